"""Ingest bundle directories into a store: integrity gate -> objects -> one ref per rank.

Order is the crash-safety argument: every object a ref names is written and
flushed before the ref is created (create-if-absent, the commit point), so a
kill at any moment leaves at most unreferenced objects, which gc collects
after its grace period. A cohort's ranks are all checked before any of its
objects is written, and its refs are published last; a reader treats a
cohort whose ranks are not all published as absent.

Attempts: the identity of a bundle is (run, kind, rollout_id, step_id, rank),
and attempts are numbered per anchor (run, kind, rollout_id, step_id): the
first capture seen for an anchor is attempt 1, a different one claims
attempt N+1 by creating `refs/claims/<anchor>.a<N>` (holding the capture's
digest: the cohort COMPLETE's for every rank of a cohort, the content digest
for a single-producer bundle) with create-if-absent. So the ranks of one
cohort share one attempt, a single-producer re-capture of a step captured as
a cohort (or the reverse) is a new attempt rather than a mix, and two
concurrent ingests never publish two different contents under one key. Same
content -> same attempt -> a no-op when its ref is already live.

One ref per key: before creating a ref, a writer fixes its name with
create-if-absent on `refs/claims/<key digest>.ref<G>` (G counts publications
of that key, a new one only after the previous was removed by `rm`); the ref
is then created under that name with create-if-absent. Two writers racing on
one key agree on the name, so exactly one ref object exists, and a writer
that died between the two steps is completed by the next ingest.
"""

from __future__ import annotations

import contextlib
import json
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from blake3 import blake3

from trajstore.bundle.checks import ROUTE_PAYLOADS, bundle_problems
from trajstore.bundle.reader import (
    KEEP_CHECKED_BYTES,
    METADATA_FILES,
    Bundle,
    BundleSet,
    document_limit,
    open_target,
)
from trajstore.cas import ArrayRecord, ObjectStore, write_array
from trajstore.cas.blobs import put_blob
from trajstore.errors import BundleError, StoreError, TrajstoreError
from trajstore.jsonio import dumps_sorted_indent1, read_bytes, sha256_bytes
from trajstore.mismatch.compute import INPUT_PAYLOADS as MISMATCH_INPUTS
from trajstore.mismatch.compute import bundle_entry
from trajstore.pools import SharedPool
from trajstore.refspace import RefSpace
from trajstore.replay.source import as_float
from trajstore.store import gclock
from trajstore.store.layout import BUNDLE_REFS_KEY, CLAIMS_KEY, RefIndex, new_doc_name

REF_VERSION = 1
#: route payloads stored as an XOR delta against this base payload when shapes match
DELTA_BASES = {
    "train_routed_experts": "rollout_routed_experts",
    "train_natural_routed_experts": "rollout_routed_experts",
}
_BASE_NAMES = frozenset(DELTA_BASES.values())


@dataclass
class IngestOutcome:
    """What happened to one target (a bundle or a cohort directory)."""

    path: str
    status: str  # "published", "unchanged" or "refused"
    keys: list[str] = field(default_factory=list)
    reason: str | None = None
    logical_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "status": self.status,
            "keys": self.keys,
            "reason": self.reason,
            "logical_bytes": self.logical_bytes,
        }


class _Recorder(ObjectStore):
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


def identity_of(run: str, b: Bundle) -> tuple[str, str, int, int | None, int | None]:
    ident = b.index.identity
    return (run, ident.kind, ident.rollout_id, ident.step_id, b.rank)


def bundle_key(
    run: str, kind: str, rollout_id: int, step_id: int | None, rank: int | None, attempt: int
) -> str:
    anchor = f"step-{rollout_id}-{step_id}" if kind == "step" else f"rollout-{rollout_id}"
    parts = [run, anchor] + ([f"rank-{rank}"] if rank is not None else []) + [f"a{attempt}"]
    return "/".join(parts)


#: a run name's characters, as documented: ASCII only (str.isalnum also took "café",
#: "٣" and "ﬁ", names that look alike or change under Unicode normalization)
_RUN_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


def check_run_name(run: str) -> str:
    ok = isinstance(run, str) and 0 < len(run) <= 128 and _RUN_CHARS.issuperset(run)
    if not ok or run.startswith("."):
        raise StoreError(
            f"run name {run!r} must be 1-128 characters of [A-Za-z0-9._-], not starting with '.'"
        )
    return run


