"""The packer's own logic (which contents go up, where each lands, retries) with a recording
store; tests/integration/test_snapshot_store.py runs the same path in the source's worker
process against Azurite, through the HTTP fault proxy."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from sidecar.backoff import Backoff
from sidecar.errors import StoreUnavailable, VersionConflict
from sidecar.snapshot import stored
from sidecar.snapshot.cut import ListedFile
from sidecar.snapshot.index import parse_pack_name
from sidecar.snapshot.packer import PackJob, SmallFile, pack_files
from sidecar.snapshot.source import FileChanged

NS, QUERY = "ns", "q-1"


@dataclass
class Recorder:
    """A store that keeps what is put, failing the first ``fail`` tries with ``error``."""

    blobs: dict[str, bytes] = field(default_factory=dict)
    fail: int = 0
    error: Exception = field(default_factory=lambda: StoreUnavailable("busy", reason="503"))
    tries: int = 0

    def put(self, name: str, body: bytes, count: Callable[[str], None]) -> str:
        self.tries += 1
        count("put")
        if self.tries <= self.fail:
            raise self.error
        if name in self.blobs:
            raise VersionConflict(name)
        self.blobs[name] = body
        return f'"v{self.tries}"'


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stored, "_schedule", Backoff(0.001, 0.001))


def files(*bodies: bytes) -> tuple[list[ListedFile], Callable[[ListedFile], SmallFile]]:
    listed = [ListedFile(f"f{i}", len(b), f"s{i}") for i, b in enumerate(bodies)]
    by_path = {f.path: b for f, b in zip(listed, bodies, strict=True)}

    def read(file: ListedFile) -> SmallFile:
        data = by_path[file.path]
        return SmallFile(hashlib.sha256(data).digest(), None, data)

    return listed, read


def job(listed: list[ListedFile], blobs: Recorder, *, known: frozenset[bytes] = frozenset(),
        target: int = 1_000_000, attempts: int = 4) -> PackJob:  # fmt: skip
    return PackJob(listed, known, blobs, NS, QUERY, target, attempts)


def test_new_contents_are_packed_once_and_placed_where_their_bytes_are() -> None:
    a, b, c = b"a" * 40, b"b" * 40, b"c" * 40
    listed, read = files(a, b, a, c)  # a twice
    blobs = Recorder()
    known = frozenset({hashlib.sha256(c).digest()})
    packed = pack_files(read, job(listed, blobs, known=known, target=70))

    # a and b fill the first pack past 70 bytes; the second a and the known c are not sent.
    assert [f.placed is not None for f in packed.files] == [True, True, False, False]
    assert [f.sha256 for f in packed.files] == [hashlib.sha256(x).digest() for x in (a, b, a, c)]
    assert len(blobs.blobs) == 1 and list(packed.packs.values()) == [80]
    (name, body), = blobs.blobs.items()  # fmt: skip
    assert parse_pack_name(name) in packed.packs
    for f, data in zip(packed.files[:2], (a, b), strict=True):
        assert f.placed is not None
        pack, offset = f.placed
        assert pack == parse_pack_name(name)
        assert body[offset : offset + len(data)] == data
    assert packed.sent.requests == {"put": 1} and not packed.sent.failures


def test_a_pack_is_sealed_at_its_target_and_the_rest_goes_up_at_the_end() -> None:
    listed, read = files(b"x" * 50, b"y" * 50, b"z" * 10)
    blobs = Recorder()
    packed = pack_files(read, job(listed, blobs, target=50))
    assert sorted(packed.packs.values()) == [10, 50, 50]
    assert sorted(len(b) for b in blobs.blobs.values()) == [10, 50, 50]
    assert len({f.placed[0] for f in packed.files if f.placed}) == 3


def test_nothing_new_sends_nothing() -> None:
    listed, read = files(b"k" * 5)
    blobs = Recorder()
    known = frozenset({hashlib.sha256(b"k" * 5).digest()})
    packed = pack_files(read, job(listed, blobs, known=known))
    assert packed.packs == {} and blobs.tries == 0 and packed.files[0].placed is None


def test_a_failing_put_is_retried_and_said() -> None:
    listed, read = files(b"r" * 30)
    blobs = Recorder(fail=2)
    packed = pack_files(read, job(listed, blobs))
    assert blobs.tries == 3 and len(blobs.blobs) == 1
    assert packed.sent.requests == {"put": 3}
    assert packed.sent.failures == ["503", "503"]
    assert [level for level, _ in packed.sent.said] == [logging.WARNING] * 2
    assert "attempt=1 of=4" in packed.sent.said[0][1]


def test_a_put_that_landed_at_an_earlier_send_counts_as_written() -> None:
    listed, read = files(b"l" * 30)
    blobs = Recorder()
    original = blobs.put

    def lost_answer(name: str, body: bytes, count: Callable[[str], None]) -> str:
        original(name, body, count)  # it lands, the answer is lost
        if blobs.tries == 1:
            raise StoreUnavailable("connection reset", reason="connection")
        return "unused"

    blobs.put = lost_answer  # type: ignore[method-assign]
    packed = pack_files(read, job(listed, blobs))
    assert list(packed.packs.values()) == [30] and len(blobs.blobs) == 1
    assert packed.sent.said[-1] == (
        logging.INFO,
        f"snapshot blob landed at an earlier send: blob={next(iter(blobs.blobs))}",
    )


def test_a_store_still_failing_after_the_attempts_fails_the_job_with_what_it_sent() -> None:
    listed, read = files(b"f" * 30)
    blobs = Recorder(fail=10)
    packed = pack_files(read, job(listed, blobs, attempts=3))
    assert isinstance(packed.error, StoreUnavailable)
    assert blobs.tries == 3 and not blobs.blobs and packed.packs == {}
    assert packed.sent.requests == {"put": 3} and packed.sent.failures == ["503"] * 3


def test_a_file_changed_under_the_job_fails_it_after_the_packs_before() -> None:
    listed, read = files(b"1" * 60, b"2" * 10)

    def changed(file: ListedFile) -> SmallFile:
        if file.path == "f1":
            raise FileChanged(f"{file.path} changed", reason="changed")
        return read(file)

    blobs = Recorder()
    packed = pack_files(changed, job(listed, blobs, target=50))
    assert isinstance(packed.error, FileChanged)
    assert list(packed.packs.values()) == [60] and len(blobs.blobs) == 1  # an orphan, pruned
