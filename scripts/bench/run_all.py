#!/usr/bin/env python
"""Run every benchmark and write docs/benchmarks.md's measured part from their output.

    .venv/bin/python scripts/bench/run_all.py [--quick] [--workdir DIR] [--doc docs/benchmarks.md]
    make bench

Each benchmark runs as its own subprocess (the exact command is recorded);
the figures come from its `--json` file or, for the scripts that only print,
from its printed lines. The block between the `run_all` markers in the doc is
replaced: the stamp (command, date, machine, load), the targets table with
every verdict decided here from these numbers, and one table per benchmark.
Nothing in that block is typed by hand, so every number traces to this run.

Every verdict is decided by scripts/bench/verdicts.py from the figure of each of
`--reps` runs of the benchmark (default 3), the target and the workload measured:
met/missed only when the target's workload was measured and the runs' spread is
under the margin, else "not measured" or "inconclusive".

Sizes are chosen so one run of every benchmark takes about 15 minutes on 2 shared
cores (so about 45 with the default 3 runs), plus the 100,000-step store of bench_scale.py (its
build and sync take most of its time);
`--quick` shrinks them (a smoke test of the pipeline, not numbers to publish:
the doc is then written to `--doc` only when given explicitly).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verdicts import MISSED, Target, Verdict, decide

ROOT = Path(__file__).resolve().parents[2]
BENCH = Path(__file__).resolve().parent
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- run_all: begin -->", "<!-- run_all: end -->"

#: full sizes (about 15 min on 2 cores) and --quick sizes
SIZES: dict[str, dict[str, Any]] = {
    "full": {
        "scale": [
            "--steps",
            "120",
            "--steps-per-rollout",
            "4",
            "--samples",
            "256",
            "--mean-tokens",
            "1024",
            "--fault-every",
            "20",
            "--clip-every",
            "20",
            "--rollouts",
            "6",
            "--requests",
            "2000",
            "--queries",
            "50",
            "--lookups",
            "500",
        ],
        "store": [],  # issue 33's sizes (bench_store.py's defaults), 5 reps
        "replay": ["--repeat", "5"],
        "catalog": ["--bundles", "10000"],
        "capture": ["--reps", "4", "--rollouts", "3"],
        "routes": [],
        # issue 33: TRL's loop with ~80 ms steps, and the 100,000-step store
        "trl_capture": ["--reps", "4", "--steps", "8"],
        "scale100k": ["--steps", "100000"],
    },
    "quick": {
        "scale": [
            "--steps",
            "80",
            "--steps-per-rollout",
            "4",
            "--samples",
            "16",
            "--mean-tokens",
            "64",
            "--fault-every",
            "20",
            "--clip-every",
            "20",
            "--rollouts",
            "4",
            "--requests",
            "200",
            "--queries",
            "5",
            "--lookups",
            "50",
        ],
        "store": ["--quick"],
        "replay": ["--repeat", "1"],
        "catalog": ["--bundles", "500"],
        "capture": ["--reps", "2", "--rollouts", "2"],
        "routes": ["--samples", "4"],
        "trl_capture": ["--reps", "1", "--steps", "3"],
        "scale100k": ["--quick"],
    },
}


@dataclass
class Run:
    """One benchmark subprocess: its command, output, timing and load."""

    key: str
    argv: list[str]
    rc: int = -1
    stdout: str = ""
    seconds: float = 0.0
    load_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    data: dict[str, Any] = field(default_factory=dict)
    #: the later repetitions of the same command (`--reps`); this one is the first
    reps: list[Run] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.rc == 0

    @property
    def base(self) -> str:
        """The benchmark's key without the repetition suffix (`scale#2` -> `scale`)."""
        return self.key.split("#")[0]

    def figures(self, get: Callable[[dict[str, Any]], float | None]) -> list[float]:
        """`get` of every repetition that succeeded and has the figure (one per run)."""
        out = []
        for r in [self, *self.reps]:
            if r.ok and r.data:
                try:
                    value = get(r.data)
                except (KeyError, TypeError, ZeroDivisionError):
                    value = None
                if value is not None:
                    out.append(float(value))
        return out

    def command(self) -> str:
        rel = [
            str(Path(a).relative_to(ROOT)) if a.startswith(str(ROOT)) else a for a in self.argv[1:]
        ]
        return " ".join([".venv/bin/python", *rel])

    def load(self) -> str:
        return f"{self.load_before[0]:.2f} -> {self.load_after[0]:.2f}"


CONSOLE: list[Path] = []  # run_all.log in the workdir: --render-from reads it back


def say(msg: str) -> None:
    print(msg, flush=True)
    for p in CONSOLE:
        with p.open("a") as fh:
            fh.write(msg + "\n")


def run(key: str, script: str, args: list[str], work: Path, json_out: bool) -> Run:
    argv = [sys.executable, str(BENCH / script), *args]
    out = work / f"{key}.json"
    if json_out:
        argv += ["--json", str(out)]
    r = Run(key, argv, load_before=os.getloadavg())
    say(f"== {key}: {r.command()}  (load {r.load_before[0]:.2f})")
    t0 = time.perf_counter()
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    r.seconds, r.rc, r.load_after = time.perf_counter() - t0, p.returncode, os.getloadavg()
    r.stdout = p.stdout
    (work / f"{key}.log").write_text(p.stdout + "\n--- stderr ---\n" + p.stderr)
    if r.ok and json_out:
        r.data = json.loads(out.read_text())
    say(p.stdout.rstrip())
    if not r.ok:
        say(f"!! {key} exited {r.rc}:\n{p.stderr[-2000:]}")
    say(f"== {key}: {r.seconds:.0f} s, exit {r.rc}, load {r.load()}\n")
    return r


