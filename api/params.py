"""Path and query parameter types shared by the routers (their OpenAPI constraints)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import Path, Query

from trajstore.catalog import MAX_PAGE_SIZE
from trajstore.catalog.queries import STEP_SORTS

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
