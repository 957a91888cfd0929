"""Catalog-wide queries: divergences, router metrics and comparison, store statistics."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query

from trajstore.catalog import query_divergences, query_router_metrics, stats
from trajstore.catalog.queries import DEFAULT_PAGE_SIZE, decode_cursor, encode_cursor, run_names
from trajstore.errors import UsageError
from trajstore.jsonio import json_safe

from .. import models
from ..detail import check_range, check_run
from ..errors import ApiError
from ..params import Cursor, Limit, OptId, Text
from ..state import AppState, StateDep

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
    if run is not None:
        check_run(state.view, run)
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
    if run is not None:
        check_run(state.view, run)
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
    """Counts and sizes over the catalog (or one run: any run ever published, so a removed
    one still shows its removed bundles)."""
    if run is not None:
        check_run(state.view, run, run_names(state.snap.catalog))
    return models.Open(**json_safe(stats(state.snap.catalog, run=run)))


def _step_window(
    state: AppState,
    runs: list[str],
    rollout_from: int | None,
    rollout_to: int | None,
    limit: int,
    cursor: str | None,
) -> tuple[list[tuple[int, int]], str | None]:
    """The union of the runs' actor steps in range, after the cursor: one page of ids.

    The cursor is bound to the runs and range (as the catalog listings' cursors): a
    step position from one set of runs would page another set from the wrong place.
    """
    query = {"run": runs, "rollout_from": rollout_from, "rollout_to": rollout_to}
    try:
        after = decode_cursor("router_compare", query, cursor, "ii")
    except UsageError as exc:
        raise ApiError(400, "bad_filter", str(exc)) from None
    wanted = set(runs)
    ids = sorted(
        {
            (rollout_id, step_id)
            for run, kind, rollout_id, step_id in state.view.groups
            if kind == "step"
            and run in wanted
            and (rollout_from is None or rollout_id >= rollout_from)
            and (rollout_to is None or rollout_id <= rollout_to)
            and (after is None or (rollout_id, step_id) > tuple(after))
        }
    )
    if len(ids) > limit:
        return ids[:limit], encode_cursor("router_compare", query, list(ids[limit - 1]))
    return ids, None


@router.get("/router/compare", response_model=models.RouterComparison)
def router_compare(
    state: StateDep,
    run: Annotated[list[str], Query(min_length=2, max_length=20, description="two or more")],
    rollout_from: OptId = None,
    rollout_to: OptId = None,
    recompute: Annotated[
        bool,
        Query(
            description="also recompute the page's steps from their payloads; 409 unless both agree"
        ),
    ] = False,
    limit: Limit = None,
    cursor: Cursor = None,
) -> models.RouterComparison:
    """`trajstore router compare --format json` over a page of steps (the union of the
    runs' steps in range, in step order), from the sums stored with each bundle (no
    payload is read); ratios and stability cover that page. ``recompute``: as the CLI's
    ``--recompute``, every step of the page again from its payloads, 409
    ``recompute_disagrees`` unless both agree."""
    from trajstore.router.compare import compare_store, compare_stored, disagreements

    for name in run:
        check_run(state.view, name)
    check_range(rollout_from, rollout_to)
    steps, next_cursor = _step_window(
        state, run, rollout_from, rollout_to, limit or DEFAULT_PAGE_SIZE, cursor
    )
    with state.replay_lock:  # the store's ref index is not thread-safe
        comparison = compare_stored(state.store, run, steps=steps)
        differ = (
            disagreements(comparison, compare_store(state.store, run, steps=steps))
            if recompute
            else []
        )
    if differ:
        more = f" (+{len(differ) - 1} more)" if len(differ) > 1 else ""
        raise ApiError(
            409,
            "recompute_disagrees",
            f"stored and recomputed metrics disagree: {differ[0]}{more}",
        )
    return models.RouterComparison(**json_safe(comparison.to_dict()), next_cursor=next_cursor)
