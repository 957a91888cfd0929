"""Micro-benchmark: trajstore.cas direct chunk path vs stock zarr-python per chunk.

    .venv/bin/python scripts/bench/bench_cas.py [--rows 512]

Prints per-chunk write/read cost of `write_array`/`read_array` on a
LocalObjectStore (flush and fsync included) and of zarr-python writing and
reading the same padded array through CASZarrStore's twin (a MemoryStore, so
zarr's number is a lower bound), plus route delta costs.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from trajstore.cas import CASZarrStore, LocalObjectStore, read_array, read_rows, write_array
from trajstore.cas.arrays import ENCODE_CACHE


def _best(fn, n: int = 5) -> float:
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=512)
    args = ap.parse_args()
    import zarr
    from zarr.codecs import BytesCodec, ZstdCodec
    from zarr.storage import MemoryStore

    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(500, 1500, args.rows)]
    values = rng.standard_normal(sum(lengths)).astype(np.float32)

    with tempfile.TemporaryDirectory() as d:
        n = 0

        def write() -> None:
            nonlocal n
            objs = LocalObjectStore(f"{d}/s{n}")
            n += 1
            ENCODE_CACHE.clear()  # measure compression, not the in-process encode cache
            write_array(objs, values, lengths, dtype_tag="torch.float32")
            objs.flush()

        t_write = _best(write)
        objs = LocalObjectStore(f"{d}/s0")
        rec = write_array(objs, values, lengths, dtype_tag="torch.float32")
        nchunks = sum(h is not None for row in rec.chunks for h in row)
        t_read = _best(lambda: read_array(LocalObjectStore(f"{d}/s0"), rec))
        t_rows = _best(lambda: read_rows(objs, rec, range(0, args.rows, 16)))

        print(f"payload: {args.rows} rows, {len(values)} float32 tokens, {nchunks} chunks")
        print(
            f"direct  write {t_write * 1e3:7.1f} ms ({t_write / nchunks * 1e6:6.1f} us/chunk, "
            f"flush+fsync incl.)  read {t_read * 1e3:7.1f} ms ({t_read / nchunks * 1e6:6.1f} "
            f"us/chunk, cold instance)  read_rows 1/16: {t_rows * 1e3:.1f} ms"
        )

        # Bulk payload read vs torch.load of the same tensor from a .pt file (same run).
        import torch

        blen = [int(x) for x in np.clip(rng.lognormal(7.3, 0.7, 2000), 50, 4000)]
        bvals = rng.standard_normal(sum(blen)).astype(np.float32)
        bobjs = LocalObjectStore(f"{d}/bulk", durable=False)
        brec = write_array(bobjs, bvals, blen, dtype_tag="torch.float32")
        bobjs.flush()
        torch.save(torch.from_numpy(bvals), f"{d}/bulk.pt")
        t_load = _best(lambda: torch.load(f"{d}/bulk.pt", weights_only=True))
        reader = LocalObjectStore(f"{d}/bulk", durable=False)
        assert np.array_equal(read_array(reader, brec), bvals)
        t_bulk = _best(lambda: read_array(reader, brec))
        mb = bvals.nbytes / 1e6
        bchunks = sum(h is not None for row in brec.chunks for h in row)
        print(
            f"bulk read {mb:.1f} MB float32, 2000 rows, {bchunks} chunks: read_array "
            f"{mb / t_bulk:.0f} MB/s, torch.load {mb / t_load:.0f} MB/s, ratio "
            f"{t_load / t_bulk:.2f}x"
        )

        padded = np.zeros((args.rows, max(lengths)), np.float32)
        off = 0
        for i, ln in enumerate(lengths):
            padded[i, :ln] = values[off : off + ln]
            off += ln

        def zwrite() -> zarr.Array:
            z = zarr.create_array(
                store=MemoryStore(),
                shape=padded.shape,
                chunks=(1, rec.chunk_tokens),
                dtype="float32",
                fill_value=0,
                serializer=BytesCodec(endian="little"),
                compressors=[ZstdCodec(level=3)],
                filters=None,
            )
            z[...] = padded
            return z

        t_zw = _best(zwrite, 3)
        t_zr = _best(lambda: zarr.open_array(store=CASZarrStore(objs, {"a": rec}), path="a")[:], 3)
        print(
            f"zarr-py write {t_zw * 1e3:7.1f} ms ({t_zw / nchunks * 1e6:6.1f} us/chunk, "
            f"MemoryStore)           read {t_zr * 1e3:7.1f} ms ({t_zr / nchunks * 1e6:6.1f} "
            "us/chunk, via CASZarrStore)"
        )

        # Routes: Qwen3-30B-A3B-like [T, 48, 8] uint8, train = rollout with 18% of
        # (token, layer) pairs re-routed.
        rl = [int(x) for x in rng.integers(300, 1500, 32)]
        rollout = rng.integers(0, 128, (sum(rl), 48, 8), dtype=np.uint8)
        train = rollout.copy()
        flip = rng.random(train.shape[:2]) < 0.18
        train[flip, 0] = (train[flip, 0] + 1) % 128
        robjs = LocalObjectStore(f"{d}/routes", durable=False)

        def size(r) -> int:
            return sum(len(robjs.get(h)) for row in r.chunks for h in row if h is not None)

        t = time.perf_counter()
        base = write_array(robjs, rollout, rl, dtype_tag="torch.uint8")
        t_base = time.perf_counter() - t
        t = time.perf_counter()
        same = write_array(robjs, rollout, rl, dtype_tag="torch.uint8", base=base)
        t_same = time.perf_counter() - t
        t = time.perf_counter()
        delta = write_array(robjs, train, rl, dtype_tag="torch.uint8", base=base)
        t_delta = time.perf_counter() - t
        t = time.perf_counter()
        assert np.array_equal(read_array(robjs, delta), train)
        t_rd = time.perf_counter() - t
        print(
            f"routes {rollout.nbytes / 2**20:.0f} MiB raw: base {size(base) / 2**20:.1f} MiB "
            f"({t_base * 1e3:.0f} ms), delta(equal) {size(same)} B ({t_same * 1e3:.0f} ms), "
            f"delta(18%) {size(delta) / 2**20:.2f} MiB ({t_delta * 1e3:.0f} ms, read "
            f"{t_rd * 1e3:.0f} ms)"
        )


if __name__ == "__main__":
    main()
