#!/usr/bin/env python
"""What a fork server costs a command's local pool, against a fork of the command.

    .venv/bin/python scripts/bench/bench_local_pool.py [--bundles 24] [--reps 9] [--json OUT]
    .venv/bin/python scripts/bench/bench_local_pool.py --quick   # a smoke run, no verdict

The local executor forks its workers unless the command has loaded obstore (an
s3:// store): a forked copy of obstore's runtime hangs, so then they come from a
fork server (trajstore/executors.py). This measures what that choice costs, on a
directory store where both work: `trajstore replay --store DIR --all --workers 2`
over `--bundles` consistent step bundles, each run a fresh process (as a user runs
it, so the fork server's start and its imports are counted every time), the two
arms alternating, the context forced in the launching process:

- fork: `trajstore.executors.worker_context` returns the fork context (what a
  directory store gets);
- forkserver: it returns the fork-server context with the replay worker's modules
  preloaded (what an s3:// store gets).

Reported: the median wall time of each and forkserver / fork, with each arm's spread
(max/min): a ratio is a verdict only when the spread is below the margin.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import emit, load1

#: the command in a fresh interpreter, its pool's context forced to argv[1]
LAUNCH = """
import multiprocessing as mp, sys
import trajstore.executors as ex

def forced(preload=()):
    ctx = mp.get_context(sys.argv[1])
    if sys.argv[1] == "forkserver":
        ctx.set_forkserver_preload(sorted(set(preload)))
    return ctx

ex.worker_context = forced
from trajstore.cli import main
sys.exit(main(sys.argv[2:]))
"""


def build(store: Path, bundles: int) -> None:
    from trajstore.examples.replay_builders import write_consistent

    from trajstore.store import Store

    cap = store.parent / "cap"
    for s in range(bundles):
        write_consistent(cap / f"replay-3-{s}", kind="step", rollout_id=3, step_id=s, seed=s)
    with Store.open(store) as st:
        assert {o.status for o in st.ingest([cap])} == {"published"}


def one(arm: str, store: Path) -> float:
    args = [sys.executable, "-c", LAUNCH, arm, "replay", "--store", str(store), "--all"]
    args += ["--workers", "2", "--json"]
    t0 = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{arm}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundles", type=int, default=24)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="4 bundles, 2 reps: a smoke run")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    bundles, reps = (4, 2) if a.quick else (a.bundles, a.reps)
    with tempfile.TemporaryDirectory(prefix="bench-pool-") as tmp:
        store = Path(tmp) / "store"
        build(store, bundles)
        one("forkserver", store)  # warm the page cache for both arms
        times: dict[str, list[float]] = {"fork": [], "forkserver": []}
        load_before = load1()
        for _ in range(reps):
            for arm in times:
                times[arm].append(one(arm, store))
        load_after = load1()
    med = {arm: statistics.median(ts) for arm, ts in times.items()}
    spread = {arm: max(ts) / min(ts) for arm, ts in times.items()}
    ratio = med["forkserver"] / med["fork"]
    for arm, ts in times.items():
        shown = ", ".join(f"{t:.2f}" for t in ts)
        print(f"{arm:10} median {med[arm]:.2f} s, spread {spread[arm]:.2f} ({shown})")
    print(
        f"forkserver / fork = {ratio:.2f} ({bundles} bundles, {reps} reps, load 1-min "
        f"{load_before:.2f} -> {load_after:.2f}){' [quick: no verdict]' if a.quick else ''}"
    )
    # no target is set for this cost (docs/store.md quotes it): no figures
    emit(a.json, [], load_before, bundles=bundles, reps=reps, times=times, median=med,
         spread=spread, ratio=ratio, quick=a.quick)  # fmt: skip


if __name__ == "__main__":
    main()
