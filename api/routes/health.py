"""``GET /v1/health``: liveness plus the catalog sync's health."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from trajstore import __version__

from .. import models
from ..state import StateDep

router = APIRouter()


@router.get(
    "/health",
    response_model=models.Health,
    responses={
        503: {"model": models.Health, "description": "degraded: the last catalog sync failed"}
    },
)
def health(state: StateDep) -> Any:
    """ "ok" (200) while the catalog syncs; "degraded" (503) with the error while it fails.

    Degraded still serves the last snapshot, but documents published since
    the failure may be missing, so a probe that reads only the status code
    sees it.
    """
    view = state.view
    error = state.snap.last_error
    body = models.Health(
        status="ok" if error is None else "degraded",
        version=__version__,
        runs=len(view.runs),
        generation=view.generation,
        sync_error=error,
    )
    if error is None:
        return body
    return JSONResponse(body.model_dump(), status_code=503)
