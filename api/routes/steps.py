"""Actor steps and rollouts: the step listing and one step or rollout in detail."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from trajstore.catalog import query_steps
from trajstore.catalog.overview import result_detail
from trajstore.jsonio import json_safe

from .. import models
from ..detail import check_range, check_run, group_detail
from ..errors import ApiError
from ..params import Attempt, Cursor, Id, Limit, OptId, RunName, Sort, Text
from ..state import StateDep

router = APIRouter()


def _detail(
    state: StateDep,
    run: str,
    kind: str,
    rollout_id: int,
    step_id: int | None,
    attempt: int | None,
) -> Response:
    """A step/rollout detail as JSON, encoded once per catalog generation (errors are not kept).

    Returned as a Response, so FastAPI does not validate and encode the model
    again; its body is `models.StepDetail`'s JSON, as the route declares.
    """
    body = state.detail_json(
        (run, kind, rollout_id, step_id, attempt),
        lambda: group_detail(state, run, kind, rollout_id, step_id, attempt),
    )
    return Response(body, media_type="application/json")


@router.get("/runs/{run}/steps", response_model=models.StepPage)
def steps(
    state: StateDep,
    run: RunName,
    rollout_from: OptId = None,
    rollout_to: OptId = None,
    first_divergent_stage: Text = None,
    status: Text = None,
    attempt: Attempt = None,
    sort: Sort = "step",
    limit: Limit = None,
    cursor: Cursor = None,
) -> Response:
    """Actor steps (latest attempt) with their latest verdict, in (rollout, step) order
    unless sorted; `attempt` keeps the steps whose latest attempt is that number.

    A page ranks the run's latest attempts and results, in time that grows with the run:
    each distinct page is built once per catalog generation (`detail_json`)."""
    check_run(state.view, run)
    check_range(rollout_from, rollout_to)

    def build() -> models.StepPage:
        page = query_steps(
            state.snap.catalog,
            run=run,
            first_divergent_stage=first_divergent_stage,
            rollout_from=rollout_from,
            rollout_to=rollout_to,
            status=status,
            limit=limit,
            cursor=cursor,
            attempt=attempt,
            sort=sort,
        )
        return models.StepPage(**json_safe(page))

    key = ("steps", run, first_divergent_stage, rollout_from, rollout_to, status, attempt)
    body = state.detail_json((*key, sort, limit, cursor), build)
    return Response(body, media_type="application/json")


@router.get("/runs/{run}/steps/{rollout_id}:{step_id}", response_model=models.StepDetail)
def step(
    state: StateDep, run: RunName, rollout_id: Id, step_id: Id, attempt: Attempt = None
) -> Response:
    """One actor step by (rollout_id, step_id): identity, samples, payloads, verdict."""
    return _detail(state, run, "step", rollout_id, step_id, attempt)


@router.get("/runs/{run}/steps/{rollout_id}:{step_id}/result", response_model=models.StepResult)
def step_result(
    state: StateDep, run: RunName, rollout_id: Id, step_id: Id, attempt: Attempt = None
) -> models.StepResult:
    """The step's latest recorded replay result: per-stage verdicts, reasons, divergences."""
    detail = group_detail(state, run, "step", rollout_id, step_id, attempt)
    if detail.latest_verdict is None:
        raise ApiError(
            404, "not_found", f"step {rollout_id}:{step_id} of run {run!r} has no recorded result"
        )
    result_id = (detail.latest_verdict.model_extra or {}).get("id")
    found = result_detail(state.snap.catalog, int(result_id)) if result_id is not None else None
    if found is None:
        raise ApiError(404, "not_found", f"result of step {rollout_id}:{step_id} not in catalog")
    return models.StepResult(**json_safe(found))


@router.get("/runs/{run}/steps/{step_ref}", include_in_schema=False)
def bad_step(run: str, step_ref: str) -> None:
    raise ApiError(422, "invalid_request", f"step id {step_ref[:50]!r} is not ROLLOUT:STEP")


@router.get("/steps/{rollout_id}:{step_id}", response_model=models.StepDetail)
def only_run_step(
    state: StateDep, rollout_id: Id, step_id: Id, attempt: Attempt = None
) -> Response:
    """The same, in a store with exactly one run."""
    run_names = state.view.runs
    if len(run_names) != 1:
        if not run_names:
            raise ApiError(404, "not_found", "the store holds no bundles")
        raise ApiError(
            409,
            "ambiguous_run",
            f"the store holds runs {list(run_names)[:20]}; use /v1/runs/{{run}}/steps/...",
        )
    return _detail(state, run_names[0], "step", rollout_id, step_id, attempt)


@router.get("/steps/{step_ref}", include_in_schema=False)
def bad_only_run_step(step_ref: str) -> None:
    raise ApiError(422, "invalid_request", f"step id {step_ref[:50]!r} is not ROLLOUT:STEP")


@router.get("/runs/{run}/rollouts/{rollout_id}", response_model=models.StepDetail)
def rollout(state: StateDep, run: RunName, rollout_id: Id, attempt: Attempt = None) -> Response:
    """The rollout-level bundle(s) of a rollout, and the actor steps stored for it."""
    return _detail(state, run, "rollout", rollout_id, None, attempt)
