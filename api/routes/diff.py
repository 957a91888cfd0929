"""``GET /v1/diff``: two stored steps, rollouts or bundles side by side (`trajstore diff`)."""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import APIRouter, Query

from trajstore.jsonio import json_safe

from .. import models
from ..detail import check_run, known_bundle
from ..errors import ApiError
from ..state import AppState, StateDep

router = APIRouter()

#: a side as `trajstore diff --store` spells it: RUN/R:S[@A], RUN/rollout-R[@A], or a bundle key
_SIDE = re.compile(
    r"^([A-Za-z0-9._-]+)/(?:(\d{1,18}):(\d{1,18})|rollout-(\d{1,18}))(?:@(\d{1,9}))?$"
)

Side = Annotated[
    str, Query(min_length=1, max_length=1000, description="RUN/R:S[@A], RUN/rollout-R[@A] or key")
]


def _sources(state: AppState, spec: str) -> list[Any]:
    """The stored bundles (every rank) one side names; 404 when the store lacks them."""
    match = _SIDE.match(spec)
    if match is None:
        known_bundle(state.view, spec)
        return [state.store.bundle(spec)]
    run, rollout, step, rollout_only, attempt = match.groups()
    check_run(state.view, run)
    chosen = int(attempt) if attempt else None
    if rollout is not None:
        return state.store.step(run, int(rollout), int(step), attempt=chosen)
    return state.store.rollout(run, int(rollout_only), attempt=chosen)


@router.get("/diff", response_model=models.DiffResponse)
def diff(state: StateDep, a: Side, b: Side) -> models.DiffResponse:
    """First differing identity, sample, config, expected value and payload token, per rank."""
    from trajstore.diff import diff_sources

    with state.replay_lock:  # the store's ref index is not thread-safe
        side_a, side_b = _sources(state, a), _sources(state, b)
        if len(side_a) != len(side_b):
            raise ApiError(
                400,
                "bad_request",
                f"{a} has {len(side_a)} rank(s), {b} has {len(side_b)}; cannot pair them",
            )
        several = len(side_a) > 1
        reports = [
            diff_sources(
                x,
                y,
                a_label=a + (f"[rank {x.rank}]" if several else ""),
                b_label=b + (f"[rank {y.rank}]" if several else ""),
            )
            for x, y in zip(side_a, side_b, strict=True)
        ]
    return models.DiffResponse(
        same=all(report.same for report in reports),
        reports=[json_safe(report.to_dict()) for report in reports],
    )
