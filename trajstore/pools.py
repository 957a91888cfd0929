"""Thread pools kept per process: made on first use, made again in a forked child.

A forked child inherits a pool object whose threads do not exist there (and maybe
a lock some parent thread held), so each pool forgets both after a fork.
"""

from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

_pools: weakref.WeakSet[SharedPool] = weakref.WeakSet()


class SharedPool:
    """A lazily started `ThreadPoolExecutor` of `workers` threads named `prefix`-N."""

    def __init__(self, workers: int, prefix: str) -> None:
        self.workers = workers
        self.prefix = prefix
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        _pools.add(self)

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix=self.prefix)
            return self._pool

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._pool = None


def _after_fork_in_child() -> None:
    for pool in list(_pools):
        pool._forget()


os.register_at_fork(after_in_child=_after_fork_in_child)
