"""Where things live in a store, and the index of its refs.

    <store>/packs/, objects/, tmp/      the object space (trajstore.cas.LocalObjectStore)
    <store>/refs/bundles/<name>.json    one immutable ref per published bundle (commit point)
    <store>/refs/tombstones/<name>.json `trajstore rm` marks; gc honours them
    <store>/refs/claims/<id>.a<N>       attempt-number claims (who owns attempt N of an identity)
    <store>/results/<name>.json         replay results (written by replay --record)
    <store>/catalog.duckdb              the index; rebuildable from refs (reindex)

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

from trajstore.errors import NotFoundError, StoreError
from trajstore.refspace import RefSpace, atomic_create

__all__ = ["RefEntry", "RefIndex", "StoreLayout", "atomic_create", "new_doc_name"]

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
    def tombstones(self) -> Path:
        return self.root / TOMBSTONES

    @property
    def claims(self) -> Path:
        return self.root / CLAIMS

    @property
    def results(self) -> Path:
        return self.root / RESULTS

    @property
    def marker(self) -> Path:
        return self.root / MARKER

    def ensure(self) -> None:
        """Create the directory skeleton (idempotent, safe to race)."""
        try:
            for d in (self.bundle_refs, self.tombstones, self.claims, self.results):
                d.mkdir(parents=True, exist_ok=True)
            if not self.marker.exists():
                atomic_create(self.marker, MARKER_TEXT, durable=False)
        except OSError as e:
            raise StoreError(f"cannot use {self.root} as a store: {e}") from None

    def is_store(self) -> bool:
        return self.marker.is_file() and self.bundle_refs.is_dir()


def list_docs(space: RefSpace, folder: str) -> list[str]:
    """Names (without `.json`) of published documents in `folder`, oldest first."""
    return [d.name[:-5] for d in space.list(folder) if d.name.endswith(".json")]


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


class RefIndex:
    """Incremental view of `refs/`: reads only refs and tombstones published since the last refresh.

    Needs no catalog (and no lock): ingest and export work while another
    process holds the catalog. A key's newest ref wins; it is live unless a
    tombstone newer than that ref names the key.
    """

    def __init__(self, space: RefSpace) -> None:
        self.space = space
        self._refs: dict[str, RefEntry] = {}
        self._bad: dict[str, str] = {}
        self._tombs: dict[str, str] = {}  # tombstone name -> key
        self._stamps: dict[str, int] = {}
        self._live: dict[str, RefEntry] | None = None
        self._anchors: dict[tuple, list[RefEntry]] | None = None

    def invalidate(self) -> None:
        """Forget when the folders were last listed: the next refresh lists them
        (after this process published a ref or a tombstone)."""
        self._stamps.clear()

    def refresh(self, *, force: bool = False) -> None:
        if force:
            self.invalidate()
        before = (len(self._refs), len(self._bad), len(self._tombs))
        if self.space.changed(BUNDLE_REFS_KEY, self._stamps):
            self._refresh_refs()
        if self.space.changed(TOMBSTONES_KEY, self._stamps):
            self._refresh_tombstones()
        if (len(self._refs), len(self._bad), len(self._tombs)) != before:
            self._live = self._anchors = None

    def _refresh_refs(self) -> None:
        for name in list_docs(self.space, BUNDLE_REFS_KEY):
            if name in self._refs or name in self._bad:
                continue
            try:
                d = self.read(name)
                cr = d.get("cohort_ranks")
                self._refs[name] = RefEntry(
                    name,
                    str(d["key"]),
                    str(d["run"]),
                    str(d["kind"]),
                    int(d["rollout_id"]),
                    d.get("step_id"),
                    d.get("rank"),
                    int(d["attempt"]),
                    None if cr is None else tuple(int(r) for r in cr),
                    str(d.get("content_digest")),
                )
            except (StoreError, KeyError, TypeError, ValueError) as e:
                self._bad[name] = f"ref {name}: unreadable ({e})"

    def _refresh_tombstones(self) -> None:
        for name in list_docs(self.space, TOMBSTONES_KEY):
            if name not in self._tombs:
                try:
                    d = json.loads(self.space.read(f"{TOMBSTONES_KEY}/{name}.json"))
                    self._tombs[name] = str(d["key"])
                except (StoreError, ValueError, KeyError, TypeError) as e:
                    self._bad[name] = f"tombstone {name}: unreadable ({e})"

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
                anchors.setdefault((e.run, e.kind, e.rollout_id, e.step_id), []).append(e)
            self._anchors = anchors
        return list(self._anchors.get((run, kind, rollout_id, step_id), ()))
