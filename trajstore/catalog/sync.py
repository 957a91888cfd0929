"""Incremental sync of the catalog from the store's refs and results.

The refs (`refs/bundles`, `refs/tombstones`) and results (`results/`) are the
truth; the catalog only indexes them. A sync lists the three directories
(cheap), applies the file names not yet in `synced_documents`, and records
them in the same transaction. Applying a document is idempotent and its
effect does not depend on the order documents arrive in, so a rebuild from
scratch (`reindex`) answers every query exactly as the incremental catalog.
"""

from __future__ import annotations

import bisect
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from trajstore.catalog import tables
from trajstore.catalog.apply import (
    apply_refs,
    apply_results,
    apply_tombstone,
    insert_rows,
    recompute_latest,
)
from trajstore.catalog.db import Catalog
from trajstore.catalog.direct import accounted_last, dir_stat, listing_record
from trajstore.catalog.rows import Doc, LoadDocument, MismatchOf
from trajstore.errors import StoreError
from trajstore.listing import DEFAULT_MARGIN_S, listing_start
from trajstore.refspace import LocalRefSpace, RefSpace

BATCH_SIZE = 256  # documents per transaction


# directory in synced_documents -> folder of the store's ref space
DIRECTORIES = {
    "bundles": "refs/bundles",
    "tombstones": "refs/tombstones",
    "results": "results",
}


StoreSource = Path | str | RefSpace  # a store directory, or any ref space (an S3 store's)


@dataclass(frozen=True)
class SyncStats:
    new_refs: int = 0
    new_tombstones: int = 0
    new_results: int = 0


def _space(store: StoreSource) -> RefSpace:
    return store if isinstance(store, RefSpace) else LocalRefSpace(Path(store))


def _list_names(space: RefSpace, directory: str) -> list[str]:
    """Published document names (finished atomic creates only), sorted."""
    return [n for n in space.list_names(DIRECTORIES[directory]) if n.endswith(".json")]


# -- sync --------------------------------------------------------------------------


def _synced_names(conn: sa.Connection, directory: str, after: str | None = None) -> set[str]:
    """Names of one directory's documents already applied to the catalog (only those
    greater than `after` when given)."""
    synced = tables.synced_documents
    if conn.dialect.name == "duckdb":
        # fetched in bulk by the driver: SQLAlchemy's per-row result handling costs about
        # 20 us a row, most of a no-op sync on a store of 10,000 refs
        sql = f"SELECT name FROM {synced.name} WHERE directory = ?"
        params = [directory]
        if after is not None:
            sql += " AND name > ?"
            params.append(after)
        rows = conn.connection.driver_connection.execute(sql, params).fetchall()
        return {row[0] for row in rows}
    query = sa.select(synced.c.name).where(synced.c.directory == directory)
    if after is not None:
        query = query.where(synced.c.name > after)
    return set(conn.execute(query).scalars())


def _recorded_listing(conn: sa.Connection, directory: str) -> str | None:
    state = tables.sync_state
    return conn.execute(
        sa.select(state.c.listing).where(state.c.directory == directory)
    ).scalar_one_or_none()


#: the PostgreSQL advisory lock every apply transaction takes (pg_advisory_xact_lock):
#: concurrent writers' applies are serialised, so `is_latest` and `runs` stay exact
WRITER_LOCK_ID = 0x7472616A  # "traj"


@dataclass(frozen=True)
class _Doc:
    """A document read before the apply transaction (its bytes and where it came from)."""

    data: bytes
    location: str

    def read_bytes(self) -> bytes:
        return self.data

    def __str__(self) -> str:
        return self.location


def _fetch(space: RefSpace, folder: str, name: str) -> Doc:
    """The document's bytes, read now (outside any transaction); unreadable ones stay
    lazy so that applying them raises the usual one-line error."""
    ref = space.doc(f"{folder}/{name}")
    try:
        return _Doc(ref.read_bytes(), str(ref))
    except OSError:
        return ref


def _prefetched(items: list[tuple[str, Doc]], load_document: LoadDocument) -> LoadDocument:
    """A loader holding the manifest/index/expected of these refs, loaded up front, so a
    server catalog's write lock is never held while objects are fetched."""
    cache: dict[str, dict] = {}
    for _, doc in items:
        try:
            documents = json.loads(doc.read_bytes()).get("documents") or {}
        except (OSError, ValueError, AttributeError):
            continue
        for digest in documents.values():
            if isinstance(digest, str) and digest not in cache:
                try:
                    cache[digest] = load_document(digest)
                except Exception:  # applying loads it again and reports it properly
                    continue

    def load(digest: str) -> dict:
        hit = cache.get(digest)
        return hit if hit is not None else load_document(digest)

    return load


def writer_lock(conn: sa.Connection) -> None:
    """Serialise apply transactions on a server catalog (DuckDB: one process anyway)."""
    if conn.dialect.name == "postgresql":
        conn.execute(sa.select(sa.func.pg_advisory_xact_lock(WRITER_LOCK_ID)))


