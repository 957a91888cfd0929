"""The chunk codec of the CAS arrays: zarr v3's `bytes` (little endian) + `zstd` level 3
without checksum, done directly (see `trajstore.cas.arrays` for the format), and the
window geometry every array shares.

Deterministic: single-threaded, content size in the header (as numcodecs writes it), no
checksum (zarr's zstd codec default `checksum: false`). zstandard contexts are not
thread-safe, so each thread gets its own.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import zstandard

from trajstore.errors import IntegrityError

ZSTD_LEVEL = 3
CHUNK_TOKENS_SCALAR = 4096
CHUNK_TOKENS_TOKENWISE = 256

#: numpy dtype name -> zarr v3 fill value (JSON). The zarr data_type is the same name.
DTYPES: dict[str, Any] = {
    "bool": False,
    "int8": 0,
    "int16": 0,
    "int32": 0,
    "int64": 0,
    "uint8": 0,
    "uint16": 0,
    "uint32": 0,
    "uint64": 0,
    "float16": 0.0,
    "float32": 0.0,
    "float64": 0.0,
}

_ctx = threading.local()


def compressor() -> zstandard.ZstdCompressor:
    """This thread's compressor (level `ZSTD_LEVEL`, read when the thread first asks)."""
    c = getattr(_ctx, "c", None)
    if c is None:
        c = _ctx.c = zstandard.ZstdCompressor(
            level=ZSTD_LEVEL, write_checksum=False, write_content_size=True
        )
    return c


def decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor."""
    d = getattr(_ctx, "d", None)
    if d is None:
        d = _ctx.d = zstandard.ZstdDecompressor()
    return d


def chunk_tokens_for(token_shape: Sequence[int]) -> int:
    """The store-wide window W for a payload whose per-token shape is `token_shape`."""
    return CHUNK_TOKENS_SCALAR if len(token_shape) == 0 else CHUNK_TOKENS_TOKENWISE


def encode_chunk(raw: bytes) -> bytes:
    """The stored bytes of a chunk whose decoded bytes are `raw` (zarr's bytes+zstd).

    Copied out when much smaller than `raw`: python-zstandard returns a bytes object
    that keeps its worst-case allocation (16.5 KiB for a padded 1-token window whose
    frame is 23 bytes), and the encode cache and the pending pack hold these by the
    thousand (100,000 one-token samples: 1.6 GB per payload).
    """
    out = compressor().compress(raw)
    return bytes(memoryview(out)) if len(out) < len(raw) // 2 else out


def decode_frame(data: bytes, size: int, what: str, h: str) -> bytes:
    """Decode one zstd frame that must decode to exactly `size` bytes, never allocating
    more; an `IntegrityError` naming the `what` object `h` otherwise."""
    try:
        declared = zstandard.frame_content_size(data)
        if declared not in (size, -1):
            raise IntegrityError(f"{what} object {h} declares {declared} bytes, expected {size}")
        out = decompressor().decompress(data, max_output_size=size)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"{what} object {h} is not a valid zstd frame: {e}") from None
    if len(out) != size:
        raise IntegrityError(f"{what} object {h} decodes to {len(out)} bytes, expected {size}")
    return out


def decode_chunk(data: bytes, size: int, h: str = "?") -> bytes:
    """Decode a chunk that must decode to exactly `size` bytes; never allocate more."""
    return decode_frame(data, size, "chunk", h)


def decode_chunks(datas: Sequence[Any], size: int, names: Sequence[str]) -> list[memoryview]:
    """`decode_chunk` of each chunk object in `datas` (named `names`), in one call that
    decodes them all into one buffer: views of it, each exactly `size` bytes (they keep
    the buffer alive: for decoding that is copied out at once, as a download does).

    One call and one allocation per batch instead of one per chunk (a 64 MB download's
    decode: 89 vs 99 ms CPU, docs/benchmarks.md). Each frame is decoded into exactly
    `size` bytes or refused, never allocated beyond it; on a refusal each chunk is decoded
    alone so the error names the bad one.
    """
    if not datas:
        return []
    sizes = np.full(len(datas), size, dtype="<u8").tobytes()
    try:
        out = decompressor().multi_decompress_to_buffer(list(datas), decompressed_sizes=sizes)
    except zstandard.ZstdError:
        for data, h in zip(datas, names, strict=True):
            decode_chunk(data, size, h)  # raises the bad chunk's IntegrityError
        raise IntegrityError(f"chunk objects {names[0]}.. do not decode") from None
    return [memoryview(out[i]) for i in range(len(datas))]


def num_windows(n: int, head: int | None, w: int) -> int:
    """Windows of a row of n tokens: ceil(n / w), or per segment when it has a head."""
    if head is None:
        return -(-n // w)
    return -(-head // w) + -(-(n - head) // w)


def window_spans(n: int, head: int | None, w: int) -> list[tuple[int, int]]:
    """(first token, tokens) of each window of a row of n tokens (see `ArrayRecord.heads`)."""
    segments = ((0, n),) if head is None else ((0, head), (head, n - head))
    return [(s + a, min(w, m - a)) for s, m in segments for a in range(0, m, w)]
