#!/usr/bin/env python
"""The integrity gate alone, per bundle: `open_target` + `bundle_problems` (what ingest's
`Ingestor.gate` runs), over every bundle under the given capture directories.

    .venv/bin/python scripts/bench/bench_gate.py DIR [DIR...] [--reps 5] [--profile out.prof]
    .venv/bin/python scripts/bench/bench_gate.py DIR --compare /tmp/old-tree [--rounds 3]
    .venv/bin/python scripts/bench/bench_gate.py DIR --parts

`--parts` prints the CPU ms per bundle of each step of the gate on its own (best of
`--reps`): index.json parse, sample records, sample checks, payload read + sha256, .pt parse.

Prints per-bundle wall ms and CPU ms (time.process_time), medians over `--reps` passes.
`--compare TREE` runs this script alternately under TREE (a checkout whose `trajstore`
package is the baseline, e.g. `git archive HEAD trajstore | tar -x -C TREE`) and under
the working tree, `--rounds` times each, and prints the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def targets_of(dirs: list[Path]) -> list[Path]:
    """Every bundle and cohort under `dirs`, as ingest finds them."""
    from trajstore.bundle.capture_dir import discover_targets

    return [t for d in dirs for t in discover_targets(d)]


def measure(targets: list[Path], reps: int, profile: str | None) -> dict:
    from trajstore.bundle.checks import bundle_problems
    from trajstore.bundle.reader import open_target

    def one_pass() -> None:
        for t in targets:
            bset = open_target(t)
            for b in bset.bundles:
                problems = bundle_problems(b)
                if problems:
                    raise SystemExit(f"{t}: {problems[0]}")

    one_pass()  # warm the page cache and imports
    if profile:
        import cProfile

        cProfile.runctx("one_pass()", globals(), {"one_pass": one_pass}, profile)
    wall, cpu = [], []
    for _ in range(reps):
        w0, c0 = time.perf_counter(), time.process_time()
        one_pass()
        wall.append((time.perf_counter() - w0) * 1e3 / len(targets))
        cpu.append((time.process_time() - c0) * 1e3 / len(targets))
    return {
        "bundles": len(targets),
        "wall_ms": statistics.median(wall),
        "cpu_ms": statistics.median(cpu),
    }


def parts(targets: list[Path], reps: int) -> None:
    from trajstore.bundle.checks import bundle_problems, payload_problems, sample_problems
    from trajstore.bundle.ptfile import read_pt_bytes
    from trajstore.bundle.reader import _read_docs, open_target
    from trajstore.jsonio import parse_json
    from trajstore.schema import Index

    def best(name: str, fn) -> None:  # noqa: ANN001
        fn(targets[0])
        times = []
        for _ in range(reps):
            c0 = time.process_time()
            for t in targets:
                fn(t)
            times.append((time.process_time() - c0) * 1e3 / len(targets))
        print(f"{name:34s} {min(times):.3f} ms CPU per bundle")

    index = {t: (t / "index.json").read_bytes() for t in targets}
    parsed = {t: parse_json(index[t], "index.json") for t in targets}
    opened = {t: open_target(t).first for t in targets}
    payloads = {t: [b._read_verified(n) for n in b.payload_names()] for t, b in opened.items()}
    best("open_target (documents, hashes)", open_target)
    best("  read + parse + model documents", _read_docs)
    best("  parse_json(index.json)", lambda t: parse_json(index[t], "index.json"))
    best("  Index.from_dict", lambda t: Index.from_dict(parsed[t]))
    best("sample_problems", lambda t: sample_problems(opened[t]))
    best(
        "payload read + sha256",
        lambda t: [opened[t]._read_verified(n) for n in opened[t].payload_names()],
    )
    best("read_pt_bytes (all payloads)", lambda t: [read_pt_bytes(r) for r in payloads[t]])
    best("open_target + payload_problems", lambda t: payload_problems(open_target(t).first))
    best("whole gate", lambda t: [bundle_problems(b) for b in open_target(t).bundles])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", type=Path, nargs="+")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile")
    ap.add_argument("--compare", type=Path, help="a tree holding the baseline trajstore package")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="one JSON line (used by --compare)")
    ap.add_argument("--parts", action="store_true", help="CPU ms of each step of the gate")
    args = ap.parse_args()
    if args.parts:
        targets = [t for t in targets_of(args.dirs) if (t / "manifest.json").is_file()]
        parts(targets, args.reps)
        print(f"{len(targets)} bundles, load {os.getloadavg()[0]:.2f}")
        return 0
    if args.compare:
        here = Path(__file__).resolve().parents[2]
        runs: dict[str, list[dict]] = {"old": [], "new": []}
        for _ in range(args.rounds):
            for which, tree in (("old", args.compare), ("new", here)):
                env = dict(os.environ, PYTHONPATH=str(tree))
                cmd = [sys.executable, __file__, *map(str, args.dirs), "--json"]
                cmd += ["--reps", str(args.reps)]
                out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
                runs[which].append(json.loads(out.stdout.strip().splitlines()[-1]))
        load = os.getloadavg()
        for key in ("wall_ms", "cpu_ms"):
            old = statistics.median(r[key] for r in runs["old"])
            new = statistics.median(r[key] for r in runs["new"])
            print(f"{key}: old {old:.2f}, new {new:.2f}, new/old {new / old:.3f}x")
        print(f"bundles {runs['new'][0]['bundles']}, load {load[0]:.2f} {load[1]:.2f}")
        return 0
    res = measure(targets_of(args.dirs), args.reps, args.profile)
    import trajstore

    res["trajstore"] = str(Path(trajstore.__file__).parent)
    if args.json:
        print(json.dumps(res))
    else:
        print(
            f"{res['bundles']} bundles ({res['trajstore']}): {res['wall_ms']:.2f} ms wall, "
            f"{res['cpu_ms']:.2f} ms CPU per bundle (medians of {args.reps}); "
            f"load {os.getloadavg()[0]:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
