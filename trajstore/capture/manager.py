"""`CaptureManager`: asynchronous, off-by-default capture from a training loop.

Why it is shaped like this: capture must never slow training noticeably nor
change a single number, and must never raise into training. So the training
thread only *snapshots* (detaches and copies tensors to CPU, so a later
in-place update of a reused buffer cannot change what is written) and
enqueues; a writer builds and publishes the bundles (a process of its own,
`writer_process`, by default: its Python takes no GIL from training; or a daemon
thread, `writer`, with ``TRAJSTORE_CAPTURE_WRITER=thread``). The queue
is bounded: when it is full the record is dropped and counted (or, with
``block=True``, the training thread waits). Writer failures are logged and
counted. `close()` (and interpreter exit) flushes.

Usage (the lines a trainer adds)::

    capture = CaptureManager.from_env(recompute=vars(args), rank=rank, producer_ranks=ranks)
    ...
    capture.rollout(rollout_id, samples, raw_rewards=..., rewards=..., advantages=..., ...)
    with capture.step(rollout_id, step_id) as step:
        for mb in micro_batches:
            ...
            step.add(mb_id, samples=mb.samples, log_probs=lp, old_log_probs=old, entropy=ent,
                     advantages=adv, loss_mask=mask, metrics=mb_metrics)
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import logging
import re
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from trajstore.bundle.assemble import CapturedRecord
from trajstore.bundle.checks import ROUTE_PAYLOADS
from trajstore.capture.config import CaptureConfig, normalize_id
from trajstore.capture.redaction import LOCATOR_FIELDS, TEXT_FIELDS, filter_config
from trajstore.capture.stats import CaptureStats
from trajstore.capture.writer import STAGING, CaptureWriter
from trajstore.jsonio import json_safe
from trajstore.vocab import LOSS_FIELDS as LOSS_METRICS

logger = logging.getLogger("trajstore.capture")

#: sample keys capture reads; anything else a caller passes is never written
SAMPLE_KEYS: frozenset[str] = frozenset(
    {
        "sample_id",
        "group_index",
        "response_length",
        "total_length",
        "loss_mask",
        "reward",
        "raw_reward",
    }
    | set(TEXT_FIELDS)
    | set(LOCATOR_FIELDS)
)
OPTIONAL_TOKEN_PAYLOADS: tuple[str, ...] = (
    "rollout_log_probs",
    "train_log_probs",
    # verl's driver batch and loss inputs (trajstore.integrations.verl)
    "token_level_scores",
    "token_level_rewards",
    "values",
    "rollout_is_weights",
)
#: a micro-batch id as ``trajstore replay --batch`` selects it
MICRO_BATCH_ID = re.compile(r"mb-\d+", re.ASCII)

__all__ = [
    "NULL_STEP",
    "SAMPLE_KEYS",
    "STAGING",
    "CaptureManager",
    "CaptureStats",
    "StepCapture",
]


# --------------------------------------------------------------------------- snapshots


def _cpu_copy(value: Any) -> Any:
    """A CPU tensor no later in-place update of ``value`` can reach.

    ``.cpu()`` on a CPU tensor returns the *same* storage, hence ``copy=True``.
    """
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True).contiguous()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.array(value, copy=True))
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, torch.Tensor) for v in value):
            return torch.cat([v.detach().reshape(-1) for v in value]).to("cpu", copy=True)
        return torch.tensor(list(value))
    if isinstance(value, (int, float, np.integer, np.floating)):
        return float(value)  # np.float32 is no float subclass (np.float64 is)
    raise TypeError(f"cannot capture a {type(value).__name__} (a tensor, array, list or number)")


def _snapshot_sample(sample: Mapping[str, Any], stats: CaptureStats) -> dict[str, Any]:
    """The whitelisted keys of a sample record; tensor-valued ones copied to CPU."""
    out = {}
    for key, value in sample.items():
        if key not in SAMPLE_KEYS:
            stats.dropped_sample_keys.add(str(key))
            continue
        if key in ("loss_mask", "reward") and not isinstance(value, (int, float, type(None))):
            value = _cpu_copy(value)
        out[key] = value
    return out


# --------------------------------------------------------------------------- step accumulator


def _micro_batch_id(given: Any, position: int) -> str:
    """``mb-NNNN``, the form ``replay --batch`` selects: None is the position, an id as
    `normalize_id` reads it (0, "0", a tensor) is its number, an ``mb-N`` string is kept.
    Other text raises: its micro-batch could never be selected for replay."""
    if given is None:
        return f"mb-{position:04d}"
    if isinstance(given, str) and MICRO_BATCH_ID.fullmatch(given):
        return given
    try:
        return f"mb-{normalize_id(given, 'micro-batch id'):04d}"
    except ValueError:
        raise ValueError(
            f"micro-batch id {given!r} is neither a non-negative integer nor 'mb-N' "
            "(the form replay --batch selects)"
        ) from None


class StepCapture:
    """Per-micro-batch appends of one actor step; `end` enqueues the bundle."""

    def __init__(
        self, manager: CaptureManager, rollout_id: int, step_id: int, recompute: Any, extra: dict
    ):
        self._manager = manager
        self._rec = CapturedRecord("step", rollout_id, step_id, [], {}, [], [], recompute, extra)
        self._parts: dict[str, list[Any]] = {}
        self._broken = False
        self._done = False
        #: set by the manager at the first add(): a step with data not yet ended or discarded
        self._open_token: int | None = None

    active = True

    def add(
        self,
        micro_batch_id: str | int | None = None,
        *,
        samples: Sequence[Mapping[str, Any]],
        log_probs: Any,
        old_log_probs: Any,
        advantages: Any,
        entropy: Any = None,
        ref_log_probs: Any = None,
        loss_mask: Any = None,
        rewards: Any = None,
        kl: Any = None,
        returns: Any = None,
        routes: Mapping[str, Any] | None = None,
        metrics: Mapping[str, Any] | None = None,
        **token_payloads: Any,
    ) -> None:
        """Snapshot one micro-batch: flat per-token tensors over its samples' responses.

        ``metrics`` are the trainer's loss metrics of this micro-batch (0-d
        tensors or floats); the bundle expects their sum over micro-batches.
        """
        if self._broken or self._done:
            return
        self._manager._opened(self)
        try:
            mb_id = _micro_batch_id(micro_batch_id, len(self._rec.micro_batches))
            if mb_id in self._rec.micro_batches:
                # one id for two micro-batches merged them into one: refuse the step instead
                raise ValueError(
                    f"micro-batch id {mb_id} given twice in step "
                    f"{self._rec.rollout_id}:{self._rec.step_id}"
                )
            self._rec.micro_batches.append(mb_id)
            base = len(self._rec.samples)
            for i, sample in enumerate(samples):
                snap = _snapshot_sample(sample, self._manager.stats)
                snap["micro_batch_id"] = mb_id
                snap.setdefault("sample_id", f"s-{base + i}")
                self._rec.samples.append(snap)
            named = {
                "log_probs": log_probs,
                "old_log_probs": old_log_probs,
                "advantages": advantages,
                "entropy": entropy,
                "ref_log_probs": ref_log_probs,
                "loss_mask": loss_mask,
                "rewards": rewards,
                "kl": kl,
                "returns": returns,
                **{
                    name: value
                    for name, value in token_payloads.items()
                    if name in OPTIONAL_TOKEN_PAYLOADS
                },
                **{name: value for name, value in (routes or {}).items() if name in ROUTE_PAYLOADS},
            }
            unknown = sorted(set(token_payloads) - set(OPTIONAL_TOKEN_PAYLOADS))
            unknown += sorted(set(routes or {}) - ROUTE_PAYLOADS)
            if unknown:
                raise TypeError(f"unknown payload(s) {', '.join(unknown)}")
            present = {name for name, value in named.items() if value is not None}
            if self._parts and present != set(self._parts):
                raise ValueError(
                    f"micro-batch {mb_id} carries payloads {sorted(present)}, "
                    f"earlier ones {sorted(self._parts)}"
                )
            for name in present:
                self._parts.setdefault(name, []).append(_cpu_copy(named[name]))
            self._rec.metrics.append(
                {
                    name: _cpu_copy(value)
                    for name, value in (metrics or {}).items()
                    if name in LOSS_METRICS
                }
            )
        except Exception:  # noqa: BLE001 - capture never raises into training
            self._broken = True
            self._manager._closed_step(self)  # counted here, not again as abandoned
            self._manager.stats.count_error("snapshotting a micro-batch")

    def router_consistency(self, metrics: Mapping[str, Any]) -> None:
        """Record the producer's own route metrics (router-metrics.md names, and
        optional hang_count/engine_error_count); replay's router.consistency
        stage recomputes and checks them."""
        if self._broken or self._done:
            return
        try:
            self._rec.router_consistency = json.loads(
                json.dumps(json_safe(dict(metrics), finite_only=False))
            )
        except (TypeError, ValueError):
            self._manager.stats.count_error("recording router.consistency metrics")

    def expect(self, stage: str, values: Mapping[str, Any]) -> None:
        """Record expected values of ``stage`` (JSON-able numbers and lists) for this step,
        merged into expected.json: how a loss family's producer states what it computed."""
        if self._broken or self._done:
            return
        try:
            extra = self._rec.expected_extra = self._rec.expected_extra or {}
            extra.setdefault(str(stage), {}).update(
                json.loads(json.dumps(json_safe(dict(values)), allow_nan=False))
            )
        except (TypeError, ValueError):
            self._manager.stats.count_error(f"recording expected {stage}")

    def end(self) -> bool:
        """Enqueue the step (returns immediately). True when it was queued."""
        if self._done:
            return False
        self._done = True
        self._manager._closed_step(self)
        if self._broken or not self._rec.samples:
            return False
        self._rec.payloads = dict(self._parts)
        return self._manager._enqueue(self._rec)

    def discard(self) -> None:
        self._done = True
        self._manager._closed_step(self)

    def __enter__(self) -> StepCapture:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.end()
        else:
            self.discard()


