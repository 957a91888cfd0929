"""The catalog of a store, for the catalog-only commands (ls, query, sql).

These commands need the catalog and nothing of the object layer: `trajstore.store`
pulls in numpy, zstandard, blake3 and the bundle reader. On a local store's own
DuckDB file that is at the head revision and in step with the refs (the listing its
last sync applied is unchanged), they read it through the `duckdb` module alone
(trajstore.catalog.direct: no SQLAlchemy, no migration check, no sync). Otherwise
the catalog is opened the full way (SQLAlchemy, migrations, a sync from the refs),
and the store's object layer is imported only when the sync meets a ref not yet in
the catalog. Same checks, rows and messages either way as `Store.open(create=False)`
and `Store.catalog()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Mirrors trajstore.store.layout (MARKER, BUNDLE_REFS); importing that module would
# import trajstore.store and with it the object layer. tests/test_cli_imports.py pins
# that both agree.
MARKER = "TRAJSTORE_STORE"
BUNDLE_REFS = Path("refs") / "bundles"


def store_root(path: str | Path) -> Path:
    """The store directory, refused (as Store.open(create=False) does) if it is not a store."""
    from trajstore.errors import StoreError

    root = Path(path)  # a leading ~ was expanded with the command line (cli._expand_store)
    if not ((root / MARKER).is_file() and (root / BUNDLE_REFS).is_dir()):
        raise StoreError(f"{root}: not a trajstore store (no {MARKER})")
    return root


@contextlib.contextmanager
def synced_catalog(path: str | Path, url: str | None = None) -> Iterator[Any]:
    """The store's catalog for reading; held only for the `with` block. The DuckDB file
    is synced from the refs first; a server catalog (`url`) is read without listing them
    (trajstore.catalog.access)."""
    if str(path).startswith("s3://"):  # a remote store: its catalog needs the object layer
        from trajstore.store import Store

        remote = Store.open(str(path), create=False, catalog_url=url)
        with remote, remote.catalog() as cat:
            yield cat
        return
    root = store_root(path)
    from trajstore.catalog.access import is_server_url
    from trajstore.catalog.db import open_catalog
    from trajstore.catalog.sync import sync_catalog

    if is_server_url(url):
        with open_catalog(root, url) as cat:
            yield cat
        return

    store = None

    def load_document(h: str) -> dict:
        nonlocal store
        if store is None:
            from trajstore.store import Store

            store = Store(root)
        return store.load_document(h)

    try:
        cat = open_catalog(root, url)
        try:
            sync_catalog(cat, root, load_document)
            yield cat
        finally:
            cat.close()
    finally:
        if store is not None:
            store.close()


def _all_pages(fn: Any, limit: int | None, **kw: Any) -> list[dict]:
    """Every row of a paged catalog query (up to `limit`), page by page."""
    from trajstore.catalog.listings import MAX_PAGE_SIZE

    out: list[dict] = []
    cursor = None
    while True:
        page = fn(
            limit=MAX_PAGE_SIZE if limit is None else min(limit - len(out), MAX_PAGE_SIZE),
            cursor=cursor,
            **kw,
        )
        out += page["items"]
        cursor = page.get("next_cursor")
        if not cursor or (limit is not None and len(out) >= limit):
            return out


class PagedReader:
    """The reads of ls/query/sql over an open Catalog (SQLAlchemy, any backend), with the
    methods and results of trajstore.catalog.direct.DirectCatalog."""

    def __init__(self, catalog: Any) -> None:
        self.catalog = catalog

    def _pages(self, name: str, limit: int | None, **kw: Any) -> list[dict]:
        from functools import partial

        from trajstore.catalog import queries

        return _all_pages(partial(getattr(queries, name), self.catalog), limit, **kw)

    def run_names(self) -> list[str]:
        from trajstore.catalog.queries import run_names

        return run_names(self.catalog)

    def bundles(self, limit: int | None = None, columns: Any = None, **kw: Any) -> list[dict]:
        """`columns` is a hint: whole rows are returned."""
        return self._pages("list_bundles", limit, **kw)

    def steps(self, limit: int | None = None, columns: Any = None, **kw: Any) -> list[dict]:
        """`columns` is a hint: whole items are returned."""
        return self._pages("query_steps", limit, **kw)

    def divergences(self, limit: int | None = None, **kw: Any) -> list[dict]:
        return self._pages("query_divergences", limit, **kw)

    def router_metrics(self, limit: int | None = None, **kw: Any) -> list[dict]:
        return self._pages("query_router_metrics", limit, **kw)

    def count(self, what: str, **filters: Any) -> int:
        from trajstore.catalog.listings import count
        from trajstore.catalog.queries import executor

        dialect = "duckdb" if self.catalog.is_duckdb else "postgresql"
        return count(executor(self.catalog), what, filters, dialect)

    def mismatch(self, q: Any, limit: int | None = None) -> list[dict]:
        from trajstore.catalog.queries import executor
        from trajstore.mismatch.query import steps

        return steps(executor(self.catalog), q, limit)

    def mismatch_layers(self, q: Any) -> list[dict]:
        from trajstore.catalog.queries import executor
        from trajstore.mismatch.query import layers

        return layers(executor(self.catalog), q)

    def readonly_sql(self, sql: str) -> tuple[list[str], list[list]]:
        from trajstore.catalog.queries import run_readonly_sql

        return run_readonly_sql(self.catalog, sql)


@contextlib.contextmanager
def catalog_reader(path: str | Path, url: str | None = None) -> Iterator[Any]:
    """The store's catalog for ls/query/sql, synced, held for the `with` block: a
    DirectCatalog when the store's own DuckDB file can be read as it is, else a
    PagedReader over the full open + sync (synced_catalog)."""
    if url is None and not str(path).startswith("s3://"):
        from trajstore.catalog.direct import DirectCatalog, NeedsFullOpen, damage_guard

        root = store_root(path)
        try:
            direct = DirectCatalog.open(root)
        except NeedsFullOpen:
            pass
        else:
            with direct, damage_guard(direct.file):  # a block the open did not read
                yield direct
            return
    with synced_catalog(path, url) as cat:
        yield PagedReader(cat)


#: rows a table of `ls` and `query` prints when no --limit is given (docs/cli.md): a
#: table is read by a person, and printing 100,000 rows costs seconds of Python per
#: command; one line on stderr says how many more there are. CSV and JSON list every row.
TABLE_ROWS = 1000


def listed(
    reader: Any, what: str, limit: int | None, table: bool, **kw: Any
) -> tuple[list[dict], int]:
    """The rows of the listing `what` (the reader's method: "bundles", "steps",
    "divergences", "router_metrics") a command prints, and how many more rows the whole
    listing has when a `table` was cut (else 0). `limit` is the command's --limit: N the
    first N rows; 0 every row; None, the default, the first TABLE_ROWS of a table and
    every row of CSV or JSON. A table reads one row past its limit to know whether it is
    cut, and only then asks the database for the count (the listing's own statement,
    counted: no row of the rest is fetched)."""
    if limit == 0 or (limit is None and not table):
        return getattr(reader, what)(limit=None, **kw), 0
    if limit is None:
        limit = TABLE_ROWS
    if not table:
        return getattr(reader, what)(limit=limit, **kw), 0
    rows = getattr(reader, what)(limit=limit + 1, **kw)
    if len(rows) <= limit:
        return rows, 0
    filters = {name: value for name, value in kw.items() if name != "columns"}
    # at least one: the row past the limit was read (a writer may remove rows in between)
    return rows[:limit], max(reader.count(what, **filters) - limit, 1)


def left_out_line(more: int, limited: bool, formats: str) -> str:
    """The one stderr line of a table cut short; `limited`: by the command's --limit
    (else by TABLE_ROWS); `formats`: the output options that list every row."""
    rows = "row" if more == 1 else "rows"
    also = "" if limited else f" (as does {formats})"
    return f"trajstore: {more} more {rows} not shown; --limit 0 lists every row{also}"


def check_run(reader: Any, run: str | None) -> None:
    """Refuse a --run the catalog does not know (`check_known_run`)."""
    if run is not None:
        from trajstore.errors import check_known_run

        check_known_run(run, reader.run_names())


def all_bundles(cat: Any, run: str | None, kind: str | None, all_attempts: bool) -> list[dict]:
    """Every catalog row of published bundles, page by page (as Store.bundles)."""
    return PagedReader(cat).bundles(run=run, kind=kind, include_all_attempts=all_attempts)
