"""Decoded chunks kept per store handle, parallel chunk reads and payloads read ahead.

Store replay of a step reads its rollout's chunks again (linkage); those are
served from the handle's cache instead of being fetched, hash-checked and
decoded twice. What must hold: the values are the written ones, a new handle
checks every object again, a corrupt chunk is still an integrity error (also
when it is read on another thread), and the cache stays within its bound.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES

from trajstore.cas import LocalObjectStore, MemoryObjectStore, read_array, read_rows, write_array
from trajstore.cas.arrays import decode_chunk
from trajstore.cas.chunk_cache import BATCH, ChunkCache
from trajstore.errors import IntegrityError
from trajstore.replay.from_store import Target, replay_stored
from trajstore.store import Store

pytestmark = pytest.mark.unit

#: rows of one chunk each, more than two pool batches (the parallel path)
ROWS = 2 * BATCH + 7


class CountingStore(MemoryObjectStore):
    """Counts object fetches."""

    def __init__(self) -> None:
        super().__init__()
        self.fetched: list[str] = []

    def get(self, h: str) -> bytes:
        self.fetched.append(h)
        return super().get(h)


def _values(rows: int = ROWS) -> tuple[np.ndarray, list[int]]:
    rng = np.random.default_rng(15)
    lengths = [int(x) for x in rng.integers(5, 300, rows)]
    return rng.standard_normal(sum(lengths)).astype(np.float32), lengths


def test_parallel_read_gives_the_written_values() -> None:
    values, lengths = _values()
    objs = MemoryObjectStore()
    rec = write_array(objs, values, lengths, dtype_tag="torch.float32")
    assert np.array_equal(read_array(objs, rec), values)


def test_chunks_read_again_by_the_same_handle_are_not_fetched_again() -> None:
    values, lengths = _values()
    objs = CountingStore()
    rec = write_array(objs, values, lengths, dtype_tag="torch.float32")
    read_array(objs, rec)
    objs.fetched.clear()
    got = read_rows(objs, rec, [3, 1])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    want = np.concatenate([values[offsets[3] : offsets[4]], values[offsets[1] : offsets[2]]])
    assert np.array_equal(got, want)
    assert objs.fetched == []


def test_a_new_handle_checks_every_object_again(tmp_path: Path) -> None:
    values, lengths = _values(8)
    objs = LocalObjectStore(tmp_path, durable=False)
    rec = write_array(objs, values, lengths, dtype_tag="torch.float32")
    objs.flush()
    read_array(objs, rec)  # this handle has verified and cached them
    h = rec.chunks[2][0]
    loc = objs._index[h]
    pack = tmp_path / "packs" / f"{loc.pack}.pack"
    raw = bytearray(pack.read_bytes())
    raw[loc.offset + loc.length // 2] ^= 0xFF
    pack.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match=h):
        read_array(LocalObjectStore(tmp_path, durable=False), rec)


def test_a_corrupt_chunk_read_on_a_pool_thread_is_an_integrity_error() -> None:
    values, lengths = _values()
    objs = MemoryObjectStore()
    rec = write_array(objs, values, lengths, dtype_tag="torch.float32")
    h = rec.chunks[ROWS - 1][0]  # in the last batch
    objs.data[h] = objs.data[h][:-1] + bytes([objs.data[h][-1] ^ 0xFF])
    with pytest.raises(IntegrityError, match=h):
        read_array(objs, rec)


def test_the_cache_keeps_within_its_bound() -> None:
    values, lengths = _values()
    objs = MemoryObjectStore()
    rec = write_array(objs, values, lengths, dtype_tag="torch.float32")
    cache = ChunkCache(max_bytes=10 * rec.chunk_bytes)
    hashes = [h for row in rec.chunks for h in row if h is not None]
    got = cache.decode_many(objs, hashes, rec.chunk_bytes, decode_chunk)
    assert len(got) == len(hashes)
    assert cache._of(objs)._bytes <= 10 * rec.chunk_bytes


def test_stored_step_with_a_corrupt_chunk_fails_its_replay(tmp_path: Path) -> None:
    """The step's payloads are read ahead on threads: the error still reaches the caller."""
    root = tmp_path / "s"
    with Store.open(root) as store:
        store.ingest([FIXTURES / "example_capture_dir"], run="r1")
    with Store.open(root, create=False) as store:
        step = store.step("r1", 120, 0)[0]
        theirs = {
            h
            for ro in store.rollout("r1", 120)
            for n in ro.payload_names()
            for row in ro.record(n).chunks
            for h in row
        }
        mine = [h for row in step.record("log_probs").chunks for h in row if h is not None]
        h = next(x for x in mine if x not in theirs)
        loc = store.objs._index[h]
    pack = root / "packs" / f"{loc.pack}.pack"
    raw = bytearray(pack.read_bytes())
    raw[loc.offset + loc.length // 2] ^= 0xFF
    pack.write_bytes(bytes(raw))
    with Store.open(root, create=False) as store, pytest.raises(IntegrityError, match=h):
        replay_stored(store, Target(run="r1", step=(120, 0)))
