"""A bundle's mismatch sums, from its payload arrays (NumPy).

Log-probs: each trainer-side payload of `metrics.PAIRS` against ``rollout_log_probs``
on masked-in response tokens, d = trainer - rollout per token, in float64. Routes:
`trajstore.router.metrics` counts them (the same code and numbers as ``router
metrics``; nothing is counted twice). Everything kept is a sum, a count or an extreme,
so the ranks of a step add up (`metrics` derives the per-step values). A pair or the
routes that cannot be measured carry ``error`` ("code: why") and no numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from trajstore.mismatch import MISMATCH_VERSION
from trajstore.mismatch.metrics import CLIP_CONFIG_KEYS, PAIRS, ROLLOUT_PAYLOAD, THRESHOLDS
from trajstore.router.metrics import ROUTE_ERRORS, RouterCounts, _sample_layout, measure_routes

ROLLOUT_ROUTES = "rollout_routed_experts"
TRAIN_ROUTES = "train_routed_experts"
#: payloads the computation reads (ingest keeps these while a bundle is written)
INPUT_PAYLOADS: frozenset[str] = frozenset(
    {ROLLOUT_PAYLOAD, ROLLOUT_ROUTES, TRAIN_ROUTES, *(p for _, p in PAIRS)}
)
#: worst tokens (largest |d|) kept in the ref per pair; every sample's is in the document
REF_WORST = 4


def clip_cap(config: Mapping[str, Any] | None) -> float | None:
    """The importance-ratio truncation cap C the config names (`CLIP_CONFIG_KEYS`)."""
    for key in CLIP_CONFIG_KEYS:
        value = (config or {}).get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
    return None


def _pair_sums(r: np.ndarray, t: np.ndarray, clip_c: float | None) -> list[dict[str, Any]]:
    """The sums of each pair, at once: `r` [n] the sampler's log-probs of the valid tokens,
    `t` [P, n] the trainer side of P pairs (n > 0, all finite). Each value is the one a
    pair's own 1-D computation gives (a row's reduction is the 1-D reduction of it)."""
    d = t - r
    a = np.abs(d)
    pr, pt = np.exp(r), np.exp(t)
    dp = np.abs(pt - pr)
    ratio = np.exp(d)
    n = int(r.size)
    columns: dict[str, list[Any]] = {
        "abs_dlogp_sum": a.sum(1).tolist(),
        "abs_dlogp_max": a.max(1).tolist(),
        "abs_dp_sum": dp.sum(1).tolist(),
        "abs_dp_max": dp.max(1).tolist(),
        "d_sum": (d.sum(1) + 0.0).tolist(),
        "k3_sum": (np.expm1(d) - d).sum(1).tolist(),
        "mult_sum": np.exp(a).sum(1).tolist(),
        "pr_sum": [float(pr.sum())] * len(t),
        "pt_sum": pt.sum(1).tolist(),
        "pr2_sum": [float((pr * pr).sum())] * len(t),
        "pt2_sum": (pt * pt).sum(1).tolist(),
        "prpt_sum": (pr * pt).sum(1).tolist(),
        **{
            f"gt_{name}": np.count_nonzero(a > value, axis=1).tolist() for name, value in THRESHOLDS
        },
        "ratio_min": ratio.min(1).tolist(),
        "ratio_max": ratio.max(1).tolist(),
        "clip_c": [clip_c] * len(t),
        "clip_count": np.count_nonzero(ratio > clip_c, axis=1).tolist()
        if clip_c is not None
        else [None] * len(t),
        "error": [None] * len(t),
    }
    return [
        {"n": n, **{field: values[p] for field, values in columns.items()}} for p in range(len(t))
    ]


def _worst_per_sample(
    r: np.ndarray,
    t: np.ndarray,
    response_lengths: Sequence[int],
    valid_r: np.ndarray,
    sample_ids: Sequence[str],
) -> list[list[dict[str, Any]]]:
    """Per pair (rows of `t` [P, n], against `r` [n], the valid tokens' log-probs), per
    sample with a masked-in token: its token of largest |d| (first on ties).

    `valid_r` is increasing, so each sample's valid tokens are one contiguous run."""
    rl = np.asarray(response_lengths, dtype=np.int64)
    ends = np.cumsum(rl)
    starts = ends - rl
    owner = np.searchsorted(ends, valid_r, side="right")
    first = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
    a = np.abs(t - r)
    best = np.maximum.reduceat(a, first, axis=1)
    at_best = a == np.repeat(best, np.diff(np.r_[first, a.shape[1]]), axis=1)
    # the first maximum of each sample: the least index holding it
    at = np.minimum.reduceat(np.where(at_best, np.arange(a.shape[1]), a.shape[1]), first, axis=1)
    samples = owner[first].tolist()
    offsets = (valid_r[at] - starts[owner[at]]).tolist()  # only the chosen tokens
    rollout = r[at].tolist()
    trainer = np.take_along_axis(t, at, 1).tolist()
    abs_d = np.take_along_axis(a, at, 1).tolist()
    out = [
        [
            {
                "sample_id": str(sample_ids[s]),
                "position": s,
                "offset": offsets[p][j],
                "rollout": rollout[p][j],
                "trainer": trainer[p][j],
                "abs_dlogp": abs_d[p][j],
            }
            for j, s in enumerate(samples)
        ]
        for p in range(len(t))
    ]
    return out


def _checked_logprobs(
    x: np.ndarray | None, r_total: int, name: str
) -> tuple[np.ndarray | None, str | None]:
    if x is None:
        return None, f"missing_logprob: the bundle has no {name}"
    arr = np.asarray(x, dtype=np.float64).reshape(-1)
    if arr.shape != (r_total,):
        return None, f"logprob_length_mismatch: {name} has {arr.size} tokens, expected {r_total}"
    return arr, None


def compute_mismatch(
    payloads: Callable[[str], np.ndarray | None],
    *,
    sample_ids: Sequence[str],
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    loss_masks: Sequence[Sequence[int]],
    config: Mapping[str, Any] | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(ref entry without its document digest, document) of one bundle.

    `payloads(name)` gives a payload as an array (log-probs as floats: bf16 widened),
    or None when the bundle has none. The sample layout is computed once; the pairs
    that can be measured are measured together (`_pair_sums`).
    """
    t_total, r_total, valid_pos, valid_r = _sample_layout(
        total_lengths, response_lengths, loss_masks
    )
    entry: dict[str, Any] = {"version": MISMATCH_VERSION, "pairs": {}, "worst": {}}
    document: dict[str, Any] = {"version": MISMATCH_VERSION, "worst_per_sample": {}}
    rollout_raw = payloads(ROLLOUT_PAYLOAD)
    rollout, rollout_error = _checked_logprobs(rollout_raw, r_total, ROLLOUT_PAYLOAD)
    r_valid = rollout[valid_r] if rollout is not None else None
    r_finite: bool | None = None  # computed once, when a pair needs it
    measured: dict[str, np.ndarray] = {}
    for pair, name in PAIRS:
        raw = payloads(name)
        trainer, error = _checked_logprobs(raw, r_total, name)
        error = rollout_error or error
        if raw is None and rollout_raw is None:  # not measured at all (router-metrics.md)
            error = f"missing_logprob: the bundle has neither {ROLLOUT_PAYLOAD} nor {name}"
        if error is None and not valid_r.size:
            error = "empty_response_mask: no masked-in response token"
        if error is None:
            t_valid = trainer[valid_r]
            if r_finite is None:
                r_finite = bool(np.isfinite(r_valid).all())
            if not (r_finite and np.isfinite(t_valid).all()):
                error = f"non_finite_logprob: NaN or Inf at a masked-in token of {name} or rollout"
        entry["pairs"][pair] = {"error": error}  # replaced by the sums when measured
        if error is None:
            measured[pair] = t_valid
    if measured:
        t = np.stack(list(measured.values()))
        sums = _pair_sums(r_valid, t, clip_cap(config))
        worst = _worst_per_sample(r_valid, t, response_lengths, valid_r, sample_ids)
        for pair, pair_sums, per_sample in zip(measured, sums, worst, strict=True):
            entry["pairs"][pair] = pair_sums
            document["worst_per_sample"][pair] = per_sample
            entry["worst"][pair] = sorted(per_sample, key=lambda w: -w["abs_dlogp"])[:REF_WORST]
    entry["routes"] = _route_sums(payloads, config, t_total, valid_pos)
    return entry, document


def _route_sums(
    payloads: Callable[[str], np.ndarray | None],
    config: Mapping[str, Any] | None,
    t_total: int,
    valid_pos: np.ndarray,
) -> dict[str, Any]:
    router = (config or {}).get("router")
    keys = ("num_experts", "num_layers", "top_k")
    if not isinstance(router, dict) or not all(
        isinstance(router.get(k), int) and not isinstance(router.get(k), bool) and router[k] > 0
        for k in keys
    ):
        return {"error": "no_router_config: config.router lacks num_experts/num_layers/top_k"}
    a, b = payloads(ROLLOUT_ROUTES), payloads(TRAIN_ROUTES)
    if a is None or b is None:
        which = ROLLOUT_ROUTES if a is None else TRAIN_ROUTES
        return {"error": f"missing_route: the bundle has no {which}"}
    c = RouterCounts(valid_tokens=int(valid_pos.size), top_k=int(router["top_k"]))
    codes = measure_routes(
        a,
        b,
        t_total=t_total,
        valid_pos=valid_pos,
        num_experts=router["num_experts"],
        num_layers=router["num_layers"],
        dense_layers=router.get("dense_layers") or (),
        counts=c,
    )
    errors = [code for code in ROUTE_ERRORS if code in codes]
    if errors:
        return {"error": f"{errors[0]}: see docs/router-metrics.md"}
    return {
        "valid_tokens": int(valid_pos.size),
        "valid_token_layers": c.valid_token_layers,
        "mismatches": c.route_mismatches,
        "missing_slots": c.missing_slots,
        "mismatched_tokens": c.mismatched_tokens,
        "top_k": c.top_k,
        "per_layer_mismatches": list(c.per_layer_mismatches),
        "per_layer_valid_token_layers": list(c.per_layer_valid_token_layers),
        "error": None,
    }


def not_computed(why: str) -> dict[str, Any]:
    """The entry of a bundle whose sums do not exist (a ref stored before they were)."""
    return {
        "version": MISMATCH_VERSION,
        "pairs": {pair: {"error": why} for pair, _ in PAIRS},
        "routes": {"error": why},
        "worst": {},
    }


def source_mismatch(source: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """`compute_mismatch` of a bundle read through the replay interface (a bundle
    directory or a stored bundle): what ``reindex`` and ``router compare --recompute`` use."""
    from trajstore.replay.source import as_float

    names = source.manifest.payloads

    def payload(name: str) -> np.ndarray | None:
        if name not in names:
            return None
        arr = source.payload(name)
        return (
            as_float(arr, names[name].dtype) if name not in (ROLLOUT_ROUTES, TRAIN_ROUTES) else arr
        )

    samples = source.index.samples
    return compute_mismatch(
        payload,
        sample_ids=[s.sample_id for s in samples],
        total_lengths=[s.total_length for s in samples],
        response_lengths=[s.response_length for s in samples],
        loss_masks=[s.loss_mask for s in samples],
        config=source.index.config,
    )


def bundle_entry(
    put_document: Callable[[bytes], str],
    payloads: Callable[[str], np.ndarray | None],
    index: Any,
) -> dict[str, Any]:
    """The ``mismatch`` entry of a ref: the sums, with the document stored by
    `put_document` (JSON bytes -> digest). A bundle the computation cannot read (it
    passed the gate, so this is not expected) gets every family's error, never a number."""
    import json

    samples = index.samples
    try:
        entry, document = compute_mismatch(
            payloads,
            sample_ids=[s.sample_id for s in samples],
            total_lengths=[s.total_length for s in samples],
            response_lengths=[s.response_length for s in samples],
            loss_masks=[s.loss_mask for s in samples],
            config=index.config,
        )
    except (ValueError, TypeError) as exc:
        return not_computed(f"compute_failed: {str(exc).splitlines()[0]}")
    entry["document"] = put_document(json.dumps(document, sort_keys=True).encode())
    return entry
