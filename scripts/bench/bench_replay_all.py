#!/usr/bin/env python
"""Replay at scale on a 10,000-step generated store: replay-all throughput, queries, lookups, REST.

    .venv/bin/python scripts/bench/bench_replay_all.py --store DIR  # a store from make_big_store.py
    .venv/bin/python scripts/bench/bench_replay_all.py --build DIR
        [--steps 10000 --samples 256 --mean-tokens 64]

In one run (same process, same machine state), on the store:

1. replay-all throughput (bundles/s) of `trajstore.replay.batch.replay_all`
   with workers=1 and workers=2 (record=False) over the bundles of
   `--rollouts K` rollout ids (their rollout bundles and steps), and as the
   baseline the same bundles exported to directories (`export_bundles`) and
   replayed from there (`open_target` + `replay_sources`, one process);
   ratio = store bundles/s / directory bundles/s. Store replay of a step also
   replays its rollout bundle (linkage), the directory replay does not; an
   in-process `replay_stored(link=False)` line isolates that;
2. `replay_all(workers=2, record=True)` over the whole store (also checked:
   the divergence query returns exactly the injected rollouts' steps);
3. divergence query `query_steps(first_divergent_stage=...)` latency p50/p99
   on an open catalog, and `trajstore query steps` end to end once;
4. lookup by actor step id: `Store.step` and `catalog.lookup_step`, p50/p99;
5. REST: `trajstore serve` on the store, p50/p99 of
   GET /v1/runs/{run}/steps/{r}:{s}, and payload download vs torch.load.

`--cold` drops the page cache (`sync; echo 3 > /proc/sys/vm/drop_caches`,
root only; the run stops if it cannot) before each replay throughput run, before
the server starts and before the first payload download, so those figures are
cold; without it they are warm. `--json OUT` writes the figures (harness.py) with every
measurement under "results".

Targets (issues 5 and 6): divergence query <= 100 ms, lookup <= 10 ms,
replay-all >= 10 bundles/s per worker on 256-sample bundles, step GET p99 <= 10 ms.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
import numpy as np
from harness import emit, figure, load1, machine_line, say

from trajstore.store import Store, export_bundles


def pct(xs: list[float]) -> str:
    ms = np.asarray(xs) * 1e3
    return f"p50 {np.percentile(ms, 50):.2f} ms, p99 {np.percentile(ms, 99):.2f} ms (n={len(ms)})"


RESULTS: dict = {}
COLD = False


def quantiles(xs: list[float]) -> dict:
    ms = np.asarray(xs) * 1e3
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "max_ms": float(ms.max()),
        "n": len(ms),
    }


def drop_caches() -> None:
    """Empty the page cache (when --cold) so the next read comes from the disk."""
    if not COLD:
        return
    harness.drop_caches()


def dir_baseline(
    store_root: Path, run: str, lo: int, hi: int, scratch: Path
) -> tuple[int, float, float, dict]:
    """Export every bundle of rollouts [lo, hi] and replay the directories.

    Returns (n, export s, replay s, statuses).
    """
    from trajstore.bundle.reader import open_target
    from trajstore.replay.runner import replay_sources

    store = Store.open(store_root, create=False)
    groups = []
    for r in range(lo, hi + 1):
        groups.append((f"rollout-{r}", store.rollout(run, r)))
        for s in sorted(
            {
                e.step_id
                for e in store.refs.live().values()
                if e.kind == "step" and e.rollout_id == r
            }
        ):
            groups.append((f"{r}-{s}", store.step(run, r, s)))
    t0 = time.perf_counter()
    dirs = [export_bundles(bs, scratch / name) for name, bs in groups]
    t_export = time.perf_counter() - t0
    statuses: dict[str, int] = {}
    store.close()
    drop_caches()
    t0 = time.perf_counter()
    for d in dirs:
        rep = replay_sources(open_target(d).bundles, label=d.name)
        statuses[rep.status] = statuses.get(rep.status, 0) + 1
    t_replay = time.perf_counter() - t0
    return len(dirs), t_export, t_replay, statuses


def stored_nolink(store_root: Path, run: str, lo: int, hi: int) -> tuple[int, float]:
    from trajstore.replay.from_store import Target, replay_stored

    store = Store.open(store_root, create=False)
    targets = []
    for r in range(lo, hi + 1):
        targets.append(Target(run=run, rollout=r))
        for s in sorted(
            {
                e.step_id
                for e in store.refs.live().values()
                if e.kind == "step" and e.rollout_id == r
            }
        ):
            targets.append(Target(run=run, step=(r, s)))
    drop_caches()
    t0 = time.perf_counter()
    for t in targets:
        replay_stored(store, t, link=False)
    dt = time.perf_counter() - t0
    store.close()
    return len(targets), dt


def bench_api(
    root: Path, run: str, steps: list[tuple[int, int]], requests: int, scratch: Path
) -> None:
    import httpx
    from bench_api import time_downloads  # beside this script

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    drop_caches()
    t0 = time.perf_counter()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trajstore",
            "serve",
            "--store",
            str(root),
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
    )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as c:
            while True:
                try:
                    if c.get("/v1/health").status_code == 200:
                        break
                except httpx.TransportError:
                    if server.poll() is not None or time.perf_counter() - t0 > 600:
                        raise SystemExit("server did not start") from None
                    time.sleep(0.2)
            RESULTS["server_ready_s"] = time.perf_counter() - t0
            say(
                f"server ready in {RESULTS['server_ready_s']:.1f} s "
                "(startup: catalog snapshot + view)"
            )
            # first touch of every step (in random order): the server reads each step's samples
            # from the store
            drop_caches()
            order = list(steps)
            random.Random(2).shuffle(order)
            lat = []
            for r, s in order:
                t = time.perf_counter()
                resp = c.get(f"/v1/runs/{run}/steps/{r}:{s}")
                lat.append(time.perf_counter() - t)
                assert resp.status_code == 200, resp.text[:300]
            RESULTS["get_step_first"] = quantiles(lat)
            say(
                f"GET /v1/runs/{run}/steps/R:S, first touch of each of {len(order)} steps "
                f"({'cold page cache' if COLD else 'warm page cache'}): {pct(lat)}; load {load1()}"
            )
            rng = random.Random(1)
            ids = [rng.choice(steps) for _ in range(requests)]
            for r, s in ids[:200]:
                c.get(f"/v1/runs/{run}/steps/{r}:{s}")
            lat, size = [], 0
            for r, s in ids:
                t = time.perf_counter()
                resp = c.get(f"/v1/runs/{run}/steps/{r}:{s}")
                lat.append(time.perf_counter() - t)
                assert resp.status_code == 200, resp.text[:300]
                size = len(resp.content)
            RESULTS["get_step"] = {**quantiles(lat), "body_bytes": size}
            say(
                f"GET /v1/runs/{run}/steps/R:S, {requests} random steps (after warm-up): "
                f"{pct(lat)}; body {size} bytes; load {load1()}"
            )

            r, s = steps[0]
            store = Store.open(root, create=False)
            (b,) = store.step(run, r, s)
            d = export_bundles([b], scratch / "api-export")
            store.close()
            pt = d / "payloads" / "log_probs.pt"
            url = f"/v1/bundles/{b.bundle_key}/payloads/log_probs"
            import torch

            drop_caches()  # first download vs first torch.load, both from the disk when --cold
            t = time.perf_counter()
            torch.load(pt, weights_only=True)
            t_load0 = time.perf_counter() - t
            t = time.perf_counter()
            c.get(url, params={"format": "raw"}).raise_for_status()
            t_get0 = time.perf_counter() - t
            loads, gets, nbytes = time_downloads(c, url, pt, 20)
            kb = nbytes / 1e3
            tl = float(np.median(loads))
            RESULTS["download"] = {
                "bytes": nbytes,
                "first_load_ms": t_load0 * 1e3,
                "first_get_ms": t_get0 * 1e3,
                "first_ratio": t_load0 / t_get0,
                "load_ms": tl * 1e3,
                **{f"{fmt}_ms": float(np.median(ts)) * 1e3 for fmt, ts in gets.items()},
                **{f"{fmt}_ratio": tl / float(np.median(ts)) for fmt, ts in gets.items()},
            }
            parts = [f"GET {fmt} {tl / float(np.median(ts)):.2f}x" for fmt, ts in gets.items()]
            say(
                f"payload log_probs {kb:.0f} kB: first (after the cache drop) torch.load "
                f"{t_load0 * 1e3:.2f} ms, GET raw {t_get0 * 1e3:.2f} ms = "
                f"{t_load0 / t_get0:.2f}x; repeated: torch.load {tl * 1e3:.2f} ms; ratio "
                f"torch.load/GET: {', '.join(parts)}"
            )
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument(
        "--store",
        type=Path,
        help="an existing store built by make_big_store.py (truth file beside it)",
    )
    g.add_argument("--build", type=Path, help="build the store here first (make_big_store)")
    ap.add_argument("--steps", type=int, default=10000)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--mean-tokens", type=int, default=64)
    ap.add_argument("--small", action="store_true")
    ap.add_argument(
        "--distinct",
        action="store_true",
        help="--build: every bundle its own content (no templates)",
    )
    ap.add_argument("--steps-per-rollout", type=int, default=8)
    ap.add_argument("--fault-every", type=int, default=97)
    ap.add_argument("--clip-every", type=int, default=89)
    ap.add_argument(
        "--cold", action="store_true", help="drop the page cache before each cold figure (root)"
    )
    ap.add_argument("--json", type=Path, help="write the results here as JSON")
    ap.add_argument(
        "--rollouts",
        type=int,
        default=10,
        help="rollout ids whose bundles the throughput runs replay",
    )
    ap.add_argument("--queries", type=int, default=50)
    ap.add_argument("--lookups", type=int, default=500)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument(
        "--skip-record",
        action="store_true",
        help="reuse recorded results (replay-all --record already ran)",
    )
    ap.add_argument("--skip-api", action="store_true")
    args = ap.parse_args()
    global COLD
    COLD = args.cold
    if COLD:
        drop_caches()  # fail early when not allowed

    load_before = load1()
    say(f"machine: {machine_line()}, date {time.strftime('%Y-%m-%d %H:%M')}, load {load_before}")
    if args.build:
        import make_big_store

        truth = make_big_store.make_store(
            args.build,
            steps=args.steps,
            samples=args.samples,
            mean_tokens=args.mean_tokens,
            small=args.small,
            distinct=args.distinct,
            per_rollout=args.steps_per_rollout,
            fault_every=args.fault_every,
            clip_every=args.clip_every,
            progress=sys.stderr.isatty(),
        )
        say(f"built {truth['bundles']} bundles in {truth['build_seconds']} s; load {load1()}")
        root = args.build
        (root.parent / f"{root.name}.truth.json").write_text(json.dumps(truth, indent=1) + "\n")
    else:
        root = args.store
        truth = json.loads((root.parent / f"{root.name}.truth.json").read_text())
    run = truth["run"]
    RESULTS.update(
        truth=truth,
        cold=COLD,
        store_bytes=sum(f.stat().st_size for f in root.rglob("*") if f.is_file()),
    )
    say(
        f"store {root}: {truth['bundles']} bundles = {truth['steps']} steps + {truth['rollouts']} "
        f"rollouts, {truth['samples_per_bundle']} samples and "
        f"{truth['response_tokens_per_bundle']} response tokens per bundle; faulty rollouts "
        f"{len(truth['faulty_rollouts'])}, wrong-clip steps {len(truth['clip_steps'])}"
    )

    from trajstore.catalog import lookup_step, query_steps
    from trajstore.replay.batch import replay_all

    scratch = Path(tempfile.mkdtemp(prefix="bench-replay-all-", dir=root.parent))
    try:
        # -- 1. throughput: a rollout range holding clean and faulty rollouts
        f0 = truth["faulty_rollouts"][0]
        lo, hi = f0 - args.rollouts // 2, f0 - args.rollouts // 2 + args.rollouts - 1
        n_dir, t_exp, t_dir, st_dir = dir_baseline(root, run, lo, hi, scratch)
        dir_bps = n_dir / t_dir
        RESULTS["dir"] = {"bundles": n_dir, "seconds": t_dir, "bps": dir_bps, "statuses": st_dir}
        say(
            f"[dir]   export {n_dir} bundles (rollouts {lo}..{hi}) {t_exp:.1f} s; replay from "
            f"directories {t_dir:.1f} s = {dir_bps:.1f} bundles/s (1 process) {st_dir}; load "
            f"{load1()}"
        )
        n_nl, t_nl = stored_nolink(root, run, lo, hi)
        RESULTS["stored_nolink"] = {"bundles": n_nl, "seconds": t_nl, "bps": n_nl / t_nl}
        say(
            f"[store] replay_stored(link=False) in process: {n_nl / t_nl:.1f} bundles/s "
            f"({n_nl / t_nl / dir_bps:.2f}x dir); load {load1()}"
        )
        for w in (1, 2):
            drop_caches()
            s = replay_all(
                root,
                run=run,
                rollout_from=lo,
                rollout_to=hi,
                workers=w,
                record=False,
                progress=False,
            )
            bps = s.total / s.seconds
            RESULTS[f"replay_all_w{w}"] = {
                "bundles": s.total,
                "seconds": s.seconds,
                "bps": bps,
                "per_worker": bps / w,
                "passed": s.passed,
                "diverged": s.diverged,
                "refused": s.refused,
            }
            say(
                f"[store] replay_all workers={w}: {s.total} bundles in {s.seconds:.1f} s = "
                f"{bps:.1f} bundles/s ({bps / w:.1f} per worker), ratio to directories "
                f"{bps / dir_bps:.2f}x; pass {s.passed} diverged {s.diverged} refused "
                f"{s.refused}; load {load1()}"
            )

        # -- 2. replay --all --record over the whole store
        if not args.skip_record:
            s = replay_all(root, workers=2, record=True, progress=sys.stderr.isatty())
            RESULTS["record"] = {
                "bundles": s.total - s.skipped,
                "seconds": s.seconds,
                "bps": (s.total - s.skipped) / s.seconds,
                "histogram": dict(s.histogram),
            }
            say(
                f"[store] replay_all --record workers=2, whole store: {s.total} bundles "
                f"({s.skipped} already recorded) in {s.seconds:.0f} s = "
                f"{(s.total - s.skipped) / s.seconds:.1f} bundles/s; histogram "
                f"{dict(s.histogram)}; refused {s.refused}; load {load1()}"
            )

        # -- 3. divergence query
        store = Store.open(root, create=False)
        t0 = time.perf_counter()
        with store.catalog() as cat:
            say(f"catalog open + sync: {time.perf_counter() - t0:.1f} s")
            want = {
                (r, s) for r in truth["faulty_rollouts"] for s in range(truth["steps_per_rollout"])
            }
            want = {(r, s) for r, s in want if r * truth["steps_per_rollout"] + s < truth["steps"]}
            page = query_steps(
                cat, run=run, first_divergent_stage="reward.post_process", limit=1000
            )
            got = {(i["rollout_id"], i["step_id"]) for i in page["items"]}
            roots = {i["root_bundle_key"] for i in page["items"]}
            clip = query_steps(cat, run=run, first_divergent_stage="loss.policy", limit=1000)
            got_clip = {(i["rollout_id"], i["step_id"]) for i in clip["items"]}
            RESULTS["truth_check"] = {
                "reward_steps": got == want,
                "clip_steps": got_clip == {tuple(x) for x in truth["clip_steps"]},
                "rooted": all(k and "/rollout-" in k for k in roots),
            }
            say(
                f"query reward.post_process: {len(got)} steps, exactly the injected rollouts' "
                f"steps: {got == want}; rooted in rollout bundles: "
                f"{all(k and '/rollout-' in k for k in roots)}; loss.policy: {len(got_clip)} "
                "steps, exactly the wrong-clip steps: "
                f"{got_clip == {tuple(x) for x in truth['clip_steps']}}"
            )
            lat = []
            for _ in range(args.queries):
                t = time.perf_counter()
                query_steps(cat, run=run, first_divergent_stage="reward.post_process", limit=1000)
                lat.append(time.perf_counter() - t)
            RESULTS["query"] = quantiles(lat)
            say(
                f"query_steps(first_divergent_stage=reward.post_process, limit=1000): {pct(lat)}; "
                f"load {load1()}"
            )
            lat = []
            for _ in range(args.queries):
                t = time.perf_counter()
                query_steps(cat, run=run, first_divergent_stage="reward.post_process")
                lat.append(time.perf_counter() - t)
            say(
                "query_steps(first_divergent_stage=reward.post_process) first page of 100: "
                f"{pct(lat)}"
            )

            # -- 4. lookup by actor step id
            rng = random.Random(0)
            spr = truth["steps_per_rollout"]
            ids = [divmod(rng.randrange(truth["steps"]), spr) for _ in range(args.lookups)]
            lat = []
            for r, s in ids:
                t = time.perf_counter()
                rows = lookup_step(cat, run, r, s)
                lat.append(time.perf_counter() - t)
                assert len(rows) == 1
            RESULTS["lookup_step"] = quantiles(lat)
            say(f"catalog.lookup_step: {pct(lat)}; load {load1()}")
        lat = []
        for r, s in ids:
            t = time.perf_counter()
            (b,) = store.step(run, r, s)
            lat.append(time.perf_counter() - t)
        RESULTS["store_step"] = quantiles(lat)
        say(f"Store.step (refs, no catalog): {pct(lat)}; load {load1()}")
        store.close()
        t = time.perf_counter()
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "trajstore",
                "query",
                "steps",
                "--store",
                str(root),
                "--run",
                run,
                "--first-divergent-stage",
                "reward.post_process",
                "--format",
                "json",
            ],
            capture_output=True,
            text=True,
        )
        say(
            "`trajstore query steps --first-divergent-stage reward.post_process` end to end: "
            f"{time.perf_counter() - t:.2f} s wall (exit {out.returncode}, process start + "
            "catalog open included)"
        )

        # -- 5. REST
        if not args.skip_api:
            steps = [divmod(i, spr) for i in range(truth["steps"])]
            bench_api(root, run, steps, args.requests, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    say(f"done; load {load1()}")
    emit(args.json, figures(RESULTS, args), load_before, results=RESULTS)
    return 0


def figures(res: dict, args: argparse.Namespace) -> list[dict]:
    """Issue 5's replay-all throughput and issue 6's step GET p99 (at the store's size)."""
    truth = res["truth"]
    spb, steps = truth["samples_per_bundle"], truth["steps"]
    cold = "cold" if res["cold"] else "warm"
    w1, w2 = res["replay_all_w1"], res["replay_all_w2"]
    per_tok = truth["response_tokens_per_bundle"] / spb
    out = [
        figure(
            "replay-all per worker, the slower of 1 and 2 workers",
            ">= 10 bundles/s per worker with 256-sample bundles",
            min(w1["per_worker"], w2["per_worker"]),
            "bundles/s",
            workload=spb,
            target_workload=256,
            detail=(
                f"{cold} cache, distinct bundles of {spb} samples x ~{per_tok:.0f} tokens: "
                f"{w1['per_worker']:.2f}/s with 1 worker, {w2['per_worker']:.2f}/s per worker "
                f"with 2; exported directories {res['dir']['bps']:.2f}/s in 1 process; "
                f"pass {w2['passed']}, diverged {w2['diverged']}"
            ),
        )
    ]
    if "get_step" in res:
        gs, gf = res["get_step"], res["get_step_first"]
        out.append(
            figure(
                "`GET /v1/runs/{run}/steps/{r}:{s}` p99, repeated and first touch (the worse)",
                "<= 10 ms at 10,000 steps",
                max(gs["p99_ms"], gf["p99_ms"]),
                "ms",
                workload=steps,
                target_workload=10_000,
                detail=(
                    f"{steps} steps: {gs['n']} random requests p99 {gs['p99_ms']:.2f} ms; first "
                    f"touch of each step ({cold}) p99 {gf['p99_ms']:.2f} ms"
                ),
            )
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
