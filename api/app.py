"""The REST API (DESIGN.md "REST"): `create_app(store_dir)` builds the FastAPI app.

Endpoints are sync (`def`): DuckDB has no async driver, so FastAPI runs them
in its thread pool. Lookups by id read the snapshot's `View` (dicts); filtered
listings query the in-memory catalog snapshot; payloads and replays read the
store's objects directly. Nothing from a request reaches the file system:
bundle keys and run names are checked against the catalog's known set, and a
ref file is opened only by the name the catalog holds for a known key.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import math
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import quote

from fastapi import APIRouter, FastAPI, HTTPException, Query, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from api import models as m
from api.payloads import (
    FORMATS,
    Body,
    BodyCache,
    RangeNotSatisfiable,
    as_npy_array,
    etag_for,
    etag_matches,
    npy_header,
    parse_range,
)
from api.snapshot import CatalogSnapshot, View
from trajstore import __version__
from trajstore.catalog import (
    MAX_PAGE_SIZE,
    query_divergences,
    query_router_metrics,
    query_steps,
    stats,
)
from trajstore.errors import (
    BundleError,
    IntegrityError,
    NotFoundError,
    SelectionError,
    StoreError,
    TrajstoreError,
    UsageError,
)
from trajstore.store import Store
from trajstore.store.stored_bundle import StoredBundle

TOKEN_ENV = "TRAJSTORE_API_TOKEN"
MAX_ID = 2**63 - 1
_REF_NAME = re.compile(r"^[0-9]{20}-[0-9]+-[0-9a-f]+$")
_LOOPBACK = {"127.0.0.1", "::1", "localhost"}

Id = Annotated[int, PathParam(ge=0, le=MAX_ID, description="non-negative integer")]
RunName = Annotated[str, PathParam(min_length=1, max_length=200)]
OptId = Annotated[int | None, Query(ge=0, le=MAX_ID)]
Attempt = Annotated[int | None, Query(ge=1, le=2**31 - 1, description="default: latest")]
Limit = Annotated[int | None, Query(ge=1, le=MAX_PAGE_SIZE, description="page size")]
Cursor = Annotated[str | None, Query(max_length=2000, description="next_cursor of the last page")]
Text = Annotated[str | None, Query(max_length=200)]

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": m.ErrorResponse, "description": why}
    for code, why in (
        (400, "bad filter or selector"),
        (401, "missing or wrong bearer token"),
        (404, "unknown run, step, bundle or payload"),
        (409, "the stored bundle cannot serve this request"),
        (422, "malformed parameter"),
    )
}


def _clean(obj: Any) -> Any:
    """JSON has no NaN/Infinity: non-finite floats become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        return _clean(obj.item())
    return obj


