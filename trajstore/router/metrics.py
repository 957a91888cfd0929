"""Route-consistency and log-prob drift metrics (contract: docs/router-metrics.md).

Only masked response tokens count: the response region of sample i is the last
``response_length_i`` of its ``total_length_i`` tokens in the flat ``[T, L, K]``
layout, and a token is valid where its ``loss_mask`` is 1. Every rate is kept
as integer/float *sums* (`RouterCounts`) so that several bundles (ranks of one
step) aggregate by summing numerators and denominators, never by averaging
rates.

Failure is explicit: a bad input yields ``None`` (never 0) for the metrics it
affects and a code in ``metric_error``. Route and log-prob metrics fail
independently:

==========================  ===================================================
code                        nulls
==========================  ===================================================
missing_route               route metrics + valid_token_layers
route_shape_mismatch        route metrics + valid_token_layers
layer_count_mismatch        route metrics + valid_token_layers
topk_mismatch               route metrics + valid_token_layers
expert_id_out_of_range      route metrics + valid_token_layers
empty_response_mask         every metric (valid_tokens == 0); or route metrics
                            only when every valid (token, layer) is dense
                            (valid_token_layers == 0)
logprob_length_mismatch     log-prob metrics
non_finite_logprob          log-prob metrics
==========================  ===================================================

Route metrics: route_mismatch_rate, expert_slot_mismatch, token_any_mismatch,
per_layer_mismatch. Log-prob metrics: f_tau_2, kl_k1, kl_k3, logprob_abs_diff.
When neither log-prob tensor is given the log-prob metrics are None with no
code (not measured); when only one is given that is logprob_length_mismatch
(the absent side has no length R).

Dense (non-MoE) slots. With a signed dtype a (token, layer) whose K ids are
all -1 on *both* sides is dense and excluded. -1 is legal only in that form:
a partial -1 row, or a row dense on one side only, is reported as
expert_id_out_of_range. Unsigned dtypes (uint8 storage) cannot hold -1, and
255 is *not* read as -1: it is an ordinary id, out of range unless
num_experts > 255. Producers that store dense layers in unsigned tensors
declare them with ``dense_layers`` (layer indices); those layers are skipped
entirely (not range-checked, not compared). A repeated id within one top-k
row is not a selection of K distinct experts and is also reported as
expert_id_out_of_range. The id range is checked on every token (prompt
included); the -1 / repeated-id rules on the compared (valid) tokens.

Inconsistent sample metadata (loss_mask lengths, response_length >
total_length, mask values other than 0/1) raises ValueError: bundle
validation owns that, and no metric could be trusted.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ROUTE_ERRORS: tuple[str, ...] = (
    "missing_route",
    "route_shape_mismatch",
    "layer_count_mismatch",
    "topk_mismatch",
    "expert_id_out_of_range",
)
LOGPROB_ERRORS: tuple[str, ...] = ("logprob_length_mismatch", "non_finite_logprob")
#: Every code, in the spec's order; metric_error lists codes in this order.
ERROR_CODES: tuple[str, ...] = (*ROUTE_ERRORS, "empty_response_mask", *LOGPROB_ERRORS)
ROUTE_METRICS: tuple[str, ...] = (
    "route_mismatch_rate",
    "expert_slot_mismatch",
    "token_any_mismatch",
    "per_layer_mismatch",
)
LOGPROB_METRICS: tuple[str, ...] = ("f_tau_2", "kl_k1", "kl_k3", "logprob_abs_diff")
#: The names `RouterMetrics.to_dict` emits, in order (one name per number).
METRIC_NAMES: tuple[str, ...] = (
    "valid_tokens",
    "valid_token_layers",
    *ROUTE_METRICS,
    *LOGPROB_METRICS,
    "metric_error",
)

_LN2 = math.log(2.0)
_CHUNK_OBS = 1 << 17  # (token, layer) observations per vectorised chunk: stays in cache


@dataclass
class RouterCounts:
    """Numerators and denominators behind `RouterMetrics`; these sum across bundles."""

    valid_tokens: int = 0
    top_k: int = 0
    routes_measured: bool = False
    valid_token_layers: int = 0
    route_mismatches: int = 0
    missing_slots: int = 0
    mismatched_tokens: int = 0
    per_layer_mismatches: list[int] = field(default_factory=list)
    per_layer_valid_token_layers: list[int] = field(default_factory=list)
    logprob_measured: bool = False
    f_tau_2_count: int = 0
    kl_k1_sum: float = 0.0
    kl_k3_sum: float = 0.0
    logprob_abs_diff_sum: float = 0.0


@dataclass
class RouterMetrics:
    """Route and log-prob consistency of one bundle (or an aggregate of several)."""

    valid_tokens: int
    valid_token_layers: int | None
    route_mismatch_rate: float | None
    expert_slot_mismatch: float | None
    token_any_mismatch: float | None
    per_layer_mismatch: list[float | None] | None
    f_tau_2: float | None
    kl_k1: float | None
    kl_k3: float | None
    logprob_abs_diff: float | None
    metric_error: list[str]
    counts: RouterCounts = field(default_factory=RouterCounts, repr=False)
    #: d = train - rollout log-prob per valid token; kept so f_tau(tau) works for any tau.
    logprob_diff: np.ndarray | None = field(default=None, repr=False, compare=False)

    def f_tau(self, tau: float) -> float | None:
        """Fraction of valid tokens whose probability ratio either way exceeds tau."""
        if self.f_tau_2 is None:
            return None
        if self.logprob_diff is None:
            if tau == 2.0:
                return self.f_tau_2
            raise ValueError("per-token log-prob differences were not kept; only f_tau(2)")
        return f_tau(self.logprob_diff, tau)

    def to_dict(self, include_counts: bool = False) -> dict[str, Any]:
        """JSON-ready dict with exactly the spec's names (plus raw sums under "counts")."""
        out: dict[str, Any] = {
            "valid_tokens": self.valid_tokens,
            "valid_token_layers": self.valid_token_layers,
            "route_mismatch_rate": self.route_mismatch_rate,
            "expert_slot_mismatch": self.expert_slot_mismatch,
            "token_any_mismatch": self.token_any_mismatch,
            "per_layer_mismatch": None
            if self.per_layer_mismatch is None
            else list(self.per_layer_mismatch),
            "f_tau_2": self.f_tau_2,
            "kl_k1": self.kl_k1,
            "kl_k3": self.kl_k3,
            "logprob_abs_diff": self.logprob_abs_diff,
            "metric_error": list(self.metric_error),
        }
        if include_counts:
            c = self.counts
            out["counts"] = {k: (list(v) if isinstance(v, list) else v) for k, v in vars(c).items()}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RouterMetrics:
        """Inverse of `to_dict`; aggregatable only if it carried "counts"."""
        counts = RouterCounts(**data["counts"]) if "counts" in data else RouterCounts()
        return cls(
            **{name: data.get(name) for name in METRIC_NAMES if name != "metric_error"},
            metric_error=list(data.get("metric_error") or []),
            counts=counts,
        )


