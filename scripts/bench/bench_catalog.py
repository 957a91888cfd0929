"""Catalog latency benchmark: lookup_step and query_steps on a big catalog.

Builds a throwaway store with N step bundles (8-32 samples each, 2 ranks for
one step in 10) and one recorded result per step (10% diverged at
advantage.estimate), syncs it, then times the hot queries. Targets (issue):
lookup_step < 10 ms, query_steps(first_divergent_stage=...) < 100 ms.

    .venv/bin/python scripts/bench/bench_catalog.py [--bundles 10000] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when a test loads this file
import harness  # noqa: E402

from trajstore.catalog import (
    lookup_step,
    open_catalog,
    query_divergences,
    query_steps,
    sync_catalog,
)

#: the manifest document of every generated ref
MANIFEST: dict = {"format_version": "2.0.0", "producer": {"commit": "abc"}}


def build_store(
    root: Path,
    n: int,
    seed: int = 0,
    *,
    run: str = "bench",
    first_rollout: int = 0,
    clock: int = 1_800_000_000_000_000_000,
    manifest: tuple[str, dict] = ("manifest", MANIFEST),
) -> tuple[dict[str, dict], int]:
    """Writes refs and results under root; returns (documents, number of full rollouts).

    `run`, `first_rollout` and `clock` (the first document name's time) let a caller add
    more steps to a store already built (bench_scale.py's catalog sync of new steps);
    `manifest` (hash, document) the manifest every ref names (bench_scale.py stores a real
    one, so that the server can answer a step lookup)."""
    rng = random.Random(seed)
    docs: dict[str, dict] = {}
    (root / "refs" / "bundles").mkdir(parents=True, exist_ok=True)
    (root / "results").mkdir(parents=True, exist_ok=True)
    made = 0
    rollout = first_rollout
    while made < n:
        for step in range(4):
            ranks = [0, 1] if rng.random() < 0.1 else [None]
            for rank in ranks:
                k = rng.randint(8, 32)
                samples = [
                    {
                        "sample_id": f"s-{i}",
                        "group_index": i // 8,
                        "response_length": 100 + i,
                        "total_length": 400 + i,
                        "loss_mask": [1] * 4,
                        "reward": rng.random(),
                        "micro_batch_id": f"mb-{i // 4:04d}",
                    }
                    for i in range(k)
                ]
                index_hash = f"idx-{run}-{rollout}-{step}-{rank}"
                docs[index_hash] = {
                    "bundle_id": f"replay-{rollout}-{step}",
                    "identity": {
                        "actor_step_id": {"rollout_id": rollout, "step_id": step},
                        "micro_batch_ids": sorted({s["micro_batch_id"] for s in samples}),
                        "semantic_group_ids": sorted({f"g-{s['group_index']}" for s in samples}),
                        "rollout_partition_ids": [f"rollout-{rollout - 1}"],
                        "weight_lineage": {
                            "rollout_weight": f"w-{rollout - 1}",
                            "actor_weight": f"w-{rollout}",
                        },
                        "rank": {"dp": len(ranks), "tp": 1, "pp": 1, "cp": 1},
                    },
                    "samples": samples,
                    "config": {},
                }
                key = f"{run}/step-{rollout}-{step}/rank-{rank}/a1"
                clock += 1000
                ref = {
                    "ref_version": 1, "key": key, "run": run, "kind": "step",
                    "rollout_id": rollout, "step_id": step, "rank": rank,
                    "cohort_ranks": [r for r in ranks if r is not None], "attempt": 1,
                    "bundle_id": f"replay-{rollout}-{step}", "format_version": "2.0.0",
                    "content_digest": "0" * 64, "published_at": "2026-11-30T01:02:03Z",
                    "documents": {"manifest": manifest[0], "index": index_hash,
                                  "expected": "expected"},
                    "payloads": {"log_probs": {"record": "r" * 64, "dtype": "torch.float32",
                                               "shape": [k * 100], "logical_bytes": k * 400}},
                    "physical_bytes": k * 100,
                }  # fmt: skip
                (root / "refs" / "bundles" / f"{clock:020d}-1-00.json").write_text(json.dumps(ref))
                made += 1
                if rank in (None, 0):
                    diverged = rng.random() < 0.1
                    clock += 1000
                    result = {
                        "result_version": 1, "bundle_key": key, "run": run,
                        "rollout_id": rollout, "step_id": step, "trajstore_version": "0.1.0",
                        "recorded_at": "2026-11-30T02:00:00Z",
                        "status": "diverged" if diverged else "pass",
                        "first_divergent_stage": "advantage.estimate" if diverged else None,
                        "first_divergent_rank": 0 if diverged else None,
                        "root_bundle_key": key if diverged else None, "selection": None,
                        "stages": [{"stage": "advantage.estimate",
                                    "status": "fail" if diverged else "pass"}],
                        "divergences": [
                            {"stage": "advantage.estimate", "sample_id": f"s-{i}",
                             "field": "advantages", "token_offset": i, "expected": 0.5,
                             "actual": 1.5, "abs_err": 1.0}
                            for i in range(4 if diverged else 0)
                        ],
                    }  # fmt: skip
                    (root / "results" / f"{clock:020d}-1-00.json").write_text(json.dumps(result))
        rollout += 1
    docs[manifest[0]] = manifest[1]
    docs["expected"] = {}
    return docs, rollout - first_rollout - 1


def timed(fn, repeat: int) -> tuple[float, float, float]:
    """Median, p95 and p99 in ms (p99 is nearly the max for 30 repeats)."""
    times = sorted(x * 1000 for x in harness.repeat(fn, repeat))
    return (
        statistics.median(times),
        times[int(len(times) * 0.95) - 1],
        times[int(len(times) * 0.99) - 1],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundles", type=int, default=10_000)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--json", type=Path, help="write the figures here (harness.py)")
    args = ap.parse_args()
    load_before = harness.load1()
    found: dict[str, tuple[float, float, float]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp) / "store"
        t0 = time.perf_counter()
        docs, rollouts = build_store(root, args.bundles)
        print(f"built {args.bundles} refs in {time.perf_counter() - t0:.1f}s")
        t0 = time.perf_counter()
        with open_catalog(root) as cat:
            st = sync_catalog(cat, root, docs.__getitem__)
        sync_s = time.perf_counter() - t0
        print(f"sync {st} in {sync_s:.1f}s")
        rng = random.Random(1)
        max_rollout = rollouts - 1
        with open_catalog(root) as cat:
            lookup_step(cat, "bench", 0, 0)  # warm

            def one_lookup():
                assert lookup_step(cat, "bench", rng.randint(0, max_rollout), rng.randint(0, 3))

            med, p95, p99 = found["lookup"] = timed(one_lookup, 300)
            print(f"lookup_step: median {med:.2f} ms, p95 {p95:.2f} ms, p99 {p99:.2f} ms")
            hits = query_steps(cat, first_divergent_stage="advantage.estimate", limit=1000)
            med, p95, p99 = found["query"] = timed(
                lambda: query_steps(cat, first_divergent_stage="advantage.estimate", limit=1000),
                30,
            )
            print(
                f"query_steps(first_divergent_stage, limit=1000, {len(hits['items'])} rows):"
                f" median {med:.1f} ms, p95 {p95:.1f} ms, p99 {p99:.1f} ms"
            )
            med, p95, p99 = timed(lambda: query_steps(cat, run="bench", limit=100), 30)
            print(
                f"query_steps(run, limit=100): median {med:.1f} ms, p95 {p95:.1f} ms, p99 "
                f"{p99:.1f} ms"
            )
            med, p95, p99 = timed(lambda: query_divergences(cat, stage="advantage.estimate"), 30)
            print(
                f"query_divergences(stage, limit=100): median {med:.1f} ms, p95 {p95:.1f} ms, p99 "
                f"{p99:.1f} ms"
            )
            t0 = time.perf_counter()
            snap = cat.snapshot_in_memory()
            print(f"snapshot_in_memory: {(time.perf_counter() - t0) * 1000:.0f} ms")
            med, p95, p99 = timed(
                lambda: lookup_step(snap, "bench", rng.randint(0, max_rollout), 0),
                300,
            )
            print(
                f"lookup_step on snapshot: median {med:.2f} ms, p95 {p95:.2f} ms, p99 {p99:.2f} ms"
            )
            snap.close()
    size = f"{args.bundles:,} synthetic step refs, one result each, 10% diverged"
    q, lk = found["query"], found["lookup"]
    harness.emit(
        args.json,
        [
            harness.figure(
                "divergence query `query_steps(first_divergent_stage=..., limit=1000)` p99",
                "<= 100 ms at 10,000 steps",
                q[2],
                "ms",
                workload=args.bundles,
                target_workload=10_000,
                detail=f"{size}: {len(hits['items'])} rows, median {q[0]:.1f} ms (30 runs)",
            ),
            harness.figure(
                "`catalog.lookup_step` by actor step id, p99",
                "<= 10 ms at 10,000 steps",
                lk[2],
                "ms",
                workload=args.bundles,
                target_workload=10_000,
                detail=f"{size}: 300 random lookups, median {lk[0]:.2f} ms",
            ),
        ],
        load_before,
        sync_s=sync_s,
    )


if __name__ == "__main__":
    main()
