"""The records the sidecar keeps, as values: pure, no I/O, no event loop, no SDK.

Owns: the checkpoint record built from Spark's progress (``checkpoint``), the blob document
with its history and reset record (``document``), source offset shapes and what is derived
from them (``offsets``), when the positions written for other tools (Kafka groups, Event
Hubs checkpoints) may move and when back (``positions``), JSON kept as the client's text
(``rawjson``), Spark's own checkpoint directory format (``spark_dir``), and what a restore
did (``restored``).

May import: ``sidecar.errors`` and ``msgspec``; nothing else of the sidecar.
"""
