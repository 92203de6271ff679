"""checkpoint-sidecar: a daemon beside each Spark driver that keeps streaming offsets safe.

Data flows one way::

    socket ─▶ protocol (validate) ─▶ server ─▶ buffer (Redis) ─▶ flusher ─▶ blob store / Kafka

Modules are named for what they own: ``protocol`` and ``checkpoint`` are pure (no I/O);
``server`` is the socket shell around the protocol; ``buffer`` owns every Redis key and
script; ``metrics`` and ``admin`` expose what is happening; ``app`` wires the components
into one task group; ``cli`` is the edge where configuration and signals come in.
"""

__version__ = "0.1.0"