def _row_lengths(name: str, shape: tuple[int, ...], b: Bundle) -> tuple[list[int], str]:
    """Chunk rows follow samples so a sample's tokens dedup wherever they recur."""
    resp = [s.response_length for s in b.index.samples]
    total = [s.total_length for s in b.index.samples]
    if len(shape) >= 1 and resp:
        order = (
            [("total", total), ("response", resp)]
            if name in ROUTE_PAYLOADS
            else [("response", resp), ("total", total)]
        )
        if name not in ROUTE_PAYLOADS and len(shape) != 1:
            order = [("total", total)]
        for kind, lengths in order:
            if shape[0] == sum(lengths):
                return lengths, kind
    n = shape[0] if len(shape) >= 1 else 1
    return [n], "single"


def write_order(b: Bundle) -> list[str]:
    """A bundle's payload names, delta bases first (their deltas are written against them)."""
    return sorted(b.payload_names(), key=lambda n: (n not in DELTA_BASES.values(), n))


def array_rows(b: Bundle, name: str) -> tuple[np.ndarray, list[int], str, list[int] | None]:
    """Payload `name` of `b` as `write_array` stores it: (values with one row per token,
    row lengths, the row kind, prompt heads or None)."""
    t = b.load_payload(name)
    shape = tuple(t.shape)
    lengths, rows = _row_lengths(name, shape, b)
    values = np.ascontiguousarray(t.array).reshape(sum(lengths), *shape[1:])
    # Rows of prompt + response: the prompt is windowed apart, so a group's shared
    # prompt (the same prefill routes) is the same objects in every sample.
    heads = (
        [max(0, s.total_length - s.response_length) for s in b.index.samples]
        if rows == "total"
        else None
    )
    return values, lengths, rows, heads


def delta_base(
    records: dict[str, ArrayRecord],
    name: str,
    values: np.ndarray,
    lengths: list[int],
    heads: list[int] | None,
) -> ArrayRecord | None:
    """The record payload `name` is stored as a delta against (`DELTA_BASES`), when its
    base is already written in `records` with the same geometry; else None."""
    base = records.get(DELTA_BASES.get(name, ""))
    if base is None:
        return None
    same = (base.dtype, base.shape[2:], base.row_lengths, base.heads) == (
        values.dtype.name,
        tuple(values.shape[1:]),
        tuple(lengths),
        None if heads is None else tuple(heads),
    )
    return base if same else None


@dataclass
class _Prepared:
    """A rank bundle whose objects are written; its ref is not yet published."""

    identity: tuple
    digest: str
    doc: dict[str, Any]


@dataclass
class _Gated:
    """A target whose every rank passed the integrity gate; nothing of it is written yet."""

    path: Path
    bset: BundleSet
    cohort_files: dict[int, dict[str, bytes]]
    nbytes: int  # payload file bytes, for sizing a batch


@dataclass
class _Written:
    """A target whose objects are written (maybe still buffered); no ref of it exists yet."""

    path: Path
    prepared: list[_Prepared]
    logical: int


def _read_doc(path: Path) -> bytes:
    """A bundle document's bytes, under the gate's cap for it (index.json's is larger)."""
    return read_bytes(path, path.name, document_limit(path.name))


def _as_gated(b: Bundle, name: str, data: bytes) -> bytes:
    """`data`, a document of `b` read again to be stored, if it is what the gate checked.

    The documents are read again after the gate (a pipelined ingest writes a target
    a while after checking it): one changed since is refused, never stored unchecked.
    """
    if name in METADATA_FILES:
        same = b.complete is not None and sha256_bytes(data) == b.complete.metadata.get(name)
    else:  # COMPLETE and the rank shards it lists (other files: never checked, kept as is)
        r = name.partition(".")[2]
        gated = b.complete if not r else b.shards.get(int(r)) if r.isdigit() else None
        if gated is None:
            return data
        try:
            same = json.loads(data) == gated.raw
        except ValueError:
            same = False
    if not same:
        raise BundleError(f"{b.path / name}: changed after the integrity gate; ingest it again")
    return data


#: The gate reads and checks a bundle's payload files on this many threads (sha256, reads
#: and .pt parsing release the GIL or are short), when they hold at least
#: `_PARALLEL_GATE_BYTES`: the gate's thread is otherwise the pipeline's slowest stage.
_GATE_READERS = 2
_PARALLEL_GATE_BYTES = 8 << 20
_gate_pool = SharedPool(_GATE_READERS, "ingest-gate-read")


