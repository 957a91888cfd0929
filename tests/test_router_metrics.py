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
    _sample_layout,
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


@pytest.mark.parametrize(
    "values",
    [
        [1, 0, 1],
        [True, False, True],
        [1.0, 0.0, 1.0],  # not bytes: read as floats
        [np.int64(1), np.int8(0), 1],
        [1, 0.0, True],
    ],
)
def test_loss_mask_value_types_read_alike(values):
    """Every mask value type that means 0/1 reads as that 0/1 (T=7, R=3; the response
    tokens sit at flat positions 3, 5 and 6)."""
    t, r, valid_pos, valid_r = _sample_layout([4, 3], [1, 2], [values[:1], values[1:]])
    on = [i for i, v in enumerate(values) if v == 1]
    assert (t, r) == (7, 3)
    assert valid_r.tolist() == on
    assert valid_pos.tolist() == [[3, 5, 6][i] for i in on]


@pytest.mark.parametrize("bad", [2, 255, 256, -1, 0.5, "1x"])
def test_loss_mask_values_other_than_0_1_raise(bad):
    with pytest.raises(ValueError, match="loss_mask values must be 0 or 1"):
        _sample_layout([4, 3], [1, 2], [[1], [bad, 1]])


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


# ---------------------------------------------------------------- the route kernel against sets


def _oracle_routes(a, b, tl, rl, masks, num_experts, dense_layers=()):
    """router-metrics.md's route rules, token by token and layer by layer, in plain Python
    sets: (metric_error codes of the route family, counts) with counts None on an error."""
    n_layers, k = a.shape[1], a.shape[2]
    keep = [layer for layer in range(n_layers) if layer not in set(dense_layers)]
    signed = any(np.issubdtype(x.dtype, np.signedinteger) for x in (a, b))
    for x in (a, b):
        lowest = -1 if np.issubdtype(x.dtype, np.signedinteger) else 0
        ids = [int(v) for v in x[:, keep].reshape(-1)]
        if any(v < lowest or v >= num_experts for v in ids):
            return ["expert_id_out_of_range"], None
    valid = []
    start = 0
    for t, r, m in zip(tl, rl, masks, strict=True):
        valid += [start + t - r + j for j in range(r) if m[j]]
        start += t
    per_mis, per_obs = [0] * n_layers, [0] * n_layers
    missing_slots = tokens_any = 0
    for pos in valid:
        any_layer = False
        for layer in keep:
            ra, rb = [int(v) for v in a[pos, layer]], [int(v) for v in b[pos, layer]]
            dense_a, dense_b = ra == [-1] * k, rb == [-1] * k
            if signed and dense_a and dense_b:
                continue
            if dense_a != dense_b or -1 in ra or -1 in rb:
                return ["expert_id_out_of_range"], None
            if len(set(ra)) < k or len(set(rb)) < k:
                return ["expert_id_out_of_range"], None
            per_obs[layer] += 1
            if set(ra) != set(rb):
                per_mis[layer] += 1
                missing_slots += k - len(set(ra) & set(rb))
                any_layer = True
        tokens_any += any_layer
    return [], {
        "per_layer_mismatches": per_mis,
        "per_layer_valid_token_layers": per_obs,
        "route_mismatches": sum(per_mis),
        "valid_token_layers": sum(per_obs),
        "missing_slots": missing_slots,
        "mismatched_tokens": tokens_any,
        "valid_tokens": len(valid),
    }


def _oracle_and_kernel(a, b, tl, rl, masks, num_experts, dense_layers=()):
    """(`_oracle_routes`'s codes and counts, `compute_router_metrics`) of the same routes."""
    codes, want = _oracle_routes(a, b, tl, rl, masks, num_experts, dense_layers)
    _, n_layers, k = a.shape
    m = compute_router_metrics(
        a,
        b,
        total_lengths=tl,
        response_lengths=rl,
        loss_masks=masks,
        num_experts=num_experts,
        num_layers=n_layers,
        top_k=k,
        dense_layers=dense_layers,
    )
    return codes, want, m


