"""Payload bodies: .npy / raw / original .pt encodings, ETags and byte ranges.

Formats (`?format=`):
- `npy` (default): a NumPy .npy file. numpy has no bfloat16, so a bf16 payload
  is widened to float32 (exact: the bf16 bits become the high half); every other
  dtype is sent as stored. `X-Dtype` always names the stored (torch) dtype.
- `raw`: the tensor's bytes as stored (little endian, C order; bf16 as its
  uint16 bits), with `X-Dtype` and `X-Shape` headers.
- `pt`: the original `payloads/<name>.pt` file, byte for byte (whole tensor only).

The ETag is a strong validator computed without reading the payload: the
payload's record hash (a content address of every chunk) plus format and
selection, so `If-None-Match` answers 304 for free.
"""

from __future__ import annotations

import hashlib
import io
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from trajstore.cas.lru import BytesLRU

FORMATS = ("npy", "raw", "pt")
STREAM_CHUNK = 1 << 20
_RANGE = re.compile(r"^\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*$")


def etag_for(content_hash: str, fmt: str, position: int | None) -> str:
    """Strong ETag: the content hash of the payload plus what was selected from it.

    A sample is selected by its row (`position`), not its id: two bundles may share a
    payload record and give one id different rows, and an id-keyed tag (the body cache's
    key too) served one bundle's rows for the other's.
    """
    row = "" if position is None else f"row{position}"
    sel = hashlib.blake2b(f"{fmt}\0{row}".encode(), digest_size=6).hexdigest()
    return f'"{content_hash[:40]}-{fmt}-{sel}"'


def etag_matches(if_none_match: str | None, etag: str) -> bool:
    if not if_none_match:
        return False
    tags = [t.strip() for t in if_none_match.split(",")]
    return "*" in tags or any(t.removeprefix("W/") == etag for t in tags)


def as_npy_array(arr: np.ndarray, torch_dtype: str) -> np.ndarray:
    """The array an .npy body carries: bf16 (stored as uint16 bits) widened to float32."""
    if torch_dtype == "torch.bfloat16":
        return (np.ascontiguousarray(arr, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.ascontiguousarray(arr)


def npy_header(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, np.lib.format.header_data_from_array_1_0(arr))
    return buf.getvalue()


@dataclass
class Body:
    """A response body as (at most two) byte views, never copied into one buffer."""

    parts: tuple[memoryview, ...]
    #: the array's shape (None for a whole .pt file)
    shape: tuple[int, ...] | None = None

    @classmethod
    def of(cls, *parts: bytes | np.ndarray, shape: tuple[int, ...] | None = None) -> Body:
        views = []
        for p in parts:
            if isinstance(p, np.ndarray):
                p = np.ascontiguousarray(p)
                views.append(memoryview(p.reshape(-1).view(np.uint8)))
            else:
                views.append(memoryview(p))
        return cls(tuple(views), shape)

    @property
    def size(self) -> int:
        return sum(v.nbytes for v in self.parts)

    def iter_range(self, start: int, end: int) -> Iterator[bytes]:
        """Bytes [start, end] (inclusive) in chunks of at most STREAM_CHUNK."""
        pos = 0
        for v in self.parts:
            lo, hi = max(start - pos, 0), min(end + 1 - pos, v.nbytes)
            while lo < hi:
                step = min(hi, lo + STREAM_CHUNK)
                yield bytes(v[lo:step])
                lo = step
            pos += v.nbytes


class BodyCache(BytesLRU):
    """Encoded payload bodies by ETag, bounded by bytes (least recently used out).

    An ETag names immutable content, so an entry is never stale. It saves the
    decode (zstd + hash checks, the slow part) on repeated downloads and on
    every Range request after the first, which would otherwise decode the
    whole payload again for each range. A body over a quarter of the bound is
    not kept (one huge payload must not evict everything else).
    """

    def __init__(self, max_bytes: int) -> None:
        super().__init__(max_bytes, item_fraction=4, size=_body_size)

    def put(self, etag: str, body: Body) -> None:
        self.add(etag, body)


def _body_size(body: Body) -> int:
    return body.size


class RangeNotSatisfiable(Exception):
    pass


#: a byte position with more digits than this is past any body (and `int()` refuses
#: strings over 4,300 digits, which a hostile Range header would turn into a 500)
_MAX_DIGITS = 18


def _position(digits: str) -> int:
    """A Range position; any number too long to be a body offset counts as 10**18."""
    return int(digits) if len(digits) <= _MAX_DIGITS else 10**_MAX_DIGITS


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """One `bytes=a-b` range as inclusive (start, end); None means the whole body.

    Several ranges, or a header that is not a byte range, are ignored (RFC 9110
    lets a server answer 200); a syntactically valid range outside the body
    raises RangeNotSatisfiable (416).
    """
    if not header:
        return None
    m = _RANGE.match(header)
    if not m:
        return None
    a, b = m.group(1), m.group(2)
    if not a and not b:
        return None
    if not a:  # suffix: the last b bytes
        n = _position(b)
        if n == 0 or size == 0:
            raise RangeNotSatisfiable
        return max(size - n, 0), size - 1
    start = _position(a)
    end = size - 1 if not b else min(_position(b), size - 1)
    if b and _position(b) < start:
        return None  # invalid range: ignore it
    if start >= size:
        raise RangeNotSatisfiable
    return start, end