def f_tau(logprob_diff: np.ndarray, tau: float) -> float | None:
    """mean 1[|d| > ln tau]: fraction of tokens whose p ratio (either way) exceeds tau."""
    if tau <= 1.0:
        raise ValueError("tau must be > 1")
    d = np.asarray(logprob_diff, dtype=np.float64)
    if d.size == 0:
        return None
    return float(np.count_nonzero(np.abs(d) > math.log(tau)) / d.size)


# --------------------------------------------------------------------------- layout


def _sample_layout(
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    loss_masks: Sequence[Sequence[int]] | np.ndarray,
) -> tuple[int, int, np.ndarray, np.ndarray]:
    """Return (T, R, flat T positions of valid tokens, R indices of valid tokens)."""
    tl = np.asarray(total_lengths, dtype=np.int64).reshape(-1)
    rl = np.asarray(response_lengths, dtype=np.int64).reshape(-1)
    if tl.shape != rl.shape:
        raise ValueError("total_lengths and response_lengths differ in length")
    if (rl < 0).any() or (rl > tl).any():
        raise ValueError("need 0 <= response_length <= total_length for every sample")
    r_total = int(rl.sum())
    if isinstance(loss_masks, np.ndarray) or (len(loss_masks) > 0 and np.isscalar(loss_masks[0])):
        mask = np.asarray(loss_masks).reshape(-1)
        if mask.size != r_total:
            raise ValueError(f"flat loss mask has {mask.size} entries, expected R={r_total}")
    else:
        if len(loss_masks) != tl.size:
            raise ValueError("one loss_mask per sample is required")
        for i, (sample_mask, n) in enumerate(zip(loss_masks, rl, strict=True)):
            if len(sample_mask) != n:
                raise ValueError(
                    f"loss_mask of sample {i} has {len(sample_mask)} entries, expected {n}"
                )
        try:  # one C pass over the Python lists when every value is an int in 0..255
            mask = np.frombuffer(bytes(itertools.chain.from_iterable(loss_masks)), np.uint8)
        except (TypeError, ValueError):  # floats, out-of-byte ints, ...: the general reading
            try:
                mask = np.fromiter(
                    itertools.chain.from_iterable(loss_masks), dtype=np.float64, count=r_total
                )
            except (TypeError, ValueError) as exc:
                raise ValueError("loss_mask values must be 0 or 1") from exc
    if mask.size and not ((mask == 0) | (mask == 1)).all():
        raise ValueError("loss_mask values must be 0 or 1")
    ends = np.cumsum(tl)
    resp_offsets = np.cumsum(rl) - rl
    positions = np.repeat(ends - rl - resp_offsets, rl) + np.arange(r_total, dtype=np.int64)
    valid_r = np.flatnonzero(mask.astype(bool))
    return int(tl.sum()), r_total, positions[valid_r], valid_r


