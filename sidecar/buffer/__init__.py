"""The Redis buffer: each query's latest checkpoint and its flush bookkeeping.

Owns: every Redis key format (``keys``), the Lua scripts (``lua``), a script row read and
checked (``rows``), which Redis client a topology needs (``topology``) and the Redis edge
itself (``redis_buffer``: every call, errors translated). ``keys``, ``lua`` and ``rows`` are
pure; ``redis`` is imported only by ``redis_buffer`` and ``topology``.

May import: ``sidecar.model``, ``sidecar.config``, ``sidecar.errors``.
"""