def _error(status: int, code: str, detail: Any, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": code, "detail": detail}, status_code=status, headers=headers)


class ApiError(HTTPException):
    def __init__(self, status: int, code: str, detail: Any) -> None:
        super().__init__(status, detail)
        self.code = code


_TRAJSTORE_STATUS: tuple[tuple[type[TrajstoreError], int, str], ...] = (
    (NotFoundError, 404, "not_found"),
    (SelectionError, 400, "bad_selection"),
    (UsageError, 400, "bad_request"),
    (BundleError, 409, "bundle_error"),
    (IntegrityError, 500, "integrity_error"),
    (StoreError, 503, "store_error"),
)


class BearerAuth:
    """Pure ASGI middleware: every HTTP request needs `Authorization: Bearer <token>`."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                resp = _error(
                    401, "unauthorized", "send Authorization: Bearer <token>",
                    {"WWW-Authenticate": "Bearer"},
                )
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class State:
    """What the endpoints share: the store, its catalog snapshot, bundle caches."""

    def __init__(self, store_dir: Path, token: str | None, poll_s: float) -> None:
        self.store = Store.open(store_dir, create=False)
        self.token = token
        self.snap = CatalogSnapshot(self.store, poll_s=poll_s)
        self._bundles: OrderedDict[str, StoredBundle] = OrderedDict()
        self._caps: dict[str, dict[str, str]] = {}
        self._lock = threading.Lock()
        self.replay_lock = threading.Lock()  # RefIndex (used by replay) is not thread-safe
        self.bodies = BodyCache(int(os.environ.get("TRAJSTORE_API_CACHE_MB", "512")) << 20)

    @property
    def view(self) -> View:
        return self.snap.view

    def stored(self, row: dict[str, Any]) -> StoredBundle:
        """The StoredBundle of a known catalog row (cached; refs are immutable)."""
        name = row["ref_name"]
        with self._lock:
            hit = self._bundles.get(name)
            if hit is not None:
                self._bundles.move_to_end(name)
                return hit
        if not _REF_NAME.match(name):
            raise StoreError(f"catalog holds a malformed ref name {name!r}; run trajstore reindex")
        sb = StoredBundle(self.store.objs, self.store.refs.read(name), name)
        with self._lock:
            self._bundles[name] = sb
            while len(self._bundles) > 256:
                self._bundles.popitem(last=False)
        return sb

    def capabilities(self, row: dict[str, Any]) -> dict[str, str]:
        h = row.get("manifest_hash")
        if not h:
            return {}
        caps = self._caps.get(h)
        if caps is None:
            manifest = self.store.load_document(h)
            caps = {
                k: str(v.get("capability"))
                for k, v in sorted((manifest.get("stage_contracts") or {}).items())
                if isinstance(v, dict)
            }
            if len(self._caps) > 10000:
                self._caps.clear()
            self._caps[h] = caps
        return caps

    def close(self) -> None:
        self.snap.close()
        self.store.close()


# -- helpers ------------------------------------------------------------------


FILE_EXTENSIONS = {"pt": "pt", "npy": "npy", "raw": "bin"}


def _payload_body(sb: StoredBundle, name: str, fmt: str, position: int | None, torch_dtype: str) -> Body:
    """The response body of a payload download (decoded from the store)."""
    if fmt == "pt":
        return Body.of(sb.payload_file(name))
    import numpy as np

    arr = sb.payload(name) if position is None else sb.payload_rows(name, np.array([position]))
    if fmt == "npy":
        a = as_npy_array(arr, torch_dtype)
        return Body.of(npy_header(a), a, shape=tuple(arr.shape))
    return Body.of(arr, shape=tuple(arr.shape))


def _bundle_url(key: str) -> str:
    return "/v1/bundles/" + quote(key, safe="/")


def _payload_infos(view: View, key: str) -> list[m.PayloadInfo]:
    return [
        m.PayloadInfo(
            name=p["name"], dtype=p["dtype"], shape=p["shape"], logical_bytes=p["logical_bytes"],
            record=p["record"], url=f"{_bundle_url(key)}/payloads/{quote(p['name'], safe='')}",
        )
        for _, p in sorted(view.payloads.get(key, {}).items())
    ]


def _samples_summary(view: View, rows: list[dict[str, Any]]) -> m.SamplesSummary:
    groups: dict[tuple, list[str]] = {}
    mbs: dict[tuple, int] = {}
    n = tokens = resp = 0
    for row in rows:
        for s in view.samples.get(row["key"], []):
            n += 1
            tokens += s["total_length"] or 0
            resp += s["response_length"] or 0
            groups.setdefault((s["semantic_group"], s["group_index"]), []).append(s["sample_id"])
            mb = (s["micro_batch_id"], row["rank"] if s["rank"] is None else s["rank"])
            mbs[mb] = mbs.get(mb, 0) + 1

    def order(k: tuple) -> tuple:
        return tuple((x is None, x) for x in k)

    return m.SamplesSummary(
        num_samples=n, num_tokens=tokens, num_response_tokens=resp,
        groups=[
            m.GroupSummary(semantic_group=g, group_index=i, num_samples=len(ids), sample_ids=ids)
            for (g, i), ids in sorted(groups.items(), key=lambda kv: order(kv[0]))
        ],
        micro_batches=[
            m.MicroBatchSummary(micro_batch_id=mb, rank=r, num_samples=c)
            for (mb, r), c in sorted(mbs.items(), key=lambda kv: order(kv[0]))
        ],
    )


def _latest_verdict(view: View, keys: list[str]) -> m.Verdict | None:
    results = [view.latest_result[k] for k in keys if k in view.latest_result]
    if not results:
        return None
    best = max(results, key=lambda r: (r["recorded_at"] or "", r["id"]))
    return m.Verdict(**_clean(best))


def _check_run(view: View, run: str) -> None:
    if run not in view.runs:
        raise ApiError(404, "not_found", f"no run {run!r} (runs: {list(view.runs)[:20]})")


def _check_range(rollout_from: int | None, rollout_to: int | None) -> None:
    if rollout_from is not None and rollout_to is not None and rollout_from > rollout_to:
        raise ApiError(400, "bad_filter", f"rollout_from ({rollout_from}) > rollout_to ({rollout_to})")


def _group_detail(
    st: State, run: str, kind: str, rollout_id: int, step_id: int | None, attempt: int | None
) -> m.StepDetail:
    view = st.view
    _check_run(view, run)
    rows, attempts = view.group(run, kind, rollout_id, step_id, attempt)
    what = f"step {rollout_id}:{step_id}" if kind == "step" else f"rollout {rollout_id}"
    if not rows:
        extra = f" attempt {attempt} (attempts: {attempts})" if attempts else ""
        raise ApiError(404, "not_found", f"run {run!r} has no {what}{extra}")
    caps: dict[str, str] = {}
    briefs = []
    for r in rows:
        c = st.capabilities(r)
        for k, v in c.items():
            caps.setdefault(k, v)
        briefs.append(
            m.BundleBrief(
                key=r["key"], bundle_id=r["bundle_id"], rank=r["rank"], attempt=r["attempt"],
                format_version=r["format_version"], num_samples=r["num_samples"],
                num_tokens=r["num_tokens"], rollout_weight=r["rollout_weight"],
                actor_weight=r["actor_weight"], published_at=r["published_at"], capabilities=c,
                payloads=_payload_infos(view, r["key"]),
                samples_url=f"{_bundle_url(r['key'])}/samples",
            )
        )
    linked: list[str] = []
    step_ids: list[int] = []
    if kind == "step":
        linked = [r["key"] for r in view.group(run, "rollout", rollout_id, None, None)[0]]
    else:
        step_ids = view.steps_of_rollout.get((run, rollout_id), [])
    return m.StepDetail(
        run=run, kind=kind, rollout_id=rollout_id, step_id=step_id, attempt=rows[0]["attempt"],
        attempts=attempts, ranks=[r["rank"] for r in rows if r["rank"] is not None],
        bundles=briefs, samples=_samples_summary(view, rows), capabilities=caps,
        rollout_bundle_keys=linked, step_ids=step_ids,
        latest_verdict=_latest_verdict(view, [r["key"] for r in rows]),
    )


def _known_bundle(view: View, key: str) -> dict[str, Any]:
    row = view.visible(key)
    if row is None:
        raise ApiError(404, "not_found", f"no published bundle {key[:200]!r}")
    return row


def _loopback(request: Request) -> bool:
    host = request.client.host if request.client else ""
    return host in _LOOPBACK or host.startswith("127.")


# -- the app --------------------------------------------------------------------


def create_app(store_dir: Path, *, token: str | None = None, poll_s: float = 0.25) -> FastAPI:
    """The API over the store at `store_dir`.

    `token` (default: the TRAJSTORE_API_TOKEN environment variable) turns on
    bearer auth for every request. The catalog snapshot is taken at startup.
    """
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    store_dir = Path(store_dir)
    holder: dict[str, State] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        holder["state"] = State(store_dir, token, poll_s)
        holder["state"].snap.start()
        try:
            yield
        finally:
            holder.pop("state").close()

    app = FastAPI(
        title="trajstore",
        version=__version__,
        description="Store and replay what asynchronous RL training consumed (DESIGN.md REST).",
        lifespan=lifespan,
        responses=ERRORS,
    )
    if token:
        app.add_middleware(BearerAuth, token=token)

    def state() -> State:
        st = holder.get("state")
        if st is None:
            raise ApiError(503, "starting", "the server is starting")
        return st

    @app.exception_handler(ApiError)
    def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status_code, exc.code, exc.detail)

    @app.exception_handler(StarletteHTTPException)
    def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _error(exc.status_code, code, exc.detail, getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = [
            {"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
            for e in exc.errors()
        ]
        return _error(422, "invalid_request", errs)

    @app.exception_handler(TrajstoreError)
    def _trajstore(_: Request, exc: TrajstoreError) -> JSONResponse:
        for cls, status, code in _TRAJSTORE_STATUS:
            if isinstance(exc, cls):
                return _error(status, code, str(exc))
        return _error(400, "bad_request", str(exc))

    r = APIRouter(prefix="/v1")

    @r.get(
        "/health",
        response_model=m.Health,
        responses={503: {"model": m.Health, "description": "degraded: the last catalog sync failed"}},
    )
    def health() -> Any:
        """"ok" (200) while the catalog syncs; "degraded" (503) with the error while it fails.

        Degraded still serves the last snapshot, but documents published since
        the failure may be missing, so a probe that reads only the status code
        sees it.
        """
        st = state()
        v = st.view
        error = st.snap.last_error
        body = m.Health(
            status="ok" if error is None else "degraded", version=__version__, runs=len(v.runs),
            generation=v.generation, sync_error=error,
        )
        if error is None:
            return body
        return JSONResponse(body.model_dump(), status_code=503)

    @r.get("/runs", response_model=m.RunList)
    def runs() -> m.RunList:
        from trajstore.catalog import list_runs

        st = state()
        items = [x for x in list_runs(st.snap.catalog) if x["num_bundles"]]
        return m.RunList(items=[m.Run(**_clean(x)) for x in items])

    @r.get("/runs/{run}/steps", response_model=m.StepPage)
    def steps(
        run: RunName,
        rollout_from: OptId = None,
        rollout_to: OptId = None,
        first_divergent_stage: Text = None,
        status: Text = None,
        limit: Limit = None,
        cursor: Cursor = None,
    ) -> m.StepPage:
        """Actor steps (latest attempt) with their latest verdict, in (rollout, step) order."""
        st = state()
        _check_run(st.view, run)
        _check_range(rollout_from, rollout_to)
        page = query_steps(
            st.snap.catalog, run=run, first_divergent_stage=first_divergent_stage,
            rollout_from=rollout_from, rollout_to=rollout_to, status=status, limit=limit,
            cursor=cursor,
        )
        return m.StepPage(**_clean(page))

    @r.get("/runs/{run}/steps/{rollout_id}:{step_id}", response_model=m.StepDetail)
    def step(run: RunName, rollout_id: Id, step_id: Id, attempt: Attempt = None) -> m.StepDetail:
        """One actor step by (rollout_id, step_id): identity, samples, payloads, verdict."""
        return _group_detail(state(), run, "step", rollout_id, step_id, attempt)

    @r.get("/runs/{run}/steps/{step_ref}", include_in_schema=False)
    def bad_step(run: str, step_ref: str) -> None:
        raise ApiError(422, "invalid_request", f"step id {step_ref[:50]!r} is not ROLLOUT:STEP")

    @r.get("/steps/{rollout_id}:{step_id}", response_model=m.StepDetail)
    def only_run_step(rollout_id: Id, step_id: Id, attempt: Attempt = None) -> m.StepDetail:
        """The same, in a store with exactly one run."""
        st = state()
        runs = st.view.runs
        if len(runs) != 1:
            if not runs:
                raise ApiError(404, "not_found", "the store holds no bundles")
            raise ApiError(409, "ambiguous_run", f"the store holds runs {list(runs)[:20]}; use /v1/runs/{{run}}/steps/...")
        return _group_detail(st, runs[0], "step", rollout_id, step_id, attempt)

    @r.get("/steps/{step_ref}", include_in_schema=False)
    def bad_only_run_step(step_ref: str) -> None:
        raise ApiError(422, "invalid_request", f"step id {step_ref[:50]!r} is not ROLLOUT:STEP")

    @r.get("/runs/{run}/rollouts/{rollout_id}", response_model=m.StepDetail)
    def rollout(run: RunName, rollout_id: Id, attempt: Attempt = None) -> m.StepDetail:
        """The rollout-level bundle(s) of a rollout, and the actor steps stored for it."""
        return _group_detail(state(), run, "rollout", rollout_id, None, attempt)

    @r.get("/bundles/{key:path}/samples", response_model=m.SampleList)
    def bundle_samples(
        key: str,
        group: Annotated[str | None, Query(max_length=200, description='"g-3" or a group index')] = None,
        micro_batch: Text = None,
    ) -> m.SampleList:
        view = state().view
        _known_bundle(view, key)
        items = view.samples.get(key, [])
        if group is not None:
            items = [s for s in items if s["semantic_group"] == group or (group.isdigit() and s["group_index"] == int(group))]
        if micro_batch is not None:
            items = [s for s in items if s["micro_batch_id"] == micro_batch]
        return m.SampleList(items=[m.SampleRow(**_clean(s)) for s in items])

    @r.get(
        "/bundles/{key:path}/payloads/{name}",
        response_class=Response,
        responses={
            200: {"content": {"application/octet-stream": {}}, "description": "the payload"},
            206: {"content": {"application/octet-stream": {}}, "description": "a byte range"},
            304: {"description": "not modified (If-None-Match)"},
            416: {"model": m.ErrorResponse, "description": "range not satisfiable"},
        },
    )
    def payload(
        key: str,
        name: Annotated[str, PathParam(max_length=200)],
        request: Request,
        format: Annotated[Literal["npy", "raw", "pt"], Query(description=f"one of {FORMATS}")] = "npy",
        sample: Text = None,
    ) -> Response:
        """A payload as .npy (bf16 widened to float32), raw bytes or the original .pt."""
        st = state()
        view = st.view
        row = _known_bundle(view, key)
        prow = view.payloads.get(key, {}).get(name)
        if prow is None:
            raise ApiError(404, "not_found", f"{key}: no payload named {name[:100]!r}")
        position = None
        if sample is not None:
            if format == "pt":
                raise ApiError(400, "bad_request", "format=pt is the whole original file; no ?sample=")
            position = next((s["position"] for s in view.samples.get(key, []) if s["sample_id"] == sample), None)
            if position is None:
                raise ApiError(404, "not_found", f"{key}: no sample {sample[:100]!r}")
        sb = st.stored(row)
        entry = sb.ref["payloads"][name]
        content = entry["file"]["sha256"] if format == "pt" else prow["record"]
        etag = etag_for(content, format, sample)
        headers = {"ETag": etag, "Accept-Ranges": "bytes", "X-Dtype": str(prow["dtype"])}
        if etag_matches(request.headers.get("if-none-match"), etag):
            return Response(status_code=304, headers=headers)
        if position is not None and entry.get("rows") not in ("response", "total"):
            raise ApiError(400, "bad_request", f"payload {name!r} is not per-token; it has no per-sample slice")
        filename = f"{name}.{FILE_EXTENSIONS[format]}"
        body = st.bodies.get(etag)
        if body is None:
            body = _payload_body(sb, name, format, position, str(prow["dtype"]))
            st.bodies.put(etag, body)
        if body.shape is not None:
            headers["X-Shape"] = ",".join(str(d) for d in body.shape)
        headers["Content-Disposition"] = f'attachment; filename="{quote(filename)}"'
        size = body.size
        try:
            rng = parse_range(request.headers.get("range"), size)
        except RangeNotSatisfiable:
            return _error(416, "range_not_satisfiable", f"body has {size} bytes", {"Content-Range": f"bytes */{size}"})
        status = 200
        start, end = 0, size - 1
        if rng is not None:
            start, end = rng
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        headers["Content-Length"] = str(max(end - start + 1, 0))
        chunks: Iterator[bytes] = body.iter_range(start, end)
        return StreamingResponse(chunks, status_code=status, headers=headers, media_type="application/octet-stream")

    @r.get("/bundles/{key:path}", response_model=m.BundleDetail)
    def bundle(key: str) -> m.BundleDetail:
        """One bundle by key (keys contain '/'): its catalog row, payloads, samples, verdict."""
        st = state()
        view = st.view
        row = _known_bundle(view, key)
        return m.BundleDetail(
            bundle=m.Open(**_clean(row)), capabilities=st.capabilities(row),
            payloads=_payload_infos(view, key), samples=_samples_summary(view, [row]),
            latest_verdict=_latest_verdict(view, [key]),
        )

    @r.post("/replay", response_model=m.ReplayResponse, responses={403: {"model": m.ErrorResponse}})
    def replay(body: m.ReplayRequest, request: Request) -> m.ReplayResponse:
        """Replay a stored step, rollout or bundle; `record` stores the result.

        Recording writes to the store: with a token configured the request was
        already authenticated; without one, only loopback clients may record.
        """
        from trajstore.bundle.capture_dir import parse_step
        from trajstore.replay.from_store import Target, record_report, replay_stored, stored_sources
        from trajstore.replay.runner import StageRequest
        from trajstore.replay.selection import SelectionRequest

        st = state()
        if body.record and st.token is None and not _loopback(request):
            raise ApiError(403, "forbidden", "record from a non-loopback client needs TRAJSTORE_API_TOKEN on the server")
        if sum(x is not None for x in (body.step, body.rollout, body.bundle)) != 1:
            raise ApiError(400, "bad_request", "name exactly one of step, rollout, bundle")
        view = st.view
        if body.run is not None:
            _check_run(view, body.run)
        if body.bundle is not None:
            _known_bundle(view, body.bundle)
        target = Target(
            run=body.run, step=parse_step(body.step) if body.step is not None else None,
            rollout=body.rollout, bundle_key=body.bundle, attempt=body.attempt,
        )
        sel = SelectionRequest(tuple(body.samples), tuple(body.groups), tuple(body.batches))
        request_stages = StageRequest.parse(body.stage)
        with st.replay_lock:
            report = replay_stored(st.store, target, request=request_stages, selection=sel, link=body.link)
            recorded: list[str] = []
            if body.record:
                recorded = record_report(st.store, report, stored_sources(st.store, target), selection=sel)
        if recorded:
            st.snap.refresh(force=True)  # read-your-writes for this client
        doc = json.loads(json.dumps(_clean(report.to_dict()), default=str))
        return m.ReplayResponse(exit_code=report.exit_code, recorded=recorded, report=doc)

    @r.get("/divergences", response_model=m.Page)
    def divergences(
        run: Text = None,
        stage: Text = None,
        sample_id: Text = None,
        min_abs_err: Annotated[float | None, Query(ge=0, allow_inf_nan=False)] = None,
        rollout_from: OptId = None,
        rollout_to: OptId = None,
        limit: Limit = None,
        cursor: Cursor = None,
    ) -> m.Page:
        """Divergences of each visible step's or rollout's latest result."""
        st = state()
        _check_range(rollout_from, rollout_to)
        page = query_divergences(
            st.snap.catalog, run=run, stage=stage, min_abs_err=min_abs_err, sample_id=sample_id,
            rollout_from=rollout_from, rollout_to=rollout_to, limit=limit, cursor=cursor,
        )
        return m.Page(**_clean(page))

    @r.get("/router/metrics", response_model=m.Page)
    def router_metrics(
        run: Text = None,
        rollout_from: OptId = None,
        rollout_to: OptId = None,
        source: Annotated[Literal["producer", "replay"] | None, Query()] = None,
        limit: Limit = None,
        cursor: Cursor = None,
    ) -> m.Page:
        """Route consistency metrics (router-metrics.md names) per bundle."""
        st = state()
        _check_range(rollout_from, rollout_to)
        page = query_router_metrics(
            st.snap.catalog, run=run, rollout_from=rollout_from, rollout_to=rollout_to,
            source=source, limit=limit, cursor=cursor,
        )
        return m.Page(**_clean(page))

    @r.get("/stats", response_model=m.Open)
    def store_stats(run: Text = None) -> m.Open:
        """Counts and sizes over the catalog (or one run)."""
        return m.Open(**_clean(stats(state().snap.catalog, run=run)))

    app.include_router(r)
    return app
