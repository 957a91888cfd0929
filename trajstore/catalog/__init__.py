"""The catalog: a SQL index over the store's refs and replay results.

The refs and result documents are the truth; the catalog can always be
rebuilt from them (reindex). See docs/catalog.md for tables and concurrency.
"""

from trajstore.catalog.db import (
    CATALOG_FILE,
    DEFAULT_LOCK_TIMEOUT,
    Catalog,
    catalog_url,
    migrate,
    open_catalog,
)
from trajstore.catalog.queries import (
    MAX_PAGE_SIZE,
    get_bundle,
    list_bundles,
    list_runs,
    lookup_rollout,
    lookup_step,
    payloads_of,
    provenance_of,
    query_divergences,
    query_router_metrics,
    query_steps,
    recorded_result_exists,
    results_of,
    router_lineage_of,
    run_readonly_sql,
    samples_of,
    stats,
)
from trajstore.catalog.sync import (
    IncrementalStats,
    SyncStats,
    changes,
    reindex,
    sync_catalog,
    sync_new,
)

__all__ = [
    "CATALOG_FILE",
    "DEFAULT_LOCK_TIMEOUT",
    "MAX_PAGE_SIZE",
    "Catalog",
    "IncrementalStats",
    "SyncStats",
    "catalog_url",
    "changes",
    "get_bundle",
    "list_bundles",
    "list_runs",
    "lookup_rollout",
    "lookup_step",
    "migrate",
    "open_catalog",
    "payloads_of",
    "provenance_of",
    "query_divergences",
    "query_router_metrics",
    "query_steps",
    "recorded_result_exists",
    "reindex",
    "results_of",
    "router_lineage_of",
    "run_readonly_sql",
    "samples_of",
    "stats",
    "sync_catalog",
    "sync_new",
]
