"""Objects and refs in an S3-compatible bucket (`s3://BUCKET/PREFIX`), through obstore.

Same content addressing, packing and verification as `LocalObjectStore`:
small objects are sealed into packs (`packs/<id>.pack`, published by writing
`packs/<id>.idx` last, the same binary index as on disk), large ones are
loose objects (`objects/<h[:2]>/<h>`). Reads fetch only the byte ranges of
the objects asked for (ranged GETs, nearby ranges merged), never whole packs,
and every object is checked against its BLAKE3 name.

Refs and claims go through `S3RefSpace`: `create_if_absent` is a PUT with
`If-None-Match: *`, so of two writers exactly one creates a name. Blob
uploads are ordinary PUTs: rewriting equal content is harmless.

Endpoint and credentials come only from the environment (`AWS_ENDPOINT_URL`,
`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
`AWS_REGION`), never from flags that `ps` would show; an `http://` endpoint
is refused unless `AWS_ALLOW_HTTP=true`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trajstore.cas.objects import (
    _HASH_RE,
    _PACK_ID_RE,
    _PACK_MAGIC,
    _READ_GAP,
    _READ_SPAN,
    ObjectInfo,
    ObjectStore,
    RepackResult,
    _decode_pack_index,
    _encode_pack,
    _Loc,
    _new_pack_id,
    _verified,
    check_hash,
    object_hash,
)
from trajstore.errors import IntegrityError, NotFoundError, StoreError, TrajstoreError, UsageError
from trajstore.listing import PACK_IDS, listing_margin_s, listing_start
from trajstore.refspace import DocInfo, RefSpace

__all__ = ["S3Location", "S3ObjectStore", "S3RefSpace", "is_s3_url", "parse_s3_url", "s3_client"]

#: parallel requests for index loads and loose-object reads
_CONCURRENCY = 8


def is_s3_url(text: object) -> bool:
    return isinstance(text, str) and text.startswith("s3://")


@dataclass(frozen=True)
class S3Location:
    """`s3://BUCKET/PREFIX`: the bucket and the key prefix (empty or ending in `/`)."""

    bucket: str
    prefix: str

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")


def parse_s3_url(url: str) -> S3Location:
    """Split `s3://BUCKET[/PREFIX]`; a UsageError for anything else."""
    if not is_s3_url(url):
        raise UsageError(f"not an s3:// URL: {url!r}")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not bucket or "/" in bucket:
        raise UsageError(f"{url!r}: give the store as s3://BUCKET/PREFIX")
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise UsageError(f"{url!r}: the prefix has an empty, '.' or '..' part")
    return S3Location(bucket, f"{prefix}/" if prefix else "")


def s3_client(bucket: str) -> Any:
    """An obstore S3Store for `bucket`, configured from the standard AWS variables only."""
    from obstore.store import S3Store

    env = os.environ
    endpoint = env.get("AWS_ENDPOINT_URL") or None
    allow_http = env.get("AWS_ALLOW_HTTP", "").strip().lower() == "true"
    if endpoint is not None and endpoint.startswith("http://") and not allow_http:
        raise UsageError(
            f"AWS_ENDPOINT_URL is plain http ({endpoint}); set AWS_ALLOW_HTTP=true to allow it"
        )
    kwargs: dict[str, Any] = {"region": env.get("AWS_REGION") or "us-east-1"}
    for var, arg in (
        ("AWS_ACCESS_KEY_ID", "access_key_id"),
        ("AWS_SECRET_ACCESS_KEY", "secret_access_key"),
        ("AWS_SESSION_TOKEN", "token"),
    ):
        if env.get(var):
            kwargs[arg] = env[var]
    if endpoint is not None:
        # an S3-compatible server (SeaweedFS, MinIO, ...) serves path-style requests
        kwargs.update(endpoint=endpoint, virtual_hosted_style_request=False)
    options = {"allow_http": True} if allow_http else {}
    try:
        return S3Store(bucket, client_options=options, **kwargs)
    except Exception as e:  # obstore's configuration errors are plain exceptions
        raise UsageError(f"cannot configure S3 access to bucket {bucket!r}: {e}") from None


#: the process whose requests started obstore's runtime (a tokio runtime with its own
#: threads, one per process, started by the first request, not by making a client)
_runtime_pid: int | None = None


def _obstore() -> Any:
    """The obstore module, for a request of this process; a StoreError in a process forked
    from one that had already made requests (its runtime's threads are not in the copy,
    and the copy's first request would wait for them forever)."""
    global _runtime_pid
    import obstore

    pid = os.getpid()
    if _runtime_pid is None:
        _runtime_pid = pid
    elif _runtime_pid != pid:
        raise StoreError(
            f"this process (pid {pid}) was forked from one that had used an s3:// store "
            f"(pid {_runtime_pid}), and S3 requests cannot work in such a copy: start it "
            "with multiprocessing's 'spawn' or 'forkserver' method, or fork before the "
            "first S3 request"
        )
    return obstore


def _store_error(e: BaseException, what: str) -> StoreError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return StoreError(f"S3 {what}: {first[:300]}")


class S3RefSpace(RefSpace):
    """Create-once documents as S3 objects under a prefix (conditional PUTs)."""

    def __init__(self, client: Any, loc: S3Location) -> None:
        self.client = client
        self.loc = loc
        self.location = loc.url
        #: names returned by listing requests so far (what a command pays for listing)
        self.listed = 0

    #: a folder listed this recently is not listed again (a listing costs one request per
    #: 1,000 names); writers of this process invalidate, lookups that miss force a listing
    LIST_MAX_AGE_NS = 1_000_000_000

    def _key(self, key: str) -> str:
        return self.loc.prefix + key

    def changed(self, folder: str, stamps: dict[str, int]) -> bool:
        now = time.monotonic_ns()
        last = stamps.get(folder)
        if last is not None and now - last < self.LIST_MAX_AGE_NS:
            return False
        stamps[folder] = now
        return True

    def create_if_absent(self, key: str, data: bytes) -> bool:
        obstore = _obstore()
        from obstore.exceptions import AlreadyExistsError

        try:
            obstore.put(self.client, self._key(key), data, mode="create")
        except AlreadyExistsError:
            return False
        except Exception as e:
            raise _store_error(e, f"cannot create {self.where(key)}") from None
        return True

    def read(self, key: str) -> bytes:
        obstore = _obstore()

        try:
            return bytes(obstore.get(self.client, self._key(key)).bytes())
        except FileNotFoundError:
            raise NotFoundError(f"{self.where(key)} does not exist") from None
        except Exception as e:
            raise _store_error(e, f"cannot read {self.where(key)}") from None

    def list(self, folder: str) -> list[DocInfo]:
        obstore = _obstore()

        prefix = self._key(folder.strip("/") + "/")
        try:
            listing = obstore.list_with_delimiter(self.client, prefix)
        except Exception as e:
            raise _store_error(e, f"cannot list {self.where(folder)}") from None
        self.listed += len(listing["objects"])
        out = [
            DocInfo(m["path"][len(prefix) :], m["last_modified"].timestamp())
            for m in listing["objects"]
            if m["path"].startswith(prefix)
        ]
        return sorted(
            (d for d in out if d.name and not d.name.startswith(".")), key=lambda d: d.name
        )

    def walk(self, folder: str) -> list[DocInfo]:
        obstore = _obstore()

        prefix = self._key(folder.strip("/") + "/")
        try:
            metas = [m for batch in obstore.list(self.client, prefix=prefix) for m in batch]
        except Exception as e:
            raise _store_error(e, f"cannot list {self.where(folder)}") from None
        self.listed += len(metas)
        out = [DocInfo(m["path"][len(prefix) :], m["last_modified"].timestamp()) for m in metas]
        return sorted((d for d in out if d.name), key=lambda d: d.name)

    def list_after(self, folder: str, after: str | None) -> list[str]:
        """Names directly inside `folder` that sort after `after` (all when None), sorted:
        one listing that starts there (S3 StartAfter), so an incremental catalog sync
        pays for what is new, not for the whole folder (trajstore.catalog.sync.sync_new)."""
        obstore = _obstore()

        prefix = self._key(folder.strip("/") + "/")
        offset = prefix + after if after else None
        try:
            metas = [
                m
                for batch in obstore.list(self.client, prefix=prefix, offset=offset)
                for m in batch
            ]
        except Exception as e:
            raise _store_error(e, f"cannot list {self.where(folder)}") from None
        self.listed += len(metas)
        names = (m["path"][len(prefix) :] for m in metas)
        return sorted(n for n in names if n and "/" not in n and not n.startswith("."))

    def delete(self, key: str) -> None:
        obstore = _obstore()

        try:
            obstore.delete(self.client, self._key(key))
        except FileNotFoundError:
            return
        except Exception as e:
            raise _store_error(e, f"cannot delete {self.where(key)}") from None


class S3ObjectStore(ObjectStore):
    """Content-addressed objects in a bucket: packs with an index object, large objects loose.

    Writers in many processes and hosts need no lock: pack ids are unique and
    a pack is visible only once its index object exists. A hash not known
    here triggers a listing of `packs/`, so other writers' packs become
    visible. Thread-safe within a process.
    """

    def __init__(
        self,
        client: Any,
        loc: S3Location,
        *,
        pack_threshold: int = 1 << 20,
        pack_max_bytes: int = 64 << 20,
        index_cache: Path | None = None,
    ) -> None:
        self.client = client
        self.loc = loc
        #: pack indexes are immutable: kept here, an open fetches only new packs' indexes
        self.index_cache = index_cache
        self.pack_threshold = pack_threshold
        self.pack_max_bytes = pack_max_bytes
        self._lock = threading.RLock()
        self._index: dict[str, _Loc] = {}
        self._members: dict[str, list[str]] = {}
        self._entries: dict[str, np.ndarray] = {}
        self._loose: set[str] = set()
        self._pending: dict[str, bytes] = {}
        self._pending_bytes = 0
        #: index objects that failed their checksum; their objects read as missing
        self.corrupt_indexes: list[str] = []
        #: names returned by listing requests so far (what a command pays for listing)
        self.listed = 0
        #: packs seen in a listing of this process or written by it; a pack known only
        #: from the local cache is confirmed (one HEAD) before it spares an upload
        self._confirmed: set[str] = set()
        self._open_incremental()

    def __repr__(self) -> str:
        return f"S3ObjectStore({self.loc.url!r})"

    # -- keys --

    def _pack_key(self, pid: str, suffix: str) -> str:
        return f"{self.loc.prefix}packs/{pid}{suffix}"

    def _loose_key(self, h: str) -> str:
        return f"{self.loc.prefix}objects/{h[:2]}/{h}"

    # -- raw requests (errors become one-line StoreErrors) --

    def _put_raw(self, key: str, data: bytes | list[bytes]) -> None:
        obstore = _obstore()

        try:
            obstore.put(self.client, key, data)
        except Exception as e:
            raise _store_error(e, f"cannot write s3://{self.loc.bucket}/{key}") from None

    def _get_raw(self, key: str) -> bytes | None:
        obstore = _obstore()

        try:
            return bytes(obstore.get(self.client, key).bytes())
        except FileNotFoundError:
            return None
        except Exception as e:
            raise _store_error(e, f"cannot read s3://{self.loc.bucket}/{key}") from None

    def _head(self, key: str) -> dict | None:
        obstore = _obstore()

        try:
            return obstore.head(self.client, key)
        except FileNotFoundError:
            return None
        except Exception as e:
            raise _store_error(e, f"cannot stat s3://{self.loc.bucket}/{key}") from None

    def _list(self, folder: str, after: str | None = None) -> list[dict]:
        """Listing entries under `folder`, only names sorting after `after` when given
        (S3 StartAfter: one request per 1,000 names from there on)."""
        obstore = _obstore()

        prefix = f"{self.loc.prefix}{folder}"
        offset = prefix + after if after else None
        try:
            out = [
                m
                for batch in obstore.list(self.client, prefix=prefix, offset=offset)
                for m in batch
            ]
        except Exception as e:
            raise _store_error(e, f"cannot list s3://{self.loc.bucket}/{prefix}") from None
        self.listed += len(out)
        return out

    def _delete_raw(self, key: str) -> None:
        obstore = _obstore()

        try:
            obstore.delete(self.client, key)
        except FileNotFoundError:
            pass
        except Exception as e:
            raise _store_error(e, f"cannot delete s3://{self.loc.bucket}/{key}") from None

    # -- writing --

    def put(self, data: bytes) -> str:
        with self._lock:
            return self._put(data)[0]

    def put_many(self, datas: Iterable[bytes]) -> list[str]:
        with self._lock:
            return [self._put(d)[0] for d in datas]

    def put_many_added(self, datas: Iterable[bytes]) -> list[tuple[str, bool]]:
        with self._lock:
            return [self._put(d) for d in datas]

    def _put(self, data: bytes) -> tuple[str, bool]:
        """Buffer or upload `data` unless held; (its hash, whether it was stored here)."""
        h = object_hash(data)
        if h in self._pending or self._indexed(h) or h in self._loose:
            return h, False
        added = True
        if len(data) >= self.pack_threshold:
            key = self._loose_key(h)
            added = self._head(key) is None
            if added:
                self._put_raw(key, bytes(data))
            self._loose.add(h)
        else:
            self._pending[h] = bytes(data)
            self._pending_bytes += len(data)
            if self._pending_bytes >= self.pack_max_bytes:
                self._flush()
        return h, added

    def flush(self) -> None:
        """Seal buffered small objects into one pack (no-op when nothing is buffered)."""
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        self._write_pack(list(self._pending.items()))
        self._pending.clear()
        self._pending_bytes = 0

    def _write_pack(self, items: list[tuple[str, bytes]]) -> str:
        pid = _new_pack_id()
        pieces, idx, entries = _encode_pack(items)
        self._put_raw(self._pack_key(pid, ".pack"), b"".join(pieces))
        # The index object is the pack's commit point: written after the pack.
        self._put_raw(self._pack_key(pid, ".idx"), idx)
        self._keep_idx(pid, idx)
        members = [h for h, _ in items]
        for (h, _), e in zip(items, entries, strict=True):
            self._index[h] = _Loc(pid, int(e["off"]), int(e["len"]))
        self._members[pid] = members
        self._entries[pid] = entries
        self._confirmed.add(pid)
        return pid

    # -- discovering packs --

    def _open_incremental(self) -> None:
        """Open with the packs of the local index cache, then list only pack names after
        the newest of them minus the margin (pack ids start with their writer's clock in
        16 hex digits, so they sort by age): an open pays for what is new. Without a
        usable cache, or with an id of another form, the whole folder is listed."""
        cached = self._cached_pack_ids()
        with self._lock:
            for pid in cached:
                raw = self._cached_idx(pid)
                entries = None if raw is None else self._parse_idx(raw)
                if entries is not None:
                    self._add_pack(pid, entries)
            after = listing_start(max(self._members, default=None), listing_margin_s(), PACK_IDS)
            if after is None:
                self.rescan()
                return
            self._add_listed(self._list("packs/", after), forget=False)

    def _cached_pack_ids(self) -> list[str]:
        if self.index_cache is None:
            return []
        try:
            names = [p.name for p in self.index_cache.iterdir()]
        except OSError:
            return []
        return sorted(n[:-4] for n in names if n.endswith(".idx") and _PACK_ID_RE.match(n[:-4]))

    def _indexed(self, h: str) -> bool:
        """Whether a stored pack holds `h`; a pack known only from the local cache is
        confirmed first (one HEAD of its index), as gc may have rewritten it since."""
        loc = self._index.get(h)
        if loc is None:
            return False
        if loc.pack in self._confirmed:
            return True
        if self._head(self._pack_key(loc.pack, ".idx")) is not None:
            self._confirmed.add(loc.pack)
            return True
        self.rescan()  # a cached pack is gone: learn every removal and where objects went
        return h in self._index

    def _pack_listing(self) -> dict[str, dict]:
        """pack id -> listing entry of its `.pack`, for packs whose index exists."""
        packs: dict[str, dict] = {}
        idx: set[str] = set()
        for m in self._list("packs/"):
            name = m["path"].rsplit("/", 1)[-1]
            stem, _, ext = name.rpartition(".")
            if not _PACK_ID_RE.match(stem):
                continue
            if ext == "pack":
                packs[stem] = m
            elif ext == "idx":
                idx.add(stem)
        return {pid: m for pid, m in packs.items() if pid in idx}

    def rescan(self) -> None:
        """List every pack: load those published since, forget (and uncache) removed ones.
        Opens list only what is new (`_open_incremental`); this full listing is for gc,
        fsck and a read that missed (e.g. a cached pack that gc removed)."""
        with self._lock:
            self._add_listed(self._list("packs/"), forget=True)

    def _add_listed(self, listing: list[dict], *, forget: bool) -> None:
        """Apply a listing of `packs/`: packs whose index is listed are confirmed and
        loaded; with `forget` (a full listing) known packs not listed are dropped."""
        present: set[str] = set()
        for m in listing:
            stem, _, ext = m["path"].rsplit("/", 1)[-1].rpartition(".")
            if ext == "idx" and _PACK_ID_RE.match(stem):
                present.add(stem)
        lost: set[str] = set()
        if forget:
            for pid in list(self._members):
                if pid not in present:
                    lost |= self._forget_pack(pid)
                    self._drop_cached_idx(pid)
        self._confirmed |= present
        new = sorted(present - self._members.keys())
        with ThreadPoolExecutor(_CONCURRENCY) as pool:
            loaded = list(pool.map(self._read_idx, new))
        for pid, entries in zip(new, loaded, strict=True):
            if entries is not None:
                self._add_pack(pid, entries)
        self._repoint(lost)

    def _add_pack(self, pid: str, entries: np.ndarray) -> None:
        members = [bytes(x).hex() for x in entries["h"]]
        for h, off, ln in zip(
            members, entries["off"].tolist(), entries["len"].tolist(), strict=True
        ):
            self._index.setdefault(h, _Loc(pid, off, ln))
        self._members[pid] = members
        self._entries[pid] = entries

    def _forget_pack(self, pid: str) -> set[str]:
        lost = set()
        self._confirmed.discard(pid)
        self._entries.pop(pid, None)
        for h in self._members.pop(pid, []):
            loc = self._index.get(h)
            if loc is not None and loc.pack == pid:
                del self._index[h]
                lost.add(h)
        return lost

    def _repoint(self, lost: set[str]) -> None:
        lost -= self._index.keys()
        for pid, members in self._members.items():
            if not lost:
                return
            if lost.isdisjoint(members):
                continue
            entries = self._entries[pid]
            for h, off, ln in zip(
                members, entries["off"].tolist(), entries["len"].tolist(), strict=True
            ):
                if h in lost:
                    self._index[h] = _Loc(pid, off, ln)
                    lost.discard(h)

    def _cached_idx(self, pid: str) -> bytes | None:
        if self.index_cache is None:
            return None
        try:
            return (self.index_cache / f"{pid}.idx").read_bytes()
        except OSError:
            return None

    def _drop_cached_idx(self, pid: str) -> None:
        if self.index_cache is not None:
            with contextlib.suppress(OSError):
                (self.index_cache / f"{pid}.idx").unlink()

    def _keep_idx(self, pid: str, raw: bytes) -> None:
        if self.index_cache is None:
            return
        try:
            self.index_cache.mkdir(parents=True, exist_ok=True)
            tmp = self.index_cache / f".{pid}.{os.getpid()}.tmp"
            tmp.write_bytes(raw)
            os.replace(tmp, self.index_cache / f"{pid}.idx")
        except OSError:
            pass  # a cache only

    def _read_idx(self, pid: str) -> np.ndarray | None:
        key = self._pack_key(pid, ".idx")
        cached = self._cached_idx(pid)
        entries = None if cached is None else self._parse_idx(cached)
        if entries is not None:
            return entries
        raw = self._get_raw(key)
        if raw is None:
            return None  # removed by a concurrent repack
        entries = self._parse_idx(raw)
        if entries is None:
            where = f"s3://{self.loc.bucket}/{key}"
            if where not in self.corrupt_indexes:
                self.corrupt_indexes.append(where)
            return None
        self._keep_idx(pid, raw)
        return entries

    @staticmethod
    def _parse_idx(raw: bytes) -> np.ndarray | None:
        """The entries of a pack index, or None unless its magic, length and checksum hold."""
        entries = _decode_pack_index(raw)
        return None if entries is None else entries.copy()

    # -- reading --

    def _fetch_ranges(
        self, pid: str, items: list[tuple[int, int, int]], hashes: list[str], out: list
    ) -> None:
        """Objects (offset, length, slot) of one pack into `out`: merged ranged GETs, verified."""
        obstore = _obstore()

        items.sort()
        runs: list[tuple[int, int, list[tuple[int, int, int]]]] = []
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
        key = self._pack_key(pid, ".pack")
        try:
            got = obstore.get_ranges(
                self.client, key, starts=[r[0] for r in runs], ends=[r[1] for r in runs]
            )
        except FileNotFoundError:
            return  # repacked away: the caller falls back to a rescan
        except Exception as e:
            raise _store_error(e, f"cannot read s3://{self.loc.bucket}/{key}") from None
        where = f"s3://{self.loc.bucket}/{key}"
        for (start, _, members), buf in zip(runs, got, strict=True):
            view = memoryview(buf)
            for off, ln, i in members:
                data = view[off - start : off - start + ln]
                if len(data) != ln:
                    raise IntegrityError(f"object {hashes[i]} is truncated in {where}")
                out[i] = _verified(hashes[i], data, where).tobytes()

    def _read_loose(self, h: str) -> bytes | None:
        data = self._get_raw(self._loose_key(h))
        if data is None:
            return None
        self._loose.add(h)
        return _verified(h, data, f"s3://{self.loc.bucket}/{self._loose_key(h)}")

    def _get_stored(self, hashes: list[str], out: list, *, pending: bool = True) -> None:
        by_pack: dict[str, list[tuple[int, int, int]]] = {}
        with self._lock:
            for i, h in enumerate(hashes):
                if out[i] is not None:
                    continue
                data = self._pending.get(h) if pending else None
                if data is not None:
                    out[i] = data
                    continue
                loc = self._index.get(h)
                if loc is not None:
                    by_pack.setdefault(loc.pack, []).append((loc.offset, loc.length, i))
        for pid, items in by_pack.items():
            self._fetch_ranges(pid, items, hashes, out)
        rest = [i for i, d in enumerate(out) if d is None]
        if rest:
            with ThreadPoolExecutor(min(_CONCURRENCY, len(rest))) as pool:
                for i, data in zip(
                    rest, pool.map(lambda i: self._read_loose(hashes[i]), rest), strict=True
                ):
                    out[i] = data

    def get_many(self, hashes: Sequence[str], *, pending: bool = True) -> list[bytes]:
        """Each object verified; per pack, one ranged request set for only the bytes needed."""
        hashes = [check_hash(h) for h in hashes]
        out: list[bytes | None] = [None] * len(hashes)
        self._get_stored(hashes, out, pending=pending)
        if any(d is None for d in out):
            self.rescan()
            self._get_stored(hashes, out, pending=pending)
        for h, d in zip(hashes, out, strict=True):
            if d is None:
                raise NotFoundError(f"object {h} not found in {self.loc.url}")
        return out  # type: ignore[return-value]

    def get(self, h: str) -> bytes:
        return self.get_many([h])[0]

    def has(self, h: str) -> bool:
        if not isinstance(h, str) or not _HASH_RE.match(h):
            return False
        with self._lock:
            if h in self._pending or self._indexed(h) or h in self._loose:
                return True
        if self._head(self._loose_key(h)) is not None:
            self._loose.add(h)
            return True
        self.rescan()
        return h in self._index

    def missing(self, hashes: Iterable[str]) -> set[str]:
        """As `ObjectStore.missing`: the pack indexes of a full listing of `packs/`, then,
        for the names none of them holds, one listing of `objects/` (not a HEAD each)."""
        with self._lock:
            self.rescan()
            rest = set(hashes) - self._index.keys()
        if rest:
            rest -= {info.hash for info in self._iter_loose()}
        return rest

    def verify(self, h: str) -> None:
        """Re-read the stored copy (never the write buffer) and check it against `h`."""
        self.get_many([check_hash(h)], pending=False)

    def verify_many(self, hashes: Sequence[str]) -> dict[str, str]:
        """As `ObjectStore.verify_many`, a batch of ranged reads per pack; a batch that
        fails is verified again one object at a time to name every bad one."""
        problems: dict[str, str] = {}
        hashes = list(hashes)
        for start in range(0, len(hashes), 2048):
            batch = hashes[start : start + 2048]
            try:
                self.get_many(batch, pending=False)
            except TrajstoreError:
                problems.update(super().verify_many(batch))
        return problems

    def iter_objects(self) -> Iterator[ObjectInfo]:
        """Stored copies (buffered objects are not yet stored), with the bucket's timestamps."""
        listing = self._pack_listing()
        with self._lock:
            self.rescan()
            packs = {pid: (list(m), self._entries[pid]) for pid, m in self._members.items()}
        for pid in sorted(packs):
            meta = listing.get(pid)
            if meta is None:
                continue
            members, entries = packs[pid]
            mtime = meta["last_modified"].timestamp()
            where = f"packs/{pid}.pack"
            for h, ln in zip(members, entries["len"].tolist(), strict=True):
                yield ObjectInfo(h, ln, mtime, where)
        yield from self._iter_loose()

    def _iter_loose(self) -> Iterator[ObjectInfo]:
        for m in self._list("objects/"):
            name = m["path"].rsplit("/", 1)[-1]
            if _HASH_RE.match(name):
                rel = m["path"][len(self.loc.prefix) :]
                yield ObjectInfo(name, int(m["size"]), m["last_modified"].timestamp(), rel)

    # -- removing --

    def delete_many(self, hashes: Iterable[str]) -> int:
        drop = {check_hash(h) for h in hashes}
        with self._lock:
            self.rescan()
            n = 0
            for h in drop:
                if self._pending.pop(h, None) is not None:
                    n += 1
                if h in self._loose or self._head(self._loose_key(h)) is not None:
                    self._delete_raw(self._loose_key(h))
                    n += 1
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
        entries = self._entries[pid]
        size = len(_PACK_MAGIC) + int(entries["len"].sum())
        keep_set = set(kept)
        want: list[tuple[int, int, int]] = []
        hashes: list[str] = []
        for h, off, ln in zip(
            members, entries["off"].tolist(), entries["len"].tolist(), strict=True
        ):
            if h in keep_set and h not in hashes:
                want.append((off, ln, len(hashes)))
                hashes.append(h)
        datas: list[bytes | None] = [None] * len(hashes)
        if want:
            # Verified: a corrupt kept object stops gc rather than being copied or lost.
            self._fetch_ranges(pid, want, hashes, datas)
            if any(d is None for d in datas):
                raise StoreError(f"pack {pid} vanished while gc rewrote it; run gc again")
            self._write_pack(list(zip(hashes, datas, strict=True)))  # type: ignore[arg-type]
        self._delete_raw(self._pack_key(pid, ".idx"))
        lost |= self._forget_pack(pid)
        self._drop_cached_idx(pid)
        self._delete_raw(self._pack_key(pid, ".pack"))
        new_size = len(_PACK_MAGIC) + sum(len(d or b"") for d in datas) if datas else 0
        return RepackResult(1, len(members) - len(kept), size - new_size, 2)

    def repack(self, keep: Callable[[str], bool], older_than: float) -> RepackResult:
        """GC primitive, as `LocalObjectStore.repack`, with the bucket's last-modified times."""
        import time

        cutoff = time.time() - older_than
        total = [0, 0, 0, 0]

        def add(r: RepackResult) -> None:
            for i, v in enumerate(
                (r.packs_rewritten, r.objects_dropped, r.bytes_freed, r.files_removed)
            ):
                total[i] += v

        with self._lock:
            listing = self._list("packs/")
            self.rescan()
            lost: set[str] = set()
            pack_times: dict[str, float] = {}
            idx_names: set[str] = set()
            for m in listing:
                stem, _, ext = m["path"].rsplit("/", 1)[-1].rpartition(".")
                if ext == "pack":
                    pack_times[stem] = m["last_modified"].timestamp()
                elif ext == "idx":
                    idx_names.add(stem)
            for pid in sorted(self._members):
                if pack_times.get(pid, cutoff) < cutoff:
                    add(self._rewrite_pack(pid, keep, lost))
            self._repoint(lost)
            for info in list(self._iter_loose()):
                if info.mtime < cutoff and not keep(info.hash):
                    self._delete_raw(self.loc.prefix + info.location)
                    self._loose.discard(info.hash)
                    add(RepackResult(0, 1, info.size, 1))
            for m in listing:  # packs whose index was never written (a crashed writer)
                stem, _, ext = m["path"].rsplit("/", 1)[-1].rpartition(".")
                old = m["last_modified"].timestamp() < cutoff
                if ext == "pack" and stem not in idx_names and old:
                    self._delete_raw(m["path"])
                    add(RepackResult(0, 0, int(m["size"]), 1))
        return RepackResult(*total)

    def close(self) -> None:
        self.flush()
