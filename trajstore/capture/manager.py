"""`CaptureManager`: asynchronous, off-by-default capture from a training loop.

Why it is shaped like this: capture must never slow training noticeably nor
change a single number, and must never raise into training. So the training
thread only *snapshots* (detaches and copies tensors to CPU, so a later
in-place update of a reused buffer cannot change what is written) and
enqueues; a daemon writer thread builds and publishes the bundles. The queue
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
import hashlib
import json
import logging
import math
import os
import queue
import shutil
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trajstore.bundle.capture_dir import rollout_dir_name, step_dir_name
from trajstore.bundle.checks import PER_TOKEN_PAYLOADS, ROUTE_PAYLOADS
from trajstore.bundle.writer import (
    BundleContents,
    default_stage_contracts,
    write_bundle,
    write_rank,
)
from trajstore.capture.config import CaptureConfig
from trajstore.capture.redaction import (
    LOCATOR_FIELDS,
    TEXT_FIELDS,
    filter_config,
    redact_identifier,
)
from trajstore.vocab import LOSS_FIELDS as LOSS_METRICS
from trajstore.vocab import required_loss_fields

logger = logging.getLogger("trajstore.capture")

#: sample keys capture reads; anything else a caller passes is never written
SAMPLE_KEYS: frozenset[str] = frozenset(
    {"sample_id", "group_index", "response_length", "total_length", "loss_mask", "reward", "raw_reward"}
    | set(TEXT_FIELDS)
    | set(LOCATOR_FIELDS)
)
OPTIONAL_TOKEN_PAYLOADS: tuple[str, ...] = ("rollout_log_probs", "train_log_probs")
STAGING = ".capture-staging"
_STOP = object()


@dataclass
class CaptureStats:
    """Counters a trainer can log; ``dropped`` > 0 means the queue was too small."""

    enqueued: int = 0
    dropped: int = 0
    skipped: int = 0
    written: int = 0
    errors: int = 0
    ingested: int = 0
    dropped_sample_keys: set[str] = field(default_factory=set)


@dataclass
class _Record:
    kind: str  # "step" | "rollout"
    rollout_id: int
    step_id: int | None
    samples: list[dict[str, Any]]
    payloads: dict[str, Any]
    micro_batches: list[str]
    metrics: list[dict[str, Any]]
    recompute: Any
    identity_extra: dict[str, Any]
    #: the producer's own route-consistency record (expected.json router.consistency)
    router_consistency: dict[str, Any] | None = None


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
    if isinstance(value, (int, float)):
        return float(value)
    raise TypeError(f"cannot capture a {type(value).__name__} (a tensor, array, list or number)")


def _snapshot_sample(s: Mapping[str, Any], stats: CaptureStats) -> dict[str, Any]:
    out = {}
    for k, v in s.items():
        if k not in SAMPLE_KEYS:
            stats.dropped_sample_keys.add(str(k))
            continue
        if k in ("loss_mask", "reward") and not isinstance(v, (int, float, type(None))):
            v = _cpu_copy(v)
        out[k] = v
    return out


def _to_list(x: Any) -> list:
    return x.tolist() if hasattr(x, "tolist") else list(x)


# --------------------------------------------------------------------------- step accumulator


class StepCapture:
    """Per-micro-batch appends of one actor step; `end` enqueues the bundle."""

    def __init__(self, manager: CaptureManager, rollout_id: int, step_id: int, recompute: Any, extra: dict):
        self._m = manager
        self._rec = _Record("step", rollout_id, step_id, [], {}, [], [], recompute, extra)
        self._parts: dict[str, list[Any]] = {}
        self._broken = False
        self._done = False

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
        try:
            mb = (
                f"mb-{len(self._rec.micro_batches):04d}"
                if micro_batch_id is None
                else micro_batch_id
                if isinstance(micro_batch_id, str)
                else f"mb-{int(micro_batch_id):04d}"
            )
            self._rec.micro_batches.append(mb)
            base = len(self._rec.samples)
            for i, s in enumerate(samples):
                snap = _snapshot_sample(s, self._m.stats)
                snap["micro_batch_id"] = mb
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
                **{k: v for k, v in token_payloads.items() if k in OPTIONAL_TOKEN_PAYLOADS},
                **{k: v for k, v in (routes or {}).items() if k in ROUTE_PAYLOADS},
            }
            unknown = sorted(set(token_payloads) - set(OPTIONAL_TOKEN_PAYLOADS))
            unknown += sorted(set(routes or {}) - ROUTE_PAYLOADS)
            if unknown:
                raise TypeError(f"unknown payload(s) {', '.join(unknown)}")
            present = {k for k, v in named.items() if v is not None}
            if self._parts and present != set(self._parts):
                raise ValueError(
                    f"micro-batch {mb} carries payloads {sorted(present)}, earlier ones {sorted(self._parts)}"
                )
            for k in present:
                self._parts.setdefault(k, []).append(_cpu_copy(named[k]))
            self._rec.metrics.append(
                {k: _cpu_copy(v) for k, v in (metrics or {}).items() if k in LOSS_METRICS}
            )
        except Exception:  # noqa: BLE001 - capture never raises into training
            self._broken = True
            self._m._count_error("snapshotting a micro-batch")

    def router_consistency(self, metrics: Mapping[str, Any]) -> None:
        """Record the producer's own route metrics (router-metrics.md names, and
        optional hang_count/engine_error_count); replay's router.consistency
        stage recomputes and checks them."""
        if self._broken or self._done:
            return
        try:
            self._rec.router_consistency = json.loads(json.dumps(dict(metrics), default=_json_number))
        except (TypeError, ValueError):
            self._m._count_error("recording router.consistency metrics")

    def end(self) -> bool:
        """Enqueue the step (returns immediately). True when it was queued."""
        if self._done:
            return False
        self._done = True
        if self._broken or not self._rec.samples:
            return False
        self._rec.payloads = dict(self._parts)
        return self._m._enqueue(self._rec)

    def discard(self) -> None:
        self._done = True

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
    for m in list(_LIVE):
        with contextlib.suppress(Exception):
            m.close()


def _register_atexit() -> None:
    global _ATEXIT_DONE
    with _ATEXIT_LOCK:
        if not _ATEXIT_DONE:
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
            logger.info("capture: config keys outside the recompute set are not written: %d key(s)", len(dropped))
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()
        if self.config.enabled:
            self._queue = queue.Queue(maxsize=self.config.queue_size)
            self._thread = threading.Thread(target=self._run, name="trajstore-capture-writer", daemon=True)
            self._thread.start()
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

    def wants_step(self, rollout_id: int, step_id: int) -> bool:
        return self.enabled and self.config.wants_step(rollout_id, step_id)

    def wants_rollout(self, rollout_id: int) -> bool:
        return self.enabled and self.config.wants_rollout(rollout_id)

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
        """Open actor step ``(rollout_id, step_id)``; a no-op object unless it is captured."""
        if not self.wants_step(rollout_id, step_id):
            if self.enabled:
                self.stats.skipped += 1
            return NULL_STEP
        extra = {
            "weight_lineage": dict(weight_lineage) if weight_lineage else None,
            "rollout_partition_ids": list(rollout_partition_ids or []),
            "consumer_batch_ids": list(consumer_batch_ids or []),
        }
        return StepCapture(self, int(rollout_id), int(step_id), recompute, extra)

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
    ) -> bool:
        """Enqueue a rollout-level bundle (reward -> advantage). True when queued.

        ``raw_rewards``/``rewards`` are per sample (before/after group
        normalization); the other tensors are flat over response tokens.
        """
        if not self.wants_rollout(rollout_id):
            if self.enabled:
                self.stats.skipped += 1
            return False
        try:
            snaps = []
            for i, s in enumerate(samples):
                snap = _snapshot_sample(s, self.stats)
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
                **{k: v for k, v in (routes or {}).items() if k in ROUTE_PAYLOADS},
            }
            payloads = {k: [_cpu_copy(v)] for k, v in named.items() if v is not None}
            extra = {
                "weight_lineage": dict(weight_lineage) if weight_lineage else None,
                "rollout_partition_ids": list(rollout_partition_ids or []),
                "consumer_batch_ids": [],
            }
            rec = _Record("rollout", int(rollout_id), None, snaps, payloads, [], [], recompute, extra)
        except Exception:  # noqa: BLE001 - capture never raises into training
            self._count_error("snapshotting a rollout")
            return False
        return self._enqueue(rec)

    def _enqueue(self, rec: _Record) -> bool:
        q = self._queue
        if q is None or self._closed:
            return False
        try:
            if self.config.block:
                q.put(rec)
            else:
                q.put_nowait(rec)
        except queue.Full:
            self.stats.dropped += 1
            n = self.stats.dropped
            if n & (n - 1) == 0:  # 1, 2, 4, 8, ...: warn without flooding the log
                logger.warning(
                    "trajstore capture queue full (size %d): dropped %d bundle(s) so far; "
                    "raise TRAJSTORE_CAPTURE_QUEUE_SIZE or set TRAJSTORE_CAPTURE_BLOCK=1",
                    self.config.queue_size,
                    n,
                )
            return False
        self.stats.enqueued += 1
        return True

    def _count_error(self, what: str) -> None:
        self.stats.errors += 1
        logger.exception("trajstore capture: error while %s (training continues)", what)

    # ---- shutdown -----------------------------------------------------------

    def close(self, timeout: float | None = None) -> CaptureStats:
        """Flush everything queued and stop the writer. Idempotent."""
        with self._lock:
            if self._closed:
                return self.stats
            self._closed = True
        if self._queue is not None and self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("trajstore capture writer still busy after %.1fs; abandoning", timeout or 0)
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

    # ---- writer thread ------------------------------------------------------

    def _run(self) -> None:
        with contextlib.suppress(Exception):  # a lower priority: training first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        assert self._queue is not None
        while True:
            rec = self._queue.get()
            if rec is _STOP:
                return
            try:
                self._write(rec)
                self.stats.written += 1
            except Exception:  # noqa: BLE001 - logged and counted, never raised
                what = (
                    f"writing step {rec.rollout_id}:{rec.step_id}"
                    if rec.kind == "step"
                    else f"writing rollout {rec.rollout_id}"
                )
                self._count_error(what)

    def _base_dir(self) -> Path:
        cfg = self.config
        if cfg.store_dir is not None:
            return cfg.store_dir / STAGING / cfg.run
        assert cfg.output_dir is not None
        return cfg.output_dir

    def _producers(self, kind: str) -> tuple[int, ...] | None:
        cfg = self.config
        if kind == "rollout" and cfg.rollout_ranks is not None:
            return cfg.rollout_ranks
        return cfg.producer_ranks

    def _write(self, rec: _Record) -> None:
        contents = build_contents(rec, self.config, self._recompute)
        name = rollout_dir_name(rec.rollout_id) if rec.kind == "rollout" else step_dir_name(rec.rollout_id, rec.step_id)
        if self.config.store_dir is not None:
            self._open_store().close()  # the store must exist before staging lives inside it
        dest = self._base_dir() / name
        ranks = self._producers(rec.kind)
        if ranks is not None and len(ranks) > 1:
            write_rank(dest, contents, rank=int(self.config.rank), expected_ranks=list(ranks))
            complete = (dest / "COMPLETE").exists()
        else:
            write_bundle(dest, contents)
            complete = True
        if complete and self.config.store_dir is not None:
            self._ingest(dest)

    def _open_store(self) -> Any:
        from trajstore.store.api import Store  # lazy: the store is optional for capture

        return Store.open(self.config.store_dir)

    def _ingest(self, path: Path) -> None:
        """Ingest a completed staged bundle/cohort once (whichever rank claims it).

        On success the staged copy is removed; on refusal it stays for a later
        ``trajstore ingest`` and the failure is counted.
        """
        claims = path.parent / ".claims"
        claims.mkdir(parents=True, exist_ok=True)
        # Keyed by the COMPLETE bytes: a re-capture of the same step (resume) is a new claim.
        key = hashlib.sha256((path / "COMPLETE").read_bytes()).hexdigest()[:16]
        try:
            fd = os.open(claims / f"{path.name}.{key}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return
        os.close(fd)
        with self._open_store() as store:
            outcomes = store.ingest([path], run=self.config.run)
        refused = [o for o in outcomes if getattr(o, "status", "published") == "refused"]
        if refused or not outcomes:
            why = refused[0].reason if refused else "nothing ingested"
            raise RuntimeError(f"store refused {path.name}: {why}; staged copy kept at {path}")
        self.stats.ingested += 1
        shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- bundle assembly


def _merge_payloads(parts: dict[str, list[Any]]) -> dict[str, Any]:
    import torch

    out = {}
    for k, vs in parts.items():
        if not vs:
            continue
        out[k] = vs[0] if len(vs) == 1 else torch.cat([v if v.dim() else v.reshape(1) for v in vs])
    return out


def _split(flat: Any, lengths: list[int], what: str) -> list[list]:
    values = _to_list(flat)
    if len(values) != sum(lengths):
        raise ValueError(f"{what} has {len(values)} entries for {sum(lengths)} response tokens")
    out, pos = [], 0
    for n in lengths:
        out.append(values[pos : pos + n])
        pos += n
    return out


def _sample_records(
    rec: _Record, payloads: dict[str, Any], cfg: CaptureConfig
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Index sample records (redacted) and the expected reward lists."""
    samples = rec.samples
    lengths = []
    for s in samples:
        if "response_length" in s:
            lengths.append(int(s["response_length"]))
        elif "loss_mask" in s:
            lengths.append(len(_to_list(s["loss_mask"])))
        else:
            raise ValueError(f"sample {s.get('sample_id')!r} has neither response_length nor loss_mask")
    flat_mask = payloads.pop("loss_mask", None)
    masks = _split(flat_mask, lengths, "loss_mask") if flat_mask is not None else None
    per_sample = {}
    for key in ("raw_rewards", "rewards"):
        v = payloads.pop(key, None)
        if v is not None:
            vals = [float(x) for x in _to_list(v)]
            if len(vals) != len(samples):
                raise ValueError(f"{key} has {len(vals)} values for {len(samples)} samples")
            per_sample[key] = vals
    records = []
    for i, s in enumerate(samples):
        r: dict[str, Any] = {
            "sample_id": str(s["sample_id"]),
            "group_index": None if s.get("group_index") is None else int(s["group_index"]),
            "response_length": lengths[i],
            "total_length": int(s.get("total_length", lengths[i])),
        }
        mask = masks[i] if masks is not None else s.get("loss_mask")
        r["loss_mask"] = [int(x) for x in _to_list(mask)] if mask is not None else [1] * lengths[i]
        if "micro_batch_id" in s:
            r["micro_batch_id"] = s["micro_batch_id"]
        if "rewards" in per_sample:
            r["reward"] = per_sample["rewards"][i]
        elif s.get("reward") is not None:
            rw = s["reward"]
            r["reward"] = [float(x) for x in _to_list(rw)] if hasattr(rw, "tolist") and rw.dim() else float(rw)
        if "raw_rewards" in per_sample:
            r["raw_reward"] = per_sample["raw_rewards"][i]
        elif s.get("raw_reward") is not None:
            r["raw_reward"] = float(s["raw_reward"])
        for f in (*TEXT_FIELDS, *LOCATOR_FIELDS):
            r.update(cfg.redaction.apply(f, s.get(f)))
        records.append(r)
    expected: dict[str, Any] = {}
    if rec.kind == "rollout":
        if "raw_rewards" in per_sample:
            expected["reward.raw"] = {"raw_rewards": per_sample["raw_rewards"]}
        if "rewards" in per_sample:
            expected["reward.post_process"] = {"rewards": per_sample["rewards"]}
    return records, expected


