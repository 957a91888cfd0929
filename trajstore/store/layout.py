"""Where things live in a store, and the index of its refs.

    <store>/packs/, objects/, tmp/      the object space (trajstore.cas.LocalObjectStore)
    <store>/refs/bundles/<name>.json    one immutable ref per published bundle (commit point)
    <store>/refs/tombstones/<name>.json `trajstore rm` marks; gc honours them
    <store>/refs/claims/<id>.a<N>       attempt-number claims (who owns attempt N of an identity)
    <store>/results/<name>.json         replay results (written by replay --record)
    <store>/catalog.duckdb              the index; rebuildable from refs (reindex)
    <store>/ref-index.json              the parsed refs (RefIndex's cache; any process rewrites it)

`<name>` = `<time_ns:020d>-<pid>-<random hex>`: unique without a lock and
sorting by age, which the catalog relies on (a newer ref of a key wins).
The same relative keys name the documents of an S3 store (`s3://BUCKET/PREFIX/refs/...`);
every document goes through a `RefSpace`, whose one atomic primitive is create-if-absent.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from trajstore.errors import NotFoundError, StoreError
from trajstore.jsonio import atomic_create
from trajstore.listing import listing_margin_s, listing_start
from trajstore.refspace import RefSpace

__all__ = ["RefEntry", "RefIndex", "StoreLayout", "new_doc_name"]

REFS = Path("refs")
BUNDLE_REFS = REFS / "bundles"
TOMBSTONES = REFS / "tombstones"
CLAIMS = REFS / "claims"
RESULTS = Path("results")
MARKER = "TRAJSTORE_STORE"
MARKER_TEXT = b"trajstore store, layout 1\n"

#: the same places as keys of a RefSpace (`/`-separated, relative to the store)
BUNDLE_REFS_KEY = BUNDLE_REFS.as_posix()
TOMBSTONES_KEY = TOMBSTONES.as_posix()
CLAIMS_KEY = CLAIMS.as_posix()
RESULTS_KEY = RESULTS.as_posix()


def new_doc_name() -> str:
    """A fresh, unique, age-sortable document name (without `.json`)."""
    return f"{time.time_ns():020d}-{os.getpid()}-{secrets.token_hex(6)}"


@dataclass(frozen=True)
class StoreLayout:
    """Paths of one store directory."""

    root: Path

    @property
    def bundle_refs(self) -> Path:
        return self.root / BUNDLE_REFS

    @property
    def marker(self) -> Path:
        return self.root / MARKER

    def ensure(self) -> None:
        """Create the directory skeleton (idempotent, safe to race)."""
        try:
            for d in (BUNDLE_REFS, TOMBSTONES, CLAIMS, RESULTS):
                (self.root / d).mkdir(parents=True, exist_ok=True)
            if not self.marker.exists():
                atomic_create(self.marker, MARKER_TEXT, durable=False)
        except OSError as e:
            raise StoreError(f"cannot use {self.root} as a store: {e}") from None

    def is_store(self) -> bool:
        return self.marker.is_file() and self.bundle_refs.is_dir()


def anchor_label(kind: str, rollout_id: int, step_id: int | None) -> str:
    """How messages name an anchor: ``step 120:0`` or ``rollout 120``."""
    return f"step {rollout_id}:{step_id}" if kind == "step" else f"rollout {rollout_id}"


@dataclass(frozen=True)
class RefEntry:
    """What the ref index keeps of one ref in memory (the full document is read on demand)."""

    name: str
    key: str
    run: str
    kind: str
    rollout_id: int
    step_id: int | None
    rank: int | None
    attempt: int
    cohort_ranks: tuple[int, ...] | None
    content_digest: str


#: the format tag of a RefIndex cache file (anything else there is ignored and rebuilt)
REFINDEX_CACHE_FORMAT = "trajstore-refindex-2"
#: documents read since the cache was written before it is written again (or 1/32 of them)
CACHE_SAVE_MIN = 256


def _entry_from_doc(name: str, d: dict[str, Any]) -> RefEntry:
    cr = d.get("cohort_ranks")
    return RefEntry(
        name,
        str(d["key"]),
        str(d["run"]),
        str(d["kind"]),
        int(d["rollout_id"]),
        None if d.get("step_id") is None else int(d["step_id"]),
        None if d.get("rank") is None else int(d["rank"]),
        int(d["attempt"]),
        None if cr is None else tuple(int(r) for r in cr),
        str(d.get("content_digest")),
    )


#: what each cached column may hold, in RefEntry's field order (a cache is read only when
#: every value fits: the entries then equal those `_entry_from_doc` would build)
_COLUMN_TYPES: tuple[tuple[type, ...], ...] = (
    (str,),  # name
    (str,),  # key
    (str,),  # run
    (str,),  # kind
    (int,),  # rollout_id
    (int, type(None)),  # step_id
    (int, type(None)),  # rank
    (int,),  # attempt
    (list, type(None)),  # cohort_ranks (ints, checked below)
    (str,),  # content_digest
)


def _column_ok(types: tuple[type, ...], column: list) -> bool:
    if not isinstance(column, list) or not all(type(x) in types for x in column):
        return False
    if list in types:
        return all(x is None or all(type(r) is int for r in x) for x in column)
    return True


def _anchor_of(e: RefEntry) -> tuple:
    return (e.run, e.kind, e.rollout_id, e.step_id)


class RefIndex:
    """Incremental view of `refs/`: reads only refs and tombstones published since the last refresh.

    Needs no catalog (and no lock): ingest and export work while another
    process holds the catalog. A key's newest ref wins; it is live unless a
    tombstone newer than that ref names the key.

    On a space that lists from a name on (`list_after`, an S3 bucket), a refresh
    lists only names after the newest one known minus `listing_margin_s()` (names
    start with their writer's clock). With `cache` the parsed entries persist in a
    local file, so a command pays for what is new, not for the store's size (reading
    110,000 local ref documents took ~5 s warm, ~20 s from a cold page cache). A
    local space is still listed in full (one directory read): only the documents are
    not read again, and a cached name no longer listed is dropped. Ref and tombstone
    documents are immutable once created, so a cached entry of a listed name is the
    document's. `refresh(force=True)` lists everything (lookups that miss, publish
    conflicts, fsck and gc), so a writer whose clock is behind by more than the
    margin is still found there.

    The cache is rewritten whole. For an S3 space, after every refresh that read
    something (a document read again costs a request); for a local one, when this index
    was built without a cache, then only once the documents read since its last write
    reach `CACHE_SAVE_MIN` or 1/32 of the index: a process that adds a few refs leaves
    them for the next one to read (~40 us each), not a rewrite of every entry per batch.
    """

    def __init__(self, space: RefSpace, cache: Path | None = None) -> None:
        self.space = space
        self.cache = cache
        self._refs: dict[str, RefEntry] = {}
        self._bad: dict[str, str] = {}
        self._tombs: dict[str, str] = {}  # tombstone name -> key
        self._stamps: dict[str, int] = {}
        self._marks: dict[str, str] = {}  # folder -> newest name listed there
        self._live: dict[str, RefEntry] | None = None
        self._anchors: dict[tuple, list[RefEntry]] | None = None
        # what `_live` is derived from, kept while it is: key -> newest ref, key -> newest
        # tombstone name (so a refresh updates it by what it read, not by every ref)
        self._newest: dict[str, RefEntry] = {}
        self._removed: dict[str, str] = {}
        self._incremental = hasattr(space, "list_after")
        self._margin_s: float | None = None
        self._loaded = False
        #: ref and tombstone documents read by this index (what the cache saves)
        self.reads = 0
        self._unsaved = 0  # documents read since the cache was last written
        self._saved = False  # the cache was adopted or written by this index
        #: folders whose cached names are still to be checked against a full listing
        self._unchecked: set[str] = set()
        #: a space listed in full: what each folder listed last (only the rest is new)
        self._seen: dict[str, set[str]] = {BUNDLE_REFS_KEY: set(), TOMBSTONES_KEY: set()}

    def invalidate(self) -> None:
        """Forget when the folders were last listed: the next refresh lists them
        (after this process published a ref or a tombstone)."""
        self._stamps.clear()

    def refresh(self, *, force: bool = False) -> None:
        """Read what was published since; `force`: list both folders in full now."""
        if not self._loaded:
            self._loaded = True
            self._load_cache()
        if force:
            self.invalidate()
        before = (len(self._refs), len(self._bad), len(self._tombs))
        refs: list[str] = []
        tombs: list[str] = []
        if self.space.changed(BUNDLE_REFS_KEY, self._stamps):
            refs = self._refresh_refs(self._listing(BUNDLE_REFS_KEY, full=force))
        if self.space.changed(TOMBSTONES_KEY, self._stamps):
            tombs = self._refresh_tombstones(self._listing(TOMBSTONES_KEY, full=force))
        if (len(self._refs), len(self._bad), len(self._tombs)) != before:
            self._update_live(refs, tombs)
            self._unsaved += len(refs) + len(tombs)
            if (
                not self._saved
                or self._incremental  # a document read again over the network costs more
                or self._unsaved >= max(CACHE_SAVE_MIN, len(self._refs) // 32)
            ):
                self._save_cache()

    def _listing(self, folder: str, *, full: bool) -> list[str]:
        """Names (without `.json`) to consider: on a space listed in full, those it did not
        list last time (all with `full`); otherwise all, or those after mark - margin."""
        if not self._incremental:
            listed, fresh = self.space.list_new(folder, set() if full else self._seen[folder])
            self._seen[folder] = listed
            if folder in self._unchecked:  # cached names a full listing no longer has
                self._unchecked.discard(folder)
                known = self._refs if folder == BUNDLE_REFS_KEY else self._tombs
                for gone in [n for n in known if f"{n}.json" not in listed]:
                    del known[gone]
            return [n[:-5] for n in fresh if n.endswith(".json")]
        if self._margin_s is None:
            self._margin_s = listing_margin_s()
        after = None if full else listing_start(self._marks.get(folder), self._margin_s)
        names = [
            n[:-5]
            for n in self.space.list_after(folder, after)  # type: ignore[attr-defined]
            if n.endswith(".json")
        ]
        if names and names[-1] > self._marks.get(folder, ""):
            self._marks[folder] = names[-1]
        return names

    def _refresh_refs(self, names: list[str]) -> list[str]:
        """Read the refs among `names` not read before; the names of those added."""
        added = []
        for name in names:
            if name in self._refs or name in self._bad:
                continue
            try:
                self.reads += 1
                self._refs[name] = _entry_from_doc(name, self.read(name))
                added.append(name)
            except (StoreError, KeyError, TypeError, ValueError) as e:
                self._bad[name] = f"ref {name}: unreadable ({e})"
        return added

    def _refresh_tombstones(self, names: list[str]) -> list[str]:
        """Read the tombstones among `names` not read before; the names of those added."""
        added = []
        for name in names:
            if name not in self._tombs:
                try:
                    self.reads += 1
                    d = json.loads(self.space.read(f"{TOMBSTONES_KEY}/{name}.json"))
                    self._tombs[name] = str(d["key"])
                    added.append(name)
                except (StoreError, ValueError, KeyError, TypeError) as e:
                    self._bad[name] = f"tombstone {name}: unreadable ({e})"
        return added

    def _update_live(self, refs: list[str], tombs: list[str]) -> None:
        """`_live` (and `_anchors`) after `refs` and `tombs` were read: each is a new dict
        (one handed out before stays as it was), changed only at the keys they name, so a
        refresh that reads 100 new refs into a store of 100,000 costs a copy, not a sort
        of every ref. Before the first `live()`, nothing is built (it builds it whole)."""
        if self._live is None:
            self._anchors = None
            return
        keys: set[str] = set()
        for name in refs:
            e = self._refs[name]
            old = self._newest.get(e.key)
            if old is None or old.name < e.name:
                self._newest[e.key] = e
                keys.add(e.key)
        for name in tombs:
            key = self._tombs[name]
            if self._removed.get(key, "") < name:
                self._removed[key] = name
                keys.add(key)
        before, live = self._live, dict(self._live)
        for key in keys:
            e = self._newest.get(key)
            if e is not None and self._removed.get(key, "") < e.name:
                live[key] = e
            else:
                live.pop(key, None)
        self._live = live
        if self._anchors is not None:
            anchors = dict(self._anchors)
            for key in keys:
                old, new = before.get(key), live.get(key)
                if old is new:
                    continue
                if old is not None:
                    at = _anchor_of(old)
                    kept = [m for m in anchors.get(at, ()) if m is not old]
                    if kept:
                        anchors[at] = kept
                    else:
                        anchors.pop(at, None)
                if new is not None:
                    at = _anchor_of(new)
                    anchors[at] = [*anchors.get(at, ()), new]
            self._anchors = anchors

    # -- the local cache (a speed-up only: anything odd there is ignored) --

    def _load_cache(self) -> None:
        """Adopt the cached entries if the file is ours, well typed, and its newest ref
        still reads back the same from the space; otherwise start empty (a full listing)."""
        if self.cache is None:
            return
        try:
            doc = orjson.loads(self.cache.read_bytes())
            if doc.get("format") != REFINDEX_CACHE_FORMAT:
                return
            if doc.get("location") != self.space.location:
                return
            cols = [doc["refs"][f] for f in RefEntry.__dataclass_fields__]
            if len({len(c) for c in cols}) != 1 or not all(
                _column_ok(t, c) for t, c in zip(_COLUMN_TYPES, cols, strict=True)
            ):
                return
            cols[8] = [None if cr is None else tuple(cr) for cr in cols[8]]
            refs = dict(zip(cols[0], map(RefEntry, *cols), strict=True))
            tombs = doc["tombs"]
            marks = {
                f: str(doc["marks"][f])
                for f in (BUNDLE_REFS_KEY, TOMBSTONES_KEY)
                if f in doc["marks"]
            }
            if not all(type(n) is str and type(k) is str for n, k in tombs.items()):
                return
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return
        if refs:
            newest = max(refs)
            try:
                self.reads += 1
                if _entry_from_doc(newest, self.read(newest)) != refs[newest]:
                    return
            except (StoreError, KeyError, TypeError, ValueError):
                return
        self._refs, self._tombs, self._marks = refs, tombs, marks
        self._saved = True
        if not self._incremental:  # listed in full: a name gone since is dropped then
            self._unchecked = {BUNDLE_REFS_KEY, TOMBSTONES_KEY}

    def _save_cache(self) -> None:
        self._saved = True
        self._unsaved = 0
        if self.cache is None:
            return
        entries = list(self._refs.values())
        refs: dict[str, list] = {
            f: [getattr(e, f) for e in entries] for f in RefEntry.__dataclass_fields__
        }
        doc = {
            "format": REFINDEX_CACHE_FORMAT,
            "location": self.space.location,
            "marks": self._marks,
            "refs": refs,  # one column per RefEntry field, in field order
            "tombs": self._tombs,
        }
        tmp = self.cache.with_name(f".{self.cache.name}.{os.getpid()}-{secrets.token_hex(4)}")
        try:
            self.cache.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(orjson.dumps(doc))
            os.replace(tmp, self.cache)
        except OSError:
            tmp.unlink(missing_ok=True)  # a cache only

    def read(self, name: str) -> dict[str, Any]:
        """The full ref document `name`."""
        key = f"{BUNDLE_REFS_KEY}/{name}.json"
        path = self.space.where(key)
        try:
            doc = json.loads(self.space.read(key))
        except NotFoundError:
            raise StoreError(f"ref {path} is unreadable: it does not exist") from None
        except (StoreError, ValueError) as e:
            raise StoreError(f"ref {path} is unreadable: {e}") from None
        if not isinstance(doc, dict) or doc.get("ref_version") != 1:
            raise StoreError(f"ref {path} is not a version-1 ref document")
        return doc

    @property
    def problems(self) -> list[str]:
        return list(self._bad.values())

    def all(self) -> list[RefEntry]:
        self.refresh()
        return sorted(self._refs.values(), key=lambda e: e.name)

    def live(self) -> dict[str, RefEntry]:
        """key -> newest ref of that key, for keys not removed since (do not mutate)."""
        self.refresh()
        if self._live is None:
            newest: dict[str, RefEntry] = {}
            for e in sorted(self._refs.values(), key=lambda e: e.name):
                newest[e.key] = e
            removed: dict[str, str] = {}
            for tname, key in self._tombs.items():
                removed[key] = max(removed.get(key, ""), tname)
            self._newest, self._removed = newest, removed
            self._live = {k: e for k, e in newest.items() if removed.get(k, "") < e.name}
        return self._live

    def at_anchor(
        self, run: str, kind: str, rollout_id: int, step_id: int | None
    ) -> list[RefEntry]:
        """Live refs of one anchor (every rank and attempt): a lookup by actor step id."""
        live = self.live()
        if self._anchors is None:
            anchors: dict[tuple, list[RefEntry]] = {}
            for e in live.values():
                anchors.setdefault(_anchor_of(e), []).append(e)
            self._anchors = anchors
        return list(self._anchors.get((run, kind, rollout_id, step_id), ()))
