"""slime's math as stage variants: the bundles `ingest --from slime` makes (config.slime).

Why variants: slime computes the same links of the chain (group normalization, the
reward-side KL, advantages and returns) with its own formulas and settings
(``--advantage-estimator`` grpo / gspo / cispo / reinforce_plus_plus /
reinforce_plus_plus_baseline, ``--kl-coef``, ``--kl-loss-type``, ``--gamma``,
``--normalize-advantages``, ``--use-rollout-logprobs``), read from ``config.slime`` (the
arguments given at ingest). The math follows slime's source:

- reward.post_process: slime/ray/rollout.py ``_post_process_rewards``: for grpo, gspo,
  cispo and reinforce_plus_plus_baseline (with ``rewards_normalization``) each reward minus
  its group's mean, divided by the group's Bessel std + 1e-6 for grpo / gspo / cispo (with
  ``grpo_std_normalization``); otherwise the raw reward. Groups are semantic
  (``group_index``): slime groups by position (``reshape(-1, n)``, or the whole batch when
  the sample count is not ``n * rollout_batch_size``), and where the two differ, the
  rewards slime trained on diverge here, naming the samples.
- advantage.kl: slime/backends/megatron_utils/loss.py ``compute_advantages_and_returns``:
  zeros when ``kl_coef == 0``, else ``compute_approx_kl(log_probs, ref_log_probs,
  kl_loss_type)`` (``rollout_log_probs`` under ``use_rollout_logprobs``), float32.
- advantage.estimate: the same function: ``get_grpo_returns`` (each sample's reward on
  every token), ``get_reinforce_plus_plus_returns`` (``-kl_coef * kl * mask``, the reward
  added at the last loss token, discounted by ``gamma``),
  ``get_reinforce_plus_plus_baseline_advantages`` (``reward - kl_coef * kl``), then
  ``distributed_masked_whiten`` under ``normalize_advantages`` (over every sample the data-
  parallel group held: the whole train dump, so only a dump of one optimizer step).

Not replayable, by name: ppo (GAE needs the critic's values), OPD, a custom advantage or
reward post-processing function, ``--disable-compute-advantages-and-returns``; the loss
(slime's train dump records none); the raw reward (the reward function's output is the
record). NumPy only, element-wise math in float32 as slime's tensors, reductions in float64.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from trajstore.replay import kernels
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
from trajstore.vocab import Capability, Payload, Stage, StageStatus

#: the config key that selects these variants, their name and version
KEY = "slime"
VERSION = "slime-v1"
#: estimators whose advantages are the sample's reward on every token (before whitening)
BROADCAST = ("grpo", "gspo", "cispo")
#: estimators whose rewards slime centres per group (_post_process_rewards)
CENTRED = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")
STD_EPS = 1e-6
WHITEN_EPS = 1e-8


def uses_slime(source: BundleSource) -> bool:
    return isinstance(source.index.config.get(KEY), dict)


def _args(source: BundleSource) -> Mapping[str, Any]:
    return source.index.config[KEY]


def linkage_unsupported(config: Mapping[str, Any]) -> str | None:
    """Why a slime step's advantages are not its rollout's rewards on every token (the
    rollout linkage's check), or None when they are."""
    args = config.get(KEY)
    if not isinstance(args, dict):
        return None
    estimator = args.get("advantage_estimator")
    if not args.get("args_given"):
        return "slime's arguments were not given at ingest (--config)"
    if estimator not in BROADCAST:
        return f"slime advantage_estimator {estimator!r}: advantages are not the rewards alone"
    if args.get("normalize_advantages"):
        return "slime normalize_advantages whitens the advantages over the whole train dump"
    return _estimate_unreplayable(args)


def _estimate_unreplayable(args: Mapping[str, Any]) -> str | None:
    if not args.get("compute_advantages_and_returns", True):
        return "slime ran with --disable-compute-advantages-and-returns: it computed none"
    if args.get("custom_advantage_function_path"):
        return "a custom advantage function (custom_advantage_function_path) is not replayed"
    if args.get("use_opd"):
        return "on-policy distillation (use_opd) changes the advantages; it is not replayed"
    if args.get("advantage_estimator") == "ppo":
        return "ppo's GAE needs the critic's values, which the train dump does not carry"
    return None


#: why a stage does not run on a slime bundle that does not declare it
_UNDECLARED = {
    Stage.REWARD_RAW: "slime records the reward function's output; there is nothing to "
    "recompute it from",
    Stage.REWARD_POST_PROCESS: "the post-processed rewards are in the rollout's train dump: "
    "recomputed in the rollout bundle when its train dump was ingested with it (a step "
    "holds part of the rollout's groups)",
    Stage.ADVANTAGE_KL: "the train dump has no kl",
    Stage.ADVANTAGE_ESTIMATE: "the train dump has no advantages",
    Stage.LOSS_POLICY: "slime's train dump records no loss to compare with",
}


def slime_capability(stage: Stage) -> CapabilityCheck:
    def check(source: BundleSource) -> tuple[Capability, str]:
        contract = source.manifest.stage_contracts.get(stage)
        args = _args(source)
        if stage == Stage.REWARD_POST_PROCESS and args.get("evaluation"):
            return Capability.SKIPPED, "an evaluation rollout: slime trains on none of it"
        if contract is None:
            return Capability.SKIPPED, _UNDECLARED.get(stage, "not in the stage contracts")
        if stage in (Stage.REWARD_RAW, Stage.LOSS_POLICY):  # declared by hand: still none
            return Capability.UNSUPPORTED, _UNDECLARED[stage]
        if contract.capability != Capability.RECOMPUTE:
            return Capability.SKIPPED, f"declared {contract.capability} by the producer"
        if not args.get("args_given"):
            return (
                Capability.UNSUPPORTED,
                "slime's arguments were not given at ingest (--config FILE); slime saves "
                "none beside its dumps",
            )
        if stage == Stage.REWARD_POST_PROCESS and args.get("custom_reward_post_process_path"):
            return (
                Capability.UNSUPPORTED,
                "a custom reward post-processing function (custom_reward_post_process_path) "
                "is not replayed",
            )
        if stage == Stage.ADVANTAGE_KL and args.get("kl_loss_type") not in kernels.KL_TYPES:
            return Capability.UNSUPPORTED, f"kl_loss_type {args.get('kl_loss_type')!r}"
        if stage == Stage.ADVANTAGE_ESTIMATE:
            reason = _estimate_unreplayable(args)
            if reason:
                return Capability.UNSUPPORTED, reason
            if args.get("normalize_advantages") and int(args.get("steps_in_dump") or 1) > 1:
                return (
                    Capability.UNSUPPORTED,
                    "normalize_advantages whitens over every optimizer step of the rollout "
                    f"({args.get('steps_in_dump')} steps, one bundle each): not replayable "
                    "from one step",
                )
        return Capability.RECOMPUTE, ""

    return check


def _unreplayed(ctx: ReplayContext) -> StageOutcome:
    """Never called: the capability of these stages is never `recompute` on slime data."""
    raise StageInputError("this stage is not replayed for slime bundles")


# --------------------------------------------------------------------------- reward


def post_process(
    raw: np.ndarray, groups: list[Any], args: Mapping[str, Any], sample_ids: list[str]
) -> np.ndarray:
    """slime's post-processed rewards of `raw`, over semantic groups."""
    estimator = args.get("advantage_estimator")
    if not (estimator in CENTRED and args.get("rewards_normalization", True)):
        return np.asarray(raw, dtype=np.float64)  # slime keeps the raw Python floats
    rewards = np.asarray(raw, dtype=np.float32)
    members: dict[int, list[int]] = {}
    for pos, g in enumerate(groups):
        if not isinstance(g, int) or isinstance(g, bool):
            raise StageInputError(f"sample {sample_ids[pos]!r} has no integer group_index")
        members.setdefault(g, []).append(pos)
    out = np.empty_like(rewards)
    std = estimator in BROADCAST and args.get("grpo_std_normalization", True)
    for rows in members.values():
        r = rewards[rows]
        centred = r - np.float32(r.astype(np.float64).mean())
        if std:
            n = centred.size
            c = centred.astype(np.float64)
            spread = (
                np.float32(np.sqrt(((c - c.mean()) ** 2).sum() / (n - 1)))
                if n > 1
                else np.float32(np.nan)  # torch.std of one value
            )
            centred = centred / (spread + np.float32(STD_EPS))
        out[rows] = centred
    return out


def stage_reward_post_process(ctx: ReplayContext) -> StageOutcome:
    stage = Stage.REWARD_POST_PROCESS
    missing = [s.sample_id for s in ctx.samples if not is_number(s.raw_reward)]
    if missing:
        raise StageInputError(
            f"incomplete bundle: sample(s) {', '.join(missing[:5])} have no numeric raw reward "
            "(a dict reward needs slime's reward_key in --config)"
        )
    raw = np.array([s.raw_reward for s in ctx.samples], dtype=np.float64)
    actual = post_process(
        raw, [s.group_index for s in ctx.samples], _args(ctx.source), ctx.sample_ids
    )
    ctx.recomputed["rewards"] = actual
    have = [i for i, s in enumerate(ctx.samples) if is_number(s.reward)]
    if not have:
        raise StageInputError("incomplete bundle: no sample records a post-processed reward")
    atol, rtol = ctx.tolerance(stage)
    comparison = compare_arrays(
        stage,
        "reward",
        np.array([ctx.samples[i].reward for i in have], dtype=np.float64),
        actual[have],
        atol=atol,
        rtol=rtol,
        exact="reward" in ctx.source.manifest.exact_fields,
        sample_ids=[ctx.sample_ids[i] for i in have],
    )
    return outcome_of(stage, [comparison], "post-processed reward mismatch in {n} sample(s)")


# --------------------------------------------------------------------------- kl


def stage_advantage_kl(ctx: ReplayContext) -> StageOutcome:
    stage = Stage.ADVANTAGE_KL
    args = _args(ctx.source)
    expected = ctx.payload(Payload.KL)
    source = Payload.ROLLOUT_LOG_PROBS if args.get("use_rollout_logprobs") else Payload.LOG_PROBS
    kl_coef = float(args.get("kl_coef") or 0.0)
    if kl_coef == 0.0 or not ctx.has_payload(source):
        actual = np.zeros(int(ctx.lengths.sum()), dtype=np.float32)
    else:
        try:
            actual = kernels.approx_kl(
                ctx.payload(source), ctx.payload(Payload.REF_LOG_PROBS), args["kl_loss_type"]
            )
        except kernels.KernelInputError as exc:
            raise StageInputError(str(exc)) from None
    ctx.recomputed["kl"] = actual
    comparison = ctx.compare(stage, Payload.KL, expected, actual, per_token=True)
    return outcome_of(
        stage, [comparison], "{n} kl token(s) diverged (max_abs_error={err:.3e}, mismatches={n})"
    )


# --------------------------------------------------------------------------- advantages


def discounted_returns(rewards: np.ndarray, lengths: np.ndarray, gamma: float) -> np.ndarray:
    """Per sample, ``G_t = r_t + gamma * G_{t+1}`` over its tokens (float64 sums)."""
    out = np.empty(rewards.size, dtype=np.float64)
    offsets = kernels.segment_offsets(lengths)
    values = rewards.astype(np.float64)
    for i in range(lengths.size):
        a, b = int(offsets[i]), int(offsets[i + 1])
        if gamma == 1.0:
            out[a:b] = np.cumsum(values[a:b][::-1])[::-1]
            continue
        running = 0.0
        for t in range(b - 1, a - 1, -1):
            running = values[t] + gamma * running
            out[t] = running
    return out.astype(np.float32)


def whiten(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """slime's ``distributed_masked_whiten`` (shift_mean=True) over one flat array."""
    v, m = values.astype(np.float64), mask.astype(np.float64)
    count = m.sum()
    if count == 0:
        raise StageInputError("normalize_advantages over an all-zero loss mask")
    mean = (v * m).sum() / count
    var = (v * v * m).sum() / count - mean * mean
    if count >= 2:
        var = var * count / (count - 1)
    return (
        (values.astype(np.float32) - np.float32(mean)) / np.float32(np.sqrt(var + WHITEN_EPS))
    ).astype(np.float32)


def _rewards(ctx: ReplayContext) -> tuple[np.ndarray, bool]:
    """The rewards the advantages come from: the linked rollout's recomputed ones (and
    True), else each sample's recorded post-processed reward."""
    by_id = ctx.upstream.get("rewards_by_id")
    if by_id is not None and all(sid in by_id for sid in ctx.sample_ids):
        return np.array([by_id[sid] for sid in ctx.sample_ids], dtype=np.float64), True
    missing = [s.sample_id for s in ctx.samples if not is_number(s.reward)]
    if missing:
        raise StageInputError(
            f"incomplete bundle: sample(s) {', '.join(missing[:5])} have no reward"
        )
    return np.array([s.reward for s in ctx.samples], dtype=np.float64), False


def stage_advantage_estimate(ctx: ReplayContext) -> StageOutcome:
    stage = Stage.ADVANTAGE_ESTIMATE
    args = _args(ctx.source)
    if args.get("normalize_advantages") and ctx.partial:
        return StageOutcome(
            stage=stage,
            status=StageStatus.SKIPPED,
            reason="normalize_advantages whitens over the whole dump; not under a selection",
        )
    estimator = args["advantage_estimator"]
    rewards, upstream = _rewards(ctx)
    lengths = ctx.lengths
    per_token = np.repeat(rewards.astype(np.float32), lengths)
    kl_coef = np.float32(args.get("kl_coef") or 0.0)
    if estimator in BROADCAST:
        returns = per_token
        advantages = returns
    else:
        kl = ctx.recomputed.get("kl")
        if kl is None:
            kl = ctx.payload(Payload.KL)
        kl = np.asarray(kl, dtype=np.float32)
        mask = ctx.mask()
        if estimator == "reinforce_plus_plus":
            token = -kl_coef * (kl * mask)
            offsets = ctx.offsets
            for i, sid in enumerate(ctx.sample_ids):
                ones = np.flatnonzero(mask[offsets[i] : offsets[i + 1]])
                if not ones.size:
                    raise StageInputError(f"sample {sid!r} is fully masked (slime refuses it)")
                token[offsets[i] + ones[-1]] += np.float32(rewards[i])
            returns = discounted_returns(token, lengths, float(args.get("gamma", 1.0)))
            advantages = returns
        else:  # reinforce_plus_plus_baseline
            advantages = (per_token - kl_coef * kl).astype(np.float32)
            returns = advantages
    if args.get("normalize_advantages"):
        advantages = whiten(advantages, ctx.mask())
    ctx.recomputed["advantages"] = advantages
    comparisons = ctx.compare_advantages(stage, advantages, returns)
    if upstream and linkage_unsupported(ctx.config) is None:
        ctx.upstream_comparison = (ctx.upstream["rewards_by_id"], comparisons[0])
    return outcome_of(
        stage,
        comparisons,
        "{n} advantage/return token(s) diverged (max_abs_error={err:.3e}, mismatches={n})",
    )


# --------------------------------------------------------------------------- registration

for _stage, _run, _inputs in (
    (Stage.REWARD_RAW, _unreplayed, ()),
    (
        Stage.REWARD_POST_PROCESS,
        stage_reward_post_process,
        ("index.samples.raw_reward", "index.samples.group_index", "config.slime"),
    ),
    (
        Stage.ADVANTAGE_KL,
        stage_advantage_kl,
        (Payload.LOG_PROBS, Payload.REF_LOG_PROBS, Payload.ROLLOUT_LOG_PROBS, "config.slime"),
    ),
    (
        Stage.ADVANTAGE_ESTIMATE,
        stage_advantage_estimate,
        ("rewards", Payload.KL, "index.samples.loss_mask", "config.slime"),
    ),
    (Stage.LOSS_POLICY, _unreplayed, ()),
):
    register_variant(
        StageVariant(
            stage=_stage,
            name=KEY,
            applies=uses_slime,
            run=_run,
            capability=slime_capability(_stage),
            version=VERSION,
            inputs=_inputs,
        )
    )