class _NullStep:
    """What `CaptureManager.step` returns for a step that is not captured."""

    active = False

    def add(self, *args: Any, **kwargs: Any) -> None:
        return None

    def end(self) -> bool:
        return False

    def discard(self) -> None:
        return None

    def __enter__(self) -> _NullStep:
        return self

    def __exit__(self, *_: Any) -> None:
        return None


NULL_STEP = _NullStep()


# --------------------------------------------------------------------------- manager

_LIVE: weakref.WeakSet[CaptureManager] = weakref.WeakSet()
_ATEXIT_LOCK = threading.Lock()
_ATEXIT_DONE = False


def _close_all() -> None:
    for manager in list(_LIVE):
        with contextlib.suppress(Exception):
            manager.close()


def _register_atexit() -> None:
    """Flush every live manager at normal interpreter exit, *before* thread pools stop.

    Why not only `atexit`: Python runs `atexit` handlers after ``threading._shutdown``,
    which has already told every ``concurrent.futures`` pool to refuse work; a store ingest
    (its writer pools) run from `close` then failed with "cannot schedule new futures after
    interpreter shutdown" and the bundles queued last stayed staged, unpublished. Hooks given
    to ``threading._register_atexit`` run first, in reverse order of registration, so one
    registered after ``concurrent.futures.thread`` is imported runs before its shutdown
    hook. `atexit` stays as the fallback (close is idempotent).
    """
    global _ATEXIT_DONE
    with _ATEXIT_LOCK:
        if not _ATEXIT_DONE:
            import concurrent.futures.thread  # noqa: F401 - its exit hook must be registered first

            register = getattr(threading, "_register_atexit", None)
            if register is not None:
                with contextlib.suppress(RuntimeError):  # already shutting down
                    register(_close_all)
            atexit.register(_close_all)
            _ATEXIT_DONE = True


