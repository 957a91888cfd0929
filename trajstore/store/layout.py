"""Where things live in a store directory, and the one atomic primitive: create-if-absent.

    <store>/packs/, objects/, tmp/      the object space (trajstore.cas.LocalObjectStore)
    <store>/refs/bundles/<name>.json    one immutable ref per published bundle (commit point)
    <store>/refs/tombstones/<name>.json `trajstore rm` marks; gc honours them
    <store>/refs/claims/<id>.a<N>       attempt-number claims (who owns attempt N of an identity)
    <store>/results/<name>.json         replay results (written by replay --record)
    <store>/catalog.duckdb              the index; rebuildable from refs (reindex)

`<name>` = `<time_ns:020d>-<pid>-<random hex>`: unique without a lock and
sorting by age, which the catalog relies on (a newer ref of a key wins).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trajstore.errors import StoreError

REFS = Path("refs")
BUNDLE_REFS = REFS / "bundles"
TOMBSTONES = REFS / "tombstones"
CLAIMS = REFS / "claims"
RESULTS = Path("results")
MARKER = "TRAJSTORE_STORE"


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
                atomic_create(self.marker, b"trajstore store, layout 1\n", durable=False)
        except OSError as e:
            raise StoreError(f"cannot use {self.root} as a store: {e}") from None

    def is_store(self) -> bool:
        return self.marker.is_file() and self.bundle_refs.is_dir()


def list_docs(directory: Path) -> list[str]:
    """Names (without `.json`) of published documents, oldest first."""
    try:
        with os.scandir(directory) as it:
            names = [
                e.name[:-5] for e in it if e.name.endswith(".json") and not e.name.startswith(".")
            ]
    except FileNotFoundError:
        return []
    return sorted(names)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_create(path: Path, data: bytes, *, durable: bool = True) -> bool:
    """Create `path` holding `data` unless it exists; False if it did.

    temp + fsync + link: the final name never holds a partial file and an
    existing file is never replaced, so this is a commit point.
    """
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        if durable:
            _fsync_dir(path.parent)
        return True
    finally:
        tmp.unlink(missing_ok=True)


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

    #: a directory modified this recently is listed again even if its mtime did not
    #: change (coarse file-system timestamps can hide a second entry made in the same tick)
    RACY_NS = 2_000_000_000

    def __init__(self, layout: StoreLayout) -> None:
        self.layout = layout
        self._refs: dict[str, RefEntry] = {}
        self._bad: dict[str, str] = {}
        self._tombs: dict[str, str] = {}  # tombstone name -> key
        self._stamps: dict[Path, int] = {}
        self._live: dict[str, RefEntry] | None = None
        self._anchors: dict[tuple, list[RefEntry]] | None = None

    def _changed(self, directory: Path) -> bool:
        """Whether `directory` may hold entries not listed yet (cheap: one stat)."""
        try:
            stamp = directory.stat().st_mtime_ns
        except FileNotFoundError:
            return True
        if self._stamps.get(directory) == stamp:
            return False
        if time.time_ns() - stamp > self.RACY_NS:
            self._stamps[directory] = stamp
        return True

    def refresh(self) -> None:
        before = (len(self._refs), len(self._bad), len(self._tombs))
        if self._changed(self.layout.bundle_refs):
            self._refresh_refs()
        if self._changed(self.layout.tombstones):
            self._refresh_tombstones()
        if (len(self._refs), len(self._bad), len(self._tombs)) != before:
            self._live = self._anchors = None

    def _refresh_refs(self) -> None:
        for name in list_docs(self.layout.bundle_refs):
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
        for name in list_docs(self.layout.tombstones):
            if name not in self._tombs:
                try:
                    d = json.loads((self.layout.tombstones / f"{name}.json").read_bytes())
                    self._tombs[name] = str(d["key"])
                except (OSError, ValueError, KeyError, TypeError) as e:
                    self._bad[name] = f"tombstone {name}: unreadable ({e})"

    def read(self, name: str) -> dict[str, Any]:
        """The full ref document `name`."""
        path = self.layout.bundle_refs / f"{name}.json"
        try:
            doc = json.loads(path.read_bytes())
        except (OSError, ValueError) as e:
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
