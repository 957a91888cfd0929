"""verl's math as stage variants: the bundles verl's capture writes (``config.verl``).

Why variants: verl computes the links of the chain with its own formulas and settings,
read from ``config.verl`` (`trajstore.integrations.verl.records.algorithm_config`). This is
an independent transcription of verl 0.9.1 (``verl.trainer.ppo.ray_trainer`` and
``core_algos``, ``verl.workers.utils.losses.ppo_loss``, ``rollout_corr_helper``) on flat
per-sample arrays; it imports neither verl nor torch:

- advantage.kl (rollout bundle): ``apply_kl_penalty``: ``token_level_rewards =
  token_level_scores - beta * kl_penalty(old_log_probs, ref_log_prob, kl_penalty) * mask``
  with ``beta`` the coefficient applied this step (``kl_coef_applied``); without
  ``use_kl_in_reward`` the rewards are the scores. The KL verl measured
  (``actor/reward_kl_penalty``) is compared when recorded.
- advantage.estimate (rollout bundle): ``compute_advantage`` for gae (needs ``values``),
  grpo, grpo_passk, rloo, opo, gpg, reinforce_plus_plus(_baseline) and remax (needs
  ``reward_baselines``), groups from ``uid`` (``group_index``); advantages and returns.
- loss.policy (step bundles): per micro-batch, the policy loss of ``loss_mode`` (vanilla
  with dual-clip, gspo, gpg, kl_cov, geo_mean, sapo, cispo, dppo_tv, dppo_kl, dro) times the
  rollout importance-sampling weights, aggregated by ``loss_agg_mode`` with the global batch
  info verl divided by, minus ``entropy_coeff`` times the entropy loss, plus ``kl_loss_coef``
  times the KL loss; each micro-batch's loss, pg_loss, pg_clipfrac, ppo_kl,
  pg_clipfrac_lower, entropy_loss and kl_loss compared. The rollout IS weights are
  recomputed from old and rollout log-probs where a micro-batch allows it.

Not replayable, by name: clip_cov and bypass_mode losses (clip_cov picks tokens with
``torch.randperm``), the vectorized / optimal-token-baseline / gdpo estimators, pf_ppo
reweighting, the KL in reward under an adaptive controller whose applied coefficient was not
captured. Element-wise math in float32 as verl's tensors, reductions in float64 rounded once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from trajstore.replay.compare import compare_arrays
from trajstore.replay.context import (
    ReplayContext,
    StageInputError,
    StageOutcome,
    is_number,
    outcome_of,
)
from trajstore.replay.losses import MicroBatch, row_sums, scalar_comparer
from trajstore.replay.registry import CapabilityCheck, StageVariant, register_variant
from trajstore.replay.source import BundleSource
from trajstore.vocab import Capability, Payload, Stage, StageStatus

#: the config key that selects these variants, their name and version
KEY = "verl"
VERSION = "verl-v1"
#: verl's advantage estimators that replay transcribes (``algorithm.adv_estimator``)
ESTIMATORS: tuple[str, ...] = (
    *("gae", "grpo", "grpo_passk", "rloo", "opo", "gpg"),
    *("reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"),
)
UNREPLAYABLE_ESTIMATORS: dict[str, str] = {
    "grpo_vectorized": "adv_estimator 'grpo_vectorized' is not transcribed (use grpo)",
    "rloo_vectorized": "adv_estimator 'rloo_vectorized' is not transcribed (use rloo)",
    "optimal_token_baseline": "adv_estimator 'optimal_token_baseline' needs sum_pi_squared, "
    "which the driver batch capture does not keep",
    "tir_optimal_token_baseline": "adv_estimator 'tir_optimal_token_baseline' needs "
    "sum_pi_squared, which the driver batch capture does not keep",
    "gdpo": "adv_estimator 'gdpo' reads per-dimension rewards outside the batch's tensors",
}
KL_PENALTIES: tuple[str, ...] = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
LOSS_MODES: tuple[str, ...] = (
    "vanilla",
    "gspo",
    "gpg",
    "kl_cov",
    "geo_mean",
    "sapo",
    "cispo",
    "dppo_tv",
    "dppo_kl",
    "dro",
)
UNREPLAYABLE_LOSS_MODES: dict[str, str] = {
    "clip_cov": "loss_mode 'clip_cov' picks the tokens it clips with torch.randperm "
    "(random): not replayable",
    "bypass_mode": "loss_mode 'bypass_mode' (rollout correction bypass) is not transcribed",
}
AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
)
#: the per-micro-batch values verl's loss logs that replay recomputes
LOSS_FIELDS: tuple[str, ...] = (
    "loss",
    "pg_loss",
    "pg_clipfrac",
    "ppo_kl",
    "pg_clipfrac_lower",
    "entropy_loss",
    "kl_loss",
)
GRPO_EPS = 1e-6
MASK_EPS = 1e-8
IS_SAFETY_BOUND = 20.0


def uses_verl(source: BundleSource) -> bool:
    return isinstance(source.index.config.get(KEY), dict)


def linkage_unsupported(config: Mapping[str, Any]) -> str | None:
    """Why the rollout linkage (a step's advantages = its rollout's rewards on every token)
    does not apply: verl's advantages are recomputed in the rollout bundle itself."""
    if isinstance(config.get(KEY), dict):
        return (
            "verl: a step's advantages are not its rollout's rewards on every token; "
            f"{Stage.ADVANTAGE_ESTIMATE} replays them in the rollout bundle"
        )
    return None


