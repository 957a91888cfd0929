"""Path and query parameter types shared by the routers (their OpenAPI constraints)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal

from fastapi import Path, Query
from fastapi._compat import field_annotation_is_sequence
from pydantic import BeforeValidator
from starlette.datastructures import QueryParams
from starlette.routing import Match

from trajstore.catalog import MAX_PAGE_SIZE
from trajstore.catalog.statements import BIGINT_MAX, STEP_SORTS

from .errors import error_response

#: ids are BIGINT columns in the catalog: the CLI and both catalog readers bound them alike
MAX_ID = BIGINT_MAX


def ascii_digits(value: Any) -> Any:
    """A path or query id must be written in ASCII digits: pydantic's lax int also reads
    `1_0` (step 10), `+3`, ` 3`, `3.0` and `１０`, so a mistyped id answered for another."""
    if isinstance(value, str) and not (value.isascii() and value.isdigit()):
        raise ValueError(f"{value[:50]!r} is not a non-negative integer in digits 0-9")
    return value


Digits = BeforeValidator(ascii_digits)
Id = Annotated[int, Digits, Path(ge=0, le=MAX_ID, description="non-negative integer")]
RunName = Annotated[str, Path(min_length=1, max_length=200)]
OptId = Annotated[int | None, Digits, Query(ge=0, le=MAX_ID)]
Attempt = Annotated[int | None, Digits, Query(ge=1, le=2**31 - 1, description="default: latest")]
Limit = Annotated[int | None, Digits, Query(ge=1, le=MAX_PAGE_SIZE, description="page size")]
Cursor = Annotated[str | None, Query(max_length=2000, description="next_cursor of the last page")]
Text = Annotated[str | None, Query(max_length=200)]
Sort = Annotated[
    Literal[STEP_SORTS],  # type: ignore[valid-type]
    Query(description="step (default), status, stage or tokens; a leading '-' reverses"),
]


def _declared(dependant: Any) -> dict[str, bool]:
    """Query parameter name -> whether the endpoint takes it as a list (given repeatedly)."""
    names = {
        field.alias: field_annotation_is_sequence(field.field_info.annotation)
        for field in dependant.query_params
    }
    for sub in dependant.dependencies:
        names.update(_declared(sub))
    return names


class DeclaredQueryOnly:
    """Pure ASGI middleware: a query parameter the matched /v1 endpoint does not take, or
    one it takes once given more than once, is 400, naming it.

    HTTP frameworks ignore unknown parameters; here a misspelt filter
    (`?first_divergent_stag=loss.policy`) would answer with every row, read as the
    filtered answer. They also keep the last of a repeated single-valued one, so
    `?run=a&run=b` answered for b alone, as if both had been asked. Only a request
    with a query string is matched against the routes (as FastAPI matches them: first
    full match, in `routers` order); a lookup without one pays a dict lookup (a
    FastAPI dependency cost every request ~10% of lookup throughput).
    """

    def __init__(self, app: Any, routers: Iterable[Any], prefix: str = "/v1") -> None:
        self.app = app
        self.prefix = prefix
        self.routes = [
            (route, _declared(route.dependant))
            for router in routers
            for route in router.routes
            if getattr(route, "dependant", None) is not None
        ]

    def _declared_for(self, scope: dict) -> dict[str, bool] | None:
        child = {**scope, "path": scope["path"][len(self.prefix) :], "root_path": ""}
        for route, declared in self.routes:
            if route.matches(child)[0] == Match.FULL:
                return declared
        return None  # no endpoint: the app answers 404/405 as it would

    @staticmethod
    def _refusal(declared: dict[str, bool], query_string: bytes) -> str | None:
        """Why the query string does not fit the endpoint (None: it does)."""
        seen: set[str] = set()
        for name, _ in QueryParams(query_string).multi_items():
            if name not in declared:
                takes = ", ".join(sorted(declared)) or "none"
                return f"unknown query parameter {name!r} (this endpoint takes: {takes})"
            if name in seen and not declared[name]:
                return f"query parameter {name!r} given more than once (it takes one value)"
            seen.add(name)
        return None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if (
            scope["type"] == "http"
            and scope.get("query_string")
            and scope.get("path", "").startswith(self.prefix + "/")
        ):
            declared = self._declared_for(scope)
            if declared is not None:
                detail = self._refusal(declared, scope["query_string"])
                if detail is not None:
                    await error_response(400, "bad_request", detail)(scope, receive, send)
                    return
        await self.app(scope, receive, send)
