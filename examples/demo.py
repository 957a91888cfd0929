"""`trajstore demo [DIR]` (and `make demo`): the whole job end to end on a local store, as a check.

1. a tiny MoE GRPO run captures runs `baseline` and `r3` through CaptureManager;
2. a synthetic long run with injected faults (streamed-group normalization in
   some rollouts, a wrong clip in some steps) is ingested beside them, with the
   public producer's fixture bundles;
3. every bundle is replayed with --record;
4. it prints sizes and dedup, the first-divergent-stage histogram, the steps
   rooted in reward.post_process (checked against the injected rollouts), the
   router comparison, and the commands to type next;
5. R3 through TRL's GRPOTrainer on a tiny transformers Qwen3-MoE (bf16
   rollout engine, fp32 training) as runs `trl-baseline` and `trl-r3`, routes
   recorded and replayed by trajstore.integrations.hf_moe, every captured
   bundle replayed (exit 0) and the two runs compared (skipped, saying so,
   without the `trl` extra).

Every step runs the real `trajstore` CLI, and the trainers as `python -m
trajstore.examples.*`; everything it needs is installed with trajstore, so it
runs from a wheel as well as from a checkout. Any failed expectation exits 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

#: the public producer's bundles the demo ingests (a copy of tests/fixtures/relax-v2's, shipped)
FIXTURES = Path(__file__).resolve().parent / "data" / "relax-v2"
FAULT_ROLLOUTS = (3, 7)  # streamed-group normalization fault
FAULT_CLIP_STEPS = ("5:1", "10:2")  # wrong eps_clip_high
ROLLOUTS, STEPS_PER_ROLLOUT = 12, 3
T0 = time.perf_counter()


def say(text: str) -> None:
    print(f"\n[{time.perf_counter() - T0:6.1f}s] {text}", flush=True)


def fail(message: str) -> NoReturn:
    """Exit 1 with `message` on stderr, after everything already printed to stdout."""
    sys.stdout.flush()
    raise SystemExit(message)


def run(cmd: list[str], *, expect: tuple[int, ...] = (0,), show: bool = True) -> str:
    """Run `cmd`; its stdout (when shown), then its stderr, follow the `$ cmd` line in order.

    Each stream is flushed before the other is written: with both redirected to one file,
    stdout is block-buffered and stderr is not, so the lines came out of order."""
    shown = cmd[2:] if cmd[1:3] == ["-m", "trajstore"] else ["python", *cmd[1:]]
    print("$ " + " ".join(shown), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if show:
        sys.stdout.write(proc.stdout)
        sys.stdout.flush()
    sys.stderr.write(proc.stderr)
    sys.stderr.flush()
    if proc.returncode not in expect:
        fail(f"demo: `{' '.join(cmd)}` exited {proc.returncode}, expected {expect}")
    return proc.stdout


def trajstore(*args: str, expect: tuple[int, ...] = (0,), show: bool = True) -> str:
    return run([sys.executable, "-m", "trajstore", *args], expect=expect, show=show)


def check(cond: bool, what: str) -> None:
    if not cond:
        fail(f"demo: expectation failed: {what}")
    print(f"  ok: {what}", flush=True)


def r3_section(store: Path, steps: int) -> None:
    """TRL GRPO runs trl-baseline and trl-r3 (bf16 rollout, fp32 training), each captured step
    replayed, and the two compared: baseline routes drift, r3 executes the rollout's."""
    runs = ("trl-baseline", "trl-r3")
    run([sys.executable, "-m", "trajstore.examples.trl_moe_r3", "--store", str(store),
         "--steps", str(steps), "--seed", "0"])  # fmt: skip
    for name in runs:
        replayed = json.loads(
            trajstore("replay", "--store", str(store), "--run", name, "--all", "--json", show=False)
        )
        check(
            replayed["total"] == 2 * steps and replayed["diverged"] == 0,
            f"`trajstore replay --store {store} --run {name} --all` exits 0: "
            f"{replayed['total']} rollout and step bundles pass",
        )
    compare = ["router", "compare", "--store", str(store), "--run", runs[0], "--run", runs[1]]
    trajstore(*compare)
    doc = json.loads(trajstore(*compare, "--format", "json", show=False))
    base = [row["runs"][runs[0]]["route_mismatch_rate"] for row in doc["steps"]]
    r3 = [row["runs"][runs[1]]["route_mismatch_rate"] for row in doc["steps"]]
    check(sum(rate or 0 for rate in base) > 0, "trl-baseline route mismatch > 0 (bf16 vs fp32)")
    check(
        len(r3) == steps and all(rate == 0 for rate in r3),
        "trl-r3 route mismatch exactly 0 on every step (the rollout's experts executed)",
    )


