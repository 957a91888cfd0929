"""One packed object store over a raw backend (a store directory, an S3 bucket).

Small objects (< `pack_threshold`) are buffered and sealed into one pack by
`flush()` (or once `pack_max_bytes` are buffered); large ones are written
loose. A pack is published by writing its index after its body, so a pack
without an index is garbage, never half-visible. Writers in many processes
and hosts need no lock: pack ids are unique and every write is whole or
absent. A hash not known here triggers a listing of `packs/`, so other
writers' packs become visible. Thread-safe within a process.

Pack indexes can be kept in a local `index_cache` (an S3 store's): an open
then loads them and lists only the pack names since the newest of them
(`trajstore.listing`), and a pack known only from the cache is confirmed (one
existence check of its index) before it spares a write, as gc may have
rewritten it since.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from trajstore.cas.backend import Backend
from trajstore.cas.objects import (
    HASH_RE,
    ObjectInfo,
    ObjectStore,
    RepackResult,
    check_hash,
    object_hash,
    verified,
)
from trajstore.cas.packs import PACK_MAGIC, IndexCache, PackSet, loose_key, pack_key, read_runs
from trajstore.errors import IntegrityError, NotFoundError, StoreError, TrajstoreError

__all__ = ["PackedObjectStore"]

_T = TypeVar("_T")
_R = TypeVar("_R")


class PackedObjectStore(ObjectStore):
    """Objects through `backend`: `packs/<id>.pack` + `.idx`, loose `objects/<h[:2]>/<h>`."""

    def __init__(
        self,
        backend: Backend,
        *,
        pack_threshold: int,
        pack_max_bytes: int,
        index_cache: Path | None = None,
    ) -> None:
        self.backend = backend
        self.pack_threshold = pack_threshold
        self.pack_max_bytes = pack_max_bytes
        self._lock = threading.RLock()
        # Serializes flushes; taken before `_lock`, never while holding it. A flush writes
        # its pack outside `_lock`, so writers keep hashing and buffering meanwhile.
        self._flush_lock = threading.Lock()
        #: which pack holds each object (pack indexes are immutable: with `index_cache`, kept
        #: in that local directory, so an open fetches only new packs' indexes)
        self.packs = PackSet(backend, None if index_cache is None else IndexCache(index_cache))
        self._index = self.packs.locs  # hash -> where its packed copy lies
        self._loose: set[str] = set()
        self._pending: dict[str, bytes] = {}
        self._pending_bytes = 0
        #: objects a flush is writing into a pack right now (still readable from here)
        self._sealing: dict[str, bytes] = {}
        self._sealing_bytes = 0
        #: pack indexes that failed their checksum; their objects read as missing
        self.corrupt_indexes = self.packs.corrupt
        with self._lock:
            self.packs.open()

    @property
    def listed(self) -> int:
        """Names returned by listing requests so far (what a command pays for listing)."""
        return self.backend.listed

    def _map(self, fn: Callable[[_T], _R], items: list[_T]) -> list[_R]:
        """`fn` over `items`, on the backend's parallel requests where it has them."""
        if self.backend.concurrency <= 1 or len(items) <= 1:
            return [fn(x) for x in items]
        with ThreadPoolExecutor(min(self.backend.concurrency, len(items))) as pool:
            return list(pool.map(fn, items))

    # -- writing --

    def put(self, data: bytes) -> str:
        return self.put_many([data])[0]

    def put_many(self, datas: Iterable[bytes]) -> list[str]:
        return [h for h, _ in self.put_many_added(datas)]

    def put_many_added(self, datas: Iterable[bytes]) -> list[tuple[str, bool]]:
        # Hashed before taking the lock: concurrent writers hash at once (BLAKE3 releases
        # the GIL); the buffer is sealed into a pack outside the lock too (`flush`).
        named = [(object_hash(d), d) for d in datas]
        added: list[bool] = []
        for h, d in named:
            with self._lock:
                added.append(self._put(h, d))
                # buffered and being sealed together stay within pack_max_bytes (+ an
                # object per writer): a writer past it waits for the seal in flight
                full = self._pending_bytes + self._sealing_bytes >= self.pack_max_bytes
            if full:
                with self._flush_lock:  # after the seal in flight, if still over
                    with self._lock:
                        over = self._pending_bytes >= self.pack_max_bytes
                    if over:
                        self._seal()
        return [(h, a) for (h, _), a in zip(named, added, strict=True)]

    def _put(self, h: str, data: bytes) -> bool:
        """Buffer or write `h` unless held; whether it was stored here (caller locks)."""
        if self._holds(h):
            return False
        if len(data) >= self.pack_threshold:
            return self._write_loose(h, data)
        self._pending[h] = bytes(data)
        self._pending_bytes += len(data)
        return True

    def _buffered(self, h: str) -> bytes | None:
        """The bytes of `h` if buffered or being sealed (caller locks)."""
        data = self._pending.get(h)
        return self._sealing.get(h) if data is None else data

    def _known(self, h: str) -> bool:
        """Held, known without any I/O: buffered, being sealed, loose or in a confirmed pack."""
        known = h in self._pending or h in self._sealing or h in self._loose
        return known or self.packs.known(h)

    def _holds(self, h: str) -> bool:
        """Buffered, being sealed, loose or packed (caller locks)."""
        return self._known(h) or self.packs.holds(h)

    def _write_loose(self, h: str, data: bytes) -> bool:
        """Write loose object `h` unless it exists; whether it was written."""
        key = loose_key(h)
        written = not self.backend.exists(key)
        if written:
            self.backend.write(key, [data])
            self.backend.sync(key.rsplit("/", 1)[0])
        self._loose.add(h)
        return written

    def flush(self) -> None:
        """Seal buffered small objects into one pack (no-op when nothing is buffered).

        On return every object put before the call is durable. The pack is written
        outside the store's lock: other threads keep putting (into a new buffer) and
        reading (the objects being sealed stay readable) meanwhile.
        """
        with self._flush_lock:
            self._seal()

    def _seal(self) -> None:
        """Write the buffered objects as one pack (the caller holds `_flush_lock`)."""
        with self._lock:
            if not self._pending:
                return
            items = list(self._pending.items())
            self._sealing, self._pending = self._pending, {}
            self._sealing_bytes = self._pending_bytes
            self._pending_bytes = 0
        pid = None
        try:
            pid, entries = self.packs.publish_pack(items)
        finally:
            with self._lock:
                if pid is None:  # not published (e.g. a full disk): buffered again
                    for h, d in items:
                        if h not in self._pending:
                            self._pending[h] = d
                            self._pending_bytes += len(d)
                else:
                    self.packs.add_written(pid, [h for h, _ in items], entries)
                self._sealing = {}
                self._sealing_bytes = 0

    def _write_pack(self, items: list[tuple[str, bytes]]) -> str:
        pid, entries = self.packs.publish_pack(items)
        self.packs.add_written(pid, [h for h, _ in items], entries)
        return pid

    # -- discovering packs --

    def rescan(self) -> None:
        """List every pack: load those published since, forget removed ones, and forget
        the loose names seen (gc may have removed them; they are checked again on use)."""
        with self._lock:
            self._loose.clear()
            self.packs.rescan()

    # -- reading --

    def _fetch(
        self, pid: str, items: list[tuple[int, int, int]], hashes: list[str], out: list
    ) -> None:
        """Objects (offset, length, slot) of one pack into `out`, each verified: few reads
        of merged ranges. Nothing if the pack is gone (the caller lists and retries)."""
        runs = read_runs(items)
        key = pack_key(pid, ".pack")
        try:
            got = self.backend.read_ranges(key, [r[0] for r in runs], [r[1] for r in runs])
        except FileNotFoundError:
            return
        where = self.backend.where(key)
        for (start, _, members), run in zip(runs, got, strict=True):
            view = memoryview(run)
            for off, ln, i in members:
                data = view[off - start : off - start + ln]
                if len(data) != ln:
                    raise IntegrityError(f"object {hashes[i]} is truncated in {where}")
                verified(hashes[i], data, where)  # every object, a run's only one too
                alone = len(members) == 1 and isinstance(run, bytes)
                out[i] = run if alone else data.tobytes()

    def _read_loose(self, h: str) -> bytes | None:
        key = loose_key(h)
        data = self.backend.read(key)
        if data is None:
            return None
        self._loose.add(h)
        return verified(h, data, self.backend.where(key))

    def _get_stored(self, hashes: list[str], out: list, *, pending: bool) -> None:
        by_pack: dict[str, list[tuple[int, int, int]]] = {}
        with self._lock:
            for i, h in enumerate(hashes):
                if out[i] is not None:
                    continue
                data = self._buffered(h) if pending else None
                if data is not None:
                    out[i] = data
                    continue
                loc = self._index.get(h)
                if loc is not None:
                    by_pack.setdefault(loc.pack, []).append((loc.offset, loc.length, i))
        for pid, items in by_pack.items():
            self._fetch(pid, items, hashes, out)
        rest = [i for i, d in enumerate(out) if d is None]
        for i, data in zip(
            rest, self._map(lambda i: self._read_loose(hashes[i]), rest), strict=True
        ):
            out[i] = data

    def get_many(self, hashes: Sequence[str], *, pending: bool = True) -> list[bytes]:
        """Each object verified; per pack, few reads of only the bytes needed. `pending`:
        objects still buffered here are answered from the buffer."""
        hashes = [check_hash(h) for h in hashes]
        out: list[bytes | None] = [None] * len(hashes)
        self._get_stored(hashes, out, pending=pending)
        if any(d is None for d in out):
            self.rescan()
            self._get_stored(hashes, out, pending=pending)
        for h, d in zip(hashes, out, strict=True):
            if d is None:
                raise NotFoundError(f"object {h} not found in {self.backend.label}")
        return out  # type: ignore[return-value]

    def get(self, h: str) -> bytes:
        return self.get_many([h])[0]

    def has_cached(self, h: str, size: int) -> bool:
        with self._lock:
            return self._known(h)

    def has(self, h: str) -> bool:
        if not isinstance(h, str) or not HASH_RE.match(h):
            return False
        with self._lock:
            if self._holds(h):
                return True
        if self.backend.exists(loose_key(h)):
            self._loose.add(h)
            return True
        self.rescan()
        return h in self._index

    def missing(self, hashes: Iterable[str]) -> set[str]:
        """As `ObjectStore.missing`: the pack indexes of a full listing, then, for the names
        none of them holds, the loose objects (a stat each locally, one listing on S3). A
        buffered object is not stored yet, so it counts as missing; so does a pack's object
        whose index is lost or corrupt."""
        with self._lock:
            self.rescan()
            rest = set(hashes) - self._index.keys()
        keys = {loose_key(h): h for h in rest if HASH_RE.match(h)}
        return rest - {keys[k] for k in self.backend.existing(keys, "objects")}

    def _verify_stored(self, hashes: list[str]) -> None:
        """Read the stored copies (never the write buffer), with no flush in flight."""
        with self._flush_lock:
            self.get_many(hashes, pending=False)

    def verify(self, h: str) -> None:
        """Re-read the stored copy (never the write buffer) and check it against `h`; an
        object only buffered so far passes."""
        try:
            self._verify_stored([check_hash(h)])
        except NotFoundError:
            with self._lock:
                if h not in self._pending:
                    raise

    def verify_many(self, hashes: Sequence[str]) -> dict[str, str]:
        """As `ObjectStore.verify_many`, batched reads per pack; a batch that fails is
        verified again one object at a time to name every bad one."""
        problems: dict[str, str] = {}
        hashes = list(hashes)
        for start in range(0, len(hashes), 2048):
            batch = hashes[start : start + 2048]
            try:
                self._verify_stored(batch)
            except TrajstoreError:
                problems.update(super().verify_many(batch))
        return problems

    def iter_objects(self) -> Iterator[ObjectInfo]:
        """Stored copies (buffered objects are not yet stored), with the backend's times."""
        with self._lock:
            self.rescan()
            packs = {
                pid: (list(m), self.packs.entries[pid]) for pid, m in self.packs.members.items()
            }
        listing = {e.key: e for e in self.backend.entries("packs")}
        for pid in sorted(packs):
            where = pack_key(pid, ".pack")
            meta = listing.get(where)
            if meta is None:
                continue
            members, entries = packs[pid]
            for h, ln in zip(members, entries["len"].tolist(), strict=True):
                yield ObjectInfo(h, ln, meta.mtime, where)
        yield from self._iter_loose()

    def _iter_loose(self) -> Iterator[ObjectInfo]:
        for e in self.backend.entries("objects"):
            name = e.key.rsplit("/", 1)[-1]
            if HASH_RE.match(name):
                yield ObjectInfo(name, e.size, e.mtime, e.key)

    # -- removing --

    def delete_many(self, hashes: Iterable[str]) -> int:
        drop = {check_hash(h) for h in hashes}
        with self._flush_lock, self._lock:
            self.rescan()
            n = 0
            for h in drop:
                data = self._pending.pop(h, None)
                if data is not None:
                    self._pending_bytes -= len(data)
                    n += 1
                if h in self._loose or self.backend.exists(loose_key(h)):
                    self.backend.delete(loose_key(h))
                    n += 1
                self._loose.discard(h)
            lost: set[str] = set()
            for pid in list(self.packs.members):
                if not drop.isdisjoint(self.packs.members[pid]):
                    n += self._rewrite_pack(pid, lambda h: h not in drop, lost).objects_dropped
            self.packs.repoint(lost)
            return n

    def _rewrite_pack(self, pid: str, keep: Callable[[str], bool], lost: set[str]) -> RepackResult:
        members = self.packs.members[pid]
        kept = [h for h in members if keep(h)]
        if len(kept) == len(members):
            return RepackResult()
        entries = self.packs.entries[pid]
        size = len(PACK_MAGIC) + int(entries["len"].sum())
        keep_set = set(kept)
        want: list[tuple[int, int, int]] = []
        hashes: list[str] = []
        for h, off, ln in zip(
            members, entries["off"].tolist(), entries["len"].tolist(), strict=True
        ):
            if h in keep_set:
                keep_set.discard(h)  # one copy each
                want.append((off, ln, len(hashes)))
                hashes.append(h)
        datas: list[bytes | None] = [None] * len(hashes)
        if want:
            # Verified: a corrupt kept object stops gc rather than being copied or lost.
            self._fetch(pid, want, hashes, datas)
            if any(d is None for d in datas):
                raise StoreError(f"pack {pid} vanished while gc rewrote it; run gc again")
            self._write_pack(list(zip(hashes, datas, strict=True)))  # type: ignore[arg-type]
        # The new copies are visible before the old ones go.
        self.backend.delete(pack_key(pid, ".idx"))
        lost |= self.packs.forget(pid)
        self.backend.delete(pack_key(pid, ".pack"))
        self.backend.sync("packs")
        new_size = len(PACK_MAGIC) + sum(len(d or b"") for d in datas) if datas else 0
        return RepackResult(1, len(members) - len(kept), size - new_size, 2)

    def repack(self, keep: Callable[[str], bool], older_than: float) -> RepackResult:
        """GC primitive: drop objects `keep` rejects, but only from files older than `older_than` s.

        Packs holding such objects are rewritten with the kept ones (never
        dropping a kept object: new pack published before the old is
        removed); loose objects are deleted; packs without an index and
        stale temp files older than the grace are removed. The policy (what
        to keep, how long a grace protects unpublished writes) is the caller's.
        """
        cutoff = time.time() - older_than
        total = RepackResult()
        with self._lock:
            self.rescan()
            listing = self.backend.entries("packs")
            pack_times: dict[str, float] = {}
            indexed: set[str] = set()
            for e in listing:
                stem, _, ext = e.key.rsplit("/", 1)[-1].rpartition(".")
                if ext == "pack":
                    pack_times[stem] = e.mtime
                elif ext == "idx":
                    indexed.add(stem)
            lost: set[str] = set()
            for pid in sorted(self.packs.members):
                if pack_times.get(pid, cutoff) < cutoff:
                    total += self._rewrite_pack(pid, keep, lost)
            self.packs.repoint(lost)
            for info in list(self._iter_loose()):
                if info.mtime < cutoff and not keep(info.hash):
                    self.backend.delete(info.location)
                    self._loose.discard(info.hash)
                    total += RepackResult(0, 1, info.size, 1)
            for e in listing:  # packs whose index was never written (a crashed writer)
                stem, _, ext = e.key.rsplit("/", 1)[-1].rpartition(".")
                orphan = ext == "pack" and stem not in indexed and e.mtime < cutoff
                if orphan and not self.backend.exists(pack_key(stem, ".idx")):
                    self.backend.delete(e.key)
                    total += RepackResult(0, 0, e.size, 1)
            files, freed = self.backend.remove_stale_temp(cutoff)
            total += RepackResult(0, 0, freed, files)
        return total

    def close(self) -> None:
        self.flush()
        with self._lock:
            self.backend.close()
