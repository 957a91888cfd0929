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
`CHUNK_TOKENS_SCALAR` = 4096 for 1-D payloads (16 KiB float32, 8 KiB bf16:
a response of up to 4,096 tokens is one chunk, so a sample is one object and
a bulk read makes ~4x fewer object lookups and decoder calls than with 1024;
dedup is unchanged because a chunk still holds only its own row's tokens),
`CHUNK_TOKENS_TOKENWISE` = 256 for payloads
with per-token shape such as routes [T, L, K] (256 x 384 B = 96 KiB for a
48x8 uint8 capture: compresses well, and a shared prompt covers whole windows).

Writing keys an in-process cache (`ENCODE_CACHE`, 64 MiB) by the BLAKE3 of a
window's decoded bytes: a window seen again (a step's samples after their
rollout bundle) reuses its encoded bytes instead of being compressed again;
encoding is deterministic, so the stored bytes are the same either way.

Delta arrays (`write_array(..., base=record)`): each chunk stores
zstd(window XOR base window). Equal windows give zero bytes, which are not
stored, so "train routes == rollout routes" costs one metadata object.

Prompt-aligned rows (`write_array(..., heads=...)`, record format 2): a row
of prompt + response tokens is windowed in two segments, so a prompt shared
by a group's samples (their prefill routes) is the same objects in each;
without heads a window mixes the prompt with the sample's own response.
Records are stored zstd-compressed (`ArrayRecord.to_object`); plain-JSON
records, as written before, still read.
"""

from __future__ import annotations

import itertools
import json
import math
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard
from blake3 import blake3

from trajstore.cas.chunk_cache import CHUNK_CACHE
from trajstore.cas.lru import BytesLRU, touch_many
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
CHUNK_TOKENS_SCALAR = 4096
CHUNK_TOKENS_TOKENWISE = 256
RECORD_FORMAT = 1
#: records whose rows are windowed in two segments (`ArrayRecord.heads`); format 1 readers refuse
RECORD_FORMAT_HEADS = 2

#: Sanity limits checked before anything is allocated from a record.
MAX_ARRAY_BYTES = 1 << 36
MAX_CHUNK_BYTES = 1 << 28
#: windows encoded and put per batch by `write_array` (bounds its memory, not the payload)
WRITE_BATCH_BYTES = 64 << 20
MAX_ROWS = 1 << 24
MAX_RECORD_BYTES = 1 << 30
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
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
    """The stored bytes of a chunk whose decoded bytes are `raw` (zarr's bytes+zstd).

    Copied out when much smaller than `raw`: python-zstandard returns a bytes object
    that keeps its worst-case allocation (16.5 KiB for a padded 1-token window whose
    frame is 23 bytes), and the encode cache and the pending pack hold these by the
    thousand (100,000 one-token samples: 1.6 GB per payload).
    """
    out = _cctx().compress(raw)
    return bytes(memoryview(out)) if len(out) < len(raw) // 2 else out


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
        out = _dctx().multi_decompress_to_buffer(list(datas), decompressed_sizes=sizes)
    except zstandard.ZstdError:
        for data, h in zip(datas, names, strict=True):
            decode_chunk(data, size, h)  # raises the bad chunk's IntegrityError
        raise IntegrityError(f"chunk objects {names[0]}.. do not decode") from None
    return [memoryview(out[i]) for i in range(len(datas))]


@dataclass(frozen=True)
class ArrayRecord:
    """Where a payload array lives: its zarr.json object and, per row, its chunk objects.

    `chunks[i][j]` is the object of window j of row i (None: all fill, not
    stored); row i has ceil(row_lengths[i] / chunk_tokens) windows. With
    `heads` (record format 2), row i is windowed in two segments, its first
    heads[i] tokens (a prompt) and the rest, so a prefix shared by several
    rows is the same objects in each: ceil(h / W) + ceil((n - h) / W)
    windows (`row_spans`). `base`, when set, is the hash of the base
    record's JSON object and the chunks are XOR deltas against the base's
    windows. JSON-able and itself storable: `objs.put(record.to_object())`.
    """

    meta: str
    dtype: str
    dtype_tag: str
    shape: tuple[int, ...]
    chunk_tokens: int
    row_lengths: tuple[int, ...]
    chunks: tuple[tuple[str | None, ...], ...]
    base: str | None = None
    heads: tuple[int, ...] | None = None

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

    def row_spans(self, i: int) -> list[tuple[int, int]]:
        """(first token, tokens) of each window of row i, in `chunks[i]` order."""
        return _spans(
            self.row_lengths[i], None if self.heads is None else self.heads[i], self.chunk_tokens
        )

    def to_dict(self) -> dict[str, Any]:
        d = {
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
        if self.heads is not None:  # format 1 records stay byte-identical (same objects)
            d["format"] = RECORD_FORMAT_HEADS
            d["heads"] = list(self.heads)
        return d

    def to_json(self) -> bytes:
        """Canonical JSON: equal records have equal bytes, hence one object."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    def to_object(self) -> bytes:
        """The stored object: the canonical JSON zstd-compressed (deterministic, so equal
        records are still one object); its 64-hex chunk names halve, and the records were
        a tenth of a dense run's stored bytes."""
        return _cctx().compress(self.to_json())

    @classmethod
    def from_object(cls, data: bytes) -> ArrayRecord:
        """A record from its stored object: compressed JSON, or plain JSON as written before."""
        if bytes(data[:4]) != _ZSTD_MAGIC:
            return cls.from_json(data)
        try:
            declared = zstandard.frame_content_size(data)
            if not 0 <= declared <= MAX_RECORD_BYTES:
                raise IntegrityError(f"array record declares {declared} bytes")
            text = _dctx().decompress(data, max_output_size=declared)
        except zstandard.ZstdError as e:
            raise IntegrityError(f"array record is not a valid zstd frame: {e}") from None
        return cls.from_json(text)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ArrayRecord:
        try:
            fmt = d.get("format")
            if fmt not in (RECORD_FORMAT, RECORD_FORMAT_HEADS) or type(fmt) is not int:
                raise ValueError(f"unknown record format {fmt!r}")
            heads = tuple(d["heads"]) if fmt == RECORD_FORMAT_HEADS else None
            rec = cls(
                meta=d["meta"],
                dtype=d["dtype"],
                dtype_tag=d["dtype_tag"],
                shape=tuple(d["shape"]),
                chunk_tokens=d["chunk_tokens"],
                row_lengths=tuple(d["row_lengths"]),
                chunks=tuple(tuple(r) for r in d["chunks"]),
                base=d.get("base"),
                heads=heads,
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
        """Refuse a record whose declared sizes are inconsistent or insane (once per instance)."""
        if self.__dict__.get("_checked"):
            return
        self._check()
        object.__setattr__(self, "_checked", True)

    def _check(self) -> None:

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
        heads = self.heads
        if heads is not None:
            if len(heads) != rows or not all(type(h) is int for h in heads):
                raise bad(f"{len(heads)} heads for {rows} rows, or a head is not an integer")
            if not all(0 <= h <= n for h, n in zip(heads, self.row_lengths, strict=True)):
                raise bad("a head is negative or longer than its row")
        for i, (n, row) in enumerate(zip(self.row_lengths, self.chunks, strict=True)):
            want = _num_windows(n, None if heads is None else heads[i], w)
            if not isinstance(row, tuple) or len(row) != want:
                raise bad(f"a row of {n} tokens needs {want} chunks")
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


def _num_windows(n: int, head: int | None, w: int) -> int:
    """Windows of a row of n tokens: ceil(n / w), or per segment when it has a head."""
    if head is None:
        return -(-n // w)
    return -(-head // w) + -(-(n - head) // w)


def _spans(n: int, head: int | None, w: int) -> list[tuple[int, int]]:
    """(first token, tokens) of each window of a row of n tokens (see `ArrayRecord.heads`)."""
    segments = ((0, n),) if head is None else ((0, head), (head, n - head))
    return [(s + a, min(w, m - a)) for s, m in segments for a in range(0, m, w)]


def load_record(objs: ObjectStore, h: str) -> ArrayRecord:
    """The record stored as object `h`."""
    return ArrayRecord.from_object(objs.get(h))


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
    dtype: str,
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
        "data_type": dtype,
        "chunk_grid": {
            "name": "regular",
            "configuration": {"chunk_shape": [1, w, *shape[2:]]},
        },
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": DTYPES[dtype],
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
    buf, present, starts = _padded_windows(objs, record, rows, 0)
    out: list[list[bytes | None]] = []
    for i, k0 in zip(rows, starts, strict=True):
        nw = len(record.chunks[i])
        out.append([buf[k].tobytes() if present[k] else None for k in range(k0, k0 + nw)])
    return out


def _window_starts(record: ArrayRecord, rows: Sequence[int]) -> list[int]:
    """Index of each row's first window in the concatenation of `rows`' windows."""
    starts, k = [], 0
    for i in rows:
        starts.append(k)
        k += len(record.chunks[i])
    return starts


def _decode_all(objs: ObjectStore, record: ArrayRecord, hashes: list[str]) -> list[bytes]:
    """Fetch (batched, verified reads) and decode these chunk objects; chunks this store
    handle already verified and decoded come from its cache (`chunk_cache`)."""
    return CHUNK_CACHE.decode_many(objs, hashes, record.chunk_bytes, decode_chunk)


def _padded_windows(
    objs: ObjectStore, record: ArrayRecord, rows: Sequence[int], depth: int
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Every window of `rows`, decoded and delta-resolved: ([n, chunk_bytes] u8, present, starts).

    Absent (fill) windows are zero; `present[k]` says whether window k had
    an object in this record or, for deltas, in a base.
    """
    record.check()
    size = record.chunk_bytes
    slots = [h for i in rows for h in record.chunks[i]]
    starts = _window_starts(record, rows)
    buf = np.zeros((len(slots), size), np.uint8)
    present = np.fromiter((h is not None for h in slots), bool, len(slots))
    wanted = list(dict.fromkeys(h for h in slots if h is not None))
    decoded = dict(zip(wanted, _decode_all(objs, record, wanted), strict=True))
    for k, h in enumerate(slots):
        if h is not None:
            buf[k] = np.frombuffer(decoded[h], np.uint8)
    if record.base is None:
        return buf, present, starts
    if depth >= _MAX_DELTA_DEPTH:
        raise IntegrityError(f"delta chain of array {record.meta} is too deep")
    base = load_record(objs, record.base)
    _check_same_geometry(base, record)
    bbuf, bpresent, _ = _padded_windows(objs, base, rows, depth + 1)
    np.bitwise_xor(buf, bbuf, out=buf)
    return buf, present | bpresent, starts


def _check_same_geometry(base: ArrayRecord, rec: ArrayRecord) -> None:
    same = (base.dtype, base.shape, base.chunk_tokens, base.row_lengths, base.heads) == (
        rec.dtype,
        rec.shape,
        rec.chunk_tokens,
        rec.row_lengths,
        rec.heads,
    )
    if not same:
        raise UsageError(
            f"delta base must have the same dtype, shape, row lengths, heads and chunking: "
            f"{base.dtype}{list(base.shape)} vs {rec.dtype}{list(rec.shape)}"
        )


def _row_windows(
    flat: np.ndarray,
    lengths: Sequence[int],
    w: int,
    tb: int,
    heads: Sequence[int] | None = None,
    base: np.ndarray | None = None,
) -> Iterator[memoryview]:
    """The bytes of every row's windows of `w` tokens (of `flat`), in order, unpadded: a
    segment's last one may be shorter (stored zero padded to `w` tokens: `_padded`). With
    `heads`, each row is two segments: its head and the rest. With `base` (bytes as long
    as `flat`), each window is the XOR of the two.

    Windows of `flat` are zero-copy views. An XOR window is computed as it is yielded:
    while hashing and compressing it next, it is still in the CPU's cache (a
    whole-payload XOR first went through memory twice). A generator, so a million short
    rows' windows are never all held at once.
    """
    size = w * tb
    mv = memoryview(flat).cast("B")
    pos = 0
    if heads is None and base is None:  # the common case, without per-window tuples/min
        for n in lengths:
            row_end = pos + n * tb
            while pos + size < row_end:
                yield mv[pos : pos + size]
                pos += size
            if pos < row_end:
                yield mv[pos:row_end]
            pos = row_end
        return
    for i, n in enumerate(lengths):
        row_end = pos + n * tb
        cuts = (row_end,) if heads is None else (pos + heads[i] * tb, row_end)
        a = pos
        for end in cuts:
            while a < end:
                b = min(a + size, end)
                if base is None:
                    yield mv[a:b]
                else:
                    yield memoryview(np.bitwise_xor(flat[a:b], base[a:b]))
                a = b
        pos = row_end


def _padded(win: memoryview, size: int) -> Any:
    """A window's stored (decoded) bytes: its bytes zero padded to `size`."""
    if len(win) == size:
        return win
    out = bytearray(size)
    out[: len(win)] = win
    return out


class _EncodeCache(BytesLRU):
    """Recently encoded windows by the BLAKE3 of their decoded bytes (bounded by bytes).

    Encoding is deterministic (equal decoded bytes -> equal stored bytes), so
    a window seen again in this process (a step bundle's samples after their
    rollout bundle, a resumed step) reuses the stored bytes instead of being
    compressed again. Per process, thread-safe, at most `max_bytes` held.
    """

    def __init__(self, max_bytes: int, max_names: int = 1 << 18) -> None:
        super().__init__(max_bytes, item_fraction=16)
        # Key -> (object name, size) of windows stored from this process, kept longer than
        # their bytes (~200 B an entry): a window whose object the store is known to hold
        # (`ObjectStore.has_cached`, no I/O) is neither compressed nor hashed again, even
        # after its bytes were evicted (a rollout bundle ingested after its steps).
        self.max_names = max_names
        self._names: OrderedDict[bytes, tuple[str, int]] = OrderedDict()

    def names_of(self, keys: Sequence[bytes | None]) -> list[tuple[str, int] | None]:
        """The (object name, size) stored for each key, or None (a None key: None)."""
        with self._lock:
            return touch_many(self._names, keys)

    def add_names(self, items: Iterable[tuple[bytes, str, int]]) -> None:
        """Remember each (key, object name, size) stored, the oldest dropped past max_names."""
        names = self._names
        with self._lock:
            for key, h, size in items:
                names[key] = (h, size)
                if len(names) > self.max_names:
                    names.popitem(last=False)

    def clear(self) -> None:
        super().clear()
        with self._lock:
            self._names.clear()


#: Encoded windows kept for reuse (see `_EncodeCache`); 64 MiB covers a rollout's chunks.
ENCODE_CACHE = _EncodeCache(64 << 20)


def _encode_windows(
    wins: list[Any], size: int, objs: ObjectStore | None = None
) -> tuple[list[bytes | str | None], list[bytes | None]]:
    """Stored bytes of each window (`encode_chunk` of it zero padded to `size` bytes), None
    for an all-zero (fill) window, or the name of its object when `objs` is known to hold
    it already; and each key.

    The encode cache is keyed by the BLAKE3 of the window's own bytes, their length and
    `size` (which fix the padded bytes): the padding is never hashed, and a window is
    padded (copied) only to be compressed. The cache is asked for the whole batch at once
    (one lock per batch, not two per window); a window repeated within the batch is
    compressed once.
    """
    suffix = size.to_bytes(8, "little") + ZSTD_LEVEL.to_bytes(2, "little", signed=True)
    zeros = bytes(size)
    keys: list[bytes | None] = []
    for win in wins:
        n = len(win)
        # a fill window is found by comparing (a byte, else a copy and a memcmp: several
        # times cheaper than hashing it, and KL, padding and such are often all zero)
        if (not n or not win[0]) and bytes(win) == zeros[:n]:
            keys.append(None)
        else:
            keys.append(blake3(win).digest() + n.to_bytes(8, "little") + suffix)
    out: list[bytes | str | None] = [None] * len(keys)
    todo: list[int] = []  # windows neither known stored nor dropped as fill
    if objs is not None:
        has_cached = objs.has_cached
        for k, known in enumerate(ENCODE_CACHE.names_of(keys)):
            if known is not None and has_cached(*known):
                out[k] = known[0]
            elif keys[k] is not None:
                todo.append(k)
    else:
        todo = [k for k, key in enumerate(keys) if key is not None]
    if not todo:
        return out, keys
    fresh: dict[bytes, bytes] = {}
    for k, data in zip(todo, ENCODE_CACHE.get_many([keys[k] for k in todo]), strict=True):
        if data is None:
            key = keys[k]
            data = fresh.get(key)  # type: ignore[arg-type]
            if data is None:
                data = fresh[key] = encode_chunk(_padded(wins[k], size))  # type: ignore[index]
        out[k] = data
    if fresh:
        ENCODE_CACHE.add_many(fresh.items())
    return out, keys


def write_array(
    objs: ObjectStore,
    values: np.ndarray,
    row_lengths: Sequence[int],
    *,
    dtype_tag: str,
    attributes: Mapping[str, Any] | None = None,
    base: ArrayRecord | None = None,
    base_values: np.ndarray | None = None,
    chunk_tokens: int | None = None,
    heads: Sequence[int] | None = None,
) -> ArrayRecord:
    """Store a ragged payload (`values` = rows' tokens concatenated, [T, *token_shape]).

    Same values, lengths, tag and attributes always give the same record.
    With `base`, chunks are XOR deltas against the base's windows (same dtype
    and geometry required); `base_values`, when given, must be the values
    `base` was written from (the caller still has them in memory) and spares
    reading the base back from the store. Objects may sit in the store's
    write buffer until `objs.flush()`. `chunk_tokens` overrides the
    store-wide W (dedup only holds between arrays written with the same W).
    `heads` (one per row, 0 <= head <= row length) windows each row's first
    `head` tokens apart from the rest (record format 2): rows sharing a
    prefix, such as a group's prompt routes, then share its objects.
    """
    arr, lengths = _check_values(values, row_lengths)
    dname = arr.dtype.name  # a Python-level property in numpy (~3 us): read once
    token_shape = tuple(arr.shape[1:])
    w = chunk_tokens if chunk_tokens is not None else chunk_tokens_for(token_shape)
    if not isinstance(dtype_tag, str) or not dtype_tag:
        raise UsageError("dtype_tag must be a non-empty string, e.g. 'torch.float32'")
    if dtype_tag == "torch.bfloat16" and arr.dtype != np.uint16:
        raise UsageError("torch.bfloat16 payloads must be passed as uint16 bits")
    if base_values is not None and base is None:
        raise UsageError("base_values needs base (the record they were written as)")
    head_t: tuple[int, ...] | None = None
    if heads is not None:
        try:
            head_t = tuple(int(h) for h in heads)
        except (TypeError, ValueError):
            raise UsageError("heads must be integers") from None
        if len(head_t) != len(lengths) or not all(
            0 <= h <= n for h, n in zip(head_t, lengths, strict=True)
        ):
            raise UsageError("heads must be one per row, each between 0 and its row's length")
    shape = (len(lengths), max(lengths, default=0), *token_shape)
    tb = arr.dtype.itemsize * math.prod(token_shape)
    flat = arr.reshape(-1).view(np.uint8)
    if base is not None:
        probe = ArrayRecord(
            "0" * 64,
            dname,
            dtype_tag,
            shape,
            w,
            tuple(lengths),
            tuple(
                (None,) * _num_windows(n, None if head_t is None else head_t[i], w)
                for i, n in enumerate(lengths)
            ),
            heads=head_t,
        )
        _check_same_geometry(base, probe)
    if base is not None and base_values is None:
        base_values = read_array(objs, base)
    if base_values is not None:
        bv = np.ascontiguousarray(base_values, dtype=arr.dtype.newbyteorder("<"))
        if bv.shape != arr.shape:
            raise UsageError(f"base_values shape {list(bv.shape)} differs from {list(arr.shape)}")
        # Padding is zero on both sides, so XOR before windowing equals XOR of windows.
        base_flat = bv.reshape(-1).view(np.uint8)
    else:
        base_flat = None
    windows = _row_windows(flat, lengths, w, tb, head_t, base_flat)
    slot_of: list[str | None] = []
    # Encoded in batches of WRITE_BATCH_BYTES of windows, each put before the next is
    # encoded: memory stays at one batch whatever the payload's size (was all of it).
    while wins := list(itertools.islice(windows, max(1, WRITE_BATCH_BYTES // (w * tb)))):
        encoded, keys = _encode_windows(wins, w * tb, objs)
        put = [k for k, d in enumerate(encoded) if type(d) is bytes]
        if put:
            hashes = objs.put_many([encoded[k] for k in put])
            named = []
            for k, h in zip(put, hashes, strict=True):
                named.append((keys[k], h, len(encoded[k])))  # type: ignore[arg-type]
                encoded[k] = h
            ENCODE_CACHE.add_names(named)  # type: ignore[arg-type]
        slot_of += encoded  # type: ignore[arg-type]
    counts = [
        _num_windows(n, None if head_t is None else head_t[i], w) for i, n in enumerate(lengths)
    ]
    table: list[tuple[str | None, ...]] = []
    k = 0
    for nw in counts:
        table.append(tuple(slot_of[k : k + nw]))
        k += nw

    tattrs: dict[str, Any] = {"dtype_tag": dtype_tag, "row_lengths": lengths, "chunk_tokens": w}
    base_hash = None
    if base is not None:
        base_hash = objs.put(base.to_object())
        tattrs["delta_base"] = base_hash
    meta = objs.put(_zarr_metadata(dname, shape, w, tattrs, attributes or {}))
    return ArrayRecord(
        meta=meta,
        dtype=dname,
        dtype_tag=dtype_tag,
        shape=shape,
        chunk_tokens=w,
        row_lengths=tuple(lengths),
        chunks=tuple(table),
        base=base_hash,
        heads=head_t,
    )


# --- reading -------------------------------------------------------------


def read_rows(objs: ObjectStore, record: ArrayRecord, rows: Sequence[int]) -> np.ndarray:
    """Tokens of `rows` (in that order) concatenated: [sum of their lengths, *token_shape].

    Fetches only those rows' chunks (and their base chunks for a delta), in
    one batched read (`objs.get_many`, every object verified), and decodes
    each distinct chunk once, straight into the output.
    """
    record.check()
    rows = [int(r) for r in rows]
    nrows = len(record.row_lengths)
    for r in rows:
        if not 0 <= r < nrows:
            raise UsageError(f"row {r} out of range for an array of {nrows} rows")
    tb = record.token_bytes
    w = record.chunk_tokens
    wb = w * tb
    lengths = [record.row_lengths[r] for r in rows]
    total = sum(lengths)
    out = np.zeros(total * tb, dtype=np.uint8)
    if record.base is not None:
        buf, _, starts = _padded_windows(objs, record, rows, 0)
        pos = 0
        for r, n, k0 in zip(rows, lengths, starts, strict=True):
            if record.heads is None:
                out[pos : pos + n * tb] = buf.reshape(-1)[k0 * wb : k0 * wb + n * tb]
            else:
                for k, (s, c) in enumerate(record.row_spans(r), k0):
                    out[pos + s * tb : pos + (s + c) * tb] = buf[k, : c * tb]
            pos += n * tb
    elif record.heads is not None:
        pos = 0
        for part in _row_batches(record, rows):
            decoded = _decode_rows(objs, record, part)
            for r in part:
                for h, (s, c) in zip(record.chunks[r], record.row_spans(r), strict=True):
                    if h is not None:
                        out[pos + s * tb : pos + (s + c) * tb] = np.frombuffer(
                            decoded[h], np.uint8, c * tb
                        )
                pos += record.row_lengths[r] * tb
    else:
        pos = 0
        for part in _row_batches(record, rows):
            decoded = _decode_rows(objs, record, part)
            for r in part:
                end = pos + record.row_lengths[r] * tb
                a = pos
                for h in record.chunks[r]:
                    b = min(a + wb, end)
                    if h is not None:
                        out[a:b] = np.frombuffer(decoded[h], np.uint8, b - a)
                    a = b
                pos = end
    return out.view(record.dtype).reshape(total, *record.token_shape)


#: decoded window bytes `read_rows` holds at once besides its output (one batch of rows)
READ_BATCH_BYTES = 64 << 20


def _row_batches(record: ArrayRecord, rows: list[int]) -> Iterator[list[int]]:
    """`rows` in consecutive runs whose windows decode to about READ_BATCH_BYTES: the
    decoded chunks are dropped after each run is copied out (a 1-token row decodes a
    16 KiB window, so a million rows at once was 16 GiB beside a 4 MB output)."""
    per_batch = max(1, READ_BATCH_BYTES // record.chunk_bytes)
    part: list[int] = []
    windows = 0
    for r in rows:
        part.append(r)
        windows += len(record.chunks[r])
        if windows >= per_batch:
            yield part
            part, windows = [], 0
    if part:
        yield part


def _decode_rows(objs: ObjectStore, record: ArrayRecord, rows: list[int]) -> dict[str, bytes]:
    """The decoded chunks of `rows` by name (each distinct chunk fetched and decoded once)."""
    wanted = list(dict.fromkeys(h for r in rows for h in record.chunks[r] if h is not None))
    return dict(zip(wanted, _decode_all(objs, record, wanted), strict=True))


def read_array(objs: ObjectStore, record: ArrayRecord) -> np.ndarray:
    """The whole payload as written: flat tokens of every row, dtype included, bit-identical."""
    return read_rows(objs, record, range(len(record.row_lengths)))
