"""Blobs: documents (manifest/index/expected, sentinels, .pt envelopes, mismatch documents)
stored as objects whose bytes are one zstd frame, deterministic (equal bytes give one
object), decoded against a bound so a corrupt or hostile object never allocates more than
`MAX_BLOB_BYTES`. Written by ingest, read by a stored bundle and export."""

from __future__ import annotations

import json
from typing import Any

import zstandard

from trajstore.cas.chunk_codec import compressor, decode_frame
from trajstore.cas.objects import ObjectStore
from trajstore.errors import IntegrityError
from trajstore.jsonio import NOT_PARSED, parse_json_fast

MAX_BLOB_BYTES = 1 << 31


def put_blob(objs: ObjectStore, data: bytes) -> str:
    """Store `data` zstd-compressed (deterministic, so equal bytes give one object)."""
    return objs.put(compressor().compress(data))


def put_blob_added(objs: ObjectStore, data: bytes) -> tuple[str, int]:
    """`put_blob`, and the bytes this call stored (0 when the object was held already)."""
    packed = compressor().compress(data)
    ((h, new),) = objs.put_many_added([packed])
    return h, len(packed) if new else 0


def get_blob(objs: ObjectStore, h: str) -> bytes:
    """The bytes of blob `h` (the object is verified against its hash by `get`)."""
    return decode_blob(h, objs.get(h))


def decode_blob(h: str, data: bytes) -> bytes:
    """The bytes of blob `h` whose (verified) object bytes are `data`."""
    try:
        size = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"blob object {h} is not a valid zstd frame: {e}") from None
    if size < 0 or size > MAX_BLOB_BYTES:
        raise IntegrityError(f"blob object {h} declares an unusable size ({size})")
    return decode_frame(data, size, "blob", h)


def get_json_blob(objs: ObjectStore, h: str) -> Any:
    return decode_json_blob(h, objs.get(h))


def decode_json_blob(h: str, data: bytes) -> Any:
    blob = decode_blob(h, data)
    # orjson where it gives the stdlib's result (an index's long loss-mask lists parse
    # several times faster); anything else is parsed by the stdlib, which words the error
    value = parse_json_fast(blob)
    if value is not NOT_PARSED:
        return value
    try:
        return json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise IntegrityError(f"document object {h} is not JSON: {e}") from None
