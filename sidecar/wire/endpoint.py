"""The TCP endpoint file: where the daemon's loopback TCP listener is, and its token. Pure.

A JVM below Java 16 has no Unix domain sockets, so the listener reaches the daemon over
loopback TCP. A loopback port is open to every process that shares the network namespace —
every container of the pod, every local user of a shared host — so the TCP listener accepts
a connection only after an ``auth`` request with the daemon's token
(:class:`sidecar.wire.protocol.ServerConnection`). The daemon draws a new token at every
start and publishes it with the port in this file, beside the socket::

    <SIDECAR_SOCKET_PATH>.tcp      e.g. /var/run/checkpoint-sidecar/sidecar.sock.tcp
    {"version":1,"host":"127.0.0.1","port":41234,"token":"…43 characters…","pid":7}

The file is readable by exactly those who may connect to the socket: its mode is the socket's
(``SIDECAR_SOCKET_MODE``) without write or execute bits for others than the owner, and it is
created in the socket's directory, so it gets the same group (the setgid ``emptyDir`` of the
pod templates). Written atomically (a new file, renamed over the old one), rewritten at every
start (a crashed daemon's file names a port nobody answers or a token nobody accepts: the
listener retries until the new one is there), removed at a clean stop.

Both ends read this module's rules: the daemon writes with :func:`encode`, clients (the CLI's
and the tests' client, ``sidecar.ops.client``) read with :func:`decode`; the JVM listener's
copy (``Endpoint.java``) is checked against it by the conformance tests.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

#: The endpoint file's name is the socket's with this suffix.
SUFFIX = ".tcp"
#: The format's version; a reader refuses others.
VERSION = 1
#: Bytes of randomness in a token (43 characters of URL-safe base64).
TOKEN_BYTES = 32
#: Largest endpoint file a reader accepts (ours are ~130 bytes).
MAX_FILE_BYTES = 4096


class EndpointError(ValueError):
    """The endpoint file is not one this version writes; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where the TCP listener is and the token it wants."""

    host: str
    port: int
    token: str
    pid: int = 0


def path_for(socket_path: str) -> str:
    """The endpoint file of the daemon serving ``socket_path``."""
    return socket_path + SUFFIX


def mode_for(socket_mode: int) -> int:
    """The endpoint file's mode: readable by whoever may connect to a socket of
    ``socket_mode`` (connecting needs its write bit), writable by the owner only."""
    readers = 0
    for shift in (6, 3, 0):  # owner, group, others
        if socket_mode & (0o2 << shift):
            readers |= 0o4 << shift
    return readers | 0o600


def new_token() -> str:
    """A fresh token (URL-safe base64 of :data:`TOKEN_BYTES` random bytes)."""
    return secrets.token_urlsafe(TOKEN_BYTES)


def encode(endpoint: Endpoint) -> bytes:
    """The endpoint file's content: one line of JSON."""
    body = {
        "version": VERSION,
        "host": endpoint.host,
        "port": endpoint.port,
        "token": endpoint.token,
        "pid": endpoint.pid,
    }
    return json.dumps(body, separators=(",", ":")).encode() + b"\n"


def decode(data: bytes) -> Endpoint:
    """Read an endpoint file's content.

    Raises:
        EndpointError: not an endpoint file of this version (the message says why).
    """
    if len(data) > MAX_FILE_BYTES:
        raise EndpointError(f"larger than {MAX_FILE_BYTES} bytes: not an endpoint file")
    try:
        body = json.loads(data)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise EndpointError(f"not JSON: {exc}") from None
    if not isinstance(body, dict) or body.get("version") != VERSION:
        raise EndpointError(f"not a version {VERSION} endpoint file")
    host, port, token, pid = (body.get(k) for k in ("host", "port", "token", "pid"))
    if not isinstance(host, str) or not host:
        raise EndpointError('"host" must be a loopback address')
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise EndpointError('"port" must be a port number')
    if not isinstance(token, str) or not token:
        raise EndpointError('"token" must be a non-empty string')
    if isinstance(pid, bool) or not isinstance(pid, int):
        pid = 0
    return Endpoint(host, port, token, pid)
