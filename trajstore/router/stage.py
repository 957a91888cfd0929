"""The ``router.consistency`` replay stage: recompute the producer's route metrics.

A producer may record its own route/log-prob consistency numbers in
expected.json under ``router.consistency`` (router-metrics.md names). Those
numbers are only as good as what the producer compared: an early R3
implementation compared the replay target with itself and reported a perfect
0 while the executed routes differed. This stage recomputes every recorded
metric from the bundle's own payloads (``rollout_routed_experts``,
``train_routed_experts``, ``rollout_log_probs``, ``train_log_probs``) and
``config.router``, and fails on any disagreement beyond the manifest's
tolerance for ``router.consistency``.

Keys under ``router.consistency`` that are not metric names (for example the
stability counters ``hang_count``, ``engine_error_count``) are not compared.
The stage works on the whole bundle: the recorded numbers describe all of it,
so a partial sample selection skips it (register it ``cohort_level``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from trajstore.errors import BundleError
from trajstore.replay.compare import Divergence
from trajstore.replay.source import BundleSource, as_float
from trajstore.replay.stages import ReplayContext, StageInputError, StageOutcome
from trajstore.router.metrics import METRIC_NAMES, RouterMetrics, compute_router_metrics

STAGE = "router.consistency"
ROLLOUT_ROUTES = "rollout_routed_experts"
TRAIN_ROUTES = "train_routed_experts"
NATURAL_ROUTES = "train_natural_routed_experts"
ROLLOUT_LOGPROBS = "rollout_log_probs"
TRAIN_LOGPROBS = "train_log_probs"
#: integer counts compare exactly; every other metric within the tolerance
EXACT_METRICS = ("valid_tokens", "valid_token_layers")
#: stability counters a producer may record next to its metrics (never recomputed)
STABILITY_COUNTERS = ("hang_count", "engine_error_count")
_REQUIRED_ROUTER_KEYS = ("num_experts", "num_layers", "top_k")


def router_config(source: BundleSource) -> dict[str, Any]:
    """``config.router`` with num_experts/num_layers/top_k checked; BundleError otherwise."""
    router = source.index.config.get("router")
    if not isinstance(router, dict):
        raise BundleError(
            f"{source.label}: index.json config.router is missing "
            "(num_experts, num_layers, top_k are needed to measure routes)"
        )
    bad = [
        k
        for k in _REQUIRED_ROUTER_KEYS
        if not isinstance(router.get(k), int) or isinstance(router.get(k), bool) or router[k] < 1
    ]
    if bad:
        raise BundleError(
            f"{source.label}: config.router.{', '.join(bad)} must be positive integer(s)"
        )
    return router


def _logprobs(source: BundleSource, name: str) -> np.ndarray | None:
    if name not in source.manifest.payloads:
        return None
    return as_float(source.payload(name), source.manifest.payloads[name].dtype)


def recompute_router_metrics(source: BundleSource) -> RouterMetrics:
    """Router metrics of a whole bundle from its payloads (what replay and the CLI report)."""
    router = router_config(source)
    names = source.manifest.payloads
    samples = source.index.samples
    return compute_router_metrics(
        source.payload(ROLLOUT_ROUTES) if ROLLOUT_ROUTES in names else None,
        source.payload(TRAIN_ROUTES) if TRAIN_ROUTES in names else None,
        total_lengths=[s.total_length for s in samples],
        response_lengths=[s.response_length for s in samples],
        loss_masks=[s.loss_mask for s in samples],
        num_experts=router["num_experts"],
        num_layers=router["num_layers"],
        top_k=router["top_k"],
        rollout_log_probs=_logprobs(source, ROLLOUT_LOGPROBS),
        train_log_probs=_logprobs(source, TRAIN_LOGPROBS),
        dense_layers=router.get("dense_layers") or (),
    )


def router_capability(source: BundleSource) -> tuple[str, str]:
    """(recompute | skipped | unsupported, reason) of ``router.consistency`` on this bundle."""
    contract = source.manifest.stage_contracts.get(STAGE)
    if contract is not None and contract.capability == "unsupported":
        return "unsupported", "the producer declares this stage unsupported"
    if contract is not None and contract.capability != "recompute":
        return "skipped", f"declared {contract.capability} by the producer"
    recorded = source.expected.get(STAGE)
    if not isinstance(recorded, dict) or not any(k in recorded for k in METRIC_NAMES):
        return "skipped", "the producer recorded no router.consistency metrics"
    try:
        router_config(source)
    except BundleError as exc:
        return "unsupported", str(exc).split(": ", 1)[-1]
    return "recompute", ""


def _as_number(value: Any) -> float | None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _differs(expected: Any, actual: Any, atol: float, rtol: float, exact: bool) -> bool:
    """Null is a value here: null vs a number is a disagreement, null vs null is not."""
    e, a = _as_number(expected), _as_number(actual)
    if e is None or a is None:
        return not (expected is None and actual is None)
    if math.isnan(e) or math.isnan(a):
        return not (math.isnan(e) and math.isnan(a))
    if exact:
        return e != a
    return not abs(a - e) <= atol + rtol * abs(e)


def compare_recorded(
    recorded: dict[str, Any], actual: RouterMetrics, *, atol: float, rtol: float
) -> list[Divergence]:
    """One Divergence per recorded metric the recomputation disagrees with."""
    got = actual.to_dict()
    divs: list[Divergence] = []

    def add(field: str, e: Any, a: Any) -> None:
        en, an = _as_number(e), _as_number(a)
        err = abs(an - en) if en is not None and an is not None else None
        divs.append(Divergence(STAGE, None, field, None, en, an, err))

    for name in METRIC_NAMES:
        if name not in recorded:
            continue
        e, a = recorded[name], got[name]
        if name == "metric_error":
            e_codes = sorted([e] if isinstance(e, str) else list(e or []))
            if e_codes != sorted(a):
                divs.append(Divergence(STAGE, None, "metric_error", None, None, None, None))
        elif name == "per_layer_mismatch":
            if e is None or a is None or not isinstance(e, list) or len(e) != len(a):
                if not (e is None and a is None):
                    add(name, None, None)
                continue
            for i, (ei, ai) in enumerate(zip(e, a, strict=True)):
                if _differs(ei, ai, atol, rtol, exact=False):
                    add(f"per_layer_mismatch[{i}]", ei, ai)
        elif _differs(e, a, atol, rtol, exact=name in EXACT_METRICS):
            add(name, e, a)
    return divs


def _reason(divs: list[Divergence], recorded: dict[str, Any], actual: RouterMetrics) -> str:
    fields = ", ".join(dict.fromkeys(d.field.split("[")[0] for d in divs))
    why = f"recorded router metrics disagree with the payloads in {fields}"
    rec = _as_number(recorded.get("route_mismatch_rate"))
    if rec == 0.0 and (actual.route_mismatch_rate or 0.0) > 0.0:
        why += (
            f" (recorded route_mismatch_rate 0, routes differ: {actual.route_mismatch_rate:.4g}"
            f" of {actual.valid_token_layers} token-layers; was the replay target compared with itself?)"
        )
    return why


def stage_router_consistency(ctx: ReplayContext) -> StageOutcome:
    """Recompute the producer's recorded router.consistency metrics and compare them."""
    source = ctx.source
    recorded = source.expected.get(STAGE)
    if not isinstance(recorded, dict):
        raise StageInputError("incomplete bundle: expected.json has no router.consistency")
    if ctx.partial:
        return StageOutcome(
            STAGE, "skipped", "recorded router metrics describe the whole bundle", requested=False
        )
    try:
        actual = recompute_router_metrics(source)
    except (BundleError, ValueError, TypeError) as exc:
        raise StageInputError(f"cannot recompute router metrics: {exc}") from None
    atol, rtol = ctx.tolerance(STAGE)
    divs = compare_recorded(recorded, actual, atol=atol, rtol=rtol)
    errs = [d.abs_err for d in divs if d.abs_err is not None]
    max_err = max(errs, default=0.0)
    if not divs:
        return StageOutcome(STAGE, "pass", "", max_abs_error=max_err, mismatch_count=0)
    return StageOutcome(
        STAGE,
        "fail",
        _reason(divs, recorded, actual),
        max_abs_error=max_err if errs else None,
        mismatch_count=len(divs),
        divergences=divs[:10],
    )
