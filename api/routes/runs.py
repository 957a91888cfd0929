"""``GET /v1/runs``: the runs that hold at least one bundle; one run's summary and strip."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import Response

from trajstore.catalog import list_runs
from trajstore.catalog.overview import MAX_STRIP_BINS, run_summary, step_strip
from trajstore.jsonio import json_safe

from .. import models
from ..detail import check_range, check_run
from ..params import OptId, RunName
from ..state import StateDep

router = APIRouter()


@router.get("/runs", response_model=models.RunList)
def runs(state: StateDep) -> models.RunList:
    items = [run for run in list_runs(state.snap.catalog) if run["num_bundles"]]
    return models.RunList(items=[models.Run(**json_safe(run)) for run in items])


@router.get("/runs/{run}/summary", response_model=models.RunSummary)
def summary(state: StateDep, run: RunName) -> Response:
    """Steps by latest verdict, first-divergent-stage histogram, bytes and dedup ratio.

    Whole-run aggregates cost time in proportion to the run's steps (the web view's steps
    page asks for them on every load): built once per catalog generation (`detail_json`)."""
    check_run(state.view, run)
    body = state.detail_json(
        ("summary", run),
        lambda: models.RunSummary(**json_safe(run_summary(state.snap.catalog, run))),
    )
    return Response(body, media_type="application/json")


@router.get("/runs/{run}/strip", response_model=models.Strip)
def strip(
    state: StateDep,
    run: RunName,
    rollout_from: OptId = None,
    rollout_to: OptId = None,
    bins: Annotated[int, Query(ge=1, le=MAX_STRIP_BINS, description="at most this many")] = 400,
) -> Response:
    """Step counts per verdict in equal-width rollout bins (a strip chart's data); built
    once per catalog generation, as the summary."""
    check_run(state.view, run)
    check_range(rollout_from, rollout_to)

    def build() -> models.Strip:
        page = step_strip(
            state.snap.catalog, run, rollout_from=rollout_from, rollout_to=rollout_to, bins=bins
        )
        return models.Strip(**json_safe(page))

    body = state.detail_json(("strip", run, rollout_from, rollout_to, bins), build)
    return Response(body, media_type="application/json")
