"""Training-thread cost of verl's recording loss, per ``update_actor`` (verl actor capture).

    .venv/bin/python scripts/bench/profile_verl_actor.py [--updates 30] [--cprofile 45]

verl's real worker on the CPU (tests/verl_cpu.py, as `bench_verl_capture.py`), capture on
into a temporary directory with the default writer. Thread CPU inside
``RecordingLoss._record`` (which includes the flushes it triggers) and inside
``RecordingLoss._flush`` (building and handing over the step records), per update, against
the thread CPU of the whole ``update_actor`` call; the first update is a warm-up. With
``--cprofile N`` the recording's profile (cumulative, N lines) is printed too: a profile
of these parts only, its times inflated by the profiler.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import ROOT, start_writer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=30)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--cprofile", type=int, default=0, metavar="N")
    args = parser.parse_args()
    start_writer("process")
    tmp = Path(tempfile.mkdtemp(prefix="profile-verl-"))
    os.environ["TRAJSTORE_CAPTURE"] = "1"
    os.environ["TRAJSTORE_CAPTURE_DIR"] = str(tmp / "capture")
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    import verl_cpu as h

    import trajstore.integrations.verl as tv
    from trajstore.integrations.verl.actor import STEP_KEY, RecordingLoss, capture_actor

    torch.set_num_threads(1)
    cfg = h.trainer_config(h.save_tiny_model(tmp / "model"))
    worker = h.build_worker(cfg)
    worker.set_loss_fn(capture_actor(worker, cfg))
    spent = {"record": 0.0, "flush": 0.0}
    prof = cProfile.Profile() if args.cprofile else None

    def timed(name: str, fn: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            start = time.thread_time()
            if prof is not None and name == "record":
                prof.enable()
            try:
                return fn(*a, **k)
            finally:
                if prof is not None and name == "record":
                    prof.disable()
                spent[name] += time.thread_time() - start

        return call

    RecordingLoss._record = timed("record", RecordingLoss._record)
    RecordingLoss._flush = timed("flush", RecordingLoss._flush)
    update_s = 0.0
    for step in range(args.updates + 1):
        batch = h.prepare(h.make_batch(args.rows, seed=step + 1), worker, cfg)
        tv.tag_batch(batch)
        batch.meta_info[STEP_KEY] = step + 1
        if step == 1:  # the warm-up update is not counted
            spent = dict.fromkeys(spent, 0.0)
            update_s = 0.0
            if prof is not None:
                prof = cProfile.Profile()
        start = time.thread_time()
        h.update_actor(worker, batch, cfg)
        update_s += time.thread_time() - start
    tv.close()
    n = args.updates
    print(
        f"per update_actor (thread CPU): update {update_s / n * 1e3:.1f} ms, "
        f"_record {spent['record'] / n * 1e3:.2f} ms "
        f"({spent['record'] / update_s:.1%}; its flushes {spent['flush'] / n * 1e3:.2f} ms)"
    )
    if prof is not None:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.cprofile)


if __name__ == "__main__":
    main()
