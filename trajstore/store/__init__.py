"""The store: bundles kept as content-addressed objects plus one ref per published bundle.

See docs/store.md for the layout, the Python API and the crash-safety model.
"""

from trajstore.store.api import DEFAULT_RUN, Store
from trajstore.store.export import export_bundles
from trajstore.store.ingest import IngestOutcome
from trajstore.store.stored_bundle import StoredBundle

__all__ = ["DEFAULT_RUN", "IngestOutcome", "Store", "StoredBundle", "export_bundles"]
