"""Step time of the tiny CPU GRPO loop with capture on vs off, as a ratio.

    .venv/bin/python scripts/bench/bench_capture.py [--reps 6] [--rollouts 3]

Worst case on purpose: every rollout and every step is captured. On and off
blocks run in the same process, interleaved (on/off order alternates per
repetition), each block a fresh loop from the same seed; a block's step time
is the median ``train_step`` + ``rollout`` wall time, which includes the
snapshot copies and the enqueue, and the writer thread's competition for
the CPU and the GIL while it writes the previous bundles in the background.
The flush at ``close()`` is not on the step path, but a trainer pays it once
at the end, so the headline ratio is whole-block wall time (every rollout and
step, plus ``close()`` for capture on) on / off. torch uses its default
number of intra-op threads (the cores a trainer would use) unless
``--threads`` says otherwise. The queue's drop counter is reported; the
target is <= 1.05x with no drops at the default queue size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import capture_figures, emit, load1
from trajstore.examples import tiny_grpo

from trajstore.capture import CaptureConfig, CaptureManager
from trajstore.capture.config import DEFAULT_QUEUE_SIZE


def bench_cfg(args: argparse.Namespace) -> tiny_grpo.TinyConfig:
    return tiny_grpo.TinyConfig(
        vocab=args.vocab,
        hidden=args.hidden,
        max_response=args.max_response,
        prompts_per_rollout=args.prompts,
        n_samples_per_prompt=args.samples,
        steps_per_rollout=2,
        groups_per_micro_batch=args.prompts // 4,
    )


def block(
    args: argparse.Namespace, capture_on: bool, out: Path
) -> tuple[list[float], list[float], dict]:
    """Per-step wall and CPU times.

    info holds the block's wall time (close() included) and capture stats.
    """
    cap = None
    if capture_on:
        cap = CaptureManager(
            CaptureConfig(enabled=True, output_dir=out, run="bench", queue_size=args.queue_size),
            recompute=tiny_grpo.TinyGRPO(0, bench_cfg(args)).recompute_config(),
        )
    loop = tiny_grpo.TinyGRPO(args.seed, bench_cfg(args), capture=cap)
    times, cpu = [], []
    t_block = time.perf_counter()
    for r in range(args.rollouts):
        t0, c0 = time.perf_counter(), time.thread_time()
        ro = loop.rollout(r)
        t_ro, c_ro = time.perf_counter() - t0, time.thread_time() - c0
        n = loop.cfg.steps_per_rollout
        for s in range(n):
            t0, c0 = time.perf_counter(), time.thread_time()
            loop.train_step(ro, s)
            # charge the rollout's capture to its steps, as a trainer would see it
            times.append(time.perf_counter() - t0 + t_ro / n)
            cpu.append(time.thread_time() - c0 + c_ro / n)
    info: dict = {}
    if cap is not None:
        t0 = time.perf_counter()
        stats = cap.close()
        info = {
            "flush_s": time.perf_counter() - t0,
            "written": stats.written,
            "dropped": stats.dropped,
            "errors": stats.errors,
        }
    info["block_s"] = time.perf_counter() - t_block
    return times, cpu, info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--rollouts", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--max-response", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--queue-size", type=int, default=DEFAULT_QUEUE_SIZE)
    ap.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)"
    )
    ap.add_argument("--json", type=Path, help="write the figures here (harness.py)")
    args = ap.parse_args()
    load_before = load1()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    on_med, off_med, ratios, drops, flushes, written = [], [], [], 0, [], 0
    block_ratios: list[float] = []
    best = {True: float("inf"), False: float("inf")}
    cpu_med: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="bench-capture-") as tmp:
        block(args, False, Path(tmp) / "warmup")  # warm-up: allocator, caches
        for rep in range(args.reps):
            order = (True, False) if rep % 2 == 0 else (False, True)
            med, wall = {}, {}
            for on in order:
                times, cpu, info = block(args, on, Path(tmp) / f"rep{rep}")
                med[on] = statistics.median(times)
                wall[on] = info["block_s"]
                best[on] = min(best[on], min(times))
                cpu_med[on].append(statistics.median(cpu))
                if on:
                    drops += info["dropped"]
                    flushes.append(info["flush_s"])
                    written += info["written"]
                    if info["errors"]:
                        print(f"writer errors: {info['errors']}", file=sys.stderr)
            on_med.append(med[True])
            off_med.append(med[False])
            ratios.append(med[True] / med[False])
            block_ratios.append(wall[True] / wall[False])
    steps = args.rollouts * 2
    print(
        f"tiny GRPO loop: hidden={args.hidden} vocab={args.vocab} samples/rollout="
        f"{args.prompts * args.samples} max_response={args.max_response}, {steps} steps/block, "
        f"{args.reps} interleaved reps, torch threads={torch.get_num_threads()}, "
        f"load avg {os.getloadavg()[0]:.1f}"
    )
    print(f"step time off  median {statistics.median(off_med) * 1e3:8.2f} ms")
    print(
        f"step time on   median {statistics.median(on_med) * 1e3:8.2f} ms  (every step and "
        "rollout captured)"
    )
    print(
        "ratio on/off   whole block incl. close() flush, median "
        f"{statistics.median(block_ratios):.3f}x  (per rep: "
        + ", ".join(f"{r:.3f}" for r in block_ratios)
        + ")"
    )
    print(
        f"ratio on/off   step median {statistics.median(ratios):.3f}x  (per rep: "
        + ", ".join(f"{r:.3f}" for r in ratios)
        + ")"
    )
    print(
        f"ratio on/off   fastest step {best[True] / best[False]:.3f}x  "
        f"({best[True] * 1e3:.2f} / {best[False] * 1e3:.2f} ms; least disturbed by other load)"
    )
    print(
        "ratio on/off   training-thread CPU "
        f"{statistics.median(cpu_med[True]) / statistics.median(cpu_med[False]):.3f}x (snapshot + "
        "enqueue cost on the training thread)"
    )
    print(
        f"bundles written {written}, dropped {drops} (queue size {args.queue_size}), "
        f"close() flush median {statistics.median(flushes) * 1e3:.1f} ms"
    )
    res = {
        "hidden": args.hidden,
        "vocab": args.vocab,
        "samples_per_rollout": args.prompts * args.samples,
        "max_response": args.max_response,
        "steps_per_block": steps,
        "reps": args.reps,
        "torch_threads": torch.get_num_threads(),
        "step_off_ms": statistics.median(off_med) * 1e3,
        "step_on_ms": statistics.median(on_med) * 1e3,
        "block_ratio": statistics.median(block_ratios),
        "block_ratios": block_ratios,
        "step_ratio": statistics.median(ratios),
        "step_ratios": ratios,
        "fastest_ratio": best[True] / best[False],
        "cpu_ratio": statistics.median(cpu_med[True]) / statistics.median(cpu_med[False]),
        "written": written,
        "dropped": drops,
        "queue_size": args.queue_size,
        "flush_ms": statistics.median(flushes) * 1e3,
    }
    detail = (
        f"tiny CPU GRPO loop, hidden {args.hidden}, {args.prompts * args.samples} samples x <= "
        f"{args.max_response} tokens, {steps} steps per block, torch threads "
        f"{torch.get_num_threads()}; step off / on {res['step_off_ms']:.1f} / "
        f"{res['step_on_ms']:.1f} ms; training-thread CPU {res['cpu_ratio']:.3f}x; "
        f"{written} bundles written, flush {res['flush_ms']:.1f} ms"
    )
    emit(
        args.json,
        capture_figures(
            "tiny GRPO loop, whole block incl. final flush",
            res["block_ratio"],
            block_ratios,
            drops,
            detail,
        ),
        load_before,
        results=res,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
