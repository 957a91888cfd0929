"""``POST /v1/replay``: replay a stored step, rollout or bundle, optionally recording it."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request

from trajstore.jsonio import json_safe

from .. import models
from ..detail import check_run, known_bundle
from ..errors import ApiError
from ..state import StateDep

router = APIRouter()

_LOOPBACK = {"127.0.0.1", "::1", "localhost"}


def _loopback(request: Request) -> bool:
    host = request.client.host if request.client else ""
    return host in _LOOPBACK or host.startswith("127.")


@router.post(
    "/replay",
    response_model=models.ReplayResponse,
    responses={403: {"model": models.ErrorResponse}},
)
def replay(state: StateDep, body: models.ReplayRequest, request: Request) -> models.ReplayResponse:
    """Replay a stored step, rollout or bundle; `record` stores the result.

    Recording writes to the store: with a token configured the request was
    already authenticated; without one, only loopback clients may record.
    """
    from trajstore.bundle.capture_dir import parse_step
    from trajstore.replay.from_store import Target, record_report, replay_stored, stored_sources
    from trajstore.replay.runner import StageRequest
    from trajstore.replay.selection import SelectionRequest

    if body.record and state.token is None and not _loopback(request):
        raise ApiError(
            403,
            "forbidden",
            "record from a non-loopback client needs TRAJSTORE_API_TOKEN on the server",
        )
    if sum(x is not None for x in (body.step, body.rollout, body.bundle)) != 1:
        raise ApiError(400, "bad_request", "name exactly one of step, rollout, bundle")
    view = state.view
    if body.run is not None:
        check_run(view, body.run)
    target = Target(
        run=body.run,
        step=parse_step(body.step) if body.step is not None else None,
        rollout=body.rollout,
        bundle_key=body.bundle,
        attempt=body.attempt,
    )
    if body.bundle is not None:
        known_bundle(view, body.bundle)
        # a run or attempt the key contradicts is a 400 before the request waits in the queue
        state.store.bundle(body.bundle, body.run, body.attempt)
    selection = SelectionRequest(tuple(body.samples), tuple(body.groups), tuple(body.batches))
    request_stages = StageRequest.parse(body.stage)
    with state.replay_lock:
        report = replay_stored(
            state.store, target, request=request_stages, selection=selection, link=body.link
        )
        recorded: list[str] = []
        if body.record:
            recorded = record_report(
                state.store, report, stored_sources(state.store, target), selection=selection
            )
    if recorded:
        state.store.index_new()  # a server catalog gets the result now (DuckDB: no-op)
        state.snap.refresh(force=True)  # read-your-writes for this client
    doc = json.loads(json.dumps(json_safe(report.to_dict()), default=str))
    return models.ReplayResponse(exit_code=report.exit_code, recorded=recorded, report=doc)
