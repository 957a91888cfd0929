"""Training-inference mismatch benchmark (issue 32): queries over a 10,000-step run, and
what computing the sums costs an ingest.

1. A throwaway store of N step refs (one rank each, 1 in 10 steps with 2 ranks) whose refs
   carry synthetic mismatch sums (48 MoE layers), written directly as bench_catalog.py
   does (no payloads), synced once. Timed, as a user runs them (whole command, fresh
   interpreter): `trajstore query mismatch --top 20` and `--first-above X`. Targets: at
   most 0.3 s each.
2. `trajstore serve` on that store: p99 of GET /v1/runs/bench/mismatch (--top 20, and
   the first page of 100), target at most 50 ms; and the web chart's data fetch (every
   page of one metric with limit=1000, plus /mismatch/layers for the heat map in the
   columns a 1,200 px page asks for, and with a column a step for comparison).
3. Ingest of M real bundles (routes [T, 48, 8] and four log-prob payloads) into two fresh
   stores, once as shipped and once with the mismatch computation replaced by a stub
   (in this process only), --repeats alternating pairs: the median of the pairs' ratios,
   target <= 1.05x. `--ingest-only` measures this figure alone. `--capture DIR` measures
   it on the bundles of a capture directory instead, e.g. issue 33's routed long run
   (`python -m trajstore.examples.gen_long_run DIR --rollouts 6 --steps 4 --samples 64
   --routes --resumed 0.1 --seed 1`: a rollout's routes in each of its steps' bundles).

    .venv/bin/python scripts/bench/bench_mismatch.py [--steps 10000] [--ingest-bundles 8]
        [--capture DIR]

Tiny smoke run (proves the script works; no figure): --quick (--steps 200 --ingest-bundles 2
--requests 20 --repeats 1 --commands 2). `--json PATH` writes the figures (harness.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
import httpx
import numpy as np

LAYERS, TOPK, EXPERTS = 48, 8, 128


def _pair(rng: random.Random, n: int) -> dict:
    d = [rng.gauss(0, 0.05) for _ in range(8)]
    return {
        "n": n, "abs_dlogp_sum": n * 0.04, "abs_dlogp_max": max(map(abs, d)) * 10,
        "abs_dp_sum": n * 0.01, "abs_dp_max": 0.2, "d_sum": n * rng.gauss(0, 0.01),
        "k3_sum": n * 0.001 * (1 + rng.random()), "mult_sum": n * 1.04, "pr_sum": n * 0.5,
        "pt_sum": n * 0.5, "pr2_sum": n * 0.3, "pt2_sum": n * 0.3, "prpt_sum": n * 0.29,
        "gt_0_1": n // 20, "gt_0_5": n // 200, "gt_ln2": n // 400, "gt_1": n // 1000,
        "ratio_min": 0.6, "ratio_max": 1.7, "clip_c": 2.0, "clip_count": n // 1000,
        "error": None,
    }  # fmt: skip


def build_store(root: Path, steps: int, seed: int = 0) -> dict[str, dict]:
    """Refs with mismatch sums under root (a store marker too); returns the documents."""
    rng = random.Random(seed)
    (root / "refs" / "bundles").mkdir(parents=True)
    (root / "results").mkdir()
    (root / "TRAJSTORE_STORE").write_text("trajstore store\n")
    docs: dict[str, dict] = {"manifest": {"format_version": "2.0.0"}, "expected": {}}
    clock = 1_800_000_000_000_000_000
    for i in range(steps):
        rollout, step = divmod(i, 4)
        ranks = [0, 1] if rng.random() < 0.1 else [None]
        drift = 1.0 + (4.0 if i > steps * 0.7 else 0.0)
        for rank in ranks:
            n = rng.randint(2000, 8000)
            index_hash = f"idx-{i}-{rank}"
            docs[index_hash] = {
                "bundle_id": f"replay-{rollout}-{step}",
                "identity": {"actor_step_id": {"rollout_id": rollout, "step_id": step}},
                "samples": [{"sample_id": f"s-{j}", "response_length": 100,
                             "total_length": 300, "loss_mask": [1] * 4} for j in range(8)],
                "config": {},
            }  # fmt: skip
            per_layer = [int(n * 0.01 * drift * rng.random()) for _ in range(LAYERS)]
            mismatch = {
                "version": 1,
                "pairs": {pair: _pair(rng, n) for pair in ("old", "current", "train")},
                "routes": {
                    "valid_tokens": n, "valid_token_layers": n * LAYERS,
                    "mismatches": sum(per_layer), "missing_slots": sum(per_layer),
                    "mismatched_tokens": min(n, sum(per_layer)), "top_k": TOPK,
                    "per_layer_mismatches": per_layer,
                    "per_layer_valid_token_layers": [n] * LAYERS, "error": None,
                },
                "worst": {"old": [{"sample_id": "s-3", "position": 3, "offset": 17,
                                   "rollout": -1.2, "trainer": -0.4, "abs_dlogp": 0.8}]},
                "document": "doc",
            }  # fmt: skip
            clock += 1000
            ref = {
                "ref_version": 1, "key": f"bench/step-{rollout}-{step}/rank-{rank}/a1",
                "run": "bench", "kind": "step", "rollout_id": rollout, "step_id": step,
                "rank": rank, "cohort_ranks": [r for r in ranks if r is not None],
                "attempt": 1, "bundle_id": f"replay-{rollout}-{step}",
                "format_version": "2.0.0", "content_digest": "0" * 64,
                "published_at": "2026-11-30T01:02:03Z",
                "documents": {"manifest": "manifest", "index": index_hash,
                              "expected": "expected"},
                "payloads": {}, "physical_bytes": 0, "mismatch": mismatch,
            }  # fmt: skip
            (root / "refs" / "bundles" / f"{clock:020d}-1-00.json").write_text(json.dumps(ref))
    return docs


def whole_command(argv: list[str], repeat: int) -> tuple[float, list[float]]:
    """Median wall seconds of `trajstore ARGV` in a fresh interpreter, and each run's."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "trajstore", *argv], capture_output=True, text=True
        )
        times.append(time.perf_counter() - t0)
        if proc.returncode not in (0, 1):
            raise SystemExit(f"trajstore {' '.join(argv)} failed: {proc.stderr}")
    return statistics.median(times), times


