"""Router consistency metrics: hand-built routes and log-probs with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trajstore.router.metrics import (
    LOGPROB_METRICS,
    ROUTE_METRICS,
    RouterMetrics,
    aggregate,
    compute_router_metrics,
)

pytestmark = pytest.mark.unit

E, L, K = 8, 2, 2


def _routes(t: int, dtype=np.int32) -> np.ndarray:
    """[t, L, K] routes: token i, layer l -> experts {0, 1} (a fixed baseline)."""
    r = np.zeros((t, L, K), dtype=dtype)
    r[..., 1] = 1
    return r


def _metrics(a, b, *, tl=(4,), rl=(2,), masks=((1, 1),), lp_r=None, lp_t=None, **kw):
    cfg = {"num_experts": E, "num_layers": L, "top_k": K} | kw
    return compute_router_metrics(
        a,
        b,
        total_lengths=list(tl),
        response_lengths=list(rl),
        loss_masks=[list(m) for m in masks],
        rollout_log_probs=lp_r,
        train_log_probs=lp_t,
        **cfg,
    )


def _assert_route_null(m: RouterMetrics) -> None:
    assert all(getattr(m, name) is None for name in ROUTE_METRICS)


def _assert_logprob_null(m: RouterMetrics) -> None:
    assert all(getattr(m, name) is None for name in LOGPROB_METRICS)


# ---------------------------------------------------------------- route metrics


def test_topk_order_difference_is_not_a_mismatch():
    a = _routes(4)
    b = a[..., ::-1].copy()
    m = _metrics(a, b)
    assert m.route_mismatch_rate == 0.0
    assert m.expert_slot_mismatch == 0.0
    assert m.metric_error == []


def test_route_mismatch_and_slot_mismatch_values():
    a, b = _routes(4), _routes(4)
    b[3, 0] = [0, 5]  # response token 3, layer 0: one of two slots differs
    b[2, 1] = [6, 7]  # response token 2, layer 1: both slots differ
    m = _metrics(a, b)
    assert m.valid_tokens == 2
    assert m.valid_token_layers == 4
    assert m.route_mismatch_rate == 2 / 4
    assert m.expert_slot_mismatch == pytest.approx((0.5 + 1.0) / 4)


def test_prompt_tokens_are_excluded():
    a, b = _routes(4), _routes(4)
    b[0:2] = 7  # prompt tokens of the only sample differ everywhere
    m = _metrics(a, b)
    assert m.route_mismatch_rate == 0.0
    assert m.valid_token_layers == 4


def test_masked_response_tokens_are_excluded():
    a, b = _routes(4), _routes(4)
    b[2, :] = [6, 7]
    m = _metrics(a, b, masks=((0, 1),))
    assert m.valid_tokens == 1
    assert m.route_mismatch_rate == 0.0


def test_response_region_is_the_tail_of_each_sample():
    a, b = _routes(7), _routes(7)
    b[3, 0] = [6, 7]  # last token of sample 0 (tl=4, rl=1)
    b[4, 0] = [6, 7]  # first (prompt) token of sample 1 (tl=3, rl=2)
    m = _metrics(a, b, tl=(4, 3), rl=(1, 2), masks=((1,), (1, 1)))
    assert m.valid_tokens == 3
    assert m.route_mismatch_rate == 1 / 6


def test_dense_minus_one_slots_are_excluded():
    a, b = _routes(4), _routes(4)
    a[:, 1] = -1
    b[:, 1] = -1
    b[3, 0] = [6, 7]
    m = _metrics(a, b)
    assert m.valid_token_layers == 2
    assert m.route_mismatch_rate == 0.5
    assert m.per_layer_mismatch == [0.5, None]


def test_declared_dense_layer_in_uint8_is_skipped():
    a, b = _routes(4, np.uint8), _routes(4, np.uint8)
    a[:, 1] = 255
    b[:, 1] = 255
    m = _metrics(a, b, dense_layers=[1])
    assert m.metric_error == []
    assert m.valid_token_layers == 2


def test_uint8_255_is_not_silently_dense():
    a, b = _routes(4, np.uint8), _routes(4, np.uint8)
    a[:, 1] = 255
    b[:, 1] = 255
    m = _metrics(a, b)
    assert "expert_id_out_of_range" in m.metric_error


def test_per_layer_mismatch():
    a, b = _routes(4), _routes(4)
    b[2, 1] = [6, 7]
    b[3, 1] = [6, 1]
    m = _metrics(a, b)
    assert m.per_layer_mismatch == [0.0, 1.0]


def test_token_any_mismatch():
    a, b = _routes(6), _routes(6)
    b[3, 0] = [6, 7]
    b[3, 1] = [6, 7]  # same token twice: counts once
    b[4, 1] = [6, 7]
    m = _metrics(a, b, tl=(6,), rl=(4,), masks=((1, 1, 1, 1),))
    assert m.token_any_mismatch == 2 / 4
    assert m.route_mismatch_rate == 3 / 8


def test_mixed_dtypes_compare_by_value():
    a = _routes(4, np.uint8)
    b = _routes(4, np.int64)[..., ::-1].copy()
    assert _metrics(a, b).route_mismatch_rate == 0.0


# ---------------------------------------------------------------- log-prob metrics


def test_f_tau_2_threshold_is_strictly_above_ln2():
    lp_r = np.zeros(4)
    lp_t = np.array([-math.log(2.0), -math.nextafter(math.log(2.0), 1.0), 0.3, math.log(3.0)])
    m = _metrics(
        _routes(6), _routes(6), tl=(6,), rl=(4,), masks=((1, 1, 1, 1),), lp_r=lp_r, lp_t=lp_t
    )
    assert m.f_tau_2 == 2 / 4
    assert m.f_tau(2.0) == 2 / 4
    assert m.f_tau(4.0) == 0.0


def test_kl_k1_k3_and_abs_diff_values():
    lp_r = np.array([-1.0, -2.0])
    lp_t = np.array([-1.5, -1.0])  # d = [-0.5, 1.0]
    m = _metrics(_routes(4), _routes(4), lp_r=lp_r, lp_t=lp_t)
    d = np.array([-0.5, 1.0])
    assert m.kl_k1 == pytest.approx(np.mean(-d))
    assert m.kl_k3 == pytest.approx(np.mean(np.exp(d) - 1 - d))
    assert m.logprob_abs_diff == pytest.approx(0.75)


def test_logprob_metrics_use_valid_tokens_only():
    lp_r = np.array([0.0, -1.0])
    lp_t = np.array([-5.0, -1.0])  # the large drift sits on a masked token
    m = _metrics(_routes(4), _routes(4), masks=((0, 1),), lp_r=lp_r, lp_t=lp_t)
    assert m.f_tau_2 == 0.0
    assert m.kl_k1 == 0.0


def test_flat_loss_mask_equals_per_sample_lists():
    a, b = _routes(7), _routes(7)
    b[5, 1] = [6, 7]
    kw = {"num_experts": E, "num_layers": L, "top_k": K}
    nested = compute_router_metrics(
        a, b, total_lengths=[4, 3], response_lengths=[1, 2], loss_masks=[[1], [1, 1]], **kw
    )
    flat = compute_router_metrics(
        a, b, total_lengths=[4, 3], response_lengths=[1, 2], loss_masks=np.array([1, 1, 1]), **kw
    )
    assert nested.to_dict() == flat.to_dict()


def test_missing_logprobs_leave_route_metrics_and_report_no_code():
    m = _metrics(_routes(4), _routes(4))
    assert m.route_mismatch_rate == 0.0
    _assert_logprob_null(m)
    assert m.metric_error == []


# ---------------------------------------------------------------- metric_error codes


def test_error_missing_route():
    m = _metrics(None, _routes(4), lp_r=np.zeros(2), lp_t=np.zeros(2))
    assert m.metric_error == ["missing_route"]
    _assert_route_null(m)
    assert m.valid_token_layers is None
    assert m.f_tau_2 == 0.0  # log-prob metrics fail independently


def test_error_route_shape_mismatch_between_sides():
    m = _metrics(_routes(4), _routes(5))
    assert "route_shape_mismatch" in m.metric_error
    _assert_route_null(m)


def test_error_route_shape_mismatch_against_lengths():
    m = _metrics(_routes(5), _routes(5))
    assert m.metric_error == ["route_shape_mismatch"]
    _assert_route_null(m)


def test_error_layer_count_mismatch():
    m = _metrics(_routes(4), _routes(4), num_layers=3)
    assert m.metric_error == ["layer_count_mismatch"]
    _assert_route_null(m)


def test_error_topk_mismatch():
    m = _metrics(_routes(4), _routes(4), top_k=4)
    assert m.metric_error == ["topk_mismatch"]
    _assert_route_null(m)


def test_error_expert_id_out_of_range():
    b = _routes(4)
    b[0, 0, 0] = E  # even on a prompt token
    m = _metrics(_routes(4), b, lp_r=np.zeros(2), lp_t=np.zeros(2))
    assert m.metric_error == ["expert_id_out_of_range"]
    _assert_route_null(m)
    assert m.kl_k1 == 0.0


def test_error_partial_minus_one_row_is_out_of_range():
    a, b = _routes(4), _routes(4)
    a[3, 0, 0] = -1
    m = _metrics(a, b)
    assert m.metric_error == ["expert_id_out_of_range"]
    _assert_route_null(m)


def test_error_empty_response_mask():
    m = _metrics(_routes(4), _routes(4), masks=((0, 0),), lp_r=np.zeros(2), lp_t=np.zeros(2))
    assert m.metric_error == ["empty_response_mask"]
    assert m.valid_tokens == 0
    assert m.valid_token_layers == 0
    _assert_route_null(m)
    _assert_logprob_null(m)


def test_error_logprob_length_mismatch():
    m = _metrics(_routes(4), _routes(4), lp_r=np.zeros(3), lp_t=np.zeros(3))
    assert m.metric_error == ["logprob_length_mismatch"]
    _assert_logprob_null(m)
    assert m.route_mismatch_rate == 0.0


def test_error_non_finite_logprob_in_valid_position():
    m = _metrics(_routes(4), _routes(4), lp_r=np.array([0.0, np.nan]), lp_t=np.zeros(2))
    assert m.metric_error == ["non_finite_logprob"]
    _assert_logprob_null(m)
    assert m.route_mismatch_rate == 0.0


def test_non_finite_logprob_in_masked_position_is_ignored():
    m = _metrics(
        _routes(4), _routes(4), masks=((0, 1),), lp_r=np.array([np.inf, 0.0]), lp_t=np.zeros(2)
    )
    assert m.metric_error == []
    assert m.kl_k3 == 0.0


def test_to_dict_uses_spec_names_and_none():
    d = _metrics(None, None).to_dict()
    assert list(d) == [
        "valid_tokens",
        "valid_token_layers",
        "route_mismatch_rate",
        "expert_slot_mismatch",
        "token_any_mismatch",
        "per_layer_mismatch",
        "f_tau_2",
        "kl_k1",
        "kl_k3",
        "logprob_abs_diff",
        "metric_error",
    ]
    assert d["route_mismatch_rate"] is None and d["metric_error"] == ["missing_route"]


# ---------------------------------------------------------------- aggregate


def _pair(seed: int, t: int, tl: list[int], rl: list[int]):
    rng = np.random.default_rng(seed)
    a = np.stack([rng.permutation(E)[:K] for _ in range(t * L)]).reshape(t, L, K)
    b = a.copy()
    flip = rng.random((t, L)) < 0.3
    b[flip] = np.stack([rng.permutation(E)[:K] for _ in range(int(flip.sum()))])
    masks = [list(rng.integers(0, 2, size=n)) for n in rl]
    lp_r = rng.normal(-1, 0.5, size=sum(rl))
    lp_t = lp_r + rng.normal(0, 0.8, size=sum(rl))
    return a, b, tl, rl, masks, lp_r, lp_t


def test_aggregate_equals_metrics_of_concatenation():
    kw = {"num_experts": E, "num_layers": L, "top_k": K}
    p1 = _pair(1, 10, [6, 4], [3, 2])
    p2 = _pair(2, 9, [9], [5])
    parts = [
        compute_router_metrics(
            a,
            b,
            total_lengths=tl,
            response_lengths=rl,
            loss_masks=m,
            rollout_log_probs=r,
            train_log_probs=t,
            **kw,
        )
        for a, b, tl, rl, m, r, t in (p1, p2)
    ]
    whole = compute_router_metrics(
        np.concatenate([p1[0], p2[0]]),
        np.concatenate([p1[1], p2[1]]),
        total_lengths=p1[2] + p2[2],
        response_lengths=p1[3] + p2[3],
        loss_masks=p1[4] + p2[4],
        rollout_log_probs=np.concatenate([p1[5], p2[5]]),
        train_log_probs=np.concatenate([p1[6], p2[6]]),
        **kw,
    )
    agg, want = aggregate(parts).to_dict(), whole.to_dict()
    for exact in ("per_layer_mismatch", "metric_error"):
        assert agg.pop(exact) == want.pop(exact)
    assert agg == pytest.approx(want)
    assert aggregate(parts).f_tau(1.5) == whole.f_tau(1.5)


def test_aggregate_keeps_a_failing_part_visible():
    ok = _metrics(_routes(4), _routes(4))
    bad = _metrics(None, _routes(4))
    agg = aggregate([ok, bad])
    assert agg.metric_error == ["missing_route"]
    assert agg.route_mismatch_rate is None


def test_aggregate_roundtrips_through_dict_counts():
    m = _metrics(_routes(4), _routes(4)[..., ::-1].copy())
    again = RouterMetrics.from_dict(m.to_dict(include_counts=True))
    assert aggregate([again]).to_dict() == m.to_dict()


# ---------------------------------------------------------------- properties


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 4)), min_size=1, max_size=4),
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from([np.uint8, np.int16, np.int32, np.int64]),
)
def test_identical_inputs_measure_exactly_zero(lengths, seed, dtype):
    rl = [r for r, _ in lengths]
    tl = [r + p for r, p in lengths]
    rng = np.random.default_rng(seed)
    t = sum(tl)
    a = np.stack([rng.permutation(E)[:K] for _ in range(t * L)]).reshape(t, L, K).astype(dtype)
    b = a[..., rng.permutation(K)].copy()
    lp = rng.normal(-2, 1, size=sum(rl))
    masks = [[1] + list(rng.integers(0, 2, size=r - 1)) for r in rl]
    m = compute_router_metrics(
        a,
        b,
        total_lengths=tl,
        response_lengths=rl,
        loss_masks=masks,
        rollout_log_probs=lp,
        train_log_probs=lp.copy(),
        num_experts=E,
        num_layers=L,
        top_k=K,
    )
    assert m.metric_error == []
    assert m.route_mismatch_rate == 0.0
    assert m.f_tau_2 == 0.0
    assert m.kl_k1 == 0.0
    assert m.kl_k3 == 0.0
