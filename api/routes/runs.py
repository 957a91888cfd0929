"""``GET /v1/runs``: the runs that hold at least one bundle."""

from __future__ import annotations

from fastapi import APIRouter

from trajstore.catalog import list_runs
from trajstore.jsonio import json_safe

from .. import models
from ..state import StateDep

router = APIRouter()


@router.get("/runs", response_model=models.RunList)
def runs(state: StateDep) -> models.RunList:
    items = [run for run in list_runs(state.snap.catalog) if run["num_bundles"]]
    return models.RunList(items=[models.Run(**json_safe(run)) for run in items])
