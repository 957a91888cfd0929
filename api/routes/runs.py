"""``GET /v1/runs``: the runs that hold at least one bundle; one run's summary and strip."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import Response

from trajstore.catalog import list_runs
from trajstore.catalog.overview import (
    MAX_STRIP_BINS,
    VerdictRows,
    run_summary,
    step_strip,
    verdict_rows,
)
from trajstore.catalog.queries import (
    DEFAULT_PAGE_SIZE,
    MAX_PAGE_SIZE,
    decode_cursor,
    encode_cursor,
    executor,
    query_mismatch,
    query_mismatch_heat,
)
from trajstore.errors import UsageError
from trajstore.jsonio import json_safe

from .. import models
from ..detail import check_range, check_run
from ..errors import ApiError
from ..params import Cursor, Id, Limit, OptId, RunName, Text
from ..state import AppState, StateDep

router = APIRouter()
#: the most columns a heat map is asked for (the web view asks for its width's worth)
MAX_HEAT_BINS = 10_000


@router.get("/runs", response_model=models.RunList)
def runs(state: StateDep) -> models.RunList:
    items = [run for run in list_runs(state.snap.catalog) if run["num_bundles"]]
    return models.RunList(items=[models.Run(**json_safe(run)) for run in items])


@router.get("/runs/{run}/summary", response_model=models.RunSummary)
def summary(state: StateDep, run: RunName) -> Response:
    """Steps by latest verdict, first-divergent-stage histogram, bytes and dedup ratio.

    Whole-run aggregates cost time in proportion to the run's steps (the web view's steps
    page asks for them on every load): built once per catalog generation (`detail_json`),
    from the run's verdict rows, which the strips share (`_verdicts`)."""
    check_run(state.view, run)

    def build() -> models.RunSummary:
        rows = _verdicts(state, run)
        return models.RunSummary(**json_safe(run_summary(state.snap.catalog, run, rows=rows)))

    body = state.detail_json(("summary", run), build)
    return Response(body, media_type="application/json")


def _verdicts(state: AppState, run: str) -> VerdictRows:
    """The run's verdict rows, read once per catalog generation for the summary and every
    strip (the steps page's first load after a sync asked for them twice)."""
    return state.generation_value(
        ("verdict_rows", run), lambda: verdict_rows(state.snap.catalog, run)
    )


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
            state.snap.catalog,
            run,
            rollout_from=rollout_from,
            rollout_to=rollout_to,
            bins=bins,
            rows=_verdicts(state, run),
        )
        return models.Strip(**json_safe(page))

    body = state.detail_json(("strip", run, rollout_from, rollout_to, bins), build)
    return Response(body, media_type="application/json")


Threshold = Annotated[float | None, Query(allow_inf_nan=False, description="a finite number")]


@router.get("/runs/{run}/mismatch", response_model=models.Page)
def mismatch(
    state: StateDep,
    run: RunName,
    metric: Annotated[str | None, Query(max_length=100, description="docs/mismatch.md")] = None,
    above: Threshold = None,
    top: Annotated[int | None, Query(ge=1, le=MAX_PAGE_SIZE)] = None,
    layer: Annotated[int | None, Query(ge=0, le=1_000_000)] = None,
    rollout_from: OptId = None,
    rollout_to: OptId = None,
    first_above: Threshold = None,
    limit: Limit = None,
    cursor: Cursor = None,
) -> models.Page:
    """Training-inference mismatch per step (`trajstore query mismatch`'s filters), each
    step with its value, token count, the reason it is null, and its worst token."""
    check_run(state.view, run)
    check_range(rollout_from, rollout_to)
    page = query_mismatch(
        state.snap.catalog,
        run,
        metric=metric,
        above=above,
        top=top,
        layer=layer,
        rollout_from=rollout_from,
        rollout_to=rollout_to,
        first_above=first_above,
        limit=limit,
        cursor=cursor,
    )
    return models.Page(**json_safe(page))


@router.get("/runs/{run}/mismatch/layers", response_model=models.Open)
def mismatch_layers(
    state: StateDep,
    run: RunName,
    rollout_from: OptId = None,
    rollout_to: OptId = None,
    bins: Annotated[int | None, Query(ge=1, le=MAX_HEAT_BINS)] = None,
) -> models.Open:
    """Route mismatch per (step, layer): the web view's heat map. ``metrics``: every
    metric name `/mismatch` takes; ``steps``: how many steps have cells. With ``bins``,
    at most that many columns: past that many steps, ``columns`` of ``bin_steps``
    consecutive steps (each naming its ``first`` and ``last`` step) and ``items`` of a
    column index, a layer and the column's summed counts (docs/rest.md)."""
    from trajstore.mismatch.metrics import METRICS

    check_run(state.view, run)
    check_range(rollout_from, rollout_to)
    heat = query_mismatch_heat(
        state.snap.catalog, run, rollout_from=rollout_from, rollout_to=rollout_to, bins=bins
    )
    return models.Open(**json_safe({**heat, "metrics": sorted(METRICS)}))


@router.get("/runs/{run}/mismatch/{rollout_id}:{step_id}/samples", response_model=models.Open)
def mismatch_samples(
    state: StateDep,
    run: RunName,
    rollout_id: Id,
    step_id: Id,
    pair: Text = None,
    limit: Limit = None,
    cursor: Cursor = None,
) -> models.Open:
    """Every sample's worst token of one step (the per-sample document stored with its
    mismatch sums), worst first, paged; ``pair`` keeps one log-prob pair (old, current,
    train). The step listing's ``worst`` is this list's first item."""
    from trajstore.mismatch.query import sample_worst

    check_run(state.view, run)
    query = {"run": run, "rollout_id": rollout_id, "step_id": step_id, "pair": pair}
    try:
        after = decode_cursor("mismatch_samples", query, cursor, "i")
        execute = executor(state.snap.catalog)
        found = sample_worst(execute, state.store.load_document, run, rollout_id, step_id, pair)
    except UsageError as exc:
        raise ApiError(400, "bad_filter", str(exc)) from None
    if found is None:
        raise ApiError(404, "not_found", f"run {run!r} has no step {rollout_id}:{step_id}")
    offset = after[0] if after else 0
    end = offset + (limit or DEFAULT_PAGE_SIZE)
    page = {
        "run": run,
        "rollout_id": rollout_id,
        "step_id": step_id,
        "attempt": found["attempt"],
        "items": found["items"][offset:end],
        "without_document": found["without_document"],
        "next_cursor": encode_cursor("mismatch_samples", query, [end])
        if end < len(found["items"])
        else None,
    }
    return models.Open(**json_safe(page))
