"""The web view (docs/web.md): pages at ``/`` over the same ``/v1`` API, no build step.

Every page is the same static shell (``static/index.html``) plus a few
hundred lines of our own JavaScript that fetch ``/v1`` and draw tables and
SVG charts in the browser. Why the shell holds no data: with a token
configured, the browser's page navigation cannot carry the bearer header, so
anything rendered into the HTML would have to be public or sent with a
cookie or a token in the URL. The shell and its assets are package files and
carry nothing from the store, so `is_public` lets them through the bearer
check, and every byte of data goes through ``/v1`` with the header.
"""

from __future__ import annotations

import re
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from ..errors import ApiError

STATIC = resources.files(__name__) / "static"
#: the assets the shell loads (nothing else under static/ is served)
ASSETS: dict[str, str] = {
    "app.js": "text/javascript; charset=utf-8",
    "charts.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
#: page paths (the client-side router in app.js draws each); /v1, /docs, /openapi.json
#: are not pages and keep the bearer check
_PAGES = re.compile(r"^/(?:|runs/[^/]+|runs/[^/]+/mismatch|runs/[^/]+/steps/[^/]+|routes|diff)$")
_ASSET = re.compile(r"^/static/([a-z]+\.(?:js|css|svg))$")
#: the shell and assets change only with the package: let the browser revalidate, no more
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}

router = APIRouter(include_in_schema=False)


def is_public(path: str) -> bool:
    """Whether `path` is a page or an asset of the web view (served without the token)."""
    if _PAGES.match(path):
        return True
    match = _ASSET.match(path)
    return bool(match and match.group(1) in ASSETS)


def _shell() -> Response:
    html = (STATIC / "index.html").read_bytes()
    return Response(html, media_type="text/html; charset=utf-8", headers=_HEADERS)


@router.api_route("/", methods=["GET", "HEAD"])
def runs_page() -> Response:
    return _shell()


@router.api_route("/runs/{run}", methods=["GET", "HEAD"])
def steps_page(run: str) -> Response:
    return _shell()


@router.api_route("/runs/{run}/mismatch", methods=["GET", "HEAD"])
def mismatch_page(run: str) -> Response:
    return _shell()


@router.api_route("/runs/{run}/steps/{step_ref}", methods=["GET", "HEAD"])
def step_page(run: str, step_ref: str) -> Response:
    return _shell()


@router.api_route("/routes", methods=["GET", "HEAD"])
def routes_page() -> Response:
    return _shell()


@router.api_route("/diff", methods=["GET", "HEAD"])
def diff_page() -> Response:
    return _shell()


@router.api_route("/static/{name}", methods=["GET", "HEAD"])
def asset(name: str) -> Response:
    media_type = ASSETS.get(name)
    if media_type is None:
        raise ApiError(404, "not_found", f"no asset {name[:100]!r}")
    return Response((STATIC / name).read_bytes(), media_type=media_type, headers=_HEADERS)
