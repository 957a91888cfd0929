"""The synced catalog of a store, for the catalog-only commands (ls, query, sql).

These commands need the catalog (SQLAlchemy + DuckDB) and nothing of the object
layer: `trajstore.store` pulls in numpy, zstandard, blake3 and the bundle
reader, a few hundred ms before the first row. The store's object layer is
imported only when the sync meets a ref not yet in the catalog (its documents
are loaded from the object store); a catalog already in step with the refs is
read without it. Same checks and messages as `Store.open(create=False)` and
`Store.catalog()`.
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

    root = Path(path)
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


def all_bundles(cat: Any, run: str | None, kind: str | None, all_attempts: bool) -> list[dict]:
    """Every catalog row of published bundles, page by page (as Store.bundles)."""
    from trajstore.catalog.queries import MAX_PAGE_SIZE, list_bundles

    out: list[dict] = []
    cursor = None
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
        if not cursor:
            return out
