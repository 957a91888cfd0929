"""Content-addressed object space: immutable byte strings named by their BLAKE3 hash.

`ObjectStore` is the interface the rest of trajstore (and a later S3 backend)
programs against. `LocalObjectStore` keeps objects in a directory: small ones
packed (per-object overhead would otherwise dominate: a 4 KiB chunk as its own
file costs a syscall storm and a 4 KiB+ inode), large ones as loose files.
`MemoryObjectStore` is a dict, for tests and scratch work.

Every read is verified against the name, so corruption is a clear
IntegrityError naming the object, never wrong numbers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np
from blake3 import blake3

from trajstore.errors import IntegrityError, NotFoundError, StoreError, TrajstoreError

__all__ = [
    "LocalObjectStore",
    "MemoryObjectStore",
    "ObjectInfo",
    "ObjectStore",
    "RepackResult",
    "check_hash",
    "object_hash",
]

log = logging.getLogger(__name__)

_HASH_RE = re.compile(r"[0-9a-f]{64}\Z")


def object_hash(data: bytes | bytearray | memoryview) -> str:
    """The name of an object: BLAKE3 hex digest (64 lowercase hex chars) of its bytes."""
    return blake3(data).hexdigest()


def check_hash(h: object) -> str:
    """Return `h` if it is a well-formed object name; refuse anything else (e.g. paths)."""
    if not isinstance(h, str) or not _HASH_RE.match(h):
        raise NotFoundError(f"not an object hash: {str(h)[:80]!r}")
    return h


def _verified(h: str, data: bytes, where: str) -> bytes:
    if blake3(data).digest() != bytes.fromhex(h):
        actual = object_hash(data)
        raise IntegrityError(f"object {h} is corrupt ({where}): its content hashes to {actual}")
    return data


#: Batched pack reads merge objects closer than this into one pread.
_READ_GAP = 64 << 10
_READ_SPAN = 16 << 20


@dataclass(frozen=True)
class ObjectInfo:
    """One stored copy of an object. `location` is backend-specific (a relative path here)."""

    hash: str
    size: int
    mtime: float
    location: str


@dataclass(frozen=True)
class RepackResult:
    """What a `repack` pass changed, for GC reporting."""

    packs_rewritten: int = 0
    objects_dropped: int = 0
    bytes_freed: int = 0
    files_removed: int = 0


class ObjectStore(ABC):
    """Immutable, verified, write-if-absent bytes keyed by BLAKE3.

    Writes may be buffered: an object is durable after `flush()` (or leaving
    the context manager), and visible to this instance at once.
    """

    @abstractmethod
    def put(self, data: bytes) -> str:
        """Store `data` if absent; return its hash. Cheap when already present."""

    def put_many(self, datas: Iterable[bytes]) -> list[str]:
        return [self.put(d) for d in datas]

    def put_many_added(self, datas: Iterable[bytes]) -> list[tuple[str, bool]]:
        """Store each of `datas` if absent: (hash, whether this call stored it) per item.

        What ingest records as the bytes a bundle *added* (the rest it references were
        already stored). Backends answer under the lock that decides the write; this
        default asks `has` first (two writers racing may both count an object).
        """
        out: list[tuple[str, bool]] = []
        seen: set[str] = set()
        for d in datas:
            h = object_hash(d)
            new = h not in seen and not self.has(h)
            seen.add(h)
            out.append((self.put(d), new))
        return out

    @abstractmethod
    def get(self, h: str) -> bytes:
        """Bytes of object `h`, verified. NotFoundError if absent, IntegrityError if corrupt."""

    def get_many(self, hashes: Sequence[str]) -> list[bytes]:
        return [self.get(h) for h in hashes]

    @abstractmethod
    def has(self, h: str) -> bool:
        """Whether `h` is stored (a buffered object counts)."""

    def has_cached(self, h: str, size: int) -> bool:
        """Whether `h` is stored, known without any I/O (False when unsure): a writer may
        then skip encoding and putting it. `size` (its length) is for wrappers that
        account the bytes a writer names."""
        return False

    @abstractmethod
    def iter_objects(self) -> Iterator[ObjectInfo]:
        """Every stored copy (a hash may appear more than once after concurrent writes)."""

    @abstractmethod
    def delete_many(self, hashes: Iterable[str]) -> int:
        """Remove every copy of these objects now; return the number of copies removed.

        No grace period: this is the primitive a GC policy calls, not a policy.
        """

    def missing(self, hashes: Iterable[str]) -> set[str]:
        """Those of `hashes` that no stored copy holds: what gc checks the live set against
        before it deletes anything. Backends answer from their object index and one listing,
        not a read per object; the default asks `has` for each."""
        return {h for h in set(hashes) if not self.has(h)}

    def verify(self, h: str) -> None:
        """Raise IntegrityError (naming `h`) unless the stored copy matches its hash."""
        self.get(h)

    def verify_many(self, hashes: Sequence[str]) -> dict[str, str]:
        """Verify each object; return the problem (one line) of each that fails, by hash.

        Backends whose reads cost a request (S3) batch this; the default verifies one by one.
        """
        problems: dict[str, str] = {}
        for h in hashes:
            try:
                self.verify(h)
            except TrajstoreError as e:
                problems[h] = str(e)
        return problems

    def flush(self) -> None:
        """Make every buffered object durable. No-op for unbuffered backends."""
        return None

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # On error, still seal what was written: objects are immutable and
        # unreferenced ones are ordinary garbage for GC.
        self.close()


class MemoryObjectStore(ObjectStore):
    """Objects in a dict. Reads are verified like any backend (tests corrupt `data`)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self._mtime: dict[str, float] = {}

    def put(self, data: bytes) -> str:
        return self.put_many_added([data])[0][0]

    def put_many_added(self, datas: Iterable[bytes]) -> list[tuple[str, bool]]:
        out = []
        for data in datas:
            h = object_hash(data)
            new = h not in self.data
            if new:
                self.data[h] = bytes(data)
                self._mtime[h] = time.time()
            out.append((h, new))
        return out

    def get(self, h: str) -> bytes:
        try:
            data = self.data[check_hash(h)]
        except KeyError:
            raise NotFoundError(f"object {h} not found in memory store") from None
        return _verified(h, data, "memory")

    def has(self, h: str) -> bool:
        return h in self.data

    def iter_objects(self) -> Iterator[ObjectInfo]:
        for h, d in list(self.data.items()):
            yield ObjectInfo(h, len(d), self._mtime.get(h, 0.0), "memory")

    def delete_many(self, hashes: Iterable[str]) -> int:
        n = 0
        for h in hashes:
            if self.data.pop(h, None) is not None:
                self._mtime.pop(h, None)
                n += 1
        return n


