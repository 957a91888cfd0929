"""How a command brings the catalog up to date: by backend and by role.

- The DuckDB file of a local store (the default): readers open it and sync from
  a full listing of the refs (one process holds the file; writers never touch
  it). Unchanged from before server catalogs.
- A server catalog (PostgreSQL, any non-DuckDB URL), shared by many hosts:
  **readers never list the store**; they read the rows. **Writers** (ingest,
  rm, replay --record) apply what they published right after publishing it,
  with `sync_new`: a listing of the names after the high-water mark only, so
  the cost follows what is new, and a writer that crashed between its ref and
  its rows is healed by the next writer's `sync_new` (or by `reindex`).

The ref/result documents stay the commit point either way; the catalog is an
index over them (docs/catalog.md "Server catalogs").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trajstore.catalog.db import Catalog, open_catalog
from trajstore.catalog.sync import (
    LoadDocument,
    SyncStats,
    sync_catalog,
    sync_new,
)
from trajstore.listing import listing_margin_s


def is_server_url(url: str | None) -> bool:
    """Whether a catalog URL names a shared server database (not a DuckDB file)."""
    return bool(url) and not str(url).startswith("duckdb:")


@contextlib.contextmanager
def reading(
    home: Path | str | None,
    url: str | None,
    source: Any,
    load_document: LoadDocument,
) -> Iterator[Catalog]:
    """The catalog for reading, held for the `with` block.

    `home` is where the default DuckDB file lives, `source` the store's refs (a
    directory or a ref space). A DuckDB catalog is synced from a full listing
    first; a server catalog is read as it is, without listing anything.
    """
    cat = open_catalog(home, url)
    try:
        if cat.is_duckdb:
            sync_catalog(cat, source, load_document)
        yield cat
    finally:
        cat.close()


def record_new(
    home: Path | str | None,
    url: str | None,
    source: Any,
    load_document: LoadDocument,
) -> SyncStats | None:
    """After a writer published documents: apply them to a server catalog now
    (`sync_new`). Nothing for a DuckDB catalog (its next reader syncs); None then."""
    if not is_server_url(url):
        return None
    with open_catalog(home, url) as cat:
        return sync_new(cat, source, load_document, margin_s=listing_margin_s())
