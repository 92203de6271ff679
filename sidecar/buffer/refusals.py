"""What Redis' "not now" refusals mean and what an operator does about them. Pure text.

The Redis edge (``redis_buffer``) names the refusal in its error, so replies, ``/readyz`` and
the log say it; ``doctor`` (``sidecar.ops.diagnosis``) adds what to do.
"""

from __future__ import annotations

MISCONF = (
    "Redis cannot persist (its last background save failed: a full or read-only disk) and "
    "refuses writes until a save succeeds"
)
LOADING = "Redis is loading its dataset after a restart (replaying its AOF or RDB)"
OOM = "Redis is at maxmemory with maxmemory-policy noeviction and refuses writes"

_FIXES = {
    MISCONF: "free disk space in (or fix the permissions of) Redis' dir, then BGSAVE; writes "
    "resume once a save succeeds (stop-writes-on-bgsave-error no gives up persistence)",
    LOADING: "wait: Redis answers once loaded (BGREWRITEAOF keeps the AOF, and this wait, short)",
    OOM: "raise maxmemory, or free memory (the namespace's records are small: look for other "
    "data in this Redis)",
}


def explain(text: str, *, loading: bool = False, oom: bool = False) -> str:
    """Redis' refusal ``text`` (its prefix maybe stripped by the client: then ``loading`` or
    ``oom`` say which) with what it means first."""
    if loading or text.startswith("LOADING"):
        return f"{LOADING} ({text})"
    if text.startswith("MISCONF"):
        return f"{MISCONF} ({text.split('.', 1)[0]})"
    if oom or text.startswith("OOM"):
        return f"{OOM} ({text})"
    return text


def fix(error: str) -> str | None:
    """What to do about an error that names one of the refusals above; None for others."""
    return next((what for refusal, what in _FIXES.items() if refusal in error), None)
