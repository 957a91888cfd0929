"""Catalog-wide queries: divergences, router metrics and store statistics."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query

from trajstore.catalog import query_divergences, query_router_metrics, stats
from trajstore.jsonio import json_safe

from .. import models
from ..detail import check_range
from ..params import Cursor, Limit, OptId, Text
from ..state import StateDep

router = APIRouter()


@router.get("/divergences", response_model=models.Page)
def divergences(
    state: StateDep,
    run: Text = None,
    stage: Text = None,
    sample_id: Text = None,
    min_abs_err: Annotated[float | None, Query(ge=0, allow_inf_nan=False)] = None,
    rollout_from: OptId = None,
    rollout_to: OptId = None,
    limit: Limit = None,
    cursor: Cursor = None,
) -> models.Page:
    """Divergences of each visible step's or rollout's latest result."""
    check_range(rollout_from, rollout_to)
    page = query_divergences(
        state.snap.catalog,
        run=run,
        stage=stage,
        min_abs_err=min_abs_err,
        sample_id=sample_id,
        rollout_from=rollout_from,
        rollout_to=rollout_to,
        limit=limit,
        cursor=cursor,
    )
    return models.Page(**json_safe(page))


@router.get("/router/metrics", response_model=models.Page)
def router_metrics(
    state: StateDep,
    run: Text = None,
    rollout_from: OptId = None,
    rollout_to: OptId = None,
    source: Annotated[Literal["producer", "replay"] | None, Query()] = None,
    limit: Limit = None,
    cursor: Cursor = None,
) -> models.Page:
    """Route consistency metrics (router-metrics.md names) per bundle."""
    check_range(rollout_from, rollout_to)
    page = query_router_metrics(
        state.snap.catalog,
        run=run,
        rollout_from=rollout_from,
        rollout_to=rollout_to,
        source=source,
        limit=limit,
        cursor=cursor,
    )
    return models.Page(**json_safe(page))


@router.get("/stats", response_model=models.Open)
def store_stats(state: StateDep, run: Text = None) -> models.Open:
    """Counts and sizes over the catalog (or one run)."""
    return models.Open(**json_safe(stats(state.snap.catalog, run=run)))