# --- local directory backend ------------------------------------------------

_PACK_MAGIC = b"TSPACK\x00\x01"
_IDX_MAGIC = b"TSIDX\x00\x00\x01"
_IDX_ENTRY = np.dtype([("h", "V32"), ("off", "<u8"), ("len", "<u8")])
_PACK_ID_RE = re.compile(r"[0-9a-f]+-[0-9a-f]+-[0-9a-f]+\Z")


def _new_pack_id() -> str:
    # Unique across processes without a lock; hex time first so ids sort by age.
    return f"{time.time_ns():016x}-{os.getpid():x}-{secrets.token_hex(6)}"


def _encode_pack(items: list[tuple[str, bytes]]) -> tuple[list[bytes], bytes, np.ndarray]:
    """A pack of `items` (hash, bytes): its pieces in order, its index object (body +
    BLAKE3 checksum) and the index entries. Both object stores write this one format."""
    entries = np.empty(len(items), dtype=_IDX_ENTRY)
    off = len(_PACK_MAGIC)
    for i, (h, d) in enumerate(items):
        entries[i] = (bytes.fromhex(h), off, len(d))
        off += len(d)
    body = _IDX_MAGIC + np.uint64(len(items)).tobytes() + entries.tobytes()
    return [_PACK_MAGIC, *(d for _, d in items)], body + blake3(body).digest(), entries


