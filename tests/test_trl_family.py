"""The loss family selected from a Relax-style bundle's config (not only TRL's): GSPO, Dr.GRPO,
DAPO and CISPO replayed for another producer.

Expected values come from an independent oracle below, written on padded [B, L] torch
tensors the way TRL's ``_compute_loss`` is, never from trajstore's NumPy kernels.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import edit_json, make_contents, resign_bundle
from trajstore.examples.replay_builders import replay, statuses

from trajstore.bundle.writer import write_bundle

pytestmark = pytest.mark.unit

EPS_REWARD = 1e-4

#: estimator -> the config keys a Relax-style producer sets (docs/integrations.md)
ESTIMATORS: dict[str, dict[str, Any]] = {
    "gspo": {
        "policy_loss": "grpo",
        "importance_sampling_level": "sequence",
        "eps_clip": 3e-4,
        "eps_clip_high": 4e-4,
        "reward_scale": "group",
    },
    "dr_grpo": {"policy_loss": "dr_grpo", "max_response_length": 8, "reward_scale": "none"},
    "dapo": {
        "policy_loss": "dapo",
        "eps_clip": 0.2,
        "eps_clip_high": 0.28,
        "loss_token_normalizer": 13.0,
        "reward_scale": "group",
    },
    "cispo": {"policy_loss": "cispo", "eps_clip_high": 1.5, "reward_scale": "batch"},
}


# --------------------------------------------------------------------------- the oracle


def _pad(flat: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths), max(lengths))
    for row, piece in enumerate(torch.split(flat, lengths)):
        out[row, : len(piece)] = piece
    return out


def oracle_advantages(raw: torch.Tensor, group_size: int, scale: str) -> torch.Tensor:
    grouped = raw.view(-1, group_size)
    mean = grouped.mean(dim=1).repeat_interleave(group_size)
    if scale == "batch":
        std = raw.std().expand_as(raw)
    else:
        std = grouped.std(dim=1).repeat_interleave(group_size)
    advantages = raw - mean
    return advantages if scale == "none" else advantages / (std + EPS_REWARD)


def oracle_loss(
    lp: torch.Tensor,
    old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: dict[str, Any],
    accumulation: int,
    step_tokens: float,
) -> torch.Tensor:
    """One micro-batch's loss, padded [B, L] tensors, as TRL 1.16 computes it; dapo and cispo
    divide by ``loss_token_normalizer``, else by the step's loss tokens."""
    eps_low = config.get("eps_clip", 0.2)
    eps_high = config.get("eps_clip_high", eps_low)
    log_ratio = lp - old
    if config.get("importance_sampling_level") == "sequence":
        weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        weights = log_ratio
    coef_1 = torch.exp(weights)
    adv = advantages.unsqueeze(1)
    kind = config["policy_loss"]
    if kind == "cispo":
        per_token = -torch.clamp(coef_1, max=eps_high) * adv * lp
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if kind == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
    if kind == "dr_grpo":
        size = per_token.size(0) * config["max_response_length"]
        return (per_token * mask).sum() / size / accumulation
    return (per_token * mask).sum() / config.get("loss_token_normalizer", step_tokens)


# --------------------------------------------------------------------------- bundles


def relax_bundle(dest: Path, estimator: str, *, loss_offset: float = 0.0) -> Path:
    """A Relax-style step bundle (two micro-batches) whose expected values the oracle gives."""
    contents = make_contents(groups=2, samples_per_group=4, seed=3)
    config = {**contents.config, **ESTIMATORS[estimator]}
    config["gradient_accumulation_steps"] = 2
    contents.config = config
    samples = contents.samples
    raw = torch.tensor([sample["raw_reward"] for sample in samples])
    rewards = oracle_advantages(raw, 4, config["reward_scale"])
    lengths = [sample["response_length"] for sample in samples]
    for sample, reward in zip(samples, rewards.tolist(), strict=True):
        sample["reward"] = reward
    contents.payloads["advantages"] = torch.repeat_interleave(rewards, torch.tensor(lengths))
    contents.expected["reward.post_process"] = {"rewards": rewards.tolist()}
    payloads = contents.payloads
    total = torch.zeros(())
    step_tokens = float(sum(sum(sample["loss_mask"]) for sample in samples))
    for mb in sorted({sample["micro_batch_id"] for sample in samples}):
        rows = [i for i, sample in enumerate(samples) if sample["micro_batch_id"] == mb]
        mb_lengths = [lengths[i] for i in rows]

        def cut(name: str, rows: list[int] = rows, mb_lengths: list[int] = mb_lengths) -> Any:
            flat = torch.split(payloads[name], lengths)
            return _pad(torch.cat([flat[i] for i in rows]), mb_lengths)

        mask = _pad(
            torch.tensor([m for i in rows for m in samples[i]["loss_mask"]], dtype=torch.float32),
            mb_lengths,
        )
        total = total + oracle_loss(
            cut("log_probs"), cut("old_log_probs"), rewards[rows], mask, config, 2, step_tokens
        )
    contents.expected["loss.policy"] = {"loss": float(total) + loss_offset}
    return write_bundle(dest, contents)


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_a_relax_style_bundle_replays_the_estimator_its_config_names(
    tmp_path: Path, estimator: str
) -> None:
    report = replay(relax_bundle(tmp_path / "b", estimator))
    found = statuses(report)
    assert report.exit_code == 0
    assert (found["reward.post_process"], found["loss.policy"]) == ("pass", "pass")


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_a_wrong_recorded_loss_is_found_at_loss_policy(tmp_path: Path, estimator: str) -> None:
    report = replay(relax_bundle(tmp_path / "b", estimator, loss_offset=1e-3))
    assert report.first_divergent_stage == "loss.policy"
    assert report.first_divergence()["field"] == "loss"


