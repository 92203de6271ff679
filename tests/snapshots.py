"""Test helpers for checkpoint snapshots: a cut copied to a directory, the way a restore
writes it (every file through the source's checked stream)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import anyio
import anyio.to_thread

from sidecar.snapshot.cut import Cut
from sidecar.snapshot.source import CheckpointSource, LocalSource


async def copy_cut(source: CheckpointSource, location: str, cut: Cut, dest: Path) -> None:
    """Write exactly ``cut``'s files under ``dest``, each read through ``source.open``.

    Raises:
        FileChanged: a file was gone or changed while it was copied.
    """
    for file in cut.files:
        target = dest / file.path
        await anyio.to_thread.run_sync(partial(target.parent.mkdir, parents=True, exist_ok=True))
        async with source.open(location, file.listed) as stream:
            out = await anyio.to_thread.run_sync(target.open, "wb")
            try:
                async for chunk in stream:
                    await anyio.to_thread.run_sync(out.write, chunk)
            finally:
                await anyio.to_thread.run_sync(out.close)


def snapshot_to(checkpoint: Path, batch: int, dest: Path) -> Cut:
    """From a sync test: the cut of ``batch`` of the checkpoint directory ``checkpoint``, its
    files copied to ``dest``."""

    async def run() -> Cut:
        source = LocalSource(checkpoint)
        cut = await source.cut("", batch)
        await copy_cut(source, "", cut, dest)
        return cut

    return anyio.run(run)
