"""Content-addressed object space and payload arrays (trajstore.cas)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import zstandard

from trajstore.cas import (
    ArrayRecord,
    LocalObjectStore,
    MemoryObjectStore,
    load_record,
    object_hash,
    read_array,
    read_rows,
    record_objects,
    write_array,
)
from trajstore.cas.arrays import decode_chunks
from trajstore.errors import IntegrityError, NotFoundError, StoreError, UsageError

pytestmark = pytest.mark.unit


def _store(root: Path, **kw) -> LocalObjectStore:
    return LocalObjectStore(root, durable=False, **kw)


def _disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _flip_byte(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))


def _ragged(rng: np.random.Generator, rows: int, lo: int = 1, hi: int = 2500) -> list[int]:
    return [int(x) for x in rng.integers(lo, hi, rows)]


class CountingStore(MemoryObjectStore):
    """Counts object reads, to check which chunks a read fetches."""

    def __init__(self) -> None:
        super().__init__()
        self.fetched: list[str] = []

    def get(self, h: str) -> bytes:
        self.fetched.append(h)
        return super().get(h)


# --- object space ---------------------------------------------------------


def test_put_get_round_trip_small_and_large(tmp_path: Path) -> None:
    objs = _store(tmp_path, pack_threshold=1024)
    small, large = b"hello", os.urandom(5000)
    hs, hl = objs.put(small), objs.put(large)
    assert hs == object_hash(small) and objs.get(hs) == small  # readable before flush
    objs.flush()
    assert objs.get(hs) == small and objs.get(hl) == large
    assert (tmp_path / "objects" / hl[:2] / hl).is_file()
    assert len(list((tmp_path / "packs").glob("*.idx"))) == 1


def test_put_is_write_if_absent(tmp_path: Path) -> None:
    objs = _store(tmp_path, pack_threshold=1024)
    data, big = os.urandom(100), os.urandom(4096)
    objs.put_many([data, big])
    objs.flush()
    before = _disk_bytes(tmp_path)
    reopened = _store(tmp_path, pack_threshold=1024)
    assert reopened.put(data) == objs.put(data)
    reopened.put(big)
    reopened.flush()
    objs.flush()
    assert _disk_bytes(tmp_path) == before
    assert sorted(i.hash for i in reopened.iter_objects()) == sorted(
        [object_hash(data), object_hash(big)]
    )


def test_missing_object_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="0" * 64):
        _store(tmp_path).get("0" * 64)


def test_non_hash_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="not an object hash"):
        _store(tmp_path).get("../../etc/passwd")


def test_flipped_byte_in_pack_is_integrity_error(tmp_path: Path) -> None:
    objs = _store(tmp_path)
    h = objs.put(b"x" * 100)
    objs.flush()
    (pack,) = (tmp_path / "packs").glob("*.pack")
    _flip_byte(pack, 8 + 50)
    fresh = _store(tmp_path)
    with pytest.raises(IntegrityError, match=h):
        fresh.get(h)
    with pytest.raises(IntegrityError, match=h):
        fresh.verify(h)
    with pytest.raises(IntegrityError, match=h):  # read alone in its pack run, batched
        _store(tmp_path).get_many([h])


def test_flipped_byte_in_loose_object_is_integrity_error(tmp_path: Path) -> None:
    objs = _store(tmp_path, pack_threshold=16)
    h = objs.put(b"y" * 100)
    _flip_byte(tmp_path / "objects" / h[:2] / h, 3)
    with pytest.raises(IntegrityError, match=h):
        objs.get(h)
    with pytest.raises(IntegrityError, match=h):
        objs.verify(h)


def test_objects_from_another_writer_become_visible(tmp_path: Path) -> None:
    reader = _store(tmp_path)
    writer = _store(tmp_path, pack_threshold=64)
    small, large = writer.put(b"s" * 10), writer.put(b"L" * 100)
    writer.flush()
    assert reader.has(small) and reader.has(large)
    assert reader.get(small) == b"s" * 10 and reader.get(large) == b"L" * 100


def test_pack_without_index_is_invisible(tmp_path: Path) -> None:
    objs = _store(tmp_path)
    h = objs.put(b"z" * 10)
    objs.flush()
    (idx,) = (tmp_path / "packs").glob("*.idx")
    idx.unlink()
    fresh = _store(tmp_path)
    assert not fresh.has(h)
    assert list(fresh.iter_objects()) == []


def test_corrupt_index_hides_its_pack(tmp_path: Path) -> None:
    objs = _store(tmp_path)
    h = objs.put(b"q" * 10)
    objs.flush()
    (idx,) = (tmp_path / "packs").glob("*.idx")
    _flip_byte(idx, 20)
    fresh = _store(tmp_path)
    assert fresh.corrupt_indexes == [idx]
    with pytest.raises(NotFoundError, match=h):
        fresh.get(h)


def test_store_root_that_is_a_file_is_store_error(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(StoreError):
        LocalObjectStore(tmp_path / "f")


def test_context_manager_seals_a_pack(tmp_path: Path) -> None:
    with _store(tmp_path) as objs:
        h = objs.put(b"ctx")
    assert _store(tmp_path).get(h) == b"ctx"


def test_delete_many_removes_packed_and_loose_copies(tmp_path: Path) -> None:
    objs = _store(tmp_path, pack_threshold=64)
    a, b, big = objs.put(b"a"), objs.put(b"b"), objs.put(b"B" * 100)
    objs.flush()
    assert objs.delete_many([a, big]) == 2
    assert objs.get(b) == b"b"
    fresh = _store(tmp_path)
    assert not fresh.has(a) and not fresh.has(big) and fresh.has(b)


def test_repack_drops_only_unkept_old_objects(tmp_path: Path) -> None:
    objs = _store(tmp_path, pack_threshold=64)
    keep_h, drop_h = objs.put(b"keep"), objs.put(b"drop")
    drop_loose = objs.put(b"D" * 100)
    objs.flush()
    old = time.time() - 3600
    for p in [*(tmp_path / "packs").iterdir(), tmp_path / "objects" / drop_loose[:2] / drop_loose]:
        os.utime(p, (old, old))
    young = objs.put(b"young")
    objs.flush()
    kept = {keep_h}
    result = objs.repack(lambda h: h in kept, older_than=600)
    assert result.objects_dropped == 2
    fresh = _store(tmp_path)
    assert fresh.get(keep_h) == b"keep" and fresh.get(young) == b"young"
    assert not fresh.has(drop_h) and not fresh.has(drop_loose)


def test_repack_keeps_everything_within_grace(tmp_path: Path) -> None:
    objs = _store(tmp_path)
    h = objs.put(b"fresh")
    objs.flush()
    assert objs.repack(lambda _h: False, older_than=600).objects_dropped == 0
    assert _store(tmp_path).get(h) == b"fresh"


def test_repack_removes_old_orphan_pack(tmp_path: Path) -> None:
    objs = _store(tmp_path)
    objs.put(b"orphan")
    objs.flush()
    (idx,) = (tmp_path / "packs").glob("*.idx")
    idx.unlink()
    (pack,) = (tmp_path / "packs").glob("*.pack")
    os.utime(pack, (0, 0))
    assert objs.repack(lambda _h: True, older_than=600).files_removed == 1
    assert not pack.exists()


# --- payload arrays --------------------------------------------------------

_DTYPES = [
    "float16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "bool",
]


@pytest.mark.parametrize("dtype", _DTYPES)
def test_array_round_trip_every_dtype(tmp_path: Path, dtype: str) -> None:
    rng = np.random.default_rng(1)
    lengths = _ragged(rng, 9)
    raw = rng.integers(0, 256, sum(lengths) * np.dtype(dtype).itemsize, dtype=np.uint8)
    values = raw.view(np.uint8 if dtype == "bool" else dtype)
    values = (raw & 1).astype(bool) if dtype == "bool" else values
    objs = _store(tmp_path)
    rec = write_array(objs, values, lengths, dtype_tag=f"torch.{dtype}")
    objs.flush()
    back = read_array(_store(tmp_path), rec)
    assert back.dtype == values.dtype and back.tobytes() == values.tobytes()


def test_bfloat16_bits_round_trip_with_tag(tmp_path: Path) -> None:
    bits = np.random.default_rng(2).integers(0, 1 << 16, 3000, dtype=np.uint16)
    objs = _store(tmp_path)
    rec = write_array(objs, bits, [1000, 2000], dtype_tag="torch.bfloat16")
    assert rec.dtype_tag == "torch.bfloat16" and rec.dtype == "uint16"
    assert np.array_equal(read_array(objs, rec), bits)


def test_bfloat16_tag_requires_uint16_bits(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="uint16"):
        write_array(_store(tmp_path), np.zeros(4, np.float32), [4], dtype_tag="torch.bfloat16")


def test_float_negative_zero_and_nan_bits_survive(tmp_path: Path) -> None:
    values = np.array([-0.0, np.nan, 0.0, -np.inf], dtype=np.float32)
    values[1] = np.frombuffer(b"\x01\x00\xc0\x7f", np.float32)[0]  # a NaN payload
    objs = _store(tmp_path)
    assert (
        read_array(objs, write_array(objs, values, [4], dtype_tag="t")).tobytes()
        == values.tobytes()
    )


def test_route_array_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    lengths = _ragged(rng, 6, hi=700)
    routes = rng.integers(0, 128, (sum(lengths), 4, 8), dtype=np.uint8)
    objs = _store(tmp_path)
    rec = write_array(objs, routes, lengths, dtype_tag="torch.uint8")
    assert rec.shape == (6, max(lengths), 4, 8) and rec.chunk_tokens == 256
    back = read_array(objs, rec)
    assert back.shape == routes.shape and np.array_equal(back, routes)


def test_row_lengths_must_cover_the_tokens(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="sum"):
        write_array(_store(tmp_path), np.zeros(10, np.float32), [3, 3], dtype_tag="t")


def test_same_values_give_identical_record(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    lengths = _ragged(rng, 5)
    values = rng.standard_normal(sum(lengths)).astype(np.float32)
    objs = _store(tmp_path)
    a = write_array(objs, values, lengths, dtype_tag="torch.float32", attributes={"name": "lp"})
    b = write_array(
        objs, values.copy(), lengths, dtype_tag="torch.float32", attributes={"name": "lp"}
    )
    assert a == b and a.to_json() == b.to_json()
    assert ArrayRecord.from_json(a.to_json()) == a


def test_subset_in_reverse_order_adds_only_metadata(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    lengths = _ragged(rng, 128)
    values = rng.standard_normal(sum(lengths)).astype(np.float32)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    objs = _store(tmp_path)
    write_array(objs, values, lengths, dtype_tag="torch.float32")
    objs.flush()
    before = {i.hash for i in objs.iter_objects()}
    subset = list(range(0, 128, 4))[::-1]
    sub_values = np.concatenate([values[offsets[i] : offsets[i + 1]] for i in subset])
    rec = write_array(objs, sub_values, [lengths[i] for i in subset], dtype_tag="torch.float32")
    objs.flush()
    added = {i.hash for i in objs.iter_objects()} - before
    assert added == {rec.meta}
    assert np.array_equal(read_array(objs, rec), sub_values)


def test_all_zero_payload_stores_no_chunks(tmp_path: Path) -> None:
    objs = _store(tmp_path)
    rec = write_array(objs, np.zeros(5000, np.float32), [2500, 2500], dtype_tag="torch.float32")
    objs.flush()
    assert all(h is None for row in rec.chunks for h in row)
    assert {i.hash for i in objs.iter_objects()} == {rec.meta}
    assert np.array_equal(read_array(objs, rec), np.zeros(5000, np.float32))


def test_read_rows_fetches_only_selected_rows(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    lengths = _ragged(rng, 20, lo=1500)
    values = rng.standard_normal(sum(lengths)).astype(np.float32)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    objs = CountingStore()
    rec = write_array(objs, values, lengths, dtype_tag="torch.float32")
    objs.fetched.clear()
    rows = [7, 2]
    got = read_rows(objs, rec, rows)
    want = np.concatenate([values[offsets[r] : offsets[r + 1]] for r in rows])
    assert np.array_equal(got, want)
    assert sorted(objs.fetched) == sorted(h for r in rows for h in rec.chunks[r])


def test_read_rows_out_of_range_is_usage_error(tmp_path: Path) -> None:
    objs = _store(tmp_path)
    rec = write_array(objs, np.ones(3, np.float32), [3], dtype_tag="t")
    with pytest.raises(UsageError, match="row 1"):
        read_rows(objs, rec, [1])


def test_corrupt_chunk_read_is_integrity_error(tmp_path: Path) -> None:
    objs = MemoryObjectStore()
    rec = write_array(objs, np.arange(100, dtype=np.int32), [100], dtype_tag="t")
    h = rec.chunks[0][0]
    objs.data[h] = objs.data[h][:-1] + b"\0"
    with pytest.raises(IntegrityError, match=h):
        read_array(objs, rec)


def test_chunk_larger_than_declared_is_refused(tmp_path: Path) -> None:
    objs = MemoryObjectStore()
    rec = write_array(objs, np.arange(100, dtype=np.int32), [100], dtype_tag="t")
    bomb = objs.put(zstandard.ZstdCompressor().compress(bytes(1 << 20)))
    forged = ArrayRecord.from_dict({**rec.to_dict(), "chunks": [[bomb]]})
    with pytest.raises(IntegrityError, match=bomb):
        read_array(objs, forged)


def test_decode_chunks_gives_what_decode_chunk_gives_each() -> None:
    c = zstandard.ZstdCompressor(write_content_size=True)
    raws = [os.urandom(100) + bytes(924), bytes(1024), os.urandom(1024)]
    got = decode_chunks([c.compress(r) for r in raws], 1024, ["a", "b", "c"])
    assert [bytes(v) for v in got] == raws


@pytest.mark.parametrize("size", [1000, 1 << 20])
def test_decode_chunks_names_the_chunk_of_the_wrong_size(size: int) -> None:
    # A frame shorter or longer than the window (a bomb) is refused, never allocated.
    c = zstandard.ZstdCompressor(write_content_size=True)
    frames = [c.compress(bytes(1024)), c.compress(bytes(size))]
    with pytest.raises(IntegrityError, match="chunk object bad "):
        decode_chunks(frames, 1024, ["good", "bad"])


def test_record_with_insane_sizes_is_refused() -> None:
    rec = write_array(MemoryObjectStore(), np.ones(3, np.float32), [3], dtype_tag="t")
    d = rec.to_dict()
    with pytest.raises(IntegrityError, match="invalid"):
        ArrayRecord.from_dict({**d, "shape": [1, 3, 1 << 30, 1 << 30]})
    with pytest.raises(IntegrityError, match="invalid"):
        ArrayRecord.from_dict({**d, "row_lengths": [5]})


def _routes_pair(rng: np.random.Generator, frac: float) -> tuple[list[int], np.ndarray, np.ndarray]:
    lengths = _ragged(rng, 16, lo=200, hi=1200)
    rollout = rng.integers(0, 128, (sum(lengths), 8, 4), dtype=np.uint8)
    train = rollout.copy()
    flip = rng.random(train.shape[:2]) < frac  # (token, layer) pairs that route differently
    train[flip, 0] = (train[flip, 0] + 1) % 128
    return lengths, rollout, train


def _stored_bytes(objs: MemoryObjectStore, rec: ArrayRecord) -> int:
    return sum(len(objs.data[h]) for row in rec.chunks for h in row if h is not None)


def test_delta_equal_to_base_costs_almost_nothing() -> None:
    lengths, rollout, _ = _routes_pair(np.random.default_rng(7), 0.0)
    objs = MemoryObjectStore()
    base = write_array(objs, rollout, lengths, dtype_tag="torch.uint8")
    delta = write_array(objs, rollout.copy(), lengths, dtype_tag="torch.uint8", base=base)
    assert delta.base is not None
    assert _stored_bytes(objs, delta) + len(objs.data[delta.meta]) < 0.01 * _stored_bytes(
        objs, base
    )
    assert np.array_equal(read_array(objs, delta), rollout)


def test_delta_with_18_percent_flips_is_cheap_and_exact() -> None:
    lengths, rollout, train = _routes_pair(np.random.default_rng(8), 0.18)
    objs = MemoryObjectStore()
    base = write_array(objs, rollout, lengths, dtype_tag="torch.uint8")
    delta = write_array(objs, train, lengths, dtype_tag="torch.uint8", base=base)
    assert _stored_bytes(objs, delta) < 0.5 * _stored_bytes(objs, base)
    assert np.array_equal(read_array(objs, delta), train)
    want = np.concatenate(_rows(train, lengths, [3, 0]))
    assert np.array_equal(read_rows(objs, delta, [3, 0]), want)
    assert base.meta in record_objects(objs, delta)
    assert load_record(objs, delta.base) == base


def _rows(values: np.ndarray, lengths: Sequence[int], rows: Sequence[int]) -> list[np.ndarray]:
    off = np.concatenate([[0], np.cumsum(lengths)])
    return [values[off[r] : off[r + 1]] for r in rows]


def test_delta_base_must_match_geometry() -> None:
    objs = MemoryObjectStore()
    base = write_array(objs, np.ones(10, np.float32), [10], dtype_tag="t")
    with pytest.raises(UsageError, match="same dtype"):
        write_array(objs, np.ones(10, np.float32), [5, 5], dtype_tag="t", base=base)


# --- zarr-python interop ---------------------------------------------------


def _zarr_chunks(values2d: np.ndarray, w: int) -> dict[str, bytes]:
    import zarr
    from zarr.codecs import BytesCodec, ZstdCodec
    from zarr.storage import MemoryStore

    store = MemoryStore()
    z = zarr.create_array(
        store=store,
        shape=values2d.shape,
        chunks=(1, w, *values2d.shape[2:]),
        dtype=values2d.dtype,
        fill_value=0,
        serializer=BytesCodec(endian="little"),
        compressors=[ZstdCodec(level=3, checksum=False)],
        filters=None,
    )
    z[...] = values2d
    return {k: v.to_bytes() for k, v in store._store_dict.items() if k.startswith("c/")}


def _padded(values: np.ndarray, lengths: Sequence[int]) -> np.ndarray:
    out = np.zeros((len(lengths), max(lengths), *values.shape[1:]), values.dtype)
    for i, row in enumerate(_rows(values, lengths, range(len(lengths)))):
        out[i, : len(row)] = row
    return out


@pytest.mark.parametrize("kind", ["float32", "routes"])
def test_chunk_bytes_equal_zarr_python(kind: str) -> None:
    rng = np.random.default_rng(9)
    lengths = _ragged(rng, 5, hi=2100 if kind == "float32" else 600)
    if kind == "float32":
        values = rng.standard_normal(sum(lengths)).astype(np.float32)
    else:
        values = rng.integers(1, 128, (sum(lengths), 3, 2), dtype=np.uint8)
    objs = MemoryObjectStore()
    rec = write_array(objs, values, lengths, dtype_tag="t")
    tail = "/0" * (values.ndim - 1)
    ours = {
        f"c/{i}/{j}{tail}": objs.data[h]
        for i, row in enumerate(rec.chunks)
        for j, h in enumerate(row)
        if h is not None
    }
    assert ours == _zarr_chunks(_padded(values, lengths), rec.chunk_tokens)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "routes", "delta"])
def test_stock_zarr_open_array_reads_equal_values(kind: str) -> None:
    import zarr

    from trajstore.cas import CASZarrStore

    rng = np.random.default_rng(10)
    lengths = _ragged(rng, 7, hi=1500)
    objs = MemoryObjectStore()
    if kind == "float32":
        values = rng.standard_normal(sum(lengths)).astype(np.float32)
        rec = write_array(objs, values, lengths, dtype_tag="torch.float32")
    elif kind == "bfloat16":
        values = rng.integers(0, 1 << 16, sum(lengths), dtype=np.uint16)
        rec = write_array(objs, values, lengths, dtype_tag="torch.bfloat16")
    else:
        base_v = rng.integers(0, 64, (sum(lengths), 3, 2), dtype=np.uint8)
        values = base_v.copy()
        values[::7, 1, 0] += 1
        rec = write_array(objs, base_v, lengths, dtype_tag="torch.uint8")
        if kind == "delta":
            rec = write_array(objs, values, lengths, dtype_tag="torch.uint8", base=rec)
        else:
            values = base_v
    store = CASZarrStore(objs, {"payload": rec})
    z = zarr.open_array(store=store, path="payload", mode="r")
    assert z.attrs["trajstore"]["row_lengths"] == lengths
    padded = z[:]
    assert padded.dtype == values.dtype and padded.tobytes() == _padded(values, lengths).tobytes()
    assert np.array_equal(z[2, : lengths[2]], _rows(values, lengths, [2])[0])


def test_zarr_store_refuses_writes() -> None:
    import zarr

    from trajstore.cas import CASZarrStore

    objs = MemoryObjectStore()
    rec = write_array(objs, np.ones(10, np.float32), [10], dtype_tag="t")
    store = CASZarrStore(objs, {"x": rec})
    with pytest.raises((StoreError, ValueError)):
        zarr.create_array(store=store, name="y", shape=(2,), dtype="f4")
    z = zarr.open_array(store=store, path="x", mode="r")
    with pytest.raises((StoreError, ValueError)):
        z[0, 0] = 5.0


def test_zarr_store_lists_arrays() -> None:
    import zarr

    from trajstore.cas import CASZarrStore

    objs = MemoryObjectStore()
    a = write_array(objs, np.ones(10, np.float32), [10], dtype_tag="t")
    g = zarr.open_group(store=CASZarrStore(objs, {"a": a, "b": a}), mode="r")
    assert sorted(g.array_keys()) == ["a", "b"]


def test_threads_write_arrays_into_one_store(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(11)
    payloads = [rng.standard_normal(3000).astype(np.float32) for _ in range(8)]
    objs = _store(tmp_path)
    with ThreadPoolExecutor(4) as pool:
        recs = list(pool.map(lambda v: write_array(objs, v, [1000, 2000], dtype_tag="t"), payloads))
    objs.flush()
    fresh = _store(tmp_path)
    assert all(np.array_equal(read_array(fresh, r), v) for r, v in zip(recs, payloads, strict=True))


def test_delta_with_base_values_in_memory_equals_read_back(tmp_path: Path) -> None:
    rng = np.random.default_rng(12)
    lengths = _ragged(rng, 6, hi=700)
    rollout = rng.integers(0, 128, (sum(lengths), 4, 8), dtype=np.uint8)
    train = rollout.copy()
    train[::5, 1, 0] ^= 3
    objs = _store(tmp_path)
    base = write_array(objs, rollout, lengths, dtype_tag="torch.uint8")
    from_store = write_array(objs, train, lengths, dtype_tag="torch.uint8", base=base)
    in_memory = write_array(
        objs, train, lengths, dtype_tag="torch.uint8", base=base, base_values=rollout
    )
    assert from_store == in_memory and from_store.to_json() == in_memory.to_json()
    objs.flush()
    assert np.array_equal(read_array(_store(tmp_path), in_memory), train)


def test_encode_cache_does_not_change_stored_bytes() -> None:
    from trajstore.cas.arrays import ENCODE_CACHE

    rng = np.random.default_rng(13)
    lengths = _ragged(rng, 8, hi=9000)
    values = rng.standard_normal(sum(lengths)).astype(np.float32)
    ENCODE_CACHE.clear()
    cold = MemoryObjectStore()
    a = write_array(cold, values, lengths, dtype_tag="t")
    warm = MemoryObjectStore()
    b = write_array(warm, values, lengths, dtype_tag="t")  # every window now cached
    assert a == b and cold.data == warm.data


def test_batched_get_many_verifies_every_object(tmp_path: Path) -> None:
    objs = _store(tmp_path)
    datas = [os.urandom(3000 + i) for i in range(20)]
    hashes = objs.put_many(datas)
    objs.flush()
    fresh = _store(tmp_path)
    order = hashes[::-1] + hashes[:3]
    assert fresh.get_many(order) == [datas[hashes.index(h)] for h in order]
    (pack,) = (tmp_path / "packs").glob("*.pack")
    _flip_byte(pack, 8 + sum(len(d) for d in datas[:7]) + 5)
    with pytest.raises(IntegrityError, match=hashes[7]):
        _store(tmp_path).get_many(hashes)