@pytest.mark.parametrize(
    ("estimator", "key", "other"),
    [
        ("gspo", "importance_sampling_level", "token"),
        ("dr_grpo", "policy_loss", "grpo"),
        ("dapo", "policy_loss", "cispo"),
        ("cispo", "eps_clip_high", 0.5),
    ],
)
def test_the_config_key_selects_the_math(
    tmp_path: Path, estimator: str, key: str, other: Any
) -> None:
    bundle = relax_bundle(tmp_path / "b", estimator)
    edit_json(bundle / "index.json", lambda doc: doc["config"].__setitem__(key, other))
    resign_bundle(bundle)
    assert replay(bundle).first_divergent_stage == "loss.policy"


def test_a_family_key_on_a_v1_bundle_without_policy_loss_is_named_unsupported(
    tmp_path: Path,
) -> None:
    contents = make_contents(seed=1)
    contents.config = {**contents.config, "delta": 1.5}
    report = replay(write_bundle(tmp_path / "b", contents), "loss.policy")
    outcome = next(s for s in report.bundles[0].stages if s.stage == "loss.policy")
    assert outcome.status == "unsupported" and "policy_loss" in outcome.reason


def test_a_v1_bundle_replays_the_v1_stages_and_a_family_bundle_the_variants(
    tmp_path: Path,
) -> None:
    v1 = replay(write_bundle(tmp_path / "v1", make_contents(seed=1)), "sample")
    family = replay(relax_bundle(tmp_path / "family", "dapo"))
    assert {s.version for s in v1.bundles[0].stages} == {"v1"}
    versions = {s.stage: s.version for s in family.bundles[0].stages}
    assert (versions["loss.policy"], versions["sample"]) == ("family-v1", "v1")


def test_a_second_variant_of_the_same_name_is_refused() -> None:
    import dataclasses

    from trajstore.replay import losses
    from trajstore.replay.registry import StageVariant, register_variant

    original = StageVariant(
        stage="loss.policy",
        name=losses.FAMILY,
        applies=losses.uses_family,
        run=losses.stage_loss_policy,
        capability=losses.family_capability("loss.policy"),
        version="family-v9",
    )
    with pytest.raises(ValueError, match="registered twice"):
        register_variant(dataclasses.replace(original))


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_replayed_float32_sums_are_torchs_bit_for_bit(rows: int) -> None:
    """TRL's group means are torch's float32 sums; replay adds in torch's order (its CPU
    cascade, with the SIMD width the capture records), so every length gives torch's bits."""
    from trajstore.replay.losses import CPU_SUM_ORDERS, REWARD_SUM_ORDERS, torch_cpu_nansum

    lanes = REWARD_SUM_ORDERS[CPU_SUM_ORDERS[torch.backends.cpu.get_cpu_capability()]]
    generator = torch.Generator().manual_seed(rows)
    lengths = [*range(1, 70), 100, 127, 256, 1000, 4099]
    for length in lengths:
        values = torch.randn(rows, length, generator=generator) * 10 + 3
        values[0, length // 2] = float("nan")  # nansum: a NaN counts as 0
        assert np.array_equal(
            torch_cpu_nansum(values.numpy(), lanes), torch.nansum(values, dim=1).numpy()
        ), length
