"""Write replay bundles (format major 1) atomically.

A bundle is built in a hidden sibling temp directory and published with one
``rename``: the final name never holds a partial bundle, an existing bundle is
never overwritten, and the temp directory is removed on failure. Multi-rank
producers write ``<cohort>/rank-<r>/`` plus a cohort shard ``COMPLETE.<r>``
and call `try_finalize`, which never waits: whoever completes the set
publishes the cohort ``COMPLETE``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trajstore.bundle.ptfile import as_torch, read_pt_bytes
from trajstore.bundle.reader import check_payload_name
from trajstore.errors import BundleError
from trajstore.jsonio import canonical_bytes, read_json, sha256_bytes
from trajstore.schema import WRITE_FORMAT_VERSION, CohortComplete, Index, Manifest, RankShard

#: stage -> (inputs, expected outputs) of the major-1 contract ("v1").
V1_STAGES: dict[str, tuple[list[str], list[str]]] = {
    "sample": (["index.samples"], []),
    "reward.raw": (["index.samples.raw_reward"], ["expected.reward.raw"]),
    "reward.post_process": (["reward.raw"], ["expected.reward.post_process"]),
    "advantage.kl": (["old_log_probs", "ref_log_probs"], ["kl"]),
    "advantage.estimate": (["index.samples.reward", "kl"], ["advantages"]),
    "loss.policy": (
        ["old_log_probs", "log_probs", "entropy", "advantages"],
        ["expected.loss.policy"],
    ),
    "router.consistency": (
        ["rollout_routed_experts", "train_routed_experts", "rollout_log_probs", "train_log_probs"],
        ["expected.router.consistency"],
    ),
}


def default_stage_contracts(payloads: set[str], expected: dict[str, Any], samples: list[dict]) -> dict:
    """Declare the v1 stages whose inputs this bundle actually carries."""
    has_raw = bool(samples) and all("raw_reward" in s for s in samples)
    present = {
        "sample": True,
        "reward.raw": has_raw and "reward.raw" in expected,
        "reward.post_process": has_raw and "reward.post_process" in expected,
        "advantage.kl": {"kl"} <= payloads,
        "advantage.estimate": {"advantages"} <= payloads,
        "loss.policy": {"old_log_probs", "log_probs", "advantages"} <= payloads
        and "loss.policy" in expected,
        "router.consistency": {"rollout_routed_experts", "train_routed_experts"} <= payloads
        and "router.consistency" in expected,
    }
    out = {}
    for stage, (inputs, outputs) in V1_STAGES.items():
        if present[stage]:
            out[stage] = {
                "capability": "recompute",
                "expected_outputs": outputs,
                "implementation": "reimplemented",
                "inputs": inputs,
                "stage": stage,
                "version": "v1",
            }
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
        path.write_bytes(data)
        dtype, shape = t.dtype, list(t.shape)
    else:
        import numpy as np
        import torch

        if not isinstance(value, (torch.Tensor, np.ndarray)):
            raise BundleError(
                f"payload '{name}': unsupported value type {type(value).__name__} "
                "(a torch tensor, a NumPy array or torch.save bytes)"
            )
        tensor = as_torch(value)
        torch.save(tensor, path)
        data = path.read_bytes()
        # Never write what the reader refuses (e.g. complex dtypes).
        t = read_pt_bytes(data, label=f"payload '{name}'")
        dtype, shape = t.dtype, list(t.shape)
    return {"bytes": len(data), "dtype": dtype, "name": name, "sha256": sha256_bytes(data), "shape": shape}


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _temp_sibling(dest: Path) -> Path:
    return dest.parent / f".{dest.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"


def write_bundle(
    dest: Path | str,
    contents: BundleContents,
    *,
    rank: int | None = None,
    expected_ranks: list[int] | None = None,
) -> Path:
    """Write ``contents`` as a complete bundle at ``dest`` (which must not exist)."""
    dest = Path(dest)
    if dest.exists():
        raise BundleError(f"{dest}: already exists; refusing to overwrite a bundle")
    dest.parent.mkdir(parents=True, exist_ok=True)
    r = 0 if rank is None else rank
    ranks = [r] if expected_ranks is None else sorted(expected_ranks)
    tmp = _temp_sibling(dest)
    try:
        (tmp / "payloads").mkdir(parents=True)
        specs = {
            name: _write_payload(tmp / "payloads" / f"{name}.pt", name, value)
            for name, value in sorted(contents.payloads.items())
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
        # Validate through the same models the reader uses: never write what we refuse.
        Manifest.from_dict(manifest)
        parsed_index = Index.from_dict(index)
        docs = {
            "manifest.json": canonical_bytes(manifest),
            "index.json": canonical_bytes(index),
            "expected.json": canonical_bytes(contents.expected),
        }
        for fname, data in docs.items():
            _fsync_write(tmp / fname, data)
        metadata = {fname: sha256_bytes(data) for fname, data in docs.items()}
        ident = parsed_index.identity.raw
        shard = {
            "actor_step_id": ident.get("actor_step_id"),
            "expected_ranks": ranks,
            "metadata": metadata,
            "payloads": {name: spec["sha256"] for name, spec in specs.items()},
            "rollout_id": ident.get("rollout_id"),
        }
        _fsync_write(tmp / f"COMPLETE.{r}", canonical_bytes(shard))
        _fsync_write(
            tmp / "COMPLETE",
            canonical_bytes({"expected_ranks": ranks, "metadata": metadata, "ranks": [r]}),
        )
        try:
            os.rename(tmp, dest)
        except OSError:
            raise BundleError(f"{dest}: appeared while writing; refusing to overwrite") from None
        return dest
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _atomic_create(path: Path, data: bytes) -> bool:
    """Create ``path`` with ``data`` unless it exists (link is atomic, no overwrite)."""
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    _fsync_write(tmp, data)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink()


def write_rank(
    cohort_dir: Path | str, contents: BundleContents, *, rank: int, expected_ranks: list[int]
) -> Path:
    """Write one rank of a cohort, its cohort shard, then try to finalize."""
    cohort_dir = Path(cohort_dir)
    if rank not in expected_ranks:
        raise BundleError(f"rank {rank} is not among expected ranks {expected_ranks}")
    cohort_dir.mkdir(parents=True, exist_ok=True)
    member = write_bundle(cohort_dir / f"rank-{rank}", contents, rank=rank, expected_ranks=expected_ranks)
    shard = read_json(member / f"COMPLETE.{rank}", f"COMPLETE.{rank}")
    shard["relpath"] = f"rank-{rank}"
    if not _atomic_create(cohort_dir / f"COMPLETE.{rank}", canonical_bytes(shard)):
        raise BundleError(f"{cohort_dir}: cohort shard COMPLETE.{rank} already exists")
    try_finalize(cohort_dir)
    return member


def try_finalize(cohort_dir: Path | str) -> bool:
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
        raise BundleError(f"{cohort_dir}: cohort shards disagree on expected ranks {sorted(expected)}")
    want = list(expected.pop())
    if sorted(shards) != want:
        return False
    if len({repr(s.anchor()) for s in shards.values()}) != 1:
        raise BundleError(f"{cohort_dir}: cohort shards disagree on the anchor; not finalizing")
    doc = {"ranks": want, "shards": {str(r): shards[r].raw for r in want}}
    CohortComplete.from_dict(doc)
    _atomic_create(cohort_dir / "COMPLETE", canonical_bytes(doc))
    return True
