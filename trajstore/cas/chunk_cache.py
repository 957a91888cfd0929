"""Decoded chunks kept per open object store, and fetched + decoded on a few threads.

Replaying a step straight from the store also replays its rollout bundle (the
linkage check), and a step shares most of its payloads' chunks with that
rollout (rewards, old/ref log-probs, advantages of the same samples). Those
chunks were fetched, hash-checked and decoded moments before; doing it again
was a third of the step's payload reads. Here a chunk object decoded once is
kept (bounded by bytes, least recently used first out) and handed out again
without re-reading or re-hashing it: an object's name is the BLAKE3 of its
bytes, so what was verified stays valid for as long as this process holds it.

The cache belongs to one `ObjectStore` instance (a `Store` handle): a new
handle, as every command opens, verifies afresh. `CHUNK_CACHE.clear()` empties
every store's cache (benchmarks do it between runs).

Misses are fetched with `objs.get_many` (every object verified) and decoded
in batches on a small thread pool when there are many: zstd decompression and
BLAKE3 release the GIL, so a batch decodes while the next one is read.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from trajstore.cas.lru import BytesLRU
from trajstore.pools import SharedPool

#: decoded bytes kept per object store (a 256-sample x 1k-token bundle's chunks are ~25 MiB:
#: a step and its rollout fit)
MAX_BYTES = 64 << 20
#: chunks per pool task; fewer misses than two batches are fetched and decoded inline
BATCH = 128
_WORKERS = min(4, os.cpu_count() or 1)
#: the threads that fetch and decode batches of misses (made again in a forked child)
_pool = SharedPool(_WORKERS, "chunks")

Decoder = Callable[[bytes, int, str], bytes]


class ChunkCache:
    """Decoded, verified chunk objects per object store (see the module docstring)."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._stores: weakref.WeakKeyDictionary[Any, BytesLRU] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def _of(self, objs: Any) -> BytesLRU | None:
        with self._lock:
            try:
                c = self._stores.get(objs)
                if c is None:
                    c = self._stores[objs] = BytesLRU(self.max_bytes)
            except TypeError:  # not weak-referenceable: no cache
                return None
            return c

    def clear(self) -> None:
        with self._lock:
            stores = list(self._stores.values())
        for c in stores:
            c.clear()

    def decode_many(
        self, objs: Any, hashes: Sequence[str], size: int, decode: Decoder
    ) -> list[bytes]:
        """Decoded bytes of each chunk object in `hashes` (each `size` bytes once decoded).

        Cached chunks are handed out as they are; the others are fetched
        (hash-checked by `objs.get_many`), decoded with `decode(data, size, h)`
        (which raises on a bad frame) and kept.
        """
        cache = self._of(objs)
        out: list[bytes | None] = [None] * len(hashes)
        missing: list[int] = []
        for i, h in enumerate(hashes):
            v = None if cache is None else cache.get((h, size))
            if v is None:
                missing.append(i)
            else:
                out[i] = v
        if not missing:
            return out  # type: ignore[return-value]

        def fetch(idx: list[int]) -> list[bytes]:
            names = [hashes[i] for i in idx]
            return [decode(d, size, h) for h, d in zip(names, objs.get_many(names), strict=True)]

        batches = [missing[a : a + BATCH] for a in range(0, len(missing), BATCH)]
        if len(batches) < 2 or _WORKERS < 2:
            results = [fetch(b) for b in batches]
        else:
            pool = _pool.get()
            futures = [pool.submit(fetch, b) for b in batches]
            results = [f.result() for f in futures]
        for idx, got in zip(batches, results, strict=True):
            for i, raw in zip(idx, got, strict=True):
                out[i] = raw
                if cache is not None:
                    cache.add((hashes[i], size), raw)
        return out  # type: ignore[return-value]

    def _after_fork(self) -> None:
        # a forked child has none of the parent's threads: a cache lock held by one of
        # them would stay held (the pool is made again by SharedPool): start afresh
        self._lock = threading.Lock()
        self._stores = weakref.WeakKeyDictionary()


#: the process's decoded-chunk cache (one bounded cache per open object store)
CHUNK_CACHE = ChunkCache()
os.register_at_fork(after_in_child=CHUNK_CACHE._after_fork)
