"""Test helpers for checkpoint snapshots: a cut copied to a directory, the way a restore
writes it (every file through the source's checked stream, the paths Spark recorded pointed
at the copy)."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import anyio
import anyio.to_thread

from sidecar.snapshot.cut import Cut
from sidecar.snapshot.relocate import location_uri, recorded_paths_in, relocate
from sidecar.snapshot.source import CheckpointSource, LocalSource


async def copy_cut(source: CheckpointSource, location: str, cut: Cut, dest: Path) -> None:
    """Write exactly ``cut``'s files under ``dest``, each read through ``source.open``, then
    point the paths Spark recorded in them at ``dest`` (as ``sidecar.snapshot.restore`` does).

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
    location = location_uri(await anyio.to_thread.run_sync(os.path.abspath, dest))
    for file in cut.files:
        if recorded_paths_in(file.path):
            target = dest / file.path
            data = await anyio.to_thread.run_sync(target.read_bytes)
            await anyio.to_thread.run_sync(target.write_bytes, relocate(data, location))


def snapshot_to(checkpoint: Path, batch: int, dest: Path) -> Cut:
    """From a sync test: the cut of ``batch`` of the checkpoint directory ``checkpoint``, its
    files copied to ``dest``."""

    async def run() -> Cut:
        source = LocalSource(checkpoint)
        cut = await source.cut("", batch)
        await copy_cut(source, "", cut, dest)
        return cut

    return anyio.run(run)