def grab(text: str, pattern: str, *names: str) -> dict[str, float]:
    """Named floats from the first line matching `pattern` (empty when the line is missing)."""
    m = re.search(pattern, text)
    return {} if m is None else {n: float(v) for n, v in zip(names, m.groups(), strict=True)}


def parse_printed(r: Run) -> None:
    """Figures of the benchmarks that print instead of writing JSON."""
    t = r.stdout
    if r.base == "replay":
        r.data = {
            **grab(
                t,
                r"512-sample step: (\d+) response tokens, 6 payloads, ([\d.]+) MiB",
                "tokens",
                "mib",
            ),
            **grab(t, r"load \(torch.load of every payload\)\s+([\d.]+) ms", "load_ms"),
            **grab(t, r"replay in process \(gate \+ 6 stages\)\s+([\d.]+) ms", "replay512_ms"),
            **grab(t, r"256-sample step, replay in process\s+([\d.]+) ms", "replay256_ms"),
            **grab(
                t,
                r"256 samples \(CLI\)\s+([\d.]+) ms wall, ([\d.]+) ms CPU",
                "cli_ms",
                "cli_cpu_ms",
            ),
            **grab(
                t,
                r"`trajstore --help`\s+([\d.]+) ms wall, ([\d.]+) ms CPU",
                "help_ms",
                "help_cpu_ms",
            ),
        }
    elif r.base == "catalog":
        ms3 = r"median ([\d.]+) ms, p95 ([\d.]+) ms, p99 ([\d.]+) ms"
        q = ("med", "p95", "p99")
        r.data = {
            **grab(t, r"built (\d+) refs", "refs"),
            "sync": grab(t, r"sync .* in ([\d.]+)s", "s"),
            "lookup": grab(t, r"(?m)^lookup_step: " + ms3, *q),
            "query": grab(
                t,
                r"query_steps\(first_divergent_stage, limit=1000, (\d+) rows\): " + ms3,
                "rows",
                *q,
            ),
            "query_run": grab(t, r"query_steps\(run, limit=100\): " + ms3, *q),
        }
    elif r.base == "store":
        row = r"\| {} \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|"
        cols = ("mb", "ratio", "s", "mbps", "vs_save")
        r.data = {
            **grab(
                t,
                r"Routed long run: (\d+) rollouts x (\d+) steps, (\d+) samples/rollout, "
                r"(\d+) bundles, ([\d.]+) MB",
                "rollouts",
                "steps",
                "samples",
                "bundles",
                "logical_mb",
            ),
            "save": grab(
                t,
                r"\| torch.save \(payloads only\) \| - \| - \| ([\d.]+) \| ([\d.]+) \|",
                "s",
                "mbps",
            ),
            "zstd": grab(t, row.format(re.escape("zstd-3 per file")), *cols),
            "xet": grab(t, row.format(re.escape("Xet local CAS")), *cols),
            "ingest": grab(t, row.format("trajstore ingest"), *cols),
            **grab(t, r"route bytes per token-layer ([\d.]+)", "route_btl"),
        }
        # issue 33: each workload's speed against Xet and its bytes, from bench_store's lines
        r.data["small_run"] = grab(
            t,
            r"Small bundles: .*?, (\d+) bundles, ([\d.]+) MB of bundle files",
            "bundles",
            "logical_mb",
        )
        for shape, label in (("routed", "routed"), ("small", "small-bundle")):
            m = re.search(
                rf"(?m)^{label} ingest / Xet, logical MB/s \(median of (\d+) alternating "
                r"pairs\): ([\d.]+)x; range ([\d./]+);",
                t,
            )
            b = grab(
                t,
                rf"(?m)^{label} physical/logical: trajstore store directory ([\d.]+), Xet CAS "
                r"directory ([\d.]+)",
                "ts",
                "xet",
            )
            speed = {}
            if m is not None:
                speed = {
                    "reps": int(m[1]),
                    "ratio": float(m[2]),
                    "range": [float(x) for x in m[3].split("/")],
                }
            r.data[f"xet_{shape}"] = {"speed": speed, "bytes": b}
    elif r.base == "ceiling":
        r.data = grab(t, r"ceiling ratio HTTP / torch.load: ([\d.]+)x", "ratio")


def machine() -> dict[str, str]:
    import numpy
    import torch

    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return {
        "nproc": str(len(os.sched_getaffinity(0))),
        "cpu": cpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": str(torch.get_num_threads()),
        "numpy": numpy.__version__,
    }


# --------------------------------------------------------------------------- doc


