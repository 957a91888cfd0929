#!/usr/bin/env python
"""Whole-command wall time of `trajstore ls`, `query steps` and `sql` on a big store
(issue 15: at most 0.3 s on a 10,000-step store).

    .venv/bin/python scripts/bench/bench_cli.py [--steps 10000] [--runs 9] [--dir DIR]
        [--quick] [--json PATH]

The store is built the cheap way of bench_catalog.py: refs and result documents
written directly (one result per step, 10% diverged; one step in 10 on two ranks),
with the store marker, then synced once in this process with the documents at hand,
so the commands find a catalog in step with the refs, as a user's second command
does. Each command runs as a fresh process (the console script), output to
/dev/null; rounds alternate the commands, with `python -c pass` and
`trajstore --help` in the same rounds as the baseline (interpreter start and the CLI's
own imports, on the same loaded machine). Bytecode is cached (PYTHONPYCACHEPREFIX, a
temporary folder) as an installed package has it, whatever PYTHONDONTWRITEBYTECODE
says; a first untimed run of each command fills it. Reported: median and p90 per command.
`--quick`: 1,000 steps, 5 rounds. `--dir` keeps (and reuses) the built store.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_catalog import build_store  # noqa: E402
from harness import emit, figure, load1  # noqa: E402

TARGET_S = 0.3


def make_store(root: Path, steps: int) -> int:
    """A synced store of about `steps` actor steps; returns the exact step count."""
    from trajstore.catalog import open_catalog, run_readonly_sql, sync_catalog

    if not (root / "TRAJSTORE_STORE").is_file():
        # bench_catalog counts bundles; one step in ten has two ranks
        docs, _ = build_store(root, int(steps * 1.1))
        (root / "TRAJSTORE_STORE").write_bytes(b"trajstore store, layout 1\n")
        with open_catalog(root) as cat:
            sync_catalog(cat, root, docs.__getitem__)
    with open_catalog(root) as cat:
        _, rows = run_readonly_sql(
            cat,
            "SELECT count(*) FROM (SELECT DISTINCT run, rollout_id, step_id FROM bundles "
            "WHERE kind = 'step')",
        )
    return int(rows[0][0])


def cli() -> list[str]:
    script = Path(sys.executable).with_name("trajstore")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from trajstore.cli import main; sys.exit(main())"]


#: the environment of the timed commands: bytecode cached (in a private folder, not the
#: checkout) as an installed package has it, even where PYTHONDONTWRITEBYTECODE is set
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def wall(argv: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV
    )
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return took


def time_commands(commands: dict[str, list[str]], rounds: int) -> dict[str, list[float]]:
    """Each command's wall time in `rounds` fresh processes, the order alternating round by
    round, after one warm-up run each (page cache and .pyc files, in a private cache)."""
    with tempfile.TemporaryDirectory(prefix="bench-cli-pycache-") as pycache:
        ENV["PYTHONPYCACHEPREFIX"] = pycache
        for argv in commands.values():
            wall(argv)
        times: dict[str, list[float]] = {name: [] for name in commands}
        for r in range(rounds):
            order = list(commands) if r % 2 == 0 else list(reversed(commands))
            for name in order:
                times[name].append(wall(commands[name]))
    return times


def p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.9 * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="actor steps (default 10,000)")
    ap.add_argument("--runs", type=int, default=None, help="rounds (default 9; --quick 5)")
    ap.add_argument("--dir", type=Path, help="build the store here and keep it (reused)")
    ap.add_argument("--quick", action="store_true", help="1,000 steps, 5 rounds")
    ap.add_argument("--json", type=Path, metavar="PATH", help="write the figures here")
    args = ap.parse_args()
    steps = args.steps or (1000 if args.quick else 10_000)
    runs = args.runs or (5 if args.quick else 9)
    load_before = load1()

    tmp = None
    if args.dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench-cli-")
        root = Path(tmp.name) / "store"
    else:
        root = args.dir
    t0 = time.perf_counter()
    n_steps = make_store(root, steps)
    print(f"store: {n_steps} steps at {root} ({time.perf_counter() - t0:.1f} s)", flush=True)

    base = cli()
    commands = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "trajstore --help": [*base, "--help"],
        "ls": [*base, "ls", "--store", str(root)],
        "query steps": [*base, "query", "steps", "--store", str(root)],
        "sql": [*base, "sql", "SELECT count(*) AS n FROM bundles", "--store", str(root)],
    }
    times = time_commands(commands, runs)

    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"{'command':18} {'median s':>9} {'p90 s':>7}")
    for name, ts in times.items():
        print(f"{name:18} {med[name]:9.3f} {p90(ts):7.3f}")
    figures = []
    for name in ("ls", "query steps", "sql"):
        figures.append(
            figure(
                f"trajstore {name}, whole command wall time",
                f"<= {TARGET_S} s on a 10,000-step store",
                med[name],
                "s",
                reps=times[name],
                workload=n_steps,
                target_workload=10_000,
                detail=(
                    f"median of {runs} fresh processes on {n_steps} steps (p90 "
                    f"{p90(times[name]):.3f} s); baseline in the same rounds: python -c pass "
                    f"{med['python -c pass']:.3f} s, trajstore --help "
                    f"{med['trajstore --help']:.3f} s"
                ),
            )
        )
    emit(args.json, figures, load_before)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