# --------------------------------------------------------------------------- routes
#
# The comparison reads each route array once, in chunks of valid tokens. A row is one
# (token, layer)'s K ids. Rows whose bytes are equal on both sides (the common case)
# hold the same set and need no set comparison; they are found by one compare per
# machine word of the row. Only the rows that differ are compared as sets (|A ∩ B| by
# K x K equalities on those rows alone). The well-formedness rules (no repeated id, -1
# only as a whole dense row on both sides) are checked on the rollout side for every
# valid row (pairwise equalities of K contiguous slot arrays, no sort) and on the
# training side for the differing rows only: a row equal to its rollout row is as well
# formed as it. No per-token Python, no sort (except for K > _PAIRWISE_MAX_K).

_PAIRWISE_MAX_K = 16  # up to this K, repeated ids are found by K(K-1)/2 equalities


def _row_words(f: np.ndarray) -> np.ndarray:
    """The C-contiguous [M, K] id array `f` as [M, W] unsigned machine words (W small)."""
    nbytes = f.shape[1] * f.itemsize
    word = next(size for size in (8, 4, 2, 1) if nbytes % size == 0)
    return f.view(np.dtype(f"u{word}"))


def _rows_equal(wa: np.ndarray, wb: np.ndarray) -> np.ndarray:
    """[M] bool: rows m of the [M, W] word arrays are equal (one compare per word)."""
    eq = wa[:, 0] == wb[:, 0]
    for w in range(1, wa.shape[1]):
        eq &= wa[:, w] == wb[:, w]
    return eq