def _loss_expected(rec: _Record, config: dict[str, Any]) -> dict[str, float] | None:
    """The trainer's loss metrics summed over micro-batches, or None if incomplete."""
    if not rec.metrics or not any(rec.metrics):
        return None
    required = required_loss_fields(bool(config.get("use_kl_loss")))
    sums = {}
    for m in required:
        if not all(m in mb for mb in rec.metrics):
            logger.warning("step %s:%s: metric %r missing in some micro-batch; loss.policy not declared",
                           rec.rollout_id, rec.step_id, m)
            return None
        sums[m] = math.fsum(float(mb[m]) for mb in rec.metrics)
    return sums


def _prune_contracts(contracts: dict, records: list[dict], payloads: dict, config: dict) -> dict:
    """Declare only stages whose inputs the bundle actually carries."""
    have = set(payloads)
    drop = set()
    if not all("reward" in r for r in records):
        drop.add("advantage.estimate")
    if float(config.get("kl_coef", 0.0) or 0.0) != 0.0 and not {"old_log_probs", "ref_log_probs"} <= have:
        drop.add("advantage.kl")
    if not isinstance(config.get("n_samples_per_prompt"), int) or any(r["group_index"] is None for r in records):
        drop.add("reward.post_process")
    if "entropy" not in have and "loss.policy" in contracts:
        drop.add("loss.policy")
    if config.get("use_kl_loss") and "ref_log_probs" not in have:
        drop.add("loss.policy")
    return {k: v for k, v in contracts.items() if k not in drop}


