"""The pack format, the same in a store directory and in a bucket.

`packs/<id>.pack` is a magic and the objects' bytes one after another;
`packs/<id>.idx` (written after the pack: its commit point) lists (BLAKE3
digest, offset, length) per object, with a magic, a count and a BLAKE3
checksum. Pack ids begin with their writer's clock in 16 hex digits, so they
sort by age (`trajstore.listing.PACK_IDS`). `IndexCache` keeps fetched indexes
in a local directory: they are immutable, so an open need fetch only new ones.
`PackSet` is what a store knows of its packs: which pack holds each object.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from blake3 import blake3

from trajstore.cas.backend import Backend
from trajstore.errors import StoreError
from trajstore.listing import PACK_IDS, listing_margin_s, listing_start

__all__ = [
    "PACK_ID_RE",
    "PACK_MAGIC",
    "IndexCache",
    "Loc",
    "PackSet",
    "decode_pack_index",
    "encode_pack",
    "loose_key",
    "new_pack_id",
    "pack_key",
    "read_runs",
]

log = logging.getLogger(__name__)

PACK_MAGIC = b"TSPACK\x00\x01"
_IDX_MAGIC = b"TSIDX\x00\x00\x01"
_IDX_ENTRY = np.dtype([("h", "V32"), ("off", "<u8"), ("len", "<u8")])
PACK_ID_RE = re.compile(r"[0-9a-f]+-[0-9a-f]+-[0-9a-f]+\Z")

#: Batched pack reads merge objects closer than this into one read (a pread, a range) ...
_READ_GAP = 64 << 10
#: ... up to this many bytes a read.
_READ_SPAN = 16 << 20


def new_pack_id() -> str:
    # Unique across processes without a lock; hex time first so ids sort by age.
    return f"{time.time_ns():016x}-{os.getpid():x}-{secrets.token_hex(6)}"


def pack_key(pid: str, suffix: str) -> str:
    """The relative key of a pack's body (`.pack`) or index (`.idx`)."""
    return f"packs/{pid}{suffix}"


def loose_key(h: str) -> str:
    """The relative key of a loose object."""
    return f"objects/{h[:2]}/{h}"


@dataclass(frozen=True)
class Loc:
    """Where a packed object lies."""

    pack: str
    offset: int
    length: int


def encode_pack(items: list[tuple[str, bytes]]) -> tuple[list[bytes], bytes, np.ndarray]:
    """A pack of `items` (hash, bytes): its pieces in order, its index object (body +
    BLAKE3 checksum) and the index entries."""
    entries = np.empty(len(items), dtype=_IDX_ENTRY)
    off = len(PACK_MAGIC)
    for i, (h, d) in enumerate(items):
        entries[i] = (bytes.fromhex(h), off, len(d))
        off += len(d)
    body = _IDX_MAGIC + np.uint64(len(items)).tobytes() + entries.tobytes()
    return [PACK_MAGIC, *(d for _, d in items)], body + blake3(body).digest(), entries


def decode_pack_index(raw: bytes, pack_size: int | None = None) -> np.ndarray | None:
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


def read_runs(
    items: list[tuple[int, int, int]],
) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
    """Objects (offset, length, slot) of one pack as reads: (start, end, members), sorted,
    objects closer than 64 KiB merged into one read of at most 16 MiB."""
    items = sorted(items)
    runs = []
    a = 0
    while a < len(items):
        start = items[a][0]
        end = start + items[a][1]
        b = a + 1
        while b < len(items):
            off, ln, _ = items[b]
            if off - end > _READ_GAP or off + ln - start > _READ_SPAN:
                break
            end = max(end, off + ln)
            b += 1
        runs.append((start, end, items[a:b]))
        a = b
    return runs


