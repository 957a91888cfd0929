#!/usr/bin/env python
"""Every issue-15 figure as a ratio, in one script run.

    .venv/bin/python scripts/bench/bench_perf.py [--quick] [--doc] [--workdir DIR]
        [--only NAME,NAME] [--timeout S]

Runs each issue-15 benchmark as its own subprocess with `--json PATH` (and
`--quick` when given), one after the other so they never compete with each
other for the cores:

| script | figures |
|---|---|
| `bench_store.py` | ingest (routed long run, small bundles), ratio to Hugging Face Xet, bytes |
| `bench_dedup.py` | physical/logical bytes, routed long run and dense run |
| `bench_cli.py` | `trajstore query`/`sql`/`ls` whole command wall time |
| `bench_store_replay.py` | replay of a step from the store, ratio to its exported directory |
| `bench_rest.py` | REST step lookups (wrk) and the first payload download |

Each script writes `{"figures": [{name, target, value, unit, met, detail}],
"command": str, "load": [before, after]}`; a figure may add `reps` (its values
over the script's own repetitions), `exact` (bytes: the same every run),
`workload` and `target_workload` (the size measured, the size the target
names). Each script runs `--reps` times (default 3, `--quick` 1) and the
verdict of a figure is decided here by scripts/bench/verdicts.py from its
values over those runs (or its `reps`), never from the script's own `met`:
met/missed only when its spread is under the margin and the target's workload
was measured, else inconclusive / not measured. This script prints one table
(figure, target, value, verdict, command, load). A script that is missing,
fails, times out or writes no valid figures is a row of its own saying so; the
others still run.

`--doc` rewrites the block between `<!-- perf: begin -->` and
`<!-- perf: end -->` in docs/benchmarks.md (creating its section, "Performance
(issue 15): every figure in one run", after the `run_all` block the first
time); nothing else in the file changes. `--workdir DIR` keeps each script's
JSON and log there. Exit status: 0 when every script ran (met or missed),
1 when one was missing or failed, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verdicts import NOT_MEASURED, Target, Verdict, decide  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BENCH = Path(__file__).resolve().parent
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- perf: begin -->", "<!-- perf: end -->"
SECTION = "## Performance (issue 15): every figure in one run"
RUN_ALL_END = "<!-- run_all: end -->"

#: (name, script): the issue-15 benchmarks, in the order they run
SCRIPTS: list[tuple[str, str]] = [
    ("ingest", "bench_store.py"),
    ("dedup", "bench_dedup.py"),
    ("cli", "bench_cli.py"),
    ("store replay", "bench_store_replay.py"),
    ("rest", "bench_rest.py"),
]
FIGURE_KEYS = {"name": str, "target": str, "value": (int, float), "unit": str, "met": bool}


@dataclass
class Result:
    """One script's run: its figures, or why there are none."""

    name: str
    script: str
    command: str
    problem: str | None = None
    figures: list[dict[str, Any]] = field(default_factory=list)
    load: tuple[float | None, float | None] = (None, None)
    seconds: float = 0.0
    #: the later runs of the same script (`--reps`)
    reps: list[Result] = field(default_factory=list)

    def verdict(self, f: dict[str, Any]) -> Verdict:
        """Figure `f`'s verdict over every run of the script (verdicts.decide)."""
        m = re.match(r"\s*(<=|>=)\s*([\d.,]+)", f["target"])
        if m is None:
            return Verdict(NOT_MEASURED, f"target {f['target']!r} is not a bound")
        target = Target(float(m[2].replace(",", "")), m[1], workload=f.get("target_workload"))
        same = [g for r in [self, *self.reps] for g in r.figures if g["name"] == f["name"]]
        if all(isinstance(g.get("reps"), list) for g in same):
            values = [float(x) for g in same for x in g["reps"]]
        else:
            values = [float(g["value"]) for g in same]
        sizes = [g.get("workload") for g in same]
        workload = None if None in sizes else min(sizes)
        return decide(values, target, workload=workload, exact=bool(f.get("exact")))


def load1() -> float:
    return round(os.getloadavg()[0], 2)


def _tail(path: Path, n: int = 1) -> str:
    try:
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return " / ".join(lines[-n:])[:300]