def build_contents(rec: _Record, cfg: CaptureConfig, default_recompute: dict[str, Any]) -> BundleContents:
    """Assemble (and redact) one bundle from a snapshot record."""
    import torch

    if rec.recompute is not None:
        config, _ = filter_config(rec.recompute)
    else:
        config = dict(default_recompute)
    payloads = _merge_payloads(rec.payloads)
    records, expected = _sample_records(rec, payloads, cfg)
    for name, t in payloads.items():
        if name in PER_TOKEN_PAYLOADS and t.dim() != 1:
            payloads[name] = t.reshape(-1)
    if rec.kind == "step":
        loss = _loss_expected(rec, config)
        if loss is not None:
            expected["loss.policy"] = loss
    if rec.router_consistency is not None:
        expected["router.consistency"] = rec.router_consistency
    groups = sorted({r["group_index"] for r in records if r["group_index"] is not None})
    group_ids = [f"g-{g}" for g in groups]
    lineage = rec.identity_extra.get("weight_lineage")
    parallel = dict(cfg.parallel or {})
    n_producers = len(cfg.producer_ranks) if cfg.producer_ranks else 1
    rank = {"dp": parallel.get("dp", n_producers), "tp": parallel.get("tp", 1),
            "pp": parallel.get("pp", 1), "cp": parallel.get("cp", 1)}
    identity: dict[str, Any] = {
        "run": cfg.run,
        "actor_step_id": {"rollout_id": rec.rollout_id, "step_id": rec.step_id} if rec.kind == "step" else None,
        "rollout_id": rec.rollout_id if rec.kind == "rollout" else None,
        "rollout_partition_ids": [str(x) for x in rec.identity_extra.get("rollout_partition_ids") or []]
        or [f"rollout-{rec.rollout_id}"],
        "consumer_batch_ids": [str(x) for x in rec.identity_extra.get("consumer_batch_ids") or []],
        "micro_batch_ids": list(dict.fromkeys(rec.micro_batches)),
        "semantic_group_ids": group_ids,
        "normalization_cohort_ids": group_ids,
        "weight_lineage": None
        if lineage is None
        else {
            "rollout_weight": redact_identifier(lineage.get("rollout_weight")),
            "actor_weight": redact_identifier(lineage.get("actor_weight")),
        },
        "rank": rank,
    }
    contracts = default_stage_contracts(set(payloads), expected, records)
    contracts = _prune_contracts(contracts, records, payloads, config)
    anchor = f"replay-{rec.rollout_id}-{rec.step_id}" if rec.kind == "step" else f"replay-rollout-{rec.rollout_id}"
    return BundleContents(
        bundle_id=f"{cfg.run}.{anchor}",
        identity=identity,
        samples=records,
        config=config,
        payloads=payloads,
        expected=expected,
        stage_contracts=contracts,
        producer={"commit": cfg.producer_commit, "dirty_patch_digest": "", "torch_version": str(torch.__version__)},
        redaction=cfg.redaction.to_manifest(),
    )


def _json_number(x: Any) -> Any:
    """0-d tensors and NumPy scalars in a metrics record as plain numbers."""
    item = getattr(x, "item", None)
    if item is not None:
        return item()
    raise TypeError(f"{type(x).__name__} is not a number")
