"""Per-token payloads as Zarr v3 arrays whose chunks are content-addressed objects.

A ragged payload (flat tokens of each row concatenated; rows are samples) is
stored as the padded array `[num_rows, width, *token_shape]` with chunk
`[1, W, *token_shape]`: a window of W tokens of one row. A chunk's bytes then
depend only on that row's own tokens, so a sample recurring in another
bundle, rank, attempt or run is the same object. Chunks whose bytes are all
zero (the fill value) are not stored.

The codec chain is `bytes` (little endian) + `zstd` level 3 without
checksum, so each stored chunk is exactly `zstd.compress(window.tobytes(), 3)`
as zarr-python writes it; we encode and decode directly (zarr-python costs
~0.1-0.7 ms per chunk) and `zarr_store.CASZarrStore` serves the same
objects to stock zarr. A caveat: a different libzstd may emit different (still
valid) bytes, which only costs dedup against objects written before.

W is a store-wide constant so that dedup holds across writers:
`CHUNK_TOKENS_SCALAR` = 1024 for 1-D payloads (4 KiB float32, 2 KiB bf16:
most responses fit in one or a few chunks, and chunks stay large enough that
per-object overhead is small), `CHUNK_TOKENS_TOKENWISE` = 256 for payloads
with per-token shape such as routes [T, L, K] (256 x 384 B = 96 KiB for a
48x8 uint8 capture: compresses well, and a shared prompt covers whole windows).

Delta arrays (`write_array(..., base=record)`): each chunk stores
zstd(window XOR base window). Equal windows give zero bytes, which are not
stored, so "train routes == rollout routes" costs one metadata object.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard

from trajstore.cas.objects import ObjectStore, check_hash
from trajstore.errors import IntegrityError, NotFoundError, UsageError

__all__ = [
    "CHUNK_TOKENS_SCALAR",
    "CHUNK_TOKENS_TOKENWISE",
    "DTYPES",
    "ZSTD_LEVEL",
    "ArrayRecord",
    "chunk_tokens_for",
    "decode_chunk",
    "encode_chunk",
    "load_record",
    "read_array",
    "read_rows",
    "record_objects",
    "window_bytes",
    "write_array",
]

ZSTD_LEVEL = 3
CHUNK_TOKENS_SCALAR = 1024
CHUNK_TOKENS_TOKENWISE = 256
RECORD_FORMAT = 1

#: Sanity limits checked before anything is allocated from a record.
MAX_ARRAY_BYTES = 1 << 36
MAX_CHUNK_BYTES = 1 << 28
MAX_ROWS = 1 << 24
_MAX_DELTA_DEPTH = 4

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

# Deterministic: single-threaded, content size in the header (as numcodecs
# writes it), no checksum (zarr's zstd codec default `checksum: false`).
# zstandard contexts are not thread-safe, so each thread gets its own.
_ctx = threading.local()


def _cctx() -> zstandard.ZstdCompressor:
    c = getattr(_ctx, "c", None)
    if c is None:
        c = _ctx.c = zstandard.ZstdCompressor(
            level=ZSTD_LEVEL, write_checksum=False, write_content_size=True
        )
    return c


def _dctx() -> zstandard.ZstdDecompressor:
    d = getattr(_ctx, "d", None)
    if d is None:
        d = _ctx.d = zstandard.ZstdDecompressor()
    return d


def chunk_tokens_for(token_shape: Sequence[int]) -> int:
    """The store-wide window W for a payload whose per-token shape is `token_shape`."""
    return CHUNK_TOKENS_SCALAR if len(token_shape) == 0 else CHUNK_TOKENS_TOKENWISE


def encode_chunk(raw: bytes) -> bytes:
    """The stored bytes of a chunk whose decoded bytes are `raw` (zarr's bytes+zstd)."""
    return _cctx().compress(raw)


def decode_chunk(data: bytes, size: int, h: str = "?") -> bytes:
    """Decode a chunk that must decode to exactly `size` bytes; never allocate more."""
    try:
        declared = zstandard.frame_content_size(data)
        if declared not in (size, -1):
            raise IntegrityError(f"chunk object {h} declares {declared} bytes, expected {size}")
        raw = _dctx().decompress(data, max_output_size=size)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"chunk object {h} is not a valid zstd frame: {e}") from None
    if len(raw) != size:
        raise IntegrityError(f"chunk object {h} decodes to {len(raw)} bytes, expected {size}")
    return raw


