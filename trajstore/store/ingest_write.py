"""Ingest, step 3 of 4: write one verified rank's objects (documents, payload arrays,
their records and envelopes, the mismatch document) and say what its ref will name.

Reads nothing of the bundle: it is handed checked bytes and rows (`ingest_gate`,
`ingest_rows`). The objects may stay buffered in the store's pack until `objs.flush()`;
no ref is created here (`publish`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from trajstore.cas import ArrayRecord, ObjectStore, write_array
from trajstore.cas.blobs import put_blob
from trajstore.cas.chunk_codec import compressor
from trajstore.cas.objects import object_hash
from trajstore.errors import StoreError
from trajstore.mismatch.compute import bundle_entry
from trajstore.schema import Index
from trajstore.store.ingest_rows import BASE_NAMES, DELTA_BASES, PayloadRows


class Recorder(ObjectStore):
    """Delegates to the real store and remembers the size of every object put (a
    bundle's closure: `sizes`) and of those this bundle's writes stored (`added`: not
    held before; what the bundle cost the store, its ref's `added_bytes`)."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.sizes: dict[str, int] = {}
        self.added: dict[str, int] = {}

    def put(self, data: bytes) -> str:
        return self.put_many([data])[0]

    def put_many(self, datas: Iterable[bytes]) -> list[str]:
        return [h for h, _ in self.put_many_added(datas)]

    def put_many_added(self, datas: Iterable[bytes]) -> list[tuple[str, bool]]:
        datas = list(datas)
        out = self.inner.put_many_added(datas)
        for (h, new), d in zip(out, datas, strict=True):
            self.sizes[h] = len(d)
            if new:
                self.added[h] = len(d)
        return out

    def get(self, h: str) -> bytes:
        return self.inner.get(h)

    def get_many(self, hashes):  # noqa: ANN001, ANN201
        return self.inner.get_many(hashes)

    def has(self, h: str) -> bool:
        return self.inner.has(h)

    def has_cached(self, h: str, size: int) -> bool:
        if not self.inner.has_cached(h, size):
            return False
        self.sizes[h] = size  # named by the bundle as if put
        return True

    def iter_objects(self):  # noqa: ANN201
        return self.inner.iter_objects()

    def delete_many(self, hashes: Iterable[str]) -> int:
        raise StoreError("ingest never deletes objects")


@dataclass(frozen=True)
class WrittenBytes:
    """Bytes of one bundle's objects: all it references, and those its write stored."""

    referenced: int
    added: int


def delta_base(records: dict[str, ArrayRecord], rows: PayloadRows) -> ArrayRecord | None:
    """The record `rows` is stored as a delta against (`DELTA_BASES`), when its base is
    already written in `records` with the same geometry; else None."""
    base = records.get(DELTA_BASES.get(rows.name, ""))
    if base is None:
        return None
    values = rows.values
    same = (base.dtype, base.shape[2:], base.row_lengths, base.heads) == (
        values.dtype.name,
        tuple(values.shape[1:]),
        tuple(rows.lengths),
        None if rows.heads is None else tuple(rows.heads),
    )
    return base if same else None


_MISMATCH_POOL: ThreadPoolExecutor | None = None
_MISMATCH_POOL_LOCK = threading.Lock()


def _mismatch_pool() -> ThreadPoolExecutor:
    global _MISMATCH_POOL
    with _MISMATCH_POOL_LOCK:
        if _MISMATCH_POOL is None:
            _MISMATCH_POOL = ThreadPoolExecutor(2, thread_name_prefix="ingest-mismatch")
        return _MISMATCH_POOL


class _Sums:
    """A rank's mismatch sums computed on a pool thread while its last payloads are
    written. The document blob is compressed and named there, and put by the writer
    (`entry`), after the payloads, as a synchronous computation puts it."""

    def __init__(self, kept: dict[str, np.ndarray], index: Index) -> None:
        self.blob: bytes | None = None
        self.future: Future[dict[str, Any]] = _mismatch_pool().submit(
            bundle_entry, self._name, dict(kept).get, index
        )

    def _name(self, data: bytes) -> str:
        self.blob = compressor().compress(data)
        return object_hash(self.blob)

    def entry(self, objs: ObjectStore) -> dict[str, Any]:
        entry = self.future.result()
        if self.blob is not None:
            h = objs.put(self.blob)
            if h != entry["document"]:  # a store that names objects otherwise
                raise StoreError(f"mismatch document stored as {h}, named {entry['document']}")
        return entry


def write_rank(
    objs: ObjectStore,
    documents: dict[str, bytes],
    sentinels: dict[str, bytes],
    cohort_sentinels: dict[str, bytes],
    payloads: Iterable[PayloadRows],
    index: Index,
    mismatch_inputs: frozenset[str] | None = None,
) -> tuple[dict[str, Any], WrittenBytes]:
    """Write a rank's objects: its documents and sentinels as blobs, then each payload
    (delta bases first, as `payloads` comes) as a CAS array, its record and its file's
    envelope, then its mismatch sums' document. The ref body naming them, and its bytes.

    `mismatch_inputs`, the names of the payloads the sums read that `payloads` holds
    (None: not known), lets the sums be computed on another thread from the moment the
    last of them arrives, while it and the payloads after it are written."""
    rec = Recorder(objs)
    docs = {k: put_blob(rec, data) for k, data in documents.items()}
    sents = {name: put_blob(rec, data) for name, data in sentinels.items()}
    csent = {name: put_blob(rec, data) for name, data in cohort_sentinels.items()}
    entries: dict[str, Any] = {}
    records: dict[str, ArrayRecord] = {}
    # Delta bases' values stay in memory while their deltas are written (no read-back).
    base_values: dict[str, np.ndarray] = {}
    # the payloads the mismatch sums read, kept until they are computed (log-probs: [R])
    kept: dict[str, np.ndarray] = {}
    sums: _Sums | None = None
    for rows in payloads:
        if rows.mismatch_input is not None:
            kept[rows.name] = rows.mismatch_input
            if sums is None and mismatch_inputs is not None and kept.keys() >= mismatch_inputs:
                sums = _Sums(kept, index)
        base = delta_base(records, rows)
        record = write_array(
            rec,
            rows.values,
            rows.lengths,
            dtype_tag=rows.dtype_tag,
            base=base,
            base_values=base_values.get(DELTA_BASES[rows.name]) if base is not None else None,
            heads=rows.heads,
        )
        records[rows.name] = record
        if rows.name in BASE_NAMES:
            base_values[rows.name] = rows.values
        f: dict[str, Any] = {"bytes": rows.file_bytes, "sha256": rows.sha256}
        if rows.envelope is not None:
            f.update(envelope=put_blob(rec, rows.envelope), span=list(rows.span or ()))
        else:
            f["whole"] = put_blob(rec, rows.whole or b"")
        entries[rows.name] = {
            "record": rec.put(record.to_object()),
            "dtype": rows.dtype_tag,
            "shape": list(rows.shape),
            "logical_bytes": int(rows.values.nbytes),
            "rows": rows.rows,
            "file": f,
        }
    base_values.clear()
    if sums is not None:
        mismatch = sums.entry(rec)
    else:
        mismatch = bundle_entry(lambda data: put_blob(rec, data), kept.get, index)
    kept.clear()
    body = {
        "documents": docs,
        "sentinels": sents,
        "cohort_sentinels": csent,
        "payloads": entries,
        "mismatch": mismatch,
    }
    return body, WrittenBytes(sum(rec.sizes.values()), sum(rec.added.values()))
