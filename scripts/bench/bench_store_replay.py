#!/usr/bin/env python
"""Replay of one step straight from the store vs the same bundle exported to a directory.

    .venv/bin/python scripts/bench/bench_store_replay.py [--quick] [--json OUT] [--cold]
        [--reps N] [--workdir DIR] [--profile]

Issue 15's figure: "replay of a step straight from the store, as a ratio to
replaying the same bundle exported to a directory" (target >= 0.6x). In one
script run:

1. `make_big_store.py --distinct` builds a store of 256-sample steps of
   ~1k-token samples (each step shares its rollout's rewards, old/ref
   log-probs and advantages, as a real run does), and `trajstore export`
   writes one step back to a directory;
2. the user's path, whole command wall time (process start and imports
   included), interleaved repetitions: `trajstore replay DIR` against
   `trajstore replay --store S --run R --step R:S` (the default, which also
   replays the step's rollout bundle to check the advantages it consumed:
   the linkage) and the same with `--no-link`; ratio = median dir time /
   median store time (>= 1 means the store is as fast);
3. the same in one process (`open_target` + `replay_sources` against
   `replay_stored`, a fresh `Store` and empty in-process caches each time),
   wall time and CPU time (`time.process_time`: every thread of the process).
   The linked store replay does two bundles' work (the rollout's replay, then
   the step's): its figure compares it with the same linked replay of the
   exported rollout and step directories (`replay_linked`), and also prints
   its ratio to the step's directory alone; `link=False` compares with the
   step's directory.

Every report is checked to be the same on both sides (status, first
divergent stage). `--cold` drops the page cache (root only) before each
timed run; without it the page cache is warm. `--json OUT` writes the issue
15 contract document (figures, command, load). `--profile` prints a cProfile
summary of each in-process path (where the time goes).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
from harness import emit, load1, say

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PY = sys.executable
TRAJSTORE = str(Path(sys.executable).with_name("trajstore"))
TARGET = 0.6
RUN = "long"


def drop_caches(cold: bool) -> None:
    """Empty the page cache (with --cold) so the next read comes from the disk."""
    if cold:
        harness.drop_caches()


def build(work: Path, steps: int, samples: int, mean_tokens: int) -> Path:
    store = work / "store"
    if (store / "refs").is_dir():
        say(f"reusing the store in {store}")
        return store
    cmd = [
        PY,
        str(HERE / "make_big_store.py"),
        str(store),
        "--distinct",
        "--steps",
        str(steps),
        "--steps-per-rollout",
        str(steps),
        "--samples",
        str(samples),
        "--mean-tokens",
        str(mean_tokens),
        "--jobs",
        "1",
        "--fault-every",
        "1000",
        "--clip-every",
        "1000",
        "--run",
        RUN,
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return store


def export(store: Path, what: list[str], out: Path) -> Path:
    """`trajstore export` of `what` (["--step", "R:S"] or ["--rollout", "R"]) to `out`."""
    if not out.is_dir():
        subprocess.run(
            [TRAJSTORE, "export", "--store", str(store), "--run", RUN, *what, str(out)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return out


def timed_cli(argv: list[str], cold: bool, env: dict | None = None) -> tuple[float, float, dict]:
    """Wall and CPU (user + sys) seconds of one whole command, and its JSON report."""
    drop_caches(cold)
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    # a baseline runs from its own directory: `-m` puts the working directory first
    cwd = env["PYTHONPATH"] if env else None
    p = subprocess.run(argv + ["--json"], capture_output=True, text=True, env=env, cwd=cwd)
    dt = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    if p.returncode not in (0, 1):
        raise SystemExit(f"{shlex.join(argv)} exited {p.returncode}: {p.stderr.strip()}")
    return dt, cpu, json.loads(p.stdout)


def verdict(report: dict) -> tuple[str, str | None]:
    return report["status"], report.get("first_divergent_stage")


def cli_figures(
    store: Path, exported: Path, step: str, reps: int, cold: bool, baseline: Path | None
) -> dict:
    """Interleaved whole-command runs of each side; with `baseline` (a checkout of the
    code before a change) its store commands run too, as `python -m trajstore`."""
    sides = {
        "dir": [TRAJSTORE, "replay", str(exported)],
        "store": [TRAJSTORE, "replay", "--store", str(store), "--run", RUN, "--step", step],
        "store_nolink": [
            TRAJSTORE,
            "replay",
            "--store",
            str(store),
            "--run",
            RUN,
            "--step",
            step,
            "--no-link",
        ],
    }
    envs: dict[str, dict | None] = {k: None for k in sides}
    if baseline is not None:
        env = {**os.environ, "PYTHONPATH": str(baseline.resolve())}
        for k in ("store", "store_nolink"):
            sides[f"{k}_baseline"] = [PY, "-m", "trajstore", *sides[k][1:]]
            envs[f"{k}_baseline"] = env
    for name, argv in sides.items():  # warm-up: .pyc files, the page cache of the code
        timed_cli(argv, False, envs[name])
    times: dict[str, list[float]] = {k: [] for k in sides}
    cpus: dict[str, list[float]] = {k: [] for k in sides}
    verdicts: dict[str, set] = {k: set() for k in sides}
    for _ in range(reps):
        for name, argv in sides.items():
            dt, cpu, report = timed_cli(argv, cold, envs[name])
            times[name].append(dt)
            cpus[name].append(cpu)
            verdicts[name].add(verdict(report))
    if len({v for vs in verdicts.values() for v in vs}) != 1:
        raise SystemExit(f"the reports differ between the sides: {verdicts}")
    med = {k: statistics.median(v) for k, v in times.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpus.items()}
    say(
        "CLI medians (wall / CPU ms): "
        + ", ".join(f"{k} {med[k] * 1e3:.0f} / {cpu_med[k] * 1e3:.0f}" for k in sides)
    )
    return {
        "median_s": med,
        "cpu_median_s": cpu_med,
        "times_s": times,
        "cpu_s": cpus,
        "commands": {k: shlex.join(v) for k, v in sides.items()},
    }


def inproc_sides(
    store: Path, exported: Path, step: tuple[int, int], cold: bool, rollout_dir: Path | None
) -> tuple:
    """(fresh, sides): the in-process replays of each side, with the trajstore importable
    here (this checkout's, or a --baseline-src checkout's in `worker`). With `rollout_dir`
    (the step's rollout exported) the "dir_linked" side replays the rollout's directory,
    then the step's against it (`replay_linked`): the linked store replay's work, from
    directories."""
    from trajstore.bundle.reader import open_target
    from trajstore.replay.from_store import Target, replay_stored
    from trajstore.replay.runner import replay_sources
    from trajstore.store import Store

    try:  # the decoded-chunk cache of this process (absent before issue 15's change)
        from trajstore.cas.chunk_cache import CHUNK_CACHE
    except ImportError:
        CHUNK_CACHE = None

    def fresh() -> None:
        if CHUNK_CACHE is not None:
            CHUNK_CACHE.clear()
        drop_caches(cold)

    def run_dir():  # noqa: ANN202
        b = open_target(exported)
        return replay_sources(b.bundles, label=b.first.bundle_id)

    def run_dir_linked():  # noqa: ANN202
        from trajstore.replay.from_store import replay_linked

        ro = open_target(rollout_dir)
        ro_report = replay_sources(ro.bundles, label=ro.first.bundle_id)
        b = open_target(exported)
        return replay_linked(b.bundles, ro_report, label=b.first.bundle_id)

    def run_store(link: bool):  # noqa: ANN202
        with Store.open(store, create=False) as st:
            return replay_stored(st, Target(run=RUN, step=step), link=link)

    sides = {
        "dir": run_dir,
        "store": lambda: run_store(True),
        "store_nolink": lambda: run_store(False),
    }
    if rollout_dir is not None:
        sides["dir_linked"] = run_dir_linked
    for fn in sides.values():  # warm-up
        fresh()
        fn()
    return fresh, sides


def timed_inproc(fresh, fn) -> tuple[float, float, tuple]:  # noqa: ANN001
    """Wall and CPU seconds (every thread of this process) of one replay, and its verdict."""
    fresh()
    c0, t0 = time.process_time(), time.perf_counter()
    report = fn()
    dt = time.perf_counter() - t0
    stage = report.first_divergent_stage
    return dt, time.process_time() - c0, (str(report.status), getattr(stage, "value", stage))


def worker(argv: list[str]) -> int:
    """`--worker STORE DIR R:S COLD`: the in-process sides of the trajstore importable here
    (a --baseline-src checkout), one timed replay per side name read from stdin."""
    store, exported, step, cold = argv
    r, s = (int(x) for x in step.split(":"))
    fresh, sides = inproc_sides(Path(store), Path(exported), (r, s), cold == "1", None)
    print("ready", flush=True)
    for line in sys.stdin:
        dt, cpu, got = timed_inproc(fresh, sides[line.strip()])
        print(json.dumps([dt, cpu, got]), flush=True)
    return 0


def inproc_figures(
    store: Path,
    exported: Path,
    step: tuple[int, int],
    reps: int,
    cold: bool,
    profile: bool,
    baseline: Path | None = None,
    rollout_dir: Path | None = None,
) -> dict:
    """In-process replays of each side, interleaved; with `baseline` the same sides of that
    checkout's code run in a worker process, interleaved with these (suffix _baseline)."""
    fresh, sides = inproc_sides(store, exported, step, cold, rollout_dir)
    names = list(sides)
    base = None
    if baseline is not None:
        base = subprocess.Popen(
            [PY, str(Path(__file__).resolve()), "--worker", str(store), str(exported)]
            + [f"{step[0]}:{step[1]}", "1" if cold else "0"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=baseline.resolve(),
            env={**os.environ, "PYTHONPATH": str(baseline.resolve())},
        )
        if base.stdout.readline().strip() != "ready":
            raise SystemExit("the --baseline-src worker did not start")
        names += [f"{k}_baseline" for k in sides if k != "dir_linked"]
    times: dict[str, list[float]] = {k: [] for k in names}
    cpus: dict[str, list[float]] = {k: [] for k in names}
    got = set()
    for _ in range(reps):
        for name in names:
            if name.endswith("_baseline"):
                base.stdin.write(name.removesuffix("_baseline") + "\n")
                base.stdin.flush()
                dt, cpu, verdict_ = json.loads(base.stdout.readline())
                verdict_ = tuple(verdict_)
            else:
                dt, cpu, verdict_ = timed_inproc(fresh, sides[name])
            times[name].append(dt)
            cpus[name].append(cpu)
            got.add(verdict_)
    if base is not None:
        base.stdin.close()
        base.wait()
    if len(got) != 1:
        raise SystemExit(f"the in-process reports differ between the sides: {got}")
    if profile:
        for name, fn in sides.items():
            fresh()
            pr = cProfile.Profile()
            pr.enable()
            fn()
            pr.disable()
            say(f"--- profile, in process: {name}")
            pstats.Stats(pr, stream=sys.stdout).sort_stats("tottime").print_stats(18)
    med = {k: statistics.median(v) for k, v in times.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpus.items()}
    say(
        "in-process medians (wall / CPU ms): "
        + ", ".join(f"{k} {med[k] * 1e3:.0f} / {cpu_med[k] * 1e3:.0f}" for k in names)
    )
    return {"median_s": med, "cpu_median_s": cpu_med, "times_s": times, "cpu_s": cpus}


def figure(name: str, value: float, detail: str, samples: int) -> dict:
    """A ratio to the exported directory; the target names 256-sample steps."""
    return harness.figure(
        name,
        f">= {TARGET}x",
        value,
        "x",
        workload=samples,
        target_workload=256,
        workload_unit="samples a step",
        detail=detail,
    )


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:
        return worker(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (< 1 min)")
    ap.add_argument("--json", type=Path, metavar="OUT", help="write the figures here")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each run")
    ap.add_argument("--reps", type=int, help="interleaved repetitions (default 3 quick, 9 full)")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--mean-tokens", type=int, default=1024)
    ap.add_argument("--workdir", type=Path, help="keep the store here (reused when present)")
    ap.add_argument("--profile", action="store_true", help="print cProfile of each path")
    ap.add_argument(
        "--baseline-src",
        type=Path,
        metavar="DIR",
        help="also time the store commands with the trajstore package of this checkout "
        "(e.g. a `git worktree` of the commit before a change), interleaved; and the "
        "in-process sides with it, in a worker process, interleaved",
    )
    args = ap.parse_args()
    reps = args.reps or (3 if args.quick else 9)
    before = load1()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-store-replay-") as tmp:
        work = (args.workdir or Path(tmp)).resolve()
        work.mkdir(parents=True, exist_ok=True)
        store = build(work, 2, args.samples, args.mean_tokens)
        step = (0, 1)
        exported = export(store, ["--step", f"{step[0]}:{step[1]}"], work / "export-0-1")
        rollout_dir = export(store, ["--rollout", str(step[0])], work / "export-rollout-0")
        tokens = json.loads((work / "store.truth.json").read_text())["response_tokens_per_bundle"]
        say(f"store: 1 rollout + 2 steps of {args.samples} samples, ~{tokens} tokens per bundle")
        cli = cli_figures(
            store, exported, f"{step[0]}:{step[1]}", reps, args.cold, args.baseline_src
        )
        inp = inproc_figures(
            store, exported, step, reps, args.cold, args.profile, args.baseline_src, rollout_dir
        )
    cache = "cold" if args.cold else "warm"

    def fig(name: str, value: float, detail: str) -> dict:
        return figure(name, value, detail, args.samples)

    size = f"256-sample step, {tokens} response tokens" if args.samples == 256 else f"{tokens} tok"
    m, n, c = cli["median_s"], inp["median_s"], cli["cpu_median_s"]
    nc = inp["cpu_median_s"]
    figures = [
        fig(
            "store replay, CLI: `replay --store S --run R --step r:s` / `replay DIR`",
            m["dir"] / m["store"],
            f"whole command wall time, median of {reps} interleaved runs, page cache {cache}; "
            f"{size}; dir {m['dir'] * 1e3:.0f} ms, store {m['store'] * 1e3:.0f} ms "
            "(includes replaying the rollout bundle for the linkage check); CPU ratio "
            f"{c['dir'] / c['store']:.2f}x",
        ),
        fig(
            "store replay, CLI --no-link / replay DIR",
            m["dir"] / m["store_nolink"],
            f"as above without the rollout linkage: store {m['store_nolink'] * 1e3:.0f} ms",
        ),
        fig(
            "store replay in process, with linkage: replay_stored / replay_linked of the "
            "exported step and rollout directories",
            n["dir_linked"] / n["store"],
            f"median of {reps}, fresh Store and empty chunk cache each run, page cache {cache}; "
            f"both sides replay the rollout, then the step against it: dirs "
            f"{n['dir_linked'] * 1e3:.0f} ms, store {n['store'] * 1e3:.0f} ms; CPU ratio "
            f"{nc['dir_linked'] / nc['store']:.2f}x ({nc['dir_linked'] * 1e3:.0f} vs "
            f"{nc['store'] * 1e3:.0f} ms, all threads); against the step's directory alone "
            f"(no linkage: {n['dir'] * 1e3:.0f} ms) {n['dir'] / n['store']:.2f}x",
        ),
        fig(
            "store replay in process, link=False",
            n["dir"] / n["store_nolink"],
            f"store {n['store_nolink'] * 1e3:.0f} ms; CPU ratio "
            f"{nc['dir'] / nc['store_nolink']:.2f}x ({nc['store_nolink'] * 1e3:.0f} ms)",
        ),
    ]
    if "store_baseline" in n:
        nb = {k.removesuffix("_baseline"): v for k, v in n.items() if k.endswith("_baseline")}
        ncb = {k.removesuffix("_baseline"): v for k, v in nc.items() if k.endswith("_baseline")}
        figures.append(
            fig(
                "store replay in process, the --baseline-src code",
                nb["dir"] / nb["store"],
                f"same runs, interleaved, in a worker process: dir {nb['dir'] * 1e3:.0f} ms, "
                f"store {nb['store'] * 1e3:.0f} ms, link=False {nb['store_nolink'] * 1e3:.0f} "
                f"ms ({nb['dir'] / nb['store_nolink']:.2f}x); CPU ratio "
                f"{ncb['dir'] / ncb['store']:.2f}x ({ncb['dir'] * 1e3:.0f} vs "
                f"{ncb['store'] * 1e3:.0f} ms), link=False {ncb['dir'] / ncb['store_nolink']:.2f}x",
            )
        )
    if "store_baseline" in m:
        figures.append(
            fig(
                "store replay, CLI, the --baseline-src code",
                m["dir"] / m["store_baseline"],
                f"same runs, interleaved: store {m['store_baseline'] * 1e3:.0f} ms, "
                f"--no-link {m['store_nolink_baseline'] * 1e3:.0f} ms; CPU ratio "
                f"{c['dir'] / c['store_baseline']:.2f}x",
            )
        )
    say(f"{time.perf_counter() - t_start:.0f} s")
    emit(args.json, figures, before, raw={"cli": cli, "in_process": inp})
    return 0


if __name__ == "__main__":
    sys.exit(main())
