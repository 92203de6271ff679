"""The daemon's own exception hierarchy.

SDK exceptions are translated at each edge (Redis in ``buffer``, Azure in ``blobstore``) so
the rest of the code reads one attribute, ``retriable``, to decide whether to try again.
Messages say what happened and what to do next.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

#: Process exit codes: clean stop, runtime failure, bad configuration or usage, forced stop.
EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_FORCED = 0, 1, 2, 130


class SidecarError(Exception):
    """Base class for every error the daemon raises on purpose."""

    retriable: ClassVar[bool] = False
    #: Machine-readable code used when the error reaches a client as an error reply.
    code: ClassVar[str] = "internal"

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its class, message and attributes, whatever its ``__init__`` takes: an
        error raised in a worker process (a snapshot's cut) arrives with its type, message
        and keyword-only attributes (``reason``); its ``__cause__``, as any exception's, is
        not pickled."""
        return (_rebuilt, (type(self), self.args, self.__dict__), None)


def _rebuilt(cls: type[SidecarError], args: tuple[Any, ...], attrs: dict[str, Any]) -> Any:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(attrs)
    return error


class ConfigError(SidecarError):
    """Configuration is invalid; the message names the setting and the accepted values."""


class SocketInUse(SidecarError):
    """Another live process is serving the configured socket path."""


class BufferUnavailable(SidecarError):
    """Redis cannot be reached (or is refusing writes); nothing was stored. Retry later."""

    retriable = True
    code = "unavailable"


class NotReplicated(SidecarError):
    """Stored on the Redis primary, but fewer replicas than ``SIDECAR_REDIS_MIN_REPLICAS``
    confirmed it in time: a failover could lose it. Resend (safe: a stored update answers
    ``applied:false`` once replicated)."""

    retriable = True
    code = "not_durable"


class BufferRefused(BufferUnavailable):
    """Redis refused the daemon's credentials (a wrong password or user: ``WRONGPASS``, a
    password required but not given: ``NOAUTH``) or its ACL forbids a command the daemon
    needs (``NOPERM``): a configuration error, named as such in the log at ERROR. Still
    retried (at the start-up wait's cap): a password rotated in Redis before its Secret, or an
    ACL being granted, heals without a restart, and the daemon keeps exporting its metrics
    and config checks meanwhile (docs/troubleshooting.md)."""


class BufferError_(SidecarError):
    """Redis answered with an error that retrying will not fix (a bug or a misconfiguration)."""

    code = "internal"


class StoreUnavailable(SidecarError):
    """The blob store cannot be reached, timed out or answered 5xx/429; retry with backoff."""

    retriable = True
    code = "unavailable"

    def __init__(
        self, message: str, *, reason: str = "unavailable", retry_after_s: float | None = None
    ) -> None:
        """``reason``: ``timeout``, ``connection``, or the status and Azure's error code
        (``503 ServerBusy``); ``retry_after_s``: the store's ``Retry-After``, when it sent one."""
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


class StoreError(SidecarError):
    """The blob store refused a call for a reason retrying will not fix (auth, bad request)."""


class StoreRefused(StoreError):
    """The blob store refuses the daemon itself: its credentials (401/403: a wrong account
    key, an expired SAS, a role not assigned, a firewall), a token the identity library could
    not get, or the container does not exist. Nothing the daemon does will fix it: an
    operator must. ``checkpoint_sidecar_store_up`` reads 0 while it lasts
    (``BlobStore.up``)."""

    def __init__(self, message: str, *, reason: str) -> None:
        """``reason``: the status and Azure's error code (``403 AuthorizationFailure``,
        ``404 ContainerNotFound``), or ``credential`` (no token)."""
        super().__init__(message)
        self.reason = reason


class LeaseConflict(SidecarError):
    """Another owner holds the lease on a query's blob; this daemon must not write it."""

    retriable = True


