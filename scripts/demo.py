"""`make demo`: the whole job end to end on a local store, as a check.

1. a tiny MoE GRPO run captures runs `baseline` and `r3` through CaptureManager;
2. a synthetic long run with injected faults (streamed-group normalization in
   some rollouts, a wrong clip in some steps) is ingested beside them, with the
   public producer's fixture bundles;
3. every bundle is replayed with --record;
4. it prints sizes and dedup, the first-divergent-stage histogram, the steps
   rooted in reward.post_process (checked against the injected rollouts), the
   router comparison, and the commands to type next.

Every step runs the real `trajstore` CLI; any failed expectation exits 1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "relax-v2"  # the public producer's bundles
FAULT_ROLLOUTS = (3, 7)  # streamed-group normalization fault
FAULT_CLIP_STEPS = ("5:1", "10:2")  # wrong eps_clip_high
ROLLOUTS, STEPS_PER_ROLLOUT = 12, 3
T0 = time.perf_counter()


def say(text: str) -> None:
    print(f"\n[{time.perf_counter() - T0:6.1f}s] {text}", flush=True)


def run(cmd: list[str], *, expect: tuple[int, ...] = (0,), show: bool = True) -> str:
    print("$ " + " ".join(cmd[2:] if cmd[1:3] == ["-m", "trajstore"] else cmd[1:]), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if show:
        sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    if proc.returncode not in expect:
        raise SystemExit(f"demo: `{' '.join(cmd)}` exited {proc.returncode}, expected {expect}")
    return proc.stdout


def trajstore(*args: str, expect: tuple[int, ...] = (0,), show: bool = True) -> str:
    return run([sys.executable, "-m", "trajstore", *args], expect=expect, show=show)


def check(cond: bool, what: str) -> None:
    if not cond:
        raise SystemExit(f"demo: expectation failed: {what}")
    print(f"  ok: {what}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default=str(ROOT / "demo-store"), help="store to (re)create")
    ap.add_argument("--moe-steps", type=int, default=6)
    args = ap.parse_args()
    store = Path(args.store)
    work = store.parent / (store.name + "-work")
    for p in (store, work):  # the demo's own directories, recreated each run
        shutil.rmtree(p, ignore_errors=True)
    work.mkdir(parents=True)

    say("1/5 tiny MoE GRPO run, captured through CaptureManager (runs baseline and r3)")
    run([sys.executable, str(ROOT / "scripts" / "moe_grpo.py"), "--store", str(store), "--mode", "both",
         "--steps", str(args.moe_steps), "--seed", "0"])

    say("2/5 synthetic long run with injected faults, plus the Relax fixture bundles")
    cap = work / "capture"
    gen = [sys.executable, str(ROOT / "scripts" / "gen_long_run.py"), str(cap), "--rollouts", str(ROLLOUTS),
           "--steps", str(STEPS_PER_ROLLOUT), "--samples", "64", "--max-len", "600", "--resumed", "0.1", "--seed", "7"]
    for r in FAULT_ROLLOUTS:
        gen += ["--fault-reward-norm", str(r)]
    for s in FAULT_CLIP_STEPS:
        gen += ["--fault-eps", s]
    run(gen)
    trajstore("ingest", str(cap), "--store", str(store), "--run", "synthetic")
    trajstore("ingest", str(FIXTURES / "example_capture_dir"), str(FIXTURES / "example_bundle"),
              "--store", str(store), "--run", "relax")

    say("3/5 replay every bundle from the store, recording the results")
    out = trajstore("replay", "--store", str(store), "--all", "--record", "--workers", "2", "--json",
                    expect=(0, 1), show=False)
    summary = json.loads(out)
    check(summary["refused"] == 0, f"no bundle refused ({summary['total']} replayed)")

    say("4/5 what the store holds and what diverged")
    stats = json.loads(trajstore("stats", "--store", str(store), "--json", show=False))
    trajstore("stats", "--store", str(store))
    check(stats["dedup_ratio"] > 1.0, f"dedup ratio {stats['dedup_ratio']:.2f} > 1 (logical {stats['logical_bytes']} B, physical {stats['physical_bytes']} B)")
    print("first divergent stage histogram:")
    for stage, n in summary["first_divergent_stage_histogram"].items():
        print(f"  {stage:<22} {n}")
    rows = json.loads(trajstore("query", "steps", "--store", str(store), "--run", "synthetic",
                                "--first-divergent-stage", "reward.post_process", "--format", "json", show=False))
    trajstore("query", "steps", "--store", str(store), "--run", "synthetic", "--first-divergent-stage",
              "reward.post_process")
    check({r["rollout_id"] for r in rows} == set(FAULT_ROLLOUTS),
          f"steps rooted in reward.post_process are exactly those of the injected rollouts {FAULT_ROLLOUTS}")
    clip = json.loads(trajstore("query", "steps", "--store", str(store), "--run", "synthetic",
                                "--first-divergent-stage", "loss.policy", "--format", "json", show=False))
    check({f"{r['rollout_id']}:{r['step_id']}" for r in clip} >= set(FAULT_CLIP_STEPS),
          f"the wrong-clip steps {FAULT_CLIP_STEPS} diverge first at loss.policy")

    say("5/5 MoE routing consistency: baseline vs r3")
    plot = work / "router_compare.png"
    trajstore("router", "compare", "--store", str(store), "--run", "baseline", "--run", "r3", "--plot", str(plot))
    cmp = json.loads(trajstore("router", "compare", "--store", str(store), "--run", "baseline", "--run", "r3",
                               "--format", "json", show=False))
    base = [s["runs"]["baseline"]["route_mismatch_rate"] for s in cmp["steps"]]
    r3 = [s["runs"]["r3"]["route_mismatch_rate"] for s in cmp["steps"]]
    check(sum(x or 0 for x in base) > 0, "baseline route mismatch > 0")
    check(all(x == 0 for x in r3), "r3 route mismatch exactly 0 on every step")
    print(f"plot written to {plot}")

    step = rows[0] if rows else {"rollout_id": FAULT_ROLLOUTS[0], "step_id": 0}
    say(f"done: all expectations met in {time.perf_counter() - T0:.0f}s. Next, try:")
    print(f"  trajstore serve --store {store}")
    print(f"  curl -s http://127.0.0.1:8000/v1/runs/synthetic/steps/{step['rollout_id']}:{step['step_id']}")
    print(f"  trajstore replay --store {store} --run synthetic --step {step['rollout_id']}:{step['step_id']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
