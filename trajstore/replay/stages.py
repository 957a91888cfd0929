"""The GRPO stage chain: each stage's capability, inputs and recompute.

A stage reads its inputs from the context: the *recomputed* output of an
upstream stage when that stage ran, the *recorded* value (expected.json or a
payload) when it was skipped. So a loss-only bundle still replays
`loss.policy`, and a divergence propagates from its root.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trajstore.bundle.checks import PER_TOKEN_PAYLOADS, sample_record_problems
from trajstore.errors import TrajstoreError
from trajstore.replay import kernels
from trajstore.replay.compare import Comparison, Divergence, compare_arrays, json_number
from trajstore.replay.selection import Selection
from trajstore.replay.source import BundleSource, as_float, payload_rows
from trajstore.schema import REWARD_STAGES, Config

STAGE_ORDER = (
    "sample",
    "reward.raw",
    "reward.post_process",
    "advantage.kl",
    "advantage.estimate",
    "loss.policy",
    "loss.value",
    "router.consistency",
)
#: config keys every stage understands (replay-math.md); anything else -> unsupported
KNOWN_CONFIG_KEYS = frozenset(Config.FIELDS)
LOSS_FIELDS = ("loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl", "kl_loss")


class StageInputError(TrajstoreError):
    """A stage cannot run on this bundle's inputs (reported as that stage's failure)."""


@dataclass
class StageOutcome:
    stage: str
    status: str  # pass | fail | skipped | unsupported
    reason: str = ""
    requested: bool = True
    max_abs_error: float | None = None
    mismatch_count: int | None = None
    divergences: list[Divergence] = field(default_factory=list)
    version: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "version": self.version,
            "status": self.status,
            "reason": self.reason,
            "requested": self.requested,
            "max_abs_error": json_number(self.max_abs_error),
            "mismatch_count": self.mismatch_count,
            "divergences": [d.to_dict() for d in self.divergences],
        }


class ReplayContext:
    """Selected inputs of one bundle plus the outputs recomputed so far."""

    def __init__(
        self,
        source: BundleSource,
        selection: Selection,
        upstream: dict[str, Any] | None = None,
    ):
        self.source = source
        self.selection = selection
        samples = source.index.samples
        self.all_lengths = np.array([s.response_length for s in samples], dtype=np.int64)
        pos = selection.positions
        self.positions = np.arange(len(samples)) if pos is None else pos
        self.samples = [samples[i] for i in self.positions]
        self.sample_ids = [s.sample_id for s in self.samples]
        self.lengths = self.all_lengths[self.positions]
        self.offsets = kernels.segment_offsets(self.lengths)
        self.config = source.index.config
        self.recomputed: dict[str, np.ndarray] = {}
        #: values an upstream bundle recomputed for these samples (rollout -> step linkage)
        self.upstream = upstream or {}
        self._payloads: dict[str, np.ndarray] = {}

    @property
    def partial(self) -> bool:
        return self.selection.partial

    def cfg(self, key: str, default: Any) -> Any:
        v = self.config.get(key, default)
        return default if v is None else v

    def has_payload(self, name: str) -> bool:
        return name in self.source.manifest.payloads

    def payload(self, name: str) -> np.ndarray:
        if name not in self._payloads:
            if not self.has_payload(name):
                raise StageInputError(f"incomplete bundle: payload '{name}' is missing")
            shape = tuple(self.source.manifest.payloads[name].shape)
            want = int(self.all_lengths.sum())
            if name in PER_TOKEN_PAYLOADS and shape != (want,):
                # Never slice or compare a payload that does not follow the sample layout.
                raise StageInputError(
                    f"payload '{name}' has shape {list(shape)}, samples have {want} response tokens"
                )
            raw = payload_rows(self.source, name, self.selection.positions, self.all_lengths)
            self._payloads[name] = as_float(raw, self.source.manifest.payloads[name].dtype)
        return self._payloads[name]

    def mask(self) -> np.ndarray:
        if self.samples:
            return np.concatenate([np.asarray(s.loss_mask, dtype=np.float32) for s in self.samples])
        return np.zeros(0, dtype=np.float32)

    def expected_per_sample(self, stage: str, key: str) -> np.ndarray | None:
        """A per-sample list from expected.json, restricted to the selection."""
        rec = self.source.expected.get(stage, {})
        if not isinstance(rec, dict) or key not in rec:
            return None
        values = rec[key]
        n = len(self.source.index.samples)
        if not isinstance(values, list) or len(values) != n:
            raise StageInputError(
                f"expected.json {stage}.{key} must list {n} values (one per sample)"
            )
        bad = next((i for i, v in enumerate(values) if not _is_number(v)), None)
        if bad is not None:
            raise StageInputError(
                f"expected.json {stage}.{key}[{bad}] is {values[bad]!r}, not a number"
            )
        return np.asarray(values, dtype=np.float64)[self.positions]

    def tolerance(self, stage: str) -> tuple[float, float]:
        return self.source.manifest.tolerance(stage)

    def compare(
        self, stage: str, fname: str, expected: np.ndarray, actual: np.ndarray, *, per_token: bool
    ) -> Comparison:
        atol, rtol = self.tolerance(stage)
        return compare_arrays(
            stage,
            fname,
            expected,
            actual,
            atol=atol,
            rtol=rtol,
            exact=fname in self.source.manifest.exact_fields,
            sample_ids=self.sample_ids,
            offsets=self.offsets if per_token else None,
        )


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _outcome(stage: str, comps: list[Comparison], what: str) -> StageOutcome:
    mism = sum(c.mismatch_count for c in comps)
    max_err = max((c.max_abs_error for c in comps), default=0.0)
    divs = [d for c in comps for d in c.divergences][:10]
    if mism == 0:
        return StageOutcome(stage, "pass", "", max_abs_error=max_err, mismatch_count=0)
    return StageOutcome(
        stage,
        "fail",
        what.format(n=mism, err=max_err),
        max_abs_error=max_err,
        mismatch_count=mism,
        divergences=divs,
    )


# --- stages -----------------------------------------------------------------


def stage_sample(ctx: ReplayContext) -> StageOutcome:
    """Sample records against payload layout; non-finite payload values located."""
    problems = sample_record_problems(ctx.samples)
    divs: list[Divergence] = []
    total = int(ctx.lengths.sum())
    for name in sorted(n for n in ctx.source.manifest.payloads if n in PER_TOKEN_PAYLOADS):
        spec = ctx.source.manifest.payloads[name]
        want = int(ctx.all_lengths.sum())
        if tuple(spec.shape) != (want,):
            have = int(spec.shape[0]) if len(spec.shape) == 1 else None
            msg = f"payload '{name}' has shape {list(spec.shape)}, samples have {want} response tokens"
            if have is not None and have < want:
                # Under the flat layout the payload ends inside/before these samples.
                offs = kernels.segment_offsets(ctx.all_lengths)
                first = int(np.searchsorted(offs, have, side="right") - 1)
                ids = [s.sample_id for s in ctx.source.index.samples]
                lacking = ids[first:]
                more = f" (+{len(lacking) - 5} more)" if len(lacking) > 5 else ""
                msg += f"; no tokens for sample(s) {', '.join(lacking[:5])}{more} past its end"
                divs.append(
                    Divergence(
                        "sample", ids[first], name, have - int(offs[first]), None, None, None
                    )
                )
            problems.append(msg)
            continue
        arr = ctx.payload(name)
        if arr.dtype.kind == "f":
            bad = np.flatnonzero(~np.isfinite(arr))
            if bad.size:
                i = int(bad[0])
                pos = int(np.searchsorted(ctx.offsets, i, side="right") - 1)
                problems.append(f"payload '{name}' has {bad.size} non-finite value(s)")
                divs.append(
                    Divergence(
                        "sample",
                        ctx.sample_ids[pos],
                        name,
                        i - int(ctx.offsets[pos]),
                        None,
                        float(arr[i]),
                        None,
                    )
                )
        if arr.shape[0] != total:
            problems.append(
                f"payload '{name}' has {arr.shape[0]} tokens for {total} selected response tokens"
            )
    if problems:
        return StageOutcome(
            "sample",
            "fail",
            problems[0] + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""),
            mismatch_count=len(problems),
            divergences=divs[:10],
        )
    return StageOutcome("sample", "pass", "", mismatch_count=0)


def _recorded_raw_rewards(ctx: ReplayContext) -> np.ndarray:
    rec = ctx.expected_per_sample("reward.raw", "raw_rewards")
    if rec is not None:
        return rec
    if all(s.raw_reward is not None for s in ctx.samples):
        return np.array([s.raw_reward for s in ctx.samples], dtype=np.float64)
    raise StageInputError(
        "incomplete bundle: no recorded raw rewards (expected reward.raw or sample raw_reward)"
    )


def stage_reward_raw(ctx: ReplayContext) -> StageOutcome:
    missing = [s.sample_id for s in ctx.samples if s.raw_reward is None]
    if missing:
        raise StageInputError(
            f"incomplete bundle: sample(s) {', '.join(missing[:5])} have no raw_reward"
        )
    actual = np.array([s.raw_reward for s in ctx.samples], dtype=np.float32)
    # Recomputed before the comparison can refuse: downstream reads what this stage derived.
    ctx.recomputed["raw_rewards"] = actual
    expected = ctx.expected_per_sample("reward.raw", "raw_rewards")
    if expected is None:
        raise StageInputError("incomplete bundle: expected.json has no reward.raw.raw_rewards")
    comp = ctx.compare("reward.raw", "raw_reward", expected, actual, per_token=False)
    return _outcome("reward.raw", [comp], "raw reward mismatch in {n} sample(s)")


def stage_reward_post_process(ctx: ReplayContext) -> StageOutcome:
    raw = ctx.recomputed.get("raw_rewards")
    if raw is None:
        raw = _recorded_raw_rewards(ctx)
    n = ctx.config.get("n_samples_per_prompt")
    if not isinstance(n, int) or n < 1:
        raise StageInputError(
            "config.n_samples_per_prompt is missing; semantic group size unknown, refusing to guess"
        )
    try:
        actual = kernels.grpo_normalize(
            np.asarray(raw, dtype=np.float32),
            [s.group_index for s in ctx.samples],
            n,
            rewards_normalization=bool(ctx.cfg("rewards_normalization", True)),
            std_normalization=bool(ctx.cfg("grpo_std_normalization", True)),
            estimator=ctx.cfg("advantage_estimator", "grpo"),
            sample_ids=ctx.sample_ids,
        )
    except kernels.KernelInputError as exc:
        raise StageInputError(f"refused: {exc}") from None
    ctx.recomputed["rewards"] = actual
    comps = []
    expected = ctx.expected_per_sample("reward.post_process", "rewards")
    if expected is None:
        raise StageInputError("incomplete bundle: expected.json has no reward.post_process.rewards")
    comps.append(ctx.compare("reward.post_process", "reward", expected, actual, per_token=False))
    if comps[0].ok and all(isinstance(s.reward, (int, float)) for s in ctx.samples):
        recorded = np.array([s.reward for s in ctx.samples], dtype=np.float64)
        comps.append(
            ctx.compare("reward.post_process", "reward", recorded, actual, per_token=False)
        )
    return _outcome("reward.post_process", comps, "normalized reward mismatch in {n} sample(s)")


def stage_advantage_kl(ctx: ReplayContext) -> StageOutcome:
    expected = ctx.payload("kl")
    kl_coef = float(ctx.cfg("kl_coef", 0.0))
    if kl_coef == 0.0:
        actual = np.zeros(int(ctx.lengths.sum()), dtype=np.float32)
    else:
        try:
            actual = kernels.approx_kl(
                ctx.payload("old_log_probs"),
                ctx.payload("ref_log_probs"),
                ctx.cfg("kl_loss_type", "k1"),
            )
        except kernels.KernelInputError as exc:
            raise StageInputError(str(exc)) from None
    ctx.recomputed["kl"] = actual
    comp = ctx.compare("advantage.kl", "kl", expected, actual, per_token=True)
    return _outcome(
        "advantage.kl", [comp], "{n} kl token(s) diverged (max_abs_error={err:.3e}, mismatches={n})"
    )


def _rewards_for_advantages(ctx: ReplayContext) -> Any:
    if "rewards" in ctx.recomputed:
        return ctx.recomputed["rewards"]
    by_id = ctx.upstream.get("rewards_by_id")
    if by_id is not None and all(sid in by_id for sid in ctx.sample_ids):
        # the rollout bundle's recomputed rewards for the samples this step consumed
        return np.array([by_id[sid] for sid in ctx.sample_ids], dtype=np.float32)
    missing = [s.sample_id for s in ctx.samples if s.reward is None]
    if missing:
        raise StageInputError(
            f"incomplete bundle: sample(s) {', '.join(missing[:5])} have no reward"
        )
    rewards = [s.reward for s in ctx.samples]
    if any(isinstance(r, list) for r in rewards):
        return rewards
    return np.asarray(rewards, dtype=np.float32)


def stage_advantage_estimate(ctx: ReplayContext) -> StageOutcome:
    expected = ctx.payload("advantages")
    try:
        actual = kernels.grpo_returns(_rewards_for_advantages(ctx), ctx.lengths)
    except kernels.KernelInputError as exc:
        raise StageInputError(str(exc)) from None
    ctx.recomputed["advantages"] = actual
    comps = [ctx.compare("advantage.estimate", "advantages", expected, actual, per_token=True)]
    if ctx.has_payload("returns"):
        comps.append(
            ctx.compare(
                "advantage.estimate", "returns", ctx.payload("returns"), actual, per_token=True
            )
        )
    return _outcome(
        "advantage.estimate",
        comps,
        "{n} advantage token(s) diverged (max_abs_error={err:.3e}, mismatches={n})",
    )


def stage_loss_policy(ctx: ReplayContext) -> StageOutcome:
    recorded = ctx.source.expected.get("loss.policy")
    if not isinstance(recorded, dict) or not recorded:
        raise StageInputError("incomplete bundle: expected.json has no loss.policy")
    advantages = ctx.recomputed.get("advantages")
    if advantages is None:
        advantages = ctx.payload("advantages")
    use_kl_loss = bool(ctx.cfg("use_kl_loss", False))
    entropy = ctx.payload("entropy") if ctx.has_payload("entropy") else None
    if entropy is None:
        if "entropy_loss" in recorded or float(ctx.cfg("entropy_coef", 0.0)) != 0.0:
            raise StageInputError("incomplete bundle: payload 'entropy' is missing")
        entropy = np.zeros(int(ctx.lengths.sum()), dtype=np.float32)
    try:
        actual = kernels.loss_policy(
            ctx.payload("old_log_probs"),
            ctx.payload("log_probs"),
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
            ref_log_probs=ctx.payload("ref_log_probs") if use_kl_loss else None,
            use_unbiased_kl=bool(ctx.cfg("use_unbiased_kl", False)),
        )
    except kernels.KernelInputError as exc:
        raise StageInputError(str(exc)) from None
    comps = []
    required = [f for f in LOSS_FIELDS if f != "kl_loss"] + (["kl_loss"] if use_kl_loss else [])
    missing = [f for f in required if f not in recorded]
    if missing:
        raise StageInputError(
            f"incomplete bundle: expected.json loss.policy lacks {', '.join(missing)}"
        )
    invalid = [f for f in required if not _is_number(recorded[f])]
    if invalid:
        raise StageInputError(
            f"expected.json loss.policy.{invalid[0]} is {recorded[invalid[0]]!r}, not a number"
        )
    for f in required:
        comps.append(
            compare_arrays(
                "loss.policy",
                f,
                np.array([recorded[f]], dtype=np.float64),
                np.array([actual[f]]),
                atol=ctx.tolerance("loss.policy")[0],
                rtol=ctx.tolerance("loss.policy")[1],
                exact=f in ctx.source.manifest.exact_fields,
            )
        )
    bad = [c.divergences[0].field for c in comps if not c.ok]
    out = _outcome("loss.policy", comps, "loss.policy mismatch in " + ", ".join(bad))
    return out


@dataclass(frozen=True)
class StageDef:
    """One replay stage: what it reads, what it recomputes, what that is compared with.

    ``version`` changes whenever the stage's math or comparison changes, so a
    recorded result says which implementation produced it.
    """

    name: str
    run: Callable[[ReplayContext], StageOutcome] | None
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    compared_with: tuple[str, ...] = ()
    cohort_level: bool = False
    version: str = "v1"


def _router_stage(ctx: ReplayContext) -> StageOutcome:
    # lives in trajstore.router, which imports this module: imported on use
    return importlib.import_module("trajstore.router.stage").stage_router_consistency(ctx)


STAGES: dict[str, StageDef] = {
    s.name: s
    for s in (
        StageDef(
            "sample",
            stage_sample,
            ("index.samples", "per-token payloads"),
            (),
            ("sample records against the payload layout", "finite payload values"),
        ),
        StageDef(
            "reward.raw",
            stage_reward_raw,
            ("index.samples.raw_reward",),
            ("raw_rewards",),
            ("expected.reward.raw.raw_rewards",),
        ),
        StageDef(
            "reward.post_process",
            stage_reward_post_process,
            ("raw_rewards", "index.samples.group_index", "config.n_samples_per_prompt"),
            ("rewards",),
            ("expected.reward.post_process.rewards", "index.samples.reward"),
        ),
        StageDef(
            "advantage.kl",
            stage_advantage_kl,
            ("old_log_probs", "ref_log_probs", "config.kl_coef", "config.kl_loss_type"),
            ("kl",),
            ("payload kl",),
        ),
        StageDef(
            "advantage.estimate",
            stage_advantage_estimate,
            ("rewards", "index.samples.response_length"),
            ("advantages",),
            ("payload advantages", "payload returns"),
        ),
        StageDef(
            "loss.policy",
            stage_loss_policy,
            ("old_log_probs", "log_probs", "advantages", "entropy", "index.samples.loss_mask"),
            LOSS_FIELDS,
            ("expected.loss.policy",),
            cohort_level=True,
        ),
        StageDef("loss.value", None, cohort_level=True),
        StageDef(
            "router.consistency",
            _router_stage,
            (
                "rollout_routed_experts",
                "train_routed_experts",
                "rollout_log_probs",
                "train_log_probs",
                "config.router",
            ),
            ("route metrics",),
            ("expected.router.consistency",),
            cohort_level=True,
        ),
    )
}


def capability(source: BundleSource, stage: str) -> tuple[str, str]:
    """(recompute | skipped | unsupported, reason) for this engine on this bundle."""
    if stage == "router.consistency":
        return importlib.import_module("trajstore.router.stage").router_capability(source)
    if stage == "loss.value":
        return "unsupported", "value loss is not replayable (GRPO has no critic)"
    contract = source.manifest.stage_contracts.get(stage)
    if contract is None:
        if stage in REWARD_STAGES and source.manifest.major == 2:
            return "skipped", "major-2 bundles carry post-processed rewards; no reward stages"
        return "skipped", "not in this bundle's stage contracts"
    if contract.capability == "unsupported":
        return "unsupported", "the producer declares this stage unsupported"
    if contract.capability != "recompute":
        return "skipped", f"declared {contract.capability} by the producer"
    if stage == "sample":
        return "recompute", ""
    unknown = sorted(set(source.index.config) - KNOWN_CONFIG_KEYS)
    if unknown:
        return "unsupported", f"config key(s) {', '.join(unknown)} not understood by this engine"
    cp = source.index.identity.cp
    if cp != 1:
        return "unsupported", f"context parallelism cp={cp} is not supported (cp=1 only)"
    estimator = source.index.config.get("advantage_estimator", "grpo")
    if estimator != "grpo" and stage in ("reward.post_process", "advantage.estimate"):
        return "unsupported", f"advantage_estimator {estimator!r} is not recomputed (grpo only)"
    return "recompute", ""
