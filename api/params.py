"""Path and query parameter types shared by the routers (their OpenAPI constraints)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import Path, Query, Request

from trajstore.catalog import MAX_PAGE_SIZE
from trajstore.catalog.queries import STEP_SORTS

from .errors import ApiError

MAX_ID = 2**63 - 1

Id = Annotated[int, Path(ge=0, le=MAX_ID, description="non-negative integer")]
RunName = Annotated[str, Path(min_length=1, max_length=200)]
OptId = Annotated[int | None, Query(ge=0, le=MAX_ID)]
Attempt = Annotated[int | None, Query(ge=1, le=2**31 - 1, description="default: latest")]
Limit = Annotated[int | None, Query(ge=1, le=MAX_PAGE_SIZE, description="page size")]
Cursor = Annotated[str | None, Query(max_length=2000, description="next_cursor of the last page")]
Text = Annotated[str | None, Query(max_length=200)]
Sort = Annotated[
    Literal[STEP_SORTS],  # type: ignore[valid-type]
    Query(description="step (default), status, stage or tokens; a leading '-' reverses"),
]

#: route -> the query parameter names it declares (routes never change once built)
_DECLARED: dict[int, frozenset[str]] = {}


def _declared(dependant: Any) -> frozenset[str]:
    names = {field.alias for field in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _declared(sub)
    return frozenset(names)


async def only_declared_query(request: Request) -> None:
    """Refuse a query parameter the endpoint does not take (400, naming those it does).

    HTTP frameworks ignore unknown parameters; here a misspelt filter
    (`?first_divergent_stag=loss.policy`) would answer with every row, read as the
    filtered answer. An async dependency: no thread hop per request.
    """
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is None:
        return
    declared = _DECLARED.get(id(route))
    if declared is None:
        declared = _DECLARED[id(route)] = _declared(dependant)
    for name in request.query_params:
        if name not in declared:
            takes = ", ".join(sorted(declared)) or "none"
            detail = f"unknown query parameter {name!r} (this endpoint takes: {takes})"
            raise ApiError(400, "bad_request", detail)
