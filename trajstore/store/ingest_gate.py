"""Ingest, step 1 of 4: read and verify a target behind the whole integrity gate.

The only ingest module that reads a bundle directory (`trajstore.bundle.reader`). It
checks every rank of a target (COMPLETE and its shards, the metadata and payload sha256s,
the zip CRCs, the schema, the payload shapes, the non-finite values: `bundle_problems`)
before anything of it is written, and hands each rank on as a `VerifiedRank`: checked
document bytes and checked payloads, never a file to open again.

Memory stays bounded as before: the gate keeps a rank's documents (up to
`KEEP_DOCUMENT_BYTES`) and its payloads (up to `KEEP_CHECKED_BYTES`) as checked, and
re-reads what it dropped when it is handed on, checked again (the sha256 against the
manifest: a file replaced since by one of the same size is refused, never stored).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from trajstore.bundle.checks import bundle_problems
from trajstore.bundle.ptfile import PtTensor
from trajstore.bundle.reader import (
    KEEP_CHECKED_BYTES,
    METADATA_FILES,
    Bundle,
    document_limit,
    open_bundle,
    open_target,
)
from trajstore.errors import BundleError, TrajstoreError
from trajstore.jsonio import read_bytes, sha256_bytes
from trajstore.pools import SharedPool
from trajstore.schema import Index

#: The gate reads and checks a bundle's payload files on this many threads (sha256, reads
#: and .pt parsing release the GIL or are short), when they hold at least
#: `_PARALLEL_GATE_BYTES`: the gate's thread is otherwise the pipeline's slowest stage.
_GATE_READERS = 2
_PARALLEL_GATE_BYTES = 8 << 20
_gate_pool = SharedPool(_GATE_READERS, "ingest-gate-read")


@dataclass(frozen=True)
class VerifiedPayload:
    """One payload as the gate checked it: the `.pt` file's bytes (sha256 and size as the
    manifest declares) and its tensor (dtype and shape as the manifest declares)."""

    name: str
    file: bytes
    sha256: str
    tensor: PtTensor


class VerifiedRank:
    """A bundle (or one rank of a cohort) that passed the whole gate.

    Hands on its documents and payloads as checked bytes (`documents`, `sentinels`,
    `payloads`); what the gate did not keep is read again and must be what it checked.
    """

    def __init__(self, bundle: Bundle, cohort_sentinels: dict[str, bytes]) -> None:
        self._b = bundle
        self.cohort_sentinels = cohort_sentinels
        ident = bundle.index.identity
        self.kind: str = ident.kind
        self.rollout_id: int = ident.rollout_id
        self.step_id: int | None = ident.step_id
        self.rank: int | None = bundle.rank
        self.bundle_id: str = bundle.bundle_id
        self.format_version = bundle.manifest.format_version
        self.expected_ranks: list[int] = sorted(int(r) for r in bundle.complete.expected_ranks)
        self.index: Index = bundle.index
        self.payload_names: list[str] = bundle.payload_names()
        self.nbytes = sum(spec.bytes for spec in bundle.manifest.payloads.values())

    def documents(self) -> dict[str, bytes]:
        """manifest, index and expected (by those names), as the gate checked them."""
        return {k: self._document(f"{k}.json") for k in ("manifest", "index", "expected")}

    def sentinels(self) -> dict[str, bytes]:
        """Every COMPLETE* file of the bundle directory by name (COMPLETE and the rank
        shards it lists as the gate checked them; any other kept as is)."""
        return {
            p.name: self._document(p.name)
            for p in sorted(self._b.path.glob("COMPLETE*"))
            if p.is_file()
        }

    def payloads(self, order: list[str]) -> Iterator[VerifiedPayload]:
        """The payloads named in `order`, one at a time: each is dropped from the gate's
        cache once the next is asked for, so about one payload is held at a time."""
        b = self._b
        for name in order:
            yield VerifiedPayload(
                name,
                b.payload_file_bytes(name),
                b.manifest.payloads[name].sha256,
                b.load_payload(name),
            )
            b.release(name)

    def _document(self, name: str) -> bytes:
        """The bytes to store of document `name`: those the gate read and checked when it
        kept them (`Bundle.files`: no second read, and a file changed since is not what is
        stored), else the file read again, refused if it changed since."""
        data = self._b.files.get(name)
        if data is not None:
            return data
        return _as_gated(self._b, name, read_bytes(self._b.path / name, name, document_limit(name)))


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


@dataclass
class VerifiedTarget:
    """A target (a bundle or a cohort directory) whose every rank passed the gate; nothing
    of it is written yet."""

    path: Path
    ranks: list[VerifiedRank]
    is_cohort: bool
    nbytes: int  # payload file bytes, for sizing a batch


def verify_target(path: Path) -> VerifiedTarget:
    """Open `path` behind the whole integrity gate (every rank); raise `TrajstoreError`
    with the reason it is refused. Reads, checks, writes nothing."""
    bset = open_target(path)
    member = bset.first
    expected = sorted(member.complete.expected_ranks)
    if not bset.is_cohort and member.rank is not None and len(expected) > 1:
        # stored alone it would be the whole step: replay would answer for one rank
        raise BundleError(
            f"rank {member.rank} of a cohort of ranks {expected}; ingest its cohort "
            f"directory {path.parent}"
        )
    cohort_files: dict[int, dict[str, bytes]] = {}
    if bset.is_cohort:
        whole = read_bytes(path / "COMPLETE", "cohort COMPLETE")
        for b in bset.bundles:
            shard = read_bytes(path / f"COMPLETE.{b.rank}", f"COMPLETE.{b.rank}")
            cohort_files[b.rank] = {"COMPLETE": whole, f"COMPLETE.{b.rank}": shard}
    # A cohort whose ranks' payloads together fit the cap one bundle keeps is kept as
    # checked (written without a second read, sha256 and parse); a larger one keeps
    # memory to one rank (each released after its check, re-read and re-checked on write).
    keep = sum(spec.bytes for b in bset.bundles for spec in b.manifest.payloads.values())
    keep_all = len(bset.bundles) == 1 or keep <= KEEP_CHECKED_BYTES
    ranks = []
    for b in bset.bundles:
        _load_payloads(b)
        problems = _problems(b)
        if problems:
            where = f"rank {b.rank}: " if bset.is_cohort else ""
            more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
            raise BundleError(f"{where}{problems[0]}{more}")
        if not keep_all:
            b.release()
        ranks.append(VerifiedRank(b, cohort_files.get(b.rank, {})))
    return VerifiedTarget(path, ranks, bset.is_cohort, sum(r.nbytes for r in ranks))


def verify_member(member: Path) -> VerifiedRank:
    """One `rank-<r>/` of a cohort whose cohort COMPLETE does not exist yet (a rank storing
    its own shard), behind the same gate; raise `BundleError` naming why it is refused."""
    b = open_bundle(member, before_cohort=True)
    problems = bundle_problems(b)
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise BundleError(f"{member}: {problems[0]}{more}")
    if b.rank is None:
        raise BundleError(f"{member}: not a cohort member (rank-<r>/)")
    return VerifiedRank(b, {})


def _problems(b: Bundle) -> list[str]:
    try:
        return bundle_problems(b)
    except TrajstoreError as e:
        return [str(e)]


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