def serve(store: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "TRAJSTORE_API_TOKEN"}
    argv = [sys.executable, "-m", "trajstore", "serve", "--store", str(store)]
    proc = subprocess.Popen([*argv, "--port", str(port), "--log-level", "warning"], env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"{base}/v1/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("trajstore serve did not start")
        time.sleep(0.2)


def p99_ms(
    client: httpx.Client, path: str, params: dict, n: int
) -> tuple[float, float, list[float]]:
    """(median, p99, the p99 of each third of the requests in the order made: the spread
    the verdict rule reads) in milliseconds."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = client.get(path, params=params)
        times.append((time.perf_counter() - t0) * 1000)
        r.raise_for_status()
    thirds = [sorted(times[i::3]) for i in range(3)]
    times.sort()

    def p99(sample: list[float]) -> float:
        return sample[max(0, int(len(sample) * 0.99) - 1)]

    return statistics.median(times), p99(times), [p99(t) for t in thirds if t]


#: the heat map's columns the web view asks for on a 1,200 px page (app.js HEAT_CELL_PX)
PAGE_BINS = (1200 - 62) // 2


def chart_fetch_s(client: httpx.Client, metric: str) -> dict[str, float | int]:
    """What the web view's mismatch page fetches, timed by part: every page of one
    metric (limit=1000) and the heat map in PAGE_BINS columns; and, for comparison, the
    heat map with a column for every step (what the page fetched before it asked for
    bins)."""
    t0 = time.perf_counter()
    rows, cursor = 0, None
    while True:
        params = {"metric": metric, "limit": 1000, **({"cursor": cursor} if cursor else {})}
        page = client.get("/v1/runs/bench/mismatch", params=params).json()
        rows += len(page["items"])
        cursor = page["next_cursor"]
        if not cursor:
            break
    t1 = time.perf_counter()
    binned = client.get("/v1/runs/bench/mismatch/layers", params={"bins": PAGE_BINS}).json()
    t2 = time.perf_counter()
    every = client.get("/v1/runs/bench/mismatch/layers").json()
    t3 = time.perf_counter()
    return {
        "rows": rows,
        "rows_s": t1 - t0,
        "binned_cells": len(binned["items"]),
        "binned_s": t2 - t1,
        "cells": len(every["items"]),
        "cells_s": t3 - t2,
    }


def make_bundles(root: Path, count: int, samples: int, resp: int, prompt: int) -> list[Path]:
    from trajstore.bundle.writer import BundleContents, write_bundle

    rng = np.random.default_rng(0)
    out = []
    for b in range(count):
        total = samples * (resp + prompt)
        # rows drawn from 64 distinct top-k sets (valid routes, some dedup as in real runs)
        routes = np.stack([rng.permutation(EXPERTS)[:TOPK] for _ in range(64)]).astype(np.uint8)[
            rng.integers(0, 64, (total, LAYERS))
        ]
        train = routes.copy()
        flip = rng.random((total, LAYERS)) < 0.05
        train[flip] = routes[rng.integers(0, total), 0]
        lp = -rng.uniform(0.01, 3, samples * resp).astype(np.float32)
        payloads = {
            "rollout_routed_experts": routes,
            "train_routed_experts": train,
            "rollout_log_probs": lp,
            **{
                name: (lp + rng.normal(0, 0.02, lp.size)).astype(np.float32)
                for name in ("old_log_probs", "log_probs", "train_log_probs")
            },
        }
        c = BundleContents(
            bundle_id=f"bench-{b}",
            identity={"actor_step_id": {"rollout_id": b, "step_id": 0}, "rollout_id": None},
            samples=[
                {"sample_id": f"s-{i}", "group_index": i // 8, "response_length": resp,
                 "total_length": resp + prompt, "loss_mask": [1] * resp, "reward": 0.0}
                for i in range(samples)
            ],
            config={"advantage_estimator": "grpo", "is_clip_max": 2.0,
                    "router": {"num_experts": EXPERTS, "num_layers": LAYERS, "top_k": TOPK}},
            payloads=payloads,
            expected={},
            producer={"commit": "bench", "dirty_patch_digest": "", "torch_version": "2"},
        )  # fmt: skip
        out.append(write_bundle(root / f"b{b}", c))
    return out


def ingest_s(store: Path, bundles: list[Path]) -> float:
    from trajstore.store import Store

    t0 = time.perf_counter()
    with Store.open(store) as st:
        outcomes = st.ingest(bundles, run="bench")
    assert all(o.status == "published" for o in outcomes), outcomes
    return time.perf_counter() - t0


def ingest_ratio(root: Path, args: argparse.Namespace) -> tuple[float, float, list[float]]:
    """(median seconds with the sums, median ratio, the ratio of each pair): --repeats
    pairs, each an ingest with the sums then one without, into fresh stores."""
    import trajstore.store.ingest_write as ingest
    from trajstore.mismatch.compute import not_computed

    if args.capture is not None:
        bundles = sorted(p.parent for p in args.capture.rglob("manifest.json"))
        if not bundles:
            raise SystemExit(f"--capture {args.capture}: no bundle (manifest.json) under it")
    else:
        bundles = make_bundles(root / "in", args.ingest_bundles, args.samples, args.resp, 256)
    real = ingest.bundle_entry
    stub = lambda put, payloads, index: not_computed("bench: not computed")  # noqa: E731
    with_s, ratios = [], []
    for i in range(args.repeats):
        ingest.bundle_entry = real
        with_s.append(ingest_s(root / f"with-{i}", bundles))
        ingest.bundle_entry = stub
        ratios.append(with_s[-1] / ingest_s(root / f"without-{i}", bundles))
    ingest.bundle_entry = real
    return statistics.median(with_s), statistics.median(ratios), ratios


def query_figures(tmp: Path, args: argparse.Namespace) -> tuple[list[dict], dict]:
    """Parts 1 and 2 on a store of --steps refs: (their figures, the chart fetch's parts)."""
    size = {"workload": args.steps, "target_workload": 10_000}
    root = tmp / "store"
    docs = build_store(root, args.steps)
    from trajstore.catalog import open_catalog, sync_catalog

    t0 = time.perf_counter()
    with open_catalog(root) as cat:
        sync_catalog(cat, root, docs.__getitem__)
    print(f"{args.steps} steps synced in {time.perf_counter() - t0:.1f} s")
    base = ["query", "mismatch", "--store", str(root), "--run", "bench"]
    top, top_runs = whole_command([*base, "--top", "20"], args.commands)
    first, first_runs = whole_command([*base, "--first-above", "0.03"], args.commands)
    print(f"query mismatch --top 20: {top:.3f} s whole command (target <= 0.3 s)")
    print(f"query mismatch --first-above: {first:.3f} s whole command (target <= 0.3 s)")
    proc, url = serve(root)
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            rest = []
            for what, params in (("?top=20", {"top": 20}), ("?limit=100", {"limit": 100})):
                med, p99, thirds = p99_ms(client, "/v1/runs/bench/mismatch", params, args.requests)
                print(f"REST mismatch{what}: median {med:.1f} ms, p99 {p99:.1f} ms (<= 50 ms)")
                rest.append((p99, what, med, thirds))
            chart = chart_fetch_s(client, "old_kl_k3")
            print(
                f"web chart data: {chart['rows']} steps in {chart['rows_s']:.2f} s + the heat "
                f"map in {PAGE_BINS} columns ({chart['binned_cells']} cells) in "
                f"{chart['binned_s']:.2f} s; a column a step ({chart['cells']} cells) "
                f"{chart['cells_s']:.2f} s"
            )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    commands = [(top, "--top 20", top_runs), (first, "--first-above 0.03", first_runs)]
    return [
        *(
            harness.figure(
                f"`trajstore query mismatch {what}`, whole command wall time",
                "<= 0.3 s at 10,000 steps",
                wall,
                "s",
                reps=runs,
                **size,
                detail=f"median of {args.commands} fresh processes on {args.steps} steps",
            )
            for wall, what, runs in commands
        ),
        *(
            harness.figure(
                f"`GET /v1/runs/{{run}}/mismatch{what}` p99",
                "<= 50 ms at 10,000 steps",
                p99,
                "ms",
                reps=thirds,
                **size,
                detail=f"{args.requests} requests, median {med:.1f} ms; reps: each third's p99",
            )
            for p99, what, med, thirds in rest
        ),
    ], chart


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--commands", type=int, default=5, help="runs of each whole command")
    ap.add_argument("--ingest-bundles", type=int, default=8)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--resp", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ingest-only", action="store_true", help="only the ingest-cost figure")
    ap.add_argument("--capture", type=Path, help="the ingest figure on these bundles")
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="the tiny smoke sizes below")
    ap.add_argument("--json", type=Path, help="write the figures here (harness.py)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.ingest_bundles, args.requests, args.repeats = 200, 2, 20, 1
        args.commands = 2
    load_before = harness.load1()
    figures: list[dict] = []
    extra: dict = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        if not args.ingest_only:
            figures, extra["chart_fetch"] = query_figures(Path(tmp), args)
        with_s, ratio, pairs = ingest_ratio(Path(tmp), args)
        what = (
            f"the bundles of {args.capture}"
            if args.capture is not None
            else f"{args.ingest_bundles} MoE bundles (routes [T, 48, 8], four log-prob payloads)"
        )
        print(
            f"ingest of {what}: {with_s:.2f} s with the mismatch sums, {ratio:.3f}x the "
            f"ingest without them (target <= 1.05x; pairs {', '.join(f'{r:.3f}' for r in pairs)})"
        )
    figures.append(
        harness.figure(
            "ingest with the mismatch sums / without them",
            "<= 1.05x",
            ratio,
            "x",
            reps=pairs,
            detail=(
                f"{what}, median of {args.repeats} alternating pairs "
                f"({min(pairs):.3f}-{max(pairs):.3f}): {with_s:.2f} s with the sums"
            ),
        )
    )
    harness.emit(args.json, figures, load_before, **extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