class LeaseLost(SidecarError):
    """Our lease was refused (expired, broken or taken over); the write did not happen."""

    retriable = True


class VersionConflict(SidecarError):
    """A conditional write was refused: the blob is no longer the version the writer read
    (another writer changed it: a predecessor's late write, a twin, an operator) or, for a
    create, it exists already. Nothing was written; read the blob again before deciding."""

    retriable = True


class UnrecordedReset(SidecarError):
    """The query's blob holds a reset that this daemon's Redis never recorded (another daemon
    on the namespace, with its own Redis, reset it): nothing is written over it, since that
    would undo the reset. Not retriable: stop the other daemon, then reset the query here
    (``checkpoint-sidecar reset``) to the position wanted."""


class NotOwner(SidecarError):
    """Another daemon holds the lease on the query's blob: this daemon cannot make the update
    durable in the blob. It is kept in Redis; resend to the daemon that owns the query, or
    again once ownership moves (``/readyz`` and the log name the owner)."""

    retriable = True
    code = "not_owner"


class KafkaUnavailable(SidecarError):
    """The Kafka brokers cannot be reached, timed out, or answered with a transient error
    (no coordinator yet, a leader moving); the commit is retried with backoff."""

    retriable = True
    code = "unavailable"


class KafkaRefused(SidecarError):
    """The brokers refused the call for a reason retrying soon will not fix (authentication,
    ACLs on the group or topic, an invalid group id, an unusable TLS setup): fix the
    credentials, the ACLs or ``SIDECAR_KAFKA_GROUP_TEMPLATE``; it is retried at the backoff
    cap meanwhile."""


class AdminForbidden(SidecarError):
    """An admin op (``reset``, ``retire``) the daemon does not allow: off unless
    ``SIDECAR_ADMIN_OPS=true``, and on the TCP listener unless ``SIDECAR_ADMIN_OPS_TCP=true``
    too."""

    code = "forbidden"


class AdminRefused(SidecarError):
    """An admin op refused for now: the query may still be running (``force`` overrides),
    or another owner holds its blob's lease. Nothing was changed."""

    code = "conflict"


class NotFound(SidecarError):
    """No such query, or no retained checkpoint of the batch asked for."""

    code = "not_found"


class InvalidRequest(SidecarError):
    """A request that cannot be carried out as asked (e.g. explicit offsets for another number
    of sources than the query has)."""

    code = "bad_request"


#: Where a stored record lives, and what an operator can do about an unreadable one.
_RECORD_KINDS = {
    "redis": (
        "Redis record",
        "it is quarantined (left as it is: not flushed, not deleted) and every other query "
        "keeps flushing. Inspect it (HGETALL {key}); the query's next newer batch replaces "
        "it, or delete it (DEL {key}) and the query resumes from its blob",
    ),
    "blob": (
        "blob",
        "it is left as it is: the daemon never overwrites a blob it cannot read (it may be "
        "another version's). Inspect it, then restore it, or delete it: the daemon then writes "
        "the query's checkpoint from Redis again",
    ),
}


class CorruptRecord(SidecarError):
    """A stored record cannot be read: a query's Redis hash or its blob document was written
    by another version, cut short, or edited by hand. Not retriable: the record stays as it
    is until it is replaced (Redis: the query's next newer batch) or removed by an operator.

    Attributes: ``where`` ("redis" or "blob"), ``key`` (the Redis key or the blob name),
    ``problem`` (what is wrong with it, e.g. "is not a checkpoint document (…)").
    """

    #: The protocol has no code of its own for it: a ``get`` that meets one answers
    #: ``internal`` with this message, which names the record.
    code = "internal"

    def __init__(self, where: Literal["redis", "blob"], key: str, problem: str) -> None:
        what, remedy = _RECORD_KINDS[where]
        super().__init__(f"{what} {key} {problem}; {remedy.format(key=key)}")
        self.where = where
        self.key = key
        self.problem = problem
