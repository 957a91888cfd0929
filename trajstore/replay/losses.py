"""The GRPO loss family: TRL's loss types, GSPO, Dr.GRPO, DAPO, CISPO, ... as stage variants.

Why a variant and not new stages: these estimators recompute the same links of
the chain (raw reward, group normalization, per-token KL, advantages, policy
loss) with other formulas, so a divergence is still named by the chain's
stage. A bundle selects the family by setting any loss-family config key
(`trajstore.schema.LOSS_FAMILY_FIELDS`, replay-math.md "Loss family"); any
producer may do so, TRL's capture (`trajstore.integrations.trl`) is one.

The math mirrors TRL 1.16's ``GRPOTrainer`` (``_generate_and_score_completions``
and ``_compute_loss``) on flat per-sample tensors instead of padded [B, L]
ones: element-wise operations in float32 as torch does them, reductions
accumulated in float64 and rounded once. Reductions that depend on the
micro-batch (TRL reduces each ``compute_loss`` call separately) use the
samples' ``micro_batch_id``. NumPy only: importing torch costs more than a replay.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trajstore.replay import stages as v1
from trajstore.replay.compare import compare_arrays
from trajstore.replay.context import (
    ReplayContext,
    StageInputError,
    StageOutcome,
    is_number,
    outcome_of,
)
from trajstore.replay.registry import CapabilityCheck, StageVariant, register_variant
from trajstore.replay.source import BundleSource
from trajstore.schema import LOSS_FAMILY_FIELDS, Config
from trajstore.vocab import Capability, Payload, Stage, StageStatus

#: the variant's name and version (recorded with every outcome it produces)
FAMILY = "loss-family"
FAMILY_VERSION = "family-v1"
#: policy losses replayed, and the reduction each uses
POLICY_LOSSES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo")
#: named but not replayable, with the reason the capability matrix gives
UNREPLAYABLE_LOSSES: dict[str, str] = {
    "vespo": "its gamma weights are not replayed (policy_loss 'vespo' is unsupported)",
}
IS_LEVELS: tuple[str, ...] = ("token", "sequence")
IS_CORRECTIONS: tuple[str, ...] = (
    "token_truncate",
    "token_mask",
    "sequence_truncate",
    "sequence_mask",
)
REWARD_SCALES: tuple[str, ...] = ("group", "batch", "none")
#: ``reward_sum_order`` -> the float32 SIMD width of torch's CPU sums that made the rewards'
#: group means and stds (replayed addition by addition; null: float64 sums, rounded once)
REWARD_SUM_ORDERS: dict[str, int] = {"torch-cpu-8": 8, "torch-cpu-16": 16}
#: torch's CPU capability (``torch.backends.cpu.get_cpu_capability()``) -> its sum order.
#: AVX512 builds still reduce float32 sums in 8-float vectors (checked against torch.nansum
#: on an avx512f CPU with torch 2.13: the 16-lane order differed from length 8 up)
CPU_SUM_ORDERS: dict[str, str] = {
    "DEFAULT": "torch-cpu-8",
    "AVX2": "torch-cpu-8",
    "AVX512": "torch-cpu-8",
}
#: per-micro-batch metrics a producer may record, compared when present
METRIC_FIELDS: tuple[str, ...] = (
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "cispo_clip_ratio",
)
#: TRL's reward-std epsilon (the v1 chain's is 1e-6)
DEFAULT_REWARD_STD_EPS = 1e-4


def uses_family(source: BundleSource) -> bool:
    """A bundle selects the family by any non-null loss-family config key."""
    config = source.index.config
    return any(config.get(key) is not None for key in LOSS_FAMILY_FIELDS)


# --------------------------------------------------------------------------- helpers


def _f32(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def row_sums(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per-sample float64 sums of a flat array (empty samples sum to 0); every family's
    per-sequence reductions (TRL's, verl's) use it."""
    out = np.zeros(lengths.size, dtype=np.float64)
    nonempty = lengths > 0
    if values.size and nonempty.any():
        starts = (np.cumsum(lengths) - lengths)[nonempty]
        out[nonempty] = np.add.reduceat(np.asarray(values, dtype=np.float64), starts)
    return out


def scalar_comparer(ctx: ReplayContext, stage: str) -> Callable[[str, float, float], Any]:
    """``compare(name, expected, actual)`` of one recorded scalar of ``stage`` with the
    stage's tolerance (exact where the manifest says so): every family's loss checks."""
    atol, rtol = ctx.tolerance(stage)
    exact = ctx.source.manifest.exact_fields

    def compare(name: str, expected: float, actual: float) -> Any:
        return compare_arrays(
            stage,
            name,
            np.array([expected], dtype=np.float64),
            np.array([actual], dtype=np.float64),
            atol=atol,
            rtol=rtol,
            exact=name in exact,
        )

    return compare


