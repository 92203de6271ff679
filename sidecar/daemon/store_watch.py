"""The blob store's health within seconds: ``checkpoint_sidecar_store_up``.

Every store call notes whether the store answered, or refused the daemon itself
(``BlobStore.up``): a failed, timed-out or refused write, renewal or read turns the gauge to
0 as it ends. A daemon with nothing to write makes few calls (a renewal every third of a
lease), so this watch pings the store (a blob's properties, ``BlobStore.ping``: one cheap
read that also tells a refused credential or a missing container) whenever no call has ended
for ``every_s`` — the write timeout. A store that stops answering therefore shows within
about two write timeouts, flushing or idle; one that answers again shows at its next call.

What readiness makes of it: nothing. ``/readyz`` means "can accept and buffer" (socket,
Redis, the instance lock, no lease held by another owner); during a store outage Redis keeps
buffering, acknowledgements go on in ``ack_mode=redis``, and the flush catches up when the
store answers. The outage is the gauge's and the alert's to show, not a reason for
Kubernetes to take the driver's pod out of service.
"""

from __future__ import annotations

import contextlib

import anyio
from anyio.abc import TaskStatus

from sidecar.errors import SidecarError
from sidecar.store.blobs import BlobStore

#: The shortest interval between pings, seconds (a very short write timeout).
MIN_EVERY_S = 1.0


class StoreWatch:
    def __init__(self, store: BlobStore, every_s: float) -> None:
        self._store = store
        self.every_s = max(MIN_EVERY_S, every_s)
        #: Pings made (tests and debugging).
        self.pings = 0

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            idle_s = anyio.current_time() - self._store.last_call_at
            if idle_s < self.every_s:
                await anyio.sleep(self.every_s - idle_s)
                continue
            self.pings += 1
            with contextlib.suppress(SidecarError):
                await self._store.ping()  # notes the outcome itself