def f(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def med(v: Verdict, unit: str = "", spec: str = ".2f") -> str:
    """`; median of N runs X` when the verdict came from more than one run."""
    if v.median is None or v.runs < 2:
        return ""
    return f"; median of {v.runs} runs {format(v.median, spec)}{unit}"


def verdict(v: Verdict, *runs: Run) -> str:
    """The verdict cell (scripts/bench/verdicts.py decided it), then the load cell of the
    runs it comes from (every repetition)."""
    loads = ", ".join(x.load() for r in runs for x in [r, *r.reps])
    return f"{v.cell()} | {loads}"


def render(
    runs: dict[str, Run],
    mach: dict[str, str],
    started: str,
    ended: str,
    cmd: str,
    sizes: str,
    rerendered: bool = False,
) -> str:
    g = {k: r.data if r.ok else {} for k, r in runs.items()}
    sc, cap, rt, rp, cat, st = (
        g["scale"],
        g["capture"],
        g["routes"],
        g["replay"],
        g["catalog"],
        g["store"],
    )
    truth = sc.get("truth", {})
    L: list[str] = []
    add = L.append
    add("## Latest run")
    add("")
    again = (
        " (tables rendered again from its kept logs by `run_all.py --render-from`)"
        if rerendered
        else ""
    )
    add(
        f"Generated by `{cmd}`{again} ({sizes} sizes) from {started} to {ended} UTC. Machine: "
        f"`nproc` {mach['nproc']}, {mach['cpu']}, Python {mach['python']}, torch {mach['torch']} "
        f"(default intra-op threads {mach['torch_threads']}), NumPy {mach['numpy']}. Load average "
        "(1 min) before -> after each benchmark is in its section; the machine is shared with "
        "other jobs, so the ratios below compare against a baseline measured in the same script, "
        "minutes apart at most."
    )
    busy = [
        k for k, r in runs.items() if max(r.load_before[0], r.load_after[0]) > int(mach["nproc"])
    ]
    if busy:
        add("")
        add(
            f"The 1-minute load exceeded the {mach['nproc']} cores during: {', '.join(busy)}. "
            "There, wall-clock latencies and throughputs are inflated by other jobs; CPU times "
            "and same-script ratios less so."
        )
    add("")
    add("### Targets at a glance")
    add("")
    add("| issue | target | measured (this run) | verdict | load (1 min, before -> after) |")
    add("|---|---|---|---|---|")
    # Every verdict below is decided by verdicts.decide from the figure of each repetition
    # (`--reps`), the target, and the workload measured (see docs/benchmarks.md).
    R = runs
    # issue 3
    cli = rp.get("cli_ms")
    v = decide(R["replay"].figures(lambda d: d["cli_ms"]), Target(700, "<="))
    add(
        f"| 3 | `trajstore replay` of a 256-sample step <= 0.7 s | {f(cli, '.0f')} ms wall "
        f"({f(rp.get('cli_cpu_ms'), '.0f')} ms CPU){med(v, ' ms', '.0f')} | "
        f"{verdict(v, R['replay'])} |"
    )
    # issue 5
    q = cat.get("query", {})
    refs = f"{cat.get('refs', 0):,.0f}"
    v = decide(
        R["catalog"].figures(lambda d: d["query"]["p99"]),
        Target(100, "<=", workload=10_000, workload_unit="steps"),
        workload=cat.get("refs"),
    )
    add(
        "| 5 | divergence query over 10,000 steps <= 100 ms | "
        f"`query_steps(first_divergent_stage=..., limit=1000)` on {refs} synthetic step refs: p99 "
        f"{f(q.get('p99'), '.1f')} ms ({f(q.get('rows'), '.0f')} rows){med(v, ' ms')} | "
        f"{verdict(v, R['catalog'])} |"
    )
    lk = cat.get("lookup", {})
    ss = sc.get("store_step", {})
    v = decide(
        R["catalog"].figures(lambda d: d["lookup"]["p99"]),
        Target(10, "<=", workload=10_000, workload_unit="steps"),
        workload=cat.get("refs"),
    )
    add(
        f"| 5 | lookup by actor step id <= 10 ms (at 10,000 steps) | `catalog.lookup_step` on "
        f"{refs} refs p99 {f(lk.get('p99'))} ms{med(v, ' ms')} (`Store.step` on the "
        f"{truth.get('steps', 'n/a')}-step store: p99 {f(ss.get('p99_ms'))} ms, not the "
        f"target's size) | {verdict(v, R['catalog'])} |"
    )
    w1, w2 = sc.get("replay_all_w1", {}), sc.get("replay_all_w2", {})
    tok = truth.get("response_tokens_per_bundle")
    spb = truth.get("samples_per_bundle")
    per_tok = f"{tok / spb:.0f}" if tok and spb else "n/a"
    v = decide(
        R["scale"].figures(
            lambda d: min(d["replay_all_w1"]["per_worker"], d["replay_all_w2"]["per_worker"])
        ),
        Target(10, ">=", workload=256, workload_unit="samples per bundle"),
        workload=spb,
    )
    add(
        "| 5 | replay-all >= 10 bundles/s per worker, 256-sample bundles | cold cache, distinct "
        f"bundles of {spb} samples x ~{per_tok} tokens: {f(w1.get('per_worker'))}/s with 1 "
        f"worker, {f(w2.get('per_worker'))}/s per worker with 2{med(v, '/s (slower of the two)')}"
        f" | {verdict(v, R['scale'])} |"
    )
    gs, gf = sc.get("get_step", {}), sc.get("get_step_first", {})
    v = decide(
        R["scale"].figures(lambda d: max(d["get_step"]["p99_ms"], d["get_step_first"]["p99_ms"])),
        Target(10, "<=", workload=10_000, workload_unit="steps"),
        workload=truth.get("steps"),
    )
    add(
        "| 6 | `GET /v1/runs/{run}/steps/{r}:{s}` p99 <= 10 ms (target at 10,000 steps) | "
        f"{truth.get('steps', 'n/a')} steps: repeated p99 {f(gs.get('p99_ms'))} ms; first touch "
        f"of each step, {'cold' if sc.get('cold') else 'warm'} cache, p99 "
        f"{f(gf.get('p99_ms'))} ms | {verdict(v, R['scale'])} |"
    )
    # The target's figure is the first (cold) download from a fresh server against a cold
    # torch.load, the median of bench_rest.py's repeats (the perf block). This run's scale
    # benchmark times one download from a server warmed by its lookups, against a
    # torch.load that is the first in its process: not that figure, so not shown.
    v = Verdict("not measured", "the first (cold) download is bench_rest.py's: perf block")
    add(
        "| 6 | payload download >= 0.5x torch.load (the first, cold download) | not in this "
        "run; the repeated (warm) download is in the REST section, the bare-HTTP ceiling here "
        f"is {f(g['ceiling'].get('ratio'), '.3f')}x | {verdict(v, R['scale'])} |"
    )
    # issue 4
    ing = st.get("ingest", {})
    if ing:
        v = decide([ing["ratio"]], Target(0.25, "<="), exact=True)  # bytes: the same every run
        add(
            f"| 4 | physical/logical <= 0.25 on the routed long run | {ing['ratio']:.3f} "
            f"({st.get('logical_mb', 0):.0f} MB run; bytes, exact) | "
            f"{verdict(v, R['store'])} |"
        )
    else:
        add("| 4 | physical/logical <= 0.25 | benchmark failed | not measured | |")
    # issue 33: ingest against Hugging Face Xet (the FastCDC loop is retired as the anchor)
    small = st.get("small_run", {})
    for shape, what, speed_t, bytes_t, size, full in (
        (
            "routed",
            "routed long run",
            1.5,
            0.22,
            f"{st.get('logical_mb', 0):.0f} MB",
            st.get("logical_mb", 0) >= 571,
        ),
        (
            "small",
            "run of small bundles",
            0.8,
            0.27,
            f"{small.get('bundles', 0):.0f} bundles, {small.get('logical_mb', 0):.0f} MB",
            small.get("bundles", 0) >= 31 and small.get("logical_mb", 0) >= 40,
        ),
    ):
        x = st.get(f"xet_{shape}", {})
        sp, by = x.get("speed", {}), x.get("bytes", {})
        if not sp or not by:
            add(f"| 33 | ingest of a {what} vs Xet | benchmark failed | not measured | |")
            continue
        lo, hi = min(sp["range"]), max(sp["range"])
        workload = 1.0 if full else 0.0  # the target's run, or a smaller one (not measured)
        # bench_store alternates the two sides `reps` times in one run and prints the median
        # pair ratio with its range: the rule's median and spread are those
        v = decide(
            [lo, sp["ratio"], hi] if sp["reps"] >= 3 else [sp["ratio"]],
            Target(speed_t, ">=", workload=1.0, workload_unit="x the target's run"),
            workload=workload,
        )
        vb = decide([by["ts"]], Target(bytes_t, "<=", workload=1.0), workload=workload, exact=True)
        small_run = "" if full else ", smaller than the target's run"
        add(
            f"| 33 | ingest of a {what}, logical MB/s / Xet >= {speed_t}x | {sp['ratio']:.2f}x "
            f"(median of {sp['reps']} alternating pairs, range {lo:.2f}-{hi:.2f}; "
            f"{size}{small_run}){med(v, 'x')} | {verdict(v, R['store'])} |"
        )
        add(
            f"| 33 | same, physical/logical <= {bytes_t} | {by['ts']:.3f} (store directory; "
            f"Xet {by['xet']:.3f}) | {verdict(vb, R['store'])} |"
        )
    # issue 7
    if cap:
        dropped = sum(x.data.get("dropped", 0) for x in [R["capture"], *R["capture"].reps])
        ratios = [
            float(ratio)
            for x in [R["capture"], *R["capture"].reps]
            if x.ok and x.data
            for ratio in x.data["block_ratios"]
        ]
        v = decide(ratios, Target(1.05, "<="))
        if dropped:
            v = Verdict("missed", "", v.median)  # a dropped bundle misses it, exactly
        add(
            f"| 7 | capture overhead <= 1.05x, no drops | {cap['block_ratio']:.3f}x whole run "
            f"incl. final flush, median of {cap['reps']} reps (torch threads "
            f"{cap['torch_threads']}); every rep of every run: "
            f"{', '.join(f'{x:.2f}' for x in ratios)}; {dropped} dropped | "
            f"{verdict(v, R['capture'])} |"
        )
    else:
        add("| 7 | capture overhead <= 1.05x, no drops | benchmark failed | not measured | |")
    # issue 33: TRL capture and the 100,000-step store (each script repeats inside itself)
    trl = g.get("trl_capture", {})
    if trl:
        reps = trl["per_rep_wall_ratio"]
        v = decide(reps, Target(1.05, "<="))
        if trl["dropped"]:
            v = Verdict(MISSED, f"{trl['dropped']} dropped")
        add(
            "| 33 | capture overhead, TRL loop (~80 ms steps) <= 1.05x | "
            f"{trl['wall_ratio_on_off']:.3f}x whole run incl. final flush (median of "
            f"{len(reps)} reps, range {min(reps):.2f}-{max(reps):.2f}; steps "
            f"{trl['step_s_off'] * 1000:.0f} ms off), writer CPU "
            f"{trl['other_threads_cpu_ms_per_step_on_minus_off']:.1f} ms a step, "
            f"{trl['dropped']} dropped | {verdict(v, R['trl_capture'])} |"
        )
    elif "trl_capture" in runs:
        add("| 33 | capture overhead, TRL loop <= 1.05x | benchmark failed | not measured | |")
    big = g.get("scale100k", {})
    for fig in big.get("figures", []):
        op, bound = fig["target"].split()[:2]
        v = decide(
            fig.get("reps") or [fig["value"]],
            Target(float(bound.rstrip("x")), op, workload=100_000, workload_unit="steps"),
            workload=big["steps"],
        )
        add(
            f"| 33 | {fig['name']} {fig['target']} | {fig['value']} {fig['unit']} "
            f"({fig['detail']}) | {verdict(v, R['scale100k'])} |"
        )
    if "scale100k" in runs and not big:
        add("| 33 | 100,000-step store figures | benchmark failed | not measured | |")
    # issue 8
    if rt:
        v = decide(
            [rt["equal_delta_bytes"] / rt["base_stored_bytes"]], Target(0.01, "<="), exact=True
        )
        add(
            "| 8 | train routes (R3, identical) < 1% of one route tensor's stored size | "
            f"{rt['equal_delta_bytes']} B (bytes, exact) | {verdict(v, R['routes'])} |"
        )
        v = decide([rt["delta_vs_base"]], Target(0.35, "<="), exact=True)
        add(
            "| 8 | train routes <= 0.35x with ~18% differing | "
            f"{rt['differing_token_layers']:.1%} of token-layers with the whole top-k redrawn: "
            f"{rt['delta_vs_base']:.3f}x (bytes, exact) | {verdict(v, R['routes'])} |"
        )
    add("")

    # --- sections
    def section(title: str, key: str, intro: str) -> None:
        r = runs[key]
        add(f"### {title}")
        add("")
        add(f"Command: `{r.command()}` ({r.seconds:.0f} s, exit {r.rc}, load {r.load()}). {intro}")
        add("")

    section(
        "Route delta storage (issue 8)",
        "routes",
        "Train routes are the rollout routes with a fraction of token-layers whose whole top-k "
        "set is redrawn (as `trajstore.examples.gen_long_run` does), written with "
        "`write_array(base=...)` as ingest does.",
    )
    if rt:
        add("| route payload | stored | bytes per token-layer | vs stored base | vs raw |")
        add("|---|---:|---:|---:|---:|")
        tl = rt["tokens"] * rt["shape"][1]
        add(
            f"| rollout routes (base), {rt['tokens']:,} tokens x {rt['shape'][1]} x "
            f"{rt['shape'][2]} uint8 | {rt['base_stored_bytes'] / 2**20:.2f} MiB | "
            f"{rt['base_bytes_per_token_layer']:.2f} | 1 | "
            f"{rt['base_stored_bytes'] / rt['raw_bytes']:.3f} |"
        )
        add(
            f"| train routes identical (R3), XOR delta | {rt['equal_delta_bytes']} B | "
            f"{rt['equal_delta_bytes'] / tl:.2f} | "
            f"{rt['equal_delta_bytes'] / rt['base_stored_bytes']:.3f} | "
            f"{rt['equal_delta_bytes'] / rt['raw_bytes']:.3f} |"
        )
        add(
            f"| train routes, {rt['differing_token_layers']:.1%} redrawn, XOR delta | "
            f"{rt['delta_stored_bytes'] / 2**20:.2f} MiB | "
            f"{rt['delta_bytes_per_token_layer']:.2f} | **{rt['delta_vs_base']:.3f}** | "
            f"{rt['delta_vs_raw']:.3f} |"
        )
        add("")
        add(
            "A redrawn token-layer carries 8 new random ids (7 bits each), so the delta cannot be "
            "much smaller than 18% x 7 B = 1.26 B per token-layer plus where the changes are; the "
            "earlier 0.046x came from changing one id by one."
        )
        add("")

    section(
        "Replay at scale and REST (issues 5 and 6)",
        "scale",
        "The store is built in the same run by `make_big_store.py --distinct`: every bundle has "
        "its own seeded content (no templates, no hard links); each step shares its rollout's "
        "rewards, old/ref log-probs and advantages (as in a real run) and draws its own "
        "`log_probs` and `entropy`.",
    )
    if sc:
        cold = "cold" if sc.get("cold") else "warm"
        add(
            f"Store: {truth['bundles']} bundles = {truth['steps']} steps + {truth['rollouts']} "
            f"rollouts, {spb} samples per bundle, {tok:,} response tokens per bundle on average "
            f"(~{per_tok} per sample), {sc['store_bytes'] / 1e6:.0f} MB on disk; built in "
            f"{truth['build_seconds']:.0f} s. Faulty rollouts {truth['faulty_rollouts']}, "
            f"wrong-clip steps {truth['clip_steps']}. Page cache: {cold} (`--cold` drops it "
            "before each replay run, before the server starts and before the first download)."
        )
        add("")
        add("| measurement | value |")
        add("|---|---:|")
        d = sc["dir"]
        add(
            f"| replay of the same bundles exported to directories, 1 process ({cold}) | "
            f"{d['bps']:.2f} bundles/s ({d['bundles']} bundles) |"
        )
        nl = sc["stored_nolink"]
        add(
            f"| `replay_stored(link=False)` in process ({cold}) | {nl['bps']:.2f} bundles/s "
            f"({nl['bps'] / d['bps']:.2f}x dir) |"
        )
        for w, x in ((1, w1), (2, w2)):
            add(
                f"| `replay_all` workers={w} ({cold}) | **{x['bps']:.2f} bundles/s = "
                f"{x['per_worker']:.2f} per worker** ({x['bps'] / d['bps']:.2f}x dir); pass "
                f"{x['passed']}, diverged {x['diverged']} |"
            )
        if "record" in sc:
            rec = sc["record"]
            add(
                f"| `replay_all --record` workers=2, whole store | {rec['bundles']} bundles in "
                f"{rec['seconds']:.0f} s = {rec['bps']:.2f} bundles/s; histogram "
                f"{rec['histogram']} |"
            )
        tc = sc.get("truth_check", {})
        add(
            f"| ground truth: reward.post_process steps / wrong-clip steps / rooted in rollouts | "
            f"{tc.get('reward_steps')} / {tc.get('clip_steps')} / {tc.get('rooted')} |"
        )
        for name, k in (
            ("divergence query, limit=1000", "query"),
            ("`catalog.lookup_step`", "lookup_step"),
            ("`Store.step`", "store_step"),
        ):
            x = sc[k]
            add(f"| {name} | p50 {x['p50_ms']:.2f} ms, p99 {x['p99_ms']:.2f} ms (n={x['n']}) |")
        add(f"| server start (catalog sync + view, {cold}) | {sc['server_ready_s']:.1f} s |")
        add(
            f"| GET step, first touch of each of {gf['n']} steps ({cold}) | p50 "
            f"{gf['p50_ms']:.2f} ms, p99 {gf['p99_ms']:.2f} ms, max {gf['max_ms']:.1f} ms |"
        )
        add(
            f"| GET step, {gs['n']} random requests after 200 warm-up | p50 {gs['p50_ms']:.2f} ms, "
            f"**p99 {gs['p99_ms']:.2f} ms**; body {gs['body_bytes']:,} B |"
        )
        # The script's one "first download" sample is left out: one download from a server
        # warmed by the lookups, against a torch.load first in its process, is not the
        # first-download figure (bench_rest.py's, in the perf block).
        dl = sc.get("download", {})
        add(
            "| `log_probs` download, repeated, page cache warm (median of 20): torch.load / "
            "npy / raw | "
            f"{dl['load_ms']:.2f} / {dl['npy_ms']:.2f} / {dl['raw_ms']:.2f} ms = "
            f"**{dl['npy_ratio']:.2f}x / {dl['raw_ratio']:.2f}x** |"
        )
        add("")
        add(
            f"Scaled down from the targets' 10,000 steps: {truth['steps']} distinct steps of "
            f"~{per_tok} tokens per sample are what can be generated, ingested and replayed "
            "within the 15-minute budget on 2 cores. Replay throughput per bundle does not depend "
            "on the number of bundles in the store; the step GET and the catalog queries do: the "
            "catalog queries are measured at 10,000 refs by the catalog benchmark below, the "
            "step GET is not measured at 10,000 steps (its verdict says so)."
        )
        add("")
    r = runs["ceiling"]
    add(
        f"HTTP ceiling: `{r.command()}` (load {r.load()}): a bare FastAPI endpoint returning 16 "
        f"MiB from memory reaches {f(g['ceiling'].get('ratio'), '.3f')}x of a page-cache "
        "torch.load here, no trajstore code involved."
    )
    add("")

    section(
        "Capture overhead (issue 7)",
        "capture",
        "The tiny CPU GRPO loop with capture on vs off, interleaved blocks in one process; every "
        "rollout and step is captured (the worst case). torch keeps its default intra-op threads "
        "(what a trainer uses). The headline ratio is whole-block wall time on / off, with "
        "capture's final `close()` flush counted.",
    )
    if cap:
        add("| measurement | value |")
        add("|---|---:|")
        add(
            f"| workload | hidden {cap['hidden']}, vocab {cap['vocab']}, "
            f"{cap['samples_per_rollout']} samples x <= {cap['max_response']} tokens, "
            f"{cap['steps_per_block']} steps per block, {cap['reps']} reps, torch threads "
            f"{cap['torch_threads']} |"
        )
        add(
            f"| step time off / on (medians) | {cap['step_off_ms']:.1f} ms / "
            f"{cap['step_on_ms']:.1f} ms |"
        )
        add(
            "| **ratio on/off, whole block incl. final flush (median of reps)** | "
            f"**{cap['block_ratio']:.3f}x** (per rep "
            f"{', '.join(f'{x:.2f}' for x in cap['block_ratios'])}) |"
        )
        add(f"| ratio on/off, median step | {cap['step_ratio']:.3f}x |")
        add(f"| ratio on/off, fastest step | {cap['fastest_ratio']:.3f}x |")
        add(f"| training-thread CPU ratio | {cap['cpu_ratio']:.3f}x |")
        add(
            f"| bundles written / dropped (queue {cap['queue_size']}) | {cap['written']} / "
            f"{cap['dropped']} |"
        )
        add(f"| `close()` flush, median | {cap['flush_ms']:.1f} ms |")
        add("")

    section(
        "Single-bundle replay (issue 3)",
        "replay",
        "Two synthetic consistent step bundles (~1k response tokens per sample), page cache warm; "
        "the CLI timing includes process start and imports.",
    )
    if rp:
        add("| measurement | value |")
        add("|---|---:|")
        add(
            f"| 512-sample step | {rp.get('tokens', 0):,.0f} tokens, {rp.get('mib', 0):.1f} MiB "
            "of payloads |"
        )
        add(
            "| torch.load of every payload / replay in process, 512 samples | "
            f"{f(rp.get('load_ms'), '.1f')} ms / {f(rp.get('replay512_ms'), '.1f')} ms |"
        )
        add(f"| replay in process, 256 samples | {f(rp.get('replay256_ms'), '.1f')} ms |")
        add(
            f"| **`trajstore replay`, 256 samples, wall / CPU** | **{f(cli, '.0f')} ms** / "
            f"{f(rp.get('cli_cpu_ms'), '.0f')} ms |"
        )
        add(
            f"| `trajstore --help`, wall / CPU | {f(rp.get('help_ms'), '.0f')} ms / "
            f"{f(rp.get('help_cpu_ms'), '.0f')} ms |"
        )
        add("")

    section(
        "Catalog (issue 5)",
        "catalog",
        f"{cat.get('refs', 0):,.0f} synthetic step refs (8-32 samples, 1 in 10 with 2 ranks), one "
        "result each, 10% diverged.",
    )
    if cat:
        add("| measurement | value |")
        add("|---|---:|")
        add(f"| sync | {f(cat['sync'].get('s'), '.1f')} s |")
        for name, k in (
            ("`lookup_step` (300 random)", "lookup"),
            ("`query_steps(first_divergent_stage, limit=1000)` (30 runs)", "query"),
            ("`query_steps(run, limit=100)` (30 runs)", "query_run"),
        ):
            x = cat[k]
            add(
                f"| {name} | median {f(x.get('med'))} ms, p95 {f(x.get('p95'))} ms, p99 "
                f"{f(x.get('p99'))} ms |"
            )
        add("")

    section(
        "Store bytes and ingest (issues 4 and 33)",
        "store",
        "A routed long run from `trajstore.examples.gen_long_run` (routes [T, 48, 8], 18% of "
        "train-route token-layers redrawn, 10% resumed steps; 6 rollouts x 4 steps x 64 "
        "samples) and a run of small bundles (6 x 4 x 128 samples, no routes), each stored "
        "by `trajstore ingest` and by Hugging Face Xet's local CAS, alternating in one script "
        "(`bench_store.py`); physical bytes are each store's directory on disk.",
    )
    if st and ing:
        add(
            f"{st.get('bundles', 0):.0f} bundles, {st.get('logical_mb', 0):.0f} MB of bundle files."
        )
        add("")
        add("| method | physical/logical | MB/s | vs torch.save |")
        add("|---|---:|---:|---:|")
        add(f"| torch.save (payloads only) | - | {st['save'].get('mbps', 0):.0f} | 1.00 |")
        for name, k in (
            ("zstd-3 per file", "zstd"),
            ("Xet, local CAS (hf_xet)", "xet"),
            ("trajstore ingest (validated, fsync)", "ingest"),
        ):
            x = st[k]
            if x:
                add(f"| {name} | {x['ratio']:.3f} | {x['mbps']:.0f} | {x['vs_save']:.2f} |")
        add("")
        add(
            "Route bytes per token-layer (`trajstore stats`, both route tensors): "
            f"{f(st.get('route_btl'))}."
        )
        add("")
    return "\n".join(L)


def rerender(work: Path, log: Path) -> tuple[dict[str, Run], dict[str, str], str, str, str, str]:
    """The runs of a finished run_all, rebuilt from its console log and kept workdir.

    Same numbers as the original run.
    """
    text = log.read_text()
    m = re.search(r"^machine (\{.*?\}); load", text, re.M)
    g = re.search(r"Generated by `(.+?)` \((\w+) sizes\) from (.+?) to (.+?) UTC", text)
    if m is None or g is None:
        raise SystemExit(f"{log}: not the console log of a finished run_all")
    runs: dict[str, Run] = {}
    for key, command, before in re.findall(
        r"^== ([\w#]+): (\.venv/bin/python .+?)  \(load ([\d.]+)\)$", text, re.M
    ):
        end = re.search(
            rf"^== {re.escape(key)}: (\d+) s, exit (-?\d+), load [\d.]+ -> ([\d.]+)$", text, re.M
        )
        if end is None:
            raise SystemExit(f"{log}: {key} did not finish")
        r = Run(
            key,
            ["python", *command.split()[1:]],
            rc=int(end[2]),
            seconds=float(end[1]),
            load_before=(float(before), 0.0, 0.0),
            load_after=(float(end[3]), 0.0, 0.0),
        )
        r.stdout = (work / f"{key}.log").read_text().split("\n--- stderr ---\n")[0]
        js = work / f"{key}.json"
        if r.ok:
            if js.exists():
                r.data = json.loads(js.read_text())
            else:
                parse_printed(r)
        if r.base in runs:
            runs[r.base].reps.append(r)  # a later repetition (`--reps`)
        else:
            runs[key] = r
    return runs, ast.literal_eval(m[1]), g[3], g[4], g[1], g[2]


def write_doc(doc: Path, block: str) -> None:
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc}: no `{BEGIN}` ... `{END}` block to replace")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{block}\n{END}{tail}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes: checks the pipeline, numbers not meaningful",
    )
    ap.add_argument(
        "--workdir", type=Path, help="stores and logs go here (kept); default: a temp dir, removed"
    )
    ap.add_argument(
        "--doc",
        type=Path,
        help=f"doc to update (default {DOC.relative_to(ROOT)}; not with --quick)",
    )
    ap.add_argument(
        "--no-cold", action="store_true", help="do not drop the page cache (figures are then warm)"
    )
    ap.add_argument(
        "--reps",
        type=int,
        default=None,
        help="runs of each benchmark; a verdict needs 3 whose spread is under the margin "
        "(scripts/bench/verdicts.py; default 3, --quick 1)",
    )
    ap.add_argument(
        "--render-from",
        type=Path,
        metavar="WORKDIR",
        help=(
            "run nothing: rewrite the tables from a finished run's kept --workdir (its run_all.log)"
        ),
    )
    ap.add_argument(
        "--log", type=Path, help="with --render-from: the console log (default WORKDIR/run_all.log)"
    )
    args = ap.parse_args()
    if args.render_from:
        runs, mach, started, ended, cmd, size = rerender(
            args.render_from, args.log or args.render_from / "run_all.log"
        )
        block = render(runs, mach, started, ended, cmd, size, rerendered=True)
        print(block)
        write_doc(args.doc or DOC, block)
        return 0
    size = "quick" if args.quick else "full"
    S = SIZES[size]
    doc = args.doc or (None if args.quick else DOC)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-all-", dir=ROOT.parent))
    work.mkdir(parents=True, exist_ok=True)
    CONSOLE.append(work / "run_all.log")
    CONSOLE[0].write_text("")
    store = work / "scale-store"
    if store.exists():
        shutil.rmtree(store)
    cmd = (
        "make bench"
        if os.environ.get("TRAJSTORE_BENCH_VIA_MAKE")
        else " ".join([".venv/bin/python", "scripts/bench/run_all.py", *sys.argv[1:]])
    )
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    mach = machine()
    say(f"machine {mach}; load {os.getloadavg()}; workdir {work}")
    cold = [] if args.no_cold else ["--cold"]
    runs: dict[str, Run] = {}
    reps = args.reps or (1 if args.quick else 3)

    def bench(key: str, script: str, argv: list[str], json_out: bool) -> Run:
        """Run a benchmark `reps` times (keys key, key#2, ...); the first carries the rest."""
        first: Run | None = None
        for i in range(1, reps + 1):
            if key == "scale":
                shutil.rmtree(store, ignore_errors=True)  # each run builds its own store
            r = run(key if i == 1 else f"{key}#{i}", script, argv, work, json_out)
            if r.ok and not r.data:
                parse_printed(r)
            if first is None:
                first = r
            else:
                first.reps.append(r)
        assert first is not None
        return first

    try:
        runs["routes"] = bench("routes", "bench_routes.py", S["routes"], True)
        runs["capture"] = bench("capture", "bench_capture.py", S["capture"], True)
        # scripts with their own repetitions inside, run once
        runs["trl_capture"] = run(
            "trl_capture", "bench_trl_capture.py", S["trl_capture"], work, True
        )
        runs["scale"] = bench(
            "scale",
            "bench_replay_all.py",
            ["--build", str(store), "--distinct", *S["scale"], *cold],
            True,
        )
        shutil.rmtree(store, ignore_errors=True)
        runs["ceiling"] = bench("ceiling", "bench_http_ceiling.py", [], False)
        runs["replay"] = bench("replay", "bench_replay.py", S["replay"], False)
        runs["catalog"] = bench(
            "catalog", "bench_catalog.py", [*S["catalog"], "--dir", str(work)], False
        )
        runs["store"] = bench(
            "store", "bench_store.py", [*S["store"], "--workdir", str(work)], False
        )
        scale_store = work / "scale100k-store"
        runs["scale100k"] = run(
            "scale100k",
            "bench_scale.py",
            [*S["scale100k"], "--dir", str(scale_store)],
            work,
            True,
        )
        shutil.rmtree(scale_store, ignore_errors=True)
        for r in runs.values():
            if r.ok and not r.data:
                parse_printed(r)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    ended = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    block = render(runs, mach, started, ended, cmd, size)
    say(block)
    if doc is not None:
        write_doc(doc, block)
        print(f"\nwrote {doc}")
    failed = [k for k, r in runs.items() if not r.ok]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
