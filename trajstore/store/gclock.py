"""The lock that keeps gc's rule true at any grace, `--grace 0` included (directory stores).

Why a lock: gc deletes objects no live ref reaches. An ingest writes its objects
before it publishes their ref, and it skips writing an object it believes stored
(its in-memory pack index, or a file seen earlier). So an object gc sees as garbage
may be about to be named by a ref. A grace period covers the first case only while
an ingest is shorter than the grace, and never the second (an old unreachable object
reused). With the lock:

- a writer (ingest of one target or of a batch, a cohort shard, a cohort's
  publication) holds it shared from before its first object to after its refs
  exist, and, if gc ran since it last looked, re-reads the object index first
  (`LocalObjectStore.rescan`), so it never trusts an object gc removed;
- fsck holds it shared too: a sweep between its listing and its checks would
  read as a missing object;
- gc holds it exclusive while it marks and sweeps, and bumps the generation first.

So no target is in flight while gc runs: every object gc may delete is unreachable
from refs that can still appear only after gc is done, and any writer after gc
re-checks what exists. A turnstile (`locks/gc.gate`) keeps a stream of writers from
starving gc: a waiting gc holds the gate, new writers queue behind it, the writers in
flight finish, gc runs, then the writers go on.

The locks are flock(2) locks on files in `<store>/locks/`: they hold between the
processes of a host, and between hosts where the file system carries them (Linux
NFS emulates flock with byte-range locks). An S3 store has no such lock: there the
grace period is the only protection (docs/store.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

from trajstore.cas import LocalObjectStore, ObjectStore

LOCKS_DIR = "locks"
GATE = "gc.gate"
LOCK = "gc.lock"

_state = threading.local()  # per thread: {root: depth} of the writer locks it holds
#: per object store instance: the gc generation its index was last re-read after (two
#: instances on one root in a process each keep their own cache, so each re-reads)
_seen: weakref.WeakKeyDictionary[LocalObjectStore, bytes] = weakref.WeakKeyDictionary()
_seen_mutex = threading.Lock()


def protects(objs: ObjectStore) -> bool:
    """Whether writers and gc of this object store take the lock (a directory store)."""
    return isinstance(objs, LocalObjectStore)


def _open(path: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)


def _depths() -> dict[str, int]:
    d = getattr(_state, "depths", None)
    if d is None:
        d = _state.depths = {}
    return d


@contextlib.contextmanager
def _lock_files(objs: LocalObjectStore) -> Iterator[tuple[int, int]]:
    """The turnstile and the lock file of `objs`, open (closing them releases any flock)."""
    d = objs.root / LOCKS_DIR
    gate = _open(d / GATE)
    try:
        lock = _open(d / LOCK)
    except BaseException:
        os.close(gate)
        raise
    try:
        yield gate, lock
    finally:
        os.close(lock)
        os.close(gate)


@contextlib.contextmanager
def writing(objs: ObjectStore) -> Iterator[None]:
    """Hold the store's writer lock (shared) around writing objects and publishing refs.

    Re-entrant within a thread (a shard store that publishes its cohort takes it
    once); a no-op for object stores without a directory (S3, memory).
    """
    if not protects(objs):
        yield
        return
    assert isinstance(objs, LocalObjectStore)
    root = str(objs.root)
    depths = _depths()
    if depths.get(root):
        _refresh(objs)  # another instance on this root may hold it: check this one's cache
        depths[root] += 1
        try:
            yield
        finally:
            depths[root] -= 1
        return
    with _lock_files(objs) as (gate, lock):
        fcntl.flock(gate, fcntl.LOCK_SH)  # queues behind a waiting gc
        fcntl.flock(lock, fcntl.LOCK_SH)
        fcntl.flock(gate, fcntl.LOCK_UN)
        _refresh(objs)
        depths[root] = 1
        try:
            yield
        finally:
            depths[root] = 0


def gc_waiting(objs: ObjectStore) -> bool:
    """Whether a gc holds the turnstile (it waits for the lock, or holds it): a writer
    holding the lock across several targets (a pipelined ingest's batch) then ends its
    batch, so gc waits for at most one target's write, as with one lock per target."""
    if not protects(objs):
        return False
    assert isinstance(objs, LocalObjectStore)
    try:
        fd = os.open(objs.root / LOCKS_DIR / GATE, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases a probe that succeeded
    return False


def _refresh(objs: LocalObjectStore) -> None:
    """Re-read `objs`'s index if gc ran since it last did (or it never did); the caller
    holds the writer lock, so no gc runs meanwhile."""
    try:
        gen = (objs.root / LOCKS_DIR / LOCK).read_bytes()
    except FileNotFoundError:
        gen = b""
    with _seen_mutex:
        stale = _seen.get(objs) != gen
    if stale:
        objs.rescan()
        with _seen_mutex:
            _seen[objs] = gen


@contextlib.contextmanager
def collecting(objs: ObjectStore) -> Iterator[None]:
    """Hold the store's gc lock (exclusive): waits for writers in flight, holds new ones
    back, and bumps the generation before anything is deleted. No-op without a directory."""
    if not protects(objs):
        yield
        return
    assert isinstance(objs, LocalObjectStore)
    with _lock_files(objs) as (gate, lock):
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX)
        # A fixed-width generation, rewritten in place: writers that see it change
        # re-read the object index. Written before any deletion, so a failure here
        # (a full disk) deletes nothing.
        os.pwrite(lock, f"{time.time_ns():020d}-{os.getpid():010d}\n".encode(), 0)
        yield
