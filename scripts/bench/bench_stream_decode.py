#!/usr/bin/env python
"""The streamed download's decode, without HTTP: wall and CPU of one payload's body.

    .venv/bin/python scripts/bench/bench_stream_decode.py STORE --run R --step r:s
        [--payload log_probs] [--format raw|npy] [--reps 8] [--cold] [--baseline-src DIR]

Each repetition is a fresh process (as a fresh server's first download is): it
opens the store, looks the step up and iterates `api.streaming.StreamedPayload`
over the payload (fetch, hash checks, zstd, the pieces the server would send),
timing only that iteration. With `--baseline-src DIR` (a checkout of the code
before a change, e.g. a `git worktree`) the same runs with DIR's `trajstore` and
`api` interleaved with this checkout's; `--cold` drops the page cache (root) before
each run. `bench_rest.py` times the whole GET; this isolates the server's decode
from the HTTP path and the client, which on 2 shared cores move the GET by more
than a decode change does.

A store with a large payload: `bench_rest.py --only cold --keep DIR` leaves one in
DIR/store (run "bench", step 999999:0, a 16M-token `log_probs`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import json, os, sys, time
from trajstore.replay.from_store import Target, stored_sources
from trajstore.store import Store
from trajstore.store.stored_bundle import load_record
from api.streaming import StreamedPayload, start_threads

store, run, step, name, fmt, cold = sys.argv[1:7]
r, s = (int(x) for x in step.split(":"))
with Store.open(store, create=False) as st:
    src = stored_sources(st, Target(run=run, step=(r, s)))[0]
    entry = src.ref["payloads"][name]
    body = StreamedPayload(src.objs, load_record(src.objs, entry["record"]),
                           tuple(entry["shape"]), entry["dtype"])
    start_threads()
    if cold == "1":
        os.sync()
        open("/proc/sys/vm/drop_caches", "w").write("3\\n")
    c0, t0 = time.process_time(), time.perf_counter()
    n = sum(len(piece) for piece in body.iter_bytes(fmt))
    print(json.dumps([time.perf_counter() - t0, time.process_time() - c0, n]))
"""


def one(src: Path, args: argparse.Namespace) -> tuple[float, float, int]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    argv = [args.store, args.run, args.step, args.payload, args.format, "1" if args.cold else "0"]
    p = subprocess.run(
        [sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, env=env, cwd=src
    )
    if p.returncode != 0:
        raise SystemExit(f"{src}: {p.stderr.strip().splitlines()[-1]}")
    wall, cpu, n = json.loads(p.stdout)
    return wall, cpu, n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("store")
    ap.add_argument("--run", required=True)
    ap.add_argument("--step", required=True, metavar="R:S")
    ap.add_argument("--payload", default="log_probs")
    ap.add_argument("--format", choices=("raw", "npy"), default="raw")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each run")
    ap.add_argument("--baseline-src", type=Path, metavar="DIR")
    args = ap.parse_args()
    sides = {"this checkout": ROOT}
    if args.baseline_src is not None:
        sides["baseline"] = args.baseline_src.resolve()
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in sides}
    sizes = set()
    for _ in range(args.reps):
        for name, src in sides.items():
            wall, cpu, n = one(src, args)
            got[name].append((wall, cpu))
            sizes.add(n)
    if len(sizes) != 1:
        raise SystemExit(f"the sides sent different body sizes: {sorted(sizes)}")
    print(
        f"{args.payload} ({sizes.pop() / 1e6:.1f} MB, format={args.format}), load "
        f"{os.getloadavg()[0]:.2f}, medians of {args.reps} fresh processes:"
    )
    for name, runs in got.items():
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        print(f"  {name}: {wall * 1e3:.1f} ms wall, {cpu * 1e3:.1f} ms CPU (all threads)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