def _load_payloads(b: Bundle) -> None:
    """Load (read, verify against the manifest's sha256, parse) `b`'s payloads ahead of the
    gate's checks, several at once, within the bytes the gate keeps cached anyway.

    Only a cache fill: a payload that fails to load is left unloaded, and the gate's own
    pass (`bundle_problems`) loads it again and reports it exactly as it would have.
    """
    names, total = [], 0
    for name in b.payload_names():
        size = b.manifest.payloads[name].bytes
        if total + size > KEEP_CHECKED_BYTES:
            break  # the gate releases payloads past this after checking (bounded memory)
        names.append(name)
        total += size
    if len(names) < 2 or total < _PARALLEL_GATE_BYTES:
        return
    pool = _gate_pool.get()

    def load(name: str) -> None:
        with contextlib.suppress(Exception):
            b.load_payload(name)

    # largest first: the two threads finish together
    names.sort(key=lambda n: -b.manifest.payloads[n].bytes)
    for f in [pool.submit(load, n) for n in names]:
        f.result()


def _gated_doc(b: Bundle, name: str, read: Callable[[], bytes]) -> bytes:
    """The bytes to store of document `name` of `b`: those its gate read and checked when
    it kept them (`Bundle.files`: no second read, and a file changed since is not what is
    stored), else the file read again, refused if it changed since (`_as_gated`)."""
    data = b.files.get(name)
    return data if data is not None else _as_gated(b, name, read())


@dataclass(frozen=True)
class WrittenBytes:
    """Bytes of one bundle's objects: all it references, and those its write stored."""

    referenced: int
    added: int


def _write_bundle_objects(
    objs: ObjectStore, b: Bundle, cohort_sentinels: dict[str, bytes]
) -> tuple[dict, WrittenBytes]:
    rec = _Recorder(objs)
    docs = {
        k: put_blob(rec, _gated_doc(b, f"{k}.json", lambda k=k: _read_doc(b.path / f"{k}.json")))
        for k in ("manifest", "index", "expected")
    }
    sentinels = {
        p.name: put_blob(rec, _gated_doc(b, p.name, lambda p=p: read_bytes(p, p.name)))
        for p in sorted(b.path.glob("COMPLETE*"))
        if p.is_file()
    }
    csent = {name: put_blob(rec, data) for name, data in cohort_sentinels.items()}
    payloads: dict[str, Any] = {}
    records: dict[str, ArrayRecord] = {}
    # Delta bases' values stay in memory while their deltas are written (no read-back).
    base_values: dict[str, np.ndarray] = {}
    # the payloads the mismatch sums read, kept until they are computed (log-probs: [R])
    kept: dict[str, np.ndarray] = {}
    for name in write_order(b):
        raw = b.payload_file_bytes(name)
        t = b.load_payload(name)
        shape = tuple(t.shape)
        values, lengths, rows, heads = array_rows(b, name)
        base_name = DELTA_BASES.get(name, "")
        base = delta_base(records, name, values, lengths, heads)
        record = write_array(
            rec,
            values,
            lengths,
            dtype_tag=t.dtype,
            base=base,
            base_values=base_values.get(base_name) if base is not None else None,
            heads=heads,
        )
        records[name] = record
        if name in _BASE_NAMES:
            base_values[name] = values
        if name in MISMATCH_INPUTS:
            kept[name] = values if name in ROUTE_PAYLOADS else as_float(values, t.dtype)
        spec = b.manifest.payloads[name]
        f: dict[str, Any] = {"bytes": len(raw), "sha256": spec.sha256}
        if t.data_span is not None and t.data_span[1] == values.nbytes:
            off, ln = t.data_span
            f.update(envelope=put_blob(rec, raw[:off] + raw[off + ln :]), span=[off, ln])
        else:
            f["whole"] = put_blob(rec, raw)
        payloads[name] = {
            "record": rec.put(record.to_object()),
            "dtype": t.dtype,
            "shape": list(shape),
            "logical_bytes": int(values.nbytes),
            "rows": rows,
            "file": f,
        }
        # Keep memory to about one payload: drop the bundle's caches of this one.
        b.release(name)
    base_values.clear()
    mismatch = bundle_entry(lambda data: put_blob(rec, data), kept.get, b.index)
    kept.clear()
    out = {
        "documents": docs,
        "sentinels": sentinels,
        "cohort_sentinels": csent,
        "payloads": payloads,
        "mismatch": mismatch,
    }
    return out, WrittenBytes(sum(rec.sizes.values()), sum(rec.added.values()))


