"""The full paths Spark recorded inside a checkpoint, pointed at where it is restored. Pure.

Spark 4 records the state schema files of an operator whose metadata is version 2
(``transformWithState``, in Scala and Python) by their **full path** in that metadata,
``state/<op>/_metadata/v2/<b>``: ``stateSchemaFilePaths`` (4.0.0: ``stateSchemaFilePath``),
e.g. ``file:/data/ck/state/0/_stateSchema/default/0_<uuid>``, the checkpoint location as the
driver qualified it. A restart reads them as written — the newest metadata's list is carried
into the next batch's and every file of it opened while planning the first batch
(``IncrementalExecution``'s ``StateSchemaAndOperatorMetadataRule``,
``StateSchemaMetadata.createStateSchemaMetadata``) — so a copy in another directory fails
with ``FileNotFoundException`` once the original is gone, and while it is not, reads the
original's files. Nothing else of a checkpoint names a path.

:func:`relocate` rewrites those paths to the same files under the new location; the restore
applies it to every file :func:`recorded_paths_in` says may hold some, once the snapshot's
own checksums are verified. A path that does not name a schema file of the checkpoint
(``…/state/<op>/_stateSchema/<store>/<name>``) is left as it is.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

#: ``state/<op>/_metadata/v2/<batch>``: operator metadata v2, the files that name paths.
_METADATA_V2 = re.compile(r"state/\d+/_metadata/v2/\d+")
#: A recorded schema path: whatever the old location was, then the file's relative path.
_SCHEMA_PATH = re.compile(r"(.*)/(state/\d+/_stateSchema/[^/]+/[^/]+)")
_FIELDS = ("stateSchemaFilePaths", "stateSchemaFilePath")


def recorded_paths_in(path: str) -> bool:
    """Whether the checkpoint file ``path`` (relative, ``/``-separated) may hold full paths
    Spark recorded (operator metadata v2)."""
    return _METADATA_V2.fullmatch(path) is not None


def location_uri(directory: str) -> str:
    """The checkpoint location ``directory`` (an absolute local path) as Spark qualifies it
    and so records it: ``file:`` and the path, not percent-encoded (Hadoop's ``Path``)."""
    if not directory.startswith("/"):
        raise ValueError(f"not an absolute path: {directory!r}")
    return "file:" + (directory.rstrip("/") or "/")


def relocate(data: bytes, location: str) -> bytes:
    """``data``, operator metadata v2 (``v2``, a newline, JSON), with every schema path it
    records moved under ``location`` (a qualified checkpoint location, :func:`location_uri`);
    ``data`` itself when nothing changes.

    Raises:
        ValueError: ``data`` is not operator metadata v2 (the snapshot's checksums passed:
            the file is not Spark's).
    """
    head, newline, body = data.partition(b"\n")
    if head.strip() != b"v2" or not newline:
        raise ValueError("not Spark's operator metadata v2 ('v2' then JSON)")
    try:
        meta = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not Spark's operator metadata v2: {exc}") from exc
    stores = meta.get("stateStoreInfo") if isinstance(meta, dict) else None
    changed = False
    for store in stores if isinstance(stores, list) else ():
        if not isinstance(store, dict):
            continue
        for field in _FIELDS:
            value = store.get(field)
            if isinstance(value, str):
                store[field] = new = _moved(value, location)
                changed |= new != value
            elif isinstance(value, list):
                store[field] = moved = [_moved(v, location) for v in value]
                changed |= moved != value
    if not changed:
        return data
    return head + newline + msgspec.json.encode(meta)


def _moved(recorded: Any, location: str) -> Any:
    if not isinstance(recorded, str) or (m := _SCHEMA_PATH.fullmatch(recorded)) is None:
        return recorded
    return f"{location.rstrip('/')}/{m[2]}"
