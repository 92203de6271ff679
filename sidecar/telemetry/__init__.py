"""What the daemon tells the outside about itself: every Prometheus metric (``metrics``);
its log lines as text or JSON (``logs``).

Owns: metric names, labels and their closed value sets; the log formats and the JSON fields.
Components are handed the ``Metrics`` object and emit into it, and log through ``logging``
with ``key=%s`` in their messages; nothing here reads a component.

May import: ``sidecar.wire`` (error codes label the bad-request counter), ``sidecar.errors``
and ``prometheus_client``.
"""
