"""Content-addressed store: a verified object space and Zarr v3 payload arrays on top of it.

`CASZarrStore` (for stock zarr-python readers) is imported lazily so that
`import trajstore.cas` does not pay for importing zarr.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trajstore.cas.arrays import (
    CHUNK_TOKENS_SCALAR,
    CHUNK_TOKENS_TOKENWISE,
    ArrayRecord,
    chunk_tokens_for,
    load_record,
    read_array,
    read_rows,
    record_objects,
    write_array,
)
from trajstore.cas.local import LocalObjectStore
from trajstore.cas.objects import (
    MemoryObjectStore,
    ObjectInfo,
    ObjectStore,
    RepackResult,
    check_hash,
    object_hash,
)

if TYPE_CHECKING:
    from trajstore.cas.zarr_store import CASZarrStore

__all__ = [
    "CHUNK_TOKENS_SCALAR",
    "CHUNK_TOKENS_TOKENWISE",
    "ArrayRecord",
    "CASZarrStore",
    "LocalObjectStore",
    "MemoryObjectStore",
    "ObjectInfo",
    "ObjectStore",
    "RepackResult",
    "check_hash",
    "chunk_tokens_for",
    "load_record",
    "object_hash",
    "read_array",
    "read_rows",
    "record_objects",
    "write_array",
]


def __getattr__(name: str) -> Any:
    if name == "CASZarrStore":
        from trajstore.cas.zarr_store import CASZarrStore

        return CASZarrStore
    raise AttributeError(f"module 'trajstore.cas' has no attribute {name!r}")
