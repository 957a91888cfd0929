"""Prompt-aligned windows (record format 2, `heads`) and compressed records: exact and readable."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import zstandard

from trajstore.cas import (
    ArrayRecord,
    MemoryObjectStore,
    load_record,
    read_array,
    read_rows,
    write_array,
)
from trajstore.errors import IntegrityError, UsageError

pytestmark = pytest.mark.unit

FIXTURE_STORE = Path(__file__).parent / "fixtures" / "store-format1"


def _group(rng: np.random.Generator, per: int, prompt: int) -> tuple[list[int], np.ndarray]:
    """`per` rows sharing their first `prompt` tokens' routes, responses drawn apart."""
    shared = rng.integers(0, 128, (prompt, 6, 2), dtype=np.uint8)
    lengths, rows = [], []
    for _ in range(per):
        resp = rng.integers(0, 128, (int(rng.integers(1, 700)), 6, 2), dtype=np.uint8)
        rows.append(np.concatenate([shared, resp]))
        lengths.append(prompt + len(resp))
    return lengths, np.concatenate(rows)


def _rows(values: np.ndarray, lengths: list[int], rows: list[int]) -> np.ndarray:
    off = np.concatenate([[0], np.cumsum(lengths)])
    return np.concatenate([values[off[r] : off[r + 1]] for r in rows])


@pytest.mark.parametrize("kind", ["routes", "float32"])
def test_heads_round_trip_whole_and_selected_rows(kind: str) -> None:
    rng = np.random.default_rng(1)
    lengths = [int(x) for x in rng.integers(0, 1300, 12)]
    heads = [int(rng.integers(0, n + 1)) for n in lengths]
    heads[0], heads[1] = 0, lengths[1]  # a head of nothing and a head that is the whole row
    shape = (sum(lengths), 5, 3) if kind == "routes" else (sum(lengths),)
    values = rng.integers(1, 255, shape, dtype=np.uint8)
    if kind == "float32":
        values = rng.standard_normal(shape).astype(np.float32)
    objs = MemoryObjectStore()
    rec = write_array(objs, values, lengths, dtype_tag="t", heads=heads, chunk_tokens=256)
    assert rec.heads == tuple(heads)
    assert read_array(objs, rec).tobytes() == values.tobytes()
    assert read_rows(objs, rec, [7, 2, 7]).tobytes() == _rows(values, lengths, [7, 2, 7]).tobytes()


def test_shared_prompt_windows_are_stored_once() -> None:
    lengths, values = _group(np.random.default_rng(2), per=8, prompt=200)
    heads = [200] * 8
    with_heads, without = MemoryObjectStore(), MemoryObjectStore()
    rec = write_array(with_heads, values, lengths, dtype_tag="t", heads=heads)
    write_array(without, values, lengths, dtype_tag="t")
    assert len({row[0] for row in rec.chunks}) == 1  # every row's prompt window: one object
    assert sum(map(len, with_heads.data.values())) < 0.8 * sum(map(len, without.data.values()))
    assert read_array(with_heads, rec).tobytes() == values.tobytes()


def test_headed_delta_is_exact_and_needs_the_same_heads() -> None:
    rng = np.random.default_rng(3)
    lengths, rollout = _group(rng, per=4, prompt=90)
    train = rollout.copy()
    flip = rng.random(train.shape[:2]) < 0.18
    train[flip, 0] ^= 1
    heads = [90] * 4
    objs = MemoryObjectStore()
    base = write_array(objs, rollout, lengths, dtype_tag="t", heads=heads)
    delta = write_array(objs, train, lengths, dtype_tag="t", heads=heads, base=base)
    assert read_array(objs, delta).tobytes() == train.tobytes()
    assert read_rows(objs, delta, [3, 1]).tobytes() == _rows(train, lengths, [3, 1]).tobytes()
    in_memory = write_array(
        objs, train, lengths, dtype_tag="t", heads=heads, base=base, base_values=rollout
    )
    assert in_memory == delta
    with pytest.raises(UsageError, match="heads"):
        write_array(objs, train, lengths, dtype_tag="t", heads=[91] * 4, base=base)


def test_bad_heads_are_usage_errors() -> None:
    objs = MemoryObjectStore()
    values = np.ones(10, np.float32)
    with pytest.raises(UsageError, match="between 0"):
        write_array(objs, values, [4, 6], dtype_tag="t", heads=[5, 0])
    with pytest.raises(UsageError, match="one per row"):
        write_array(objs, values, [4, 6], dtype_tag="t", heads=[1])


def test_record_formats_on_disk() -> None:
    objs = MemoryObjectStore()
    values = np.arange(1, 11, dtype=np.float32)
    plain = write_array(objs, values, [4, 6], dtype_tag="t")
    headed = write_array(objs, values, [4, 6], dtype_tag="t", heads=[2, 3])
    assert json.loads(plain.to_json())["format"] == 1 and "heads" not in plain.to_dict()
    assert json.loads(headed.to_json())["format"] == 2
    for rec in (plain, headed):
        stored = rec.to_object()
        assert zstandard.ZstdDecompressor().decompress(stored) == rec.to_json()
        assert ArrayRecord.from_object(stored) == rec
        assert load_record(objs, objs.put(stored)) == rec


