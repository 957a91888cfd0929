"""Assemble one bundle's `BundleContents` from what capture snapshotted.

Why here and not in capture: this is the bundle format's side of capture (which
sample fields, expected outputs, identity and stage contracts a captured record
becomes), so it lives next to the bundle writer that serializes the result.
Capture owns the hot-path snapshots and the writer thread and calls
`build_contents` from that thread. This module imports nothing from
``trajstore.capture`` (capture imports it), so the dependency runs one way; the
capture configuration reaches it through the `AssemblySettings` protocol.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from trajstore.bundle.checks import PER_TOKEN_PAYLOADS
from trajstore.bundle.writer import BundleContents, default_stage_contracts
from trajstore.vocab import Stage, required_loss_fields

logger = logging.getLogger("trajstore.capture")


@dataclass
class CapturedRecord:
    """One rollout or actor step as snapshotted on the training thread (CPU copies)."""

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
    #: other expected values by stage, merged into expected.json (e.g. a loss family's record)
    expected_extra: dict[str, dict[str, Any]] | None = None


class SampleRedaction(Protocol):
    """The redaction policy as assembly uses it (capture's `RedactionPolicy`)."""

    def redact_sample(self, sample: Mapping[str, Any]) -> dict[str, Any]: ...

    def identifier(self, value: Any) -> str | None: ...

    def to_manifest(self) -> dict[str, str]: ...


class AssemblySettings(Protocol):
    """The capture settings a bundle records (capture's `CaptureConfig`)."""

    run: str
    producer_commit: str
    producer_ranks: tuple[int, ...] | None
    parallel: Mapping[str, int] | None
    redaction: SampleRedaction


def _to_list(values: Any) -> list:
    return values.tolist() if hasattr(values, "tolist") else list(values)


def _merge_payloads(parts: dict[str, list[Any]]) -> dict[str, Any]:
    """One tensor per payload: the micro-batches' pieces concatenated."""
    import torch

    merged = {}
    for name, pieces in parts.items():
        if not pieces:
            continue
        merged[name] = (
            pieces[0]
            if len(pieces) == 1
            else torch.cat([piece if piece.dim() else piece.reshape(1) for piece in pieces])
        )
    return merged


def _split(flat: Any, lengths: list[int], what: str) -> list[list]:
    """Cut a flat per-token list into one list per sample response."""
    values = _to_list(flat)
    if len(values) != sum(lengths):
        raise ValueError(f"{what} has {len(values)} entries for {sum(lengths)} response tokens")
    pieces, pos = [], 0
    for length in lengths:
        pieces.append(values[pos : pos + length])
        pos += length
    return pieces


def _response_lengths(samples: list[dict[str, Any]]) -> list[int]:
    lengths = []
    for sample in samples:
        if "response_length" in sample:
            lengths.append(int(sample["response_length"]))
        elif "loss_mask" in sample:
            lengths.append(len(_to_list(sample["loss_mask"])))
        else:
            raise ValueError(
                f"sample {sample.get('sample_id')!r} has neither response_length nor loss_mask"
            )
    return lengths


def _sample_records(
    rec: CapturedRecord, payloads: dict[str, Any], settings: AssemblySettings
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Index sample records (redacted) and the expected reward lists."""
    samples = rec.samples
    lengths = _response_lengths(samples)
    flat_mask = payloads.pop("loss_mask", None)
    masks = _split(flat_mask, lengths, "loss_mask") if flat_mask is not None else None
    per_sample = {}
    for key in ("raw_rewards", "rewards"):
        value = payloads.pop(key, None)
        if value is not None:
            values = [float(x) for x in _to_list(value)]
            if len(values) != len(samples):
                raise ValueError(f"{key} has {len(values)} values for {len(samples)} samples")
            per_sample[key] = values
    records = []
    for i, sample in enumerate(samples):
        record: dict[str, Any] = {
            "sample_id": str(sample["sample_id"]),
            "group_index": None
            if sample.get("group_index") is None
            else int(sample["group_index"]),
            "response_length": lengths[i],
            "total_length": int(sample.get("total_length", lengths[i])),
        }
        mask = masks[i] if masks is not None else sample.get("loss_mask")
        record["loss_mask"] = (
            [int(x) for x in _to_list(mask)] if mask is not None else [1] * lengths[i]
        )
        if "micro_batch_id" in sample:
            record["micro_batch_id"] = sample["micro_batch_id"]
        if "rewards" in per_sample:
            record["reward"] = per_sample["rewards"][i]
        elif sample.get("reward") is not None:
            reward = sample["reward"]
            record["reward"] = (
                [float(x) for x in _to_list(reward)]
                if hasattr(reward, "tolist") and reward.dim()
                else float(reward)
            )
        if "raw_rewards" in per_sample:
            record["raw_reward"] = per_sample["raw_rewards"][i]
        elif sample.get("raw_reward") is not None:
            record["raw_reward"] = float(sample["raw_reward"])
        record.update(settings.redaction.redact_sample(sample))
        records.append(record)
    expected: dict[str, Any] = {}
    if rec.kind == "rollout":
        if "raw_rewards" in per_sample:
            expected[Stage.REWARD_RAW] = {"raw_rewards": per_sample["raw_rewards"]}
        if "rewards" in per_sample:
            expected[Stage.REWARD_POST_PROCESS] = {"rewards": per_sample["rewards"]}
    return records, expected


def _loss_expected(rec: CapturedRecord, config: dict[str, Any]) -> dict[str, float] | None:
    """The trainer's loss metrics summed over micro-batches, or None if incomplete."""
    if not rec.metrics or not any(rec.metrics):
        return None
    required = required_loss_fields(bool(config.get("use_kl_loss")))
    sums = {}
    for name in required:
        if not all(name in mb_metrics for mb_metrics in rec.metrics):
            logger.warning(
                "step %s:%s: metric %r missing in some micro-batch; loss.policy not declared",
                rec.rollout_id,
                rec.step_id,
                name,
            )
            return None
        sums[name] = math.fsum(float(mb_metrics[name]) for mb_metrics in rec.metrics)
    return sums


def _prune_contracts(contracts: dict, records: list[dict], payloads: dict, config: dict) -> dict:
    """Declare only stages whose inputs the bundle actually carries."""
    have = set(payloads)
    drop = set()
    if not all("reward" in record for record in records):
        drop.add(Stage.ADVANTAGE_ESTIMATE)
    kl_coef = float(config.get("kl_coef", 0.0) or 0.0)
    if kl_coef != 0.0 and not {"old_log_probs", "ref_log_probs"} <= have:
        drop.add(Stage.ADVANTAGE_KL)
    if not isinstance(config.get("n_samples_per_prompt"), int) or any(
        record["group_index"] is None for record in records
    ):
        drop.add(Stage.REWARD_POST_PROCESS)
    # verl computes no entropy when entropy_coeff is 0; its loss replays without it
    verl = isinstance(config.get("verl"), dict)
    if "entropy" not in have and Stage.LOSS_POLICY in contracts and not verl:
        drop.add(Stage.LOSS_POLICY)
    if config.get("use_kl_loss") and "ref_log_probs" not in have:
        drop.add(Stage.LOSS_POLICY)
    return {stage: v for stage, v in contracts.items() if stage not in drop}


def _identity(
    rec: CapturedRecord, settings: AssemblySettings, records: list[dict[str, Any]]
) -> dict[str, Any]:
    """The manifest identity: run, step or rollout, lineage (redacted) and rank layout."""
    groups = sorted({r["group_index"] for r in records if r["group_index"] is not None})
    group_ids = [f"g-{group}" for group in groups]
    lineage = rec.identity_extra.get("weight_lineage")
    parallel = dict(settings.parallel or {})
    n_producers = len(settings.producer_ranks) if settings.producer_ranks else 1
    rank = {
        "dp": parallel.get("dp", n_producers),
        "tp": parallel.get("tp", 1),
        "pp": parallel.get("pp", 1),
        "cp": parallel.get("cp", 1),
    }
    is_step = rec.kind == "step"
    partition_ids = rec.identity_extra.get("rollout_partition_ids") or []
    return {
        "run": settings.run,
        "actor_step_id": {"rollout_id": rec.rollout_id, "step_id": rec.step_id}
        if is_step
        else None,
        "rollout_id": None if is_step else rec.rollout_id,
        "rollout_partition_ids": [str(x) for x in partition_ids] or [f"rollout-{rec.rollout_id}"],
        "consumer_batch_ids": [str(x) for x in rec.identity_extra.get("consumer_batch_ids") or []],
        "micro_batch_ids": list(dict.fromkeys(rec.micro_batches)),
        "semantic_group_ids": group_ids,
        "normalization_cohort_ids": group_ids,
        "weight_lineage": None
        if lineage is None
        else {
            "rollout_weight": settings.redaction.identifier(lineage.get("rollout_weight")),
            "actor_weight": settings.redaction.identifier(lineage.get("actor_weight")),
        },
        "rank": rank,
    }


def build_contents(
    rec: CapturedRecord, settings: AssemblySettings, config: dict[str, Any]
) -> BundleContents:
    """Assemble (and redact) one bundle from a snapshot record.

    ``config`` is the recompute config already filtered to the keys replay reads.
    """
    import torch

    payloads = _merge_payloads(rec.payloads)
    records, expected = _sample_records(rec, payloads, settings)
    for name, tensor in payloads.items():
        if name in PER_TOKEN_PAYLOADS and tensor.dim() != 1:
            payloads[name] = tensor.reshape(-1)
    if rec.kind == "step":
        loss = _loss_expected(rec, config)
        if loss is not None:
            expected[Stage.LOSS_POLICY] = loss
    if rec.router_consistency is not None:
        expected[Stage.ROUTER_CONSISTENCY] = rec.router_consistency
    for stage, values in (rec.expected_extra or {}).items():
        expected.setdefault(stage, {}).update(values)
    contracts = default_stage_contracts(set(payloads), expected, records)
    contracts = _prune_contracts(contracts, records, payloads, config)
    anchor = (
        f"replay-{rec.rollout_id}-{rec.step_id}"
        if rec.kind == "step"
        else f"replay-rollout-{rec.rollout_id}"
    )
    return BundleContents(
        bundle_id=f"{settings.run}.{anchor}",
        identity=_identity(rec, settings, records),
        samples=records,
        config=config,
        payloads=payloads,
        expected=expected,
        stage_contracts=contracts,
        producer={
            "commit": settings.producer_commit,
            "dirty_patch_digest": "",
            "torch_version": str(torch.__version__),
        },
        redaction=settings.redaction.to_manifest(),
    )
