"""Reading CAS arrays: rows of a record fetched (batched, verified) and decoded straight
into the output, delta records resolved against their bases."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from trajstore.cas.array_record import (
    MAX_DELTA_DEPTH,
    ArrayRecord,
    check_same_geometry,
    load_record,
)
from trajstore.cas.chunk_cache import CHUNK_CACHE
from trajstore.cas.chunk_codec import decode_chunk
from trajstore.cas.objects import ObjectStore
from trajstore.errors import IntegrityError, UsageError


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
    if depth >= MAX_DELTA_DEPTH:
        raise IntegrityError(f"delta chain of array {record.meta} is too deep")
    base = load_record(objs, record.base)
    check_same_geometry(base, record)
    bbuf, bpresent, _ = _padded_windows(objs, base, rows, depth + 1)
    np.bitwise_xor(buf, bbuf, out=buf)
    return buf, present | bpresent, starts
