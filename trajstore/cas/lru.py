"""A thread-safe map of values bounded by their total size, least recently used out.

The in-process caches use it: decoded chunks per store (`chunk_cache`), encoded
windows per process (`array_write._EncodeCache`) and the REST server's payload bodies
(`api.payloads.BodyCache`, whose values size themselves).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any


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
    """At most `max_bytes` of values (each `size(value)` bytes: `len` for byte strings); a
    value over `max_bytes // item_fraction` is not kept (one huge value would otherwise
    evict everything)."""

    def __init__(
        self, max_bytes: int, item_fraction: int = 8, size: Callable[[Any], int] = len
    ) -> None:
        self.max_bytes = max_bytes
        self.item_fraction = item_fraction
        self._size = size
        self._d: OrderedDict[Hashable, Any] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def fits(self, size: int) -> bool:
        """Whether a value of `size` bytes would be kept."""
        return size <= self.max_bytes // self.item_fraction

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

    def add(self, key: Hashable, value: Any) -> None:
        self.add_many([(key, value)])

    def add_many(self, items: Iterable[tuple[Hashable, Any]]) -> None:
        """`add` of each (key, value) under one lock."""
        size, d = self._size, self._d
        with self._lock:
            for key, value in items:
                n = size(value)
                if not self.fits(n) or key in d:
                    continue
                d[key] = value
                self._bytes += n
                while self._bytes > self.max_bytes:
                    self._bytes -= size(d.popitem(last=False)[1])

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self._bytes = 0