def _args(source: BundleSource) -> Mapping[str, Any]:
    return source.index.config[KEY]


def _f32(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


# --------------------------------------------------------------------------- kernels


def masked_mean(values: np.ndarray, mask: np.ndarray) -> float:
    """verl's ``masked_mean`` over everything: ``sum(values * mask) / (sum(mask) + 1e-8)``."""
    kept = np.where(mask != 0, values, 0.0).astype(np.float64)
    return float(np.float32((kept * mask).sum() / (float(mask.sum()) + MASK_EPS)))


def masked_whiten(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """verl's ``masked_whiten`` (shift_mean): ``(v - mean) * rsqrt(unbiased var + 1e-8)``."""
    m = mask.astype(np.float64)
    count = m.sum()
    if count < 2:
        raise StageInputError("masked_whiten over fewer than 2 loss tokens (verl raises)")
    v = values.astype(np.float64)
    mean = (np.where(m != 0, v, 0.0) * m).sum() / (count + MASK_EPS)
    centred = (v - np.float32(mean)) ** 2
    var = (np.where(m != 0, centred, 0.0) * m).sum() / (count + MASK_EPS) * count / (count - 1)
    scale = np.float32(1.0 / math.sqrt(float(np.float32(var)) + MASK_EPS))
    return ((_f32(values) - np.float32(mean)) * scale).astype(np.float32)


def kl_penalty(log_probs: np.ndarray, ref_log_probs: np.ndarray, kind: str) -> np.ndarray:
    """``core_algos.kl_penalty`` (the forward value; a ``+`` suffix changes gradients only)."""
    base = kind[:-1] if kind.endswith("+") else kind
    lp, ref = _f32(log_probs), _f32(ref_log_probs)
    if base in ("kl", "k1"):
        return lp - ref
    if base == "abs":
        return np.abs(lp - ref)
    if base in ("mse", "k2"):
        return (np.float32(0.5) * (lp - ref) ** 2).astype(np.float32)
    if base in ("low_var_kl", "k3"):
        kl = np.clip(ref - lp, np.float32(-20), np.float32(20))
        return np.clip(np.exp(kl) - kl - np.float32(1), np.float32(-10), np.float32(10))
    raise StageInputError(f"kl_penalty {kind!r} is not one of {', '.join(KL_PENALTIES)}")


def agg_loss(
    loss: np.ndarray,
    mask: np.ndarray,
    lengths: np.ndarray,
    mode: str,
    info: Mapping[str, Any],
) -> float:
    """``core_algos.agg_loss`` of one micro-batch with its ``global_batch_info``."""
    dp = float(info.get("dp_size") or 1)
    kept = np.where(mask != 0, loss, 0.0).astype(np.float64) * mask
    if mode == "token-mean":
        tokens = info.get("batch_num_tokens")
        tokens = float(mask.sum()) if tokens is None else float(tokens)
        return float(np.float32(kept.sum() / tokens * dp))
    if mode == "token-sum":
        return float(np.float32(kept.sum() * dp))
    counts = row_sums(mask, lengths)
    seq = row_sums(kept, lengths)
    if mode == "seq-mean-token-mean":
        seq = np.float32(seq) / (np.float32(counts) + np.float32(MASK_EPS))
    seq_mask = (counts > 0).astype(np.float64)
    size = info.get("global_batch_size")
    size = seq_mask.sum() if size is None else float(size)
    out = (np.asarray(seq, dtype=np.float64) * seq_mask).sum() / size * dp
    if mode == "seq-mean-token-sum-norm":
        factor = info.get("loss_scale_factor")
        out /= float(info["horizon"] if factor is None else factor)
    elif mode not in ("seq-mean-token-sum", "seq-mean-token-mean"):
        raise StageInputError(f"loss_agg_mode {mode!r} is not one of {', '.join(AGG_MODES)}")
    return float(np.float32(out))


def rollout_is_weights(
    old_log_probs: np.ndarray,
    rollout_log_probs: np.ndarray,
    mask: np.ndarray,
    lengths: np.ndarray,
    level: str,
    threshold: Any,
) -> np.ndarray:
    """``rollout_corr_helper.compute_rollout_correction_weights`` without batch
    normalization: token or sequence ratios of old vs rollout log-probs, zeroed on masked
    tokens, truncated at the upper bound (TIS) or zeroed outside ``lower_upper`` (IcePop)."""
    upper, lower = parse_threshold(threshold)
    log_ratio = _f32(old_log_probs) - _f32(rollout_log_probs)
    if level == "token":
        raw = np.exp(np.clip(log_ratio, np.float32(-IS_SAFETY_BOUND), np.float32(IS_SAFETY_BOUND)))
    else:
        sums = row_sums(np.where(mask != 0, log_ratio, 0.0) * mask, lengths).astype(np.float32)
        sums = np.clip(sums, np.float32(-IS_SAFETY_BOUND), np.float32(IS_SAFETY_BOUND))
        raw = np.repeat(np.exp(sums), lengths)
    raw = (raw * mask).astype(np.float32)
    if lower is None:
        return np.minimum(raw, np.float32(upper))
    keep = (raw >= np.float32(lower)) & (raw <= np.float32(upper))
    return np.where(keep, raw, np.float32(0.0)).astype(np.float32)


def parse_threshold(spec: Any) -> tuple[float, float | None]:
    """``_parse_rollout_is_threshold``: a float upper bound, or ``"lower_upper"``."""
    if isinstance(spec, str) and "_" in spec:
        low, high = spec.strip().split("_", 1)
        return float(high), float(low)
    return float(spec), None


# --------------------------------------------------------------------------- estimators


def _groups(group_index: list[Any], sample_ids: list[str]) -> dict[int, list[int]]:
    members: dict[int, list[int]] = {}
    for pos, g in enumerate(group_index):
        if not isinstance(g, int) or isinstance(g, bool):
            raise StageInputError(f"sample {sample_ids[pos]!r} has no integer group_index (uid)")
        members.setdefault(g, []).append(pos)
    return members


def _std(values: np.ndarray) -> np.float32:
    """``torch.std`` (Bessel) in float32, float64 sums."""
    v = values.astype(np.float64)
    return np.float32(math.sqrt(((v - v.mean()) ** 2).sum() / (v.size - 1)))


@dataclass
class Batch:
    """The rollout bundle's arrays the estimators read (flat per token, in sample order)."""

    rewards: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray
    groups: list[Any]
    sample_ids: list[str]
    values: np.ndarray | None = None
    baselines: np.ndarray | None = None


def _outcome(per_row: np.ndarray, b: Batch) -> np.ndarray:
    return (np.repeat(_f32(per_row), b.lengths) * b.mask).astype(np.float32)


def _discounted(b: Batch, gamma: float) -> np.ndarray:
    """reinforce_plus_plus's returns: masked tokens carry the running return unchanged."""
    out = np.zeros_like(b.rewards)
    starts = np.cumsum(b.lengths) - b.lengths
    g = np.float32(gamma)
    for start, length in zip(starts, b.lengths, strict=True):
        running = np.float32(0.0)
        for t in range(start + length - 1, start - 1, -1):
            new = b.rewards[t] + g * running
            out[t] = new * b.mask[t]
            running = new * b.mask[t] + running * (np.float32(1) - b.mask[t])
    return out


def estimate(b: Batch, args: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(advantages, returns) of ``compute_advantage`` for ``args['adv_estimator']``."""
    name = args.get("adv_estimator")
    scores = row_sums(b.rewards, b.lengths).astype(np.float32)
    norm = bool(args.get("norm_adv_by_std_in_grpo", True))
    if name == "gae":
        if b.values is None:
            raise StageInputError("incomplete bundle: gae needs payload 'values'")
        gamma, lam = np.float32(args.get("gamma", 1.0)), np.float32(args.get("lam", 1.0))
        raw = np.zeros_like(b.rewards)
        starts = np.cumsum(b.lengths) - b.lengths
        one = np.float32(1.0)
        for start, length in zip(starts, b.lengths, strict=True):
            nextvalue, lastgaelam = np.float32(0.0), np.float32(0.0)
            for t in range(start + length - 1, start - 1, -1):
                m, v = b.mask[t], b.values[t]
                delta = b.rewards[t] + gamma * nextvalue - v
                candidate = delta + gamma * lam * lastgaelam
                nextvalue = v * m + (one - m) * nextvalue
                lastgaelam = candidate * m + (one - m) * lastgaelam
                raw[t] = lastgaelam
        returns = (raw + b.values).astype(np.float32)
        return masked_whiten(raw, b.mask), returns
    if name == "reinforce_plus_plus":
        returns = _discounted(b, float(args.get("gamma", 1.0)))
        return (masked_whiten(returns, b.mask) * b.mask).astype(np.float32), returns
    if name == "remax":
        if b.baselines is None:
            raise StageInputError(
                "incomplete bundle: remax needs expected.json advantage.estimate.reward_baselines"
            )
        masked = (b.rewards * b.mask).astype(np.float32)
        returns = np.zeros_like(masked)
        starts = np.cumsum(b.lengths) - b.lengths
        for start, length in zip(starts, b.lengths, strict=True):
            seg = masked[start : start + length].astype(np.float64)
            returns[start : start + length] = np.cumsum(seg[::-1])[::-1]
        advantages = returns - np.repeat(_f32(b.baselines), b.lengths) * b.mask
        return advantages.astype(np.float32), returns
    members = _groups(b.groups, b.sample_ids)
    out = np.zeros_like(scores)
    if name in ("grpo", "gpg", "reinforce_plus_plus_baseline", "rloo"):
        alpha = np.float32(scores.size / max(int(np.count_nonzero(scores)), 1))
        for rows in members.values():
            s = scores[rows]
            n = len(rows)
            mean = np.float32(0.0) if n == 1 else np.float32(s.astype(np.float64).mean())
            if name == "grpo":
                std = np.float32(1.0) if n == 1 else _std(s)
                centred = s - mean
                out[rows] = centred / (std + np.float32(GRPO_EPS)) if norm else centred
            elif name == "gpg":
                out[rows] = alpha * (s - mean) / np.float32(1.0)
            elif name == "rloo":
                f = np.float32(n) / np.float32(n - 1) if n > 1 else None
                out[rows] = s if f is None else s * f - mean * f
            else:
                out[rows] = s - mean
        if name == "reinforce_plus_plus_baseline":
            tokens = _outcome(out, b)
            advantages = (masked_whiten(tokens, b.mask) * b.mask).astype(np.float32)
            return advantages, advantages
        advantages = _outcome(out, b)
        return advantages, advantages
    if name == "opo":
        lengths = row_sums(b.mask, b.lengths).astype(np.float32)
        for rows in members.values():
            s = scores[rows]
            if len(rows) == 1:
                out[rows] = s
                continue
            weight = lengths[rows].astype(np.float64)
            baseline = np.float32((weight * s).sum() / weight.sum())
            out[rows] = s - baseline
        advantages = _outcome(out, b)
        return advantages, advantages
    if name == "grpo_passk":
        for group, rows in members.items():
            s = scores[rows]
            if len(rows) < 2:
                raise StageInputError(f"grpo_passk group g-{group} has fewer than 2 samples")
            order = np.argsort(-s.astype(np.float64), kind="stable")
            advantage = s[order[0]] - s[order[1]]
            if norm:
                advantage = advantage / (_std(s) + np.float32(GRPO_EPS))
            out[rows[int(order[0])]] = advantage
        advantages = _outcome(out, b)
        return advantages, advantages
    raise StageInputError(f"adv_estimator {name!r} is not replayed")


# --------------------------------------------------------------------------- the loss


def _clip_ratios(args: Mapping[str, Any]) -> tuple[np.float32, np.float32]:
    clip = float(args.get("clip_ratio", 0.2))
    low = args.get("clip_ratio_low")
    high = args.get("clip_ratio_high")
    return np.float32(clip if low is None else low), np.float32(clip if high is None else high)


def policy_loss(mb: MicroBatch, args: Mapping[str, Any]) -> dict[str, float]:
    """``get_policy_loss_fn(loss_mode)``'s pg_loss and metrics for one micro-batch."""
    mode = str(args.get("loss_mode") or "vanilla")
    agg = str(args.get("loss_agg_mode", "token-mean"))
    lp, old, adv, mask = _f32(mb.log_probs), _f32(mb.old_log_probs), _f32(mb.advantages), mb.mask
    one = np.float32(1.0)
    low, high = _clip_ratios(args)
    extra = args.get("policy_loss") or {}
    nak = lp - old
    nak_clamped = np.clip(nak, np.float32(-20.0), np.float32(20.0))
    metrics: dict[str, float] = {}
    lengths = mb.lengths

    def weighted(losses: np.ndarray) -> np.ndarray:
        return losses if mb.is_weights is None else (losses * mb.is_weights).astype(np.float32)

    if mode == "vanilla":
        ratio = np.exp(nak_clamped)
        c = np.float32(args.get("clip_ratio_c", 3.0))
        l1 = -adv * ratio
        l2 = -adv * np.clip(ratio, one - low, one + high)
        c1 = np.maximum(l1, l2)
        l3 = -adv * c
        c2 = np.minimum(l3, c1)
        losses = np.where(adv < 0, c2, c1)
        metrics["pg_clipfrac"] = masked_mean((l2 > l1).astype(np.float32), mask)
        metrics["ppo_kl"] = masked_mean(-nak_clamped, mask)
        metrics["pg_clipfrac_lower"] = masked_mean(((c1 > l3) & (adv < 0)).astype(np.float32), mask)
    elif mode == "gspo":
        counts = np.maximum(row_sums(mask, lengths), 1.0).astype(np.float32)
        seq = row_sums(nak * mask, lengths).astype(np.float32) / counts
        log_ratio = np.minimum((lp - lp) + np.repeat(seq, lengths), np.float32(10.0))
        ratio = np.exp(log_ratio)
        l1 = -adv * ratio
        l2 = -adv * np.clip(ratio, one - low, one + high)
        losses = np.maximum(l1, l2)
        metrics["pg_clipfrac"] = masked_mean((l2 > l1).astype(np.float32), mask)
        metrics["ppo_kl"] = masked_mean(-nak, mask)
        metrics["pg_clipfrac_lower"] = 0.0
    elif mode == "sapo":
        ratio = np.exp(nak_clamped)
        taus = np.where(adv > 0, np.float32(args["tau_pos"]), np.float32(args["tau_neg"]))
        gates = (one / (one + np.exp(-(taus * (ratio - one))))) * (np.float32(4.0) / taus)
        losses = (-gates * adv).astype(np.float32)
        agg = "seq-mean-token-mean"  # verl's sapo aggregates so whatever loss_agg_mode says
        metrics["pg_clipfrac"] = 0.0
        metrics["ppo_kl"] = masked_mean(-nak_clamped, mask)
        metrics["pg_clipfrac_lower"] = 0.0
    elif mode == "gpg":
        losses = -lp * adv
    elif mode == "kl_cov":
        ratio = np.exp(nak)
        coef = extra.get("ppo_kl_coef")
        coef = np.float32(1.0 if coef is None else coef)
        kl_ratio = extra.get("kl_cov_ratio")
        kl_ratio = 0.0002 if kl_ratio is None else float(kl_ratio)
        losses = (-adv * ratio).astype(np.float32)
        with_kl = (-adv * ratio + coef * np.abs(nak)).astype(np.float32)
        valid = np.flatnonzero(mask > 0)
        if valid.size and kl_ratio != 0:
            a, p = adv[valid], lp[valid]
            cov = (a - np.float32(a.astype(np.float64).mean())) * (
                p - np.float32(p.astype(np.float64).mean())
            )
            count = max(1, int(valid.size * kl_ratio))
            top = valid[np.argsort(-cov.astype(np.float64), kind="stable")[:count]]
            losses[top] = with_kl[top]
        metrics["ppo_kl"] = masked_mean(np.abs(nak), mask)
    elif mode == "geo_mean":
        sign = np.sign(adv)
        clamped = np.clip(nak, -low, high)
        kept = sign * np.minimum(sign * nak, sign * clamped)
        counts = row_sums(mask, lengths).astype(np.float32) + np.float32(MASK_EPS)
        ratio = np.exp(row_sums(kept * mask, lengths).astype(np.float32) / counts)
        advantage = row_sums(adv * mask, lengths).astype(np.float32) / counts
        rows = -advantage * ratio
        if mb.is_weights is not None:
            logs = np.log(mb.is_weights + np.float32(1e-10)) * mask
            rows = rows * np.exp(row_sums(logs, lengths).astype(np.float32) / counts)
        clipped = (nak != clamped).astype(np.float32)
        metrics["pg_clipfrac"] = masked_mean(clipped * (adv > 0), mask)
        metrics["ppo_kl"] = masked_mean(-nak, mask)
        metrics["pg_clipfrac_lower"] = masked_mean(clipped * (adv < 0), mask)
        metrics["pg_loss"] = float(np.float32(np.asarray(rows, dtype=np.float64).mean()))
        return metrics  # geo_mean averages its sequences: no loss_agg_mode
    elif mode == "dro":
        beta = extra.get("dro_beta")
        if beta is None or beta <= 0:
            raise StageInputError("policy_loss.dro_beta must be positive for loss_mode dro")
        losses = -(lp * adv - np.float32(0.5) * np.float32(beta) * nak * nak)
        metrics["ppo_kl"] = masked_mean(-nak, mask)
    elif mode == "cispo":
        ratio = np.exp(nak_clamped)
        clipped = np.clip(ratio, one - low, one + high)
        losses = -clipped * adv * lp
        metrics["pg_clipfrac"] = masked_mean((ratio != clipped).astype(np.float32), mask)
        metrics["ppo_kl"] = masked_mean(-nak_clamped, mask)
        metrics["pg_clipfrac_lower"] = 0.0
    elif mode in ("dppo_tv", "dppo_kl"):
        ratio = np.exp(nak_clamped)
        c = np.float32(args.get("clip_ratio_c", 20.0))
        truncated = np.minimum(ratio, c)
        prob, old_prob = np.exp(lp), np.exp(old)
        if mode == "dppo_tv":
            positive = (prob - old_prob) <= high
            negative = (prob - old_prob) >= -low
        else:
            eps = np.float32(1e-8)
            binary = old_prob * (old - lp) + (one - old_prob) * np.log(
                (one - old_prob + eps) / (one - prob + eps)
            )
            positive = (binary <= high) | (prob <= old_prob)
            negative = (binary <= low) | (prob >= old_prob)
        valid = np.where(adv > 0, positive, negative).astype(np.float32)
        losses = -adv * truncated * lp * valid
        metrics["pg_clipfrac"] = masked_mean(one - valid, mask)
        metrics["ppo_kl"] = masked_mean(-nak_clamped, mask)
        metrics["pg_clipfrac_lower"] = masked_mean((ratio > c).astype(np.float32) * valid, mask)
    else:
        raise StageInputError(f"loss_mode {mode!r} is not replayed")
    metrics["pg_loss"] = agg_loss(weighted(_f32(losses)), mask, lengths, agg, mb.info)
    return metrics


def micro_batch_loss(mb: MicroBatch, args: Mapping[str, Any]) -> dict[str, float]:
    """``verl.workers.utils.losses.ppo_loss`` for one micro-batch: the policy loss, minus
    ``entropy_coeff`` times the entropy loss (when verl computed entropy), plus
    ``kl_loss_coef`` times the KL loss (``use_kl_loss``); and their parts."""
    out = policy_loss(mb, args)
    agg = str(args.get("loss_agg_mode", "token-mean"))
    loss = np.float32(out["pg_loss"])
    if mb.entropy is not None:
        entropy_loss = agg_loss(_f32(mb.entropy), mb.mask, mb.lengths, agg, mb.info)
        out["entropy_loss"] = entropy_loss
        loss = loss - np.float32(args.get("entropy_coeff", 0.0)) * np.float32(entropy_loss)
    if args.get("use_kl_loss"):
        if mb.ref_log_probs is None:
            raise StageInputError(
                f"incomplete bundle: payload '{Payload.REF_LOG_PROBS}' is missing"
            )
        kld = kl_penalty(
            mb.log_probs, mb.ref_log_probs, str(args.get("kl_loss_type", "low_var_kl"))
        )
        kl_loss = agg_loss(kld, mb.mask, mb.lengths, agg, mb.info)
        out["kl_loss"] = kl_loss
        loss = loss + np.float32(kl_loss) * np.float32(args.get("kl_loss_coef", 0.0))
    out["loss"] = float(loss)
    return out


# --------------------------------------------------------------------------- capability


def verl_capability(stage: Stage) -> CapabilityCheck:
    def check(source: BundleSource) -> tuple[Capability, str]:
        contract = source.manifest.stage_contracts.get(stage)
        if stage in (Stage.REWARD_RAW, Stage.REWARD_POST_PROCESS):
            reason = (
                "verl's reward function output (token_level_scores) is the record; its "
                "KL in reward is replayed in advantage.kl"
            )
            return (Capability.UNSUPPORTED if contract else Capability.SKIPPED), reason
        if stage == Stage.LOSS_VALUE:
            return Capability.UNSUPPORTED, (
                "verl's critic update (value loss) is not captured: capture records the actor"
            )
        if contract is None:
            return Capability.SKIPPED, "not in this bundle's stage contracts"
        if contract.capability != Capability.RECOMPUTE:
            return Capability.SKIPPED, f"declared {contract.capability} by the producer"
        if source.index.identity.cp != 1:
            return Capability.UNSUPPORTED, "context parallelism cp != 1 is not supported"
        reason = unreplayable(stage, _args(source))
        if reason:
            return Capability.UNSUPPORTED, reason
        return Capability.RECOMPUTE, ""

    return check


def unreplayable(stage: Stage, args: Mapping[str, Any]) -> str | None:
    """Why this stage cannot replay these verl settings (None: it can)."""
    if stage == Stage.ADVANTAGE_KL and args.get("use_kl_in_reward"):
        kind = str(args.get("kl_penalty"))
        if kind.rstrip("+") not in KL_PENALTIES:
            return f"kl_penalty {kind!r} is not one of {', '.join(KL_PENALTIES)}"
        if args.get("kl_coef_applied") is None:
            return (
                "the KL-in-reward coefficient applied this step was not captured "
                f"(kl_ctrl {args.get('kl_ctrl_type')!r}: pass kl_coef= or the step's metrics)"
            )
    if stage == Stage.ADVANTAGE_ESTIMATE:
        name = str(args.get("adv_estimator"))
        if name in UNREPLAYABLE_ESTIMATORS:
            return UNREPLAYABLE_ESTIMATORS[name]
        if name not in ESTIMATORS:
            return f"adv_estimator {name!r} is not one of {', '.join(ESTIMATORS)}"
        if args.get("use_pf_ppo"):
            return "use_pf_ppo resamples the batch after the advantages: not replayed"
    if stage == Stage.LOSS_POLICY:
        mode = str(args.get("loss_mode") or "vanilla")
        if mode in UNREPLAYABLE_LOSS_MODES:
            return UNREPLAYABLE_LOSS_MODES[mode]
        if mode not in LOSS_MODES:
            return f"loss_mode {mode!r} is not one of {', '.join(LOSS_MODES)}"
        agg = str(args.get("loss_agg_mode"))
        if agg not in AGG_MODES:
            return f"loss_agg_mode {agg!r} is not one of {', '.join(AGG_MODES)}"
        if (
            args.get("use_kl_loss")
            and str(args.get("kl_loss_type")).rstrip("+") not in KL_PENALTIES
        ):
            return (
                f"kl_loss_type {args.get('kl_loss_type')!r} is not one of {', '.join(KL_PENALTIES)}"
            )
    return None


def _unreplayed(ctx: ReplayContext) -> StageOutcome:
    """Never called: the capability of these stages is never `recompute` on verl data."""
    raise StageInputError("this stage is not replayed for verl bundles")


# --------------------------------------------------------------------------- stages


def stage_advantage_kl(ctx: ReplayContext) -> StageOutcome:
    """``apply_kl_penalty``: token_level_rewards from token_level_scores (and the KL)."""
    stage = Stage.ADVANTAGE_KL
    args = _args(ctx.source)
    scores = _f32(ctx.payload(Payload.TOKEN_LEVEL_SCORES))
    mask = ctx.mask()
    comparisons = []
    if args.get("use_kl_in_reward"):
        kld = kl_penalty(
            ctx.payload(Payload.OLD_LOG_PROBS),
            ctx.payload(Payload.REF_LOG_PROBS),
            str(args["kl_penalty"]),
        )
        kld = (kld * mask).astype(np.float32)
        actual = (scores - np.float32(args["kl_coef_applied"]) * kld).astype(np.float32)
        measured = ctx.source.expected.get(stage, {})
        recorded = isinstance(measured, dict) and is_number(measured.get("reward_kl_penalty"))
        if recorded and not ctx.partial:  # verl's mean is over the whole batch
            counts = row_sums(mask, ctx.lengths) + MASK_EPS
            per_row = row_sums(kld * mask, ctx.lengths) / counts
            atol, rtol = ctx.tolerance(stage)
            comparisons.append(
                compare_arrays(
                    stage,
                    "reward_kl_penalty",
                    np.array([float(measured["reward_kl_penalty"])]),
                    np.array([float(np.float32(per_row.mean()))]),
                    atol=atol,
                    rtol=rtol,
                )
            )
    else:
        actual = scores
    ctx.recomputed["token_level_rewards"] = actual
    expected = ctx.payload(Payload.TOKEN_LEVEL_REWARDS)
    comparisons.insert(
        0, ctx.compare(stage, Payload.TOKEN_LEVEL_REWARDS, expected, actual, per_token=True)
    )
    return outcome_of(
        stage,
        comparisons,
        "{n} token_level_rewards token(s) diverged (max_abs_error={err:.3e}, mismatches={n})",
    )


def stage_advantage_estimate(ctx: ReplayContext) -> StageOutcome:
    """``compute_advantage``: advantages and returns from token_level_rewards and groups."""
    stage = Stage.ADVANTAGE_ESTIMATE
    args = _args(ctx.source)
    if ctx.partial:
        return StageOutcome(
            stage=stage,
            status=StageStatus.SKIPPED,
            reason="verl's estimators normalize over groups or the whole batch; "
            "not under a selection",
        )
    rewards = ctx.recomputed.get("token_level_rewards")
    if rewards is None:
        rewards = ctx.payload(Payload.TOKEN_LEVEL_REWARDS)
    record = ctx.source.expected.get(stage, {})
    baselines = record.get("reward_baselines") if isinstance(record, dict) else None
    if baselines is not None:
        if not isinstance(baselines, list) or len(baselines) != len(ctx.samples):
            raise StageInputError(
                f"expected.json {stage}.reward_baselines must list one number per sample"
            )
        baselines = np.asarray(baselines, dtype=np.float32)
    batch = Batch(
        rewards=_f32(rewards),
        mask=ctx.mask(),
        lengths=ctx.lengths,
        groups=[sample.group_index for sample in ctx.samples],
        sample_ids=ctx.sample_ids,
        values=_f32(ctx.payload(Payload.VALUES)) if ctx.has_payload(Payload.VALUES) else None,
        baselines=baselines,
    )
    advantages, returns = estimate(batch, args)
    ctx.recomputed["advantages"] = advantages
    comparisons = ctx.compare_advantages(stage, advantages, returns)
    return outcome_of(
        stage,
        comparisons,
        "{n} advantage/return token(s) diverged (max_abs_error={err:.3e}, mismatches={n})",
    )


def _recorded(ctx: ReplayContext) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    stage = Stage.LOSS_POLICY
    record = ctx.source.expected.get(stage)
    if not isinstance(record, dict):
        raise StageInputError(f"incomplete bundle: expected.json {stage} is missing")
    batches = record.get("micro_batches")
    if not isinstance(batches, dict) or not all(isinstance(v, dict) for v in batches.values()):
        raise StageInputError(f"expected.json {stage}.micro_batches must map ids to objects")
    for mb_id, fields in batches.items():
        for name in ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor"):
            value = fields.get(name)
            if value is not None and not (is_number(value) and value > 0):
                raise StageInputError(
                    f"expected.json {stage}.micro_batches[{mb_id!r:.40}].{name} is "
                    f"{value!r:.40}, not a number above 0"
                )
    return record, batches


def stage_loss_policy(ctx: ReplayContext) -> StageOutcome:
    """Each micro-batch's loss and logged parts, and the step's sums."""
    stage = Stage.LOSS_POLICY
    args = _args(ctx.source)
    record, recorded = _recorded(ctx)
    order: dict[str, list[int]] = {}
    for pos, sample in enumerate(ctx.samples):
        order.setdefault(sample.micro_batch_id or "mb-0000", []).append(pos)
    mask = ctx.mask()
    columns = {
        "log_probs": ctx.payload(Payload.LOG_PROBS),
        "old_log_probs": ctx.payload(Payload.OLD_LOG_PROBS),
        "advantages": ctx.payload(Payload.ADVANTAGES),
    }
    optional = {
        "entropy": Payload.ENTROPY,
        "ref_log_probs": Payload.REF_LOG_PROBS,
        "rollout_log_probs": Payload.ROLLOUT_LOG_PROBS,
        "is_weights": Payload.ROLLOUT_IS_WEIGHTS,
    }
    for name, payload in optional.items():
        if ctx.has_payload(payload):
            columns[name] = ctx.payload(payload)
    correction = args.get("rollout_correction") or {}
    level = correction.get("rollout_is")
    recompute_is = (
        "is_weights" in columns
        and "rollout_log_probs" in columns
        and level in ("token", "sequence")
        and correction.get("rollout_is_threshold") is not None
        and not correction.get("rollout_is_batch_normalize")
        and not correction.get("rollout_rs")
    )
    compare = scalar_comparer(ctx, stage)

    comparisons: list[Any] = []
    trusted: list[str] = []
    results: dict[str, dict[str, float]] = {}
    for mb_id, positions in order.items():
        index = np.concatenate(
            [np.arange(ctx.offsets[p], ctx.offsets[p + 1]) for p in positions]
        ).astype(np.int64)
        lengths = ctx.lengths[positions]
        parts = {name: values[index] for name, values in columns.items()}
        info = dict(recorded.get(mb_id, {}))
        info.setdefault("horizon", int(lengths.max()) if lengths.size else 0)
        weights = parts.get("is_weights")
        if weights is not None and recompute_is:
            weights = rollout_is_weights(
                parts["old_log_probs"],
                parts["rollout_log_probs"],
                mask[index],
                lengths,
                str(level),
                correction["rollout_is_threshold"],
            )
            comparisons.append(
                ctx_compare_tokens(ctx, stage, positions, parts["is_weights"], weights)
            )
        elif weights is not None:
            trusted.append(f"{mb_id}.{Payload.ROLLOUT_IS_WEIGHTS}")
        mb = MicroBatch(
            micro_batch_id=mb_id,
            lengths=lengths,
            log_probs=parts["log_probs"],
            old_log_probs=parts["old_log_probs"],
            advantages=parts["advantages"],
            mask=mask[index],
            info=info,
            entropy=parts.get("entropy"),
            ref_log_probs=parts.get("ref_log_probs"),
            is_weights=None if weights is None else _f32(weights),
        )
        results[mb_id] = micro_batch_loss(mb, args)
    if any(not is_number(fields.get("loss")) for fields in recorded.values()) and not is_number(
        record.get("loss")
    ):
        raise StageInputError(f"incomplete bundle: expected.json {stage} records no loss")
    for mb_id, fields in recorded.items():
        if mb_id not in results:
            raise StageInputError(f"expected.json {stage}.micro_batches names unknown {mb_id}")
        for name in LOSS_FIELDS:
            value = fields.get(name)
            if is_number(value) and name in results[mb_id]:
                comparisons.append(compare(f"{mb_id}.{name}", float(value), results[mb_id][name]))
    if not ctx.partial:
        for name in ("loss", "pg_loss"):
            if is_number(record.get(name)):
                total = math.fsum(result.get(name, 0.0) for result in results.values())
                comparisons.append(compare(name, float(record[name]), total))
    if not comparisons:
        raise StageInputError(
            f"incomplete bundle: expected.json {stage} records nothing to compare"
        )
    mismatched = [c.divergences[0].field for c in comparisons if not c.ok]
    outcome = outcome_of(stage, comparisons, f"{stage} mismatch in " + ", ".join(mismatched[:5]))
    outcome.trusted = trusted
    return outcome


def ctx_compare_tokens(
    ctx: ReplayContext, stage: Stage, positions: list[int], expected: Any, actual: Any
) -> Any:
    """Per-token comparison over some of the selected samples (one micro-batch)."""
    atol, rtol = ctx.tolerance(stage)
    lengths = ctx.lengths[positions]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return compare_arrays(
        stage,
        Payload.ROLLOUT_IS_WEIGHTS,
        np.asarray(expected, dtype=np.float64),
        np.asarray(actual, dtype=np.float64),
        atol=atol,
        rtol=rtol,
        exact=Payload.ROLLOUT_IS_WEIGHTS in ctx.source.manifest.exact_fields,
        sample_ids=[ctx.sample_ids[p] for p in positions],
        offsets=offsets,
    )


# --------------------------------------------------------------------------- registration

for _stage, _run, _inputs in (
    (Stage.REWARD_RAW, _unreplayed, ()),
    (Stage.REWARD_POST_PROCESS, _unreplayed, ()),
    (Stage.LOSS_VALUE, _unreplayed, ()),
    (
        Stage.ADVANTAGE_KL,
        stage_advantage_kl,
        (
            Payload.TOKEN_LEVEL_SCORES,
            Payload.OLD_LOG_PROBS,
            Payload.REF_LOG_PROBS,
            "index.samples.loss_mask",
            "config.verl",
        ),
    ),
    (
        Stage.ADVANTAGE_ESTIMATE,
        stage_advantage_estimate,
        (
            Payload.TOKEN_LEVEL_REWARDS,
            Payload.VALUES,
            "index.samples.group_index",
            "index.samples.loss_mask",
            "expected.advantage.estimate.reward_baselines",
            "config.verl",
        ),
    ),
    (
        Stage.LOSS_POLICY,
        stage_loss_policy,
        (
            Payload.LOG_PROBS,
            Payload.OLD_LOG_PROBS,
            Payload.ADVANTAGES,
            Payload.ENTROPY,
            Payload.REF_LOG_PROBS,
            Payload.ROLLOUT_LOG_PROBS,
            Payload.ROLLOUT_IS_WEIGHTS,
            "index.samples.loss_mask",
            "index.samples.micro_batch_id",
            "expected.loss.policy.micro_batches",
            "config.verl",
        ),
    ),
):
    register_variant(
        StageVariant(
            stage=_stage,
            name=KEY,
            applies=uses_verl,
            run=_run,
            capability=verl_capability(_stage),
            version=VERSION,
            inputs=_inputs,
        )
    )