#: written in the work directory when the demo makes it: a later run may recreate both
DEMO_MARK = ".trajstore-demo"


def own_dirs(store: Path, work: Path) -> str | None:
    """Recreate the demo's store and work directory, empty; or say why not (None: done).

    Only what the demo made is deleted: an existing non-empty directory is recreated
    when the work directory holds DEMO_MARK, so a real store given by mistake
    (`trajstore demo ~/runs/store`) is refused, never removed.
    """
    for d in (store, work):
        if d.is_symlink() or (d.exists() and not d.is_dir()):
            return f"{d}: exists and is not a directory"
    made_by_demo = (work / DEMO_MARK).is_file()
    for d in (store, work):
        if d.is_dir() and any(d.iterdir()) and not made_by_demo:
            return (
                f"{d} exists and was not made by the demo (no {work / DEMO_MARK}); "
                "give a new directory, or remove it yourself"
            )
    for d in (store, work):
        shutil.rmtree(d, ignore_errors=True)
    try:
        work.mkdir(parents=True)
    except (FileExistsError, NotADirectoryError, PermissionError) as e:
        return f"cannot create {work}: {e.strerror}: {e.filename}"
    (work / DEMO_MARK).write_text(
        f"made by `trajstore demo`: it recreates {store.name} and this directory on each run\n"
    )
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--store", default="demo-store", help="store to (re)create (default: ./demo-store)"
    )
    parser.add_argument("--moe-steps", type=int, default=6)
    parser.add_argument("--trl-steps", type=int, default=2)
    args = parser.parse_args(argv)
    store = Path(args.store)
    work = store.parent / (store.name + "-work")
    refusal = own_dirs(store, work)
    if refusal is not None:
        print(f"trajstore demo: error: {refusal}", file=sys.stderr)
        return 2

    say("1/6 tiny MoE GRPO run, captured through CaptureManager (runs baseline and r3)")
    run(
        [
            sys.executable,
            "-m",
            "trajstore.examples.moe_grpo",
            "--store",
            str(store),
            "--mode",
            "both",
            "--steps",
            str(args.moe_steps),
            "--seed",
            "0",
        ]
    )

    say("2/6 synthetic long run with injected faults, plus the Relax fixture bundles")
    capture_dir = work / "capture"
    gen = [
        sys.executable,
        "-m",
        "trajstore.examples.gen_long_run",
        str(capture_dir),
        "--rollouts",
        str(ROLLOUTS),
        "--steps",
        str(STEPS_PER_ROLLOUT),
        "--samples",
        "64",
        "--max-len",
        "600",
        "--resumed",
        "0.1",
        "--seed",
        "7",
    ]
    for rollout in FAULT_ROLLOUTS:
        gen += ["--fault-reward-norm", str(rollout)]
    for step in FAULT_CLIP_STEPS:
        gen += ["--fault-eps", step]
    run(gen)
    trajstore("ingest", str(capture_dir), "--store", str(store), "--run", "synthetic")
    trajstore(
        "ingest",
        str(FIXTURES / "example_capture_dir"),
        str(FIXTURES / "example_bundle"),
        "--store",
        str(store),
        "--run",
        "relax",
    )

    say("3/6 replay every bundle from the store, recording the results")
    out = trajstore(
        "replay",
        "--store",
        str(store),
        "--all",
        "--record",
        "--workers",
        "2",
        "--json",
        expect=(0, 1),
        show=False,
    )
    summary = json.loads(out)
    check(summary["refused"] == 0, f"no bundle refused ({summary['total']} replayed)")

    say("4/6 what the store holds and what diverged")
    stats = json.loads(trajstore("stats", "--store", str(store), "--json", show=False))
    trajstore("stats", "--store", str(store))
    check(
        stats["dedup_ratio"] > 1.0,
        f"dedup ratio {stats['dedup_ratio']:.2f} > 1 (logical {stats['logical_bytes']} B, physical "
        f"{stats['physical_bytes']} B)",
    )
    print("first divergent stage histogram:")
    for stage, count in summary["first_divergent_stage_histogram"].items():
        print(f"  {stage:<22} {count}")
    rows = json.loads(
        trajstore(
            "query",
            "steps",
            "--store",
            str(store),
            "--run",
            "synthetic",
            "--first-divergent-stage",
            "reward.post_process",
            "--format",
            "json",
            show=False,
        )
    )
    trajstore(
        "query",
        "steps",
        "--store",
        str(store),
        "--run",
        "synthetic",
        "--first-divergent-stage",
        "reward.post_process",
    )
    check(
        {row["rollout_id"] for row in rows} == set(FAULT_ROLLOUTS),
        "steps rooted in reward.post_process are exactly those of the injected rollouts "
        f"{FAULT_ROLLOUTS}",
    )
    clip = json.loads(
        trajstore(
            "query",
            "steps",
            "--store",
            str(store),
            "--run",
            "synthetic",
            "--first-divergent-stage",
            "loss.policy",
            "--format",
            "json",
            show=False,
        )
    )
    check(
        {f"{row['rollout_id']}:{row['step_id']}" for row in clip} >= set(FAULT_CLIP_STEPS),
        f"the wrong-clip steps {FAULT_CLIP_STEPS} diverge first at loss.policy",
    )

    say("5/6 MoE routing consistency: baseline vs r3")
    plot = work / "router_compare.png"
    trajstore(
        "router",
        "compare",
        "--store",
        str(store),
        "--run",
        "baseline",
        "--run",
        "r3",
        "--plot",
        str(plot),
    )
    comparison = json.loads(
        trajstore(
            "router",
            "compare",
            "--store",
            str(store),
            "--run",
            "baseline",
            "--run",
            "r3",
            "--format",
            "json",
            show=False,
        )
    )
    baseline = [row["runs"]["baseline"]["route_mismatch_rate"] for row in comparison["steps"]]
    r3 = [row["runs"]["r3"]["route_mismatch_rate"] for row in comparison["steps"]]
    check(sum(rate or 0 for rate in baseline) > 0, "baseline route mismatch > 0")
    check(all(rate == 0 for rate in r3), "r3 route mismatch exactly 0 on every step")

    say("6/6 R3 through TRL's GRPOTrainer on a transformers Qwen3-MoE: baseline vs r3")
    missing = [
        m for m in ("transformers", "trl", "datasets") if importlib.util.find_spec(m) is None
    ]
    if missing:
        print(f"  skipped: needs {', '.join(missing)} (pip install 'trajstore[trl]')")
    else:
        r3_section(store, args.trl_steps)

    first = rows[0] if rows else {"rollout_id": FAULT_ROLLOUTS[0], "step_id": 0}
    say(f"done: all expectations met in {time.perf_counter() - T0:.0f}s. Next, try:")
    print(f"  trajstore serve --store {store}")
    print(
        f"  curl -s http://127.0.0.1:8000/v1/runs/synthetic/steps/{first['rollout_id']}:{first['step_id']}"
    )
    print(
        f"  trajstore replay --store {store} --run synthetic --step "
        f"{first['rollout_id']}:{first['step_id']}"
    )
    step_ref = f"{first['rollout_id']}:{first['step_id']}"
    print("\nWith `trajstore serve` running, open the web view (docs/web.md):")
    print("  http://127.0.0.1:8000/")
    print(f"  http://127.0.0.1:8000/runs/synthetic/steps/{step_ref}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