def content_digest(documents: dict[str, str], cohort_sentinels: dict[str, str]) -> str:
    """Manifest (with every payload's sha256), index and expected determine a bundle's content.

    A cohort member's digest also covers the cohort COMPLETE (every rank's
    metadata hashes), so a re-captured cohort is a new attempt on every rank
    and the ranks of one attempt always belong together.
    """
    parts = {k: documents[k] for k in ("manifest", "index", "expected")}
    parts["cohort"] = cohort_sentinels.get("COMPLETE")
    text = json.dumps(parts, sort_keys=True)
    return blake3(text.encode()).hexdigest()


class Ingestor:
    """Publishes bundles into one store; keeps a cache of which keys are live."""

    def __init__(self, space: RefSpace, objs: ObjectStore, refs: RefIndex) -> None:
        self.space = space
        self.objs = objs
        self.refs = refs
        self._refs_lock = threading.Lock()  # RefIndex is not thread-safe; publishers may be

    # -- what is already published --

    def live_keys(self) -> set[str]:
        return set(self.refs.live())

    # -- one target --

    def gate(self, path: Path) -> _Gated | IngestOutcome:
        """Open `path` behind the whole integrity gate (every rank), or say why it is refused.

        Writes nothing: a target is written only once all its ranks passed.
        """
        try:
            bset = open_target(path)
        except TrajstoreError as e:
            return IngestOutcome(str(path), "refused", reason=str(e))
        member = bset.first
        expected = sorted(member.complete.expected_ranks)
        if not bset.is_cohort and member.rank is not None and len(expected) > 1:
            # stored alone it would be the whole step: replay would answer for one rank
            return IngestOutcome(
                str(path),
                "refused",
                reason=f"rank {member.rank} of a cohort of ranks {expected}; ingest its cohort "
                f"directory {path.parent}",
            )
        cohort_files: dict[int, dict[str, bytes]] = {}
        if bset.is_cohort:
            whole = read_bytes(path / "COMPLETE", "cohort COMPLETE")
            for b in bset.bundles:
                shard = read_bytes(path / f"COMPLETE.{b.rank}", f"COMPLETE.{b.rank}")
                cohort_files[b.rank] = {"COMPLETE": whole, f"COMPLETE.{b.rank}": shard}
        nbytes = 0
        for b in bset.bundles:
            _load_payloads(b)
            try:
                problems = bundle_problems(b)
            except TrajstoreError as e:
                problems = [str(e)]
            if problems:
                where = f"rank {b.rank}: " if bset.is_cohort else ""
                more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
                return IngestOutcome(str(path), "refused", reason=f"{where}{problems[0]}{more}")
            nbytes += sum(spec.bytes for spec in b.manifest.payloads.values())
            if len(bset.bundles) > 1:  # a cohort: keep memory to one rank (re-read on write)
                b.release()
        return _Gated(path, bset, cohort_files, nbytes)

    def write(self, gated: _Gated, run: str) -> _Written:
        """Write the objects of a gated target (they may stay buffered until `objs.flush()`)."""
        prepared: list[_Prepared] = []
        logical = 0
        bundles = gated.bset.bundles
        ranks = [b.rank for b in bundles] if gated.bset.is_cohort else None
        while bundles:
            b = bundles.pop(0)
            body, nbytes = _write_bundle_objects(self.objs, b, gated.cohort_files.get(b.rank, {}))
            identity = identity_of(run, b)
            ident = b.index.identity
            doc = {
                "ref_version": REF_VERSION,
                "run": run,
                "kind": ident.kind,
                "rollout_id": ident.rollout_id,
                "step_id": ident.step_id,
                "rank": b.rank,
                "cohort_ranks": ranks,
                "bundle_id": b.bundle_id,
                "format_version": b.manifest.format_version,
                "content_digest": content_digest(body["documents"], body["cohort_sentinels"]),
                "physical_bytes": nbytes.referenced,
                "added_bytes": nbytes.added,
                **body,
            }
            logical += sum(p["logical_bytes"] for p in body["payloads"].values())
            prepared.append(_Prepared(identity, doc["content_digest"], doc))
        return _Written(gated.path, prepared, logical)

    def publish_many(self, writtens: list[_Written], live: set[str]) -> list[IngestOutcome]:
        """Create the refs of written targets whose objects are durable (flushed), in order;
        `live` holds the keys already live (this call adds the ones it publishes).

        The common case, a first capture of each anchor, costs one round of fsyncs for the
        whole batch (`RefSpace.staged`): every anchor's attempt-1 claim, and the ref guard
        and ref it leads to, are written and fsynced before any of them is created; then
        the claims are created, then the guards of the claims this call made, the claims
        directory is fsynced once, then the refs of the guards this call made, and the refs
        directory is fsynced once. So each ref is created only after its claim and guard
        are durable (the module docstring's order). Anything but that first try (a claim
        held by another capture, a guard held by another writer, the second capture of an
        anchor in the batch) takes the one-by-one path (`_claim_attempt`, `_publish`), so
        attempts and keys are those of publishing the targets one at a time.
        """
        items = [(w, p) for w in writtens for p in w.prepared]
        captures = [p.doc["cohort_sentinels"].get("COMPLETE") or p.digest for _, p in items]
        first: dict[tuple, int] = {}  # anchor -> its first item: tries attempt 1 in the batch
        for i, (_, p) in enumerate(items):
            first.setdefault(p.identity[:4], i)
        staged: list[tuple[str, bytes]] = [
            (f"{CLAIMS_KEY}/{_anchor_hash(items[i][1].identity[:4])}.a1", captures[i].encode())
            for i in first.values()
        ]
        # attempt 1's guard and ref of each item of the same capture as its anchor's first
        # try (a cohort's ranks share it) whose key is not live: staged with the claims,
        # used only if this call makes that claim (else attempt 1 may be another capture)
        ahead: dict[int, tuple[str, bytes, int]] = {}  # item -> key, ref data, staged index
        ahead_keys: set[str] = set()
        for i, (_, p) in enumerate(items):
            f = first[p.identity[:4]]
            key = bundle_key(*p.identity, 1)
            if captures[i] != captures[f] or key in live or key in ahead_keys:
                continue
            ahead_keys.add(key)
            doc = {**p.doc, "key": key, "attempt": 1, "published_at": _now()}
            data = dumps_sorted_indent1(doc)
            name = new_doc_name()
            ahead[i] = (key, data, len(staged))
            staged.append((f"{CLAIMS_KEY}/{_key_hash(key)}.ref1", name.encode()))
            staged.append((f"{BUNDLE_REFS_KEY}/{name}.json", data))
        made: dict[int, bool] = {}
        created: set[int] = set()  # items whose ref this call created ahead
        by_guard: list[int] = []  # items whose guard this call created
        with self.space.staged(staged) as st:
            for k, i in enumerate(first.values()):
                made[i] = st.create(k)
            for i, (_, _, g) in ahead.items():
                if made[first[items[i][1].identity[:4]]] and st.create(g):
                    by_guard.append(i)
            st.sync()  # the claims and guards made are durable before any ref exists
            for i in by_guard:
                if st.create(ahead[i][2] + 1):
                    created.add(i)
            st.sync()
        if created:
            with self._refs_lock:
                self.refs.invalidate()
        # every anchor's attempt-1 claim exists now: the others start by reading it
        todo: list[tuple[_Written, str, bytes]] = []
        keys: dict[int, list[str]] = {id(w): [] for w in writtens}
        published: set[int] = set()
        for i, (w, p) in enumerate(items):
            anchor = p.identity[:4]
            ours = made[first[anchor]] and captures[i] == captures[first[anchor]]
            attempt = 1 if ours else self._claim_attempt(anchor, captures[i], 1)
            key = bundle_key(*p.identity, attempt)
            keys[id(w)].append(key)
            if i in created:
                published.add(id(w))
                live.add(key)
                continue
            if key in live:
                continue
            live.add(key)
            if ours and i in ahead:  # its guard was there already: the batch path below
                todo.append((w, key, ahead[i][1]))
                continue
            p.doc.update(key=key, attempt=attempt, published_at=_now())
            todo.append((w, key, dumps_sorted_indent1(p.doc)))
        mine = [new_doc_name() for _ in todo]
        guards = [f"{CLAIMS_KEY}/{_key_hash(key)}.ref1" for _, key, _ in todo]
        held = self.space.create_many_if_absent(
            [(g, m.encode()) for g, m in zip(guards, mine, strict=True)]
        )
        names = [m if h else self._held(g) for g, m, h in zip(guards, mine, held, strict=True)]
        done = self.space.create_many_if_absent(
            [
                (f"{BUNDLE_REFS_KEY}/{n}.json", data)
                for n, (_, _, data) in zip(names, todo, strict=True)
            ]
        )
        if any(done):
            with self._refs_lock:
                self.refs.invalidate()
        for (w, key, data), ok in zip(todo, done, strict=True):
            if ok or self._publish(key, data):
                published.add(id(w))
        return [
            IngestOutcome(
                str(w.path),
                "published" if id(w) in published else "unchanged",
                keys[id(w)],
                None,
                w.logical,
            )
            for w in writtens
        ]

    def _held(self, claim: str) -> str:
        try:
            return self.space.read(claim).decode().strip()
        except (StoreError, UnicodeDecodeError) as e:
            raise StoreError(f"cannot read claim {self.space.where(claim)}: {e}") from None

    def _claim_attempt(self, identity: tuple, digest: str, taken: int = 0) -> int:
        """The attempt of `digest` under `identity`'s anchor, claiming a new one if needed;
        claims 1..`taken` are known to exist (read, not created)."""
        idh = _anchor_hash(identity)
        n = 1
        while True:
            claim = f"{CLAIMS_KEY}/{idh}.a{n}"
            if n > taken and self.space.create_if_absent(claim, digest.encode()):
                return n
            if self._held(claim) == digest:
                return n
            n += 1

    def _publish(self, key: str, data: bytes) -> bool:
        """Create the one ref of `key` (unless live already); True if this call created it."""
        kh = _key_hash(key)
        g = 1
        while True:
            guard = f"{CLAIMS_KEY}/{kh}.ref{g}"
            mine = new_doc_name()
            # whoever creates the guard fixes the ref's name for every writer of this key
            name = mine if self.space.create_if_absent(guard, mine.encode()) else self._held(guard)
            if self.space.create_if_absent(f"{BUNDLE_REFS_KEY}/{name}.json", data):
                with self._refs_lock:
                    self.refs.invalidate()
                return True
            with self._refs_lock:
                self.refs.refresh(force=True)
                live = self.refs.live().get(key)
                listed = {e.name for e in self.refs.all()}
            if live is not None and live.name >= name:
                return False  # published by the other writer (or later): one ref per key
            if live is None and name not in listed:
                # listed after its creation (a listing can lag): trust the existing object
                return False
            g += 1  # that publication was removed (rm); the next one is new


