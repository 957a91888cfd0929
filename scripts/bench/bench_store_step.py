#!/usr/bin/env python
"""`Store.step` lookup latency: the lazy index against an eager parse, in one process.

    .venv/bin/python scripts/bench/make_big_store.py /tmp/lk/store --steps 40 --samples 256 \
        --mean-tokens 1024 --distinct --jobs 1
    .venv/bin/python scripts/bench/bench_store_step.py /tmp/lk/store [--lookups 300]

A lookup by actor step id fetches and hash-checks the step's documents but parses
index.json (every sample's loss mask) only on first use. The baseline is the same lookup
followed by `.index` (what every lookup paid before), interleaved with it on the same random
step ids so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

from trajstore.store import Store


def quantiles(v: list[float]) -> tuple[float, float]:
    return statistics.median(v), sorted(v)[max(0, int(0.99 * len(v)) - 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store", type=Path)
    ap.add_argument("--lookups", type=int, default=300)
    args = ap.parse_args()
    store = Store.open(args.store, create=False)
    ids = sorted(
        {(e.run, e.rollout_id, e.step_id) for e in store.refs.live().values() if e.kind == "step"}
    )
    rng = random.Random(0)
    lazy: list[float] = []
    eager: list[float] = []
    for i in range(args.lookups):
        run, rollout_id, step_id = rng.choice(ids)
        for parse in (False, True) if i % 2 else (True, False):
            t = time.perf_counter()
            for b in store.step(run, rollout_id, step_id):
                if parse:
                    b.index  # noqa: B018 - the eager baseline parses index.json
            (eager if parse else lazy).append((time.perf_counter() - t) * 1e3)
    for label, v in (("Store.step (lazy index)", lazy), ("Store.step + .index (baseline)", eager)):
        p50, p99 = quantiles(v)
        print(f"{label:32s} p50 {p50:.2f} ms, p99 {p99:.2f} ms")
    print(f"n={args.lookups} each over {len(ids)} steps; load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
