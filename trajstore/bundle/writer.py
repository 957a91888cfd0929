"""Write replay bundles (format major 1) atomically.

A bundle is built in a hidden sibling temp directory and published with one
``rename``: the final name never holds a partial bundle, an existing bundle is
never overwritten, and the temp directory is removed on failure. Multi-rank
producers write ``<cohort>/rank-<r>/`` plus a cohort shard ``COMPLETE.<r>``
and call `try_finalize`, which never waits: whoever completes the set
publishes the cohort ``COMPLETE``.

``durable`` (the default) also survives a power loss: every file ``COMPLETE``
vouches for, payloads included, is fsynced (in one round, on threads) before
``COMPLETE`` is written, and the directories after it. Without it nothing is
fsynced: a process that dies still never leaves a partial bundle under its final
name, and after an OS crash a bundle whose files did not all reach the disk is
refused by every reader by the hashes ``COMPLETE`` holds. Capture writes without
(``TRAJSTORE_CAPTURE_DURABLE``): its fsyncs slowed verl's ``update_actor`` by ~5%,
from the other core (docs/capture.md, Durability).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trajstore.bundle.ptfile import as_torch, read_pt_bytes
from trajstore.bundle.reader import check_payload_name
from trajstore.errors import BundleError
from trajstore.jsonio import (
    atomic_create,
    canonical_bytes,
    fsync_all,
    fsync_path,
    read_json,
    sha256_bytes,
    temp_sibling,
)
from trajstore.schema import WRITE_FORMAT_VERSION, CohortComplete, Index, Manifest, RankShard
from trajstore.vocab import Payload, Stage

#: stage -> (inputs, expected outputs) of the major-1 contract ("v1").
V1_STAGES: dict[str, tuple[list[str], list[str]]] = {
    Stage.SAMPLE: (["index.samples"], []),
    Stage.REWARD_RAW: (["index.samples.raw_reward"], [f"expected.{Stage.REWARD_RAW}"]),
    Stage.REWARD_POST_PROCESS: ([Stage.REWARD_RAW], [f"expected.{Stage.REWARD_POST_PROCESS}"]),
    Stage.ADVANTAGE_KL: ([Payload.OLD_LOG_PROBS, Payload.REF_LOG_PROBS], [Payload.KL]),
    Stage.ADVANTAGE_ESTIMATE: (["index.samples.reward", Payload.KL], [Payload.ADVANTAGES]),
    Stage.LOSS_POLICY: (
        [Payload.OLD_LOG_PROBS, Payload.LOG_PROBS, Payload.ENTROPY, Payload.ADVANTAGES],
        [f"expected.{Stage.LOSS_POLICY}"],
    ),
    Stage.ROUTER_CONSISTENCY: (
        [
            Payload.ROLLOUT_ROUTED_EXPERTS,
            Payload.TRAIN_ROUTED_EXPERTS,
            Payload.ROLLOUT_LOG_PROBS,
            Payload.TRAIN_LOG_PROBS,
        ],
        [f"expected.{Stage.ROUTER_CONSISTENCY}"],
    ),
}


def stage_contract(stage: str, inputs: list[str], outputs: list[str]) -> dict[str, Any]:
    """A stage contract trajstore writes: recomputed, reimplemented, version v1."""
    return {
        "capability": "recompute",
        "expected_outputs": outputs,
        "implementation": "reimplemented",
        "inputs": inputs,
        "stage": stage,
        "version": "v1",
    }


def default_stage_contracts(
    payloads: set[str], expected: dict[str, Any], samples: list[dict]
) -> dict:
    """Declare the v1 stages whose inputs this bundle actually carries."""
    has_raw = bool(samples) and all("raw_reward" in s for s in samples)
    routes = {Payload.ROLLOUT_ROUTED_EXPERTS, Payload.TRAIN_ROUTED_EXPERTS}
    present = {
        Stage.SAMPLE: True,
        Stage.REWARD_RAW: has_raw and Stage.REWARD_RAW in expected,
        Stage.REWARD_POST_PROCESS: has_raw and Stage.REWARD_POST_PROCESS in expected,
        # verl records the rewards before and after its KL in reward, not the KL itself
        Stage.ADVANTAGE_KL: {Payload.KL} <= payloads
        or {Payload.TOKEN_LEVEL_SCORES, Payload.TOKEN_LEVEL_REWARDS} <= payloads,
        Stage.ADVANTAGE_ESTIMATE: {Payload.ADVANTAGES} <= payloads,
        Stage.LOSS_POLICY: {Payload.OLD_LOG_PROBS, Payload.LOG_PROBS, Payload.ADVANTAGES}
        <= payloads
        and Stage.LOSS_POLICY in expected,
        Stage.ROUTER_CONSISTENCY: routes <= payloads and Stage.ROUTER_CONSISTENCY in expected,
    }
    out = {}
    for stage, (inputs, outputs) in V1_STAGES.items():
        if present[stage]:
            out[stage] = stage_contract(stage, inputs, outputs)
    return out


@dataclass
class BundleContents:
    """Everything a bundle holds, before it is serialized.

    ``payloads`` values are torch tensors, NumPy arrays, or ``bytes`` of an
    existing ``torch.save`` file (written verbatim: how export reproduces the
    original files byte for byte).
    """

    bundle_id: str
    identity: dict[str, Any]
    samples: list[dict[str, Any]]
    config: dict[str, Any]
    payloads: dict[str, Any]
    expected: dict[str, Any] = field(default_factory=dict)
    stage_contracts: dict[str, Any] | None = None
    producer: dict[str, str] | None = None
    comparison_policy: dict[str, Any] | None = None
    redaction: dict[str, str] | None = None
    format_version: str = WRITE_FORMAT_VERSION
    extra_manifest: dict[str, Any] = field(default_factory=dict)
    #: index.json ``extensions``: a framework's data kept verbatim (bundle-format.md)
    extensions: dict[str, Any] | None = None


def _default_producer() -> dict[str, str]:
    import torch

    return {
        "commit": os.environ.get("TRAJSTORE_PRODUCER_COMMIT", ""),
        "dirty_patch_digest": "",
        "torch_version": str(torch.__version__),
    }


def _write_payload(path: Path, name: str, value: Any) -> dict[str, Any]:
    check_payload_name(name)
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        t = read_pt_bytes(data, label=f"payload '{name}'")
        _write_file(path, data, durable=False)
    else:
        import numpy as np
        import torch

        if not isinstance(value, (torch.Tensor, np.ndarray)):
            raise BundleError(
                f"payload '{name}': unsupported value type {type(value).__name__} "
                "(a torch tensor, a NumPy array or torch.save bytes)"
            )
        tensor = as_torch(value)
        # To the path, not to a buffer: torch names the zip's root folder after the file
        # ("log_probs/data.pkl"; a buffer gets "archive/"), and the bytes stay what every
        # earlier trajstore wrote (the store dedups the records by those bytes).
        try:
            torch.save(tensor, path)
        except RuntimeError as e:
            raise _disk_full_or(e, path, tensor.nbytes) from e
        data = path.read_bytes()
        # Never write what the reader refuses (e.g. complex dtypes).
        t = read_pt_bytes(data, label=f"payload '{name}'")
    return {
        "bytes": len(data),
        "dtype": t.dtype,
        "name": name,
        "sha256": sha256_bytes(data),
        "shape": list(t.shape),
    }


def _disk_full_or(error: RuntimeError, path: Path, nbytes: int) -> Exception:
    """torch.save writes through C++ streams, whose failure carries no errno
    ("basic_ios::clear: iostream error"): when the file system has less room than the
    payload, call it what it most likely is, ENOSPC, so callers count and report a full
    disk as such; otherwise the original error."""
    try:
        v = os.statvfs(path.parent)
    except OSError:
        return error
    if v.f_bavail * v.f_frsize < nbytes + (64 << 10):
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return error


def _write_file(path: Path, data: bytes, *, durable: bool = False) -> None:
    """Create ``path`` with ``data`` in as few system calls as Python allows (each one
    releases and retakes the GIL a training thread is waiting for); fsync if durable."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def write_bundle(
    dest: Path | str,
    contents: BundleContents,
    *,
    rank: int | None = None,
    expected_ranks: list[int] | None = None,
    durable: bool = True,
) -> Path:
    """Write ``contents`` as a complete bundle at ``dest`` (which must not exist);
    ``durable``: fsynced so that it survives a power loss (the module docstring)."""
    dest = Path(dest)
    if dest.exists():
        raise BundleError(f"{dest}: already exists; refusing to overwrite a bundle")
    dest.parent.mkdir(parents=True, exist_ok=True)
    r = 0 if rank is None else rank
    ranks = [r] if expected_ranks is None else sorted(expected_ranks)
    tmp = temp_sibling(dest)
    try:
        (tmp / "payloads").mkdir(parents=True)
        files = {name: tmp / "payloads" / f"{name}.pt" for name in sorted(contents.payloads)}
        specs = {
            name: _write_payload(path, name, contents.payloads[name])
            for name, path in files.items()
        }
        contracts = contents.stage_contracts
        if contracts is None:
            contracts = default_stage_contracts(set(specs), contents.expected, contents.samples)
        manifest = {
            "bundle_id": contents.bundle_id,
            "comparison_policy": contents.comparison_policy
            or {"exact_fields": ["sample_id", "loss_mask", "group_index"], "tolerances": {}},
            "format_version": contents.format_version,
            "payloads": specs,
            "producer": contents.producer or _default_producer(),
            "redaction": contents.redaction or {},
            "stage_contracts": contracts,
            **contents.extra_manifest,
        }
        index = {
            "bundle_id": contents.bundle_id,
            "config": contents.config,
            "identity": contents.identity,
            "samples": contents.samples,
        }
        if contents.extensions is not None:
            index["extensions"] = contents.extensions
        # Validate through the same models the reader uses: never write what we refuse.
        Manifest.from_dict(manifest)
        parsed_index = Index.from_dict(index)
        docs = {
            "manifest.json": canonical_bytes(manifest),
            "index.json": canonical_bytes(index),
            "expected.json": canonical_bytes(contents.expected),
        }
        for fname, data in docs.items():
            _write_file(tmp / fname, data)
        metadata = {fname: sha256_bytes(data) for fname, data in docs.items()}
        ident = parsed_index.identity.raw
        shard = {
            "actor_step_id": ident.get("actor_step_id"),
            "expected_ranks": ranks,
            "metadata": metadata,
            "payloads": {name: spec["sha256"] for name, spec in specs.items()},
            "rollout_id": ident.get("rollout_id"),
        }
        _write_file(tmp / f"COMPLETE.{r}", canonical_bytes(shard))
        if durable:  # what COMPLETE vouches for is on disk before COMPLETE is
            fsync_all(
                [*files.values(), tmp / "payloads", *(tmp / f for f in docs), tmp / f"COMPLETE.{r}"]
            )
        _write_file(
            tmp / "COMPLETE",
            canonical_bytes({"expected_ranks": ranks, "metadata": metadata, "ranks": [r]}),
            durable=durable,
        )
        if durable:
            fsync_path(tmp)
        try:
            os.rename(tmp, dest)
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise  # e.g. a full disk: not a bundle that appeared meanwhile
            raise BundleError(f"{dest}: appeared while writing; refusing to overwrite") from None
        if durable:
            fsync_path(dest.parent)
        return dest
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_rank(
    cohort_dir: Path | str,
    contents: BundleContents,
    *,
    rank: int,
    expected_ranks: list[int],
    durable: bool = True,
) -> Path:
    """Write one rank of a cohort, its cohort shard, then try to finalize (``durable`` as
    in `write_bundle`, for all three)."""
    cohort_dir = Path(cohort_dir)
    if rank not in expected_ranks:
        raise BundleError(f"rank {rank} is not among expected ranks {expected_ranks}")
    cohort_dir.mkdir(parents=True, exist_ok=True)
    member = write_bundle(
        cohort_dir / f"rank-{rank}",
        contents,
        rank=rank,
        expected_ranks=expected_ranks,
        durable=durable,
    )
    shard = read_json(member / f"COMPLETE.{rank}", f"COMPLETE.{rank}")
    shard["relpath"] = f"rank-{rank}"
    if not atomic_create(cohort_dir / f"COMPLETE.{rank}", canonical_bytes(shard), durable=durable):
        raise BundleError(f"{cohort_dir}: cohort shard COMPLETE.{rank} already exists")
    try_finalize(cohort_dir, durable=durable)
    return member