@dataclass(frozen=True)
class ArrayRecord:
    """Where a payload array lives: its zarr.json object and, per row, its chunk objects.

    `chunks[i][j]` is the object of window j of row i (None: all fill, not
    stored); row i has ceil(row_lengths[i] / chunk_tokens) windows. `base`,
    when set, is the hash of the base record's JSON object and the chunks
    are XOR deltas against the base's windows. JSON-able and itself
    storable: `objs.put(record.to_json())`.
    """

    meta: str
    dtype: str
    dtype_tag: str
    shape: tuple[int, ...]
    chunk_tokens: int
    row_lengths: tuple[int, ...]
    chunks: tuple[tuple[str | None, ...], ...]
    base: str | None = None

    @property
    def token_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[2:])

    @property
    def token_bytes(self) -> int:
        return np.dtype(self.dtype).itemsize * math.prod(self.token_shape)

    @property
    def chunk_bytes(self) -> int:
        """Decoded size of every chunk (full window, padded with the fill value)."""
        return self.chunk_tokens * self.token_bytes

    @property
    def num_tokens(self) -> int:
        return sum(self.row_lengths)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": RECORD_FORMAT,
            "meta": self.meta,
            "dtype": self.dtype,
            "dtype_tag": self.dtype_tag,
            "shape": list(self.shape),
            "chunk_tokens": self.chunk_tokens,
            "row_lengths": list(self.row_lengths),
            "chunks": [list(r) for r in self.chunks],
            "base": self.base,
        }

    def to_json(self) -> bytes:
        """Canonical JSON: equal records have equal bytes, hence one object."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ArrayRecord:
        try:
            if d.get("format") != RECORD_FORMAT:
                raise ValueError(f"unknown record format {d.get('format')!r}")
            rec = cls(
                meta=d["meta"],
                dtype=d["dtype"],
                dtype_tag=d["dtype_tag"],
                shape=tuple(d["shape"]),
                chunk_tokens=d["chunk_tokens"],
                row_lengths=tuple(d["row_lengths"]),
                chunks=tuple(tuple(r) for r in d["chunks"]),
                base=d.get("base"),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise IntegrityError(f"array record is malformed: {e}") from None
        rec.check()
        return rec

    @classmethod
    def from_json(cls, data: bytes | str) -> ArrayRecord:
        try:
            d = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise IntegrityError(f"array record is not JSON: {e}") from None
        if not isinstance(d, dict):
            raise IntegrityError("array record is not a JSON object")
        return cls.from_dict(d)

    def check(self) -> None:
        """Refuse a record whose declared sizes are inconsistent or insane."""

        def bad(why: str) -> IntegrityError:
            return IntegrityError(f"array record (meta {self.meta}) is invalid: {why}")

        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise bad(f"unsupported dtype {self.dtype!r}")
        if not isinstance(self.dtype_tag, str):
            raise bad("dtype_tag is not a string")
        ints = (*self.shape, self.chunk_tokens, *self.row_lengths)
        if not all(type(x) is int and x >= 0 for x in ints):
            raise bad("shape, chunk_tokens and row_lengths must be non-negative integers")
        if len(self.shape) < 2 or not 0 < self.chunk_tokens <= 1 << 20:
            raise bad(f"shape {list(self.shape)} / chunk_tokens {self.chunk_tokens}")
        rows = self.shape[0]
        if rows > MAX_ROWS or rows != len(self.row_lengths) or rows != len(self.chunks):
            raise bad(
                f"{rows} rows, {len(self.row_lengths)} lengths, {len(self.chunks)} chunk rows"
            )
        if self.shape[1] != max(self.row_lengths, default=0):
            raise bad(f"width {self.shape[1]} is not the longest row")
        if math.prod(self.token_shape) > MAX_CHUNK_BYTES or self.chunk_bytes > MAX_CHUNK_BYTES:
            raise bad(f"chunk of {self.chunk_bytes} bytes")
        if self.num_tokens * self.token_bytes > MAX_ARRAY_BYTES:
            raise bad(f"{self.num_tokens * self.token_bytes} bytes declared")
        w = self.chunk_tokens
        for n, row in zip(self.row_lengths, self.chunks, strict=True):
            if not isinstance(row, tuple) or len(row) != -(-n // w):
                raise bad(f"a row of {n} tokens needs {-(-n // w)} chunks")
        try:
            check_hash(self.meta)
            if self.base is not None:
                check_hash(self.base)
            for row in self.chunks:
                for h in row:
                    if h is not None:
                        check_hash(h)
        except NotFoundError as e:
            raise bad(str(e)) from None

    def object_hashes(self) -> set[str]:
        """Objects this record references directly (the base record's own are not included)."""
        out = {self.meta, *(h for row in self.chunks for h in row if h is not None)}
        if self.base is not None:
            out.add(self.base)
        return out


def load_record(objs: ObjectStore, h: str) -> ArrayRecord:
    """The record stored as object `h`."""
    return ArrayRecord.from_json(objs.get(h))


def record_objects(objs: ObjectStore, record: ArrayRecord) -> set[str]:
    """Every object needed to read `record`, following delta bases (for GC marking)."""
    out = record.object_hashes()
    depth = 0
    while record.base is not None:
        depth += 1
        if depth > _MAX_DELTA_DEPTH:
            raise IntegrityError(f"delta chain of record {record.meta} is too deep")
        record = load_record(objs, record.base)
        out |= record.object_hashes()
    return out


# --- writing -------------------------------------------------------------


def _zarr_metadata(
    dtype: np.dtype,
    shape: tuple[int, ...],
    w: int,
    trajstore_attrs: dict[str, Any],
    attributes: Mapping[str, Any],
) -> bytes:
    """The array's zarr.json (v3), canonical JSON so equal arrays share one object."""
    if "trajstore" in attributes:
        raise UsageError("attribute name 'trajstore' is reserved")
    doc = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": dtype.name,
        "chunk_grid": {
            "name": "regular",
            "configuration": {"chunk_shape": [1, w, *shape[2:]]},
        },
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": DTYPES[dtype.name],
        "codecs": [
            {"name": "bytes", "configuration": {"endian": "little"}},
            {"name": "zstd", "configuration": {"level": ZSTD_LEVEL, "checksum": False}},
        ],
        "attributes": {**attributes, "trajstore": trajstore_attrs},
        "storage_transformers": [],
    }
    try:
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise UsageError(f"array attributes are not JSON: {e}") from None


