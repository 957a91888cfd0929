#!/usr/bin/env python
"""A 100,000-step store: CLI commands, the step GET, the web view's steps page data and
catalog sync of 1,000 new steps (issue 33's scale rows).

    .venv/bin/python scripts/bench/bench_scale.py [--steps 100000] [--dir DIR] [--quick]
        [--json PATH]

The store is built the cheap way of bench_catalog.py (refs and result documents written
directly; one step in ten on two ranks, one result per step, 10% diverged), in chunks of
10,000 steps, each synced before the next is written (so the documents of one chunk are
in memory at a time); the sync time of each chunk is printed, which shows how a sync's
cost grows with the store. `--dir` keeps the store and reuses it on the next run (the
catalog-sync figure adds steps to it: see below).

Figures, all on that store:

- `ls`, `query steps`, `sql`: whole-command wall time, fresh processes (bench_cli.py's
  method: bytecode cached, rounds alternating, `python -c pass` as the baseline);
- `GET /v1/runs/{run}/steps/{r}:{s}`, random existing steps, one keep-alive client
  against `trajstore serve` (1 worker): median and p99;
- the web view's steps page data: what /runs/{run} fetches when it opens (run summary,
  strip of 400 bins, first 50 steps; docs/web.md), median over repetitions; the first
  load after the server starts (it builds what the next loads of the same catalog
  generation reuse) is reported apart;
- catalog sync after 1,000 new steps (refs and results written as above, the run's next
  rollouts) into this store against the same 1,000 into an empty store whose catalog
  exists: the time of the next reader's `open_catalog` + `sync_catalog`, median of
  `--sync-reps` alternating pairs. Each pair adds 1,000 steps to the big store.

`--quick`: 2,000 steps, 200 new, few repetitions (checks the script, not figures).
Prints a table; `--json PATH` writes the figures (harness.py).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_catalog import build_store  # noqa: E402
from bench_cli import cli, p90, time_commands  # noqa: E402
from harness import emit, figure, load1  # noqa: E402

CLI_TARGET_S = 0.3
GET_P99_TARGET_MS = 10.0
PAGE_TARGET_MS = 300.0
SYNC_RATIO_TARGET = 2.0
RUN = "bench"
CHUNK = 10_000
#: the first document name's time of each chunk: far apart, so chunks never collide
CLOCK0 = 1_800_000_000_000_000_000
CLOCK_STRIDE = 10**12


def _bundles_for(steps: int) -> int:
    return int(steps * 1.1)  # build_store counts bundles; one step in ten has two ranks


def _state_path(root: Path) -> Path:
    return root / "bench-scale.json"


def _state(root: Path) -> dict:
    path = _state_path(root)
    return json.loads(path.read_text()) if path.is_file() else {"rollouts": 0, "chunks": 0}


#: the one manifest every generated ref names, stored for real: the server reads a step's
#: capabilities from it (the other documents exist only in the benchmark's loader)
MANIFEST = {
    "format_version": "2.0.0",
    "producer": {"commit": "abc"},
    "stage_contracts": {
        "advantage.estimate": {"capability": "recompute", "stage": "advantage.estimate"}
    },
}


def _manifest(root: Path) -> tuple[str, dict]:
    from trajstore.cas.blobs import put_blob
    from trajstore.jsonio import canonical_bytes
    from trajstore.store import Store

    with Store.open(root) as store:
        return put_blob(store.objs, canonical_bytes(MANIFEST)), MANIFEST


def add_steps(root: Path, steps: int, state: dict, seed: int | None = None) -> tuple[float, dict]:
    """Write `steps` more steps (the run's next rollouts, after `state`) and sync them;
    returns the sync's seconds and the new state (also written to `root`). The catalog must
    exist (see `ensure_catalog`). `seed` defaults to the chunk's number."""
    from trajstore.catalog import open_catalog, sync_catalog

    docs, rollouts = build_store(
        root,
        _bundles_for(steps),
        seed=state["chunks"] if seed is None else seed,
        run=RUN,
        first_rollout=state["rollouts"],
        clock=CLOCK0 + state["chunks"] * CLOCK_STRIDE,
        manifest=_manifest(root),
    )
    t0 = time.perf_counter()
    with open_catalog(root) as cat:
        sync_catalog(cat, root, docs.__getitem__)
    took = time.perf_counter() - t0
    state = {"rollouts": state["rollouts"] + rollouts + 1, "chunks": state["chunks"] + 1}
    _state_path(root).write_text(json.dumps(state))
    return took, state


def ensure_catalog(root: Path) -> None:
    """A store (its manifest object stored) and a catalog at the head revision, empty."""
    from trajstore.catalog import open_catalog, sync_catalog

    _manifest(root)
    (root / "results").mkdir(parents=True, exist_ok=True)
    with open_catalog(root) as cat:
        sync_catalog(cat, root, {}.__getitem__)


def count_steps(root: Path) -> int:
    from trajstore.catalog import open_catalog, run_readonly_sql

    with open_catalog(root) as cat:
        _, rows = run_readonly_sql(
            cat,
            "SELECT count(*) FROM (SELECT DISTINCT run, rollout_id, step_id FROM bundles "
            "WHERE kind = 'step')",
        )
    return int(rows[0][0])


def build(root: Path, steps: int) -> dict:
    """Grow the store to about `steps` steps in chunks; prints each chunk's sync time."""
    if not (root / "TRAJSTORE_STORE").is_file():
        ensure_catalog(root)
    state = _state(root)
    have = count_steps(root)
    while have < steps:
        n = min(CHUNK, steps - have)
        t0 = time.perf_counter()
        took, state = add_steps(root, n, state)
        have = count_steps(root)
        print(
            f"  chunk {state['chunks']}: +{n} steps -> {have} steps; sync {took:.2f} s "
            f"({time.perf_counter() - t0:.1f} s with writing)",
            flush=True,
        )
    return state


def time_cli(root: Path, rounds: int) -> dict[str, list[float]]:
    base = cli()
    return time_commands(
        {
            "python -c pass": [sys.executable, "-c", "pass"],
            "ls": [*base, "ls", "--store", str(root)],
            "query steps": [*base, "query", "steps", "--store", str(root)],
            "sql": [*base, "sql", "SELECT count(*) AS n FROM bundles", "--store", str(root)],
        },
        rounds,
    )


def time_rest(root: Path, lookups: int, pages: int, max_rollout: int) -> dict:
    import httpx
    from bench_web import serve

    proc, base = serve(root)
    rng = random.Random(7)
    try:
        with httpx.Client(base_url=base, timeout=600) as http:

            def get(path: str, **params: object) -> httpx.Response:
                resp = http.get(path, params=params)
                resp.raise_for_status()
                return resp

            def page() -> None:
                get(f"/v1/runs/{RUN}/summary")
                get(f"/v1/runs/{RUN}/strip", bins=400)
                get(f"/v1/runs/{RUN}/steps", limit=50)

            get(f"/v1/runs/{RUN}/steps/0:0")
            t0 = time.perf_counter()
            page()  # the first load of this catalog generation builds what later loads reuse
            first_page_ms = (time.perf_counter() - t0) * 1000
            step_ms = []
            for _ in range(lookups):
                path = f"/v1/runs/{RUN}/steps/{rng.randint(0, max_rollout)}:{rng.randint(0, 3)}"
                t0 = time.perf_counter()
                get(path)
                step_ms.append((time.perf_counter() - t0) * 1000)
            page_ms = []
            for _ in range(pages):
                t0 = time.perf_counter()
                page()
                page_ms.append((time.perf_counter() - t0) * 1000)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    # three p99s, one per third of the lookups in the order made: the verdict's spread
    thirds = [sorted(step_ms[i::3]) for i in range(3)]
    step_ms.sort()
    return {
        "get_p99_thirds_ms": [t[max(0, int(len(t) * 0.99) - 1)] for t in thirds if t],
        "page_ms": page_ms,
        "get_median_ms": statistics.median(step_ms),
        "get_p99_ms": step_ms[max(0, int(len(step_ms) * 0.99) - 1)],
        "page_median_ms": statistics.median(page_ms),
        "page_max_ms": max(page_ms),
        "page_first_ms": first_page_ms,
    }


def time_sync(root: Path, new: int, reps: int, work: Path) -> dict:
    """Pairs: the same `new` steps into the big store and into an empty one."""
    big, empty = [], []
    state = _state(root)
    for rep in range(reps):
        fresh = work / f"empty-{rep}"
        ensure_catalog(fresh)
        timings, after = {}, state
        for which in ("big", "empty") if rep % 2 == 0 else ("empty", "big"):
            target = root if which == "big" else fresh
            timings[which], next_state = add_steps(target, new, state, seed=1000 + rep)
            if which == "big":
                after = next_state
        state = after
        shutil.rmtree(fresh, ignore_errors=True)
        big.append(timings["big"])
        empty.append(timings["empty"])
        print(
            f"  sync of {new} new steps: big store {timings['big']:.3f} s, "
            f"empty store {timings['empty']:.3f} s",
            flush=True,
        )
    return {
        "big_s": statistics.median(big),
        "empty_s": statistics.median(empty),
        "big_runs_s": big,
        "empty_runs_s": empty,
        "ratio": statistics.median(big) / statistics.median(empty),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="actor steps (default 100,000)")
    ap.add_argument("--new", type=int, default=None, help="steps added for the sync figure")
    ap.add_argument("--rounds", type=int, default=None, help="CLI rounds (default 9)")
    ap.add_argument("--lookups", type=int, default=None, help="step GETs (default 1000)")
    ap.add_argument("--pages", type=int, default=None, help="page loads (default 15)")
    ap.add_argument("--sync-reps", type=int, default=None, help="sync pairs (default 3)")
    ap.add_argument("--dir", type=Path, help="build the store here and keep it (reused)")
    ap.add_argument("--quick", action="store_true", help="2,000 steps, few repetitions")
    ap.add_argument("--json", type=Path, metavar="PATH", help="write the figures here")
    args = ap.parse_args()
    q = args.quick
    steps = args.steps or (2000 if q else 100_000)
    new = args.new or (200 if q else 1000)
    rounds = args.rounds or (3 if q else 9)
    lookups = args.lookups or (100 if q else 1000)
    pages = args.pages or (3 if q else 15)
    sync_reps = args.sync_reps or (1 if q else 3)
    load_before = load1()
    work = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=args.dir.parent if args.dir else None))
    root = args.dir or work / "store"
    try:
        t0 = time.perf_counter()
        print(f"building {steps} steps at {root}", flush=True)
        state = build(root, steps)
        n_steps = count_steps(root)
        print(f"store: {n_steps} steps ({time.perf_counter() - t0:.1f} s)", flush=True)
        times = time_cli(root, rounds)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        rest = time_rest(root, lookups, pages, state["rollouts"] - 1)
        sync = time_sync(root, new, sync_reps, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    on = f"{n_steps} steps"
    size = {"workload": n_steps, "target_workload": 100_000, "workload_unit": "steps"}
    figures = [
        figure(
            f"trajstore {name}, whole command wall time",
            f"<= {CLI_TARGET_S} s on a 100,000-step store",
            med[name],
            "s",
            reps=times[name],
            **size,
            detail=f"median of {rounds} fresh processes on {on} (p90 {p90(times[name]):.3f} s);"
            f" python -c pass {med['python -c pass']:.3f} s",
        )
        for name in ("ls", "query steps", "sql")
    ]
    figures += [
        figure(
            "GET /v1/runs/{run}/steps/{r}:{s}, p99",
            f"<= {GET_P99_TARGET_MS} ms on a 100,000-step store",
            rest["get_p99_ms"],
            "ms",
            reps=rest["get_p99_thirds_ms"],
            **size,
            detail=f"{lookups} random steps of {on}, 1 worker, keep-alive; median "
            f"{rest['get_median_ms']:.2f} ms",
        ),
        figure(
            "web view steps page data (summary, strip, first 50 steps)",
            f"<= {PAGE_TARGET_MS} ms on a 100,000-step store",
            rest["page_median_ms"],
            "ms",
            reps=rest["page_ms"],
            **size,
            detail=f"median of {pages} loads on {on}; max {rest['page_max_ms']:.1f} ms; "
            f"the generation's first load {rest['page_first_ms']:.1f} ms",
        ),
        figure(
            f"catalog sync of {new} new steps, big store / empty store",
            f"<= {SYNC_RATIO_TARGET}x (1,000 steps into 100,000)",
            sync["ratio"],
            "x",
            reps=[b / e for b, e in zip(sync["big_runs_s"], sync["empty_runs_s"], strict=True)],
            **{**size, "workload": n_steps if new >= 1000 else 0},
            detail=f"median of {sync_reps} pairs: {sync['big_s']:.3f} s into {on} vs "
            f"{sync['empty_s']:.3f} s into an empty store",
        ),
    ]
    print(f"{'figure':62} {'value':>9}")
    for fig in figures:
        print(f"{fig['name']:62} {fig['value']:>9} {fig['unit']}")
    emit(args.json, figures, load_before, steps=n_steps, rest=rest, sync=sync)


if __name__ == "__main__":
    main()
