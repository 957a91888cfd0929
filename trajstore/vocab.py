"""The words of the replay contract, defined once: stages, statuses, payloads, loss fields.

Every module that names a stage, a stage status or a payload uses these members
instead of retyping the string, so a typo is an AttributeError, not a silent
mismatch. Members are ``str`` subclasses whose values are the exact strings
of the bundle format and of the CLI/JSON output: they compare equal to those
strings, hash alike, and serialize (``json.dumps``, f-strings, ``str()``) as them.

This module imports nothing from trajstore, so any module may import it.
"""

from __future__ import annotations

from enum import Enum


class _Word(str, Enum):
    """A str-valued member that prints as its value (like Python 3.11's StrEnum)."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(str.__str__(self), spec)


class Stage(_Word):
    """Replay stages, declared in chain order (upstream first)."""

    SAMPLE = "sample"
    REWARD_RAW = "reward.raw"
    REWARD_POST_PROCESS = "reward.post_process"
    ADVANTAGE_KL = "advantage.kl"
    ADVANTAGE_ESTIMATE = "advantage.estimate"
    LOSS_POLICY = "loss.policy"
    LOSS_VALUE = "loss.value"
    ROUTER_CONSISTENCY = "router.consistency"


#: the stage chain: a divergence in an earlier stage explains the later ones
STAGE_ORDER: tuple[Stage, ...] = tuple(Stage)
#: stages a major-2 bundle never carries (it records post-processed rewards only)
REWARD_STAGES: tuple[Stage, ...] = (Stage.REWARD_RAW, Stage.REWARD_POST_PROCESS)


class StageStatus(_Word):
    """What one stage's replay found."""

    PASS = "pass"
    FAIL = "fail"
    SKIPPED = "skipped"
    UNSUPPORTED = "unsupported"


class Capability(_Word):
    """Whether this engine recomputes a stage on a given bundle."""

    RECOMPUTE = "recompute"
    SKIPPED = "skipped"
    UNSUPPORTED = "unsupported"


class DeclaredCapability(_Word):
    """What a producer's stage contract (manifest.json) says replay may do with a stage."""

    RECOMPUTE = "recompute"
    RECORDED_ONLY = "recorded-only"
    INSPECT_ONLY = "inspect-only"
    UNSUPPORTED = "unsupported"


class Verdict(_Word):
    """One replay's overall status (the report's and the recorded result's ``status``)."""

    PASS = "pass"
    DIVERGED = "diverged"
    UNSUPPORTED = "unsupported"
    #: the bundle could not be replayed at all (integrity, selection, ...)
    REFUSED = "refused"


#: a step filter for steps with no recorded result (not a verdict: nothing was recorded)
UNREPLAYED = "unreplayed"
#: the values ``query steps --status`` accepts: a recorded verdict, or UNREPLAYED (plain
#: strings, as argparse prints them in its choices)
STEP_STATUSES: tuple[str, ...] = (*(verdict.value for verdict in Verdict), UNREPLAYED)


class Payload(_Word):
    """Payload (tensor) names of a bundle."""

    OLD_LOG_PROBS = "old_log_probs"
    LOG_PROBS = "log_probs"
    REF_LOG_PROBS = "ref_log_probs"
    ENTROPY = "entropy"
    KL = "kl"
    ADVANTAGES = "advantages"
    RETURNS = "returns"
    LOSS_MASK = "loss_mask"
    ROLLOUT_LOG_PROBS = "rollout_log_probs"
    TRAIN_LOG_PROBS = "train_log_probs"
    ROLLOUT_ROUTED_EXPERTS = "rollout_routed_experts"
    TRAIN_ROUTED_EXPERTS = "train_routed_experts"
    TRAIN_NATURAL_ROUTED_EXPERTS = "train_natural_routed_experts"
    #: verl's driver batch (trajstore.integrations.verl): scores before and rewards after the
    #: KL in reward, the critic's values, the rollout importance-sampling weights
    TOKEN_LEVEL_SCORES = "token_level_scores"
    TOKEN_LEVEL_REWARDS = "token_level_rewards"
    VALUES = "values"
    ROLLOUT_IS_WEIGHTS = "rollout_is_weights"


#: the trainer's loss metrics that ``loss.policy`` records and recomputes
LOSS_FIELDS: tuple[str, ...] = (
    "loss",
    "pg_loss",
    "entropy_loss",
    "pg_clipfrac",
    "ppo_kl",
    "kl_loss",
)
#: the one loss field that exists only when the trainer adds a KL loss term
KL_LOSS_FIELD = "kl_loss"


def required_loss_fields(use_kl_loss: bool) -> list[str]:
    """The loss fields a step must record: ``kl_loss`` only under ``use_kl_loss``."""
    return [name for name in LOSS_FIELDS if name != KL_LOSS_FIELD or use_kl_loss]