def _synced_among(conn: sa.Connection, directory: str, names: list[str]) -> set[str]:
    """Which of `names` are already applied (one bounded query, not the whole table)."""
    synced = tables.synced_documents
    found: set[str] = set()
    for start in range(0, len(names), 1000):
        part = names[start : start + 1000]
        found.update(
            conn.execute(
                sa.select(synced.c.name).where(
                    synced.c.directory == directory, synced.c.name.in_(part)
                )
            ).scalars()
        )
    return found


def _apply_batch(
    catalog: Catalog,
    space: RefSpace,
    directory: str,
    names: list[str],
    load_document: LoadDocument | None,
    mismatch_of: MismatchOf | None = None,
) -> int:
    """Apply one batch of documents in one transaction; returns how many were new.

    On a server catalog the transaction takes the writer lock and skips names another
    process applied meanwhile, so concurrent syncs never apply a document twice.
    """
    if directory == "bundles" and load_document is None:
        raise StoreError("sync of bundle refs needs a document loader")
    folder = DIRECTORIES[directory]
    items = [(name, _fetch(space, folder, name)) for name in names]
    if directory == "bundles":
        load_document = _prefetched(items, load_document)
    with catalog.begin() as conn:
        writer_lock(conn)
        if not catalog.is_duckdb:
            done = _synced_among(conn, directory, names)
            items = [(name, doc) for name, doc in items if name not in done]
        if not items:
            return 0
        if directory == "bundles":
            apply_refs(conn, items, load_document, mismatch_of)
        elif directory == "tombstones":
            anchors = [apply_tombstone(conn, name, doc) for name, doc in items]
            recompute_latest(conn, (a for a in anchors if a is not None))
        else:
            apply_results(conn, items)
        insert_rows(
            conn,
            tables.synced_documents,
            [{"directory": directory, "name": name} for name, _ in items],
        )
        state = tables.sync_state
        conn.execute(
            state.update()
            .where(state.c.directory == directory)
            .values(applied=state.c.applied + len(items))
        )
    return len(items)


def _raise_mark(catalog: Catalog, directory: str, listed: list[str]) -> None:
    """Record the newest listed name as the directory's high-water mark (never lowers it)."""
    if not listed:
        return
    state = tables.sync_state
    newest = max(listed)
    with catalog.begin() as conn:
        conn.execute(
            state.update()
            .where(
                state.c.directory == directory,
                sa.or_(state.c.high_water.is_(None), state.c.high_water < newest),
            )
            .values(high_water=newest)
        )


#: documents applied by one sync after which a server catalog's statistics are refreshed
ANALYZE_AFTER = 500


def _analyze_if_bulk(catalog: Catalog, applied: int) -> None:
    """Refresh PostgreSQL's planner statistics after a bulk apply (a first sync, a
    reindex): with the empty tables' estimates the planner picks nested loops that
    turn a 40 ms query_steps into seconds. Autovacuum would get there, minutes later."""
    if catalog.is_duckdb or applied < ANALYZE_AFTER:
        return
    names = ", ".join(table.name for table in (*tables.INDEX_TABLES, tables.sync_state))
    with catalog.begin() as conn:
        conn.exec_driver_sql(f"ANALYZE {names}")


def _record_listing(catalog: Catalog, directory: str, record: str) -> None:
    """Store the listing a sync has just applied in full (sync_state.listing), so that a
    reader which lists the same skips the sync (trajstore.catalog.direct). Stat and names
    were taken before the applies: the record never names a document that is not in the
    catalog. Written only when it changed."""
    state = tables.sync_state
    with catalog.begin() as conn:
        conn.execute(
            state.update()
            .where(
                state.c.directory == directory,
                sa.or_(state.c.listing.is_(None), state.c.listing != record),
            )
            .values(listing=record)
        )


def _source(catalog: Catalog, store_dir: StoreSource | None) -> RefSpace:
    source = store_dir if store_dir is not None else catalog.store_dir
    if source is None:
        raise StoreError("sync needs the store directory (--store)")
    return _space(source)


