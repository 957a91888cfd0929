"""A whole payload streamed as it is decoded: the cold download path.

The first download of a payload used to decode all of it (and parse the
bundle's index.json, whose loss masks dominate a long bundle's documents)
before sending a byte. Here the chunk objects are fetched and decoded in
batches on a small thread pool (zstd decompression and the object hash checks
release the GIL), a few batches ahead of the socket, and each batch is sent as
soon as it is ready.

Only the payload's array record is read, not index.json: the record and every
chunk object are hash-checked on fetch, so the bytes are the ones ingest
verified before publishing the bundle; a missing or damaged object fails the
request (the connection is cut: the body is already partly sent) and nothing
unverified is ever sent. Delta-encoded records (`record.base`) keep the old
path: resolving a delta needs its base's windows.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from itertools import islice

import numpy as np

from trajstore.cas.arrays import ArrayRecord, decode_chunks
from trajstore.cas.objects import ObjectStore
from trajstore.pools import SharedPool

from .payloads import as_npy_array

#: decoded bytes per batch (one pool task, one or more sent pieces)
BATCH_BYTES = 2 << 20
#: batches decoded ahead of the socket (bounds memory to about DEPTH * BATCH_BYTES)
DEPTH = 4
THREADS = min(4, os.cpu_count() or 1)
#: the decode threads (made again in a forked child, as a `--workers N` server may fork)
_POOL = SharedPool(THREADS, "decode")

#: one window of a row: its chunk object (None: fill, all zero) and its bytes in the output
Window = tuple[str | None, int]


def npy_header_for(shape: tuple[int, ...], dtype: np.dtype) -> bytes:
    """The .npy header of a C-order array of `shape` and `dtype` (no array is allocated)."""
    buf = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue()


def _windows(record: ArrayRecord) -> list[Window]:
    tb = record.token_bytes
    out: list[Window] = []
    for i, chunks in enumerate(record.chunks):  # row_spans: a format-2 row has two segments
        for h, (_, n) in zip(chunks, record.row_spans(i), strict=True):
            out.append((h, n * tb))
    return out


def _batches(windows: list[Window], limit: int, max_windows: int) -> list[list[Window]]:
    """Consecutive windows, a batch ending at `limit` bytes sent or `max_windows` decoded:
    a 1-token row sends 4 bytes but decodes a 16 KiB window, so sent bytes alone let one
    batch of 100,000 short rows decode 1.6 GB."""
    out: list[list[Window]] = [[]]
    size = 0
    for window in windows:
        if size >= limit or len(out[-1]) >= max_windows:
            out.append([])
            size = 0
        out[-1].append(window)
        size += window[1]
    return out


class StreamedPayload:
    """The body of a whole raw or .npy payload, decoded batch by batch on the pool."""

    def __init__(
        self, objs: ObjectStore, record: ArrayRecord, shape: tuple[int, ...], torch_dtype: str
    ) -> None:
        record.check()
        if record.base is not None:
            raise ValueError("a delta record is not streamed")
        self.objs = objs
        self.record = record
        self.shape = shape
        self.torch_dtype = torch_dtype
        self.widen = torch_dtype == "torch.bfloat16"
        self.nbytes = record.num_tokens * record.token_bytes

    def npy_header(self) -> bytes:
        dtype = np.dtype(np.float32) if self.widen else np.dtype(self.record.dtype)
        return npy_header_for(self.shape, dtype)

    def size(self, fmt: str) -> int:
        if fmt == "raw":
            return self.nbytes
        return len(self.npy_header()) + self.nbytes * (2 if self.widen else 1)

    def _decode(self, batch: list[Window], fmt: str) -> bytes:
        size = self.record.chunk_bytes
        wanted = list(dict.fromkeys(h for h, _ in batch if h is not None))
        views = decode_chunks(self.objs.get_many(wanted), size, wanted)
        decoded = dict(zip(wanted, views, strict=True))
        # one copy: a whole window joins as decoded, a row's last (short) one as a view
        raw = b"".join(
            bytes(n) if h is None else decoded[h] if n == len(decoded[h]) else decoded[h][:n]
            for h, n in batch
        )
        if fmt == "npy" and self.widen:
            bits = np.frombuffer(raw, dtype=np.uint16)
            return as_npy_array(bits, self.torch_dtype).tobytes()
        return raw

    def iter_bytes(self, fmt: str) -> Iterator[bytes]:
        """The body's bytes in order; at most DEPTH batches decode ahead of the consumer.

        The first DEPTH batches are submitted here, not at the first `next()`: they
        decode while the response's headers go out (a thread hop and an event-loop
        turn or two before the body is iterated). Batches of a body never iterated
        finish and are dropped (bounded: DEPTH batches).
        """
        per_batch = max(1, BATCH_BYTES // self.record.chunk_bytes)
        batches = iter(_batches(_windows(self.record), BATCH_BYTES, per_batch))
        pending: deque[Future[bytes]] = deque(
            _POOL.get().submit(self._decode, batch, fmt) for batch in islice(batches, DEPTH)
        )
        return self._sent(fmt, batches, pending)

    def _sent(
        self, fmt: str, batches: Iterator[list[Window]], pending: deque[Future[bytes]]
    ) -> Iterator[bytes]:
        try:
            if fmt == "npy":
                yield self.npy_header()
            while pending:
                piece = pending.popleft().result()
                for batch in islice(batches, DEPTH - 1 - len(pending)):
                    pending.append(_POOL.get().submit(self._decode, batch, fmt))
                yield piece
        finally:
            for future in pending:  # a client that went away: stop decoding for it
                future.cancel()


def start_threads() -> None:
    """Start the decode threads now (the pool starts them on demand, on a first
    download's critical path): each waits for all the others, so none is reused."""
    barrier = threading.Barrier(THREADS)

    def meet() -> None:
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=5)

    for future in [_POOL.get().submit(meet) for _ in range(THREADS)]:
        future.result()
