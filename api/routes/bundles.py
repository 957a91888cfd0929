"""One bundle by key: its detail, its samples, and payload downloads."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Annotated, Any, Literal
from urllib.parse import quote

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import Response, StreamingResponse

from trajstore.bundle.ptfile import TORCH_TO_NUMPY
from trajstore.cas.arrays import load_record
from trajstore.jsonio import json_safe
from trajstore.store.stored_bundle import StoredBundle

from .. import models
from ..detail import known_bundle, latest_verdict, payload_infos, samples_summary
from ..errors import ApiError, error_response
from ..limits import MAX_BUFFERED_ENV
from ..params import Text
from ..payloads import (
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
from ..state import AppState, StateDep
from ..streaming import StreamedPayload, npy_header_for

router = APIRouter()

FILE_EXTENSIONS = {"pt": "pt", "npy": "npy", "raw": "bin"}


def _kept(
    chunks: Iterator[bytes], cache: BodyCache, etag: str, shape: tuple[int, ...], size: int
) -> Iterator[bytes]:
    """Pass a streamed body through; keep it in the body cache once complete, if it fits."""
    if not cache.fits(size):
        yield from chunks  # not held: memory stays bounded by the decode-ahead window
        return
    parts = []
    for chunk in chunks:
        parts.append(chunk)
        yield chunk
    cache.put(etag, Body.of(*parts, shape=shape))


def _payload_body(
    stored_bundle: StoredBundle, name: str, fmt: str, position: int | None, torch_dtype: str
) -> Body:
    """The response body of a payload download (decoded from the store)."""
    if fmt == "pt":
        return Body.of(stored_bundle.payload_file(name))
    import numpy as np

    array = (
        stored_bundle.payload(name)
        if position is None
        else stored_bundle.payload_rows(name, np.array([position]))
    )
    if fmt == "npy":
        npy_array = as_npy_array(array, torch_dtype)
        return Body.of(npy_header(npy_array), npy_array, shape=tuple(array.shape))
    return Body.of(array, shape=tuple(array.shape))


def _body_bytes(
    stored_bundle: StoredBundle, name: str, fmt: str, position: int | None, torch_dtype: str
) -> int:
    """The size of the body `_payload_body` would build, from the ref entry alone (and, for
    one sample, the array record the build reads anyway): nothing is decoded."""
    entry = stored_bundle.ref["payloads"][name]
    if fmt == "pt":
        return int(entry["file"]["bytes"])
    import numpy as np

    dtype = TORCH_TO_NUMPY[torch_dtype]
    if fmt == "npy" and torch_dtype == "torch.bfloat16":
        dtype = np.dtype(np.float32)
    shape = tuple(int(dim) for dim in entry["shape"])
    if position is not None:
        record = stored_bundle.record(name)
        shape = (int(record.row_lengths[position]), *record.token_shape)
    size = math.prod(shape) * dtype.itemsize
    return size + len(npy_header_for(shape, dtype)) if fmt == "npy" else size


def _too_large(
    stored_bundle: StoredBundle, name: str, size: int, limit: int, what: str
) -> ApiError:
    """422 `too_large`: the body would be built in memory and is over the limit."""
    streamed = stored_bundle.record(name).base is None  # a delta record is never streamed
    alternative = (
        "a whole download with format=npy or raw (no Range, no ?sample=) is streamed with "
        "bounded memory"
        if streamed
        else "this payload is delta-encoded: every body of it is built in memory"
    )
    return ApiError(
        422,
        "too_large",
        f"{what} of payload {name!r} would be built in memory: {size} bytes, over the limit "
        f"of {limit} ({MAX_BUFFERED_ENV}); {alternative}",
    )


def _buffered_body(
    state: AppState,
    stored_bundle: StoredBundle,
    name: str,
    fmt: str,
    position: int | None,
    torch_dtype: str,
    etag: str,
    what: str,
) -> Body:
    """`_payload_body`, with its memory bounded (issue 18, item 5).

    Over `max_buffered_bytes` it is refused before anything is decoded. Over
    `serial_build_bytes` bodies are built one at a time under `build_lock` (a
    flood gets 503 `busy`), and a body built or being sent is shared by ETag
    (the cache, or `bodies_in_flight` while any response still holds it), so
    concurrent requests for one huge payload hold one copy, not one each.
    """
    size = _body_bytes(stored_bundle, name, fmt, position, torch_dtype)
    if size > state.max_buffered_bytes:
        raise _too_large(stored_bundle, name, size, state.max_buffered_bytes, what)
    if size <= state.serial_build_bytes:
        body = _payload_body(stored_bundle, name, fmt, position, torch_dtype)
        state.bodies.put(etag, body)
        return body
    with state.build_lock:
        body = state.bodies.get(etag) or state.bodies_in_flight.get(etag)
        if body is None:
            body = _payload_body(stored_bundle, name, fmt, position, torch_dtype)
            state.bodies.put(etag, body)
            state.bodies_in_flight[etag] = body
    return body


def _no_such(key: str, what: str, value: str, present: list[Any]) -> None:
    names = sorted({str(v) for v in present if v is not None})
    shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
    raise ApiError(404, "not_found", f"{key}: no {what} {value!r} (it has {shown or 'none'})")


@router.get("/bundles/{key:path}/samples", response_model=models.SampleList)
def bundle_samples(
    state: StateDep,
    key: str,
    group: Annotated[
        str | None, Query(max_length=200, description='"g-3" or a group index')
    ] = None,
    micro_batch: Text = None,
) -> models.SampleList:
    """The bundle's samples; `group` and `micro_batch` must each name one of the bundle's
    (404 otherwise, naming them: a misspelt filter is not an empty list)."""
    view = state.view
    known_bundle(view, key)
    items = view.samples.get(key, [])
    if group is not None:
        picked = [
            sample
            for sample in items
            if sample["semantic_group"] == group
            or (group.isascii() and group.isdigit() and sample["group_index"] == int(group))
        ]
        if not picked:
            _no_such(key, "group", group, [sample["semantic_group"] for sample in items])
        items = picked
    if micro_batch is not None:
        present = [sample["micro_batch_id"] for sample in view.samples.get(key, [])]
        if micro_batch not in present:
            _no_such(key, "micro-batch", micro_batch, present)
        items = [sample for sample in items if sample["micro_batch_id"] == micro_batch]
    return models.SampleList(items=[models.SampleRow(**json_safe(sample)) for sample in items])


@router.get(
    "/bundles/{key:path}/payloads/{name}",
    response_class=Response,
    responses={
        200: {"content": {"application/octet-stream": {}}, "description": "the payload"},
        206: {"content": {"application/octet-stream": {}}, "description": "a byte range"},
        304: {"description": "not modified (If-None-Match)"},
        416: {"model": models.ErrorResponse, "description": "range not satisfiable"},
        422: {
            "model": models.ErrorResponse,
            "description": "too_large: a body built in memory (Range, ?sample=, format=pt, a "
            "delta record) over TRAJSTORE_API_MAX_BUFFERED_BYTES",
        },
        503: {"model": models.ErrorResponse, "description": "busy: too many large bodies queued"},
    },
)
def payload(
    state: StateDep,
    key: str,
    name: Annotated[str, Path(max_length=200)],
    request: Request,
    format: Annotated[Literal["npy", "raw", "pt"], Query(description=f"one of {FORMATS}")] = "npy",
    sample: Text = None,
) -> Response:
    """A payload as .npy (bf16 widened to float32), raw bytes or the original .pt."""
    view = state.view
    row = known_bundle(view, key)
    payload_row = view.payloads.get(key, {}).get(name)
    if payload_row is None:
        raise ApiError(404, "not_found", f"{key}: no payload named {name[:100]!r}")
    position = None
    if sample is not None:
        if format == "pt":
            raise ApiError(400, "bad_request", "format=pt is the whole original file; no ?sample=")
        position = next(
            (
                sample_row["position"]
                for sample_row in view.samples.get(key, [])
                if sample_row["sample_id"] == sample
            ),
            None,
        )
        if position is None:
            raise ApiError(404, "not_found", f"{key}: no sample {sample[:100]!r}")
    stored_bundle = state.stored(row)
    entry = stored_bundle.ref["payloads"][name]
    content = entry["file"]["sha256"] if format == "pt" else payload_row["record"]
    etag = etag_for(content, format, position)
    headers = {"ETag": etag, "Accept-Ranges": "bytes", "X-Dtype": str(payload_row["dtype"])}
    if etag_matches(request.headers.get("if-none-match"), etag):
        return Response(status_code=304, headers=headers)
    if position is not None and entry.get("rows") not in ("response", "total"):
        raise ApiError(
            400, "bad_request", f"payload {name!r} is not per-token; it has no per-sample slice"
        )
    filename = f"{name}.{FILE_EXTENSIONS[format]}"
    body = state.bodies.get(etag)
    if body is None and position is None and format != "pt" and not request.headers.get("range"):
        # cold whole download: stream it while it decodes (api/streaming.py)
        record = load_record(stored_bundle.objs, entry["record"])
        if record.base is None:
            shape = tuple(entry["shape"])
            streamed = StreamedPayload(stored_bundle.objs, record, shape, str(payload_row["dtype"]))
            headers["X-Shape"] = ",".join(str(dim) for dim in shape)
            headers["Content-Disposition"] = f'attachment; filename="{quote(filename)}"'
            headers["Content-Length"] = str(streamed.size(format))
            return StreamingResponse(
                _kept(
                    streamed.iter_bytes(format), state.bodies, etag, shape, streamed.size(format)
                ),
                headers=headers,
                media_type="application/octet-stream",
            )
    if body is None:
        what = (
            f"sample {sample[:100]!r}"
            if sample is not None
            else "a byte range"
            if request.headers.get("range")
            else f"the format={format} body"
        )
        body = _buffered_body(
            state, stored_bundle, name, format, position, str(payload_row["dtype"]), etag, what
        )
    if body.shape is not None:
        headers["X-Shape"] = ",".join(str(dim) for dim in body.shape)
    headers["Content-Disposition"] = f'attachment; filename="{quote(filename)}"'
    size = body.size
    try:
        byte_range = parse_range(request.headers.get("range"), size)
    except RangeNotSatisfiable:
        return error_response(
            416,
            "range_not_satisfiable",
            f"body has {size} bytes",
            {"Content-Range": f"bytes */{size}"},
        )
    status = 200
    start, end = 0, size - 1
    if byte_range is not None:
        start, end = byte_range
        status = 206
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    headers["Content-Length"] = str(max(end - start + 1, 0))
    chunks: Iterator[bytes] = body.iter_range(start, end)
    return StreamingResponse(
        chunks, status_code=status, headers=headers, media_type="application/octet-stream"
    )


@router.get("/bundles/{key:path}", response_model=models.BundleDetail)
def bundle(state: StateDep, key: str) -> models.BundleDetail:
    """One bundle by key (keys contain '/'): its catalog row, payloads, samples, verdict."""
    view = state.view
    row = known_bundle(view, key)
    return models.BundleDetail(
        bundle=models.Open(**json_safe(row)),
        capabilities=state.capabilities(row),
        payloads=payload_infos(view, key),
        samples=samples_summary(view, [row]),
        latest_verdict=latest_verdict(view, [key]),
    )