class IndexCache:
    """Pack indexes kept in a local directory (a cache only: anything wrong there is
    ignored, and every index read from it is checked again)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def pack_ids(self) -> list[str]:
        try:
            names = [p.name for p in self.directory.iterdir()]
        except OSError:
            return []
        return sorted(n[:-4] for n in names if n.endswith(".idx") and PACK_ID_RE.match(n[:-4]))

    def read(self, pid: str) -> bytes | None:
        try:
            return (self.directory / f"{pid}.idx").read_bytes()
        except OSError:
            return None

    def keep(self, pid: str, raw: bytes) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.directory / f".{pid}.{os.getpid()}.tmp"
            tmp.write_bytes(raw)
            os.replace(tmp, self.directory / f"{pid}.idx")
        except OSError:
            pass  # a cache only

    def drop(self, pid: str) -> None:
        with contextlib.suppress(OSError):
            (self.directory / f"{pid}.idx").unlink()


class PackSet:
    """The packs a store knows and which of them holds each object: their indexes, loaded
    from listings of `packs/` (and the index cache), and the packs this store publishes.
    Not locked: the store calls it under its lock."""

    def __init__(self, backend: Backend, cache: IndexCache | None) -> None:
        self.backend = backend
        self.cache = cache
        self.locs: dict[str, Loc] = {}
        self.members: dict[str, list[str]] = {}  # pack id -> hashes in it
        self.entries: dict[str, np.ndarray] = {}  # pack id -> its index entries
        #: packs seen in a listing of this process or written by it; a pack known only
        #: from the index cache is confirmed before it spares a write
        self.confirmed: set[str] = set()
        #: pack indexes that failed their checksum; their objects read as missing
        self.corrupt: list[object] = []

    def open(self) -> None:
        """Without a cache: list `packs/`. With one: load the cached indexes, then list only
        the pack names from `listing_start` on (pack ids begin with their writer's clock,
        so they sort by age): an open pays for what is new."""
        if self.cache is None:
            self.rescan()
            return
        for pid in self.cache.pack_ids():
            raw = self.cache.read(pid)
            entries = None if raw is None else decode_pack_index(raw)
            if entries is not None:
                self.add(pid, entries.copy())
        after = listing_start(max(self.members, default=None), listing_margin_s(), PACK_IDS)
        if after is None:
            self.rescan()
            return
        self.apply_listing(self.backend.names("packs", after), forget=False)

    def rescan(self) -> None:
        """List every pack: load those published since, forget removed ones."""
        self.apply_listing(self.backend.names("packs"), forget=True)

    def apply_listing(self, names: list[str], *, forget: bool) -> None:
        """Packs whose index is listed are confirmed and loaded; with `forget` (a full
        listing) known packs not listed are dropped."""
        present = {n[:-4] for n in names if n.endswith(".idx") and PACK_ID_RE.match(n[:-4])}
        lost: set[str] = set()
        if forget:
            for pid in list(self.members):
                if pid not in present:
                    lost |= self.forget(pid)
        self.confirmed |= present
        new = sorted(present - self.members.keys())
        if self.backend.concurrency > 1 and len(new) > 1:
            with ThreadPoolExecutor(min(self.backend.concurrency, len(new))) as pool:
                loaded = list(pool.map(self.read_index, new))
        else:
            loaded = [self.read_index(pid) for pid in new]
        for pid, entries in zip(new, loaded, strict=True):
            if entries is not None:
                self.add(pid, entries)
        self.repoint(lost)

    def read_index(self, pid: str) -> np.ndarray | None:
        """A pack's index entries (from the cache if kept there); None if it is gone or
        corrupt (then listed in `corrupt`)."""
        key = pack_key(pid, ".idx")
        cached = None if self.cache is None else self.cache.read(pid)
        entries = None if cached is None else decode_pack_index(cached)
        if entries is not None:
            return entries.copy()
        raw = self.backend.read(key)
        try:
            pack_size = self.backend.known_size(pack_key(pid, ".pack"))
        except FileNotFoundError:
            return None  # removed by a concurrent repack
        if raw is None:
            return None
        entries = decode_pack_index(raw, pack_size)
        if entries is None:
            where = self.backend.locate(key)
            if where not in self.corrupt:
                self.corrupt.append(where)
                log.warning("pack index %s is corrupt; its objects are unavailable", where)
            return None
        if self.cache is not None:
            self.cache.keep(pid, raw)
        return entries.copy()

    def publish_pack(self, items: list[tuple[str, bytes]]) -> tuple[str, np.ndarray]:
        """Write and publish a pack of `items` (durable on return): its body, then its
        index (the commit point). Its id and entries; not added here (`add_written`)."""
        pid = new_pack_id()
        pieces, idx, entries = encode_pack(items)
        self.backend.write(pack_key(pid, ".pack"), pieces)
        try:
            self.backend.write(pack_key(pid, ".idx"), [idx])
        except BaseException:  # e.g. a full disk: the pack was never published, free it now
            try:
                self.backend.delete(pack_key(pid, ".pack"))
            except (OSError, StoreError):
                log.warning("could not remove the unpublished pack %s", pid)
            raise
        self.backend.sync("packs")
        if self.cache is not None:
            self.cache.keep(pid, idx)
        return pid, entries

    def add_written(self, pid: str, hashes: list[str], entries: np.ndarray) -> None:
        """A pack this store published: its objects are read from it from now on."""
        for h, e in zip(hashes, entries, strict=True):
            self.locs[h] = Loc(pid, int(e["off"]), int(e["len"]))
        self.members[pid] = hashes
        self.entries[pid] = entries
        self.confirmed.add(pid)

    def add(self, pid: str, entries: np.ndarray) -> None:
        """A listed or cached pack: objects not indexed yet are read from it."""
        members = [bytes(x).hex() for x in entries["h"]]
        for h, off, ln in zip(
            members, entries["off"].tolist(), entries["len"].tolist(), strict=True
        ):
            self.locs.setdefault(h, Loc(pid, off, ln))
        self.members[pid] = members
        self.entries[pid] = entries

    def forget(self, pid: str) -> set[str]:
        """Drop a pack (and its cached index); return hashes whose indexed copy was in it."""
        lost = set()
        self.confirmed.discard(pid)
        self.entries.pop(pid, None)
        for h in self.members.pop(pid, []):
            loc = self.locs.get(h)
            if loc is not None and loc.pack == pid:
                del self.locs[h]
                lost.add(h)
        self.backend.forget(pack_key(pid, ".pack"))
        if self.cache is not None:
            self.cache.drop(pid)
        return lost

    def repoint(self, lost: set[str]) -> None:
        """Index another pack's copy of objects whose indexed copy went away."""
        lost -= self.locs.keys()
        for pid, members in self.members.items():
            if not lost:
                return
            if lost.isdisjoint(members):
                continue
            entries = self.entries[pid]
            for h, off, ln in zip(
                members, entries["off"].tolist(), entries["len"].tolist(), strict=True
            ):
                if h in lost:
                    self.locs[h] = Loc(pid, off, ln)
                    lost.discard(h)

    def known(self, h: str) -> bool:
        """Whether a confirmed pack holds `h` (no I/O)."""
        loc = self.locs.get(h)
        return loc is not None and loc.pack in self.confirmed

    def holds(self, h: str) -> bool:
        """Whether a stored pack holds `h`; a pack known only from the cache is confirmed
        first (its index still exists), as gc may have rewritten it since."""
        loc = self.locs.get(h)
        if loc is None:
            return False
        if loc.pack in self.confirmed:
            return True
        if self.backend.exists(pack_key(loc.pack, ".idx")):
            self.confirmed.add(loc.pack)
            return True
        self.rescan()  # a cached pack is gone: learn every removal and where objects went
        return h in self.locs
