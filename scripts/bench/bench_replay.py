"""Replay benchmark: how much does a replay cost over just loading the bundle?

Writes two synthetic, mathematically consistent major-1 step bundles (every
stage recomputes and passes), then measures:

1. a 512-sample step (64 prompts x 8 samples, ~1k response tokens each):
   - load: ``torch.load(weights_only=True)`` of every payload file (the floor
     any replay that reads the bundle from disk pays);
   - replay: ``open_target`` + ``replay_sources`` in process (integrity gate,
     sha256 of every payload, parse, all six stages), reported as a ratio to load;
2. a 256-sample step: wall time of the ``trajstore replay`` console script in a
   subprocess (process start and imports included; target <= 0.7 s);
3. wall time of ``trajstore --help``.

Each timing is the median of ``--repeat`` runs after one warm-up (page cache
warm: this measures CPU cost, not the disk). The subprocess timings also
report the child's CPU time (user + sys), which a busy shared machine
inflates far less than wall time; the load average is printed for context.

    .venv/bin/python scripts/bench/bench_replay.py [--repeat 7] [--keep DIR]
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import harness
import numpy as np

from trajstore.bundle.writer import BundleContents, default_stage_contracts, write_bundle
from trajstore.replay import kernels

CONFIG = {
    "advantage_estimator": "grpo",
    "entropy_coef": 0.01,
    "eps_clip": 0.2,
    "eps_clip_high": 0.28,
    "grpo_std_normalization": True,
    "kl_coef": 0.05,
    "kl_loss_type": "k3",
    "n_samples_per_prompt": 8,
    "rewards_normalization": True,
}


def synth_contents(n_samples: int, mean_tokens: int = 1024, seed: int = 0) -> BundleContents:
    """A consistent step bundle: rewards -> advantages, kl, expected loss via the kernels."""
    n = CONFIG["n_samples_per_prompt"]
    rng = np.random.default_rng(seed)
    lens = rng.integers(mean_tokens * 3 // 4, mean_tokens * 5 // 4 + 1, size=n_samples)
    groups = [i // n for i in range(n_samples)]
    raw = rng.integers(0, 5, size=n_samples).astype(np.float32) / np.float32(4)
    rewards = kernels.grpo_normalize(raw, groups, n)
    tokens = int(lens.sum())
    old = (-rng.uniform(0.05, 3.0, tokens)).astype(np.float32)
    new = (old + rng.normal(0.0, 0.3, tokens)).astype(np.float32)
    ref = (old + rng.normal(0.0, 0.1, tokens)).astype(np.float32)
    entropy = rng.uniform(0.0, 2.0, tokens).astype(np.float32)
    kl = kernels.approx_kl(old, ref, CONFIG["kl_loss_type"])
    adv = kernels.grpo_returns(rewards, lens)
    masks = [[1] * (int(x) - 4) + [0] * 4 for x in lens]
    flat_mask = np.concatenate([np.asarray(m, dtype=np.float32) for m in masks])
    loss = kernels.loss_policy(
        old, new, adv, entropy, flat_mask, lens,
        eps_clip=0.2, eps_clip_high=0.28, entropy_coef=0.01,
    )  # fmt: skip
    samples = [
        {
            "group_index": groups[i],
            "label_hash": None,
            "loss_mask": masks[i],
            "micro_batch_id": f"mb-{i // 16:04d}",
            "raw_reward": float(raw[i]),
            "response_length": int(lens[i]),
            "reward": float(rewards[i]),
            "sample_id": f"s-{i}",
            "total_length": int(lens[i]) + 256,
        }
        for i in range(n_samples)
    ]
    payloads = {
        "old_log_probs": old,
        "log_probs": new,
        "ref_log_probs": ref,
        "entropy": entropy,
        "kl": kl,
        "advantages": adv,
    }
    expected = {
        "loss.policy": loss,
        "reward.post_process": {"rewards": [float(x) for x in rewards]},
        "reward.raw": {"raw_rewards": [float(x) for x in raw]},
    }
    return BundleContents(
        bundle_id=f"b-bench-{n_samples}",
        identity={
            "actor_step_id": {"rollout_id": 1, "step_id": 0},
            "rollout_id": None,
            "rank": {"cp": 1, "dp": 1, "pp": 1, "tp": 1},
            "semantic_group_ids": [f"g-{g}" for g in sorted(set(groups))],
            "normalization_cohort_ids": ["nc-0"],
        },
        samples=samples,
        config=dict(CONFIG),
        payloads=payloads,
        expected=expected,
        stage_contracts=default_stage_contracts(set(payloads), expected, samples),
        producer={"commit": "bench", "dirty_patch_digest": "", "torch_version": "n/a"},
    )


def timed(fn, repeat: int, times: list[float] | None = None) -> tuple[float, object]:  # noqa: ANN001
    """Median wall seconds of ``fn()`` over ``repeat`` runs (kept in `times`) and the result
    of the warm-up run before them."""
    result = fn()
    out = harness.repeat(fn, repeat)
    if times is not None:
        times.extend(out)
    return statistics.median(out), result


def _note(sink: list[float], result: tuple[int, float]) -> tuple[int, float]:
    sink.append(result[1])
    return result


def load_all(bundle: Path) -> int:
    import torch

    n = 0
    for f in sorted((bundle / "payloads").glob("*.pt")):
        n += torch.load(f, weights_only=True).numel()
    return n


def replay_in_process(bundle: Path) -> int:
    from trajstore.bundle.reader import open_target
    from trajstore.replay.runner import replay_sources

    bset = open_target(bundle)
    report = replay_sources(bset.bundles, label=bundle.name)
    return report.exit_code


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--keep", type=Path, help="write the bundles here and keep them")
    ap.add_argument("--small", action="store_true", help="32- and 16-sample steps (smoke)")
    ap.add_argument("--json", type=Path, help="write the figures here (harness.py)")
    args = ap.parse_args()
    load_before = harness.load1()
    n_big, n_small = (32, 16) if args.small else (512, 256)
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-replay-"))
    exe = Path(sys.executable).parent / "trajstore"
    try:
        big = root / f"step-{n_big}"
        small = root / f"step-{n_small}"
        if not big.exists():
            write_bundle(big, synth_contents(n_big, seed=1))
        if not small.exists():
            write_bundle(small, synth_contents(n_small, seed=2))
        tokens = load_all(big)
        size = sum(f.stat().st_size for f in (big / "payloads").glob("*.pt"))

        t_load, _ = timed(lambda: load_all(big), args.repeat)
        t_replay, code = timed(lambda: replay_in_process(big), args.repeat)
        if code != 0:
            print(f"replay of the synthetic bundle did not pass (exit {code})", file=sys.stderr)
            return 1
        t_replay_256, _ = timed(lambda: replay_in_process(small), args.repeat)

        def cli(*argv: str) -> tuple[int, float]:
            """Exit code and the child's CPU seconds (user + sys): robust to a busy machine."""
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            code = subprocess.run([str(exe), *argv], capture_output=True).returncode
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            return code, cpu

        cpu_cli: list[float] = []
        wall_cli: list[float] = []
        t_cli, (code, _) = timed(
            lambda: _note(cpu_cli, cli("replay", str(small))), args.repeat, wall_cli
        )
        if code != 0:
            print(f"trajstore replay exited {code}", file=sys.stderr)
            return 1
        cpu_help: list[float] = []
        t_help, _ = timed(lambda: _note(cpu_help, cli("--help")), args.repeat)

        print(f"machine: {harness.machine_line()}")
        print(
            f"{n_big}-sample step: {tokens // 6} response tokens, 6 payloads, "
            f"{size / 2**20:.1f} MiB"
        )
        print(f"  load (torch.load of every payload)   {t_load * 1e3:8.1f} ms")
        print(f"  replay in process (gate + 6 stages)  {t_replay * 1e3:8.1f} ms")
        print(f"  replay / load ratio                  {t_replay / t_load:8.2f}")
        print(f"{n_small}-sample step, replay in process     {t_replay_256 * 1e3:8.1f} ms")
        print(
            f"`trajstore replay` {n_small} samples (CLI)   {t_cli * 1e3:8.1f} ms wall, "
            f"{statistics.median(cpu_cli) * 1e3:.1f} ms CPU   (target <= 700 ms wall)"
        )
        print(
            f"`trajstore --help`                     {t_help * 1e3:8.1f} ms wall, "
            f"{statistics.median(cpu_help) * 1e3:.1f} ms CPU"
        )
        harness.emit(
            args.json,
            [
                harness.figure(
                    f"`trajstore replay` of a {n_small}-sample step, whole command wall time",
                    "<= 700 ms on a 256-sample step",
                    t_cli * 1e3,
                    "ms",
                    reps=[x * 1e3 for x in wall_cli],
                    workload=n_small,
                    target_workload=256,
                    detail=(
                        f"median of {args.repeat} runs, page cache warm, ~1k response tokens "
                        f"a sample; CPU {statistics.median(cpu_cli) * 1e3:.0f} ms; in process "
                        f"{t_replay_256 * 1e3:.1f} ms; `trajstore --help` {t_help * 1e3:.0f} ms; "
                        f"{n_big}-sample step: torch.load of every payload {t_load * 1e3:.1f} ms, "
                        f"replay in process {t_replay * 1e3:.1f} ms"
                    ),
                )
            ],
            load_before,
        )
        return 0
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
