"""Tests of the NumPy GRPO replay kernels (contract: docs/replay-math.md).

Hand-computed pins, hypothesis properties, parity with the independent torch
oracle (examples/oracle.py, the same one replay tests build bundles with), and the
public producer's real fixture bundle.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import FIXTURES
from hypothesis import example, given, settings
from hypothesis import strategies as st
from trajstore.examples import oracle

from trajstore.errors import TrajstoreError
from trajstore.replay.kernels import (
    KernelInputError,
    approx_kl,
    grpo_normalize,
    grpo_returns,
    locate_token,
    loss_policy,
    policy_loss_terms,
    segment_ids,
    segment_offsets,
    sum_of_sample_mean,
)

pytestmark = pytest.mark.integration

FIXTURE = FIXTURES / "example_bundle"
ATOL, RTOL = 1e-6, 1e-5
E = math.e


def f32(*xs: float) -> np.ndarray:
    return np.array(xs, dtype=np.float32)


def close(actual, expected, atol: float = ATOL, rtol: float = RTOL) -> None:
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), atol=atol, rtol=rtol)


# --------------------------------------------------------------------------- approx_kl

LP, BASE = f32(0.0, -1.0), f32(-1.0, 0.0)  # log_ratio = [1, -1]


def test_k1_is_log_ratio() -> None:
    close(approx_kl(LP, BASE, "k1"), [1.0, -1.0])


def test_k2_is_half_squared_log_ratio() -> None:
    close(approx_kl(LP, BASE, "k2"), [0.5, 0.5])


def test_k3_is_exp_neg_minus_one_plus_log_ratio() -> None:
    close(approx_kl(LP, BASE, "k3"), [1 / E, E - 2])


def test_k3_with_importance_ratio_scales_per_token() -> None:
    close(approx_kl(LP, BASE, "k3", importance_ratio=f32(2.0, 0.5)), [2 / E, (E - 2) / 2])


def test_k1_with_importance_ratio() -> None:
    close(approx_kl(LP, BASE, "k1", importance_ratio=f32(3.0, 3.0)), [3.0, -3.0])


def test_low_var_kl_equals_k3_inside_clamp() -> None:
    close(approx_kl(LP, BASE, "low_var_kl"), approx_kl(LP, BASE, "k3"))


def test_low_var_kl_clamps_to_ten() -> None:
    # log_ratio = -5: k3 = e^5 - 6 = 142.41...
    assert approx_kl(f32(0.0), f32(5.0), "low_var_kl")[0] == pytest.approx(10.0)


def test_k3_is_not_clamped() -> None:
    assert approx_kl(f32(0.0), f32(5.0), "k3")[0] == pytest.approx(math.exp(5) - 6, rel=1e-6)


def test_low_var_kl_clamps_after_the_ratio() -> None:
    # 0.05 * 142.41 = 7.12: under the clamp only because the ratio came first.
    kl = approx_kl(f32(0.0), f32(5.0), "low_var_kl", importance_ratio=f32(0.05))
    assert kl[0] == pytest.approx(0.05 * (math.exp(5) - 6), rel=1e-6)


def test_low_var_kl_clamps_negative_side() -> None:
    kl = approx_kl(f32(0.0), f32(5.0), "low_var_kl", importance_ratio=f32(-1.0))
    assert kl[0] == pytest.approx(-10.0)


def test_approx_kl_stays_float32() -> None:
    assert approx_kl(LP.astype(np.float64), BASE, "k3").dtype == np.float32


def test_unknown_kl_type_raises() -> None:
    with pytest.raises(KernelInputError, match="k4"):
        approx_kl(LP, BASE, "k4")


def test_kernel_input_error_is_value_and_trajstore_error() -> None:
    assert issubclass(KernelInputError, ValueError)
    assert issubclass(KernelInputError, TrajstoreError)


def test_approx_kl_length_mismatch_raises() -> None:
    with pytest.raises(KernelInputError):
        approx_kl(f32(0.0, 1.0), f32(0.0), "k1")


# --------------------------------------------------------------------------- policy loss terms


def _terms(ratios, advs, eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=None):
    new = np.log(np.array(ratios, dtype=np.float64)).astype(np.float32)
    old = np.zeros_like(new)
    return policy_loss_terms(old, new, f32(*advs), eps_clip, eps_clip_high, eps_clip_c)


def test_clip_high_side_positive_advantage_clips() -> None:
    pg, cf, _ = _terms([1.5], [1.0])
    close(pg, [-1.28])
    close(cf, [1.0])


def test_clip_high_side_negative_advantage_keeps_ratio() -> None:
    pg, cf, _ = _terms([1.5], [-1.0])
    close(pg, [1.5], rtol=1e-6)
    close(cf, [0.0])


def test_clip_low_side_negative_advantage_clips() -> None:
    pg, cf, _ = _terms([0.5], [-1.0])
    close(pg, [0.8])
    close(cf, [1.0])


def test_clip_low_side_positive_advantage_keeps_ratio() -> None:
    pg, cf, _ = _terms([0.5], [1.0])
    close(pg, [-0.5], rtol=1e-6)
    close(cf, [0.0])


def test_asymmetric_clip_uses_eps_clip_high_above_one() -> None:
    pg, cf, _ = _terms([1.25], [1.0], eps_clip=0.2, eps_clip_high=0.28)
    close(pg, [-1.25], rtol=1e-6)
    close(cf, [0.0])


def test_symmetric_clip_when_eps_clip_high_is_none() -> None:
    pg, cf, _ = _terms([1.25], [1.0], eps_clip=0.2, eps_clip_high=None)
    close(pg, [-1.2])
    close(cf, [1.0])


def test_ppo_kl_is_old_minus_new() -> None:
    _, _, kl = policy_loss_terms(f32(-0.5, -1.0), f32(-0.75, -0.25), f32(1, 1), 0.2, 0.2)
    close(kl, [0.25, -0.75])


def test_dual_clip_bounds_negative_advantage() -> None:
    pg, cf, _ = _terms([5.0], [-1.0], eps_clip_c=3.0)
    close(pg, [3.0])
    close(cf, [0.0])


def test_dual_clip_leaves_positive_advantage_alone() -> None:
    pg, _, _ = _terms([5.0], [1.0], eps_clip_c=3.0)
    close(pg, [-1.28])


def test_dual_clip_inactive_below_bound() -> None:
    pg, _, _ = _terms([2.0], [-1.0], eps_clip_c=3.0)
    close(pg, [2.0], rtol=1e-6)


def test_dual_clip_constant_must_exceed_one() -> None:
    with pytest.raises(KernelInputError, match="eps_clip_c"):
        _terms([1.0], [1.0], eps_clip_c=1.0)


# --------------------------------------------------------------------------- reductions


def test_sum_of_sample_mean_masked_tokens() -> None:
    # sample 0: (1 + 3) / 2 ; sample 1 fully masked: 0 / max(0, 1)
    assert sum_of_sample_mean(f32(1, 2, 3, 10, 20), [1, 0, 1, 0, 0], [3, 2]) == pytest.approx(2.0)


def test_sum_of_sample_mean_weighs_samples_not_tokens() -> None:
    assert sum_of_sample_mean(f32(1, 1, 1, 4), [1, 1, 1, 1], [3, 1]) == pytest.approx(5.0)


def test_sum_of_sample_mean_returns_float32_scalar() -> None:
    assert sum_of_sample_mean(f32(1, 2), [1, 1], [2]).dtype == np.float32


def test_sum_of_sample_mean_rejects_non_binary_mask() -> None:
    with pytest.raises(KernelInputError, match="0/1"):
        sum_of_sample_mean(f32(1, 2), [1, 2], [2])


def test_sum_of_sample_mean_rejects_wrong_token_count() -> None:
    with pytest.raises(KernelInputError, match="sum\\(response_length\\)"):
        sum_of_sample_mean(f32(1, 2, 3), [1, 1, 1], [2])


def test_loss_policy_hand_computed() -> None:
    # ratio 1 -> pg = -A; sample 0 keeps token 0 only, sample 1 its one token.
    out = loss_policy(
        f32(0, 0, 0),
        f32(0, 0, 0),
        f32(1, 1, -2),
        f32(0.5, 9, 1.5),
        [1, 0, 1],
        [2, 1],
        eps_clip=0.2,
        eps_clip_high=0.28,
        entropy_coef=0.1,
    )
    assert out == pytest.approx(
        {"pg_loss": 1.0, "pg_clipfrac": 0.0, "ppo_kl": 0.0, "entropy_loss": 2.0, "loss": 0.8}
    )


def test_loss_policy_kl_loss_term() -> None:
    out = loss_policy(
        f32(0, 0, 0),
        f32(0, 0, 0),
        f32(1, 1, -2),
        f32(0.5, 9, 1.5),
        [1, 0, 1],
        [2, 1],
        eps_clip=0.2,
        eps_clip_high=0.28,
        entropy_coef=0.1,
        use_kl_loss=True,
        kl_loss_coef=0.2,
        kl_loss_type="k1",
        ref_log_probs=f32(-1, 0, 0.5),
    )
    assert out["kl_loss"] == pytest.approx(0.5)
    assert out["loss"] == pytest.approx(0.9)


def test_loss_policy_without_kl_has_no_kl_key() -> None:
    out = loss_policy(f32(0), f32(0), f32(1), f32(0), [1], [1], eps_clip=0.2)
    assert set(out) == {"loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl"}


def test_loss_policy_kl_needs_ref_log_probs() -> None:
    with pytest.raises(KernelInputError, match="ref_log_probs"):
        loss_policy(f32(0), f32(0), f32(1), f32(0), [1], [1], use_kl_loss=True)


# --------------------------------------------------------------------------- GRPO rewards

SQRT_HALF = 0.5 / (math.sqrt(0.5) + 1e-6)


def test_grpo_group_of_two_normalized() -> None:
    close(grpo_normalize([1.0, 0.0], [0, 0], 2), [SQRT_HALF, -SQRT_HALF])


def test_grpo_std_is_unbiased() -> None:
    # [1, 2, 6]: centred [-2, -1, 3], unbiased var 14 / 2 = 7
    s = math.sqrt(7) + 1e-6
    close(grpo_normalize([1.0, 2.0, 6.0], [4, 4, 4], 3), [-2 / s, -1 / s, 3 / s])


def test_grpo_groups_of_size_one_become_zero_without_std() -> None:
    close(grpo_normalize([3.0, -2.0], [0, 1], 1), [0.0, 0.0])


def test_grpo_interleaved_groups_are_semantic() -> None:
    out = grpo_normalize([1.0, 10.0, 0.0, 20.0], [1, 0, 1, 0], 2)
    close(out, [SQRT_HALF, -SQRT_HALF, -SQRT_HALF, SQRT_HALF])


def test_grpo_mean_only_without_std_normalization() -> None:
    out = grpo_normalize([1.0, 10.0, 0.0, 20.0], [1, 0, 1, 0], 2, std_normalization=False)
    close(out, [0.5, -5.0, -0.5, 5.0])


def test_grpo_std_only_for_grpo_estimator() -> None:
    out = grpo_normalize([1.0, 0.0], [0, 0], 2, estimator="reinforce_plus_plus_baseline")
    close(out, [0.5, -0.5])


def test_grpo_without_rewards_normalization_passes_through() -> None:
    close(grpo_normalize([1.0, 0.0], [0, 0], 2, rewards_normalization=False), [1.0, 0.0])


def test_grpo_refuses_missing_group_index_naming_sample() -> None:
    with pytest.raises(KernelInputError, match="'s-1'.*group_index"):
        grpo_normalize([1.0, 0.0], [0, None], 2, sample_ids=["s-0", "s-1"])


def test_grpo_refuses_wrong_group_size_naming_group() -> None:
    with pytest.raises(KernelInputError, match="g-1 has 1 sample"):
        grpo_normalize([1.0, 0.0, 2.0], [0, 0, 1], 2)


def test_grpo_refuses_group_larger_than_n() -> None:
    with pytest.raises(KernelInputError, match="g-0 has 4"):
        grpo_normalize([1.0, 0.0, 2.0, 3.0], [0, 0, 0, 0], 2)


def test_grpo_returns_broadcast_reward_per_token() -> None:
    close(grpo_returns([0.5, -1.0], [2, 3]), [0.5, 0.5, -1, -1, -1])


def test_grpo_returns_accepts_per_token_rewards() -> None:
    close(grpo_returns([[0.1, 0.2], 3.0], [2, 1]), [0.1, 0.2, 3.0])


def test_grpo_returns_rejects_count_mismatch() -> None:
    with pytest.raises(KernelInputError):
        grpo_returns([0.5], [2, 3])


# --------------------------------------------------------------------------- segments


def test_segment_offsets_are_starts_plus_total() -> None:
    assert segment_offsets([3, 0, 2]).tolist() == [0, 3, 3, 5]


def test_segment_ids() -> None:
    assert segment_ids([2, 0, 1]).tolist() == [0, 0, 2]


def test_locate_token_scalar() -> None:
    assert locate_token(2, segment_offsets([3, 2])) == (0, 2)


def test_locate_token_skips_empty_sample() -> None:
    assert locate_token(3, segment_offsets([3, 0, 2])) == (2, 0)


def test_locate_token_vectorised() -> None:
    pos, off = locate_token([0, 4, 3], segment_offsets([3, 0, 2]))
    assert pos.tolist() == [0, 2, 2] and off.tolist() == [0, 1, 0]


def test_locate_token_out_of_range_raises() -> None:
    with pytest.raises(KernelInputError, match="outside"):
        locate_token(5, segment_offsets([3, 2]))


# --------------------------------------------------------------------------- properties


@st.composite
def grouped_rewards(draw):
    n = draw(st.integers(1, 6))
    groups = draw(st.integers(1, 5))
    rewards = draw(
        st.lists(
            st.floats(-10, 10, allow_nan=False, width=32),
            min_size=n * groups,
            max_size=n * groups,
        )
    )
    gi = draw(st.permutations([g for g in range(groups) for _ in range(n)]))
    return rewards, list(gi), n


@settings(max_examples=40, deadline=None)
@given(grouped_rewards())
@example(([6.1015625, 6.10546875, 6.105469703674316], [0, 0, 0], 3))  # found by a CI run
def test_property_normalized_group_mean_is_zero(case) -> None:
    """Zero up to the float32 rounding of the centring, which the division by a small std
    magnifies: rewards 6.1015625, 6.10546875, 6.1054697 (std 0.002) give a mean of 2e-4."""
    rewards, gi, n = case
    out = grpo_normalize(rewards, gi, n)
    for g in set(gi):
        members = out[np.array(gi) == g].astype(np.float64)
        raw = np.asarray(rewards, dtype=np.float64)[np.array(gi) == g]
        std = raw.std(ddof=1) if len(raw) > 1 else 0.0
        rounding = 8 * np.finfo(np.float32).eps * np.abs(raw).max() / (std + 1e-6)
        assert abs(members.mean()) < 1e-4 + rounding


@st.composite
def token_batch(draw):
    lengths = draw(st.lists(st.integers(0, 6), min_size=1, max_size=6))
    total = sum(lengths)
    vals = st.floats(-3, 3, allow_nan=False, width=32)
    lp = draw(st.lists(vals, min_size=total, max_size=total))
    old = draw(st.lists(vals, min_size=total, max_size=total))
    adv = draw(st.lists(vals, min_size=total, max_size=total))
    mask = draw(st.lists(st.integers(0, 1), min_size=total, max_size=total))
    return lengths, f32(*lp), f32(*old), f32(*adv), np.array(mask, dtype=np.int64)


@settings(max_examples=40, deadline=None)
@given(token_batch())
def test_property_ratio_one_loss_is_negative_mean_advantage(batch) -> None:
    lengths, lp, _, adv, mask = batch
    out = loss_policy(lp, lp, adv, np.zeros_like(lp), mask, lengths, eps_clip=0.2)
    expected = -float(sum_of_sample_mean(adv, mask, lengths))
    assert out["loss"] == pytest.approx(expected, rel=1e-6, abs=1e-7)


@settings(max_examples=40, deadline=None)
@given(token_batch())
def test_property_clipfrac_in_unit_interval(batch) -> None:
    lengths, lp, old, adv, mask = batch
    _, cf, _ = policy_loss_terms(old, lp, adv, 0.2, 0.28, 3.0)
    assert set(np.unique(cf).tolist()) <= {0.0, 1.0}
    out = loss_policy(old, lp, adv, np.zeros_like(lp), mask, lengths, eps_clip=0.2)
    assert 0.0 <= out["pg_clipfrac"] / len(lengths) <= 1.0


@settings(max_examples=40, deadline=None)
@given(token_batch())
def test_property_sum_of_sample_mean_of_ones_counts_masked_samples(batch) -> None:
    lengths, lp, _, _, mask = batch
    offsets = segment_offsets(lengths)
    with_mask = sum(int(mask[a:b].any()) for a, b in zip(offsets[:-1], offsets[1:], strict=True))
    assert sum_of_sample_mean(np.ones_like(lp), mask, lengths) == pytest.approx(with_mask)


# --------------------------------------------------------------------------- torch parity


def _random_batch(seed: int, n_samples: int = 24):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 40, n_samples).tolist()
    total = sum(lengths)
    old = (rng.normal(size=total) * 0.5 - 1).astype(np.float32)
    lp = (old + rng.normal(size=total) * 0.4).astype(np.float32)
    ref = (old + rng.normal(size=total) * 0.6).astype(np.float32)
    adv = rng.normal(size=total).astype(np.float32)
    ent = rng.random(total).astype(np.float32) * 2
    mask = (rng.random(total) > 0.2).astype(np.int64)
    return lengths, old, lp, ref, adv, ent, mask


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3", "low_var_kl"])
@pytest.mark.parametrize("with_ratio", [False, True])
def test_parity_approx_kl(kl_type: str, with_ratio: bool) -> None:
    _, old, lp, ref, _, _, _ = _random_batch(1)
    ratio = np.exp(lp - old) * 3 if with_ratio else None
    ours = approx_kl(lp, ref, kl_type, importance_ratio=ratio)
    close(ours, oracle.approx_kl(lp, ref, kl_type, importance_ratio=ratio))


@pytest.mark.parametrize(
    "cfg",
    [
        dict(
            eps_clip=0.2,
            eps_clip_high=0.28,
            eps_clip_c=None,
            entropy_coef=0.01,
            use_kl_loss=False,
            kl_loss_coef=0.0,
            kl_loss_type="k1",
            use_unbiased_kl=False,
        ),
        dict(
            eps_clip=0.2,
            eps_clip_high=0.2,
            eps_clip_c=3.0,
            entropy_coef=0.0,
            use_kl_loss=True,
            kl_loss_coef=0.05,
            kl_loss_type="low_var_kl",
            use_unbiased_kl=True,
        ),
        dict(
            eps_clip=0.1,
            eps_clip_high=0.3,
            eps_clip_c=1.5,
            entropy_coef=0.001,
            use_kl_loss=True,
            kl_loss_coef=0.5,
            kl_loss_type="k2",
            use_unbiased_kl=False,
        ),
    ],
    ids=["plain", "dualclip-unbiased-lowvar", "asym-k2"],
)
@pytest.mark.parametrize("seed", [0, 7])
def test_parity_loss_policy(cfg: dict, seed: int) -> None:
    lengths, old, lp, ref, adv, ent, mask = _random_batch(seed)
    ours = loss_policy(old, lp, adv, ent, mask, lengths, ref_log_probs=ref, **cfg)
    theirs = oracle.policy_loss(old, lp, adv, ent, mask, lengths, ref_log_probs=ref, **cfg)
    assert ours.keys() == theirs.keys()
    for key, val in theirs.items():
        assert ours[key] == pytest.approx(val, abs=ATOL, rel=RTOL), key


@pytest.mark.parametrize("seed", [0, 3])
def test_parity_policy_terms_per_token(seed: int) -> None:
    _, old, lp, _, adv, _, _ = _random_batch(seed)
    pg, cf, kl = policy_loss_terms(old, lp, adv, 0.2, 0.28, 3.0)
    ratio = torch.exp(-(torch.from_numpy(old) - torch.from_numpy(lp)))
    a = torch.from_numpy(adv)
    pg1, pg2 = -ratio * a, -torch.clamp(ratio, 0.8, 1.28) * a
    ref_pg = torch.where(
        a < 0, torch.minimum(-3.0 * a, torch.maximum(pg1, pg2)), torch.maximum(pg1, pg2)
    )
    close(pg, ref_pg.numpy())
    close(cf, (pg2 > pg1).float().numpy(), atol=0, rtol=0)
    close(kl, (torch.from_numpy(old) - torch.from_numpy(lp)).numpy(), atol=0, rtol=0)


@pytest.mark.parametrize("n", [1, 2, 8])
def test_parity_grpo_normalize(n: int) -> None:
    rng = np.random.default_rng(n)
    gi = rng.permutation(np.repeat(np.arange(5), n)).tolist()
    raw = (rng.random(len(gi)) * 4 - 1).round(3).tolist()
    close(grpo_normalize(raw, gi, n), oracle.group_normalize(raw, gi, n))


def test_float64_inputs_stay_float64() -> None:
    lengths, old, lp, _, adv, _, mask = _random_batch(2)
    pg, _, _ = policy_loss_terms(old.astype(np.float64), lp.astype(np.float64), adv, 0.2, 0.2)
    assert pg.dtype == np.float64
    assert sum_of_sample_mean(pg, mask, lengths).dtype == np.float64


# --------------------------------------------------------------------------- real fixture


@pytest.fixture(scope="module")
def bundle():
    index = json.loads((FIXTURE / "index.json").read_text())
    expected = json.loads((FIXTURE / "expected.json").read_text())
    payloads = {
        p.stem: torch.load(p, weights_only=True).numpy()
        for p in (FIXTURE / "payloads").glob("*.pt")
    }
    return index, expected, payloads


def test_fixture_loss_policy_matches_expected(bundle) -> None:
    index, expected, p = bundle
    cfg, samples = index["config"], index["samples"]
    out = loss_policy(
        p["old_log_probs"],
        p["log_probs"],
        p["advantages"],
        p["entropy"],
        np.concatenate([s["loss_mask"] for s in samples]),
        [s["response_length"] for s in samples],
        eps_clip=cfg["eps_clip"],
        eps_clip_high=cfg["eps_clip_high"],
        entropy_coef=cfg["entropy_coef"],
    )
    for key, val in expected["loss.policy"].items():
        assert out[key] == pytest.approx(val, abs=ATOL, rel=RTOL), key


def test_fixture_advantages_are_grpo_returns_of_rewards(bundle) -> None:
    index, _, p = bundle
    samples = index["samples"]
    adv = grpo_returns([s["reward"] for s in samples], [s["response_length"] for s in samples])
    close(adv, p["advantages"])


def test_fixture_kl_payload_is_k3_of_old_vs_ref(bundle) -> None:
    index, _, p = bundle
    assert index["config"]["kl_coef"] == 0.05 and index["config"]["kl_loss_type"] == "k3"
    close(approx_kl(p["old_log_probs"], p["ref_log_probs"], "k3"), p["kl"])


# --------------------------------------------------------------------------- import hygiene


def test_kernels_module_does_not_import_torch() -> None:
    code = "import sys, trajstore.replay.kernels; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
