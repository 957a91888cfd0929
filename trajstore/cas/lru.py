"""A thread-safe map of byte strings bounded by their total size, least recently used out.

Both in-process caches of the object layer use it: decoded chunks per store
(`chunk_cache`) and encoded windows per process (`arrays._EncodeCache`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence


def touch_many(d: OrderedDict, keys: Sequence[Hashable | None]) -> list:
    """The value of each key in `d` (None for a None or absent key), each found one marked
    most recently used; the caller holds the lock that guards `d`."""
    out = []
    for key in keys:
        v = None if key is None else d.get(key)
        if v is not None:
            d.move_to_end(key)
        out.append(v)
    return out


class BytesLRU:
    """At most `max_bytes` of values; a value over `max_bytes // item_fraction` is not kept
    (one huge value would otherwise evict everything)."""

    def __init__(self, max_bytes: int, item_fraction: int = 8) -> None:
        self.max_bytes = max_bytes
        self.item_fraction = item_fraction
        self._d: OrderedDict[Hashable, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> bytes | None:
        with self._lock:
            v = self._d.get(key)
            if v is not None:
                self._d.move_to_end(key)
            return v

    def get_many(self, keys: Sequence[Hashable | None]) -> list[bytes | None]:
        """`get` of each key under one lock (None for a None key)."""
        with self._lock:
            return touch_many(self._d, keys)

    def add(self, key: Hashable, value: bytes) -> None:
        if len(value) > self.max_bytes // self.item_fraction:
            return
        with self._lock:
            if key in self._d:
                return
            self._d[key] = value
            self._bytes += len(value)
            while self._bytes > self.max_bytes:
                self._bytes -= len(self._d.popitem(last=False)[1])

    def add_many(self, items: Iterable[tuple[Hashable, bytes]]) -> None:
        """`add` of each (key, value) under one lock."""
        limit = self.max_bytes // self.item_fraction
        d = self._d
        with self._lock:
            for key, value in items:
                if len(value) > limit or key in d:
                    continue
                d[key] = value
                self._bytes += len(value)
                while self._bytes > self.max_bytes:
                    self._bytes -= len(d.popitem(last=False)[1])

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self._bytes = 0
