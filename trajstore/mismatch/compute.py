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
from trajstore.router.metrics import ROUTE_ERRORS, _sample_layout, compute_router_metrics

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


def _pair_sums(
    rollout: np.ndarray,
    trainer: np.ndarray,
    valid_r: np.ndarray,
    clip_c: float | None,
) -> dict[str, Any]:
    d = trainer[valid_r] - rollout[valid_r]
    a = np.abs(d)
    pr, pt = np.exp(rollout[valid_r]), np.exp(trainer[valid_r])
    dp = np.abs(pt - pr)
    ratio = np.exp(d)
    n = int(d.size)
    out: dict[str, Any] = {
        "n": n,
        "abs_dlogp_sum": float(a.sum()),
        "abs_dlogp_max": float(a.max()) if n else None,
        "abs_dp_sum": float(dp.sum()),
        "abs_dp_max": float(dp.max()) if n else None,
        "d_sum": float(d.sum()) + 0.0,
        "k3_sum": float((np.expm1(d) - d).sum()),
        "mult_sum": float(np.exp(a).sum()),
        "pr_sum": float(pr.sum()),
        "pt_sum": float(pt.sum()),
        "pr2_sum": float((pr * pr).sum()),
        "pt2_sum": float((pt * pt).sum()),
        "prpt_sum": float((pr * pt).sum()),
        **{f"gt_{name}": int(np.count_nonzero(a > value)) for name, value in THRESHOLDS},
        "ratio_min": float(ratio.min()) if n else None,
        "ratio_max": float(ratio.max()) if n else None,
        "clip_c": clip_c,
        "clip_count": int(np.count_nonzero(ratio > clip_c)) if clip_c is not None else None,
        "error": None,
    }
    return out


def _worst_per_sample(
    rollout: np.ndarray,
    trainer: np.ndarray,
    response_lengths: Sequence[int],
    valid_r: np.ndarray,
    sample_ids: Sequence[str],
) -> list[dict[str, Any]]:
    """Per sample with a masked-in token: its token of largest |d| (first on ties).

    `valid_r` is increasing, so each sample's valid tokens are one contiguous run."""
    if not valid_r.size:
        return []
    rl = np.asarray(response_lengths, dtype=np.int64)
    ends = np.cumsum(rl)
    starts = ends - rl
    owner = np.searchsorted(ends, valid_r, side="right")
    a = np.abs(trainer[valid_r] - rollout[valid_r])
    first = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
    best = np.maximum.reduceat(a, first)
    hit = np.flatnonzero(a == np.repeat(best, np.diff(np.r_[first, a.size])))
    _, at = np.unique(owner[hit], return_index=True)  # the first maximum of each sample
    out = []
    for i in hit[at].tolist():
        s, r = int(owner[i]), int(valid_r[i])
        out.append(
            {
                "sample_id": str(sample_ids[s]),
                "position": s,
                "offset": r - int(starts[s]),
                "rollout": float(rollout[r]),
                "trainer": float(trainer[r]),
                "abs_dlogp": float(a[i]),
            }
        )
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
    or None when the bundle has none.
    """
    _, r_total, valid_pos, valid_r = _sample_layout(total_lengths, response_lengths, loss_masks)
    clip_c = clip_cap(config)
    entry: dict[str, Any] = {"version": MISMATCH_VERSION, "pairs": {}, "worst": {}}
    document: dict[str, Any] = {"version": MISMATCH_VERSION, "worst_per_sample": {}}
    rollout_raw = payloads(ROLLOUT_PAYLOAD)
    rollout, rollout_error = _checked_logprobs(rollout_raw, r_total, ROLLOUT_PAYLOAD)
    for pair, name in PAIRS:
        raw = payloads(name)
        trainer, error = _checked_logprobs(raw, r_total, name)
        error = rollout_error or error
        if raw is None and rollout_raw is None:  # not measured at all (router-metrics.md)
            error = f"missing_logprob: the bundle has neither {ROLLOUT_PAYLOAD} nor {name}"
        if error is None and not valid_r.size:
            error = "empty_response_mask: no masked-in response token"
        if error is None and not (
            np.isfinite(rollout[valid_r]).all() and np.isfinite(trainer[valid_r]).all()
        ):
            error = f"non_finite_logprob: NaN or Inf at a masked-in token of {name} or rollout"
        if error is not None:
            entry["pairs"][pair] = {"error": error}
            continue
        entry["pairs"][pair] = _pair_sums(rollout, trainer, valid_r, clip_c)
        per_sample = _worst_per_sample(rollout, trainer, response_lengths, valid_r, sample_ids)
        document["worst_per_sample"][pair] = per_sample
        entry["worst"][pair] = sorted(per_sample, key=lambda w: -w["abs_dlogp"])[:REF_WORST]
    entry["routes"] = _route_sums(
        payloads, total_lengths, response_lengths, loss_masks, config, valid_pos.size
    )
    return entry, document


def _route_sums(
    payloads: Callable[[str], np.ndarray | None],
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    loss_masks: Sequence[Sequence[int]],
    config: Mapping[str, Any] | None,
    valid_tokens: int,
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
    m = compute_router_metrics(
        a,
        b,
        total_lengths=total_lengths,
        response_lengths=response_lengths,
        loss_masks=loss_masks,
        num_experts=router["num_experts"],
        num_layers=router["num_layers"],
        top_k=router["top_k"],
        dense_layers=router.get("dense_layers") or (),
    )
    codes = [c for c in m.metric_error if c in ROUTE_ERRORS]
    if codes:
        return {"error": f"{codes[0]}: see docs/router-metrics.md"}
    c = m.counts
    return {
        "valid_tokens": int(valid_tokens),
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