def test_record_written_as_plain_json_still_reads() -> None:
    objs = MemoryObjectStore()
    values = np.arange(1, 11, dtype=np.float32)
    rec = write_array(objs, values, [4, 6], dtype_tag="t")
    h = objs.put(rec.to_json())  # how records were stored before they were compressed
    assert load_record(objs, h) == rec
    assert read_array(objs, load_record(objs, h)).tobytes() == values.tobytes()


@pytest.mark.parametrize(
    "change",
    [{"format": 3}, {"format": 2}, {"format": 2, "heads": [1, 99]}, {"format": True}],
)
def test_malformed_record_format_is_integrity_error(change: dict) -> None:
    objs = MemoryObjectStore()
    rec = write_array(objs, np.ones(10, np.float32), [4, 6], dtype_tag="t")
    d = {**rec.to_dict(), **change}
    with pytest.raises(IntegrityError):
        ArrayRecord.from_dict(d)


def test_record_object_that_is_not_zstd_or_json_is_integrity_error() -> None:
    bad = b"\x28\xb5\x2f\xfd" + b"\x00" * 20
    with pytest.raises(IntegrityError):
        ArrayRecord.from_object(bad)


@pytest.mark.parametrize("delta", [False, True])
def test_stock_zarr_reads_headed_arrays(delta: bool) -> None:
    import zarr

    from trajstore.cas import CASZarrStore

    lengths, values = _group(np.random.default_rng(4), per=3, prompt=130)
    objs = MemoryObjectStore()
    rec = write_array(objs, values, lengths, dtype_tag="t", heads=[130] * 3)
    if delta:
        values = values.copy()
        values[::5, 2, 1] ^= 3
        rec = write_array(objs, values, lengths, dtype_tag="t", heads=[130] * 3, base=rec)
    z = zarr.open_array(store=CASZarrStore(objs, {"r": rec}), path="r", mode="r")
    padded = z[:]
    for i, n in enumerate(lengths):
        assert padded[i, :n].tobytes() == _rows(values, lengths, [i]).tobytes()
        assert not padded[i, n:].any()


def test_rest_stream_of_a_headed_array_is_exact() -> None:
    from trajstore.api.streaming import StreamedPayload

    lengths, values = _group(np.random.default_rng(5), per=6, prompt=77)
    objs = MemoryObjectStore()
    rec = write_array(objs, values, lengths, dtype_tag="torch.uint8", heads=[77] * 6)
    body = b"".join(StreamedPayload(objs, rec, values.shape, "torch.uint8").iter_bytes("raw"))
    assert body == values.tobytes()


def test_store_written_before_format_2_still_reads(tmp_path: Path) -> None:
    """A store written by the code before prompt-aligned windows and compressed records."""
    from trajstore.store import Store
    from trajstore.store.maintenance import fsck

    root = tmp_path / "store"
    shutil.copytree(FIXTURE_STORE, root)
    with Store.open(root) as store:
        bundles = store.step("old", 0, 0) + store.rollout("old", 0)
        assert len(bundles) == 2
        for b in bundles:
            for name in b.payload_names():
                raw = store.objs.get(b.ref["payloads"][name]["record"])
                assert raw[:1] == b"{" and json.loads(raw)["format"] == 1
                rec = b.record(name)
                assert rec.heads is None
                # payload_file is the .pt file rebuilt from the chunks, checked against its sha256
                assert b.payload_file(name)
                rows = b.payload_rows(name, np.array([1, 0]))
                assert rows.size > 0
        assert fsck(store).ok


def test_ingest_stores_a_groups_shared_prefill_routes_once(tmp_path: Path) -> None:
    from trajstore.examples import gen_long_run

    from trajstore.store import Store

    cap = tmp_path / "capture"
    args = ["--rollouts", "1", "--steps", "1", "--samples", "8", "--per-prompt", "4"]
    args += ["--routes", "--layers", "4", "--topk", "2", "--min-len", "20", "--max-len", "300"]
    assert gen_long_run.main([str(cap), *args, "--shared-prompt-routes"]) == 0
    with Store.open(tmp_path / "store") as store:
        assert all(o.status == "published" for o in store.ingest([cap], run="r"))
        (b,) = store.rollout("r", 0)
        for name in ("rollout_routed_experts", "train_routed_experts"):
            rec = b.record(name)
            assert rec.heads == tuple(s.total_length - s.response_length for s in b.index.samples)
            first = [row[0] for row in rec.chunks]  # the prompt's window, per sample
            assert len(set(first[:4])) == 1 and len(set(first[4:])) == 1
            assert (
                b.payload_file(name)
                == (cap / "replay-rollout-0" / "payloads" / f"{name}.pt").read_bytes()
            )