def _check_values(values: np.ndarray, row_lengths: Sequence[int]) -> tuple[np.ndarray, list[int]]:
    arr = np.asarray(values)
    if arr.ndim < 1:
        raise UsageError("a payload must have a token axis (ndim >= 1)")
    if arr.dtype.name not in DTYPES:
        raise UsageError(
            f"unsupported payload dtype {arr.dtype}; pass bfloat16 as uint16 bits with "
            "dtype_tag='torch.bfloat16'"
        )
    arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    try:
        lengths = [int(n) for n in row_lengths]
    except (TypeError, ValueError):
        raise UsageError("row_lengths must be integers") from None
    if any(n < 0 for n in lengths) or sum(lengths) != arr.shape[0]:
        raise UsageError(
            f"row_lengths (sum {sum(lengths)}) must be non-negative and sum to the "
            f"payload's {arr.shape[0]} tokens"
        )
    return arr, lengths


def window_bytes(
    objs: ObjectStore, record: ArrayRecord, rows: Sequence[int]
) -> list[list[bytes | None]]:
    """Decoded value bytes of every window of `rows` (None: all fill), deltas resolved."""
    return _windows(objs, record, rows, 0)


def _windows(
    objs: ObjectStore, record: ArrayRecord, rows: Sequence[int], depth: int
) -> list[list[bytes | None]]:
    record.check()
    size = record.chunk_bytes
    wanted = list(dict.fromkeys(h for i in rows for h in record.chunks[i] if h is not None))
    decoded = {
        h: decode_chunk(d, size, h) for h, d in zip(wanted, objs.get_many(wanted), strict=True)
    }
    out: list[list[bytes | None]] = [
        [None if h is None else decoded[h] for h in record.chunks[i]] for i in rows
    ]
    if record.base is None:
        return out
    if depth >= _MAX_DELTA_DEPTH:
        raise IntegrityError(f"delta chain of array {record.meta} is too deep")
    base = load_record(objs, record.base)
    _check_same_geometry(base, record)
    base_win = _windows(objs, base, rows, depth + 1)
    for orow, brow in zip(out, base_win, strict=True):
        for j, (d, b) in enumerate(zip(orow, brow, strict=True)):
            orow[j] = b if d is None else (d if b is None else _xor(d, b))
    return out


def _xor(a: bytes, b: bytes) -> bytes:
    return np.bitwise_xor(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)).tobytes()


def _check_same_geometry(base: ArrayRecord, rec: ArrayRecord) -> None:
    same = (base.dtype, base.shape, base.chunk_tokens, base.row_lengths) == (
        rec.dtype,
        rec.shape,
        rec.chunk_tokens,
        rec.row_lengths,
    )
    if not same:
        raise UsageError(
            f"delta base must have the same dtype, shape, row lengths and chunking: "
            f"{base.dtype}{list(base.shape)} vs {rec.dtype}{list(rec.shape)}"
        )


