"""A published bundle read straight from the store: the replay engine's source interface.

Documents (manifest/index/expected, sentinels, .pt envelopes) are zstd
"blobs" (`trajstore.cas.blobs`), decoded against a bound.
Payloads are CAS arrays (`trajstore.cas`); `payload_rows` fetches only the
chunks of the selected samples, which is what makes replaying one group of
a 4,000-token-per-sample step cheap.

A lookup is cheap too: a `StoredBundle` reads and checks its manifest and
expected documents at once, and fetches its index object (verified against
its hash), but decodes, parses and validates the index (every sample's loss
mask: most of a bundle's metadata) only on first use of `index` or of any
payload or file, so nothing is handed out before every check has run.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trajstore.bundle.checks import PER_TOKEN_PAYLOADS
from trajstore.cas import ArrayRecord, ObjectStore, load_record, read_array, read_rows
from trajstore.cas.blobs import decode_json_blob, get_blob, get_json_blob
from trajstore.errors import IntegrityError, NotFoundError, UsageError
from trajstore.jsonio import sha256_bytes
from trajstore.pools import SharedPool
from trajstore.schema import Index, Manifest

#: a bundle whose per-token payloads are larger is not read ahead (`StoredBundle.prefetch`):
#: a step read ahead while its rollout replays holds two bundles' payloads at once
READ_AHEAD_MAX_BYTES = 512 << 20
#: payloads read ahead at once (each read decodes a bounded run of rows at a time)
READ_AHEAD_THREADS = min(2, os.cpu_count() or 1)
#: the few threads that read payloads ahead (`StoredBundle.prefetch`)
_prefetch_pool = SharedPool(READ_AHEAD_THREADS, "prefetch")


def ref_objects(objs: ObjectStore, ref: dict[str, Any]) -> set[str]:
    """Every object a ref needs (its closure), following delta bases; reads records."""
    from trajstore.cas import record_objects

    out: set[str] = set(ref["documents"].values())
    out |= set((ref.get("sentinels") or {}).values())
    out |= set((ref.get("cohort_sentinels") or {}).values())
    document = (ref.get("mismatch") or {}).get("document")
    if document:
        out.add(document)
    for p in ref["payloads"].values():
        out.add(p["record"])
        out |= record_objects(objs, load_record(objs, p["record"]))
        f = p.get("file") or {}
        out |= {f[k] for k in ("envelope", "whole") if f.get(k)}
    return out


def payload_file_bytes(objs: ObjectStore, entry: dict[str, Any], record: ArrayRecord) -> bytes:
    """The original `.pt` file of a payload, byte for byte (envelope + tensor bytes spliced)."""
    f = entry["file"]
    if f.get("whole"):
        data = get_blob(objs, f["whole"])
    else:
        env = get_blob(objs, f["envelope"])
        off, ln = f["span"]
        tensor = read_array(objs, record).tobytes()
        if len(tensor) != ln or off > len(env):
            raise IntegrityError(f"payload file of record {entry['record']}: span does not fit")
        data = env[:off] + tensor + env[off:]
    if len(data) != f["bytes"] or sha256_bytes(data) != f["sha256"]:
        raise IntegrityError(
            f"payload file of record {entry['record']} does not reproduce its sha256 "
            f"{f['sha256'][:12]}…"
        )
    return data


def sample_positions(positions: Any) -> np.ndarray:
    """`positions` as a 1-D int64 array; anything but integers is refused. `int()` of
    each read a boolean mask as positions 0 and 1 (the first two samples, over and
    over) and a float 1.7 as sample 1."""
    arr = np.asarray(positions)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        hint = " (for a boolean mask pass np.flatnonzero(mask))" if arr.dtype == bool else ""
        raise UsageError(
            f"sample positions must be a 1-D sequence of integers, not {arr.dtype} of shape "
            f"{arr.shape}{hint}"
        )
    return arr.astype(np.int64, copy=False)


@dataclass
class StoredBundle:
    """One published rank bundle (or single-producer bundle), read from the object space."""

    objs: ObjectStore
    ref: dict[str, Any]
    ref_name: str
    manifest: Manifest = field(init=False)
    expected: dict[str, Any] = field(init=False)
    rank: int | None = field(init=False)
    _records: dict[str, ArrayRecord] = field(default_factory=dict, repr=False)
    # The index object's verified (compressed) bytes until `index` parses them.
    _index_object: bytes | None = field(default=None, init=False, repr=False)
    _index: Index | None = field(default=None, init=False, repr=False)
    # Whole payloads being read ahead (`prefetch`): name -> (record, values).
    _ahead: dict[str, Future] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        docs = self.ref["documents"]
        self.manifest = Manifest.from_dict(get_json_blob(self.objs, docs["manifest"]))
        # Fetched (and so hash-checked: a missing or damaged object fails the lookup)
        # but parsed on first use: decoding and validating every loss mask is most of
        # a lookup's cost, and a lookup by step id often needs none of it.
        self._index_object = self.objs.get(docs["index"])
        self.expected = get_json_blob(self.objs, docs["expected"])
        self.rank = self.ref.get("rank")

    @property
    def index(self) -> Index:
        """index.json, decoded and validated on first use (its errors are raised here)."""
        if self._index is None:
            h = self.ref["documents"]["index"]
            data = self._index_object  # kept until a parse succeeds (a retry raises again)
            index = Index.from_dict(decode_json_blob(h, self.objs.get(h) if data is None else data))
            self._index, self._index_object = index, None
            return index
        return self._index

    def _checked(self) -> None:
        """Every document checked: run before any payload or file is handed out."""
        self.index  # noqa: B018 - parses and validates index.json (raises if it is invalid)

    @property
    def bundle_key(self) -> str:
        return self.ref["key"]

    @property
    def bundle_id(self) -> str:
        return self.manifest.bundle_id

    @property
    def attempt(self) -> int:
        return int(self.ref["attempt"])

    @property
    def label(self) -> str:
        return self.bundle_id if self.rank is None else f"{self.bundle_id}[rank {self.rank}]"

    def payload_names(self) -> list[str]:
        return sorted(self.ref["payloads"])

    def _entry(self, name: str) -> dict[str, Any]:
        entry = self.ref["payloads"].get(name)
        if entry is None:
            raise NotFoundError(f"{self.bundle_key}: no payload named {name!r}")
        return entry

    def record(self, name: str) -> ArrayRecord:
        """The payload's CAS array record (for `CASZarrStore` or `read_rows`)."""
        self._checked()
        if name not in self._records:
            self._records[name] = load_record(self.objs, self._entry(name)["record"])
        return self._records[name]

    def payload_identity(self, name: str) -> tuple | None:
        """What names payload `name`'s values: its CAS record (the BLAKE3 of a record
        that lists its chunks' names) and how the record is laid out and shaped; two
        payloads with equal identities read the same values (`StageMemo`)."""
        entry = self.ref["payloads"].get(name)
        if not isinstance(entry, dict) or not isinstance(entry.get("record"), str):
            return None
        try:
            return (
                entry["record"],
                repr(entry.get("rows")),
                repr(entry.get("dtype")),
                repr(entry.get("shape")),
            )
        except (TypeError, ValueError):
            return None

    def prefetch(self) -> None:
        """Start reading every per-token payload whole, on a few threads, while the caller
        parses documents and replays (a whole-bundle replay reads them all in its sample
        stage). Fetching, hash checks and decoding release the GIL; nothing read ahead is
        handed out before `payload` has run every document check. A bundle larger than
        `READ_AHEAD_MAX_BYTES` is read when asked, as before."""
        names = [n for n in self.payload_names() if n in PER_TOKEN_PAYLOADS]
        entries = self.ref["payloads"]
        try:
            size = sum(int(entries[n].get("logical_bytes") or 0) for n in names)
        except (TypeError, ValueError, AttributeError):
            return  # an odd ref: read as before, where its checks report it
        if size > READ_AHEAD_MAX_BYTES:
            return
        for name in names:
            if name not in self._ahead:
                self._ahead[name] = _prefetch_pool.get().submit(self._read_whole, entries[name])

    def _read_whole(self, entry: dict[str, Any]) -> tuple[ArrayRecord, np.ndarray]:
        rec = load_record(self.objs, entry["record"])
        return rec, read_array(self.objs, rec)

    def payload(self, name: str) -> np.ndarray:
        """The whole payload (torch dtype bits; bf16 as uint16), in its original shape."""
        entry = self._entry(name)
        self._checked()
        ahead = self._ahead.pop(name, None)
        if ahead is None:
            values = read_array(self.objs, self.record(name))
        else:
            rec, values = ahead.result()  # raises what reading it raised
            self._records.setdefault(name, rec)
        return values.reshape(entry["shape"])

    def payload_rows(self, name: str, positions: np.ndarray) -> np.ndarray:
        """The tokens of the samples at `positions` (integer positions in bundle order),
        reading only their chunks."""
        self._checked()
        rows = sample_positions(positions)
        entry = self._entry(name)
        if entry.get("rows") in ("response", "total"):
            return read_rows(self.objs, self.record(name), rows.tolist())
        from trajstore.replay.source import slice_rows

        lengths = np.array([s.response_length for s in self.index.samples], dtype=np.int64)
        return slice_rows(self.payload(name), lengths, rows)

    def payload_tensor(self, name: str):  # noqa: ANN201 - torch is imported lazily
        """The payload as a torch tensor (imports torch), dtype included (bf16 too)."""
        import torch

        arr = np.ascontiguousarray(self.payload(name))
        t = torch.from_numpy(arr.copy())
        if self._entry(name)["dtype"] == "torch.bfloat16":
            t = t.view(torch.bfloat16)
        return t

    def payload_file(self, name: str) -> bytes:
        """The original `payloads/<name>.pt` bytes (sha256-checked)."""
        return payload_file_bytes(self.objs, self._entry(name), self.record(name))

    def file_bytes(self, filename: str) -> bytes:
        """A stored metadata or sentinel file of this bundle (manifest.json, COMPLETE, ...)."""
        self._checked()
        docs = {f"{k}.json": v for k, v in self.ref["documents"].items()}
        h = docs.get(filename) or (self.ref.get("sentinels") or {}).get(filename)
        if h is None:
            raise NotFoundError(f"{self.bundle_key}: no stored file {filename!r}")
        return get_blob(self.objs, h)
