"""Capture overhead on verl's actor update, and bytes stored per step vs verl's own dump.

    .venv/bin/python scripts/bench/bench_verl_capture.py [--reps 6] [--rows 16] [--updates 4]

verl 0.9.1's real ``ActorRolloutRefWorker`` on the CPU (tests/verl_cpu.py: a tiny Qwen2
built from a config, fsdp2, nothing downloaded). One worker; blocks alternate between verl's
own loss (capture off: the baseline, in the same run) and the recording loss of
``capture_actor`` (on, every micro-batch captured into a temporary directory: the worst
case). A block is ``--updates`` ``update_actor`` calls, each on a fresh driver batch (two
optimizer steps); both blocks of a pair get the same batches (a batch's random prompt and
response lengths set its update's cost: until 2026-12-04 every block drew its own, and
the pairs' ratios spread 0.8-1.5). A block's time is the wall time of its calls a call
(which includes the recording's copies and enqueue; the writer's work for one call
overlaps the next call, or after a block's last, the next block, on or off: longer blocks
measure more of it where it belongs, and have less noise), its CPU time the training
process's (``--writer process``, the default: the writer process's CPU is reported
apart). The driver's ``capture_batch`` is timed apart. Bytes: the step's bundles on disk
(its rollout bundle and its step bundles) against verl's own ``DataProto.save_to_disk``
of the same batch. Reports through harness.emit.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import ROOT, capture_figures, emit, load1, start_writer, writer_process_cpu_s


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    """verl prints progress to stdout: it goes to stderr while it runs."""
    load_before = load1()
    with contextlib.redirect_stdout(sys.stderr):
        result, args = measure()
    emit(
        args.json,
        capture_figures(
            "verl update_actor" + (", thread writer" if args.writer == "thread" else ""),
            result["ratio"],
            result["per_rep_ratio"],
            result["dropped"],
            f"verl ActorRolloutRefWorker on the CPU (tiny Qwen2, fsdp2), {args.rows} rows a "
            f"batch, {args.reps} on/off pairs of {args.updates} call(s) a block: "
            f"update_actor {result['update_actor_s_off']:.2f} s "
            f"off / {result['update_actor_s_on']:.2f} s on; CPU {result['cpu_ratio']:.3f}x"
            + (
                f" (the writer process's CPU while update_actor ran: "
                f"{result['writer_process_cpu_ms_per_update']:.0f} ms a call)"
                if args.writer == "process"
                else ""
            )
            + "; "
            f"bytes per step {result['bytes_ratio']:.3f}x verl's save_to_disk",
        ),
        load_before,
        results=result,
    )


def measure() -> tuple[dict[str, Any], argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=6, help="on/off block pairs")
    parser.add_argument("--rows", type=int, default=16, help="samples per driver batch")
    parser.add_argument(
        "--updates", type=int, default=4,
        help="update_actor calls a block (each on a fresh batch, the same in both blocks of a "
        "pair; 1 before 2026-12-04 08:30): the writer's work for one call lands in the next "
        "call of its own block, as in a run with capture on throughout; with one call a "
        "block, each call's last bundles were written during the next block, on or off",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--writer", choices=("thread", "process"), default="process",
        help="TRAJSTORE_CAPTURE_WRITER: the capture writer measured (default: the default)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the figures here (harness.py)")
    args = parser.parse_args()
    writer_start_s = start_writer(args.writer)
    tmp = Path(tempfile.mkdtemp(prefix="bench-verl-"))
    os.environ["TRAJSTORE_CAPTURE"] = "1"
    os.environ["TRAJSTORE_CAPTURE_DIR"] = str(tmp / "capture")
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    import verl_cpu as h

    import trajstore.integrations.verl as tv
    from trajstore.integrations.verl.actor import STEP_KEY, capture_actor

    torch.set_num_threads(args.threads)
    cfg = h.trainer_config(h.save_tiny_model(tmp / "model"))
    worker = h.build_worker(cfg)
    own = worker.actor.loss_fn
    recording = capture_actor(worker, cfg)
    times: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    writer_cpu: dict[str, list[float]] = {"off": [], "on": []}  # the writer process's
    driver_s: list[float] = []
    dumped: list[int] = []
    step = 0
    for rep in range(args.reps + 1):  # the first pair warms up and is not counted
        for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
            worker.set_loss_fn(recording if mode == "on" else own)
            batches = []
            for u in range(args.updates):
                step += 1  # a capture step id: unique, so on blocks never share a bundle name
                # the same batches for both blocks of a pair: a batch's prompt and response
                # lengths are random, and the update's cost follows its tokens
                seed = rep * args.updates + u + 1
                batch = h.prepare(h.make_batch(args.rows, seed=seed), worker, cfg)
                if mode == "on":
                    tv.tag_batch(batch)
                    batch.meta_info[STEP_KEY] = step
                batches.append((step, batch))
            wall = used = writer_used = 0.0
            for step_id, batch in batches:
                start, cpu_start = time.perf_counter(), time.process_time()
                writer_start = writer_process_cpu_s()
                h.update_actor(worker, batch, cfg)
                wall += time.perf_counter() - start
                used += time.process_time() - cpu_start
                writer_used += writer_process_cpu_s() - writer_start
                if mode == "on":
                    start = time.perf_counter()
                    tv.capture_batch(batch, cfg, step=step_id)
                    driver_s.append(time.perf_counter() - start)
            if rep:  # per update_actor call
                times[mode].append(wall / args.updates)
                cpu[mode].append(used / args.updates)
                writer_cpu[mode].append(writer_used / args.updates)
            if mode == "on":
                for step_id, batch in batches:
                    dump = tmp / f"dataproto-{step_id}.pkl"
                    batch.save_to_disk(str(dump))
                    dumped.append(_size(dump))
    stats = tv.close()
    per_step: dict[int, int] = {}
    for path in (tmp / "capture").iterdir():
        parts = path.name.split("-")  # replay-<step>-<k> or replay-rollout-<step>
        key = int(parts[2]) if parts[1] == "rollout" else int(parts[1])
        per_step[key] = per_step.get(key, 0) + _size(path)
    stored = list(per_step.values())
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    result: dict[str, Any] = {
        "settings": {k: str(v) for k, v in vars(args).items()},
        "update_actor_s_off": off,
        "update_actor_s_on": on,
        "ratio": on / off,
        "per_rep_ratio": [a / b for a, b in zip(times["on"], times["off"], strict=True)],
        "cpu_ratio": statistics.median(cpu["on"]) / statistics.median(cpu["off"]),
        "writer_process_start_s": writer_start_s,
        "writer_process_cpu_ms_per_update": statistics.median(writer_cpu["on"]) * 1000,
        "capture_batch_s": statistics.median(driver_s),
        "bytes_per_step": statistics.median(stored),
        "dataproto_save_to_disk_bytes": statistics.median(dumped),
        "bytes_ratio": statistics.median(stored) / statistics.median(dumped),
        "written": stats.written,
        "dropped": stats.dropped,
        "errors": stats.errors,
    }
    return result, args


if __name__ == "__main__":
    main()
