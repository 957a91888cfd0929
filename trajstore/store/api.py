"""The Python API of a store (the CLI is a thin layer over it).

    from trajstore.store import Store

    store = Store.open("runs.store")
    store.ingest(["capture/"], run="baseline")
    (b,) = store.step("baseline", 120, 0)          # one StoredBundle per rank
    lp = b.payload_tensor("log_probs")             # torch tensor, dtype preserved
    store.runs(); store.bundles(run="baseline")

Lookups go through the refs directly (no catalog lock needed); listings go
through the catalog, which is synced from the refs whenever it is opened.

A store is a directory (the default) or `s3://BUCKET/PREFIX`: the URL picks
the object space and the ref space; everything above them is the same code.
An S3 store without a catalog URL keeps a DuckDB catalog rebuilt from its refs
in a local cache directory (`store_cache_dir`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import numbers
import os
import secrets
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from trajstore.cas import LocalObjectStore, ObjectStore
from trajstore.errors import (
    NotFoundError,
    StoreError,
    TrajstoreError,
    UsageError,
    check_known_run,
)
from trajstore.jsonio import user_path
from trajstore.refspace import LocalRefSpace, RefSpace
from trajstore.store.ingest import Ingestor, IngestOutcome, check_run_name
from trajstore.store.ingest_pipeline import ingest_paths
from trajstore.store.layout import (
    MARKER,
    MARKER_TEXT,
    TOMBSTONES_KEY,
    RefEntry,
    RefIndex,
    StoreLayout,
    anchor_label,
    new_doc_name,
)
from trajstore.store.stored_bundle import StoredBundle, get_json_blob

DEFAULT_RUN = "default"
#: the RefIndex cache file inside an S3 store's local cache directory
REF_CACHE = "ref-index.json"


def anchor_id(value: object, what: str) -> int:
    """`value` as an id: integers only (numpy's too). `int()` made 3.9 step 3, True step 1
    and a step given as "12" the pair 1:2."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise UsageError(f"{what} must be an integer, not {type(value).__name__} {value!r}")
    return int(value)


def is_remote(location: str | os.PathLike[str]) -> bool:
    """Whether a store location is an object-store URL (`s3://...`) rather than a directory."""
    return isinstance(location, str) and location.startswith("s3://")


def store_cache_dir(url: str, marker: bytes = b"") -> Path:
    """Local cache of a remote store (its DuckDB catalog): `$TRAJSTORE_CACHE_DIR` or
    `~/.cache/trajstore`, then 16 hex digits of the sha256 of the URL and the store's
    marker (which holds a random id), so a store created anew at a URL gets a new cache."""
    base = os.environ.get("TRAJSTORE_CACHE_DIR") or Path.home() / ".cache" / "trajstore"
    return user_path(base) / hashlib.sha256(url.encode() + b"\n" + marker).hexdigest()[:16]


class Store:
    """A store: object space + ref space + catalog.

    `root` is the store directory; for an S3 store it is the local cache
    directory (where its default DuckDB catalog lives) and `url` is the bucket.
    """

    def __init__(
        self,
        root: Path,
        *,
        durable: bool = True,
        catalog_url: str | None = None,
        objs: ObjectStore | None = None,
        space: RefSpace | None = None,
        url: str | None = None,
    ) -> None:
        self.root = Path(root)
        self.layout = StoreLayout(self.root)
        self.durable = durable
        self.catalog_url = catalog_url
        self.url = url or str(root)
        self.objs: ObjectStore = (
            objs if objs is not None else LocalObjectStore(root, durable=durable)
        )
        self.space: RefSpace = space if space is not None else LocalRefSpace(root, durable=durable)
        # the parsed refs persist in `root` (an S3 store's local cache directory, or the
        # store directory beside its DuckDB catalog), so opening a store reads only the
        # refs published since (RefIndex)
        self.refs = RefIndex(self.space, cache=self.root / REF_CACHE)

    @property
    def is_remote(self) -> bool:
        return is_remote(self.url)

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        create: bool = True,
        durable: bool = True,
        catalog_url: str | None = None,
    ) -> Store:
        """Open (or with `create`, initialise) the store at `path` (a directory or s3:// URL)."""
        if is_remote(path):
            return cls._open_s3(str(path), create=create, catalog_url=catalog_url)
        root = user_path(path)
        layout = StoreLayout(root)
        if not layout.is_store():
            if not create:
                raise StoreError(f"{root}: not a trajstore store (no {layout.marker.name})")
            if root.exists() and not root.is_dir():
                raise StoreError(f"{root}: exists and is not a directory")
            if root.is_dir() and any(root.iterdir()) and not (root / "refs").is_dir():
                raise StoreError(f"{root}: not empty and not a trajstore store; refusing to use it")
            layout.ensure()
        return cls(root, durable=durable, catalog_url=catalog_url)

    @classmethod
    def _open_s3(cls, url: str, *, create: bool, catalog_url: str | None) -> Store:
        from trajstore.cas.s3 import S3ObjectStore, S3RefSpace, parse_s3_url, s3_client

        loc = parse_s3_url(url)
        client = s3_client(loc.bucket)
        space = S3RefSpace(client, loc)
        try:
            marker = space.read(MARKER)
        except NotFoundError:
            if not create:
                raise StoreError(f"{loc.url}: not a trajstore store (no {MARKER})") from None
            space.create_if_absent(MARKER, MARKER_TEXT + f"id {secrets.token_hex(8)}\n".encode())
            marker = space.read(MARKER)  # ours, or a racing creator's
        cache = store_cache_dir(loc.url, marker)
        return cls(
            cache,
            catalog_url=catalog_url,
            objs=S3ObjectStore(client, loc, index_cache=cache / "pack-index"),
            space=space,
            url=loc.url,
        )

    def close(self) -> None:
        self.objs.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing --

    def ingest(
        self,
        paths: Iterable[str | os.PathLike[str]],
        run: str = DEFAULT_RUN,
        *,
        progress: bool | None = False,
        on_outcome: Callable[[IngestOutcome], None] | None = None,
    ) -> list[IngestOutcome]:
        """Ingest bundles/cohorts/capture dirs; refused targets are reported, not raised.

        `on_outcome` is called as each target is done (published, unchanged or
        refused), so a caller can report progress an interruption cannot lose.
        """
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        ing = Ingestor(self.space, self.objs, self.refs)
        # as given: Path("") would be the current directory, which discovery refuses
        outcomes = ingest_paths(ing, list(paths), run, progress=progress, on_outcome=on_outcome)
        if any(o.status == "published" for o in outcomes):
            self.index_new()
        return outcomes

    def remove(self, keys: Iterable[str] = (), *, run: str | None = None) -> list[str]:
        """Tombstone bundles (by key) or a whole run; nothing is deleted until gc.

        A rank of a cohort goes only with every other rank of its attempt: one alone
        would leave a step that lists but that replay and export refuse as incomplete.
        """
        live = self.refs.live()
        targets = [keys] if isinstance(keys, str) else list(keys)  # one key, not its letters
        for k in targets:
            if k not in live:
                raise NotFoundError(f"no published bundle {k!r}")
        if run is not None:
            # training order (a rollout, then its steps), not publication order: batched
            # ingest publishes refs concurrently, and the listing must not depend on that
            mine = [
                e.key
                for e in sorted(
                    (e for e in live.values() if e.run == run),
                    key=lambda e: (e.rollout_id, e.kind != "rollout", e.step_id or 0, e.key),
                )
            ]
            if not mine:  # a run stored under an older, looser rule stays removable
                check_run_name(run)
                raise NotFoundError(f"run {run!r} has no published bundles")
            targets += mine
        self._refuse_part_of_a_cohort(live, targets)
        from trajstore.store.publish import now

        for k in dict.fromkeys(targets):
            doc = {"tombstone_version": 1, "key": k, "removed_at": now()}
            self.space.create_if_absent(
                f"{TOMBSTONES_KEY}/{new_doc_name()}.json", json.dumps(doc, sort_keys=True).encode()
            )
        self.refs.invalidate()
        self.index_new()
        return list(dict.fromkeys(targets))

    def _refuse_part_of_a_cohort(self, live: dict[str, RefEntry], targets: list[str]) -> None:
        """Refuse (nothing removed) targets holding some but not every live rank of one
        cohort attempt: the rest would list as a step that replay and export refuse."""
        chosen = set(targets)
        seen: set[tuple] = set()
        for key in targets:
            e = live[key]
            attempt = (e.run, e.kind, e.rollout_id, e.step_id, e.attempt)
            if e.cohort_ranks is None or attempt in seen:
                continue
            seen.add(attempt)
            cohort = sorted(
                (m for m in self.refs.at_anchor(*attempt[:4]) if m.attempt == e.attempt),
                key=lambda m: -1 if m.rank is None else m.rank,
            )
            if any(m.key not in chosen for m in cohort):
                what = anchor_label(e.kind, e.rollout_id, e.step_id)
                raise UsageError(
                    f"{key} is one rank of run {e.run!r} {what} attempt {e.attempt}; a cohort "
                    "is removed whole (its other ranks would list but not replay), so name "
                    f"every rank: trajstore rm {' '.join(m.key for m in cohort)}"
                )

    # -- reading --

    def load_document(self, h: str) -> dict:
        """A stored JSON document (manifest/index/expected)
        by object hash (the catalog's loader)."""
        doc = get_json_blob(self.objs, h)
        if not isinstance(doc, dict):
            raise StoreError(f"document object {h} is not a JSON object")
        return doc

    def mismatch_of(self, ref: dict) -> dict:
        """The mismatch entry of a ref stored without one, computed from its payloads
        (reindex); its per-sample document is not kept (a ref is never rewritten)."""
        from trajstore.mismatch.compute import not_computed, source_mismatch

        try:
            entry, _ = source_mismatch(StoredBundle(self.objs, ref, str(ref.get("key"))))
        except (TrajstoreError, ValueError, KeyError, TypeError) as exc:
            return not_computed(f"not_computed: {str(exc).splitlines()[0]}")
        return entry

    def _stored(self, e: RefEntry) -> StoredBundle:
        return StoredBundle(self.objs, self.refs.read(e.name), e.name)

    def bundle(self, key: str, run: str | None = None, attempt: int | None = None) -> StoredBundle:
        """One published bundle by key (e.g. `default/step-120-0/rank-0/a1`).

        A key names its run and attempt; `run` / `attempt` (a caller's --run / --attempt
        beside --bundle) must agree with it, or the call is refused rather than either
        being ignored.
        """
        e = self.refs.live().get(key)
        if e is None:
            self.refs.refresh(force=True)  # published since the last listing?
            e = self.refs.live().get(key)
        if e is None:
            raise NotFoundError(f"no published bundle {key!r}")
        if run is not None and e.run != run:
            raise UsageError(
                f"bundle {key!r} is of run {e.run!r}, not of run {run!r}: "
                "name the bundle alone or with its own run"
            )
        if attempt is not None and e.attempt != attempt:
            raise UsageError(
                f"bundle {key!r} is attempt {e.attempt}, not attempt {attempt}: "
                "name the bundle alone or with its own attempt"
            )
        return self._stored(e)

    def _group(
        self, run: str, kind: str, rollout_id: int, step_id: int | None, attempt: int | None
    ) -> list[StoredBundle]:
        if attempt is not None:
            attempt = anchor_id(attempt, "attempt")
        what = anchor_label(kind, rollout_id, step_id)
        cands = self.refs.at_anchor(run, kind, rollout_id, step_id)
        if not cands:
            self.refs.refresh(force=True)  # published since the last listing?
            cands = self.refs.at_anchor(run, kind, rollout_id, step_id)
        if not cands:  # say so when it is the run that is not there
            check_known_run(run, (e.run for e in self.refs.live().values()))
            raise NotFoundError(f"run {run!r} has no {what}")
        if attempt is None:
            attempt = max(e.attempt for e in cands)
        chosen = sorted(
            (e for e in cands if e.attempt == attempt),
            key=lambda e: -1 if e.rank is None else e.rank,
        )
        if not chosen:
            have = sorted({e.attempt for e in cands})
            raise NotFoundError(f"run {run!r} {what} has no attempt {attempt} (attempts: {have})")
        want = chosen[0].cohort_ranks
        if want is not None and sorted(e.rank for e in chosen) != sorted(want):
            have = sorted(e.rank for e in chosen)
            raise NotFoundError(
                f"run {run!r} {what} attempt {attempt}: cohort incomplete "
                f"(ranks {have} of {list(want)} published); re-run the ingest to complete it"
            )
        return [self._stored(e) for e in chosen]

    def step(
        self, run: str, rollout_id: int, step_id: int, attempt: int | None = None
    ) -> list[StoredBundle]:
        """Every rank of actor step (rollout_id, step_id):
        the latest attempt unless one is named."""
        rollout_id, step_id = anchor_id(rollout_id, "rollout_id"), anchor_id(step_id, "step_id")
        return self._group(run, "step", rollout_id, step_id, attempt)

    def rollout(self, run: str, rollout_id: int, attempt: int | None = None) -> list[StoredBundle]:
        """Every rank of the rollout-level bundle of `rollout_id`."""
        return self._group(run, "rollout", anchor_id(rollout_id, "rollout_id"), None, attempt)

    def attempts(
        self, run: str, kind: str, rollout_id: int, step_id: int | None = None
    ) -> list[int]:
        return sorted({e.attempt for e in self.refs.at_anchor(run, kind, rollout_id, step_id)})

    # -- the catalog --

    @contextlib.contextmanager
    def catalog(self) -> Iterator[Any]:
        """The catalog for reading, held only for the `with` block: the DuckDB file is
        synced from the refs first; a server catalog is read without listing them."""
        from trajstore.catalog.access import reading

        with reading(self.root, self.catalog_url, self.space, self.load_document) as cat:
            yield cat

    def index_new(self) -> Any:
        """After publishing (ingest, rm, replay --record): apply the new documents to a
        server catalog now (returns the sync's stats); a DuckDB catalog catches up when
        it is next read (returns None)."""
        if not self.catalog_url or self.catalog_url.startswith("duckdb:"):
            return None  # without importing the catalog (SQLAlchemy) on every ingest
        from trajstore.catalog.access import record_new

        return record_new(self.root, self.catalog_url, self.space, self.load_document)

    def runs(self) -> list[dict]:
        from trajstore.catalog import list_runs

        with self.catalog() as cat:
            return list_runs(cat)

    def bundles(
        self,
        run: str | None = None,
        kind: str | None = None,
        *,
        all_attempts: bool = False,
        limit: int | None = None,
    ) -> list[dict]:
        """Catalog rows of published bundles (latest attempts unless `all_attempts`)."""
        from trajstore.catalog import MAX_PAGE_SIZE, list_bundles
        from trajstore.catalog.queries import run_names

        if kind not in (None, "step", "rollout"):
            raise UsageError(f"kind must be 'step' or 'rollout', not {kind!r}")
        if limit is not None and (anchor_id(limit, "limit") < 0):
            raise UsageError(f"limit must be 0 or more, not {limit}")
        out: list[dict] = []
        cursor = None
        with self.catalog() as cat:
            check_known_run(run, run_names(cat))  # a misspelt run is not "no bundles"
            while True:
                page = list_bundles(
                    cat,
                    run=run,
                    kind=kind,
                    include_all_attempts=all_attempts,
                    limit=MAX_PAGE_SIZE,
                    cursor=cursor,
                )
                out += page["items"]
                cursor = page.get("next_cursor")
                if not cursor or (limit is not None and len(out) >= limit):
                    break
        return out[:limit] if limit is not None else out

    def reindex(self) -> dict:
        """Rebuild the catalog from refs and results alone."""
        from trajstore.catalog import CATALOG_FILE, reindex

        target = self.catalog_url or str(self.root / CATALOG_FILE)
        s = reindex(target, self.space, self.load_document, mismatch_of=self.mismatch_of)
        return {
            "new_refs": s.new_refs,
            "new_tombstones": s.new_tombstones,
            "new_results": s.new_results,
            "moved_aside": s.moved_aside,
            "reason": s.reason,
        }
