"""Rebuilding a catalog from the refs and results alone (`trajstore reindex`), moving a
DuckDB file that cannot be read aside first."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import sqlalchemy as sa

from trajstore.catalog import tables
from trajstore.catalog.db import (
    Catalog,
    _duckdb_file,
    _is_lock_error,
    open_catalog,
    shown_url,
)
from trajstore.catalog.rows import LoadDocument, MismatchOf
from trajstore.catalog.sync import StoreSource, SyncStats, sync_catalog, writer_lock
from trajstore.errors import (
    CatalogDamagedError,
    StoreError,
    TrajstoreError,
    disk_full_error,
)
from trajstore.refspace import RefSpace


@dataclass(frozen=True)
class ReindexStats(SyncStats):
    #: where a DuckDB file that could not be read or written was moved (None: it was fine)
    moved_aside: str | None = None
    #: DuckDB's complaint about that file
    reason: str | None = None


def reindex(
    catalog_path_or_url: Path | str,
    store_dir: StoreSource,
    load_document: LoadDocument,
    *,
    lock_timeout: float | None = None,
    mismatch_of: MismatchOf | None = None,
) -> ReindexStats:
    """Rebuild the catalog from refs and results alone.

    A readable catalog is emptied and refilled under its lock. A DuckDB file that cannot
    be opened, or that fails a read or write while it is emptied and refilled (cut short,
    overwritten), is moved aside as `<file>.damaged-<UTC time>` (never deleted: it is the
    user's file) and the catalog is rebuilt in a new file, exactly as after deleting it.
    A held lock, a full disk, a catalog newer than this trajstore and a server catalog's
    errors are raised, never rebuilt. `mismatch_of` computes the mismatch sums of a ref
    stored without them (trajstore.mismatch; the CLI passes the store's).
    """
    target = str(catalog_path_or_url)
    url = target if "://" in target else f"duckdb:///{Path(target).resolve()}"
    kwargs = {} if lock_timeout is None else {"lock_timeout": lock_timeout}
    home = None if isinstance(store_dir, RefSpace) else store_dir
    file = _duckdb_file(sa.engine.make_url(url))
    try:
        catalog = open_catalog(home, url, **kwargs)
    except Exception as exc:
        reason = _unusable_file(exc) if file is not None else None
        if reason is None:
            if isinstance(exc, TrajstoreError) or disk_full_error(exc):
                raise
            line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise StoreError(f"cannot open catalog {shown_url(url)} for reindex: {line}") from None
    else:
        try:
            return _refill(catalog, store_dir, load_document, mismatch_of)
        except CatalogDamagedError as exc:  # a block the open did not read
            if file is None:
                raise
            reason = exc.reason
    aside = _move_aside(Path(file))
    stats = _refill(open_catalog(home, url, **kwargs), store_dir, load_document, mismatch_of)
    return replace(stats, moved_aside=None if aside is None else str(aside), reason=reason)


def _refill(
    catalog: Catalog,
    store_dir: StoreSource,
    load_document: LoadDocument,
    mismatch_of: MismatchOf | None = None,
) -> ReindexStats:
    """Empty every index table of an open catalog (closed on return), then sync it."""
    with catalog:
        with catalog.begin() as conn:
            writer_lock(conn)  # a server catalog's writers wait, then see the empty tables
            for table in tables.INDEX_TABLES:
                conn.execute(table.delete())
            conn.execute(tables.sync_state.update().values(high_water=None, listing=None))
            if conn.dialect.name == "postgresql":
                # ids restart as in a new catalog, so the rebuilt one answers identically
                # (DuckDB cannot restart a sequence; its reindex of a readable file keeps
                # counting, and a rebuild from a moved-aside file starts at 1)
                for seq in (tables.REPLAY_RESULTS_ID_SEQ, tables.ROUTER_METRICS_ID_SEQ):
                    conn.exec_driver_sql(f"ALTER SEQUENCE {seq.name} RESTART WITH 1")
        s = sync_catalog(catalog, store_dir, load_document, mismatch_of=mismatch_of)
    return ReindexStats(s.new_refs, s.new_tombstones, s.new_results)


def _unusable_file(exc: Exception) -> str | None:
    """Why a DuckDB catalog file that failed to open is to be rebuilt (one line), or None
    when `exc` is no reason to: a damaged file or any database error opening it, but not
    a lock held by another process, a full disk or a refusal of ours (a newer catalog)."""
    if isinstance(exc, CatalogDamagedError):
        return exc.reason
    if isinstance(exc, TrajstoreError) or _is_lock_error(exc) or disk_full_error(exc):
        return None
    from trajstore.catalog.direct import driver

    db_errors = (sa.exc.DBAPIError, driver().Error)
    if not isinstance(exc, db_errors) and not isinstance(getattr(exc, "orig", None), db_errors):
        return None  # a bug of ours: rebuilding would only hide it
    text = str(getattr(exc, "orig", None) or exc).strip()
    return (text.splitlines() or [type(exc).__name__])[0][:300]


def _move_aside(file: Path) -> Path | None:
    """Rename a catalog file (and its WAL) to `<name>.damaged-<UTC time>[-N]`; the new
    name, or None when there was no file to keep."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    aside = file.with_name(f"{file.name}.damaged-{stamp}")
    n = 1
    while aside.exists() or aside.with_name(aside.name + ".wal").exists():
        n += 1
        aside = file.with_name(f"{file.name}.damaged-{stamp}-{n}")
    try:
        try:
            os.rename(file, aside)
        except FileNotFoundError:
            return None  # nothing to keep: the catalog is created anew
        with contextlib.suppress(FileNotFoundError):
            os.rename(file.with_name(file.name + ".wal"), aside.with_name(aside.name + ".wal"))
    except OSError as e:
        raise StoreError(
            f"catalog {file} cannot be read and cannot be moved aside to rebuild it: {e}"
        ) from None
    return aside