class CaptureManager:
    """Capture rollout- and step-level bundles; a no-op unless enabled."""

    def __init__(self, config: CaptureConfig | None = None, *, recompute: Any = None):
        self.config = config or CaptureConfig()
        self.stats = CaptureStats()
        #: default recompute config, filtered now so a bad one fails at start-up
        self._recompute, dropped = filter_config(recompute)
        if dropped and self.config.enabled:
            logger.info(
                "capture: config keys outside the recompute set are not written: %d key(s)",
                len(dropped),
            )
        self._writer: Any = None  # a CaptureWriter or a ProcessWriter
        self._closed = False
        self._lock = threading.Lock()
        #: steps given data but not yet ended/discarded: token -> (rollout_id, step_id)
        self._open_steps: dict[int, tuple[int, int]] = {}
        self._tokens = itertools.count()
        if self.config.enabled:
            writer: Any = CaptureWriter
            if self.config.writer == "process":
                from trajstore.capture.writer_process import ProcessWriter as writer
            self._writer = writer(self.config, self.stats, self._recompute)
            _LIVE.add(self)
            _register_atexit()

    @classmethod
    def from_env(
        cls,
        *,
        recompute: Any = None,
        rank: int | None = None,
        producer_ranks: Sequence[int] | None = None,
        environ: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> CaptureManager:
        """Configure from ``TRAJSTORE_CAPTURE*`` / ``RELAX_REPLAY_CAPTURE*`` (off unless set)."""
        if rank is not None:
            overrides["rank"] = rank
        if producer_ranks is not None:
            overrides["producer_ranks"] = tuple(producer_ranks)
        return cls(CaptureConfig.from_env(environ, **overrides), recompute=recompute)

    @property
    def enabled(self) -> bool:
        return self.config.enabled and not self._closed

    def wants_step(self, rollout_id: Any, step_id: Any) -> bool:
        """Whether the step is captured; an id `normalize_id` refuses is counted, False."""
        try:
            return self.enabled and self.config.wants_step(rollout_id, step_id)
        except ValueError:
            self.stats.count_error(f"reading step id {rollout_id!r}:{step_id!r}")
            return False

    def wants_rollout(self, rollout_id: Any) -> bool:
        """Whether the rollout is captured; an id `normalize_id` refuses is counted, False."""
        try:
            return self.enabled and self.config.wants_rollout(rollout_id)
        except ValueError:
            self.stats.count_error(f"reading rollout id {rollout_id!r}")
            return False

    # ---- hot path -----------------------------------------------------------

    def step(
        self,
        rollout_id: int,
        step_id: int,
        *,
        recompute: Any = None,
        weight_lineage: Mapping[str, Any] | None = None,
        rollout_partition_ids: Sequence[str] | None = None,
        consumer_batch_ids: Sequence[str] | None = None,
    ) -> StepCapture | _NullStep:
        """Open actor step ``(rollout_id, step_id)``; a no-op object unless it is captured.

        Ids may be ints, numpy integers, 0-d tensors or decimal strings (`normalize_id`):
        the step filter and the bundle name read them alike. A refused id is an error
        (counted and logged), never raised.
        """
        if not self.enabled:
            return NULL_STEP
        try:
            rollout_id = normalize_id(rollout_id, "rollout id")
            step_id = normalize_id(step_id, "step id")
        except ValueError:
            self.stats.count_error(f"opening step {rollout_id!r}:{step_id!r}")
            return NULL_STEP
        if not self.wants_step(rollout_id, step_id):
            self.stats.skipped += 1
            return NULL_STEP
        extra = {
            "weight_lineage": dict(weight_lineage) if weight_lineage else None,
            "rollout_partition_ids": list(rollout_partition_ids or []),
            "consumer_batch_ids": list(consumer_batch_ids or []),
        }
        return StepCapture(self, rollout_id, step_id, recompute, extra)

    def _opened(self, step: StepCapture) -> None:
        """Note a step that holds data, so that `close` can tell it was never ended."""
        if step._open_token is None:
            step._open_token = next(self._tokens)
            with self._lock:
                self._open_steps[step._open_token] = (step._rec.rollout_id, step._rec.step_id)

    def _closed_step(self, step: StepCapture) -> None:
        token, step._open_token = step._open_token, None
        if token is not None:
            with self._lock:
                self._open_steps.pop(token, None)

    def rollout(
        self,
        rollout_id: int,
        samples: Sequence[Mapping[str, Any]],
        *,
        raw_rewards: Any = None,
        rewards: Any = None,
        advantages: Any = None,
        old_log_probs: Any = None,
        ref_log_probs: Any = None,
        kl: Any = None,
        returns: Any = None,
        loss_mask: Any = None,
        routes: Mapping[str, Any] | None = None,
        recompute: Any = None,
        weight_lineage: Mapping[str, Any] | None = None,
        rollout_partition_ids: Sequence[str] | None = None,
        expected: Mapping[str, Mapping[str, Any]] | None = None,
        **token_payloads: Any,
    ) -> bool:
        """Enqueue a rollout-level bundle (reward -> advantage). True when queued.

        ``raw_rewards``/``rewards`` are per sample (before/after group
        normalization); the other tensors are flat over response tokens, as are
        ``token_payloads`` (`OPTIONAL_TOKEN_PAYLOADS` only).
        ``expected``: other expected values by stage (JSON-able), merged into expected.json.
        """
        if not self.enabled:
            return False
        try:
            rollout_id = normalize_id(rollout_id, "rollout id")
        except ValueError:
            self.stats.count_error(f"opening rollout {rollout_id!r}")
            return False
        if not self.wants_rollout(rollout_id):
            self.stats.skipped += 1
            return False
        try:
            unknown = sorted(set(token_payloads) - set(OPTIONAL_TOKEN_PAYLOADS))
            if unknown:
                raise TypeError(f"unknown payload(s) {', '.join(unknown)}")
            snaps = []
            for i, sample in enumerate(samples):
                snap = _snapshot_sample(sample, self.stats)
                snap.setdefault("sample_id", f"s-{i}")
                snaps.append(snap)
            named = {
                "raw_rewards": raw_rewards,
                "rewards": rewards,
                "advantages": advantages,
                "old_log_probs": old_log_probs,
                "ref_log_probs": ref_log_probs,
                "kl": kl,
                "returns": returns,
                "loss_mask": loss_mask,
                **token_payloads,
                **{name: value for name, value in (routes or {}).items() if name in ROUTE_PAYLOADS},
            }
            payloads = {
                name: [_cpu_copy(value)] for name, value in named.items() if value is not None
            }
            extra = {
                "weight_lineage": dict(weight_lineage) if weight_lineage else None,
                "rollout_partition_ids": list(rollout_partition_ids or []),
                "consumer_batch_ids": [],
            }
            rec = CapturedRecord(
                "rollout", rollout_id, None, snaps, payloads, [], [], recompute, extra
            )
            if expected:
                rec.expected_extra = {
                    str(stage): json.loads(json.dumps(json_safe(dict(values)), allow_nan=False))
                    for stage, values in expected.items()
                }
        except Exception:  # noqa: BLE001 - capture never raises into training
            self.stats.count_error("snapshotting a rollout")
            return False
        return self._enqueue(rec)

    def _enqueue(self, rec: CapturedRecord) -> bool:
        writer = self._writer
        if writer is None or self._closed:
            return False
        if not writer.put(rec):
            self.stats.dropped += 1
            dropped = self.stats.dropped
            if dropped & (dropped - 1) == 0:  # 1, 2, 4, 8, ...: warn without flooding the log
                logger.warning(
                    "trajstore capture queue full (size %d): dropped %d bundle(s) so far; "
                    "raise TRAJSTORE_CAPTURE_QUEUE_SIZE or set TRAJSTORE_CAPTURE_BLOCK=1",
                    self.config.queue_size,
                    dropped,
                )
            return False
        self.stats.enqueued += 1
        return True

    # ---- shutdown -----------------------------------------------------------

    def close(self, timeout: float | None = None) -> CaptureStats:
        """Flush everything queued and stop the writer. Idempotent."""
        with self._lock:
            if self._closed:
                return self.stats
            self._closed = True
            abandoned = sorted(self._open_steps.values())
            self._open_steps.clear()
        if abandoned:
            self.stats.abandoned += len(abandoned)
            shown = ", ".join(f"{r}:{s}" for r, s in abandoned[:10])
            more = f" and {len(abandoned) - 10} more" if len(abandoned) > 10 else ""
            logger.warning(
                "trajstore capture: step(s) %s%s were given micro-batches but never ended "
                "(use `with capture.step(...)` or call end()); not written",
                shown,
                more,
            )
        if self._writer is not None and not self._writer.stop(timeout):
            logger.warning(
                "trajstore capture writer still busy after %.1fs; abandoning", timeout or 0
            )
        if self.stats.dropped_sample_keys:
            logger.info(
                "trajstore capture: sample keys not written (not whitelisted): %s",
                ", ".join(sorted(self.stats.dropped_sample_keys)),
            )
        return self.stats

    def __enter__(self) -> CaptureManager:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()
