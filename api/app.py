"""The REST API (docs/rest.md): `create_app(store_dir)` builds the FastAPI app.

Endpoints are sync (`def`): DuckDB has no async driver, so FastAPI runs them
in its thread pool. Lookups by id read the snapshot's `View` (dicts); filtered
listings query the in-memory catalog snapshot; payloads and replays read the
store's objects directly. Nothing from a request reaches the file system:
bundle keys and run names are checked against the catalog's known set, and a
ref file is opened only by the name the catalog holds for a known key.

Where things live: one router per resource in ``routes/``, the shared state
they receive through ``Depends`` in ``state.py``, error bodies in ``errors.py``.
"""

from __future__ import annotations

import contextlib
import gc
import hmac
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

from trajstore import __version__

from . import links, streaming, web
from .errors import ERRORS, error_response, install_error_handlers
from .limits import TOKEN_ENV, BodyLimit
from .params import DeclaredQueryOnly
from .routes import ROUTERS
from .state import AppState

#: where /docs and /redoc find Swagger UI's and ReDoc's scripts and styles (fastapi-offline's)
DOCS_ASSETS = "/docs-assets"
#: where `app_from_env` (each `trajstore serve --workers N` worker) finds its store and catalog
STORE_ENV = "TRAJSTORE_SERVE_STORE"
CATALOG_ENV = "TRAJSTORE_SERVE_CATALOG"


class BearerAuth:
    """Pure ASGI middleware: every HTTP request needs `Authorization: Bearer <token>`,
    except the web view's pages and assets (package files holding no store data;
    the pages ask for the token and send it with each /v1 request: docs/web.md)."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not (
            scope.get("method") in ("GET", "HEAD") and web.is_public(scope.get("path", ""))
        ):
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                response = error_response(
                    401,
                    "unauthorized",
                    "send Authorization: Bearer <token>",
                    {"WWW-Authenticate": "Bearer"},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


#: requests routed through the app at start-up (`_warm_up`): a path no route matches (walks
#: every router), then the by-id lookups and the payload download, on names no catalog holds
WARM_UP_PATHS = (
    "/v1/-warm-up-",
    "/v1/runs/-warm-up-/steps/0:0",
    "/v1/bundles/-warm-up-/payloads/-warm-up-",
)


async def _warm_up(app: FastAPI, token: str | None) -> None:
    """Route a few requests through the whole app before serving; each is answered 404
    (nothing of the store is read) and dropped.

    What a fresh server paid on its first request (issue 15: ~20-30 ms before the first
    byte of a first download, most of it again after a dropped page cache): FastAPI
    builds an included router's routes (dependants, pydantic fields) the first time a
    request is matched against them, and on an endpoint's first call reads the source of
    its function (`inspect.getsourcelines`, for error context); plus the first thread of
    the sync endpoints' pool. (The payload decode threads: `streaming.start_threads`.)
    """
    headers = [(b"host", b"warm-up")]
    if token:
        headers.append((b"authorization", f"Bearer {token}".encode()))

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        return None

    for path in WARM_UP_PATHS:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "GET",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "root_path": "",
            "query_string": b"",
            "headers": headers,
            "client": ("127.0.0.1", 0),
            "server": ("127.0.0.1", 0),
            "state": {},
        }
        await app(scope, receive, send)


def create_app(
    store_dir: Path | str,
    *,
    token: str | None = None,
    poll_s: float = 0.25,
    catalog_url: str | None = None,
) -> FastAPI:
    """The API over the store at `store_dir`.

    `token` (default: the TRAJSTORE_API_TOKEN environment variable) turns on
    bearer auth for every request. The catalog snapshot is taken at startup.
    """
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    if not str(store_dir).startswith("s3://"):  # an s3:// URL stays a string
        store_dir = Path(store_dir)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = AppState(store_dir, token, poll_s, catalog_url=catalog_url)
        # the start-up heap (modules, the catalog view, digests: ~500k objects on a
        # 2,000-step store) is long-lived: a full collection walking it stalled every
        # request for 1-2 s on a loaded box (issue 15's p99); refcounting still frees it.
        # Collected first, so no cyclic garbage of the start-up is frozen with it
        gc.collect()
        gc.freeze()
        state.snap.start()
        app.state.trajstore = state
        await _warm_up(app, token)
        streaming.start_threads()
        try:
            yield
        finally:
            app.state.trajstore = None
            state.close()

    # /docs and /redoc as FastAPI's own, with their assets served from the fastapi-offline
    # package instead of a CDN (FastAPI's self-hosting recipe): they render offline too
    app = FastAPIOffline(
        static_url=DOCS_ASSETS,
        favicon_url="/static/favicon.svg",
        title="trajstore",
        version=__version__,
        description="Store and replay what asynchronous RL training consumed (docs/rest.md).",
        lifespan=lifespan,
        responses=ERRORS,
    )
    app.add_middleware(DeclaredQueryOnly, routers=ROUTERS)
    app.add_middleware(BodyLimit)  # inside the bearer check: no body is read before it
    if token:
        app.add_middleware(BearerAuth, token=token)
    install_error_handlers(app)
    generated_openapi = app.openapi
    app.openapi = lambda: links.add_links(generated_openapi())  # type: ignore[method-assign]
    for router in ROUTERS:
        app.include_router(router, prefix="/v1")
    app.include_router(web.router)
    return app


def app_from_env() -> FastAPI:
    """The app of one `serve --workers N` worker process (a uvicorn factory).

    Workers share nothing but the store: each opens the store and takes its
    own catalog snapshot in its lifespan, from the paths `serve` put in the
    environment (an import string cannot carry arguments).
    """
    return create_app(os.environ[STORE_ENV], catalog_url=os.environ.get(CATALOG_ENV) or None)