def _per_token(per_row: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    return np.repeat(per_row, lengths)


def _nanstd(values: np.ndarray) -> float:
    """TRL's ``nanstd``: Bessel-corrected std ignoring NaN; NaN for fewer than 2 values."""
    kept = values[~np.isnan(values)].astype(np.float64)
    if kept.size < 2:
        return math.nan
    return float(np.sqrt(np.mean((kept - kept.mean()) ** 2) * kept.size / (kept.size - 1)))


# ---- torch's float32 CPU sums, addition by addition -----------------------------------
#
# Why: TRL subtracts a group mean that torch summed in float32. That mean can sit an ulp or
# two away from the correctly rounded one, and dividing by a small std magnifies the ulp far
# past the comparison's tolerance (issue 29, item 13: 3.4e-6 on every sample of a group).
# Replaying the mean in float64 is then a different computation, not a more accurate one.
# torch's CPU kernel (aten/native/cpu/SumKernel.cpp, "cascade sum") adds in a fixed order that
# depends only on the length and the SIMD width, so it is replayed here exactly.


def _cascade(rows: np.ndarray) -> np.ndarray:
    """Sum over axis 0 in 4 levels of chunks of 16 (or 2**(ceil(log2 n) / 4)) elements."""
    size, levels = rows.shape[0], 4
    power = max(4, (size - 1).bit_length() // levels) if size > 1 else 4
    step, mask = 1 << power, (1 << power) - 1
    acc = [np.zeros(rows.shape[1:], dtype=np.float32) for _ in range(levels)]
    i = 0
    while i + step <= size:
        for _ in range(step):
            acc[0] = acc[0] + rows[i]
            i += 1
        for j in range(1, levels):
            acc[j], acc[j - 1] = acc[j] + acc[j - 1], np.zeros_like(acc[0])
            if i & (mask << (j * power)):
                break
    for k in range(i, size):
        acc[0] = acc[0] + rows[k]
    for j in range(1, levels):
        acc[0] = acc[0] + acc[j]
    return acc[0]


def _ilp_sum(x: np.ndarray) -> np.ndarray:
    """Sum over axis 0 as 4 interleaved partial sums (cascaded), the tail, then the partials."""
    n, ilp = x.shape[0], 4
    whole = n // ilp
    if whole:
        partial = list(_cascade(x[: whole * ilp].reshape((whole, ilp) + x.shape[1:])))
    else:
        partial = [np.zeros(x.shape[1:], dtype=np.float32) for _ in range(ilp)]
    for k in range(whole * ilp, n):
        partial[0] = partial[0] + x[k]
    for k in range(1, ilp):
        partial[0] = partial[0] + partial[k]
    return partial[0]


def torch_cpu_nansum(rows: np.ndarray, lanes: int) -> np.ndarray:
    """``torch.nansum(rows, dim=1)`` of a contiguous float32 [n, k] array on the CPU, bit for
    bit: rows of at least ``lanes`` (the SIMD width in float32s) are summed as vectors of
    ``lanes``, the leftover elements first and the lanes after; shorter rows as scalars."""
    x = np.nan_to_num(np.asarray(rows, dtype=np.float32), nan=0.0)
    n, k = x.shape
    if k < lanes:
        return _ilp_sum(np.ascontiguousarray(x.T))
    vectors = k // lanes
    lanes_sum = _ilp_sum(x[:, : vectors * lanes].reshape(n, vectors, lanes).transpose(1, 0, 2))
    out = np.zeros(n, dtype=np.float32)
    for column in range(vectors * lanes, k):
        out = out + x[:, column]
    for lane in range(lanes):
        out = out + lanes_sum[:, lane]
    return out


def _torch_nanmean(rows: np.ndarray, lanes: int) -> np.ndarray:
    """``torch.nanmean(rows, dim=1)`` in float32 (NaN for a row of NaN only)."""
    count = (~np.isnan(rows)).sum(axis=1).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (torch_cpu_nansum(rows, lanes) / count).astype(np.float32)


def _torch_nanstd(rows: np.ndarray, lanes: int) -> np.ndarray:
    """TRL's ``nanstd(rows, dim=1)`` in float32: the NaN-mean of squared deviations from the
    NaN-mean, times ``count / (count - 1)`` (NaN below 2 values), square-rooted."""
    rows = np.asarray(rows, dtype=np.float32)
    deviations = rows - _torch_nanmean(rows, lanes)[:, None]
    variance = _torch_nanmean(deviations * deviations, lanes)
    count = (~np.isnan(rows)).sum(axis=1).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        correction = np.where(count > 1, count / (count - np.float32(1.0)), np.float32(np.nan))
        return np.sqrt((variance * correction.astype(np.float32)).astype(np.float32))


@dataclass(frozen=True)
class LossSettings:
    """The config of one bundle as the family's loss reads it (replay-math.md "Loss family")."""

    policy_loss: str
    level: str
    eps_low: float
    eps_high: float
    delta: float | None
    beta: float
    use_kl: bool
    bias_corrected_kl: bool
    entropy_coef: float
    top_entropy_quantile: float
    max_response_length: int | None
    accumulation: int
    steps_per_generation: int | None
    token_normalizer: float | None
    sapo_pos: float
    sapo_neg: float
    off_policy_threshold: float | None
    is_correction: str | None
    is_clip_min: float | None
    is_clip_max: float | None
    aux_coef: float

    @classmethod
    def of(cls, ctx: ReplayContext) -> LossSettings:
        eps = float(ctx.cfg("eps_clip", 0.2))
        use_kl = bool(ctx.cfg("use_kl_loss", False))
        return cls(
            policy_loss=str(ctx.cfg("policy_loss", "grpo")),
            level=str(ctx.cfg("importance_sampling_level", "token")),
            eps_low=eps,
            eps_high=float(ctx.cfg("eps_clip_high", eps)),
            delta=ctx.config.get("delta"),
            beta=float(ctx.cfg("kl_loss_coef", 0.0)) if use_kl else 0.0,
            use_kl=use_kl,
            bias_corrected_kl=bool(ctx.cfg("use_unbiased_kl", False)),
            entropy_coef=float(ctx.cfg("entropy_coef", 0.0)),
            top_entropy_quantile=float(ctx.cfg("top_entropy_quantile", 1.0)),
            max_response_length=ctx.config.get("max_response_length"),
            accumulation=int(ctx.cfg("gradient_accumulation_steps", 1)),
            steps_per_generation=ctx.config.get("steps_per_generation"),
            token_normalizer=ctx.config.get("loss_token_normalizer"),
            sapo_pos=float(ctx.cfg("sapo_temperature_pos", 1.0)),
            sapo_neg=float(ctx.cfg("sapo_temperature_neg", 1.05)),
            off_policy_threshold=ctx.config.get("off_policy_mask_threshold"),
            is_correction=ctx.config.get("is_correction"),
            is_clip_min=ctx.config.get("is_clip_min"),
            is_clip_max=ctx.config.get("is_clip_max"),
            aux_coef=float(ctx.cfg("aux_loss_coef", 0.0)),
        )


# --------------------------------------------------------------------------- kernels


def k3_kl(log_probs: np.ndarray, ref_log_probs: np.ndarray) -> np.ndarray:
    """TRL's per-token KL: ``exp(ref - lp) - (ref - lp) - 1``, in float32."""
    diff = _f32(ref_log_probs) - _f32(log_probs)
    return np.exp(diff) - diff - np.float32(1.0)


def importance_ratio(
    log_probs: np.ndarray,
    old_log_probs: np.ndarray,
    mask: np.ndarray,
    lengths: np.ndarray,
    level: str,
) -> np.ndarray:
    """TRL's ``coef_1`` on every token: ``exp(lp - old)`` (``token``), or the exp of each
    sample's masked mean of ``lp - old`` (``sequence``, GSPO), in float32."""
    log_ratio = _f32(log_probs) - _f32(old_log_probs)
    if level == "sequence":
        counts = np.maximum(row_sums(mask, lengths), 1.0).astype(np.float32)
        per_row = row_sums(log_ratio * mask, lengths).astype(np.float32) / counts
        log_ratio = _per_token(per_row.astype(np.float32), lengths)
    return np.exp(log_ratio)


def loss_kl(
    log_probs: np.ndarray,
    ref_log_probs: np.ndarray,
    ratio: np.ndarray | None,
    bias_corrected: bool,
) -> np.ndarray:
    """The per-token KL TRL's loss adds (``per_token_kl``): k3, times the importance ratio
    under ``use_bias_correction_kl`` (``use_unbiased_kl``; TRL 1.16's default)."""
    kl = k3_kl(log_probs, ref_log_probs)
    return (kl * ratio).astype(np.float32) if bias_corrected else kl


def is_correction_ratio(
    old_log_probs: np.ndarray,
    sampling_log_probs: np.ndarray,
    mask: np.ndarray,
    lengths: np.ndarray,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> np.ndarray:
    """Per-token importance-sampling correction (TRL's vLLM IS ratio) of one set of samples.

    ``(old - sampling) * mask`` with NaN as 0; sequence modes sum it per sample;
    ``exp``; truncate clamps to [min, max], mask zeroes ratios outside it.
    """
    diff = np.nan_to_num((_f32(old_log_probs) - _f32(sampling_log_probs)) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = _per_token(row_sums(diff, lengths).astype(np.float32), lengths)
    ratio = np.exp(diff)
    if mode.endswith("truncate"):
        low = -np.inf if clip_min is None else clip_min
        high = np.inf if clip_max is None else clip_max
        return np.clip(ratio, np.float32(low), np.float32(high)).astype(np.float32)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return np.where((ratio < low) | (ratio > high), np.float32(0.0), ratio).astype(np.float32)


@dataclass
class MicroBatch:
    """One call of a trainer's loss (TRL's ``compute_loss``, verl's actor loss): its
    samples' flat per-token arrays, in bundle order.

    The loss family reads ``is_ratio`` / ``sampling_log_probs`` (TRL's IS correction),
    ``aux_loss`` and ``token_normalizer``; verl's variants read ``is_weights`` (rollout IS
    weights) and ``info`` (the global batch sizes its aggregation divided by).
    """

    micro_batch_id: str
    lengths: np.ndarray
    log_probs: np.ndarray
    old_log_probs: np.ndarray
    advantages: np.ndarray
    mask: np.ndarray
    entropy: np.ndarray | None = None
    ref_log_probs: np.ndarray | None = None
    is_ratio: np.ndarray | None = None
    sampling_log_probs: np.ndarray | None = None
    is_weights: np.ndarray | None = None
    aux_loss: float | None = None
    token_normalizer: float | None = None
    info: Mapping[str, Any] = field(default_factory=dict)


def micro_batch_loss(mb: MicroBatch, s: LossSettings) -> dict[str, float]:
    """The loss TRL's ``_compute_loss`` returns for one micro-batch, and its logged metrics."""
    lengths, mask = mb.lengths, _f32(mb.mask)
    lp, adv = _f32(mb.log_probs), _f32(mb.advantages)
    ent = _f32(mb.entropy)
    counts = np.maximum(row_sums(mask, lengths), 1.0).astype(np.float32)
    coef_1 = importance_ratio(lp, mb.old_log_probs, mask, lengths, s.level)
    entropy_mask = None
    if s.top_entropy_quantile < 1.0:
        kept = ent[mask.astype(bool)]
        if kept.size == 0:
            entropy_mask = np.zeros_like(mask)
        else:
            threshold = np.float32(np.quantile(kept, 1.0 - s.top_entropy_quantile))
            entropy_mask = ((ent * mask >= threshold) & mask.astype(bool)).astype(np.float32)
    per_token_kl = None
    if s.beta != 0.0:
        if mb.ref_log_probs is None:
            raise StageInputError(
                f"incomplete bundle: payload '{Payload.REF_LOG_PROBS}' is missing"
            )
        per_token_kl = loss_kl(lp, mb.ref_log_probs, coef_1, s.bias_corrected_kl)
    if s.policy_loss == "cispo":
        per_token_loss = -np.minimum(coef_1, np.float32(s.eps_high)) * adv * lp
    elif s.policy_loss == "sapo":
        temperatures = np.where(adv > 0, np.float32(s.sapo_pos), np.float32(s.sapo_neg))
        soft = 1.0 / (1.0 + np.exp(-(temperatures * (coef_1 - np.float32(1.0)))))
        per_token_loss = -(soft.astype(np.float32) * np.float32(4.0) / temperatures) * adv
    else:
        coef_2 = np.clip(coef_1, np.float32(1 - s.eps_low), np.float32(1 + s.eps_high))
        if s.delta is not None:
            coef_1 = np.minimum(coef_1, np.float32(s.delta))
        per_token_loss = -np.minimum(coef_1 * adv, coef_2 * adv)
    per_token_loss = per_token_loss.astype(np.float32)
    if s.off_policy_threshold is not None:
        sampling = mb.sampling_log_probs if mb.sampling_log_probs is not None else mb.old_log_probs
        kl_div = np.nan_to_num(_f32(sampling) - lp, nan=0.0)
        seq_kl = (row_sums(kl_div * mask, lengths).astype(np.float32)) / counts
        keep = (adv >= 0) | (_per_token(seq_kl, lengths) <= np.float32(s.off_policy_threshold))
        per_token_loss = per_token_loss * keep.astype(np.float32)
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if s.is_correction is not None:
        if mb.is_ratio is None:
            raise StageInputError(
                f"incomplete bundle: is_correction needs payload '{Payload.ROLLOUT_LOG_PROBS}'"
            )
        per_token_loss = per_token_loss * mb.is_ratio
    if per_token_kl is not None:
        per_token_loss = per_token_loss + np.float32(s.beta) * per_token_kl
    accumulation = np.float32(s.accumulation)
    masked = per_token_loss * mask
    rows = lengths.size
    if s.policy_loss in ("grpo", "sapo"):
        loss = np.float32(np.mean(row_sums(masked, lengths).astype(np.float32) / counts))
        loss = loss / accumulation
    elif s.policy_loss == "bnpo":
        loss = np.float32(masked.sum(dtype=np.float64)) / np.float32(max(float(mask.sum()), 1.0))
        loss = loss / accumulation
    elif s.policy_loss == "dr_grpo":
        if s.max_response_length is None:
            raise StageInputError("config.max_response_length is required by policy_loss dr_grpo")
        loss = np.float32(masked.sum(dtype=np.float64)) / np.float32(rows * s.max_response_length)
        loss = loss / accumulation
    elif s.policy_loss == "luspo":
        loss = np.float32(np.mean(row_sums(masked, lengths).astype(np.float32))) / accumulation
    else:  # dapo, cispo: one token normalizer for the step
        normalizer = mb.token_normalizer
        if normalizer is None:
            raise StageInputError(f"policy_loss {s.policy_loss} needs a token normalizer")
        loss = np.float32(masked.sum(dtype=np.float64)) / np.float32(normalizer)
    if s.entropy_coef != 0.0:
        effective = mask if entropy_mask is None else mask * entropy_mask
        entropy_loss = np.float32((ent * effective).sum(dtype=np.float64)) / np.float32(
            max(float(effective.sum()), 1.0)
        )
        loss = loss - np.float32(s.entropy_coef) * (entropy_loss / accumulation)
    if s.aux_coef != 0.0:
        if mb.aux_loss is None:
            raise StageInputError(f"micro-batch {mb.micro_batch_id} has no recorded aux_loss")
        loss = loss + np.float32(s.aux_coef) * np.float32(mb.aux_loss) / accumulation
    token_count = max(float(mask.sum()), 1.0)

    def token_mean(x: np.ndarray) -> float:
        """TRL's ``global_masked_mean``: over loss tokens, or over samples for a ratio-derived
        value under sequence-level weights (one value per sample, repeated on its tokens)."""
        if s.level == "sequence":
            first = np.cumsum(lengths) - lengths
            return float(x[first[lengths > 0]].astype(np.float64).sum() / max(rows, 1))
        return float((x * mask).sum(dtype=np.float64) / token_count)

    def masked_mean(x: np.ndarray) -> float:
        return float((x * mask).sum(dtype=np.float64) / token_count)

    out = {"loss": float(loss), "entropy": masked_mean(ent)}
    if per_token_kl is not None:
        out["kl"] = masked_mean(per_token_kl)
    if s.policy_loss in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        low = ((coef_1 < 1 - s.eps_low) & (adv < 0)).astype(np.float32)
        high = ((coef_1 > 1 + s.eps_high) & (adv > 0)).astype(np.float32)
        out["clip_ratio/low_mean"] = token_mean(low)
        out["clip_ratio/high_mean"] = token_mean(high)
        out["clip_ratio/region_mean"] = token_mean(np.maximum(low, high))
    elif s.policy_loss == "cispo":
        out["cispo_clip_ratio"] = token_mean(((coef_1 > s.eps_high) & (adv > 0)).astype(np.float32))
    return out


def reward_advantages(
    raw_rewards: np.ndarray,
    group_index: list[Any],
    group_size: int,
    scale: str,
    eps: float,
    sample_ids: list[str],
    sum_lanes: int | None = None,
) -> np.ndarray:
    """TRL's ``sum_then_normalize`` advantages: ``r - group mean``, divided by the group's
    (``group``) or the whole batch's (``batch``) Bessel std plus ``eps`` unless ``none``.

    With ``sum_lanes`` the means and stds are torch's float32 CPU sums (`torch_cpu_nansum`,
    group members in bundle order); without, float64 sums rounded once to float32."""
    rewards = _f32(raw_rewards)
    groups: dict[int, list[int]] = {}
    for pos, group in enumerate(group_index):
        if group is None or isinstance(group, bool) or not isinstance(group, int):
            raise StageInputError(f"sample {sample_ids[pos]!r} has no integer group_index")
        groups.setdefault(group, []).append(pos)
    for group, members in groups.items():
        if len(members) != group_size:
            raise StageInputError(
                f"group g-{group} has {len(members)} sample(s), "
                f"expected n_samples_per_prompt={group_size}"
            )
    means = np.zeros_like(rewards)
    stds = np.zeros_like(rewards)
    if sum_lanes is not None:
        members = np.array(list(groups.values()), dtype=np.int64).reshape(-1, group_size)
        means[members] = _torch_nanmean(rewards[members], sum_lanes)[:, None]
        if scale == "batch":
            stds[:] = _torch_nanstd(rewards[None, :], sum_lanes)[0] if rewards.size > 1 else 0.0
        elif group_size > 1:
            stds[members] = _torch_nanstd(rewards[members], sum_lanes)[:, None]
        advantages = rewards - means
        if scale != "none":
            advantages = advantages / (stds + np.float32(eps))
        return np.nan_to_num(advantages.astype(np.float32), nan=0.0)
    batch_std = np.float32(_nanstd(rewards)) if rewards.size > 1 else np.float32(0.0)
    for members in groups.values():
        values = rewards[members]
        kept = values[~np.isnan(values)]
        means[members] = np.float32(kept.astype(np.float64).mean()) if kept.size else np.nan
        if scale == "batch":
            stds[members] = batch_std
        else:
            stds[members] = np.float32(_nanstd(values)) if group_size > 1 else np.float32(0.0)
    advantages = rewards - means
    if scale != "none":
        advantages = advantages / (stds + np.float32(eps))
    return np.nan_to_num(advantages.astype(np.float32), nan=0.0)


# --------------------------------------------------------------------------- stages


def stage_reward_raw(ctx: ReplayContext) -> StageOutcome:
    """Weighted sum of the per-function rewards (``config.reward_weights``), else v1."""
    weights = ctx.config.get("reward_weights")
    if weights is None:
        return v1.stage_reward_raw(ctx)
    record = ctx.source.expected.get(Stage.REWARD_RAW, {})
    per_function = record.get("rewards_per_func") if isinstance(record, dict) else None
    if not isinstance(per_function, list) or len(per_function) != len(ctx.source.index.samples):
        raise StageInputError(
            "incomplete bundle: expected.json reward.raw.rewards_per_func must list one row "
            "per sample"
        )
    rows = [per_function[int(pos)] for pos in ctx.positions]
    if any(not isinstance(row, list) or len(row) != len(weights) for row in rows):
        raise StageInputError(
            f"reward.raw.rewards_per_func rows must have {len(weights)} values (reward_weights)"
        )
    bad = next((v for row in rows for v in row if v is not None and not is_number(v)), None)
    if bad is not None:  # a string here raised ValueError from np.array (tests/fuzz)
        raise StageInputError(
            f"expected.json reward.raw.rewards_per_func holds {bad!r:.40}, not a number or null"
        )
    table = np.array(
        [[math.nan if value is None else value for value in row] for row in rows],
        dtype=np.float32,
    ).reshape(len(rows), len(weights))
    weighted = table * _f32(weights)[None, :]
    actual = np.where(
        np.isnan(table).all(axis=1),
        np.float32(np.nan),
        np.nansum(weighted.astype(np.float64), axis=1).astype(np.float32),
    )
    ctx.recomputed["raw_rewards"] = actual
    comparisons = []
    expected = ctx.expected_per_sample(Stage.REWARD_RAW, "raw_rewards")
    if expected is not None:
        comparisons.append(
            ctx.compare(Stage.REWARD_RAW, "raw_reward", expected, actual, per_token=False)
        )
    # each sample's recorded raw reward too, unless expected.json already failed
    if all(c.ok for c in comparisons) and all(
        sample.raw_reward is not None for sample in ctx.samples
    ):
        recorded = np.array([sample.raw_reward for sample in ctx.samples], dtype=np.float64)
        comparisons.append(
            ctx.compare(Stage.REWARD_RAW, "raw_reward", recorded, actual, per_token=False)
        )
    if not comparisons:
        raise StageInputError("incomplete bundle: no recorded raw rewards to compare with")
    return outcome_of(Stage.REWARD_RAW, comparisons, "raw reward mismatch in {n} sample(s)")


def stage_reward_post_process(ctx: ReplayContext) -> StageOutcome:
    """Group / batch / no reward scaling (``config.reward_scale``), else v1."""
    scale = ctx.config.get("reward_scale")
    if scale is None:
        return v1.stage_reward_post_process(ctx)
    stage = Stage.REWARD_POST_PROCESS
    if scale == "batch" and ctx.partial:
        return StageOutcome(
            stage=stage,
            status=StageStatus.SKIPPED,
            reason="reward_scale batch normalizes over the whole bundle; not under a selection",
        )
    raw = ctx.recomputed.get("raw_rewards")
    if raw is None:
        raw = v1._recorded_raw_rewards(ctx)
    group_size = ctx.config.get("n_samples_per_prompt")
    if not isinstance(group_size, int) or group_size < 1:
        raise StageInputError(
            "config.n_samples_per_prompt is missing; semantic group size unknown, refusing to guess"
        )
    order = ctx.config.get("reward_sum_order")
    actual = reward_advantages(
        np.asarray(raw, dtype=np.float32),
        [sample.group_index for sample in ctx.samples],
        group_size,
        scale,
        float(ctx.cfg("reward_std_eps", DEFAULT_REWARD_STD_EPS)),
        ctx.sample_ids,
        sum_lanes=None if order is None else REWARD_SUM_ORDERS[order],
    )
    ctx.recomputed["rewards"] = actual
    comparisons = []
    expected = ctx.expected_per_sample(stage, "rewards")
    if expected is not None:
        comparisons.append(ctx.compare(stage, "reward", expected, actual, per_token=False))
    # each sample's recorded reward too, unless expected.json already failed (one line a sample)
    if all(c.ok for c in comparisons) and all(is_number(sample.reward) for sample in ctx.samples):
        recorded = np.array([sample.reward for sample in ctx.samples], dtype=np.float64)
        comparisons.append(ctx.compare(stage, "reward", recorded, actual, per_token=False))
    if not comparisons:
        raise StageInputError("incomplete bundle: no recorded post-processed rewards")
    return outcome_of(stage, comparisons, "normalized reward mismatch in {n} sample(s)")


def stage_loss_kl(ctx: ReplayContext) -> StageOutcome:
    """The loss's per-token KL (k3 of log_probs against ref_log_probs, times the importance
    ratio under use_unbiased_kl), checked against payload kl: the KL the producer's loss used."""
    stage = Stage.ADVANTAGE_KL
    expected = ctx.payload(Payload.KL)
    log_probs = ctx.payload(Payload.LOG_PROBS)
    bias_corrected = bool(ctx.cfg("use_unbiased_kl", False))
    ratio = None
    if bias_corrected:
        ratio = importance_ratio(
            log_probs,
            ctx.payload(Payload.OLD_LOG_PROBS),
            _f32(ctx.mask()),
            ctx.lengths,
            str(ctx.cfg("importance_sampling_level", "token")),
        )
    actual = loss_kl(log_probs, ctx.payload(Payload.REF_LOG_PROBS), ratio, bias_corrected)
    ctx.recomputed["kl"] = actual
    comparison = ctx.compare(stage, Payload.KL, expected, actual, per_token=True)
    return outcome_of(
        stage, [comparison], "{n} kl token(s) diverged (max_abs_error={err:.3e}, mismatches={n})"
    )


@dataclass
class _Inputs:
    """What the loss read besides the payloads: recomputed where the bundle allows (and then
    compared with the record), else the recorded value, named in ``trusted``."""

    batches: list[MicroBatch]
    comparisons: list[Any]
    trusted: list[str]


def generation_loss_tokens(
    ctx: ReplayContext, order: dict[str, list[int]], steps_per_generation: int | None
) -> dict[str, float]:
    """Each micro-batch's generation-batch loss-token count (TRL's ``num_items_in_batch``),
    where the bundle holds that generation batch whole.

    TRL shuffles a generation batch once, splits it into ``steps_per_generation`` equal
    micro-batches and feeds those slices in turn, ``num_iterations`` times over. So any
    ``steps_per_generation`` consecutive micro-batches of one generation batch in which each
    of its prompt groups appears exactly ``n_samples_per_prompt`` times are the whole batch,
    and their loss tokens are the count of every micro-batch of that generation. A sample's
    generation is ``group_index // (groups per generation batch)``.
    """
    group_size = ctx.config.get("n_samples_per_prompt")
    sizes = {len(positions) for positions in order.values()}
    if steps_per_generation is None or not isinstance(group_size, int) or len(sizes) != 1:
        return {}
    span = int(steps_per_generation)
    generation_rows = sizes.pop() * span
    if span < 1 or group_size < 1 or generation_rows % group_size:
        return {}
    groups_per_generation = generation_rows // group_size
    tokens = row_sums(_f32(ctx.mask()), ctx.lengths)
    runs: list[tuple[int, list[str]]] = []  # consecutive micro-batches of one generation
    for mb_id, positions in order.items():
        groups = {ctx.samples[p].group_index for p in positions}
        if not all(isinstance(g, int) and not isinstance(g, bool) for g in groups):
            return {}
        generations = {g // groups_per_generation for g in groups}
        generation = generations.pop() if len(generations) == 1 else None
        if generation is None or not runs or runs[-1][0] != generation:
            runs.append((-1 if generation is None else generation, []))
        runs[-1][1].append(mb_id)
    counted: dict[int, float] = {}
    for generation, mb_ids in runs:
        first = generation * groups_per_generation
        wanted = dict.fromkeys(range(first, first + groups_per_generation), group_size)
        for start in range(len(mb_ids) - span + 1):
            positions = [p for mb_id in mb_ids[start : start + span] for p in order[mb_id]]
            counts: dict[int, int] = {}
            for p in positions:
                group = ctx.samples[p].group_index
                counts[group] = counts.get(group, 0) + 1
            if generation >= 0 and counts == wanted:
                counted[generation] = float(tokens[positions].sum())
                break
    return {
        mb_id: counted[generation]
        for generation, mb_ids in runs
        if generation in counted
        for mb_id in mb_ids
    }


def _micro_batches(ctx: ReplayContext, s: LossSettings) -> _Inputs:
    """The selected samples split by micro_batch_id, in order of first appearance, with the
    recorded per-micro-batch inputs recomputed where the bundle allows."""
    order: dict[str, list[int]] = {}
    for pos, sample in enumerate(ctx.samples):
        order.setdefault(sample.micro_batch_id or "mb-0000", []).append(pos)
    advantages = ctx.recomputed.get("advantages")
    if advantages is None:
        advantages = ctx.payload(Payload.ADVANTAGES)
    needs_ref = s.beta != 0.0
    needs_sampling = s.is_correction is not None or (
        s.off_policy_threshold is not None and ctx.has_payload(Payload.ROLLOUT_LOG_PROBS)
    )
    columns = {
        "log_probs": ctx.payload(Payload.LOG_PROBS),
        "old_log_probs": ctx.payload(Payload.OLD_LOG_PROBS),
        "advantages": advantages,
        "entropy": ctx.payload(Payload.ENTROPY),
        "mask": ctx.mask(),
    }
    if needs_ref:
        columns["ref_log_probs"] = ctx.payload(Payload.REF_LOG_PROBS)
    if needs_sampling:
        columns["sampling_log_probs"] = ctx.payload(Payload.ROLLOUT_LOG_PROBS)
    recorded = _recorded_micro_batches(ctx)
    token_normalized = s.policy_loss in ("dapo", "cispo")
    counted = generation_loss_tokens(ctx, order, s.steps_per_generation) if token_normalized else {}
    inputs = _Inputs([], [], [])
    for mb_id, positions in order.items():
        index = np.concatenate(
            [np.arange(ctx.offsets[p], ctx.offsets[p + 1]) for p in positions]
        ).astype(np.int64)
        parts = {name: values[index] for name, values in columns.items()}
        lengths = ctx.lengths[positions]
        record = recorded.get(mb_id, {})
        normalizer = None
        if token_normalized:
            normalizer = _token_normalizer(ctx, s, mb_id, record, counted, inputs)
            if normalizer is None:
                normalizer = max(float(columns["mask"].sum()), 1.0)
        if s.aux_coef != 0.0 and is_number(record.get("aux_loss")):
            inputs.trusted.append(f"{mb_id}.aux_loss")  # needs the loss forward's router logits
        is_ratio = None
        if s.is_correction is not None:
            is_ratio = is_correction_ratio(
                parts["old_log_probs"],
                parts["sampling_log_probs"],
                _f32(parts["mask"]),
                lengths,
                s.is_correction,
                s.is_clip_min,
                s.is_clip_max,
            )
        inputs.batches.append(
            MicroBatch(
                micro_batch_id=mb_id,
                lengths=lengths,
                is_ratio=is_ratio,
                aux_loss=record.get("aux_loss"),
                token_normalizer=normalizer,
                **parts,
            )
        )
    return inputs


def _token_normalizer(
    ctx: ReplayContext,
    s: LossSettings,
    mb_id: str,
    record: Mapping[str, Any],
    counted: Mapping[str, float],
    inputs: _Inputs,
) -> float | None:
    """A dapo/cispo micro-batch's divisor, TRL's ``num_items_in_batch * G / steps_per_generation``
    (one process): the count recomputed from the bundle when it holds the generation batch
    whole (compared with the recorded one), else the recorded count or divisor, on trust; the
    config's ``loss_token_normalizer``; None: the bundle's loss tokens."""
    recorded = record.get("generation_loss_tokens")
    tokens = counted.get(mb_id)
    if tokens is not None and is_number(recorded):
        atol, rtol = ctx.tolerance(Stage.LOSS_POLICY)
        inputs.comparisons.append(
            compare_arrays(
                Stage.LOSS_POLICY,
                f"{mb_id}.generation_loss_tokens",
                np.array([float(recorded)]),
                np.array([tokens]),
                atol=atol,
                rtol=rtol,
            )
        )
    elif tokens is None and is_number(recorded) and s.steps_per_generation is not None:
        tokens = float(recorded)
        inputs.trusted.append(f"{mb_id}.generation_loss_tokens")
    if tokens is not None and s.steps_per_generation is not None:
        accumulation = np.float32(s.accumulation)
        count = np.float32(max(tokens, 1.0))
        return float(count * accumulation / np.float32(s.steps_per_generation))
    if is_number(record.get("token_normalizer")):
        inputs.trusted.append(f"{mb_id}.token_normalizer")
        return float(record["token_normalizer"])
    return s.token_normalizer


def _recorded_micro_batches(ctx: ReplayContext) -> Mapping[str, Mapping[str, Any]]:
    """expected.json loss.policy.micro_batches, each entry an object whose token_normalizer
    and aux_loss, when given, are numbers (a normalizer above 0): an entry that was not an
    object, or a string there, raised from deep in the loss (tests/fuzz/fuzz_expected.py)."""
    record = ctx.source.expected.get(Stage.LOSS_POLICY, {})
    batches = record.get("micro_batches", {}) if isinstance(record, dict) else {}
    if not isinstance(batches, dict):
        raise StageInputError("expected.json loss.policy.micro_batches must be an object")
    for mb_id, fields in batches.items():
        where = f"expected.json loss.policy.micro_batches[{mb_id!r:.40}]"
        if not isinstance(fields, dict):
            raise StageInputError(f"{where} must be an object")
        for name in ("token_normalizer", "aux_loss"):
            value = fields.get(name)
            if value is not None and not (
                is_number(value) and math.isfinite(value) and (name == "aux_loss" or value > 0)
            ):
                what = "a number above 0" if name == "token_normalizer" else "a finite number"
                raise StageInputError(f"{where}.{name} is {value!r:.40}, not {what}")
    return batches


def stage_loss_policy(ctx: ReplayContext) -> StageOutcome:
    """The step's loss (sum over micro-batches) and each micro-batch's loss and metrics."""
    stage = Stage.LOSS_POLICY
    recorded = ctx.source.expected.get(stage)
    if not isinstance(recorded, dict) or not is_number(recorded.get("loss")):
        raise StageInputError(f"incomplete bundle: expected.json {stage}.loss is missing")
    settings = LossSettings.of(ctx)
    inputs = _micro_batches(ctx, settings)
    results = {mb.micro_batch_id: micro_batch_loss(mb, settings) for mb in inputs.batches}
    compare = scalar_comparer(ctx, stage)

    total = math.fsum(result["loss"] for result in results.values())
    comparisons = [*inputs.comparisons, compare("loss", float(recorded["loss"]), total)]
    for mb_id, fields in _recorded_micro_batches(ctx).items():
        if mb_id not in results:
            raise StageInputError(f"expected.json {stage}.micro_batches names unknown {mb_id}")
        for name in ("loss", *METRIC_FIELDS):
            value = fields.get(name)
            if is_number(value) and name in results[mb_id]:
                comparisons.append(compare(f"{mb_id}.{name}", float(value), results[mb_id][name]))
    mismatched = [c.divergences[0].field for c in comparisons if not c.ok]
    outcome = outcome_of(stage, comparisons, f"{stage} mismatch in " + ", ".join(mismatched[:5]))
    outcome.trusted = inputs.trusted
    return outcome


# --------------------------------------------------------------------------- capability


def family_capability(stage: Stage) -> CapabilityCheck:
    """The producer's contract, then the family's config: unreplayable settings by name."""

    def check(source: BundleSource) -> tuple[Capability, str]:
        contract = source.manifest.stage_contracts.get(stage)
        if contract is None:
            return Capability.SKIPPED, "not in this bundle's stage contracts"
        if contract.capability == Capability.UNSUPPORTED:
            return Capability.UNSUPPORTED, "the producer declares this stage unsupported"
        if contract.capability != Capability.RECOMPUTE:
            return Capability.SKIPPED, f"declared {contract.capability} by the producer"
        config = source.index.config
        unknown = sorted(set(config) - set(Config.FIELDS))
        if unknown:
            return (
                Capability.UNSUPPORTED,
                f"config key(s) {', '.join(unknown)} not understood by this engine",
            )
        if source.index.identity.cp != 1:
            return Capability.UNSUPPORTED, "context parallelism cp != 1 is not supported"
        reason = _unreplayable(stage, config)
        if reason:
            return Capability.UNSUPPORTED, reason
        return Capability.RECOMPUTE, ""

    return check


def _unreplayable(stage: Stage, config: Mapping[str, Any]) -> str | None:
    """Why this stage cannot replay this config (None: it can)."""
    estimator = config.get("advantage_estimator") or "grpo"
    if stage in (Stage.REWARD_POST_PROCESS, Stage.ADVANTAGE_ESTIMATE) and estimator != "grpo":
        return f"advantage_estimator {estimator!r} is not recomputed (grpo only)"
    if stage == Stage.REWARD_POST_PROCESS:
        aggregation = config.get("reward_aggregation") or "sum_then_normalize"
        if aggregation != "sum_then_normalize":
            return f"reward_aggregation {aggregation!r} is not replayed (sum_then_normalize only)"
        scale = config.get("reward_scale")
        if scale is not None and scale not in REWARD_SCALES:
            return f"reward_scale {scale!r} is not one of {', '.join(REWARD_SCALES)}"
        order = config.get("reward_sum_order")
        if order is not None and order not in REWARD_SUM_ORDERS:
            return f"reward_sum_order {order!r} is not one of {', '.join(REWARD_SUM_ORDERS)}"
    if stage == Stage.ADVANTAGE_KL and not config.get("use_kl_loss"):
        return "use_kl_loss is off: no loss-side KL to check"
    if stage != Stage.LOSS_POLICY:
        return None
    policy = config.get("policy_loss")
    if policy is None:
        return "loss-family config without policy_loss: the loss is not determined"
    if policy in UNREPLAYABLE_LOSSES:
        return UNREPLAYABLE_LOSSES[policy]
    if policy not in POLICY_LOSSES:
        return f"policy_loss {policy!r} is not one of {', '.join(POLICY_LOSSES)}"
    level = config.get("importance_sampling_level") or "token"
    if level not in IS_LEVELS:
        return f"importance_sampling_level {level!r} is not token or sequence"
    correction = config.get("is_correction")
    if correction is not None and correction not in IS_CORRECTIONS:
        return f"is_correction {correction!r} is not one of {', '.join(IS_CORRECTIONS)}"
    if config.get("kl_loss_type") not in (None, "k3", "low_var_kl") and config.get("use_kl_loss"):
        return f"kl_loss_type {config.get('kl_loss_type')!r}: the family's KL is k3"
    if config.get("eps_clip_c") is not None:
        return "eps_clip_c (dual clip) is not part of the loss family"
    return None


# --------------------------------------------------------------------------- registration

for _stage, _run, _inputs in (
    (
        Stage.REWARD_RAW,
        stage_reward_raw,
        ("expected.reward.raw.rewards_per_func", "config.reward_weights"),
    ),
    (
        Stage.REWARD_POST_PROCESS,
        stage_reward_post_process,
        (
            "raw_rewards",
            "index.samples.group_index",
            "config.reward_scale",
            "config.reward_std_eps",
            "config.reward_sum_order",
        ),
    ),
    (
        Stage.ADVANTAGE_KL,
        stage_loss_kl,
        (
            Payload.LOG_PROBS,
            Payload.REF_LOG_PROBS,
            Payload.OLD_LOG_PROBS,
            "index.samples.loss_mask",
            "config.use_unbiased_kl",
            "config.importance_sampling_level",
        ),
    ),
    (
        Stage.ADVANTAGE_ESTIMATE,
        v1.stage_advantage_estimate,
        ("rewards", "index.samples.response_length"),
    ),
    (
        Stage.LOSS_POLICY,
        stage_loss_policy,
        (
            Payload.OLD_LOG_PROBS,
            Payload.LOG_PROBS,
            Payload.ADVANTAGES,
            Payload.ENTROPY,
            Payload.REF_LOG_PROBS,
            Payload.ROLLOUT_LOG_PROBS,
            "index.samples.loss_mask",
            "index.samples.micro_batch_id",
            "expected.loss.policy.micro_batches",
        ),
    ),
):
    register_variant(
        StageVariant(
            stage=_stage,
            name=FAMILY,
            applies=uses_family,
            run=_run,
            capability=family_capability(_stage),
            version=FAMILY_VERSION,
            inputs=_inputs,
        )
    )