def _repeats(t: np.ndarray) -> np.ndarray:
    """[M] bool: column m of the [K, M] id array `t` holds an id twice."""
    k, m = t.shape
    if k > _PAIRWISE_MAX_K:
        s = np.sort(t, axis=0)
        return (s[1:] == s[:-1]).any(0)
    # one contiguous compare and or per pair of slots, into preallocated rows: a third of
    # the time of comparing a slot against the later ones at once and reducing over them
    out = np.zeros(m, dtype=bool)
    hit = np.empty(m, dtype=bool)
    for i in range(k - 1):
        for j in range(i + 1, k):
            np.equal(t[i], t[j], out=hit)
            out |= hit
    return out


def _dense_columns(t: np.ndarray) -> tuple[np.ndarray, bool]:
    """([M] bool: column m of `t` is all -1, whether a column holds -1 only partly)."""
    neg = t == -1
    all_neg = neg.all(0)
    return all_neg, bool((neg.any(0) != all_neg).any())


def _compare_chunk(
    ca: np.ndarray, cb: np.ndarray, check_dense: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, bool]:
    """Compare [C, L, K] chunks (C-contiguous, one dtype): (flat indices of the mismatching
    rows, their missing slots, [C*L] dense rows or None when there are none, malformed).

    Without `check_dense` neither side holds a negative id, so no row is dense."""
    k = ca.shape[2]
    fa, fb = ca.reshape(-1, k), cb.reshape(-1, k)
    wa, wb = _row_words(fa), _row_words(fb)
    diff = np.flatnonzero(~_rows_equal(wa, wb))
    ta = np.ascontiguousarray(fa.T)
    # the differing rows, gathered a row (a few words) at a time, then slot-major
    xa = np.ascontiguousarray(wa[diff].view(fa.dtype).T)
    xb = np.ascontiguousarray(wb[diff].view(fb.dtype).T)
    rep_a, rep_b = _repeats(ta), _repeats(xb)
    dense = None
    malformed = False
    if check_dense:
        dense, partial_a = _dense_columns(ta)
        dense_b, partial_b = _dense_columns(xb)
        malformed = partial_a or partial_b or bool((dense[diff] != dense_b).any())
        rep_a &= ~dense
        rep_b &= ~dense_b
    if malformed or rep_a.any() or rep_b.any():
        return diff[:0], diff[:0], dense, True
    # |A ∩ B| of each differing row: slot i of A found among B's slots, summed over i
    inter = (xa[:, None, :] == xb[None, :, :]).any(1).sum(0)
    partial = inter < k  # the rest hold the same set in another order
    return diff[partial], k - inter[partial], dense, False


def _id_range(x: np.ndarray, keep_layers: np.ndarray | None) -> tuple[int, int] | None:
    """(min, max) id outside declared-dense layers, None when there is none."""
    if keep_layers is not None:
        x = x[:, keep_layers]
    if x.size == 0:
        return None
    lo = int(x.min()) if np.issubdtype(x.dtype, np.signedinteger) else 0
    return lo, int(x.max())


def _out_of_range(x: np.ndarray, lo_hi: tuple[int, int] | None, num_experts: int) -> bool:
    """Any id outside [0, num_experts) other than -1 in a non-declared-dense layer."""
    if lo_hi is None:
        return False
    lo_ok = lo_hi[0] >= (-1 if np.issubdtype(x.dtype, np.signedinteger) else 0)
    return not (lo_ok and lo_hi[1] < num_experts)


def _work_dtype(da: np.dtype, db: np.dtype, num_experts: int) -> np.dtype:
    """Narrowest dtype holding ids and -1 (ids are range-checked first): less to move."""
    if not (np.issubdtype(da, np.signedinteger) or np.issubdtype(db, np.signedinteger)):
        if num_experts <= 256:
            return np.dtype(np.uint8)
    elif num_experts <= 127:
        return np.dtype(np.int8)
    if num_experts <= 32767:
        return np.dtype(np.int16)
    return np.result_type(da, db)


