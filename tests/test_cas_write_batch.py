"""write_array's batched encode-cache path stores exactly the bytes of each padded window.

The writer asks the encode cache for a whole batch of windows at once and compresses a
window repeated within the batch once; these pin that the objects and records are the
same whatever the cache holds (nothing, the bytes, only the names) and equal to zstd of
each zero-padded window computed here independently.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zstandard

from trajstore.cas import LocalObjectStore, MemoryObjectStore, write_array
from trajstore.cas.arrays import ENCODE_CACHE, ZSTD_LEVEL
from trajstore.cas.lru import BytesLRU
from trajstore.cas.objects import object_hash

pytestmark = pytest.mark.unit


def _payload(routes: bool) -> tuple[np.ndarray, list[int], list[int]]:
    rng = np.random.default_rng(21)
    shape = (3, 2) if routes else ()
    w = 256 if routes else 4096
    lengths = [300, 0, 300, w + 5, 17, 300, 2 * w, 1]
    rows = [
        rng.integers(1, 200, (n, *shape)).astype(np.uint8 if routes else np.float32)
        for n in lengths
    ]
    rows[2] = rows[0].copy()  # a repeated row: the same windows within one batch
    rows[5] = np.zeros_like(rows[5])  # an all-fill row: no object
    rows[4][:3] = 0  # a window starting with zeros that is not fill
    heads = [min(n, 40) for n in lengths]
    return np.concatenate(rows), lengths, heads


def _expected(values: np.ndarray, lengths: list[int], heads: list[int] | None, w: int):
    """(row, window) -> zstd of the zero-padded window, None for an all-zero one."""
    c = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=False, write_content_size=True)
    tb = values[:1].nbytes if len(values) else 0
    flat = values.reshape(-1).view(np.uint8).tobytes()
    out, pos = [], 0
    for i, n in enumerate(lengths):
        segs = [(0, n)] if heads is None else [(0, heads[i]), (heads[i], n)]
        row = []
        for s, e in segs:
            for a in range(s, e, w):
                b = min(a + w, e)
                raw = flat[pos + a * tb : pos + b * tb].ljust(w * tb, b"\0")
                row.append(None if not any(raw) else c.compress(raw))
        out.append(row)
        pos += n * tb
    return out


@pytest.mark.parametrize("routes", [False, True])
@pytest.mark.parametrize("with_heads", [False, True])
def test_objects_equal_padded_windows_whatever_the_cache_holds(
    tmp_path: Path, routes: bool, with_heads: bool
) -> None:
    values, lengths, heads = _payload(routes)
    h = heads if with_heads else None
    ENCODE_CACHE.clear()
    stores = [LocalObjectStore(tmp_path / "cold", durable=False)]
    recs = [write_array(stores[0], values, lengths, dtype_tag="t", heads=h)]
    w = recs[0].chunk_tokens
    want = _expected(values, lengths, h, w)
    # the bytes cached; then only the names (the store already holds the objects)
    stores.append(MemoryObjectStore())
    recs.append(write_array(stores[1], values, lengths, dtype_tag="t", heads=h))
    ENCODE_CACHE._d.clear()
    recs.append(write_array(stores[0], values, lengths, dtype_tag="t", heads=h))
    assert recs[0] == recs[1] == recs[2]
    assert recs[0].to_object() == recs[2].to_object()
    for rec_row, want_row in zip(recs[0].chunks, want, strict=True):
        assert [x is None for x in rec_row] == [x is None for x in want_row]
        for name, data in zip(rec_row, want_row, strict=True):
            if name is not None:
                assert name == object_hash(data)
                assert stores[0].get(name) == data and stores[1].data[name] == data
    assert recs[0].chunks[0] == recs[0].chunks[2]  # the repeated row: the same objects


def test_bytes_lru_batch_calls_equal_one_at_a_time() -> None:
    rng = np.random.default_rng(3)
    items = [
        (int(k), bytes(int(n)))
        for k, n in zip(rng.integers(0, 40, 300), rng.integers(1, 90, 300), strict=True)
    ]
    one, many = BytesLRU(1000, item_fraction=16), BytesLRU(1000, item_fraction=16)
    for a in range(0, len(items), 37):
        batch = items[a : a + 37]
        for k, v in batch:
            one.add(k, v)
        many.add_many(batch)
        keys = [k for k, _ in batch[:9]] + [None, 999]
        assert many.get_many(keys) == [None if k is None else one.get(k) for k in keys]
        assert list(one._d.items()) == list(many._d.items()) and one._bytes == many._bytes
