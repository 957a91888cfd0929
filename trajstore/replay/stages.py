"""The GRPO stage chain: each stage's capability, inputs and recompute.

A stage reads its inputs from the context: the *recomputed* output of an
upstream stage when that stage ran, the *recorded* value (expected.json or a
payload) when it was skipped. So a loss-only bundle still replays
`loss.policy`, and a divergence propagates from its root.

Every stage here registers itself in `trajstore.replay.registry`; the router
stage registers from `trajstore.router.stage`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trajstore.bundle.checks import PER_TOKEN_PAYLOADS, sample_record_problems
from trajstore.replay import kernels
from trajstore.replay.compare import Divergence, compare_arrays
from trajstore.replay.context import (
    MAX_STAGE_EXAMPLES,
    ReplayContext,
    StageInputError,
    StageOutcome,
    is_number,
    outcome_of,
    with_copied_divergences,
)
from trajstore.replay.registry import CapabilityCheck, StageDef, register_stage
from trajstore.replay.source import BundleSource
from trajstore.schema import LOSS_FAMILY_FIELDS, Config
from trajstore.vocab import (
    LOSS_FIELDS,
    REWARD_STAGES,
    Capability,
    Payload,
    Stage,
    StageStatus,
    required_loss_fields,
)

#: config keys every v1 stage understands (replay-math.md); anything else -> unsupported (the
#: loss-family keys are understood by the family variants of trajstore/replay/losses.py only)
KNOWN_CONFIG_KEYS = frozenset(Config.FIELDS) - frozenset(LOSS_FAMILY_FIELDS)
#: sample ids a reason lists before it says "(+N more)"
MAX_LISTED_SAMPLES = 5

__all__ = [
    "KNOWN_CONFIG_KEYS",
    "ReplayContext",
    "StageInputError",
    "StageOutcome",
]


def _listed(sample_ids: list[str]) -> str:
    """The first few ids, and how many more there are."""
    more = len(sample_ids) - MAX_LISTED_SAMPLES
    return ", ".join(sample_ids[:MAX_LISTED_SAMPLES]) + (f" (+{more} more)" if more > 0 else "")


def stage_sample(ctx: ReplayContext) -> StageOutcome:
    """Sample records against payload layout; non-finite payload values located."""
    problems = sample_record_problems(ctx.samples)
    divergences: list[Divergence] = []
    total = int(ctx.lengths.sum())
    payloads = ctx.source.manifest.payloads
    for name in sorted(name for name in payloads if name in PER_TOKEN_PAYLOADS):
        spec = payloads[name]
        want = int(ctx.all_lengths.sum())
        if tuple(spec.shape) != (want,):
            have = int(spec.shape[0]) if len(spec.shape) == 1 else None
            msg = (
                f"payload '{name}' has shape {list(spec.shape)}, "
                f"samples have {want} response tokens"
            )
            if have is not None and have < want:
                # Under the flat layout the payload ends inside/before these samples.
                all_offsets = kernels.segment_offsets(ctx.all_lengths)
                first = int(np.searchsorted(all_offsets, have, side="right") - 1)
                all_ids = [sample.sample_id for sample in ctx.source.index.samples]
                msg += f"; no tokens for sample(s) {_listed(all_ids[first:])} past its end"
                divergences.append(
                    Divergence(
                        stage=Stage.SAMPLE,
                        sample_id=all_ids[first],
                        field=name,
                        token_offset=have - int(all_offsets[first]),
                        expected=None,
                        actual=None,
                        abs_err=None,
                    )
                )
            problems.append(msg)
            continue
        values = ctx.payload(name)
        if values.dtype.kind == "f":
            non_finite = np.flatnonzero(~np.isfinite(values))
            if non_finite.size:
                token = int(non_finite[0])
                position = int(np.searchsorted(ctx.offsets, token, side="right") - 1)
                problems.append(f"payload '{name}' has {non_finite.size} non-finite value(s)")
                divergences.append(
                    Divergence(
                        stage=Stage.SAMPLE,
                        sample_id=ctx.sample_ids[position],
                        field=name,
                        token_offset=token - int(ctx.offsets[position]),
                        expected=None,
                        actual=float(values[token]),
                        abs_err=None,
                    )
                )
        if values.shape[0] != total:
            problems.append(
                f"payload '{name}' has {values.shape[0]} tokens "
                f"for {total} selected response tokens"
            )
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        return StageOutcome(
            stage=Stage.SAMPLE,
            status=StageStatus.FAIL,
            reason=problems[0] + more,
            mismatch_count=len(problems),
            divergences=divergences[:MAX_STAGE_EXAMPLES],
        )
    return StageOutcome(stage=Stage.SAMPLE, status=StageStatus.PASS, mismatch_count=0)


def _recorded_raw_rewards(ctx: ReplayContext) -> np.ndarray:
    recorded = ctx.expected_per_sample(Stage.REWARD_RAW, "raw_rewards")
    if recorded is not None:
        return recorded
    if all(sample.raw_reward is not None for sample in ctx.samples):
        return np.array([sample.raw_reward for sample in ctx.samples], dtype=np.float64)
    raise StageInputError(
        "incomplete bundle: no recorded raw rewards (expected reward.raw or sample raw_reward)"
    )


def stage_reward_raw(ctx: ReplayContext) -> StageOutcome:
    missing = [sample.sample_id for sample in ctx.samples if sample.raw_reward is None]
    if missing:
        raise StageInputError(
            f"incomplete bundle: sample(s) {', '.join(missing[:MAX_LISTED_SAMPLES])}"
            " have no raw_reward"
        )
    actual = np.array([sample.raw_reward for sample in ctx.samples], dtype=np.float32)
    # Recomputed before the comparison can refuse: downstream reads what this stage derived.
    ctx.recomputed["raw_rewards"] = actual
    expected = ctx.expected_per_sample(Stage.REWARD_RAW, "raw_rewards")
    if expected is None:
        raise StageInputError("incomplete bundle: expected.json has no reward.raw.raw_rewards")
    comparison = ctx.compare(Stage.REWARD_RAW, "raw_reward", expected, actual, per_token=False)
    return outcome_of(Stage.REWARD_RAW, [comparison], "raw reward mismatch in {n} sample(s)")


def stage_reward_post_process(ctx: ReplayContext) -> StageOutcome:
    raw = ctx.recomputed.get("raw_rewards")
    if raw is None:
        raw = _recorded_raw_rewards(ctx)
    group_size = ctx.config.get("n_samples_per_prompt")
    if not isinstance(group_size, int) or group_size < 1:
        raise StageInputError(
            "config.n_samples_per_prompt is missing; semantic group size unknown, refusing to guess"
        )
    try:
        actual = kernels.grpo_normalize(
            np.asarray(raw, dtype=np.float32),
            [sample.group_index for sample in ctx.samples],
            group_size,
            rewards_normalization=bool(ctx.cfg("rewards_normalization", True)),
            std_normalization=bool(ctx.cfg("grpo_std_normalization", True)),
            estimator=ctx.cfg("advantage_estimator", "grpo"),
            sample_ids=ctx.sample_ids,
        )
    except kernels.KernelInputError as exc:
        raise StageInputError(f"refused: {exc}") from None
    ctx.recomputed["rewards"] = actual
    stage = Stage.REWARD_POST_PROCESS
    expected = ctx.expected_per_sample(stage, "rewards")
    if expected is None:
        raise StageInputError("incomplete bundle: expected.json has no reward.post_process.rewards")
    comparisons = [ctx.compare(stage, "reward", expected, actual, per_token=False)]
    if comparisons[0].ok and all(isinstance(sample.reward, (int, float)) for sample in ctx.samples):
        recorded = np.array([sample.reward for sample in ctx.samples], dtype=np.float64)
        comparisons.append(ctx.compare(stage, "reward", recorded, actual, per_token=False))
    return outcome_of(stage, comparisons, "normalized reward mismatch in {n} sample(s)")


def stage_advantage_kl(ctx: ReplayContext) -> StageOutcome:
    expected = ctx.payload(Payload.KL)
    kl_coef = float(ctx.cfg("kl_coef", 0.0))
    kl_type = ctx.cfg("kl_loss_type", "k1")
    key = ctx.memo_key(
        Stage.ADVANTAGE_KL,
        (Payload.KL, Payload.OLD_LOG_PROBS, Payload.REF_LOG_PROBS),
        "stage_advantage_kl",
        kl_coef,
        repr(kl_type),
    )
    hit = None if ctx.memo is None else ctx.memo.get(key)
    if hit is not None:  # its rollout's stage on the same bytes (StageMemo)
        ctx.recomputed["kl"] = hit[1]["kl"].copy()
        return hit[0]
    if kl_coef == 0.0:
        actual = np.zeros(int(ctx.lengths.sum()), dtype=np.float32)
    else:
        try:
            actual = kernels.approx_kl(
                ctx.payload(Payload.OLD_LOG_PROBS),
                ctx.payload(Payload.REF_LOG_PROBS),
                kl_type,
            )
        except kernels.KernelInputError as exc:
            raise StageInputError(str(exc)) from None
    ctx.recomputed["kl"] = actual
    comparison = ctx.compare(Stage.ADVANTAGE_KL, Payload.KL, expected, actual, per_token=True)
    outcome = outcome_of(
        Stage.ADVANTAGE_KL,
        [comparison],
        "{n} kl token(s) diverged (max_abs_error={err:.3e}, mismatches={n})",
    )
    if ctx.memo is not None:
        ctx.memo.put(key, outcome, {"kl": actual.copy()})
    return outcome


def _rewards_from_upstream(ctx: ReplayContext) -> np.ndarray | None:
    """The rollout bundle's recomputed rewards for the samples this step consumed, when
    they are its advantages' source (no reward recomputed here, every sample's upstream)."""
    if "rewards" in ctx.recomputed:
        return None
    by_id = ctx.upstream.get("rewards_by_id")
    if by_id is not None and all(sample_id in by_id for sample_id in ctx.sample_ids):
        return np.array([by_id[sample_id] for sample_id in ctx.sample_ids], dtype=np.float32)
    return None


def _rewards_for_advantages(ctx: ReplayContext, upstream: np.ndarray | None) -> Any:
    if "rewards" in ctx.recomputed:
        return ctx.recomputed["rewards"]
    if upstream is not None:
        return upstream
    missing = [sample.sample_id for sample in ctx.samples if sample.reward is None]
    if missing:
        raise StageInputError(
            f"incomplete bundle: sample(s) {', '.join(missing[:MAX_LISTED_SAMPLES])} have no reward"
        )
    rewards = [sample.reward for sample in ctx.samples]
    if any(isinstance(reward, list) for reward in rewards):
        return rewards
    return np.asarray(rewards, dtype=np.float32)


def stage_advantage_estimate(ctx: ReplayContext) -> StageOutcome:
    stage = Stage.ADVANTAGE_ESTIMATE
    expected = ctx.payload(Payload.ADVANTAGES)
    upstream = _rewards_from_upstream(ctx)
    rewards = _rewards_for_advantages(ctx, upstream)
    key = None
    if ctx.memo is not None and isinstance(rewards, np.ndarray):
        key = ctx.memo_key(
            stage,
            (Payload.ADVANTAGES, Payload.RETURNS),
            "stage_advantage_estimate",
            rewards.dtype.str,
            rewards.shape,
            rewards.tobytes(),
        )
    hit = None if key is None else ctx.memo.get(key)
    if hit is not None:  # its rollout's stage on the same bytes and rewards (StageMemo)
        outcome, values = hit
        ctx.recomputed["advantages"] = values["advantages"].copy()
        if upstream is not None:
            comparison = values["comparison"]
            ctx.upstream_comparison = (
                ctx.upstream["rewards_by_id"],
                with_copied_divergences(comparison),
            )
        return outcome
    try:
        actual = kernels.grpo_returns(rewards, ctx.lengths)
    except kernels.KernelInputError as exc:
        raise StageInputError(str(exc)) from None
    ctx.recomputed["advantages"] = actual
    comparisons = [ctx.compare(stage, Payload.ADVANTAGES, expected, actual, per_token=True)]
    if upstream is not None:
        # exactly the rollout linkage's comparison: it takes this one instead of redoing it
        ctx.upstream_comparison = (ctx.upstream["rewards_by_id"], comparisons[0])
    if ctx.has_payload(Payload.RETURNS):
        returns = ctx.payload(Payload.RETURNS)
        comparisons.append(ctx.compare(stage, Payload.RETURNS, returns, actual, per_token=True))
    outcome = outcome_of(
        stage,
        comparisons,
        "{n} advantage token(s) diverged (max_abs_error={err:.3e}, mismatches={n})",
    )
    if key is not None:
        ctx.memo.put(key, outcome, {"advantages": actual.copy(), "comparison": comparisons[0]})
    return outcome


def stage_loss_policy(ctx: ReplayContext) -> StageOutcome:
    stage = Stage.LOSS_POLICY
    recorded = ctx.source.expected.get(stage)
    if not isinstance(recorded, dict) or not recorded:
        raise StageInputError(f"incomplete bundle: expected.json has no {stage}")
    advantages = ctx.recomputed.get("advantages")
    if advantages is None:
        advantages = ctx.payload(Payload.ADVANTAGES)
    use_kl_loss = bool(ctx.cfg("use_kl_loss", False))
    entropy = ctx.payload(Payload.ENTROPY) if ctx.has_payload(Payload.ENTROPY) else None
    if entropy is None:
        if "entropy_loss" in recorded or float(ctx.cfg("entropy_coef", 0.0)) != 0.0:
            raise StageInputError(f"incomplete bundle: payload '{Payload.ENTROPY}' is missing")
        entropy = np.zeros(int(ctx.lengths.sum()), dtype=np.float32)
    try:
        actual = kernels.loss_policy(
            ctx.payload(Payload.OLD_LOG_PROBS),
            ctx.payload(Payload.LOG_PROBS),
            advantages,
            entropy,
            ctx.mask(),
            ctx.lengths,
            eps_clip=float(ctx.cfg("eps_clip", 0.2)),
            eps_clip_high=ctx.config.get("eps_clip_high"),
            eps_clip_c=ctx.config.get("eps_clip_c"),
            entropy_coef=float(ctx.cfg("entropy_coef", 0.0)),
            use_kl_loss=use_kl_loss,
            kl_loss_coef=float(ctx.cfg("kl_loss_coef", 0.0)),
            kl_loss_type=ctx.cfg("kl_loss_type", "k1"),
            ref_log_probs=ctx.payload(Payload.REF_LOG_PROBS) if use_kl_loss else None,
            use_unbiased_kl=bool(ctx.cfg("use_unbiased_kl", False)),
        )
    except kernels.KernelInputError as exc:
        raise StageInputError(str(exc)) from None
    required = required_loss_fields(use_kl_loss)
    missing = [name for name in required if name not in recorded]
    if missing:
        raise StageInputError(
            f"incomplete bundle: expected.json {stage} lacks {', '.join(missing)}"
        )
    invalid = [name for name in required if not is_number(recorded[name])]
    if invalid:
        raise StageInputError(
            f"expected.json {stage}.{invalid[0]} is {recorded[invalid[0]]!r}, not a number"
        )
    atol, rtol = ctx.tolerance(stage)
    comparisons = [
        compare_arrays(
            stage,
            name,
            np.array([recorded[name]], dtype=np.float64),
            np.array([actual[name]]),
            atol=atol,
            rtol=rtol,
            exact=name in ctx.source.manifest.exact_fields,
        )
        for name in required
    ]
    mismatched = [
        comparison.divergences[0].field for comparison in comparisons if not comparison.ok
    ]
    return outcome_of(stage, comparisons, f"{stage} mismatch in " + ", ".join(mismatched))


# --- capability -------------------------------------------------------------


def grpo_capability(
    stage: Stage, *, reads_config: bool = True, grpo_estimator_only: bool = False
) -> CapabilityCheck:
    """The capability check of a GRPO stage: the producer's contract, then the config.

    ``reads_config``: the stage's math depends on config (and so refuses keys
    it does not understand and cp != 1). ``grpo_estimator_only``: it recomputes
    the GRPO advantage estimator only.
    """

    def check(source: BundleSource) -> tuple[Capability, str]:
        contract = source.manifest.stage_contracts.get(stage)
        if contract is None:
            if stage in REWARD_STAGES and source.manifest.major == 2:
                return (
                    Capability.SKIPPED,
                    "major-2 bundles carry post-processed rewards; no reward stages",
                )
            return Capability.SKIPPED, "not in this bundle's stage contracts"
        if contract.capability == Capability.UNSUPPORTED:
            return Capability.UNSUPPORTED, "the producer declares this stage unsupported"
        if contract.capability != Capability.RECOMPUTE:
            return Capability.SKIPPED, f"declared {contract.capability} by the producer"
        if not reads_config:
            return Capability.RECOMPUTE, ""
        config = source.index.config
        unknown = sorted(
            key
            for key in config
            if key not in KNOWN_CONFIG_KEYS
            and not (key in LOSS_FAMILY_FIELDS and config.get(key) is None)
        )
        if unknown:
            return (
                Capability.UNSUPPORTED,
                f"config key(s) {', '.join(unknown)} not understood by this engine",
            )
        context_parallel = source.index.identity.cp
        if context_parallel != 1:
            return (
                Capability.UNSUPPORTED,
                f"context parallelism cp={context_parallel} is not supported (cp=1 only)",
            )
        estimator = source.index.config.get("advantage_estimator", "grpo")
        if grpo_estimator_only and estimator != "grpo":
            return (
                Capability.UNSUPPORTED,
                f"advantage_estimator {estimator!r} is not recomputed (grpo only)",
            )
        return Capability.RECOMPUTE, ""

    return check


def _value_loss_capability(source: BundleSource) -> tuple[Capability, str]:
    return Capability.UNSUPPORTED, "value loss is not replayable (GRPO has no critic)"


# --- registration -------------------------------------------------------------

register_stage(
    StageDef(
        name=Stage.SAMPLE,
        run=stage_sample,
        capability=grpo_capability(Stage.SAMPLE, reads_config=False),
        inputs=("index.samples", "per-token payloads"),
        compared_with=("sample records against the payload layout", "finite payload values"),
    )
)
register_stage(
    StageDef(
        name=Stage.REWARD_RAW,
        run=stage_reward_raw,
        capability=grpo_capability(Stage.REWARD_RAW),
        inputs=("index.samples.raw_reward",),
        outputs=("raw_rewards",),
        compared_with=("expected.reward.raw.raw_rewards",),
    )
)
register_stage(
    StageDef(
        name=Stage.REWARD_POST_PROCESS,
        run=stage_reward_post_process,
        capability=grpo_capability(Stage.REWARD_POST_PROCESS, grpo_estimator_only=True),
        inputs=("raw_rewards", "index.samples.group_index", "config.n_samples_per_prompt"),
        outputs=("rewards",),
        compared_with=("expected.reward.post_process.rewards", "index.samples.reward"),
    )
)
register_stage(
    StageDef(
        name=Stage.ADVANTAGE_KL,
        run=stage_advantage_kl,
        capability=grpo_capability(Stage.ADVANTAGE_KL),
        inputs=(
            Payload.OLD_LOG_PROBS,
            Payload.REF_LOG_PROBS,
            "config.kl_coef",
            "config.kl_loss_type",
        ),
        outputs=(Payload.KL,),
        compared_with=("payload kl",),
    )
)
register_stage(
    StageDef(
        name=Stage.ADVANTAGE_ESTIMATE,
        run=stage_advantage_estimate,
        capability=grpo_capability(Stage.ADVANTAGE_ESTIMATE, grpo_estimator_only=True),
        inputs=("rewards", "index.samples.response_length"),
        outputs=(Payload.ADVANTAGES,),
        compared_with=("payload advantages", "payload returns"),
    )
)
register_stage(
    StageDef(
        name=Stage.LOSS_POLICY,
        run=stage_loss_policy,
        capability=grpo_capability(Stage.LOSS_POLICY),
        inputs=(
            Payload.OLD_LOG_PROBS,
            Payload.LOG_PROBS,
            Payload.ADVANTAGES,
            Payload.ENTROPY,
            "index.samples.loss_mask",
        ),
        outputs=LOSS_FIELDS,
        compared_with=(f"expected.{Stage.LOSS_POLICY}",),
        cohort_level=True,
    )
)
register_stage(
    StageDef(
        name=Stage.LOSS_VALUE,
        run=None,
        capability=_value_loss_capability,
        cohort_level=True,
    )
)
