#!/usr/bin/env python
"""Every benchmark figure in one run: `make bench` (full sizes) or `make bench-quick`.

    .venv/bin/python scripts/bench/run.py [--quick] [--reps N] [--only NAME,NAME]
        [--workdir DIR] [--doc] [--timeout S] [--no-cold]

Runs each figure script of FIGURES (below) as its own subprocess, one after the other so
they never compete for the cores, `--reps` times (default 3; `--quick` 1), each with
`--json PATH` (the figures contract of harness.py). Every verdict is decided by
scripts/bench/verdicts.py from a figure's values over those runs (or the script's own
`reps`), never from the script's `met`. Prints one table (figure, target, value, verdict,
command, load); a script that is missing, fails, times out or writes no valid figures is
a row saying so, and the others still run.

`--doc` rewrites the block between `<!-- bench: begin -->` and `<!-- bench: end -->` in
docs/benchmarks.md (added at the end the first time); nothing else in the file changes.
`--quick` runs the same figures on tiny sizes: a smoke test of every script, not figures
to publish (with `--doc` it writes nothing unless `--doc-path` names a file). Exit
status: 0 when every script ran (met or missed), 1 when one was missing or failed, 2 on
bad arguments.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import BENCH, ROOT, Result, load1, machine, machine_line, run_script, say  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench: begin -->", "<!-- bench: end -->"
SECTION = "## Latest run"


@dataclass(frozen=True)
class Entry:
    """One figure script: its name, file, and arguments at full and quick sizes
    (`{work}` is the run's work directory; `{cold}` is `--cold` unless `--no-cold`)."""

    name: str
    script: str
    full: tuple[str, ...] = ()
    quick: tuple[str, ...] = ("--quick",)


SCALE = ("--steps-per-rollout", "4", "--fault-every", "20", "--clip-every", "20")
#: the figures, in the order they run (see docs/benchmarks.md for each target)
FIGURES: list[Entry] = [
    Entry("routes", "bench_routes.py", (), ("--samples", "4")),
    Entry("capture", "bench_capture.py", ("--reps", "4", "--rollouts", "3"),
          ("--reps", "1", "--rollouts", "1", "--hidden", "32", "--vocab", "32",
           "--max-response", "8")),
    # the completion length calibrated to the ~80 ms steps issue 33 names (--step-ms)
    Entry("trl_capture", "bench_trl_capture.py",
          ("--reps", "4", "--steps", "8"), ("--reps", "1", "--steps", "3")),
    Entry("trl_capture_thread", "bench_trl_capture.py",
          ("--reps", "4", "--steps", "8", "--writer", "thread"),
          ("--reps", "1", "--steps", "3", "--writer", "thread")),
    Entry("verl_capture", "bench_verl_capture.py", (), ("--reps", "1", "--rows", "4")),
    Entry("verl_capture_thread", "bench_verl_capture.py", ("--writer", "thread"),
          ("--reps", "1", "--rows", "4", "--writer", "thread")),
    Entry("replay", "bench_replay.py", ("--repeat", "5"), ("--repeat", "1", "--small")),
    Entry("replay_all", "bench_replay_all.py",
          ("--build", "{work}/scale-store", "--distinct", *SCALE, "--steps", "120",
           "--samples", "256", "--mean-tokens", "1024", "--rollouts", "6", "--requests",
           "2000", "--queries", "50", "--lookups", "500", "{cold}"),
          ("--build", "{work}/scale-store", "--distinct", "--steps-per-rollout", "1",
           "--fault-every", "20", "--clip-every", "20", "--steps", "20", "--samples", "8",
           "--mean-tokens", "32", "--rollouts", "2", "--requests", "50", "--queries", "3",
           "--lookups", "20")),
    Entry("catalog", "bench_catalog.py", ("--bundles", "10000", "--dir", "{work}"),
          ("--bundles", "300", "--dir", "{work}")),
    Entry("store", "bench_store.py", ("--workdir", "{work}"),
          ("--quick", "--reps", "1", "--workdir", "{work}")),
    Entry("dedup", "bench_dedup.py", (), ("--quick", "--no-shared")),
    Entry("cli", "bench_cli.py", (), ("--steps", "300", "--runs", "2")),
    Entry("store_replay", "bench_store_replay.py", (),
          ("--quick", "--reps", "1", "--samples", "16", "--mean-tokens", "64")),
    Entry("rest", "bench_rest.py", (), ("--quick", "--repeats", "1", "--rounds", "1")),
    Entry("ray", "bench_ray.py", ("--build", "{work}/ray-store", "--steps", "48"),  # 60 bundles
          ("--build", "{work}/ray-store", "--steps", "4", "--samples", "8", "--mean-tokens",
           "32", "--reps", "1")),
    Entry("ray_s3", "bench_ray.py", ("--s3", "{work}/ray-s3", "--steps", "48"),
          ("--s3", "{work}/ray-s3", "--steps", "4", "--samples", "8", "--mean-tokens", "32",
           "--reps", "1")),
    Entry("mismatch", "bench_mismatch.py", ("--dir", "{work}"), ("--quick", "--dir", "{work}")),
    Entry("scale", "bench_scale.py", ("--dir", "{work}/scale100k"),
          ("--quick", "--steps", "500", "--dir", "{work}/scale100k")),
]  # fmt: skip


# --------------------------------------------------------------------------- tables


def _fmt_value(f: dict) -> str:
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
            out.append(
                [f["name"], f["target"], _fmt_value(f), r.verdict(f).cell(), r.command, loads]
            )
    return out


HEADER = ["figure", "target", "value", "verdict", "command", "load (1 min)"]


def markdown_table(table: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for row in table:
        cells = [c.replace("|", "\\|").replace("\n", " ") for c in row]
        cells[4] = f"`{row[4]}`"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def text_table(table: list[list[str]]) -> str:
    """Aligned columns; long names and commands are cut, a verdict (or why a script gave
    no figures) never is."""
    widths = [min(60, max(len(h), *(len(r[i]) for r in table))) for i, h in enumerate(HEADER)]
    widths[3] = min(widths[3], 12)

    def cut(c: str, i: int) -> str:
        return c if i == 3 or len(c) <= widths[i] else c[: widths[i] - 1] + "…"

    return "\n".join(
        "  ".join(cut(c, i).ljust(widths[i]) for i, c in enumerate(r)).rstrip()
        for r in [HEADER, *table]
    )


def block(results: list[Result], command: str, started: datetime, seconds: float) -> str:
    """The generated block of docs/benchmarks.md (between the bench markers)."""
    met = sum(r.verdict(f).status == "met" for r in results for f in r.figures)
    total = sum(len(r.figures) for r in results)
    bad = [r.script for r in results if r.problem]
    details = [
        f"- {f['name']}: {f['detail']}" for r in results for f in r.figures if f.get("detail")
    ]
    return "\n".join(
        [
            BEGIN,
            f"Generated by `{command}` on {started:%Y-%m-%d %H:%M} UTC ({seconds / 60:.0f} min). "
            f"Machine: {machine_line(machine())}. Each script's 1-minute load average before "
            "and after it is in the last column.",
            "",
            f"**{met} of {total} figures met**"
            + (f"; no figures from {', '.join(bad)} (see its row)." if bad else "."),
            "",
            markdown_table(rows(results)),
            "",
            "What each figure compares:",
            "",
            *details,
            END,
        ]
    )


def write_doc(doc: Path, text: str) -> None:
    """Replace the bench block (or add its section at the end)."""
    body = doc.read_text()
    if BEGIN in body and END in body:
        a = body.index(BEGIN)
        b = body.index(END, a) + len(END)
        body = body[:a] + text + body[b:]
    else:
        body = body.rstrip("\n") + f"\n\n{SECTION}\n\n{text}\n"
    doc.write_text(body)


# --------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, no figures")
    ap.add_argument("--doc", action="store_true", help="rewrite the bench block of the doc")
    ap.add_argument("--doc-path", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--bench-dir", type=Path, default=BENCH, help=argparse.SUPPRESS)
    ap.add_argument("--workdir", type=Path, help="keep each script's JSON, log and stores here")
    ap.add_argument("--only", help="comma list of figure names or scripts (default: all)")
    ap.add_argument("--timeout", type=float, help="seconds per script (900 quick, 7200 full)")
    ap.add_argument("--reps", type=int, help="runs of each script (default 3, --quick 1)")
    ap.add_argument(
        "--no-cold", action="store_true", help="do not drop the page cache (figures are warm)"
    )
    args = ap.parse_args()
    chosen = FIGURES
    if args.only:
        want = {x.strip() for x in args.only.split(",") if x.strip()}
        keys = {e.name: e for e in FIGURES} | {e.script: e for e in FIGURES}
        keys |= {e.script[:-3]: e for e in FIGURES}
        unknown = want - set(keys)
        if unknown:
            names = ", ".join(e.name for e in FIGURES)
            print(f"run.py: unknown --only {', '.join(sorted(unknown))}; figures: {names}",
                  file=sys.stderr)  # fmt: skip
            return 2
        chosen = [e for e in FIGURES if e in {keys[w] for w in want}]
    timeout = args.timeout or (900.0 if args.quick else 7200.0)
    reps = args.reps or (1 if args.quick else 3)
    cold = "" if args.no_cold or args.quick else "--cold"
    started = datetime.now(timezone.utc)
    t0 = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="bench-", dir=ROOT.parent)
    work = (args.workdir or Path(tmp)).resolve()
    work.mkdir(parents=True, exist_ok=True)
    say(f"machine {machine()}; load {load1()}; workdir {work}")
    results: list[Result] = []
    try:
        for e in chosen:
            argv = [a.format(work=work, cold=cold) for a in (e.quick if args.quick else e.full)]
            first: Result | None = None
            for i in range(reps):
                for a in argv:  # each run builds its own store (`--build {work}/x-store`)
                    if a.endswith("-store"):
                        shutil.rmtree(a, ignore_errors=True)
                say(f"[{e.name}] {e.script} (run {i + 1} of {reps}) ...")
                r = run_script(e.name, e.script, [a for a in argv if a], work, timeout,
                               args.bench_dir)  # fmt: skip
                state = r.problem or f"{len(r.figures)} figures"
                say(f"[{e.name}] {r.seconds:.0f} s, load {_fmt_load(r.load)}: {state}")
                if first is None:
                    first = r
                elif not r.problem:
                    first.reps.append(r)
            assert first is not None
            results.append(first)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.perf_counter() - t0
    command = shlex.join([".venv/bin/python", "scripts/bench/run.py", *sys.argv[1:]])
    print()
    print(text_table(rows(results)))
    if args.doc and args.quick and args.doc_path is None:
        print("\n--quick: docs/benchmarks.md not written (quick sizes are not figures)")
    elif args.doc:
        doc = args.doc_path or DOC
        write_doc(doc, block(results, command, started, seconds))
        print(f"\nwrote the bench block of {doc}")
    return 1 if any(r.problem for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
