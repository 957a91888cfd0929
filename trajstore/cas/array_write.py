"""Writing CAS arrays: a ragged payload windowed per row, each window encoded once
(`ENCODE_CACHE`) and stored as a content-addressed chunk, deltas XOR'ed against a base."""

from __future__ import annotations

import itertools
import json
import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from blake3 import blake3

from trajstore.cas import chunk_codec
from trajstore.cas.array_read import read_array
from trajstore.cas.array_record import ArrayRecord, check_same_geometry
from trajstore.cas.chunk_codec import DTYPES, chunk_tokens_for, encode_chunk, num_windows
from trajstore.cas.lru import BytesLRU, touch_many
from trajstore.cas.objects import ObjectStore
from trajstore.errors import UsageError

#: windows encoded and put per batch by `write_array` (bounds its memory, not the payload)
WRITE_BATCH_BYTES = 64 << 20


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
            {"name": "zstd", "configuration": {"level": chunk_codec.ZSTD_LEVEL, "checksum": False}},
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
    suffix = size.to_bytes(8, "little") + chunk_codec.ZSTD_LEVEL.to_bytes(2, "little", signed=True)
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
                (None,) * num_windows(n, None if head_t is None else head_t[i], w)
                for i, n in enumerate(lengths)
            ),
            heads=head_t,
        )
        check_same_geometry(base, probe)
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
        num_windows(n, None if head_t is None else head_t[i], w) for i, n in enumerate(lengths)
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