def try_finalize(cohort_dir: Path | str, *, durable: bool = True) -> bool:
    """Publish the cohort COMPLETE if every expected shard is present. Never waits.

    Idempotent and safe to race: the sentinel is created with an atomic link,
    so of several ranks finishing together exactly one publishes it.
    """
    cohort_dir = Path(cohort_dir)
    if (cohort_dir / "COMPLETE").exists():
        return True
    shards: dict[int, RankShard] = {}
    for p in cohort_dir.glob("COMPLETE.*"):
        suffix = p.name.split(".", 1)[1]
        if suffix.isdigit():
            with contextlib.suppress(BundleError):
                shards[int(suffix)] = RankShard.from_dict(read_json(p, p.name), p.name)
    if not shards:
        return False
    expected = {tuple(sorted(s.expected_ranks)) for s in shards.values()}
    if len(expected) != 1:
        raise BundleError(
            f"{cohort_dir}: cohort shards disagree on expected ranks {sorted(expected)}"
        )
    want = list(expected.pop())
    if sorted(shards) != want:
        return False
    if len({repr(s.anchor()) for s in shards.values()}) != 1:
        raise BundleError(f"{cohort_dir}: cohort shards disagree on the anchor; not finalizing")
    doc = {"ranks": want, "shards": {str(r): shards[r].raw for r in want}}
    CohortComplete.from_dict(doc)
    atomic_create(cohort_dir / "COMPLETE", canonical_bytes(doc), durable=durable)
    return True
