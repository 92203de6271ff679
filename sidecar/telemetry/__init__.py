"""What the daemon tells the outside about itself: every Prometheus metric (``metrics``).

Owns: metric names, labels and their closed value sets. Components are handed the
``Metrics`` object and emit into it; nothing here reads a component.

May import: ``sidecar.wire`` (error codes label the bad-request counter), ``sidecar.errors``
and ``prometheus_client``.
"""
