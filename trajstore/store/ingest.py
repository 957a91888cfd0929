"""Ingest bundle directories into a store: one way, in four steps, none calling back.

    target --verify--> VerifiedTarget --rows--> PayloadRows --write--> objects --publish--> refs
            (ingest_gate)              (ingest_rows)          (ingest_write)     (publish)

1. `ingest_gate`: every rank of a target behind the whole integrity gate (the only step
   that reads the bundle directory); refused targets stop here, nothing written.
2. `ingest_rows`: each verified payload as the rows of a CAS array, its file's envelope
   and the values the mismatch sums read (pure).
3. `ingest_write`: a rank's objects (documents, arrays, records, envelopes, the
   mismatch document) and the ref body naming them.
4. `publish`: the refs, once the objects are flushed (claims, guards, one ref per key).

This module composes them for one target (`Ingestor`); `ingest_pipeline` runs them for
many on threads, a batch's objects in one pack and its refs in one round of fsyncs.

Order is the crash-safety argument: every object a ref names is written and
flushed before the ref is created (create-if-absent, the commit point), so a
kill at any moment leaves at most unreferenced objects, which gc collects
after its grace period. A cohort's ranks are all checked before any of its
objects is written, and its refs are published last; a reader treats a
cohort whose ranks are not all published as absent. Attempts and the one-ref-per-key
rule: `publish`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trajstore.cas import ObjectStore
from trajstore.errors import StoreError, TrajstoreError
from trajstore.mismatch.compute import INPUT_PAYLOADS as MISMATCH_INPUTS
from trajstore.refspace import RefSpace
from trajstore.store.ingest_gate import VerifiedRank, VerifiedTarget, verify_target
from trajstore.store.ingest_rows import SampleLayout, payload_rows, write_order
from trajstore.store.ingest_write import WrittenBytes, write_rank
from trajstore.store.layout import RefIndex
from trajstore.store.publish import REF_VERSION, PreparedRef, RefPublisher, content_digest

__all__ = [
    "IngestOutcome",
    "Ingestor",
    "VerifiedTarget",
    "WrittenTarget",
    "check_run_name",
    "identity_of",
    "ref_fields",
    "store_rank",
]


@dataclass
class IngestOutcome:
    """What happened to one target (a bundle or a cohort directory)."""

    path: str
    status: str  # "published", "unchanged" or "refused"
    keys: list[str] = field(default_factory=list)
    reason: str | None = None
    logical_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


def identity_of(run: str, r: VerifiedRank) -> tuple[str, str, int, int | None, int | None]:
    return (run, r.kind, r.rollout_id, r.step_id, r.rank)


def store_rank(
    objs: ObjectStore, r: VerifiedRank, cohort_sentinels: dict[str, bytes] | None = None
) -> tuple[dict[str, Any], WrittenBytes]:
    """Steps 2 and 3 for one verified rank: its payloads turned into rows as they are
    written, one at a time (about one payload in memory), after its documents.
    `cohort_sentinels` (else those the gate read) are stored with it."""
    layout = SampleLayout.of(r.index)
    rows = (payload_rows(p, layout) for p in r.payloads(write_order(r.payload_names)))
    csent = r.cohort_sentinels if cohort_sentinels is None else cohort_sentinels
    inputs = MISMATCH_INPUTS.intersection(r.payload_names)
    return write_rank(objs, r.documents(), r.sentinels(), csent, rows, r.index, inputs)


def ref_fields(
    run: str, r: VerifiedRank, cohort_ranks: list[int] | None, nbytes: WrittenBytes
) -> dict[str, Any]:
    """A rank's ref fields besides its objects (the body `store_rank` returns) and the
    publication's key, attempt, time and content digest."""
    return {
        "ref_version": REF_VERSION,
        "run": run,
        "kind": r.kind,
        "rollout_id": r.rollout_id,
        "step_id": r.step_id,
        "rank": r.rank,
        "cohort_ranks": cohort_ranks,
        "bundle_id": r.bundle_id,
        "format_version": r.format_version,
        "physical_bytes": nbytes.referenced,
        "added_bytes": nbytes.added,
    }


@dataclass
class WrittenTarget:
    """A target whose objects are written (maybe still buffered); no ref of it exists yet."""

    path: Path
    prepared: list[PreparedRef]
    logical: int


class Ingestor:
    """Publishes bundles into one store; keeps a cache of which keys are live."""

    def __init__(self, space: RefSpace, objs: ObjectStore, refs: RefIndex) -> None:
        self.space = space
        self.objs = objs
        self.refs = refs
        self.publisher = RefPublisher(space, refs)

    def live_keys(self) -> set[str]:
        return set(self.refs.live())

    def gate(self, path: Path) -> VerifiedTarget | IngestOutcome:
        """Step 1: `path` behind the whole integrity gate, or the outcome saying why it is
        refused. Writes nothing: a target is written only once all its ranks passed."""
        try:
            return verify_target(path)
        except TrajstoreError as e:
            return IngestOutcome(str(path), "refused", reason=str(e))

    def write(self, target: VerifiedTarget, run: str) -> WrittenTarget:
        """Steps 2 and 3: write a verified target's objects (they may stay buffered until
        `objs.flush()`), rank by rank, each rank dropped once written."""
        ranks = target.ranks
        cohort = [r.rank for r in ranks] if target.is_cohort else None
        prepared: list[PreparedRef] = []
        logical = 0
        while ranks:
            r = ranks.pop(0)
            body, nbytes = store_rank(self.objs, r)
            digest = content_digest(body["documents"], body["cohort_sentinels"])
            doc = {**ref_fields(run, r, cohort, nbytes), "content_digest": digest, **body}
            logical += sum(p["logical_bytes"] for p in body["payloads"].values())
            prepared.append(PreparedRef(identity_of(run, r), digest, doc))
        return WrittenTarget(target.path, prepared, logical)

    def publish_many(self, writtens: list[WrittenTarget], live: set[str]) -> list[IngestOutcome]:
        """Step 4: create the refs of written targets whose objects are durable (flushed),
        in order (`RefPublisher.publish_many`); `live` holds the keys already live."""
        done = self.publisher.publish_many([w.prepared for w in writtens], live)
        return [
            IngestOutcome(str(w.path), "published" if ok else "unchanged", keys, None, w.logical)
            for w, (ok, keys) in zip(writtens, done, strict=True)
        ]
