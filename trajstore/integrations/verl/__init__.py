"""Capture for verl (``pip install 'trajstore[verl]'``): what a PPO/GRPO step consumed.

Capture is off by default and turned on as for `trajstore.capture.CaptureManager`
(``TRAJSTORE_CAPTURE=1`` with ``TRAJSTORE_CAPTURE_DIR`` or ``TRAJSTORE_CAPTURE_STORE``,
``s3://`` included; the run name from ``TRAJSTORE_RUN``). One process-wide manager is made
at the first capture and flushed at interpreter exit (or by `close`).

- `capture_batch` (driver, after ``update_actor``): the batch as the step's rollout bundle;
- `capture_micro_batches` (actor, from verl's loss): per-micro-batch records
  (`MicroBatchRecord`) as the step's step bundles.

The records' layout is `trajstore.integrations.verl.records` (shared by both sides). Importing
this package imports neither verl nor Ray; the parts that drive verl itself raise an
ImportError naming the extra when verl is missing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from trajstore.integrations.adapter import StepRecord, write_steps
from trajstore.integrations.verl.records import (
    CONTRACT_VERSION,
    GROUP_KEY,
    KEY,
    ROW_KEY,
    VERL,
    MicroBatchRecord,
    RolloutRecord,
    algorithm_config,
    rollout_record,
    step_records,
)

logger = logging.getLogger("trajstore.capture")

#: the install hint of every ImportError this integration raises
INSTALL_HINT = VERL.install_hint

__all__ = [
    "CONTRACT_VERSION",
    "GROUP_KEY",
    "INSTALL_HINT",
    "KEY",
    "ROW_KEY",
    "MicroBatchRecord",
    "RolloutRecord",
    "StepRecord",
    "algorithm_config",
    "capture_batch",
    "capture_manager",
    "capture_micro_batches",
    "close",
    "require_verl",
    "rollout_record",
    "step_records",
    "tag_batch",
    "write_rollout",
    "write_steps",
]

_LOCK = threading.Lock()
_MANAGER: Any = None


def require_verl() -> Any:
    """The ``verl`` module, or an ImportError that says how to install it."""
    return VERL.require()


def capture_manager(**overrides: Any) -> Any:
    """This process's `CaptureManager` (made from the environment at the first call;
    ``overrides`` such as ``rank=`` apply to that first call only)."""
    global _MANAGER
    with _LOCK:
        if _MANAGER is None:
            from trajstore.capture import CaptureManager

            _MANAGER = CaptureManager.from_env(**overrides)
            if _MANAGER.enabled:
                VERL.warn_untested()
        return _MANAGER


def close() -> Any:
    """Flush and stop this process's manager (also done at interpreter exit); its stats."""
    global _MANAGER
    with _LOCK:
        manager, _MANAGER = _MANAGER, None
    return None if manager is None else manager.close()


def tag_batch(batch: Any) -> Any:
    """Add `ROW_KEY` (each row's index) and `GROUP_KEY` (its ``uid`` group) to a
    ``DataProto`` before ``update_actor``, so the actor's micro-batches know their rows."""
    import torch

    from trajstore.integrations.adapter import groups_of_uids
    from trajstore.integrations.verl.records import BatchView

    view = BatchView.of(batch)
    rows = int(view.tensors["responses"].shape[0])
    device = view.tensors["responses"].device
    groups = groups_of_uids(view.non_tensor.get("uid"), rows)
    target = batch.batch if hasattr(batch, "batch") else batch
    target[ROW_KEY] = torch.arange(rows, device=device)
    target[GROUP_KEY] = torch.tensor(groups, device=device)
    return batch


def write_rollout(manager: Any, record: RolloutRecord) -> bool:
    """Enqueue a rollout record on ``manager``; True when queued."""
    return manager.rollout(
        record.step,
        record.samples,
        routes=record.routes or None,
        recompute=record.recompute,
        expected=record.expected or None,
        **record.payloads,
    )


def capture_batch(batch: Any, config: Any, *, step: int, **options: Any) -> bool:
    """Capture verl's driver batch after ``update_actor`` as step ``step``'s rollout bundle.

    ``config``: the trainer's whole config; ``step``: ``trainer.global_steps``; ``options``
    as `rollout_record`'s: ``metrics=`` (the step's, as verl logged them) or ``kl_coef=``
    (the KL-in-reward coefficient applied this step, needed under an adaptive controller).
    Off (False) unless capture is on; never raises into training (an error is counted and
    logged).
    """
    manager = capture_manager()
    if not manager.enabled or not manager.wants_rollout(step):
        return False
    try:
        record = rollout_record(batch, config, step=step, **options)
    except Exception:  # noqa: BLE001 - capture never raises into training
        manager.stats.count_error("capturing a verl driver batch")
        return False
    return write_rollout(manager, record)


def capture_micro_batches(
    records: Sequence[MicroBatchRecord],
    config: Any,
    *,
    step: int,
    kl_coef: float | None = None,
) -> int:
    """Capture one ``update_actor`` call's micro-batch records as step bundles (one per
    optimizer step, `step_records`); how many were queued. Off (0) unless capture is on;
    never raises into training."""
    manager = capture_manager()
    if not manager.enabled:
        return 0
    try:
        steps = step_records(records, config, step=step, kl_coef=kl_coef)
    except Exception:  # noqa: BLE001 - capture never raises into training
        manager.stats.count_error("capturing verl micro-batches")
        return 0
    return write_steps(manager, steps)
