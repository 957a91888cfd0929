#!/usr/bin/env python
"""`trajstore ingest --from slime` against Hugging Face Xet on the same dump files (issue 31).

    .venv/bin/python scripts/bench/bench_slime_ingest.py [--quick] [--reps 5] [--json PATH]

A slime run is generated once (`trajstore.examples.slime_dumps`: ``--dump-details`` layout,
rollout and train dumps, routes ``[len(tokens) - 1, 48, 8]`` int32 over 128 experts, a
group's prompt routed identically, baseline mode so each train dump carries the routes
again). Then, alternating, each repetition stores those same files twice, each time into a
fresh empty target:

- **trajstore**: ``trajstore ingest --from slime DIR --store S --config args.txt`` run in
  this process (every dump loaded with the restricted unpickler and CRC-checked, converted to
  bundles, the bundles ingested: sample-aligned chunks, zstd, BLAKE3, packs, refs, catalog;
  durable: every pack and ref fsynced);
- **xet**: ``hf_xet.XetSession().new_upload_commit(endpoint="local://CAS")``, one
  ``start_upload_file(path, sha256=hf_xet.SKIP_SHA256)`` per dump, ``wait_to_finish()``
  (content-defined chunking, dedup, compression, xorbs and shards written to the local CAS
  directory; its cache directed to a temp dir), the time to write the CAS to disk included.

Reported: each side's median wall time over ``--reps`` (after one warm-up repetition
each), their ratio trajstore / xet (below 1: trajstore is faster) and its spread (min-max of
the per-repetition ratios); and physical / logical for both, logical being the dump files'
bytes: trajstore's physical is the bytes of every object the refs reach (``trajstore
stats``) and, apart, the store directory's bytes on disk (catalog, refs and packs); Xet's is
its CAS directory's bytes on disk, next to its own ``dedup_metrics``; and one more,
instrumented trajstore ingest split into its two phases (load + check + convert the
dumps and write their bundles to a temp directory; ingest those). `--quick`: a tiny
run, 2 repetitions (a smoke test, not a figure). The machine must be quiet for the
ratio to mean anything. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import forget_trajstore_caches, isolate, require_xet, run_xet, tree_bytes

FULL = [
    "--rollouts", "3", "--prompts", "8", "--n", "8", "--prompt-len", "512",
    "--response-len", "512", "--layers", "48", "--topk", "8", "--experts", "128",
    "--dp", "2", "--steps", "2", "--micro-batch", "4",
]  # fmt: skip
QUICK = [
    "--rollouts", "1", "--prompts", "2", "--n", "4", "--prompt-len", "128",
    "--response-len", "128", "--layers", "48", "--topk", "8", "--experts", "128",
    "--dp", "2", "--steps", "1", "--micro-batch", "2",
]  # fmt: skip


def dump_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.pt") if p.is_file())


def run_trajstore(dumps: Path, store: Path) -> dict[str, Any]:
    from trajstore.cli import main
    from trajstore.store import Store
    from trajstore.store.maintenance import stats

    argv = ["ingest", "--from", "slime", str(dumps), "--store", str(store), "--run", "bench"]
    argv += ["--config", str(dumps / "args.txt"), "--json"]
    sink = io.StringIO()
    forget_trajstore_caches()  # as a new process would start
    start = time.perf_counter()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(io.StringIO()):
        code = main(argv)
    wall = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"trajstore ingest exited {code}: {sink.getvalue()[-400:]}")
    with Store.open(store) as s:
        st = stats(s)
    return {
        "wall_s": wall,
        "physical_bytes": st["physical_bytes"],
        "bundle_logical_bytes": st["logical_bytes"],
        "store_dir_bytes": tree_bytes(store),
    }


def phases(dumps: Path, store: Path) -> dict[str, float]:
    """One instrumented trajstore ingest, phase by phase (what the CLI path does in turn):
    load + check + convert the dumps and write their bundles to a temp directory (`stage`),
    then ingest those (`ingest_staged`)."""
    from trajstore.integrations import formats
    from trajstore.store import Store

    start = time.perf_counter()
    staged = formats.stage("slime", [str(dumps)], run="bench", config=str(dumps / "args.txt"))
    try:
        written = time.perf_counter()
        with Store.open(store) as s:
            formats.ingest_staged(s, staged)
        done = time.perf_counter()
    finally:
        staged.cleanup()
    return {
        "load_check_convert_write_bundles_s": round(written - start, 4),
        "store_ingest_s": round(done - written, 4),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny run, 2 repetitions")
    ap.add_argument("--reps", type=int, default=None, help="measured repetitions (default 5)")
    ap.add_argument("--json", type=Path, default=None, help="also write the result here")
    ap.add_argument("--workdir", type=Path, default=None, help="where to generate (a temp dir)")
    args = ap.parse_args(argv)
    require_xet()
    reps = args.reps or (2 if args.quick else 5)
    work = Path(tempfile.mkdtemp(prefix="bench-slime-", dir=args.workdir))
    isolate(work)  # Xet's cache in the temp dir, never the user's
    try:
        from trajstore.examples import slime_dumps

        dumps = work / "dumps"
        gen = QUICK if args.quick else FULL
        with contextlib.redirect_stdout(io.StringIO()):
            slime_dumps.main([str(dumps), *gen, "--seed", "1"])
        files = dump_files(dumps)
        logical = sum(p.stat().st_size for p in files)
        sides: dict[str, list[dict[str, Any]]] = {"trajstore": [], "xet": []}
        for rep in range(reps + 1):  # repetition 0 warms both up and is dropped
            order = ("trajstore", "xet") if rep % 2 == 0 else ("xet", "trajstore")
            for side in order:
                target = work / f"{side}-{rep}"
                if side == "trajstore":
                    got = run_trajstore(dumps, target)
                else:
                    got = run_xet(files, target)
                shutil.rmtree(target, ignore_errors=True)
                if rep:
                    sides[side].append(got)
        breakdown = phases(dumps, work / "phases-store")
        shutil.rmtree(work / "phases-store", ignore_errors=True)
        ratios = [
            t["wall_s"] / x["wall_s"] for t, x in zip(sides["trajstore"], sides["xet"], strict=True)
        ]
        t_med = statistics.median(r["wall_s"] for r in sides["trajstore"])
        x_med = statistics.median(r["wall_s"] for r in sides["xet"])
        last_t, last_x = sides["trajstore"][-1], sides["xet"][-1]
        result = {
            "workload": {
                "generator": "trajstore.examples.slime_dumps " + " ".join(gen),
                "dump_files": len(files),
                "dump_bytes": logical,
                "reps": reps,
                "quick": args.quick,
            },
            "trajstore": {
                "median_wall_s": round(t_med, 4),
                "walls_s": [round(r["wall_s"], 4) for r in sides["trajstore"]],
                "physical_bytes": last_t["physical_bytes"],
                "store_dir_bytes": last_t["store_dir_bytes"],
                "physical_over_logical": round(last_t["physical_bytes"] / logical, 4),
                "store_dir_over_logical": round(last_t["store_dir_bytes"] / logical, 4),
                "bundle_logical_bytes": last_t["bundle_logical_bytes"],
                "phases_one_run": breakdown,
            },
            "xet": {
                "median_wall_s": round(x_med, 4),
                "walls_s": [round(r["wall_s"], 4) for r in sides["xet"]],
                "cas_dir_bytes": last_x["cas_dir_bytes"],
                "physical_over_logical": round(last_x["cas_dir_bytes"] / logical, 4),
                "dedup_metrics": last_x["dedup_metrics"],
            },
            "time_ratio_trajstore_over_xet": {
                "of_medians": round(t_med / x_med, 3),
                "per_rep_min": round(min(ratios), 3),
                "per_rep_max": round(max(ratios), 3),
            },
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
