"""Open a bundle directory behind the full integrity gate.

Order matters: sentinels and hashes are checked before any payload is parsed,
and every payload's size and sha256 are checked before its tensor is built.
`open_bundle` never returns a bundle that failed the gate; `inspect_bundle`
(for `trajstore inspect`) reads what it can of an incomplete one.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trajstore.bundle.ptfile import PtTensor, read_pt_bytes
from trajstore.errors import BundleError
from trajstore.jsonio import (
    MAX_JSON_BYTES,
    parse_json,
    read_bytes,
    read_json,
    read_regular,
    sha256_bytes,
)
from trajstore.schema import CohortComplete, Complete, Index, Manifest, RankShard

METADATA_FILES = ("manifest.json", "index.json", "expected.json")
#: Default cap on one payload file: ingest holds about one payload in memory (docs/store.md
#: "Limits"), so a file the machine cannot hold is refused before any byte of it is read.
MAX_PAYLOAD_BYTES = 16 << 30
#: Environment variable overriding `MAX_PAYLOAD_BYTES` (bytes; 1 to 2**40).
MAX_PAYLOAD_ENV = "TRAJSTORE_MAX_PAYLOAD_BYTES"
#: index.json may be larger than the other documents (jsonio's 256 MiB): it lists every
#: sample, ~275 bytes each for a 1-token sample as the writer indents it (1M samples: 275 MiB).
MAX_INDEX_BYTES = 1 << 30
#: Default cap on samples per bundle: every command holds a few KB per sample (docs/store.md
#: "Limits"); checked right after index.json parses, before any sample object is built.
MAX_SAMPLES = 1 << 21
#: Environment variable overriding `MAX_SAMPLES` (1 to 2**24, the store's row limit).
MAX_SAMPLES_ENV = "TRAJSTORE_MAX_SAMPLES"
#: Checked payloads up to this size stay cached for ingest; larger ones are re-read
#: (and re-hashed) when written, so the gate never holds more than one large payload.
KEEP_CHECKED_BYTES = 256 << 20
#: A bundle keeps the document bytes its gate checked (`Bundle.files`) up to this size in all.
KEEP_DOCUMENT_BYTES = 64 << 20
# \Z, not "$": "$" also matches before a final newline ("rank-0\n" was rank 0)
_RANK_DIR = re.compile(r"^rank-(\d+)\Z", re.ASCII)


def _env_limit(name: str, default: int, most: int, what: str) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 0 < value <= most:
        raise BundleError(f"{name}={raw!r:.40}: expected {what} from 1 to {most}")
    return value


def max_payload_bytes() -> int:
    """The payload size cap: `TRAJSTORE_MAX_PAYLOAD_BYTES` if set, else `MAX_PAYLOAD_BYTES`."""
    return _env_limit(MAX_PAYLOAD_ENV, MAX_PAYLOAD_BYTES, 1 << 40, "a byte count")


def max_samples() -> int:
    """The samples-per-bundle cap: `TRAJSTORE_MAX_SAMPLES` if set, else `MAX_SAMPLES`."""
    return _env_limit(MAX_SAMPLES_ENV, MAX_SAMPLES, 1 << 24, "a sample count")


def document_limit(name: str) -> int:
    """The size cap of a bundle document (index.json's is larger: it grows with samples)."""
    return MAX_INDEX_BYTES if name == "index.json" else MAX_JSON_BYTES


def check_sample_count(index: Any) -> None:
    """Refuse a parsed index.json listing more samples than the cap, before building them."""
    samples = index.get("samples") if isinstance(index, dict) else None
    if isinstance(samples, list) and len(samples) > max_samples():
        raise BundleError(
            f"index.json lists {len(samples)} samples, beyond the limit of {max_samples()} "
            f"(set {MAX_SAMPLES_ENV} to raise it; each costs a few KB of memory)"
        )


def check_payload_sizes(manifest: Manifest) -> None:
    """Refuse, before reading any payload, one whose declared size is over the cap."""
    limit = max_payload_bytes()
    for name, spec in sorted(manifest.payloads.items()):
        if spec.bytes > limit:
            raise BundleError(
                f"payload '{name}' declares {spec.bytes} bytes, beyond the limit of {limit} "
                f"(set {MAX_PAYLOAD_ENV} to raise it; about that much memory is needed)"
            )


def check_payload_name(name: str) -> None:
    """Payload names are plain file names: no separators, no '..', not absolute."""
    if (
        not isinstance(name, str)
        or not name
        or "/" in name
        or "\\" in name
        or name in (".", "..")
        or ".." in name
        or name.startswith("~")
        or "\x00" in name
    ):
        raise BundleError(f"payload name {name!r} is not a plain file name; refused")


@dataclass
class Bundle:
    """A bundle that passed the integrity gate (or, from inspect, a partial one)."""

    path: Path
    manifest: Manifest
    index: Index
    expected: dict[str, Any]
    complete: Complete | None
    shards: dict[int, RankShard]
    rank: int | None = None
    warnings: list[str] = field(default_factory=list)
    #: the bytes the gate checked of manifest.json, index.json, expected.json, COMPLETE and
    #: each COMPLETE.<r> (empty when together over KEEP_DOCUMENT_BYTES, or released): storing
    #: these needs no re-read, and no check that the files did not change since
    files: dict[str, bytes] = field(default_factory=dict, repr=False)
    _raw: dict[str, bytes] = field(default_factory=dict, repr=False)
    _cache: dict[str, PtTensor] = field(default_factory=dict, repr=False)

    @property
    def bundle_id(self) -> str:
        return self.manifest.bundle_id

    @property
    def label(self) -> str:
        return self.bundle_id if self.rank is None else f"{self.bundle_id}[rank {self.rank}]"

    @property
    def major(self) -> int:
        return self.manifest.major

    def payload_names(self) -> list[str]:
        return sorted(self.manifest.payloads)

    def payload_file_bytes(self, name: str) -> bytes:
        """The verified bytes of ``payloads/<name>.pt``."""
        if name not in self._raw:
            self._raw[name] = self._read_verified(name)
        return self._raw[name]

    def load_payload(self, name: str) -> PtTensor:
        """The payload tensor (dtype and shape checked against the manifest)."""
        if name not in self._cache:
            spec = self.manifest.payloads.get(name)
            if spec is None:
                raise BundleError(f"{self.label}: no payload named '{name}'")
            t = read_pt_bytes(self.payload_file_bytes(name), label=f"payload '{name}'")
            if t.dtype != spec.dtype:
                raise BundleError(
                    f"payload '{name}': dtype {t.dtype}, manifest declares {spec.dtype}"
                )
            if tuple(t.shape) != tuple(spec.shape):
                raise BundleError(
                    f"payload '{name}': shape {list(t.shape)}, manifest declares {list(spec.shape)}"
                )
            self._cache[name] = t
        return self._cache[name]

    def payload(self, name: str) -> np.ndarray:
        return self.load_payload(name).array

    def _read_verified(self, name: str) -> bytes:
        check_payload_name(name)
        spec = self.manifest.payloads[name]
        path = self.path / "payloads" / f"{name}.pt"
        data = read_regular(path, max_payload_bytes())  # one open + fstat when all is well
        if data is None or len(data) != spec.bytes:
            data = self._read_checked(name, path, spec.bytes)
        digest = sha256_bytes(data)
        if digest != spec.sha256:
            raise BundleError(
                f"payload '{name}': sha256 mismatch (file {digest[:12]}…, manifest "
                f"{spec.sha256[:12]}…)"
            )
        return data

    def _read_checked(self, name: str, path: Path, declared: int) -> bytes:
        """Read a payload file step by step, wording why it is refused."""
        if path.is_symlink():
            raise BundleError(f"payload '{name}': {path} is a symlink; refused")
        if not path.is_file():
            raise BundleError(f"payload '{name}': file missing ({path})")
        size = path.stat().st_size
        if size != declared:
            raise BundleError(
                f"payload '{name}': size {size} bytes, manifest declares {declared} "
                "(truncated or replaced)"
            )
        return read_bytes(path, f"payload '{name}'", limit=max_payload_bytes())

    def release(self, name: str | None = None) -> None:
        """Drop cached payload bytes/tensors (one, or all, with `files`) to bound memory;
        re-read on use."""
        if name is None:
            self.files = {}
        for cache in (self._raw, self._cache):
            if name is None:
                cache.clear()
            else:
                cache.pop(name, None)

    def verify_payloads(self) -> None:
        """Check every payload's size, hash, dtype and shape (loads each tensor)."""
        for name in self.payload_names():
            self.load_payload(name)


_FLOAT_MAX = int(sys.float_info.max)
#: a run of digits this long may be an integer beyond float64 (~1.8e308)
_FLOAT_DIGITS = re.compile(rb"[0-9]{309}")


def _beyond_float(value: Any) -> int | None:
    """The digit count of the first integer in `value` that no float64 holds, else None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) is int and abs(item) > _FLOAT_MAX:
            return len(str(abs(item)))
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


def parse_expected(raw: bytes) -> dict[str, Any]:
    """expected.json as every reader takes it: a JSON object keyed by stage whose numbers
    are float64s (every stage compares them as one: an integer past ~1.8e308 raised an
    OverflowError in the stage that read it). What each stage reads from it is checked by
    the stage (`trajstore.replay`)."""
    expected = parse_json(raw, "expected.json")
    if not isinstance(expected, dict):
        raise BundleError("expected.json: expected a JSON object keyed by stage")
    if _FLOAT_DIGITS.search(raw):
        digits = _beyond_float(expected)
        if digits is not None:
            raise BundleError(f"expected.json: an integer of {digits} digits is beyond a float64")
    return expected


def _read_docs(path: Path) -> tuple[dict[str, bytes], Manifest, Index, dict[str, Any]]:
    raw = {name: read_bytes(path / name, name, document_limit(name)) for name in METADATA_FILES}
    manifest = Manifest.from_dict(parse_json(raw["manifest.json"], "manifest.json"))
    for name in manifest.payloads:
        check_payload_name(name)
    check_payload_sizes(manifest)  # up front: before index.json's samples are even built
    parsed_index = parse_json(raw["index.json"], "index.json")
    check_sample_count(parsed_index)
    index = Index.from_dict(parsed_index)
    expected = parse_expected(raw["expected.json"])
    if manifest.bundle_id != index.bundle_id:
        raise BundleError(
            f"bundle_id differs: manifest.json {manifest.bundle_id!r}, index.json "
            f"{index.bundle_id!r}"
        )
    return raw, manifest, index, expected


def _anchor_of(index: Index) -> tuple[Any, Any]:
    ident = index.identity.raw
    return (ident.get("actor_step_id"), ident.get("rollout_id"))


def open_bundle(
    path: Path | str, *, verify_payloads: bool = False, before_cohort: bool = False
) -> Bundle:
    """Open one bundle directory (a plain bundle or one ``rank-<r>/`` of a cohort).

    Checks: COMPLETE well-formed, metadata hashes, rank shards against the
    manifest, the cohort sentinel for a multi-rank member. Payload bytes are
    checked lazily on first use, or all at once with ``verify_payloads``.
    ``before_cohort`` opens a cohort member whose cohort COMPLETE does not exist
    yet (a rank storing its own shard; the cohort is checked when it is published).
    """
    path = Path(path)
    if not path.is_dir():
        raise BundleError(f"{path}: not a bundle directory")
    if not (path / "COMPLETE").exists():
        raise BundleError(f"{path}: COMPLETE is missing (bundle incomplete or still being written)")
    complete_bytes = read_bytes(path / "COMPLETE", "COMPLETE")
    complete = Complete.from_dict(parse_json(complete_bytes, "COMPLETE"), "COMPLETE")
    files = {"COMPLETE": complete_bytes}
    raw, manifest, index, expected = _read_docs(path)
    for name in METADATA_FILES:
        digest = sha256_bytes(raw[name])
        if complete.metadata[name] != digest:
            raise BundleError(
                f"{name}: sha256 does not match COMPLETE (edited after the bundle was signed)"
            )

    shards: dict[int, RankShard] = {}
    owner: dict[str, int] = {}
    for r in complete.ranks:
        shard_path = path / f"COMPLETE.{r}"
        if not shard_path.exists():
            raise BundleError(f"rank shard COMPLETE.{r} is missing (COMPLETE lists rank {r})")
        shard_bytes = read_bytes(shard_path, f"COMPLETE.{r}")
        files[f"COMPLETE.{r}"] = shard_bytes
        shard = RankShard.from_dict(parse_json(shard_bytes, f"COMPLETE.{r}"), f"COMPLETE.{r}")
        if shard.metadata != complete.metadata:
            raise BundleError(f"COMPLETE.{r}: metadata hashes differ from COMPLETE")
        if shard.anchor() != _anchor_of(index):
            raise BundleError(
                f"COMPLETE.{r}: anchor {shard.anchor()} differs from index.json identity"
            )
        for name, digest in shard.payloads.items():
            if name in owner:
                raise BundleError(f"payload '{name}' is owned by two ranks ({owner[name]} and {r})")
            owner[name] = r
            spec = manifest.payloads.get(name)
            if spec is None:
                raise BundleError(f"COMPLETE.{r}: claims payload '{name}' absent from the manifest")
            if spec.sha256 != digest:
                raise BundleError(
                    f"COMPLETE.{r}: sha256 of payload '{name}' differs from the manifest"
                )
        shards[r] = shard
    missing = sorted(set(manifest.payloads) - set(owner))
    if missing:
        raise BundleError(f"payload(s) {', '.join(missing)} claimed by no rank shard")

    rank = None
    m = _RANK_DIR.match(path.name)
    expected_ranks = complete.expected_ranks
    if m:
        rank = int(m.group(1))
    if m and len(expected_ranks) > 1 and before_cohort:
        pass  # its cohort is checked and published later, from every rank's shard
    elif m and len(expected_ranks) > 1:
        # A cohort member: only the cohort COMPLETE makes it readable.
        cc = _require_cohort_complete(path.parent, expected_ranks)
        cshard = cc.shards.get(rank)
        if cshard is None or cshard.metadata != complete.metadata:
            raise BundleError(
                f"{path}: rank {rank} metadata hashes differ from the cohort COMPLETE's shard "
                f"{rank}"
            )
    elif sorted(set(complete.ranks)) != sorted(set(expected_ranks)):
        # A single-directory bundle is complete only when every expected rank signed it.
        raise BundleError(
            f"{path}: COMPLETE lists ranks {sorted(complete.ranks)} but expects ranks "
            f"{sorted(expected_ranks)} "
            "(bundle incomplete; a rank member belongs in rank-<r>/ of a cohort)"
        )
    bundle = Bundle(
        path=path,
        manifest=manifest,
        index=index,
        expected=expected,
        complete=complete,
        shards=shards,
        rank=rank,
        warnings=manifest.warnings() + index.warnings(),
        _raw={},
    )
    files.update(raw)
    if sum(map(len, files.values())) <= KEEP_DOCUMENT_BYTES:
        bundle.files = files
    if verify_payloads:
        bundle.verify_payloads()
    return bundle


def _require_cohort_complete(cohort: Path, expected_ranks: list[int]) -> CohortComplete:
    sentinel = cohort / "COMPLETE"
    if not sentinel.exists():
        raise BundleError(
            f"{cohort}: cohort is not complete "
            f"(no cohort COMPLETE; ranks {expected_ranks} expected); "
            "a rank bundle of an unfinished cohort is refused"
        )
    cc = CohortComplete.from_dict(read_json(sentinel, "cohort COMPLETE"))
    if sorted(cc.ranks) != sorted(expected_ranks):
        raise BundleError(
            f"{cohort}: cohort COMPLETE lists ranks {sorted(cc.ranks)}, members expect "
            f"{sorted(expected_ranks)}"
        )
    return cc


@dataclass
class BundleSet:
    """What one target names: a single bundle, or every rank of a cohort."""

    path: Path
    bundles: list[Bundle]
    cohort: CohortComplete | None = None

    @property
    def is_cohort(self) -> bool:
        return self.cohort is not None

    @property
    def first(self) -> Bundle:
        return self.bundles[0]


def is_bundle_dir(path: Path) -> bool:
    return (path / "manifest.json").is_file()


def is_cohort_dir(path: Path) -> bool:
    return not is_bundle_dir(path) and any(_RANK_DIR.match(p.name) for p in _children(path))


def _children(path: Path) -> list[Path]:
    try:
        return sorted(p for p in path.iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        return []


def open_cohort(path: Path, *, verify_payloads: bool = False) -> BundleSet:
    """Open a multi-rank cohort directory: every rank, checked against its shard."""
    if not (path / "COMPLETE").exists():
        ranks = sorted(
            int(_RANK_DIR.match(p.name).group(1))
            for p in _children(path)
            if _RANK_DIR.match(p.name)
        )
        raise BundleError(
            f"{path}: cohort is not complete (no cohort COMPLETE; rank dirs present: {ranks})"
        )
    cc = CohortComplete.from_dict(read_json(path / "COMPLETE", "cohort COMPLETE"))
    if sorted(cc.shards) != sorted(cc.ranks):
        raise BundleError(
            f"{path}: cohort COMPLETE ranks {cc.ranks} and shards {sorted(cc.shards)} differ"
        )
    bundles = []
    anchors = set()
    for r in sorted(cc.ranks):
        shard = cc.shards[r]
        rel = shard.get("relpath", f"rank-{r}")
        if rel != f"rank-{r}":
            raise BundleError(f"{path}: shard {r} relpath {rel!r} is not 'rank-{r}'")
        shard_file = path / f"COMPLETE.{r}"
        if not shard_file.exists():
            raise BundleError(f"{path}: cohort shard COMPLETE.{r} is missing")
        on_disk = RankShard.from_dict(read_json(shard_file, f"COMPLETE.{r}"), f"COMPLETE.{r}")
        if on_disk.raw != shard.raw:
            raise BundleError(f"{path}: COMPLETE.{r} differs from the cohort COMPLETE's shard {r}")
        if sorted(shard.expected_ranks) != sorted(cc.ranks):
            raise BundleError(
                f"{path}: shard {r} expects ranks {shard.expected_ranks}, cohort has {cc.ranks}"
            )
        member = path / rel
        if not member.is_dir():
            raise BundleError(f"{path}: rank {r} directory {rel} is missing")
        b = open_bundle(member, verify_payloads=verify_payloads)
        if b.complete.metadata != shard.metadata:
            raise BundleError(f"{path}: rank {r} metadata hashes differ from its cohort shard")
        for name, digest in shard.payloads.items():
            spec = b.manifest.payloads.get(name)
            if spec is None or spec.sha256 != digest:
                raise BundleError(
                    f"{path}: rank {r} payload '{name}' differs from its cohort shard"
                )
        anchors.add(repr(shard.anchor()))
        bundles.append(b)
    if len(anchors) != 1:
        raise BundleError(f"{path}: cohort shards disagree on the anchor")
    return BundleSet(path, bundles, cc)


def open_target(path: Path | str, *, verify_payloads: bool = False) -> BundleSet:
    """Open a bundle directory or a cohort directory (not a capture directory)."""
    path = Path(path)
    if is_bundle_dir(path):
        return BundleSet(path, [open_bundle(path, verify_payloads=verify_payloads)])
    if is_cohort_dir(path):
        return open_cohort(path, verify_payloads=verify_payloads)
    if not path.exists():
        raise BundleError(f"{path}: no such file or directory")
    raise BundleError(f"{path}: neither a bundle (no manifest.json) nor a cohort (no rank-*/)")
