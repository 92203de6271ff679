"""The daemon's own exception hierarchy.

SDK exceptions are translated at each edge (Redis in ``buffer``, Azure in ``blobstore``) so
the rest of the code reads one attribute, ``retriable``, to decide whether to try again.
Messages say what happened and what to do next.
"""

from __future__ import annotations

from typing import ClassVar

#: Process exit codes: clean stop, runtime failure, bad configuration or usage, forced stop.
EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_FORCED = 0, 1, 2, 130


class SidecarError(Exception):
    """Base class for every error the daemon raises on purpose."""

    retriable: ClassVar[bool] = False
    #: Machine-readable code used when the error reaches a client as an error reply.
    code: ClassVar[str] = "internal"


class ConfigError(SidecarError):
    """Configuration is invalid; the message names the setting and the accepted values."""


class SocketInUse(SidecarError):
    """Another live process is serving the configured socket path."""


class BufferUnavailable(SidecarError):
    """Redis cannot be reached (or is refusing writes); nothing was stored. Retry later."""

    retriable = True
    code = "unavailable"


class BufferError_(SidecarError):
    """Redis answered with an error that retrying will not fix (a bug or a misconfiguration)."""

    code = "internal"


class StoreUnavailable(SidecarError):
    """The blob store cannot be reached, timed out or answered 5xx/429; retry with backoff."""

    retriable = True
    code = "unavailable"


class StoreError(SidecarError):
    """The blob store refused a call for a reason retrying will not fix (auth, bad request)."""


class LeaseConflict(SidecarError):
    """Another owner holds the lease on a query's blob; this daemon must not write it."""

    retriable = True


class LeaseLost(SidecarError):
    """Our lease was refused (expired, broken or taken over); the write did not happen."""

    retriable = True