def write_array(
    objs: ObjectStore,
    values: np.ndarray,
    row_lengths: Sequence[int],
    *,
    dtype_tag: str,
    attributes: Mapping[str, Any] | None = None,
    base: ArrayRecord | None = None,
    chunk_tokens: int | None = None,
) -> ArrayRecord:
    """Store a ragged payload (`values` = rows' tokens concatenated, [T, *token_shape]).

    Same values, lengths, tag and attributes always give the same record.
    With `base`, chunks are XOR deltas against the base's windows (same dtype
    and geometry required). Objects may sit in the store's write buffer until
    `objs.flush()`. `chunk_tokens` overrides the store-wide W (dedup only
    holds between arrays written with the same W).
    """
    arr, lengths = _check_values(values, row_lengths)
    token_shape = tuple(arr.shape[1:])
    w = chunk_tokens if chunk_tokens is not None else chunk_tokens_for(token_shape)
    if not isinstance(dtype_tag, str) or not dtype_tag:
        raise UsageError("dtype_tag must be a non-empty string, e.g. 'torch.float32'")
    if dtype_tag == "torch.bfloat16" and arr.dtype != np.uint16:
        raise UsageError("torch.bfloat16 payloads must be passed as uint16 bits")
    shape = (len(lengths), max(lengths, default=0), *token_shape)
    tb = arr.dtype.itemsize * math.prod(token_shape)
    size = w * tb
    zero = bytes(size)
    base_win: list[list[bytes | None]] | None = None
    if base is not None:
        probe = ArrayRecord(
            "0" * 64,
            arr.dtype.name,
            dtype_tag,
            shape,
            w,
            tuple(lengths),
            tuple((None,) * -(-n // w) for n in lengths),
        )
        _check_same_geometry(base, probe)
        base_win = window_bytes(objs, base, range(len(lengths)))

    buf = arr.tobytes()
    payloads: list[bytes] = []
    slots: list[tuple[int, int]] = []
    table: list[list[str | None]] = []
    pos = 0
    for i, n in enumerate(lengths):
        nw = -(-n // w)
        row: list[str | None] = [None] * nw
        for j in range(nw):
            a = pos + j * w * tb
            b = pos + min((j + 1) * w, n) * tb
            raw = buf[a:b]
            if len(raw) < size:
                raw += zero[: size - len(raw)]
            if base_win is not None:
                bw = base_win[i][j]
                if bw is not None:
                    raw = _xor(raw, bw)
            if raw != zero:
                payloads.append(encode_chunk(raw))
                slots.append((i, j))
        table.append(row)
        pos += n * tb
    for (i, j), h in zip(slots, objs.put_many(payloads), strict=True):
        table[i][j] = h

    tattrs: dict[str, Any] = {"dtype_tag": dtype_tag, "row_lengths": lengths, "chunk_tokens": w}
    base_hash = None
    if base is not None:
        base_hash = objs.put(base.to_json())
        tattrs["delta_base"] = base_hash
    meta = objs.put(_zarr_metadata(arr.dtype, shape, w, tattrs, attributes or {}))
    return ArrayRecord(
        meta=meta,
        dtype=arr.dtype.name,
        dtype_tag=dtype_tag,
        shape=shape,
        chunk_tokens=w,
        row_lengths=tuple(lengths),
        chunks=tuple(tuple(r) for r in table),
        base=base_hash,
    )


# --- reading -------------------------------------------------------------


def read_rows(objs: ObjectStore, record: ArrayRecord, rows: Sequence[int]) -> np.ndarray:
    """Tokens of `rows` (in that order) concatenated: [sum of their lengths, *token_shape].

    Fetches only those rows' chunks (and their base chunks for a delta).
    """
    record.check()
    rows = [int(r) for r in rows]
    nrows = len(record.row_lengths)
    for r in rows:
        if not 0 <= r < nrows:
            raise UsageError(f"row {r} out of range for an array of {nrows} rows")
    tb = record.token_bytes
    w = record.chunk_tokens
    lengths = [record.row_lengths[r] for r in rows]
    out = np.zeros(sum(lengths) * tb, dtype=np.uint8)
    pos = 0
    for n, wins in zip(lengths, window_bytes(objs, record, rows), strict=True):
        for j, raw in enumerate(wins):
            if raw is not None:
                k = (min((j + 1) * w, n) - j * w) * tb
                out[pos + j * w * tb : pos + j * w * tb + k] = np.frombuffer(raw, np.uint8, k)
        pos += n * tb
    return out.view(record.dtype).reshape(sum(lengths), *record.token_shape)


def read_array(objs: ObjectStore, record: ArrayRecord) -> np.ndarray:
    """The whole payload as written: flat tokens of every row, dtype included, bit-identical."""
    return read_rows(objs, record, range(len(record.row_lengths)))