def _anchor_hash(identity: tuple) -> str:
    return blake3(json.dumps(list(identity)).encode()).hexdigest()[:40]


def _key_hash(key: str) -> str:
    return blake3(key.encode()).hexdigest()[:40]


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Progress:
    """A one-line progress bar on stderr, only when stderr is a terminal."""

    def __init__(self, total: int, enabled: bool | None = None) -> None:
        self.total = total
        self.done = 0
        self.bytes = 0
        self.start = time.monotonic()
        self.enabled = sys.stderr.isatty() if enabled is None else enabled

    def update(self, outcome: IngestOutcome) -> None:
        self.done += 1
        self.bytes += outcome.logical_bytes
        if not self.enabled:
            return
        rate = self.bytes / max(time.monotonic() - self.start, 1e-6) / 1e6
        width = 30
        fill = int(width * self.done / max(self.total, 1))
        sys.stderr.write(
            f"\ringest [{'#' * fill}{'.' * (width - fill)}] "
            f"{self.done}/{self.total} {rate:7.1f} MB/s"
        )
        sys.stderr.flush()

    def clear(self) -> None:
        """Erase the bar's line, so a line printed next does not start after it."""
        if self.enabled:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def ingest_paths(
    ingestor: Ingestor,
    paths: Iterable[Path | str],
    run: str,
    *,
    progress: bool | None = None,
    on_outcome: Callable[[IngestOutcome], None] | None = None,
) -> list[IngestOutcome]:
    """Ingest every bundle/cohort at or below `paths`, as a pipeline (`_Pipeline`).

    `on_outcome` sees each outcome as soon as it is final (a published target's
    refs are already created), in the order of the returned list (the targets'
    order). Ctrl-C stores the targets that already passed the gate, then raises.
    """
    from trajstore.bundle.capture_dir import discover_targets

    targets: list[Path] = []
    outcomes: list[IngestOutcome] = []
    for p in paths:
        try:
            targets += discover_targets(p)
        except TrajstoreError as e:  # its message starts with the path the outcome names
            reason = str(e).removeprefix(f"{p}: ")
            outcomes.append(IngestOutcome(str(p), "refused", reason=reason))
            if on_outcome is not None:
                on_outcome(outcomes[-1])
    if not targets:
        return outcomes
    check_run_name(run)
    bar = Progress(len(targets), progress)

    def emit(out: IngestOutcome) -> None:
        outcomes.append(out)
        if on_outcome is not None:
            bar.clear()
            on_outcome(out)
        bar.update(out)

    try:
        _Pipeline(ingestor, targets, run).run(emit)
    finally:
        bar.close()
    return outcomes


