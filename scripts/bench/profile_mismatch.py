#!/usr/bin/env python
"""The mismatch sums' share of an ingest's CPU (issue 32), by cProfile on every thread.

    .venv/bin/python scripts/bench/profile_mismatch.py [--bundles 4] [--top 0]

Ingests `bench_mismatch.py`'s MoE bundles (routes [T, 48, 8] of 128 experts, four
log-prob payloads, 32 samples x 512 response tokens) into a fresh store after one
warm-up ingest, with a `cProfile.Profile(time.thread_time)` on the calling thread and on
every thread the ingest starts (gate, writers, finisher, readers), merged. The share is
`bundle_entry`'s cumulative time over the sum of all functions' internal time, less the
waits (a queue's get, a lock's acquire, sleep) that a still-running pool thread leaves
open. Pools started before (the gate's readers) are not profiled, with or without
the sums; the sums' own pool is started afresh. A measurement tool, not a figure: on
a loaded machine only the proportions mean something. `--top N` prints the N callees
of the computation by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import threading
import time
from pathlib import Path

import bench_mismatch

WAITS = ("SimpleQueue' objects", "acquire' of '_thread", "time.sleep")
PARTS = (
    "measure_routes",
    "_compare_chunk",
    "_repeats",
    "_id_range",
    "_pair_sums",
    "_worst_per_sample",
    "_sample_layout",
)


def profile_ingest(bundles: list[Path], store: Path) -> pstats.Stats:
    from trajstore.store import Store

    profiles: list[cProfile.Profile] = []
    run = threading.Thread.run

    def profiled_run(self: threading.Thread) -> None:
        p = cProfile.Profile(time.thread_time)
        profiles.append(p)
        p.enable()
        try:
            run(self)
        finally:
            p.disable()

    import trajstore.store.ingest_write as ingest_write

    if hasattr(ingest_write, "_MISMATCH_POOL"):  # a fresh pool: its thread is profiled
        ingest_write._MISMATCH_POOL = None
    main = cProfile.Profile(time.thread_time)
    threading.Thread.run = profiled_run  # type: ignore[method-assign]
    try:
        main.enable()
        with Store.open(store) as st:
            outcomes = st.ingest(bundles, run="bench")
        main.disable()
    finally:
        threading.Thread.run = run  # type: ignore[method-assign]
    assert all(o.status == "published" for o in outcomes), outcomes
    stats = pstats.Stats(main)
    for p in profiles:
        stats.add(p)
    return stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundles", type=int, default=4)
    ap.add_argument("--top", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        bundles = bench_mismatch.make_bundles(root / "in", args.bundles, 32, 512, 256)
        from trajstore.store import Store

        with Store.open(root / "warm") as st:  # imports and first-use costs, dropped
            st.ingest(bundles[:1], run="warm")
        stats = profile_ingest(bundles, root / "store")
    rows = stats.stats  # type: ignore[attr-defined]
    total = sum(v[2] for k, v in rows.items() if not any(w in k[2] for w in WAITS))

    def cum(name: str) -> float:
        return sum(v[3] for k, v in rows.items() if k[2] == name)

    entry = cum("bundle_entry")
    print(f"ingest CPU {total:.3f} s, bundle_entry {entry:.3f} s: {entry / total:.1%}")
    for name in PARTS:
        print(f"  {name}: {cum(name) / max(entry, 1e-12):.0%} of bundle_entry")
    if args.top:
        stats.sort_stats("cumulative").print_callees("bundle_entry|compute_mismatch", args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
