"""`ArrayRecord`: where a payload array lives (its zarr.json object and, per row, its
chunk objects), its checks and stored form, and the objects a record needs."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard

from trajstore.cas.chunk_codec import DTYPES, compressor, decompressor, num_windows, window_spans
from trajstore.cas.objects import ObjectStore, check_hash
from trajstore.errors import IntegrityError, NotFoundError, UsageError

RECORD_FORMAT = 1
#: records whose rows are windowed in two segments (`ArrayRecord.heads`); format 1 readers refuse
RECORD_FORMAT_HEADS = 2
#: Sanity limits checked before anything is allocated from a record.
MAX_ARRAY_BYTES = 1 << 36
MAX_CHUNK_BYTES = 1 << 28
MAX_ROWS = 1 << 24
MAX_RECORD_BYTES = 1 << 30
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
MAX_DELTA_DEPTH = 4


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
        return window_spans(
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
        return compressor().compress(self.to_json())

    @classmethod
    def from_object(cls, data: bytes) -> ArrayRecord:
        """A record from its stored object: compressed JSON, or plain JSON as written before."""
        if bytes(data[:4]) != _ZSTD_MAGIC:
            return cls.from_json(data)
        try:
            declared = zstandard.frame_content_size(data)
            if not 0 <= declared <= MAX_RECORD_BYTES:
                raise IntegrityError(f"array record declares {declared} bytes")
            text = decompressor().decompress(data, max_output_size=declared)
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
            want = num_windows(n, None if heads is None else heads[i], w)
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


def load_record(objs: ObjectStore, h: str) -> ArrayRecord:
    """The record stored as object `h`."""
    return ArrayRecord.from_object(objs.get(h))


def record_objects(objs: ObjectStore, record: ArrayRecord) -> set[str]:
    """Every object needed to read `record`, following delta bases (for GC marking)."""
    out = record.object_hashes()
    depth = 0
    while record.base is not None:
        depth += 1
        if depth > MAX_DELTA_DEPTH:
            raise IntegrityError(f"delta chain of record {record.meta} is too deep")
        record = load_record(objs, record.base)
        out |= record.object_hashes()
    return out


def check_same_geometry(base: ArrayRecord, rec: ArrayRecord) -> None:
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
