"""Training-thread cost of one ``update_actor``'s step records (verl actor capture).

    PYTHONPATH=. .venv/bin/python scripts/bench/profile_verl_records.py [CHECKOUT]

Two flushes of four micro-batches (2 rows, horizon 64) against verl's OmegaConf trainer
config (tests/verl_cpu.py of CHECKOUT, default "."). A checkout with ``step_settings``
reads the config once per update and passes it to ``step_records``; an older one's
``step_records`` reads it per flush. Prints the median and p10/p90 of 300 updates.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def main() -> None:
    sys.path.insert(0, str(Path(sys.argv[1] if len(sys.argv) > 1 else ".") / "tests"))
    import torch
    import verl_cpu as h

    from trajstore.integrations.verl import records

    torch.set_num_threads(1)
    cfg = h.trainer_config(h.save_tiny_model(Path(tempfile.mkdtemp()) / "m"))
    g = torch.Generator().manual_seed(0)

    def field() -> torch.Tensor:
        return torch.randn(2, 64, generator=g)

    def record(k: int, opt: int) -> Any:
        lengths = torch.randint(1, 65, (2,), generator=g).tolist()
        mask = (torch.arange(64)[None] < torch.tensor(lengths)[:, None]).long()
        return records.MicroBatchRecord(
            rows=[2 * k, 2 * k + 1],
            log_probs=field(),
            old_log_probs=field(),
            advantages=field(),
            response_mask=mask,
            loss=0.1,
            entropy=field(),
            groups=[k, k],
            response_lengths=lengths,
            optimizer_step=opt,
        )

    flushes = [[record(4 * o + m, o) for m in range(4)] for o in range(2)]
    new = hasattr(records, "step_settings")

    def update() -> None:
        settings = records.step_settings(cfg) if new else None
        for members in flushes:
            if new:
                records.step_records(members, cfg, step=1, settings=settings)
            else:
                records.step_records(members, cfg, step=1)

    for _ in range(20):
        update()
    times = []
    for _ in range(300):
        start = time.perf_counter()
        update()
        times.append(time.perf_counter() - start)
    times.sort()
    median, p10, p90 = statistics.median(times), times[30], times[270]
    side = "step_settings" if new else "per-flush config"
    print(
        f"{side}: ms per update_actor median {1e3 * median:.3f} p10 {1e3 * p10:.3f} "
        f"p90 {1e3 * p90:.3f}"
    )


if __name__ == "__main__":
    main()