#: A batch of written targets ends (one pack flush, then their refs) at this many
#: payload bytes or targets, when a gc waits for the writer lock, ...
BATCH_BYTES = 256 << 20
BATCH_TARGETS = 64
#: ... or, while the finisher has nothing to do, at this many bytes or targets: the
#: finisher's fsyncs then overlap the writes of the next batch, and batches grow (fewer
#: fsyncs per target) only when the finisher is the slower stage.
_EAGER_BYTES = 64 << 20
_EAGER_TARGETS = 8
#: ... or when the gate has had none ready for this long (a slow or blocked source).
_LINGER_S = 0.5
#: targets written at once (zstd, BLAKE3 and the pack writes release the GIL)
_WRITERS = 2
_END = object()
_POLL_S = 0.05


class _Pipeline:
    """Ingest of many targets on threads: the gate runs one target ahead of the writers.

    The per-byte work (reading, sha256, parsing and the finite-value checks of the
    gate; BLAKE3, zstd and pack writes of the writers) is C code that releases the
    GIL, so they overlap. The writer loop batches: the objects of several gated
    targets go to one pack (one fsync for the batch, not one per target), then the
    refs of the batch are created (`_publish_all`). The order of the crash-safety
    argument is unchanged (a ref is created only after every object it names is
    flushed; nothing of a target is written before its whole gate passed).

    Memory: the gate holds at most two targets (the one it checks and one handed
    over), the writers `_WRITERS` targets plus the pack buffer (`pack_max_bytes`).

    Ctrl-C in the calling thread: the writer finishes the targets that already
    passed the gate (writes, flushes and publishes them; their outcomes are
    emitted), then `KeyboardInterrupt` is raised. A second Ctrl-C stops waiting.
    """

    def __init__(self, ingestor: Ingestor, targets: list[Path], run: str) -> None:
        self.ing = ingestor
        self.targets = targets
        self.run_name = run
        self.gated: queue.Queue[Any] = queue.Queue(maxsize=1)
        self.done: queue.Queue[Any] = queue.Queue()
        self.stop = threading.Event()

    def run(self, emit: Callable[[IngestOutcome], None]) -> None:
        threads = [
            threading.Thread(target=self._gate_loop, name="ingest-gate", daemon=True),
            threading.Thread(target=self._write_loop, name="ingest-write", daemon=True),
        ]
        for t in threads:
            t.start()
        interrupted: KeyboardInterrupt | None = None
        try:
            while True:
                try:
                    item = self.done.get()
                    if item is _END:
                        break
                    if isinstance(item, BaseException):
                        raise item
                    emit(item)
                except KeyboardInterrupt as e:
                    if interrupted is not None:
                        raise
                    interrupted = e
                    self.stop.set()
        finally:
            self.stop.set()  # whatever ends this loop (an error, `emit` raising) stops the threads
        if interrupted is not None:
            raise interrupted

    def _hand_over(self, item: Any) -> bool:
        """Put `item` for the writer; False if the pipeline stopped first."""
        while True:
            try:
                self.gated.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                if self.stop.is_set():
                    return False

    def _gate_loop(self) -> None:
        try:
            for t in self.targets:
                if self.stop.is_set() or not self._hand_over(self.ing.gate(t)):
                    return
            self._hand_over(_END)
        except BaseException as e:  # handed to the writer, raised in the calling thread
            self._hand_over(e)

    def _take(self, wait_s: float | None) -> Any:
        """The next gated item; None if none came within `wait_s` (None: no limit) or the
        pipeline stopped (items already handed over are still returned first)."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while True:
            try:
                return self.gated.get(timeout=_POLL_S)
            except queue.Empty:
                if self.stop.is_set() or (deadline is not None and time.monotonic() > deadline):
                    return None

    def _publish_all(self, written: list[_Written]) -> dict[int, IngestOutcome]:
        """Create the refs of flushed targets (`Ingestor.publish_many`), by id.

        A ref create is two fsyncs (file, directory), three documents a target, and
        most of a small target's fixed cost: the batch's documents are fsynced in one
        concurrent round (they share the file system's journal commits), then two
        directory fsyncs (claims, refs) serve the whole batch (`publish_many`).
        """
        outs = self.ing.publish_many(written, self.ing.live_keys())
        return {id(w): o for w, o in zip(written, outs, strict=True)}

    def _write_one(self, gated: _Gated) -> _Written | IngestOutcome:
        """Write a gated target, or refuse it if its source changed since the gate."""
        try:
            return self.ing.write(gated, self.run_name)
        except BundleError as e:
            return IngestOutcome(str(gated.path), "refused", reason=str(e))

    def _finish(
        self, batch: list[Future[_Written | IngestOutcome] | IngestOutcome], failed: threading.Event
    ) -> None:
        """Wait for a batch's writes, flush its objects, then create its refs and emit its
        outcomes in target order (on the finisher thread, while the next batch is written).
        A failed write still lets the targets before it be published; its error is raised
        after them, and no later batch is published or emitted (`failed`)."""
        error: BaseException | None = None
        for x in batch:
            if isinstance(x, Future):
                try:
                    x.result()
                except BaseException as e:
                    error = error or e
        if failed.is_set():
            return  # an earlier batch failed: the loop stops; nothing of this one is emitted
        try:
            if error is not None:  # keep what precedes the first failure
                k = next(i for i, x in enumerate(batch) if isinstance(x, Future) and x.exception())
                del batch[k:]
            written = [
                r for x in batch if isinstance(x, Future) and isinstance(r := x.result(), _Written)
            ]
            outs: dict[int, IngestOutcome] = {}
            if written:
                self.ing.objs.flush()
                outs = self._publish_all(written)
            for x in batch:
                r = x if isinstance(x, IngestOutcome) else x.result()
                self.done.put(r if isinstance(r, IngestOutcome) else outs[id(r)])
        except BaseException as e:
            error = error or e
        if error is not None:
            failed.set()
            raise error

    def _write_loop(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        pending: list[Future[_Written | IngestOutcome] | IngestOutcome] = []
        inflight: list[Future[Any]] = []  # writes not yet done, of any batch
        finishing: list[Future[None]] = []  # batches handed to the finisher, oldest first
        failed = threading.Event()
        lock = contextlib.ExitStack()
        held = False  # the writer lock: from a batch's first object until its refs exist
        nbytes = 0

        def check(wait: bool) -> None:
            """Raise the first failure of a handed-over batch; with `wait`, wait for all."""
            while finishing and (wait or finishing[0].done()):
                finishing.pop(0).result()

        def seal() -> None:
            """Hand the current batch to the finisher, which flushes and publishes it while
            the next batch is written; raise an earlier batch's failure first."""
            nonlocal nbytes
            check(wait=False)
            if pending:
                finishing.append(finisher.submit(self._finish, pending.copy(), failed))
            pending.clear()
            nbytes = 0

        def drain() -> None:
            """Seal, wait until every batch is published, then release the writer lock."""
            nonlocal held
            try:
                seal()
                check(wait=True)
            finally:
                for f in finishing:  # after a failure: later batches only wait for writes
                    f.exception()
                finishing.clear()
                if held:
                    lock.close()
                    held = False

        try:
            with (
                ThreadPoolExecutor(_WRITERS, thread_name_prefix="ingest-write") as pool,
                ThreadPoolExecutor(1, thread_name_prefix="ingest-finish") as finisher,
            ):
                try:
                    while True:
                        item = self._take(_LINGER_S if pending or finishing else None)
                        if item is None:  # the gate is slow or blocked, or the pipeline stopped
                            drain()
                            if self.stop.is_set():
                                break
                            continue
                        if item is _END:
                            break
                        if isinstance(item, BaseException):
                            drain()  # store what passed before it, then raise it
                            raise item
                        if isinstance(item, IngestOutcome):
                            pending.append(item)
                            continue
                        if not held:
                            lock.enter_context(gclock.writing(self.ing.objs))
                            held = True
                        # at most _WRITERS writes run; the next waits here (bounded memory)
                        inflight[:] = [f for f in inflight if not f.done()]
                        if len(inflight) >= _WRITERS:
                            inflight[0].exception()
                        fut = pool.submit(self._write_one, item)
                        inflight.append(fut)
                        pending.append(fut)
                        nbytes += item.nbytes
                        idle = not finishing or finishing[-1].done()
                        if (
                            nbytes >= BATCH_BYTES
                            or len(pending) >= BATCH_TARGETS
                            or (idle and (nbytes >= _EAGER_BYTES or len(pending) >= _EAGER_TARGETS))
                        ):
                            seal()
                        if gclock.gc_waiting(self.ing.objs):  # never hold gc back long
                            drain()
                    drain()
                except BaseException:
                    failed.set()  # batches not yet published stay unpublished, as before
                    raise
            self.done.put(_END)
        except BaseException as e:
            self.stop.set()
            lock.close()
            self.done.put(e)
