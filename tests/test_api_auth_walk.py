"""With a token set, nothing answers without it: a walk over every route (issue 18, item 4).

Two walks against `trajstore serve` (a subprocess, TRAJSTORE_API_TOKEN set):
every operation of the served OpenAPI document, and every route the app
has (`app.routes`: the operations plus what the schema leaves out: the web
view's pages and assets, /docs, /redoc and their /docs-assets, /openapi.json,
the catch-all step routes). What is public is decided in one place, `api.web.is_public`: GET
and HEAD of the web view's shell pages and its four assets (package files,
no store data; docs/rest.md#security). Everything else, any method, answers
401 with a JSON body without the header or with a wrong one, and something
other than 401 with the right one (so the walk can tell the two apart).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from test_api_hostile import KEY, served, store  # noqa: F401  (the module's store fixture)
from trajstore.api import web
from trajstore.api.app import create_app
from trajstore.api.routes import ROUTERS

pytestmark = pytest.mark.integration

TOKEN = "walk-the-spec-0123456789"
#: a real value for each path parameter, so the right token gets a real answer
PARAMS = {
    "run": "cap",
    "rollout_id": "120",
    "step_id": "0",
    "key": KEY,
    "name": "log_probs",
    "step_ref": "120:0",
}
#: a request body per operation that needs one
BODIES = {("POST", "/v1/replay"): {"run": "cap", "step": "120:0"}}
WRONG = (
    {},
    {"Authorization": ""},
    {"Authorization": "Bearer"},
    {"Authorization": "Bearer wrong"},
    {"Authorization": f"bearer {TOKEN}"},
    {"Authorization": f"Bearer  {TOKEN}"},
    {"Authorization": f"Bearer {TOKEN}{TOKEN}"},
    {"Authorization": f"Bearer {TOKEN[:-1]}"},
    {"Authorization": TOKEN},
    {"Authorization": f"Basic {TOKEN}"},
    {"X-Api-Token": TOKEN},
)


def concrete(template: str) -> str:
    """A route template with each `{param}` or `{param:conv}` filled in from PARAMS."""
    return re.sub(r"\{(\w+)(?::\w+)?\}", lambda m: PARAMS.get(m.group(1), "x"), template)


def all_routes(app: FastAPI) -> list[tuple[str, list[str]]]:
    """(path template, methods) of every route: the app's own (/docs, /redoc,
    /openapi.json) and those of the routers it includes (/v1's and the web view's;
    FastAPI keeps an included router as one opaque entry in ``app.routes``)."""
    # a Mount (/docs' assets, fastapi-offline's files) has a path and no methods: GET
    found = [
        (route.path, getattr(route, "methods", None))
        for route in app.routes
        if hasattr(route, "path")
    ]
    found += [("/v1" + route.path, route.methods) for r in ROUTERS for route in r.routes]
    found += [(route.path, route.methods) for route in web.router.routes]
    return [(path, sorted(methods or {"GET"})) for path, methods in found]


@pytest.fixture(scope="module")
def client(store: Path) -> Iterator[httpx.Client]:  # noqa: F811
    with (
        served(store, token=TOKEN) as (_, port),
        httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c,
    ):
        yield c


def assert_refused(
    client: httpx.Client, method: str, path: str, wrong: tuple = WRONG, **kw: object
) -> None:
    for headers in wrong:
        got = client.request(method, path, headers=headers, **kw)
        assert got.status_code == 401, (method, path, headers, got.status_code)
        assert got.headers["www-authenticate"] == "Bearer"
        if method != "HEAD":
            assert got.json()["error"] == "unauthorized"


def test_every_openapi_operation_needs_the_token(client: httpx.Client) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert client.get("/openapi.json").status_code == 401
    spec = client.get("/openapi.json", headers=auth).json()
    operations = [
        (method.upper(), path)
        for path, item in spec["paths"].items()
        for method in item
        if method in ("get", "post", "put", "patch", "delete", "head", "options")
    ]
    assert len(operations) >= 15, operations
    for method, template in operations:
        path = concrete(template)
        body = BODIES.get((method, template))
        assert_refused(client, method, path, json=body)
        got = client.request(method, path, headers=auth, json=body)
        assert got.status_code != 401 and got.status_code < 500, (method, path, got.text[:300])


def test_every_route_and_method_outside_the_public_pages_needs_the_token(
    client: httpx.Client,
    store: Path,  # noqa: F811
) -> None:
    routes = all_routes(create_app(store, token=TOKEN))
    paths = {path for path, _ in routes}
    assert {"/docs", "/redoc", "/docs-assets", "/openapi.json", "/", "/static/{name}"} <= paths
    public = 0
    for template, methods in routes:
        path = concrete(template)
        for method in {*methods, "HEAD", "OPTIONS", "DELETE", "PUT", "PATCH", "POST"}:
            if method in ("GET", "HEAD") and web.is_public(path):
                public += 1
                continue
            # every wrong header on the route's own methods; none and a wrong token on others
            assert_refused(client, method, path, WRONG if method in methods else WRONG[::4])
    assert public >= 4  # the shell pages; asset names come next


def test_the_public_pages_and_assets_hold_no_store_data(client: httpx.Client) -> None:
    static = Path(web.__file__).parent / "static"
    for path in ("/", "/runs/cap", "/runs/cap/steps/120:0", "/routes", "/diff"):
        got = client.get(path)
        assert got.status_code == 200 and got.content == (static / "index.html").read_bytes()
    for name in web.ASSETS:
        got = client.get(f"/static/{name}")
        assert got.status_code == 200 and got.content == (static / name).read_bytes()
        assert client.head(f"/static/{name}").status_code == 200
    # anything else under /static, or a page path with a method that writes, needs the token
    for path in ("/static/index.html", "/static/__init__.py", "/static/app.js.map"):
        assert_refused(client, "GET", path)
    assert_refused(client, "POST", "/")


def test_unknown_paths_need_the_token_too(client: httpx.Client) -> None:
    """A 401 rather than a 404: without the token the server says nothing about its routes."""
    for path in ("/v1/nothing", "/v2/runs", "/admin", "/v1", "/static", "/%2e%2e/v1/runs"):
        assert_refused(client, "GET", path)