def _decode_pack_index(raw: bytes, pack_size: int | None = None) -> np.ndarray | None:
    """The entries of a pack index object (a view of `raw`), or None unless its magic,
    length and checksum hold and, given `pack_size`, every entry lies inside the pack."""
    body, digest = raw[:-32], raw[-32:]
    ok = len(raw) >= 48 and body[:8] == _IDX_MAGIC and blake3(body).digest() == digest
    if ok:
        n = int(np.frombuffer(body, "<u8", 1, 8)[0])
        ok = len(body) == 16 + n * _IDX_ENTRY.itemsize
    if not ok:
        return None
    entries = np.frombuffer(body, _IDX_ENTRY, n, 16)
    if pack_size is not None:
        # off + len in uint64 wraps around; compare without adding.
        lens = entries["len"]
        inside = bool((lens <= pack_size).all()) and bool(
            (entries["off"] <= np.uint64(pack_size) - lens).all()
        )
        if not inside:
            return None
    return entries


@dataclass(frozen=True)
class _Loc:
    pack: str
    offset: int
    length: int


class LocalObjectStore(ObjectStore):
    """Objects under `root`: `packs/<id>.pack` + `packs/<id>.idx`, loose `objects/<h[:2]>/<h>`.

    Small objects (< `pack_threshold`) are buffered and sealed into one pack
    by `flush()` (or automatically once `pack_max_bytes` are buffered). A pack
    is published by renaming its index last, so a pack without an index is
    garbage, never half-visible. Writers in several processes need no lock:
    pack ids are unique and loose objects are renamed into place. A hash not
    found in memory triggers a rescan of `packs/`, so another process's
    objects become visible. Thread-safe within a process.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        pack_threshold: int = 1 << 20,
        pack_max_bytes: int = 128 << 20,
        durable: bool = True,
        max_open_packs: int = 64,
    ) -> None:
        self.root = Path(root)
        self.pack_threshold = pack_threshold
        self.pack_max_bytes = pack_max_bytes
        self.durable = durable
        self._objects_dir = self.root / "objects"
        self._packs_dir = self.root / "packs"
        self._tmp_dir = self.root / "tmp"
        try:
            for d in (self._objects_dir, self._packs_dir, self._tmp_dir):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot use {self.root} as an object store: {e}") from None
        self._lock = threading.RLock()
        # Serializes flushes; taken before `_lock`, never while holding it. A flush writes
        # its pack outside `_lock`, so writers keep hashing and buffering meanwhile.
        self._flush_lock = threading.Lock()
        self._index: dict[str, _Loc] = {}
        self._members: dict[str, list[str]] = {}  # pack id -> hashes in it
        self._loose: set[str] = set()
        self._pending: dict[str, bytes] = {}
        self._pending_bytes = 0
        #: objects a flush is writing into a pack right now (still readable from here)
        self._sealing: dict[str, bytes] = {}
        self._sealing_bytes = 0
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._max_fds = max_open_packs
        #: idx files that failed their checksum; their objects read as missing.
        self.corrupt_indexes: list[Path] = []
        self.rescan()

    def __repr__(self) -> str:
        return f"LocalObjectStore({str(self.root)!r})"

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

    def _holds(self, h: str) -> bool:
        """Known here without I/O: buffered, being sealed, packed or loose (caller locks)."""
        return h in self._pending or h in self._sealing or h in self._index or h in self._loose

    def _loose_path(self, h: str) -> Path:
        return self._objects_dir / h[:2] / h

    def _tmp_path(self, suffix: str) -> Path:
        return self._tmp_dir / f"{os.getpid():x}-{secrets.token_hex(8)}{suffix}"

    def _write_file(self, final: Path, chunks: Iterable[bytes]) -> None:
        """temp + fsync + rename: the final name never holds a partial file."""
        tmp = self._tmp_path(final.suffix or ".obj")
        try:
            with open(tmp, "wb") as f:
                for c in chunks:
                    f.write(c)
                if self.durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _fsync_dir(self, d: Path) -> None:
        if self.durable:
            fd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _write_loose(self, h: str, data: bytes) -> bool:
        """Write loose object `h` unless its file exists; whether it was written."""
        path = self._loose_path(h)
        written = not path.exists()
        if written:
            path.parent.mkdir(exist_ok=True)
            self._write_file(path, [data])
            self._fsync_dir(path.parent)
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
            pid, entries = self._write_pack_files(items)
        finally:
            with self._lock:
                if pid is None:  # not published (e.g. a full disk): buffered again
                    for h, d in items:
                        if h not in self._pending:
                            self._pending[h] = d
                            self._pending_bytes += len(d)
                else:
                    self._add_pack(pid, items, entries)
                self._sealing = {}
                self._sealing_bytes = 0

    def _write_pack(self, items: list[tuple[str, bytes]]) -> str:
        pid, entries = self._write_pack_files(items)
        self._add_pack(pid, items, entries)
        return pid

    def _add_pack(self, pid: str, items: list[tuple[str, bytes]], entries: np.ndarray) -> None:
        members = [h for h, _ in items]
        for (h, _), e in zip(items, entries, strict=True):
            self._index[h] = _Loc(pid, int(e["off"]), int(e["len"]))
        self._members[pid] = members

    def _write_pack_files(self, items: list[tuple[str, bytes]]) -> tuple[str, np.ndarray]:
        """Write and publish a pack of `items` (durable on return); its id and entries."""
        pid = _new_pack_id()
        pieces, idx, entries = _encode_pack(items)
        self._write_file(self._packs_dir / f"{pid}.pack", pieces)
        # The idx rename is the commit point of the pack.
        try:
            self._write_file(self._packs_dir / f"{pid}.idx", [idx])
        except BaseException:  # e.g. a full disk: the pack was never published, free it now
            (self._packs_dir / f"{pid}.pack").unlink(missing_ok=True)
            raise
        self._fsync_dir(self._packs_dir)
        return pid, entries

    # -- discovering packs --

    def rescan(self) -> None:
        """Load indexes of packs published since the last scan; forget removed packs
        and the loose names seen (gc may have removed them; they are re-stat'ed on use)."""
        with self._lock:
            self._loose.clear()
            try:
                names = os.listdir(self._packs_dir)
            except OSError as e:
                raise StoreError(f"cannot list {self._packs_dir}: {e}") from None
            present = {n[:-4] for n in names if n.endswith(".idx") and _PACK_ID_RE.match(n[:-4])}
            lost: set[str] = set()
            for pid in list(self._members):
                if pid not in present:
                    lost |= self._forget_pack(pid)
            for pid in sorted(present - self._members.keys()):
                self._load_idx(pid)
            self._repoint(lost)

    def _forget_pack(self, pid: str) -> set[str]:
        """Drop a pack from memory; return hashes whose indexed copy was in it."""
        lost = set()
        for h in self._members.pop(pid, []):
            loc = self._index.get(h)
            if loc is not None and loc.pack == pid:
                del self._index[h]
                lost.add(h)
        fd = self._fds.pop(pid, None)
        if fd is not None:
            os.close(fd)
        return lost

    def _repoint(self, lost: set[str]) -> None:
        """Index another pack's copy of objects whose indexed copy went away."""
        lost -= self._index.keys()
        if not lost:
            return
        for pid, members in self._members.items():
            if lost.isdisjoint(members):
                continue
            entries = self._read_idx(pid)
            if entries is None:
                continue
            for h, off, ln in zip(
                members, entries["off"].tolist(), entries["len"].tolist(), strict=True
            ):
                if h in lost:
                    self._index[h] = _Loc(pid, off, ln)
                    lost.discard(h)

    def _read_idx(self, pid: str) -> np.ndarray | None:
        path = self._packs_dir / f"{pid}.idx"
        try:
            raw = path.read_bytes()
            pack_size = (self._packs_dir / f"{pid}.pack").stat().st_size
        except FileNotFoundError:
            return None  # removed by a concurrent repack
        entries = _decode_pack_index(raw, pack_size)
        if entries is None:
            if path not in self.corrupt_indexes:
                self.corrupt_indexes.append(path)
                log.warning("pack index %s is corrupt; its objects are unavailable", path)
            return None
        return entries

    def _load_idx(self, pid: str) -> None:
        entries = self._read_idx(pid)
        if entries is None:
            return
        members = [bytes(x).hex() for x in entries["h"]]
        for h, off, ln in zip(
            members, entries["off"].tolist(), entries["len"].tolist(), strict=True
        ):
            self._index.setdefault(h, _Loc(pid, off, ln))
        self._members[pid] = members

    # -- reading --

    def _pack_fd(self, pid: str) -> int:
        fd = self._fds.get(pid)
        if fd is None:
            fd = os.open(self._packs_dir / f"{pid}.pack", os.O_RDONLY)
            self._fds[pid] = fd
            if len(self._fds) > self._max_fds:
                os.close(self._fds.popitem(last=False)[1])
        else:
            self._fds.move_to_end(pid)
        return fd

    def _read_packed(self, h: str, loc: _Loc) -> bytes:
        data = os.pread(self._pack_fd(loc.pack), loc.length, loc.offset)
        if len(data) != loc.length:
            raise IntegrityError(f"object {h} is truncated in packs/{loc.pack}.pack")
        return _verified(h, data, f"packs/{loc.pack}.pack")

    def _lookup(self, h: str) -> bytes | None:
        data = self._buffered(h)
        if data is not None:
            return data
        loc = self._index.get(h)
        if loc is not None:
            try:
                return self._read_packed(h, loc)
            except FileNotFoundError:
                return None  # pack was repacked away; caller rescans
        try:
            data = self._loose_path(h).read_bytes()
        except FileNotFoundError:
            return None
        self._loose.add(h)
        return _verified(h, data, f"objects/{h[:2]}/{h}")

    def get(self, h: str) -> bytes:
        check_hash(h)
        with self._lock:
            data = self._lookup(h)
            if data is None:
                self.rescan()
                data = self._lookup(h)
        if data is None:
            raise NotFoundError(f"object {h} not found in {self.root}")
        return data

    def get_many(self, hashes: Sequence[str]) -> list[bytes]:
        """Like `get` for each hash (each verified), batched: per pack, sorted preads of runs."""
        hashes = [check_hash(h) for h in hashes]
        out: list[bytes | None] = [None] * len(hashes)
        with self._lock:
            by_pack: dict[str, list[tuple[int, int, int]]] = {}
            for i, h in enumerate(hashes):
                data = self._buffered(h)
                if data is not None:
                    out[i] = data
                    continue
                loc = self._index.get(h)
                if loc is not None:
                    by_pack.setdefault(loc.pack, []).append((loc.offset, loc.length, i))
            for pid, items in by_pack.items():
                with contextlib.suppress(FileNotFoundError):  # repacked away: fallback rescans
                    self._read_pack_batch(pid, items, hashes, out)
            for i, h in enumerate(hashes):
                if out[i] is None:
                    out[i] = self.get(h)
        return out  # type: ignore[return-value]

    def _read_pack_batch(
        self, pid: str, items: list[tuple[int, int, int]], hashes: list[str], out: list
    ) -> None:
        """Read objects (offset, length, slot) of one pack into `out`, verified, few preads."""
        fd = self._pack_fd(pid)
        items.sort()
        where = f"packs/{pid}.pack"
        n = len(items)
        a = 0
        while a < n:
            start = items[a][0]
            end = start + items[a][1]
            b = a + 1
            while b < n:
                off, ln, _ = items[b]
                if off - end > _READ_GAP or off + ln - start > _READ_SPAN:
                    break
                end = max(end, off + ln)
                b += 1
            run = os.pread(fd, end - start, start)
            view = memoryview(run)
            for off, ln, i in items[a:b]:
                data = view[off - start : off - start + ln]
                if len(data) != ln:
                    raise IntegrityError(f"object {hashes[i]} is truncated in {where}")
                _verified(hashes[i], data, where)  # every object, a run's only one too
                out[i] = data.tobytes() if b - a > 1 else run
            a = b

    def has_cached(self, h: str, size: int) -> bool:
        with self._lock:
            return self._holds(h)

    def has(self, h: str) -> bool:
        if not isinstance(h, str) or not _HASH_RE.match(h):
            return False
        with self._lock:
            if self._holds(h):
                return True
            if self._loose_path(h).exists():
                self._loose.add(h)
                return True
            self.rescan()
            return h in self._index

    def missing(self, hashes: Iterable[str]) -> set[str]:
        """As `ObjectStore.missing`: the pack indexes (rescanned) and a stat of each name
        none of them holds. A buffered object is not stored yet, so it counts as missing;
        so does a pack's object whose index is lost or corrupt."""
        with self._lock:
            self.rescan()
            rest = set(hashes) - self._index.keys()
        return {h for h in rest if not (_HASH_RE.match(h) and self._loose_path(h).is_file())}

    def verify(self, h: str) -> None:
        """Re-read the stored copy (never the write buffer) and check it against `h`."""
        check_hash(h)
        with self._flush_lock, self._lock:  # no flush in flight: nothing is being sealed
            pending = self._pending.pop(h, None)
            try:
                self.get(h)
            except NotFoundError:
                if pending is None:
                    raise
            finally:
                if pending is not None:
                    self._pending[h] = pending

    def iter_objects(self) -> Iterator[ObjectInfo]:
        """Stored copies on disk (buffered objects are not yet stored)."""
        with self._lock:
            self.rescan()
            packs = {pid: list(m) for pid, m in self._members.items()}
        for pid in sorted(packs):
            try:
                mtime = (self._packs_dir / f"{pid}.pack").stat().st_mtime
            except FileNotFoundError:
                continue
            entries = self._read_idx(pid)
            if entries is None:
                continue
            for h, ln in zip(packs[pid], entries["len"].tolist(), strict=True):
                yield ObjectInfo(h, ln, mtime, f"packs/{pid}.pack")
        yield from self._iter_loose()

    def _iter_loose(self) -> Iterator[ObjectInfo]:
        for sub in sorted(self._objects_dir.iterdir()):
            if not sub.is_dir():
                continue
            for p in sorted(sub.iterdir()):
                if _HASH_RE.match(p.name):
                    try:
                        st = p.stat()
                    except FileNotFoundError:
                        continue
                    yield ObjectInfo(
                        p.name, st.st_size, st.st_mtime, f"objects/{sub.name}/{p.name}"
                    )

    # -- removing --

    def delete_many(self, hashes: Iterable[str]) -> int:
        drop = {check_hash(h) for h in hashes}
        with self._flush_lock, self._lock:
            self.rescan()
            n = 0
            for h in drop:
                if self._pending.pop(h, None) is not None:
                    n += 1
                try:
                    self._loose_path(h).unlink()
                    n += 1
                except FileNotFoundError:
                    pass
                self._loose.discard(h)
            lost: set[str] = set()
            for pid in list(self._members):
                if not drop.isdisjoint(self._members[pid]):
                    n += self._rewrite_pack(pid, lambda h: h not in drop, lost).objects_dropped
            self._repoint(lost)
            return n

    def _rewrite_pack(self, pid: str, keep: Callable[[str], bool], lost: set[str]) -> RepackResult:
        members = self._members[pid]
        kept = [h for h in members if keep(h)]
        if len(kept) == len(members):
            return RepackResult()
        entries = self._read_idx(pid)
        if entries is None:
            return RepackResult()
        pack_path = self._packs_dir / f"{pid}.pack"
        size = pack_path.stat().st_size
        keep_set = set(kept)
        items: list[tuple[str, bytes]] = []
        seen: set[str] = set()
        for h, off, ln in zip(
            members, entries["off"].tolist(), entries["len"].tolist(), strict=True
        ):
            if h in keep_set and h not in seen:
                seen.add(h)
                # Verified: a corrupt kept object stops GC rather than being copied or lost.
                items.append((h, self._read_packed(h, _Loc(pid, off, ln))))
        if items:
            self._write_pack(items)  # new copies are visible before the old ones go
        (self._packs_dir / f"{pid}.idx").unlink(missing_ok=True)
        lost |= self._forget_pack(pid)
        # Kept objects now point at the new pack (set in _write_pack); dropped ones vanish.
        pack_path.unlink(missing_ok=True)
        self._fsync_dir(self._packs_dir)
        new_size = len(_PACK_MAGIC) + sum(len(d) for _, d in items) if items else 0
        return RepackResult(1, len(members) - len(kept), size - new_size, 2)

    def repack(self, keep: Callable[[str], bool], older_than: float) -> RepackResult:
        """GC primitive: drop objects `keep` rejects, but only from files older than `older_than` s.

        Packs holding such objects are rewritten with the kept ones (never
        dropping a kept object: new pack published before the old is
        removed); loose objects are unlinked; packs without an index and
        stale temp files older than the grace are removed. The policy (what
        to keep, how long a grace protects unpublished writes) is the caller's.
        """
        cutoff = time.time() - older_than
        total = RepackResult()

        def add(r: RepackResult) -> None:
            nonlocal total
            total = RepackResult(
                *(a + b for a, b in zip(_astuple(total), _astuple(r), strict=True))
            )

        with self._lock:
            self.rescan()
            lost: set[str] = set()
            for pid in sorted(self._members):
                try:
                    mtime = (self._packs_dir / f"{pid}.pack").stat().st_mtime
                except FileNotFoundError:
                    continue
                if mtime < cutoff:
                    add(self._rewrite_pack(pid, keep, lost))
            self._repoint(lost)
            for info in list(self._iter_loose()):
                if info.mtime < cutoff and not keep(info.hash):
                    (self.root / info.location).unlink(missing_ok=True)
                    self._loose.discard(info.hash)
                    add(RepackResult(0, 1, info.size, 1))
            indexed = set(self._members)
            for p in self._packs_dir.iterdir():
                orphan = p.suffix == ".pack" and p.stem not in indexed
                if orphan and not (self._packs_dir / f"{p.stem}.idx").exists():
                    add(self._remove_if_old(p, cutoff))
            for p in self._tmp_dir.iterdir():
                add(self._remove_if_old(p, cutoff))
        return total

    @staticmethod
    def _remove_if_old(p: Path, cutoff: float) -> RepackResult:
        try:
            st = p.stat()
            if st.st_mtime >= cutoff:
                return RepackResult()
            p.unlink()
        except FileNotFoundError:
            return RepackResult()
        return RepackResult(0, 0, st.st_size, 1)

    def close(self) -> None:
        self.flush()
        with self._lock:
            while self._fds:
                os.close(self._fds.popitem()[1])


def _astuple(r: RepackResult) -> tuple[int, int, int, int]:
    return (r.packs_rewritten, r.objects_dropped, r.bytes_freed, r.files_removed)