def _route_counts(
    a: np.ndarray,
    b: np.ndarray,
    num_experts: int,
    valid_pos: np.ndarray,
    keep_layers: np.ndarray | None,
    counts: RouterCounts,
    negative_ids: bool = True,
) -> bool:
    """Fill the route sums of `counts`; return True if a malformed row was found (the
    route sums are then left at 0: no route metric is reported). `negative_ids` False
    promises that neither side holds a negative id (no dense row to look for)."""
    n_layers_all = a.shape[1]
    per_layer_mis = np.zeros(n_layers_all, dtype=np.int64)
    per_layer_obs = np.zeros(n_layers_all, dtype=np.int64)
    layer_idx = np.arange(n_layers_all) if keep_layers is None else keep_layers
    n_layers = layer_idx.size
    signed = np.issubdtype(a.dtype, np.signedinteger) or np.issubdtype(b.dtype, np.signedinteger)
    check_dense = signed and negative_ids
    step = max(1, _CHUNK_OBS // max(1, n_layers))
    work = _work_dtype(a.dtype, b.dtype, num_experts)
    missing_slots = mismatched_tokens = 0
    if n_layers:
        for start in range(0, valid_pos.size, step):
            pos = valid_pos[start : start + step]
            ca, cb = a[pos].astype(work, copy=False), b[pos].astype(work, copy=False)
            if keep_layers is not None:
                ca, cb = ca[:, keep_layers], cb[:, keep_layers]
            rows, missing, dense, bad = _compare_chunk(
                np.ascontiguousarray(ca), np.ascontiguousarray(cb), check_dense
            )
            if bad:
                return True
            per_layer_mis[layer_idx] += np.bincount(rows % n_layers, minlength=n_layers)
            live = pos.size if dense is None else pos.size - dense.reshape(-1, n_layers).sum(0)
            per_layer_obs[layer_idx] += live
            missing_slots += int(missing.sum())
            tokens = rows // n_layers  # increasing: a token's rows are adjacent
            mismatched_tokens += int(np.count_nonzero(tokens[1:] != tokens[:-1])) + (
                tokens.size > 0
            )
    counts.missing_slots += missing_slots
    counts.mismatched_tokens += mismatched_tokens
    counts.per_layer_mismatches = per_layer_mis.tolist()
    counts.per_layer_valid_token_layers = per_layer_obs.tolist()
    counts.route_mismatches = int(per_layer_mis.sum())
    counts.valid_token_layers = int(per_layer_obs.sum())
    return False


# --------------------------------------------------------------------------- entry points


def measure_routes(
    rollout_routes: np.ndarray | None,
    train_routes: np.ndarray | None,
    *,
    t_total: int,
    valid_pos: np.ndarray,
    num_experts: int,
    num_layers: int,
    dense_layers: Iterable[int],
    counts: RouterCounts,
) -> set[str]:
    """The route part of `compute_router_metrics` on a layout `_sample_layout` gave (T and
    the flat positions of the valid tokens): fills the route sums of `counts` (whose
    ``top_k`` is the configured K) and returns the route error codes."""
    top_k = counts.top_k
    dense_set = sorted({int(i) for i in dense_layers})
    if any(i < 0 or i >= num_layers for i in dense_set):
        raise ValueError(f"dense_layers must lie in [0, {num_layers})")
    codes: set[str] = set()
    if rollout_routes is None or train_routes is None:
        codes.add("missing_route")
    else:
        a, b = np.asarray(rollout_routes), np.asarray(train_routes)
        for x in (a, b):
            if not np.issubdtype(x.dtype, np.integer):
                raise TypeError(f"route tensors must be integer, got {x.dtype}")
        if a.ndim != 3 or b.ndim != 3 or a.shape != b.shape or a.shape[0] != t_total:
            codes.add("route_shape_mismatch")
        for x in (a, b):
            if x.ndim == 3 and x.shape[1] != num_layers:
                codes.add("layer_count_mismatch")
            if x.ndim == 3 and x.shape[2] != top_k:
                codes.add("topk_mismatch")
        keep = None
        if dense_set:
            keep = np.setdiff1d(np.arange(num_layers), dense_set)
        ranges = {}
        for side, x in (("a", a), ("b", b)):
            if x.ndim == 3 and (keep is None or x.shape[1] == num_layers):
                ranges[side] = _id_range(x, keep)
                if _out_of_range(x, ranges[side], num_experts):
                    codes.add("expert_id_out_of_range")
        if not codes:
            negative = any(r is not None and r[0] < 0 for r in ranges.values())
            if _route_counts(a, b, num_experts, valid_pos, keep, counts, negative):
                codes.add("expert_id_out_of_range")
            else:
                counts.routes_measured = True
    return codes


def compute_router_metrics(
    rollout_routes: np.ndarray | None,
    train_routes: np.ndarray | None,
    *,
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    loss_masks: Sequence[Sequence[int]] | np.ndarray,
    num_experts: int,
    num_layers: int,
    top_k: int,
    rollout_log_probs: np.ndarray | None = None,
    train_log_probs: np.ndarray | None = None,
    dense_layers: Iterable[int] = (),
) -> RouterMetrics:
    """Measure rollout-vs-train route and log-prob consistency on valid response tokens.

    Routes are [T, L, K] integer arrays (or anything `np.asarray` accepts, e.g. a
    CPU torch tensor); log-probs are [R] floats; num_experts/num_layers/top_k come
    from index.json config.router; dense_layers declares non-MoE layer indices.
    """
    t_total, r_total, valid_pos, valid_r = _sample_layout(
        total_lengths, response_lengths, loss_masks
    )
    counts = RouterCounts(valid_tokens=int(valid_pos.size), top_k=int(top_k))
    codes = measure_routes(
        rollout_routes,
        train_routes,
        t_total=t_total,
        valid_pos=valid_pos,
        num_experts=num_experts,
        num_layers=num_layers,
        dense_layers=dense_layers,
        counts=counts,
    )

    # Log-probs.
    diff: np.ndarray | None = None
    if rollout_log_probs is not None or train_log_probs is not None:
        if rollout_log_probs is None or train_log_probs is None:
            codes.add("logprob_length_mismatch")
        else:
            lp_r = np.asarray(rollout_log_probs, dtype=np.float64)
            lp_t = np.asarray(train_log_probs, dtype=np.float64)
            if lp_r.shape != (r_total,) or lp_t.shape != (r_total,):
                codes.add("logprob_length_mismatch")
            else:
                vr, vt = lp_r[valid_r], lp_t[valid_r]
                if not (np.isfinite(vr).all() and np.isfinite(vt).all()):
                    codes.add("non_finite_logprob")
                else:
                    diff = vt - vr
                    counts.logprob_measured = True
                    counts.f_tau_2_count = int(np.count_nonzero(np.abs(diff) > _LN2))
                    counts.kl_k1_sum = float(-diff.sum()) + 0.0
                    counts.kl_k3_sum = float((np.expm1(diff) - diff).sum()) + 0.0
                    counts.logprob_abs_diff_sum = float(np.abs(diff).sum())

    return _finish(counts, codes, diff)


def _finish(counts: RouterCounts, codes: set[str], diff: np.ndarray | None) -> RouterMetrics:
    """Turn sums into rates, applying the null rules of the module docstring."""
    n_tok = counts.valid_tokens
    if n_tok == 0:
        codes.add("empty_response_mask")
    route_ok = counts.routes_measured and not (codes & set(ROUTE_ERRORS))
    vtl = counts.valid_token_layers if route_ok else None
    if route_ok and vtl == 0:
        codes.add("empty_response_mask")
    rates_ok = route_ok and n_tok > 0 and bool(vtl)
    per_layer: list[float | None] | None = None
    if rates_ok:
        per_layer = [
            (mis / obs if obs else None)
            for mis, obs in zip(
                counts.per_layer_mismatches, counts.per_layer_valid_token_layers, strict=True
            )
        ]
    lp_ok = counts.logprob_measured and n_tok > 0 and not (codes & set(LOGPROB_ERRORS))
    return RouterMetrics(
        valid_tokens=n_tok,
        valid_token_layers=vtl,
        route_mismatch_rate=counts.route_mismatches / vtl if rates_ok else None,
        expert_slot_mismatch=counts.missing_slots / (counts.top_k * vtl) if rates_ok else None,
        token_any_mismatch=counts.mismatched_tokens / n_tok if rates_ok else None,
        per_layer_mismatch=per_layer,
        f_tau_2=counts.f_tau_2_count / n_tok if lp_ok else None,
        kl_k1=counts.kl_k1_sum / n_tok if lp_ok else None,
        kl_k3=counts.kl_k3_sum / n_tok if lp_ok else None,
        logprob_abs_diff=counts.logprob_abs_diff_sum / n_tok if lp_ok else None,
        metric_error=[c for c in ERROR_CODES if c in codes],
        counts=counts,
        logprob_diff=diff if lp_ok else None,
    )


def aggregate(metrics_list: Sequence[RouterMetrics]) -> RouterMetrics:
    """Combine bundles (ranks of one step, or steps of a run) by summing sums.

    A route or log-prob error in any part nulls that family in the aggregate
    (a failing rank must not be averaged away); empty_response_mask is judged
    on the totals, so one rank with no valid tokens is fine.
    """
    if not metrics_list:
        raise ValueError("aggregate needs at least one RouterMetrics")
    codes: set[str] = set()
    total = RouterCounts(routes_measured=True, logprob_measured=True)
    top_ks = {metrics.counts.top_k for metrics in metrics_list if metrics.counts.routes_measured}
    if len(top_ks) > 1:
        raise ValueError(f"cannot aggregate different top_k values {sorted(top_ks)}")
    total.top_k = top_ks.pop() if top_ks else metrics_list[0].counts.top_k
    layer_counts = {
        len(metrics.counts.per_layer_valid_token_layers)
        for metrics in metrics_list
        if metrics.counts.routes_measured
    }
    if len(layer_counts) > 1:
        raise ValueError(f"cannot aggregate different layer counts {sorted(layer_counts)}")
    n_layers = layer_counts.pop() if layer_counts else 0
    total.per_layer_mismatches = [0] * n_layers
    total.per_layer_valid_token_layers = [0] * n_layers
    diffs: list[np.ndarray] = []
    keep_diffs = True
    for metrics in metrics_list:
        c = metrics.counts
        codes.update(e for e in metrics.metric_error if e != "empty_response_mask")
        total.valid_tokens += c.valid_tokens
        total.routes_measured &= c.routes_measured
        total.logprob_measured &= c.logprob_measured
        if c.routes_measured:
            total.valid_token_layers += c.valid_token_layers
            total.route_mismatches += c.route_mismatches
            total.missing_slots += c.missing_slots
            total.mismatched_tokens += c.mismatched_tokens
            for i in range(n_layers):
                total.per_layer_mismatches[i] += c.per_layer_mismatches[i]
                total.per_layer_valid_token_layers[i] += c.per_layer_valid_token_layers[i]
        if c.logprob_measured:
            total.f_tau_2_count += c.f_tau_2_count
            total.kl_k1_sum += c.kl_k1_sum
            total.kl_k3_sum += c.kl_k3_sum
            total.logprob_abs_diff_sum += c.logprob_abs_diff_sum
            if metrics.logprob_diff is not None:
                diffs.append(metrics.logprob_diff)
            elif c.valid_tokens:
                keep_diffs = False
    diff = np.concatenate(diffs) if keep_diffs and total.logprob_measured and diffs else None
    if diff is None and keep_diffs and total.logprob_measured:
        diff = np.zeros(0)
    return _finish(total, codes, diff)
