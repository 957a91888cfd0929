"""Injected producer faults: each must be found at the right stage, sample and token.

Every bundle is otherwise mathematically consistent (`replay_builders`): the
fault is the only thing the producer did differently from what its recorded
config says, so the first divergent stage is where the fault lives.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from trajstore.examples import oracle
from trajstore.examples.replay_builders import Faults, replay, stage, statuses, write_consistent

pytestmark = pytest.mark.unit

BEFORE_LOSS = ("sample", "reward.raw", "reward.post_process", "advantage.kl", "advantage.estimate")


# --------------------------------------------------------------------------- KL type


def test_flipped_kl_type_is_found_at_advantage_kl(tmp_path: Path) -> None:
    path, _ = write_consistent(tmp_path / "b", faults=Faults(kl_type="k1"))
    report = replay(path)
    assert report.first_divergent_stage == "advantage.kl"
    assert report.exit_code == 1


def test_flipped_kl_type_first_divergence_is_first_token(tmp_path: Path) -> None:
    path, _ = write_consistent(tmp_path / "b", faults=Faults(kl_type="k1"))
    first = replay(path).first_divergence()
    assert (first["sample_id"], first["field"], first["token_offset"]) == ("s-0", "kl", 0)


def test_flipped_kl_type_counts_every_differing_token(tmp_path: Path) -> None:
    path, built = write_consistent(tmp_path / "b", faults=Faults(kl_type="k1"))
    p = built.contents.payloads
    k1 = p["kl"].astype(np.float64)
    k3 = oracle.approx_kl(p["old_log_probs"], p["ref_log_probs"], "k3").astype(np.float64)
    differing = int(np.count_nonzero(np.abs(k3 - k1) > 1e-6 + 1e-5 * np.abs(k1)))
    assert stage(replay(path), "advantage.kl").mismatch_count == differing


def test_flipped_kl_type_leaves_advantages_and_loss_passing(tmp_path: Path) -> None:
    # GRPO advantages do not use KL, and no KL loss is configured.
    path, _ = write_consistent(tmp_path / "b", faults=Faults(kl_type="k1"))
    s = statuses(replay(path))
    assert (s["advantage.estimate"], s["loss.policy"]) == ("pass", "pass")


# --------------------------------------------------------------------------- eps_clip_high


def test_wrong_eps_clip_high_is_found_at_loss_policy(tmp_path: Path) -> None:
    path, _ = write_consistent(tmp_path / "b", faults=Faults(eps_clip_high=0.2))
    report = replay(path)
    assert report.first_divergent_stage == "loss.policy"
    assert all(statuses(report)[s] == "pass" for s in BEFORE_LOSS)


def test_wrong_eps_clip_high_names_the_clipped_loss_fields(tmp_path: Path) -> None:
    path, _ = write_consistent(tmp_path / "b", faults=Faults(eps_clip_high=0.2))
    out = stage(replay(path), "loss.policy")
    fields = {d.field for d in out.divergences}
    # Clip range changes the surrogate and the clip fraction, not entropy or ppo_kl.
    assert {"loss", "pg_loss", "pg_clipfrac"} <= fields
    assert not fields & {"entropy_loss", "ppo_kl"}


# --------------------------------------------------------------------------- loss mask


def test_shifted_loss_mask_surfaces_only_at_loss_policy(tmp_path: Path) -> None:
    # The mask enters nothing but the loss-side sum_of_sample_mean: with a
    # valid 0/1 mask of the right length, every earlier stage is unaffected.
    path, _ = write_consistent(tmp_path / "b", faults=Faults(loss_mask_shift=1))
    report = replay(path)
    assert report.first_divergent_stage == "loss.policy"
    assert all(statuses(report)[s] == "pass" for s in BEFORE_LOSS)


def test_shifted_loss_mask_moves_every_masked_mean(tmp_path: Path) -> None:
    path, _ = write_consistent(tmp_path / "b", faults=Faults(loss_mask_shift=1))
    fields = {d.field for d in stage(replay(path), "loss.policy").divergences}
    assert {"loss", "pg_loss", "entropy_loss", "ppo_kl"} <= fields


def test_loss_mask_one_entry_too_long_is_named_at_sample_stage(tmp_path: Path) -> None:
    path, _ = write_consistent(tmp_path / "b", faults=Faults(loss_mask_extra_entry="s-5"))
    report = replay(path)
    out = stage(report, "sample")
    assert report.first_divergent_stage == "sample"
    assert "'s-5'" in out.reason and "loss_mask" in out.reason


# --------------------------------------------------------------------------- dropped sample


def test_dropped_sample_fails_sample_stage_naming_the_sample(tmp_path: Path) -> None:
    path, built = write_consistent(tmp_path / "b", faults=Faults(dropped_sample="s-31"))
    report = replay(path)
    out = stage(report, "sample")
    assert report.first_divergent_stage == "sample"
    assert "s-31" in out.reason
    located = {(d.field, d.sample_id, d.token_offset) for d in out.divergences}
    assert ("advantages", "s-31", 0) in located


def test_dropped_sample_fails_every_per_token_stage_instead_of_misaligning(tmp_path: Path) -> None:
    # Payloads one sample short must never be compared token for token.
    path, _ = write_consistent(tmp_path / "b", faults=Faults(dropped_sample="s-31"))
    report = replay(path)
    for name in ("advantage.kl", "advantage.estimate", "loss.policy"):
        out = stage(report, name)
        assert out.status == "fail"
        assert "response tokens" in out.reason


def test_dropped_sample_with_selection_fails_without_crashing(tmp_path: Path) -> None:
    path, _ = write_consistent(tmp_path / "b", faults=Faults(dropped_sample="s-31"))
    report = replay(path, samples=("s-31",))
    assert stage(report, "advantage.estimate").status == "fail"
    assert report.exit_code == 1


# --------------------------------------------------------------------------- NaN


def test_nan_in_log_probs_is_located_at_sample_stage(tmp_path: Path) -> None:
    path, _ = write_consistent(tmp_path / "b", faults=Faults(nan_at=("log_probs", "s-4", 2)))
    report = replay(path)
    assert report.first_divergent_stage == "sample"
    d = stage(report, "sample").divergences[0]
    assert (d.field, d.sample_id, d.token_offset) == ("log_probs", "s-4", 2)


def test_nan_in_log_probs_makes_loss_policy_fail_not_pass(tmp_path: Path) -> None:
    path, _ = write_consistent(tmp_path / "b", faults=Faults(nan_at=("log_probs", "s-4", 2)))
    out = stage(replay(path), "loss.policy")
    assert out.status == "fail"
    assert "pg_loss" in {d.field for d in out.divergences}
