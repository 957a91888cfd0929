"""The contract between verl's data and trajstore bundles (driver batch, actor micro-batches).

Why one module both sides share: the driver (``capture_batch``, after ``update_actor``) and
the actor (``capture_actor``, inside verl's loss) see different halves of a step, and replay
needs them to agree on sample ids, groups and the config. This module turns each half into
bundle records and imports neither verl nor Ray: it reads a ``DataProto`` by duck typing
(``.batch``, ``.non_tensor_batch``, ``.meta_info``) or a plain mapping of fields (the v1
``PPOTrainer``'s), and a config as an OmegaConf ``DictConfig``, a dataclass or a mapping.

Identity (docs/integrations.md "verl"):

- rollout bundle ``replay-rollout-<step>``: ``step`` is verl's ``trainer.global_steps``;
  one per driver batch: every sample, its ``uid`` group, scores, rewards, log-probs,
  advantages and returns (the reward -> advantage half of the chain);
- step bundle ``replay-<step>-<k>``: ``k`` is the optimizer step within that global step's
  ``update_actor`` (epoch * mini-batches + mini-batch), one per optimizer step: the
  micro-batches verl's loss consumed, with the new log-probs, entropy and the loss's logged
  parts (the loss half);
- sample ``s<row>``: ``row`` is the sample's row in the driver batch (the actor reads it
  from the batch field `ROW_KEY`, which the driver adds before ``update_actor``), so a
  step's samples are found in its rollout bundle by id.

Padding is removed per sample: a response's real tokens are its ``attention_mask`` ones
(verl right-pads responses, left-pads prompts); every per-token payload is flat over them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from trajstore.integrations.adapter import (
    FrameworkAdapter,
    SampleIds,
    StepRecord,
    config_get,
    cpu,
    groups_of_uids,
    keep_mask,
    last_token_lengths,
    micro_batch_id,
    pack,
    plain,
    trim_routes,
)
from trajstore.replay.verl_math import LOSS_FIELDS
from trajstore.vocab import Stage

#: the config key of a verl bundle (index.json ``config.verl``) and the records' version
KEY = "verl"
CONTRACT_VERSION = "verl-records-v1"
#: the verl release these records were written against (others: a warning at capture)
TESTED_VERL = "0.9.1"
#: batch fields the driver adds before ``update_actor`` so each micro-batch knows its rows
ROW_KEY = "trajstore_row"
GROUP_KEY = "trajstore_group"
#: bundle payload -> verl batch key, for the per-token fields of the rollout bundle (in this
#: order; verl names a field as the bundle does, but for its singular ``ref_log_prob``)
_LOG_PROB_FIELDS = ("old_log_probs", "ref_log_probs", "rollout_log_probs", "advantages")
_VALUE_FIELDS = ("returns", "values", "token_level_scores", "token_level_rewards")
ROLLOUT_TOKEN_FIELDS: dict[str, str] = {
    name: {"ref_log_probs": "ref_log_prob"}.get(name, name)
    for name in (*_LOG_PROB_FIELDS, *_VALUE_FIELDS, "rollout_is_weights")
}
#: the optional per-token fields of a micro-batch record (attribute = bundle payload name)
OPTIONAL_TOKEN_FIELDS = ("entropy", "ref_log_probs", "rollout_log_probs", "rollout_is_weights")
#: verl's loss metrics (``actor/`` prefix dropped) that a micro-batch record keeps: the
#: logged parts replay recomputes (the loss itself is recorded apart)
LOSS_METRICS: tuple[str, ...] = tuple(name for name in LOSS_FIELDS if name != "loss")
#: verl 0.9.1's defaults of ``actor.policy_loss`` (``PolicyLossConfig``), for keys a config omits
POLICY_LOSS_DEFAULTS: dict[str, Any] = {
    "loss_mode": "vanilla",
    "clip_cov_ratio": 0.0002,
    "clip_cov_lb": 1.0,
    "clip_cov_ub": 5.0,
    "kl_cov_ratio": 0.0002,
    "ppo_kl_coef": 0.1,
    "dro_beta": None,
}
#: the global batch info verl's ``agg_loss`` divides by (``config.global_batch_info``)
BATCH_INFO: tuple[str, ...] = (
    "dp_size",
    "batch_num_tokens",
    "global_batch_size",
    "loss_scale_factor",
)


# --------------------------------------------------------------------------- reading


@dataclass
class BatchView:
    """A driver batch as three plain mappings (a ``DataProto`` or the v1 trainer's fields)."""

    tensors: dict[str, torch.Tensor]
    non_tensor: dict[str, Any]
    meta: dict[str, Any]

    @classmethod
    def of(cls, batch: Any) -> BatchView:
        if hasattr(batch, "batch") and hasattr(batch, "non_tensor_batch"):
            keys = [] if batch.batch is None else list(batch.batch.keys())  # a TensorDict
            tensors = {k: batch.batch[k] for k in keys}
            return cls(tensors, dict(batch.non_tensor_batch), dict(batch.meta_info or {}))
        if isinstance(batch, Mapping):
            tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
            others = {k: v for k, v in batch.items() if not isinstance(v, torch.Tensor)}
            return cls(tensors, others, {})
        raise TypeError(f"a verl batch is a DataProto or a mapping of fields, not {type(batch)}")


class VerlAdapter(FrameworkAdapter):
    """verl: imported lazily (``pip install 'trajstore[verl]'``), its config as ``config.verl``."""

    name = "verl"
    module = "verl"
    extra = "verl"
    tested = TESTED_VERL

    def is_tested(self, version: str | None) -> bool:
        return not version or version == self.tested

    def recompute_config(self, source: Any, **options: Any) -> dict[str, Any]:
        return {KEY: algorithm_config(source, **options)}


VERL = VerlAdapter()


def verl_version() -> str | None:
    """The installed verl's version, read without importing verl."""
    return VERL.installed_version()


# --------------------------------------------------------------------------- config


def algorithm_config(
    config: Any, *, kl_coef: float | None = None, horizon: int | None = None
) -> dict[str, Any]:
    """The settings of a verl run that determine its math, as ``config.verl`` of a bundle.

    ``config`` is the trainer's whole config (``algorithm`` and ``actor_rollout_ref``).
    ``kl_coef`` is the KL-in-reward coefficient *applied* this step (``kl_ctrl.value``
    before ``apply_kl_penalty`` updated it, logged as ``actor/reward_kl_penalty_coeff``);
    under a fixed controller it is ``kl_ctrl.kl_coef``, under an adaptive one it must be
    given, else replay reports the KL in reward unsupported. ``horizon``: the padded
    response length, which ``seq-mean-token-sum-norm`` divides by.
    """
    algo = config_get(config, "algorithm", {})
    actor = config_get(config, "actor_rollout_ref.actor", {})
    ctrl = config_get(algo, "kl_ctrl", {})
    ctrl_type = str(config_get(ctrl, "type", "fixed"))
    use_kl_in_reward = bool(config_get(algo, "use_kl_in_reward", False))
    applied = kl_coef
    if applied is None and ctrl_type == "fixed":
        applied = float(config_get(ctrl, "kl_coef", 0.001))
    clip_ratio = float(config_get(actor, "clip_ratio", 0.2))
    policy_loss = {**POLICY_LOSS_DEFAULTS, **(plain(config_get(actor, "policy_loss", {})) or {})}
    correction = config_get(algo, "rollout_correction", None)
    out: dict[str, Any] = {
        "contract": CONTRACT_VERSION,
        "verl_version": verl_version(),
        # driver: algorithm.*
        "adv_estimator": str(config_get(algo, "adv_estimator", "gae")),
        "gamma": float(config_get(algo, "gamma", 1.0)),
        "lam": float(config_get(algo, "lam", 1.0)),
        "norm_adv_by_std_in_grpo": bool(config_get(algo, "norm_adv_by_std_in_grpo", True)),
        "use_kl_in_reward": use_kl_in_reward,
        "kl_penalty": str(config_get(algo, "kl_penalty", "kl")),
        "kl_ctrl_type": ctrl_type,
        "kl_ctrl_coef": float(config_get(ctrl, "kl_coef", 0.001)),
        "kl_ctrl_target": float(config_get(ctrl, "target_kl", 0.1)),
        "kl_ctrl_horizon": int(config_get(ctrl, "horizon", 10000)),
        "kl_coef_applied": None if applied is None else float(applied),
        "use_pf_ppo": bool(config_get(algo, "use_pf_ppo", False)),
        "rollout_correction": None if correction is None else plain(correction),
        # actor: actor_rollout_ref.actor.*
        "loss_mode": str(policy_loss.get("loss_mode") or "vanilla"),
        "loss_agg_mode": str(config_get(actor, "loss_agg_mode", "token-mean")),
        "clip_ratio": clip_ratio,
        "clip_ratio_low": float(config_get(actor, "clip_ratio_low", clip_ratio)),
        "clip_ratio_high": float(config_get(actor, "clip_ratio_high", clip_ratio)),
        "clip_ratio_c": float(config_get(actor, "clip_ratio_c", 3.0)),
        "use_kl_loss": bool(config_get(actor, "use_kl_loss", False)),
        "kl_loss_coef": float(config_get(actor, "kl_loss_coef", 0.001)),
        "kl_loss_type": str(config_get(actor, "kl_loss_type", "low_var_kl")),
        "entropy_coeff": float(config_get(actor, "entropy_coeff", 0.0)),
        "loss_scale_factor": config_get(actor, "loss_scale_factor", None),
        "policy_loss": {k: v for k, v in policy_loss.items() if k != "rollout_correction"},
        "tau_pos": float(config_get(actor, "tau_pos", 1.0)),
        "tau_neg": float(config_get(actor, "tau_neg", 1.05)),
        "ppo_epochs": int(config_get(actor, "ppo_epochs", 1)),
        "ppo_mini_batch_size": config_get(actor, "ppo_mini_batch_size", None),
        "rollout_n": config_get(config, "actor_rollout_ref.rollout.n", None),
        "horizon": horizon,
    }
    return plain(out)


# --------------------------------------------------------------------------- the driver batch


@dataclass
class RolloutRecord:
    """One driver batch as a rollout bundle's contents (flat per-token payloads)."""

    step: int
    samples: list[dict[str, Any]]
    payloads: dict[str, torch.Tensor]
    routes: dict[str, torch.Tensor]
    recompute: dict[str, Any]
    expected: dict[str, dict[str, Any]]
    #: the per-sample ``uid`` groups (order of first appearance) and response lengths
    groups: list[int]
    lengths: list[int]


def rollout_record(
    batch: Any,
    config: Any,
    *,
    step: int,
    kl_coef: float | None = None,
    metrics: Mapping[str, Any] | None = None,
) -> RolloutRecord:
    """The rollout bundle of a verl driver batch taken after ``update_actor``.

    ``metrics``: the step's metrics as verl logged them; ``actor/reward_kl_penalty_coeff``
    gives the applied KL coefficient when ``kl_coef`` is not given, and
    ``actor/reward_kl_penalty`` the KL it measured (replay compares both).
    """
    view = BatchView.of(batch)
    t = view.tensors
    responses = t["responses"]
    rows, horizon = int(responses.shape[0]), int(responses.shape[1])
    attention = cpu(t["attention_mask"]).to(torch.int64)
    if "prompts" in t:
        prompt_width = int(t["prompts"].shape[1])
    else:
        prompt_width = int(attention.shape[1]) - horizon
    response_attention = attention[:, prompt_width:]
    lengths = response_attention.sum(-1)
    prompt_lengths = attention[:, :prompt_width].sum(-1)
    keep = keep_mask(lengths, horizon)
    mask = cpu(t["response_mask"]) if "response_mask" in t else response_attention
    groups = groups_of_uids(view.non_tensor.get("uid"), rows)
    metrics = dict(metrics or {})
    if kl_coef is None and "actor/reward_kl_penalty_coeff" in metrics:
        kl_coef = float(metrics["actor/reward_kl_penalty_coeff"])
    recompute = VERL.recompute_config(config, kl_coef=kl_coef, horizon=horizon)
    scores = cpu(t["token_level_scores"]).float() if "token_level_scores" in t else None
    rewards = cpu(t["token_level_rewards"]).float() if "token_level_rewards" in t else None
    samples = []
    for row in range(rows):
        sample: dict[str, Any] = {
            "sample_id": f"s{row}",
            "group_index": groups[row],
            "response_length": int(lengths[row]),
            "total_length": int(lengths[row] + prompt_lengths[row]),
        }
        if scores is not None:
            sample["raw_reward"] = float(scores[row][keep[row]].double().sum())
        if rewards is not None:
            sample["reward"] = float(rewards[row][keep[row]].double().sum())
        samples.append(sample)
    payloads = {"loss_mask": pack(mask, keep).to(torch.int64)}
    for name, key in ROLLOUT_TOKEN_FIELDS.items():
        if key in t:
            payloads[name] = pack(t[key], keep)
    routes = {}
    if "routed_experts" in t:
        real = torch.cat([attention[:, :prompt_width], response_attention], dim=1)
        routes["rollout_routed_experts"] = trim_routes(t["routed_experts"], real)
    expected: dict[str, dict[str, Any]] = {}
    if "reward_baselines" in t:  # remax's greedy-response rewards: an input, kept per sample
        baselines = [float(x) for x in cpu(t["reward_baselines"]).reshape(-1)]
        expected[Stage.ADVANTAGE_ESTIMATE] = {"reward_baselines": baselines}
    if "actor/reward_kl_penalty" in metrics:  # the KL apply_kl_penalty measured
        measured = float(metrics["actor/reward_kl_penalty"])
        expected[Stage.ADVANTAGE_KL] = {"reward_kl_penalty": measured}
    return RolloutRecord(
        step=int(step),
        samples=samples,
        payloads=payloads,
        routes=routes,
        recompute=recompute,
        expected=expected,
        groups=groups,
        lengths=[int(x) for x in lengths],
    )


# --------------------------------------------------------------------------- actor micro-batches


@dataclass
class MicroBatchRecord:
    """What one call of verl's actor loss consumed and produced (``capture_actor`` fills it).

    Tensors are padded [b, R] as verl's loss saw them (``no_padding_2_padding`` output);
    ``rows`` are the samples' rows in the driver batch (`ROW_KEY`), ``groups`` their ``uid``
    groups (`GROUP_KEY`). ``loss`` is the value verl's loss returned (policy loss minus
    ``entropy_coeff * entropy_loss`` plus ``kl_loss_coef * kl_loss``); ``metrics`` its logged
    parts (`LOSS_METRICS`, with or without the ``actor/`` prefix); ``dp_size``,
    ``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor`` the
    ``global_batch_info`` its ``agg_loss`` divided by. ``optimizer_step`` is the mini-batch's
    index within this ``update_actor`` (epoch * mini-batches + mini-batch).
    """

    rows: Sequence[int]
    log_probs: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    loss: float
    metrics: Mapping[str, Any] = field(default_factory=dict)
    entropy: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    rollout_is_weights: torch.Tensor | None = None
    groups: Sequence[int] | None = None
    response_lengths: Sequence[int] | None = None
    optimizer_step: int = 0
    dp_size: int = 1
    batch_num_tokens: float | None = None
    global_batch_size: float | None = None
    loss_scale_factor: float | None = None
    dp_rank: int = 0


def _number(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.detach().float().cpu().item()
    value = float(value)
    return value if math.isfinite(value) else None


def _metrics(record: MicroBatchRecord) -> dict[str, float]:
    out = {}
    for name, value in record.metrics.items():
        short = name.removeprefix("actor/")
        if short in LOSS_METRICS:
            number = _number(value.value if hasattr(value, "value") else value)
            if number is not None:
                out[short] = number
    return out


def _packer(keep: torch.Tensor) -> Any:
    """`pack` over one ``keep`` mask for many fields: the kept positions found once, then
    one ``index_select`` per field (the same values in the same order as ``value[keep]``,
    a new tensor). A field of another shape goes through `pack` (which refuses it)."""
    flat = keep.reshape(-1).nonzero().squeeze(1)

    def packed(value: torch.Tensor) -> torch.Tensor:
        value = value.detach().cpu()
        if value.shape != keep.shape:
            return pack(value, keep)
        return value.reshape(-1).index_select(0, flat)

    return packed


def _micro_batch(record: MicroBatchRecord, number: int, ids: SampleIds) -> dict[str, Any]:
    """One record as ``StepCapture.add`` arguments plus its expected values."""
    rows = [
        int(r) for r in (record.rows.tolist() if hasattr(record.rows, "tolist") else record.rows)
    ]
    mask = cpu(record.response_mask)
    horizon = int(mask.shape[-1])
    if record.response_lengths is not None:
        lengths = torch.tensor([int(x) for x in record.response_lengths])
    else:  # the last loss token ends the response (trailing masked tokens are not kept)
        lengths = last_token_lengths(mask)
    keep = keep_mask(lengths, horizon)
    if record.groups is None:  # a bundle's samples must name their semantic group
        raise ValueError(
            f"a micro-batch record has no groups: add {GROUP_KEY!r} to the batch "
            "(tag_batch) before update_actor"
        )
    groups = [int(g) for g in record.groups]
    response_lengths = [int(n) for n in lengths.tolist()]  # one read, not one a sample
    samples = []
    for i, row in enumerate(rows):
        samples.append(
            {
                "sample_id": ids(f"s{row}", row),
                "group_index": groups[i],
                "response_length": response_lengths[i],
            }
        )
    packed = _packer(keep)
    payloads: dict[str, Any] = {
        "log_probs": packed(record.log_probs).float(),
        "old_log_probs": packed(record.old_log_probs).float(),
        "advantages": packed(record.advantages).float(),
        "loss_mask": packed(mask).to(torch.int64),
    }
    for name in OPTIONAL_TOKEN_FIELDS:
        value = getattr(record, name)
        if value is not None:
            payloads[name] = packed(value).float()
    expected = {
        "loss": _number(record.loss),
        **_metrics(record),
        "dp_size": int(record.dp_size),
        "batch_num_tokens": _number(record.batch_num_tokens),
        "global_batch_size": _number(record.global_batch_size),
        "loss_scale_factor": _number(record.loss_scale_factor),
        "horizon": horizon,
        "dp_rank": int(record.dp_rank),
    }
    return {
        "mb_id": micro_batch_id(number),
        "samples": samples,
        "payloads": payloads,
        "expected": expected,
    }


def step_settings(config: Any, *, kl_coef: float | None = None) -> dict[str, Any]:
    """``config.verl`` of a step bundle but for its ``horizon`` (None here): the trainer
    config read and converted once, for every step bundle of an ``update_actor`` call
    (`step_records` ``settings``). Reading an OmegaConf config costs milliseconds, which
    a read per flush spent on the training thread."""
    return algorithm_config(config, kl_coef=kl_coef)


def step_records(
    records: Sequence[MicroBatchRecord],
    config: Any,
    *,
    step: int,
    kl_coef: float | None = None,
    settings: Mapping[str, Any] | None = None,
) -> list[StepRecord]:
    """The step bundles of one ``update_actor`` call's micro-batch records: one per
    ``optimizer_step``, rollout id ``step`` (verl's global step), step id the optimizer
    step; micro-batches numbered in the order they ran.

    ``settings``: `step_settings` of ``config`` (and ``kl_coef``) when the caller read it
    already (the actor reads it once per ``update_actor``); ``config`` and ``kl_coef`` are
    then not read. Without it ``config`` is read here, once a call."""
    if settings is None:
        settings = step_settings(config, kl_coef=kl_coef)
    by_step: dict[int, list[MicroBatchRecord]] = {}
    for record in records:
        by_step.setdefault(int(record.optimizer_step), []).append(record)
    out = []
    for optimizer_step, members in sorted(by_step.items()):
        horizon = int(members[0].response_mask.shape[-1])
        recompute = {KEY: {**settings, "horizon": horizon}}  # the key keeps its place
        ids = SampleIds()
        batches = [_micro_batch(record, n, ids) for n, record in enumerate(members)]
        per_mb = {mb["mb_id"]: mb["expected"] for mb in batches}
        total: dict[str, Any] = {"micro_batches": per_mb}
        for name in ("loss", "pg_loss", "entropy_loss", "kl_loss"):  # verl sums these
            values = [mb.get(name) for mb in per_mb.values()]
            if values and all(v is not None for v in values):
                total[name] = math.fsum(values)
        out.append(StepRecord(int(step), optimizer_step, batches, total, recompute))
    return out
