"""The daemon's errors cross a process boundary whole (the snapshot cut's worker process
raises them; sidecar/errors.py)."""

from __future__ import annotations

import pickle

import pytest

from sidecar.errors import BufferUnavailable, SidecarError
from sidecar.snapshot.cut import CutError
from sidecar.snapshot.source import FileChanged, SourceError
from sidecar.snapshot.upload import UploadError


@pytest.mark.parametrize(
    "error",
    [
        CutError("offsets/7 is missing: batch 7 is not committed", reason="not_committed"),
        FileChanged("state/0/0/3.delta was deleted while it was copied", reason="gone"),
        SourceError("/ck is not a directory", reason="unreadable"),
        UploadError("the lease was lost", reason="not_owner"),
        BufferUnavailable("Redis at localhost:6379 refused the connection"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_an_error_pickled_and_loaded_keeps_its_type_message_and_reason(
    error: SidecarError,
) -> None:
    error.add_note("in the cut's worker process")
    loaded = pickle.loads(pickle.dumps(error))
    assert type(loaded) is type(error)
    assert str(loaded) == str(error) and loaded.args == error.args
    assert getattr(loaded, "reason", None) == getattr(error, "reason", None)
    assert loaded.retriable == error.retriable
    assert loaded.__notes__ == ["in the cut's worker process"]