def check_document(doc: Any) -> list[dict[str, Any]]:
    """The figures of a script's JSON document; ValueError says what is wrong with it."""
    if not isinstance(doc, dict) or not isinstance(doc.get("figures"), list):
        raise ValueError('no "figures" list')
    if not doc["figures"]:
        raise ValueError("an empty figures list")
    for i, f in enumerate(doc["figures"]):
        if not isinstance(f, dict):
            raise ValueError(f"figure {i} is not an object")
        for key, kind in FIGURE_KEYS.items():
            if not isinstance(f.get(key), kind) or (key == "value" and isinstance(f[key], bool)):
                raise ValueError(f"figure {i} ({f.get('name', '?')}): bad or missing {key!r}")
    return doc["figures"]


def run_script(
    name: str,
    script: str,
    quick: bool,
    work: Path,
    timeout: float,
    python: str,
    bench: Path = BENCH,
) -> Result:
    """Run one benchmark script; never raises for what the script does."""
    path = bench / script
    out = work / f"{path.stem}.json"
    log = work / f"{path.stem}.log"
    argv = [python, str(path), *(["--quick"] if quick else []), "--json", str(out)]
    shown = shlex.join(
        [".venv/bin/python", f"scripts/bench/{script}", *argv[2:-1], f"{path.stem}.json"]
    )
    res = Result(name, script, shown)
    if not path.is_file():
        res.problem = "missing: the script does not exist"
        return res
    out.unlink(missing_ok=True)
    before = load1()
    t0 = time.perf_counter()
    with log.open("w") as fh:
        # its own session, so that a timeout also ends the servers and workers it started
        proc = subprocess.Popen(
            argv, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except BaseException:  # Ctrl-C: end what this script started, then stop
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            raise
    res.seconds = time.perf_counter() - t0
    res.load = (before, load1())
    if rc is None:
        res.problem = f"failed: timed out after {timeout:.0f} s"
        return res
    if rc != 0:
        res.problem = f"failed: exit {rc}: {_tail(log) or 'no output'}"
        return res
    try:
        doc = json.loads(out.read_text())
        res.figures = check_document(doc)
    except FileNotFoundError:
        res.problem = "failed: exit 0 but no --json file written"
        return res
    except ValueError as e:  # JSONDecodeError is a ValueError
        res.problem = f"failed: its --json file is not valid: {e}"
        return res
    if isinstance(doc.get("command"), str) and doc["command"]:
        res.command = doc["command"].replace(str(out), out.name).replace(f"{ROOT}/", "")
    lo = doc.get("load")
    if isinstance(lo, list) and len(lo) == 2 and all(isinstance(x, (int, float)) for x in lo):
        res.load = (float(lo[0]), float(lo[1]))
    return res


def _fmt_value(f: dict[str, Any]) -> str:
    v, unit = f["value"], f["unit"]
    text = f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return f"{text}{unit}" if unit in ("x", "%") else f"{text} {unit}".strip()


def _fmt_load(load: tuple[float | None, float | None]) -> str:
    a, b = load
    return "-" if a is None else f"{a:.2f} -> {b:.2f}"


def rows(results: list[Result]) -> list[list[str]]:
    """One table row per figure, and one per script that gave none."""
    out: list[list[str]] = []
    for r in results:
        if r.problem:
            out.append(
                [f"({r.script})", "-", "-", f"**{r.problem}**", r.command, _fmt_load(r.load)]
            )
            continue
        loads = ", ".join(_fmt_load(x.load) for x in [r, *r.reps])
        for f in r.figures:
            verdict = r.verdict(f).cell()
            out.append([f["name"], f["target"], _fmt_value(f), verdict, r.command, loads])
    return out


HEADER = ["figure", "target", "value", "verdict", "command", "load (1 min)"]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(table: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for row in table:
        cells = [_cell(c) for c in row]
        cells[4] = f"`{row[4]}`"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def text_table(table: list[list[str]]) -> str:
    """Aligned columns; long names and commands are cut, a verdict (why a script gave no
    figures) never is."""
    widths = [min(60, max(len(h), *(len(r[i]) for r in table))) for i, h in enumerate(HEADER)]
    widths[3] = min(widths[3], 12)

    def cut(c: str, i: int) -> str:
        return c if i == 3 or len(c) <= widths[i] else c[: widths[i] - 1] + "…"

    return "\n".join(
        "  ".join(cut(c, i).ljust(widths[i]) for i, c in enumerate(r)).rstrip()
        for r in [HEADER, *table]
    )


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"`nproc` {len(os.sched_getaffinity(0))}, {cpu}, Python {platform.python_version()}"


def block(results: list[Result], command: str, started: datetime, seconds: float) -> str:
    """The measured block of docs/benchmarks.md (between the perf markers)."""
    met = sum(r.verdict(f).status == "met" for r in results for f in r.figures)
    total = sum(len(r.figures) for r in results)
    bad = [r.script for r in results if r.problem]
    details = "\n".join(
        f"- {f['name']}: {f.get('detail', '')}".rstrip(": ")
        for r in results
        for f in r.figures
        if f.get("detail")
    )
    return "\n".join(
        [
            BEGIN,
            f"Generated by `{command}` on {started:%Y-%m-%d %H:%M} UTC ({seconds / 60:.0f} min). "
            f"Machine: {machine()}; shared with other jobs, so every figure is a ratio to a "
            "baseline measured in the same script, and each script's 1-minute load average "
            "before and after it is in the last column.",
            "",
            f"**{met} of {total} figures met**"
            + (f"; no figures from {', '.join(bad)} (see its row)." if bad else "."),
            "",
            markdown_table(rows(results)),
            "",
            "What each figure compares:",
            "",
            details,
            END,
        ]
    )


def write_doc(doc: Path, text: str) -> None:
    """Replace the perf block (or add its section after the run_all block, else at the end)."""
    body = doc.read_text()
    if BEGIN in body and END in body:
        a = body.index(BEGIN)
        b = body.index(END, a) + len(END)
        body = body[:a] + text + body[b:]
    else:
        section = (
            f"{SECTION}\n\n"
            "Written by `scripts/bench/bench_perf.py --doc` (do not edit inside the markers): "
            "it runs every issue-15 benchmark script as a subprocess and collects their "
            "figures. The profiles (where the time goes) and before/after notes are in "
            "each figure's own section below.\n\n"
            f"{text}"
        )
        if RUN_ALL_END in body:
            i = body.index(RUN_ALL_END) + len(RUN_ALL_END)
            body = body[:i] + "\n\n" + section + body[i:]
        else:
            body = body.rstrip("\n") + "\n\n" + section + "\n"
    doc.write_text(body)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="each script's small version")
    ap.add_argument("--doc", action="store_true", help="rewrite the perf block of the doc")
    ap.add_argument("--doc-path", type=Path, default=DOC, help=argparse.SUPPRESS)
    ap.add_argument("--bench-dir", type=Path, default=BENCH, help=argparse.SUPPRESS)
    ap.add_argument("--workdir", type=Path, help="keep each script's JSON and log here")
    ap.add_argument("--only", help="comma list of names or scripts to run (default: all)")
    ap.add_argument("--timeout", type=float, help="seconds per script (900 quick, 7200 full)")
    ap.add_argument(
        "--reps", type=int, help="runs of each script, for the verdicts (default 3, quick 1)"
    )
    args = ap.parse_args()
    chosen = SCRIPTS
    if args.only:
        want = {x.strip() for x in args.only.split(",") if x.strip()}
        chosen = [(n, s) for n, s in SCRIPTS if n in want or s in want or s[:-3] in want]
        unknown = want - {k for n, s in SCRIPTS for k in (n, s, s[:-3])}
        if unknown or not chosen:
            names = ", ".join(s[:-3] for _, s in SCRIPTS)
            print(
                f"bench_perf: unknown --only {', '.join(sorted(unknown))}; scripts: {names}",
                file=sys.stderr,
            )
            return 2
    timeout = args.timeout or (900.0 if args.quick else 7200.0)
    started = datetime.now(timezone.utc)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-perf-") as tmp:
        work = (args.workdir or Path(tmp)).resolve()
        work.mkdir(parents=True, exist_ok=True)
        results = []
        reps = args.reps or (1 if args.quick else 3)
        for name, script in chosen:
            first: Result | None = None
            for i in range(reps):
                print(f"[{name}] {script} (run {i + 1} of {reps}) ...", flush=True)
                r = run_script(
                    name, script, args.quick, work, timeout, sys.executable, args.bench_dir
                )
                state = r.problem or f"{len(r.figures)} figures"
                print(f"[{name}] {r.seconds:.0f} s, load {_fmt_load(r.load)}: {state}", flush=True)
                if first is None:
                    first = r
                elif not r.problem:
                    first.reps.append(r)
            assert first is not None
            results.append(first)
    seconds = time.perf_counter() - t0
    command = shlex.join([".venv/bin/python", "scripts/bench/bench_perf.py", *sys.argv[1:]])
    print()
    print(text_table(rows(results)))
    if args.doc:
        write_doc(args.doc_path, block(results, command, started, seconds))
        print(f"\nwrote the perf block of {args.doc_path}")
    return 1 if any(r.problem for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
