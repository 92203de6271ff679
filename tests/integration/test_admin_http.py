"""The admin endpoint's HTTP, against a real daemon (Redis, Azurite): what a probe, a
Prometheus scrape and a confused client get. The responder is h11 over anyio streams
(``sidecar.daemon.http``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import anyio
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from sidecar.daemon.http import RENDER_SWITCH_INTERVAL_S
from tests.helpers import ConfigFactory, running_daemon


async def exchange(port: int, raw: bytes) -> bytes:
    """Send ``raw`` on one connection and read until the server closes it."""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(raw)
        chunks = []
        with anyio.fail_after(10):
            try:
                while True:
                    chunks.append(await stream.receive())
            except anyio.EndOfStream:
                pass
    return b"".join(chunks)


async def test_probes_scrape_and_keep_alive_then_errors_are_answered(
    make_config: ConfigFactory,
) -> None:
    config = make_config()
    async with running_daemon(config) as daemon:
        port = daemon.admin.port
        assert port is not None
        # Two requests on one connection (keep-alive), the second asking to close.
        both = await exchange(
            port,
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
            b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        first, second = both.split(b"HTTP/1.1 ")[1:]
        assert first.startswith(b"200 ") and first.endswith(b"\r\n\r\nok\n")
        assert second.startswith(b"200 ") and second.endswith(b"\r\n\r\nready\n")

        scrape = await exchange(port, b"GET /metrics HTTP/1.0\r\n\r\n")
        head, _, body = scrape.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert f"Content-Type: {CONTENT_TYPE_LATEST}".encode() in head
        names = {f.name for f in text_string_to_metric_families(body.decode())}
        assert "checkpoint_sidecar_updates" in names

        missing = await exchange(port, b"GET /nope HTTP/1.0\r\n\r\n")
        assert missing.startswith(b"HTTP/1.1 404 Not Found\r\n") and b"/readyz" in missing
        post = await exchange(port, b"POST /readyz HTTP/1.0\r\nContent-Length: 2\r\n\r\nhi")
        assert post.startswith(b"HTTP/1.1 405 ")
        garbage = await exchange(port, b"\x16\x03\x01 not http at all\r\n\r\n")
        assert garbage.startswith(b"HTTP/1.1 400 ") and b"bad request" in garbage
        # ... and the endpoint still answers afterwards.
        again = await exchange(port, b"GET /healthz HTTP/1.0\r\n\r\n")
        assert again.startswith(b"HTTP/1.1 200 ")


async def test_a_failing_readiness_check_is_a_500_and_the_daemon_goes_on(
    make_config: ConfigFactory,
) -> None:
    """A bug in a check (or a collector) is answered and logged, never the daemon's end."""
    config = make_config()
    async with running_daemon(config) as daemon:
        port = daemon.admin.port
        assert port is not None

        async def broken() -> str | None:
            raise RuntimeError("a bug in a readiness check")

        daemon.admin._checks.append(broken)
        failed = await exchange(port, b"GET /readyz HTTP/1.0\r\n\r\n")
        assert failed.startswith(b"HTTP/1.1 500 ") and b"internal error" in failed
        daemon.admin._checks.remove(broken)
        ready = await exchange(port, b"GET /readyz HTTP/1.0\r\n\r\n")
        assert ready.startswith(b"HTTP/1.1 200 ") and ready.endswith(b"ready\n")


async def test_a_scrape_renders_with_short_gil_switches_and_restores_them(
    make_config: ConfigFactory,
) -> None:
    # The page renders in a worker thread; meanwhile the GIL changes hands every 0.5 ms, so
    # the event loop never waits 5 ms for it at each wake-up. Python's interval comes back.
    seen: list[float] = []

    class Spy(Collector):
        def collect(self) -> Iterator[Metric]:
            seen.append(sys.getswitchinterval())
            yield GaugeMetricFamily("spy", "the switch interval during a render", value=1)

    before = sys.getswitchinterval()
    async with running_daemon(make_config()) as daemon:
        daemon.metrics.registry.register(Spy())
        port = daemon.admin.port
        assert port is not None
        for _ in range(2):
            answer = await exchange(
                port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
            assert b"\r\n\r\n" in answer and b"\nspy 1.0\n" in answer
            assert sys.getswitchinterval() == before
    assert seen == [RENDER_SWITCH_INTERVAL_S] * 2 and before > RENDER_SWITCH_INTERVAL_S
