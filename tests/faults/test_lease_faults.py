"""Lease faults: a blob store that stops answering (calls hang and time out, never refused).

Real Azurite behind a TCP proxy that can hold every byte in both directions without closing
anything, as a black-holed network does. The daemon runs in-process with an injected lease
clock, so "the lease's validity has ended" is a step of the test, not a race with a timer.
"""

from __future__ import annotations

import anyio
import pytest
from anyio.abc import ByteStream, SocketAttribute, SocketStream, TaskStatus

from sidecar.daemon.app import Daemon
from sidecar.flush.lease import EXPIRY_MARGIN_S, RENEW_JITTER, LeaseState
from sidecar.ops.client import SidecarClient
from tests.helpers import Clock, ConfigFactory, eventually, sample, scrape
from tests.services import Azurite, azurite_connection_string
from tests.sparkshapes import kafka_progress

QID = "4b1d0c2e-0000-4000-8000-00000000d00d"
LABEL = "orders-to-delta"
HELD = "checkpoint_sidecar_lease_held"
RENEWALS = "checkpoint_sidecar_lease_renewals_total"


class StallingProxy:
    """A TCP proxy to ``127.0.0.1:upstream_port`` that passes bytes until :meth:`stall`.

    Stalled, it keeps accepting and reading but forwards nothing either way until
    :meth:`resume` (then it forwards what it held, in order): requests neither reach the
    server nor fail, so every call times out on the client's side.
    """

    def __init__(self, upstream_port: int) -> None:
        self._upstream_port = upstream_port
        self._flowing = anyio.Event()
        self._flowing.set()
        self.port = 0
        #: Chunks read and waiting for :meth:`resume` (a call is hanging in the proxy).
        self.held = 0

    def stall(self) -> None:
        if self._flowing.is_set():
            self._flowing = anyio.Event()

    def resume(self) -> None:
        self._flowing.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        async with listener:
            self.port = listener.extra(SocketAttribute.local_port)
            task_status.started()
            await listener.serve(self._connection)

    async def _connection(self, client: SocketStream) -> None:
        async with client:
            try:
                upstream = await anyio.connect_tcp("127.0.0.1", self._upstream_port)
            except OSError:
                return
            async with upstream, anyio.create_task_group() as tg:
                tg.start_soon(self._pump, client, upstream, tg.cancel_scope)
                await self._pump(upstream, client, tg.cancel_scope)

    async def _pump(self, src: ByteStream, dst: ByteStream, scope: anyio.CancelScope) -> None:
        try:
            async for chunk in src:
                if not self._flowing.is_set():
                    self.held += 1
                    try:
                        await self._flowing.wait()
                    finally:
                        self.held -= 1
                await dst.send(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        finally:
            scope.cancel()  # one side is gone: close both


async def readyz(daemon: Daemon) -> tuple[int, str]:
    return await anyio.to_thread.run_sync(scrape, daemon, "/readyz")


@pytest.mark.slow
async def test_a_lease_whose_renewal_hangs_is_lost_when_its_validity_ends_and_comes_back(
    make_config: ConfigFactory, azurite: Azurite
) -> None:
    clock = Clock(1000.0)
    async with anyio.create_task_group() as tg:
        proxy = StallingProxy(azurite.port)
        await tg.start(proxy.run)
        config = make_config(
            azure_connection_string=azurite_connection_string(proxy.port),
            count_threshold=1,
            lease_duration_s=15,
            # Longer than the steps below: the renewal still hangs when the lease lapses.
            write_timeout_s=20,
        )
        daemon = Daemon(config, lease_clock=clock)
        await tg.start(daemon.run)
        try:
            async with await SidecarClient.connect(config.socket_path) as c:
                assert (await c.progress(kafka_progress(QID, 1))).applied
            with anyio.fail_after(10):
                await daemon.flush.ack(QID, 1, None)
            assert daemon.flush.leases.state(QID) is LeaseState.HELD
            acquired = clock.now  # the lease was acquired at this (frozen) time
            valid_until = acquired + config.lease_duration_s - EXPIRY_MARGIN_S
            assert (await readyz(daemon))[0] == 200

            proxy.stall()
            # the latest a (jittered) renewal is due ...
            clock.now = acquired + daemon.flush.leases.renew_every_s * (1 + RENEW_JITTER)
            await eventually(lambda: proxy.held >= 1)  # ... and hangs in the proxy
            clock.now = valid_until - 0.1
            ticks = daemon.flush.leases.ticks
            await eventually(
                lambda: daemon.flush.leases.ticks >= ticks + 2
            )  # the loop looked: valid
            assert sample(daemon, HELD, query=LABEL) == 1
            assert (await readyz(daemon))[0] == 200

            clock.now = valid_until  # the lease may lapse now: not ours to write any more
            with anyio.fail_after(1):
                await eventually(lambda: sample(daemon, HELD, query=LABEL) == 0)
            # A store that does not answer is not a reason to be unready (Redis buffers):
            # the store's gauge says it once the hanging call times out.
            assert (await readyz(daemon)) == (200, "ready\n")
            # LOST by its own timer: the renewal neither failed nor was refused yet.
            assert sample(daemon, RENEWALS, result="error") == 0
            assert sample(daemon, RENEWALS, result="lost") == 0
            ticks = daemon.flush.leases.ticks  # the store still does not answer: still not owned
            await eventually(lambda: daemon.flush.leases.ticks >= ticks + 2)
            assert daemon.flush.leases.state(QID) is not LeaseState.HELD
            assert daemon.flush.leases.contested() == []  # nobody else holds it

            proxy.resume()
            clock.now += 60  # any retry backoff has elapsed
            await eventually(lambda: sample(daemon, HELD, query=LABEL) == 1, timeout_s=30)
            assert (await readyz(daemon)) == (200, "ready\n")
            assert sample(daemon, RENEWALS, result="lost") == 0  # timed out, never refused
            async with await SidecarClient.connect(config.socket_path) as c:
                assert (await c.progress(kafka_progress(QID, 2))).applied
            with anyio.fail_after(10):
                await daemon.flush.ack(QID, 2, None)
        finally:
            proxy.resume()
            daemon.request_stop()
            await daemon.stopped.wait()
            tg.cancel_scope.cancel()