def sync_catalog(
    catalog: Catalog,
    store_dir: StoreSource | None = None,
    load_document: LoadDocument | None = None,
    *,
    batch_size: int = BATCH_SIZE,
    mismatch_of: MismatchOf | None = None,
) -> SyncStats:
    """Apply refs, tombstones and results not yet in the catalog (a full listing).

    Works the same on the file catalog and on an in-memory snapshot, for a
    store directory or any ref space (an S3 store's). The DuckDB catalog of a
    local store syncs this way on every open; a server catalog uses it only to
    rebuild (reindex) and keeps current with `sync_new`.
    """
    store = _source(catalog, store_dir)
    counts = {}
    # tombstones first: a ref removed (and perhaps collected) is then indexed as removed
    for directory in ("tombstones", "bundles", "results"):
        folder = store.root / DIRECTORIES[directory] if isinstance(store, LocalRefSpace) else None
        listed_ns = time.time_ns()
        stat = dir_stat(folder) if folder is not None else None
        names = _list_names(store, directory)
        with catalog.connect() as conn:
            last = None
            if catalog.is_duckdb and folder is not None:
                # the recorded listing accounted for: only names after its last can be new
                last = accounted_last(_recorded_listing(conn, directory), names)
            done = _synced_names(conn, directory, after=last)
        if last is not None:
            new = [n for n in names[bisect.bisect_right(names, last) :] if n not in done]
        else:
            new = [n for n in names if n not in done]
        counts[directory] = 0
        for start in range(0, len(new), batch_size):
            batch = new[start : start + batch_size]
            counts[directory] += _apply_batch(
                catalog, store, directory, batch, load_document, mismatch_of
            )
        if not catalog.is_duckdb:
            _raise_mark(catalog, directory, names)
        elif folder is not None:
            _record_listing(catalog, directory, listing_record(names, stat, listed_ns))
    _analyze_if_bulk(catalog, sum(counts.values()))
    return SyncStats(
        new_refs=counts["bundles"],
        new_tombstones=counts["tombstones"],
        new_results=counts["results"],
    )


def _list_after(space: RefSpace, directory: str, after: str | None) -> list[str]:
    """Document names after `after` (all when None), sorted.

    A space with `list_after(folder, after)` (an object store: one listing request
    from `after` on, e.g. S3 ListObjectsV2 StartAfter) is asked for exactly those; a
    local directory is read by name only (one readdir, no per-file stat or read).
    """
    folder = DIRECTORIES[directory]
    lister = getattr(space, "list_after", None)
    if lister is not None:
        names = [d if isinstance(d, str) else d.name for d in lister(folder, after)]
    elif isinstance(space, LocalRefSpace):
        try:
            with os.scandir(space.root / folder) as entries:
                names = [e.name for e in entries if not e.name.startswith(".")]
        except FileNotFoundError:
            names = []
    else:
        names = [d.name for d in space.list(folder)]
    return sorted(n for n in names if n.endswith(".json") and (after is None or n > after))


@dataclass(frozen=True)
class IncrementalStats(SyncStats):
    """A `sync_new`: what was applied, and how many names the listing returned."""

    listed: int = 0
    listed_after: dict[str, str | None] | None = None


def sync_new(
    catalog: Catalog,
    store_dir: StoreSource | None = None,
    load_document: LoadDocument | None = None,
    *,
    margin_s: float = DEFAULT_MARGIN_S,
    batch_size: int = BATCH_SIZE,
) -> IncrementalStats:
    """Apply the documents published since the high-water mark (server catalogs).

    Lists only names after (mark - margin): the cost follows what is new, not the
    store's size. Names are `<time_ns>-<pid>-<hex>`, so a document named up to
    `margin_s` before the newest one already seen (clock skew between hosts, a slow
    upload) is still found; what the listing returns is checked against
    synced_documents by name (one bounded query), and only the missing ones are
    read and applied. Then the mark moves to the newest listed name. Correct with
    any number of concurrent writers: applies are serialised and skip what another
    process applied first (`_apply_batch`).
    """
    store = _source(catalog, store_dir)
    state = tables.sync_state
    with catalog.connect() as conn:
        marks = dict(conn.execute(sa.select(state.c.directory, state.c.high_water)).all())
    now_ns = time.time_ns()
    counts: dict[str, int] = {}
    starts: dict[str, str | None] = {}
    listed = 0
    for directory in ("tombstones", "bundles", "results"):
        after = listing_start(marks.get(directory), margin_s, now_ns=now_ns)
        starts[directory] = after
        names = _list_after(store, directory, after)
        listed += len(names)
        with catalog.connect() as conn:
            done = _synced_among(conn, directory, names)
        new = [n for n in names if n not in done]
        counts[directory] = 0
        for start in range(0, len(new), batch_size):
            batch = new[start : start + batch_size]
            counts[directory] += _apply_batch(catalog, store, directory, batch, load_document)
        _raise_mark(catalog, directory, names)
    _analyze_if_bulk(catalog, sum(counts.values()))
    return IncrementalStats(
        new_refs=counts["bundles"],
        new_tombstones=counts["tombstones"],
        new_results=counts["results"],
        listed=listed,
        listed_after=starts,
    )


def changes(catalog: Catalog) -> int:
    """Documents applied to this catalog so far: a counter that grows with every sync
    that applied something (a server polls it instead of listing the store)."""
    state = tables.sync_state
    with catalog.connect() as conn:
        return int(
            conn.execute(sa.select(sa.func.coalesce(sa.func.sum(state.c.applied), 0))).scalar_one()
        )