def _random_routes(rng, t, n_layers, k, num_experts, dtype):
    rows = [rng.choice(num_experts, size=k, replace=False) for _ in range(t * n_layers)]
    return np.array(rows, dtype=np.int64).reshape(t, n_layers, k).astype(dtype)


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 4)), min_size=1, max_size=4),
    n_layers=st.integers(1, 4),
    shape=st.sampled_from(
        # (top_k, num_experts, dtype): 8 x uint8 is one 64-bit word per row; 3 x int16 is
        # 6 bytes (2-byte words); experts >= 64 and >= 256; K > 16 sorts
        [
            (2, 8, np.int32),
            (8, 128, np.uint8),
            (8, 70, np.int8),
            (3, 300, np.int16),
            (1, 4, np.int64),
            (4, 1000, np.uint16),
            (17, 40, np.int16),
        ]
    ),
    flips=st.integers(0, 6),
    defect=st.sampled_from(
        ["none", "permute", "dup_equal", "dup_train", "dense", "dense_one_side", "partial"]
        + ["partial_train"]
    ),
    dense_layer=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_route_counts_equal_a_set_oracle(
    lengths, n_layers, shape, flips, defect, dense_layer, seed
):
    """Every route number and error of the vectorised kernel equals plain Python sets, on
    random routes with flipped experts, permuted rows, repeated ids (on both sides alike,
    or on the training side only), dense -1 rows, -1 on one side only or part of a row,
    masked tokens, empty masks and declared dense layers."""
    k, num_experts, dtype = shape
    rng = np.random.default_rng(seed)
    rl = [r for r, _ in lengths]
    tl = [r + p for r, p in lengths]
    t = sum(tl)
    masks = [list(rng.integers(0, 2, size=r)) for r in rl]
    a = _random_routes(rng, t, n_layers, k, num_experts, dtype)
    b = a.copy()
    for _ in range(flips if t else 0):  # replace one slot by an expert not in the row
        pos, layer, slot = rng.integers(t), rng.integers(n_layers), rng.integers(k)
        free = sorted(set(range(num_experts)) - {int(v) for v in b[pos, layer]})
        b[pos, layer, slot] = free[rng.integers(len(free))]
    signed = np.issubdtype(np.dtype(dtype), np.signedinteger)
    # a defect lands on a compared token (when there is one) 3 times in 4
    starts = np.cumsum([0, *tl])[:-1]
    compared = [
        int(s) + t_ - r + j
        for s, t_, r, m in zip(starts, tl, rl, masks, strict=True)
        for j in range(r)
        if m[j]
    ]
    pos = int(rng.choice(compared)) if compared and rng.random() < 0.75 else rng.integers(t or 1)
    layer = rng.integers(n_layers)
    if t and defect == "permute":
        b = b[..., rng.permutation(k)].copy()
    elif t and defect in ("dup_equal", "dup_train") and k > 1:
        i, j = rng.choice(k, size=2, replace=False)
        for x in (a, b) if defect == "dup_equal" else (b,):
            x[pos, layer, j] = x[pos, layer, i]
    elif t and signed and defect in ("dense", "dense_one_side", "partial", "partial_train"):
        if defect.startswith("partial"):
            for x in (a, b) if defect == "partial" else (b,):
                x[pos, layer, 0] = -1
        else:
            for x in (a, b) if defect == "dense" else (a,):
                x[pos, layer] = -1
    dense_layers = [n_layers - 1] if dense_layer and n_layers > 1 else []
    for x in (a, b):  # a declared dense layer holds anything (here: a fixed id repeated)
        if dense_layers:
            x[:, dense_layers] = 0
    codes, want, m = _oracle_and_kernel(a, b, tl, rl, masks, num_experts, dense_layers)
    got_route_codes = [c for c in m.metric_error if c != "empty_response_mask"]
    assert got_route_codes == codes
    if want is None:
        _assert_route_null(m)
        return
    c = m.counts
    got = {name: getattr(c, name) for name in want}
    assert got == want
    if want["valid_tokens"] == 0 or want["valid_token_layers"] == 0:
        assert "empty_response_mask" in m.metric_error
        _assert_route_null(m)
    else:
        assert m.route_mismatch_rate == want["route_mismatches"] / want["valid_token_layers"]
        assert m.token_any_mismatch == want["mismatched_tokens"] / want["valid_tokens"]
        assert m.expert_slot_mismatch == want["missing_slots"] / (k * want["valid_token_layers"])


def test_route_counts_across_chunks_equal_a_set_oracle():
    """A bundle larger than one vectorised chunk (2**18 token-layers): tokens on both sides
    of a chunk boundary, partly masked, with flips and permuted rows."""
    rng = np.random.default_rng(7)
    n_layers, k, num_experts = 4, 2, 90
    rl, tl = [40_000, 30_000], [40_010, 30_000]
    t = sum(tl)
    a = np.argsort(rng.random((t * n_layers, num_experts)), axis=1)[:, :k].reshape(t, n_layers, k)
    a = a.astype(np.uint8)
    b = a[..., ::-1].copy()
    for pos in rng.integers(0, t, 300):
        b[pos, rng.integers(n_layers)] = [88, 89] if 88 not in a[pos].reshape(-1) else [0, 1]
    masks = [list(rng.integers(0, 2, size=r)) for r in rl]
    codes, want, m = _oracle_and_kernel(a, b, tl, rl, masks, num_experts)
    assert m.metric_error == codes == []
    assert {name: getattr(m.counts, name) for name in want} == want
    assert want["route_mismatches"] > 0
