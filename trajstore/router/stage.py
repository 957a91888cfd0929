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
from trajstore.replay.context import (
    MAX_STAGE_EXAMPLES,
    ReplayContext,
    StageInputError,
    StageOutcome,
)
from trajstore.replay.registry import StageDef, register_stage
from trajstore.replay.source import BundleSource, as_float
from trajstore.router.metrics import METRIC_NAMES, RouterMetrics, compute_router_metrics
from trajstore.vocab import Capability, Payload, Stage, StageStatus

STAGE = Stage.ROUTER_CONSISTENCY
ROLLOUT_ROUTES = Payload.ROLLOUT_ROUTED_EXPERTS
TRAIN_ROUTES = Payload.TRAIN_ROUTED_EXPERTS
NATURAL_ROUTES = Payload.TRAIN_NATURAL_ROUTED_EXPERTS
ROLLOUT_LOGPROBS = Payload.ROLLOUT_LOG_PROBS
TRAIN_LOGPROBS = Payload.TRAIN_LOG_PROBS
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


def payload_logprobs(source: BundleSource, name: str) -> np.ndarray | None:
    """A log-prob payload as floats (bfloat16 widened), None when the bundle has none."""
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
        rollout_log_probs=payload_logprobs(source, ROLLOUT_LOGPROBS),
        train_log_probs=payload_logprobs(source, TRAIN_LOGPROBS),
        dense_layers=router.get("dense_layers") or (),
    )


def router_capability(source: BundleSource) -> tuple[Capability, str]:
    """(recompute | skipped | unsupported, reason) of ``router.consistency`` on this bundle."""
    contract = source.manifest.stage_contracts.get(STAGE)
    if contract is not None and contract.capability == Capability.UNSUPPORTED:
        return Capability.UNSUPPORTED, "the producer declares this stage unsupported"
    if contract is not None and contract.capability != Capability.RECOMPUTE:
        return Capability.SKIPPED, f"declared {contract.capability} by the producer"
    recorded = source.expected.get(STAGE)
    if not isinstance(recorded, dict) or not any(name in recorded for name in METRIC_NAMES):
        return Capability.SKIPPED, f"the producer recorded no {STAGE} metrics"
    try:
        router_config(source)
    except BundleError as exc:
        return Capability.UNSUPPORTED, str(exc).split(": ", 1)[-1]
    return Capability.RECOMPUTE, ""


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
    divergences: list[Divergence] = []

    def add(field: str, expected: Any, actual: Any) -> None:
        expected_number, actual_number = _as_number(expected), _as_number(actual)
        known = expected_number is not None and actual_number is not None
        divergences.append(
            Divergence(
                stage=STAGE,
                sample_id=None,
                field=field,
                token_offset=None,
                expected=expected_number,
                actual=actual_number,
                abs_err=abs(actual_number - expected_number) if known else None,
            )
        )

    for name in METRIC_NAMES:
        if name not in recorded:
            continue
        expected, actual_value = recorded[name], got[name]
        if name == "metric_error":
            # codes: a string, a list of strings or null; anything else disagrees (a list
            # holding a non-string, or a number, raised TypeError here: tests/fuzz)
            codes = [expected] if isinstance(expected, str) else expected or []
            if (
                not isinstance(codes, list)
                or not all(isinstance(code, str) for code in codes)
                or sorted(codes) != sorted(actual_value)
            ):
                add(name, None, None)
        elif name == "per_layer_mismatch":
            if (
                expected is None
                or actual_value is None
                or not isinstance(expected, list)
                or len(expected) != len(actual_value)
            ):
                if not (expected is None and actual_value is None):
                    add(name, None, None)
                continue
            for layer, (expected_layer, actual_layer) in enumerate(
                zip(expected, actual_value, strict=True)
            ):
                if _differs(expected_layer, actual_layer, atol, rtol, exact=False):
                    add(f"per_layer_mismatch[{layer}]", expected_layer, actual_layer)
        elif _differs(expected, actual_value, atol, rtol, exact=name in EXACT_METRICS):
            add(name, expected, actual_value)
    return divergences


def _reason(divergences: list[Divergence], recorded: dict[str, Any], actual: RouterMetrics) -> str:
    fields = ", ".join(dict.fromkeys(d.field.split("[")[0] for d in divergences))
    why = f"recorded router metrics disagree with the payloads in {fields}"
    recorded_rate = _as_number(recorded.get("route_mismatch_rate"))
    if recorded_rate == 0.0 and (actual.route_mismatch_rate or 0.0) > 0.0:
        why += (
            f" (recorded route_mismatch_rate 0, routes differ: {actual.route_mismatch_rate:.4g}"
            f" of {actual.valid_token_layers} token-layers;"
            " was the replay target compared with itself?)"
        )
    return why


def stage_router_consistency(ctx: ReplayContext) -> StageOutcome:
    """Recompute the producer's recorded router.consistency metrics and compare them."""
    source = ctx.source
    recorded = source.expected.get(STAGE)
    if not isinstance(recorded, dict):
        raise StageInputError(f"incomplete bundle: expected.json has no {STAGE}")
    if ctx.partial:
        return StageOutcome(
            stage=STAGE,
            status=StageStatus.SKIPPED,
            reason="recorded router metrics describe the whole bundle",
            requested=False,
        )
    try:
        actual = recompute_router_metrics(source)
    except (BundleError, ValueError, TypeError) as exc:
        raise StageInputError(f"cannot recompute router metrics: {exc}") from None
    atol, rtol = ctx.tolerance(STAGE)
    divergences = compare_recorded(recorded, actual, atol=atol, rtol=rtol)
    errors = [d.abs_err for d in divergences if d.abs_err is not None]
    max_err = max(errors, default=0.0)
    if not divergences:
        return StageOutcome(
            stage=STAGE, status=StageStatus.PASS, max_abs_error=max_err, mismatch_count=0
        )
    return StageOutcome(
        stage=STAGE,
        status=StageStatus.FAIL,
        reason=_reason(divergences, recorded, actual),
        max_abs_error=max_err if errors else None,
        mismatch_count=len(divergences),
        divergences=divergences[:MAX_STAGE_EXAMPLES],
    )


register_stage(
    StageDef(
        name=STAGE,
        run=stage_router_consistency,
        capability=router_capability,
        inputs=(
            ROLLOUT_ROUTES,
            TRAIN_ROUTES,
            ROLLOUT_LOGPROBS,
            TRAIN_LOGPROBS,
            "config.router",
        ),
        outputs=("route metrics",),
        compared_with=(f"expected.{STAGE}",),
        cohort_level=True,
    )
)
