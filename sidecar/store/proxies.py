"""The HTTP proxy to the storage account, from the environment, decided once. Pure but for
reading ``os.environ``.

With aiohttp's ``trust_env`` (azure-core's default) every request looks the proxy up in the
environment and reads ``~/.netrc``, each in a worker thread: two thread hops per blob write,
~0.2 ms of a 4 ms write on a busy 2-core node (issue #22). The store turns that off and reads
the same variables itself when it makes its client: ``HTTP_PROXY`` / ``HTTPS_PROXY`` (either
case) by the account URL's scheme, unless ``NO_PROXY`` names its host. ``~/.netrc`` is not
read: the store authenticates with its connection string or its Azure identity.
"""

from __future__ import annotations

import urllib.request
from urllib.parse import urlsplit


def proxies_for(url: str) -> dict[str, str] | None:
    """``{scheme: proxy URL}`` for requests to ``url`` (azure-core's ``proxies``), or None
    when the environment names no proxy for it."""
    parts = urlsplit(url)
    found = urllib.request.getproxies_environment()
    proxy = found.get(parts.scheme)
    if not proxy or urllib.request.proxy_bypass(parts.hostname or ""):
        return None
    return {parts.scheme: proxy}


def shown(proxy: str) -> str:
    """A proxy URL for a log line: its credentials left out."""
    parts = urlsplit(proxy)
    return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")
