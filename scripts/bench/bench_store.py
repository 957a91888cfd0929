#!/usr/bin/env python
"""Store benchmark on a generated routed long run: ingest speed and physical/logical bytes.

    .venv/bin/python scripts/bench/bench_store.py [--rollouts 6 --steps 4 --samples 128]

In one run, on the same bundle files:
- trajstore ingest (durable: fsync on) wall time and physical bytes (objects
  reachable from the refs);
- writing the same payloads with torch.save (what a producer pays), as the
  throughput reference (ingest / torch.save ratio);
- zstd-3 over every bundle file;
- FastCDC (pyfastcdc, avg 16 KiB) + zstd-3 per unique chunk (a generic
  dedup store), timed too.
Logical bytes = the bundle files' bytes. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zstandard
from blake3 import blake3


def files_of(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def bench_torch_save(root: Path, scratch: Path) -> float:
    import torch

    from trajstore.bundle.ptfile import read_pt_bytes

    tensors = []
    for p in files_of(root):
        if p.suffix == ".pt":
            t = read_pt_bytes(p.read_bytes())
            tensors.append(t.to_torch())
    t0 = time.perf_counter()
    for i, t in enumerate(tensors):
        torch.save(t, scratch / f"{i}.pt")
    return time.perf_counter() - t0


def bench_zstd(root: Path) -> tuple[int, float]:
    c = zstandard.ZstdCompressor(level=3)
    t0 = time.perf_counter()
    total = sum(len(c.compress(p.read_bytes())) for p in files_of(root))
    return total, time.perf_counter() - t0


def bench_fastcdc(root: Path) -> tuple[int, float]:
    from pyfastcdc import FastCDC

    cdc = FastCDC(avg_size=16384)
    c = zstandard.ZstdCompressor(level=3)
    seen: set[bytes] = set()
    total = 0
    t0 = time.perf_counter()
    for p in files_of(root):
        for ch in cdc.cut_buf(p.read_bytes()):
            data = bytes(ch.data)
            h = blake3(data).digest()
            if h not in seen:
                seen.add(h)
                total += len(c.compress(data))
    return total, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rollouts", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--resumed", type=float, default=0.1)
    ap.add_argument("--workdir", type=Path, help="keep files here (default: a temp dir)")
    args = ap.parse_args()
    from trajstore.store import Store
    from trajstore.store.maintenance import stats

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        tmp = Path(tmp)
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
                "--resumed",
                str(args.resumed),
                "--ranks",
                str(args.ranks),
                "--seed",
                "1",
            ],
            check=True,
        )
        files = files_of(cap)
        logical = sum(p.stat().st_size for p in files)
        bundles = len(list(cap.rglob("manifest.json")))
        (tmp / "ts").mkdir()
        t_save = bench_torch_save(cap, tmp / "ts")
        z_bytes, t_z = bench_zstd(cap)
        c_bytes, t_c = bench_fastcdc(cap)
        t0 = time.perf_counter()
        with Store.open(tmp / "store") as store:
            outs = store.ingest([cap], run="bench")
        t_ingest = time.perf_counter() - t0
        refused = [o for o in outs if o.status == "refused"]
        if refused:
            print(f"refused: {refused[0].reason}", file=sys.stderr)
            return 2
        with Store.open(tmp / "store") as store:
            s = stats(store)
        phys = s["physical_bytes"]
        route = s["runs"][0].get("route_bytes_per_token_layer")

        def mbps(t: float) -> float:
            return logical / t / 1e6

        print(
            f"\nRouted long run: {args.rollouts} rollouts x {args.steps} steps, {args.samples} "
            f"samples/rollout, {bundles} bundles, {logical / 1e6:.1f} MB of bundle files\n"
        )
        print("| method | physical MB | physical/logical | time s | MB/s | vs torch.save |")
        print("|---|---:|---:|---:|---:|---:|")
        rows = [
            ("torch.save (payloads only)", None, t_save),
            ("zstd-3 per file", z_bytes, t_z),
            ("FastCDC 16K + zstd-3", c_bytes, t_c),
            ("trajstore ingest", phys, t_ingest),
        ]
        for name, size, t in rows:
            ps = "-" if size is None else f"{size / 1e6:.1f}"
            ratio = "-" if size is None else f"{size / logical:.3f}"
            print(f"| {name} | {ps} | {ratio} | {t:.2f} | {mbps(t):.0f} | {t_save / t:.2f} |")
        print(
            f"\ntrajstore: {s['objects']} objects, dedup ratio (payload logical / physical) "
            f"{s['dedup_ratio']}, route bytes per token-layer {route}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
