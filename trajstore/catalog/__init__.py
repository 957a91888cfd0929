"""The catalog: a SQL index over the store's refs and replay results.

The refs and result documents are the truth; the catalog can always be
rebuilt from them (reindex). See docs/catalog.md for tables and concurrency.

The names below are loaded on first use: importing a submodule that needs no
SQLAlchemy (trajstore.catalog.direct, the CLI's reader) does not import it.
"""

from __future__ import annotations

import importlib
from typing import Any

#: public name -> the submodule that defines it
_EXPORTS = {
    **dict.fromkeys(
        ("CATALOG_FILE", "DEFAULT_LOCK_TIMEOUT", "Catalog", "catalog_url", "migrate"), "db"
    ),
    "open_catalog": "db",
    **dict.fromkeys(
        (
            "MAX_PAGE_SIZE",
            "get_bundle",
            "list_bundles",
            "list_runs",
            "lookup_rollout",
            "lookup_step",
            "payloads_of",
            "provenance_of",
            "query_divergences",
            "query_router_metrics",
            "query_steps",
            "recorded_result_exists",
            "results_of",
            "router_lineage_of",
            "run_readonly_sql",
            "samples_of",
            "stats",
        ),
        "queries",
    ),
    **dict.fromkeys(
        ("IncrementalStats", "SyncStats", "changes", "sync_catalog", "sync_new"), "sync"
    ),
    **dict.fromkeys(("ReindexStats", "reindex"), "reindex"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
