"""What `trajstore inspect` shows: identity, layout, producer, capabilities.

Works on an incomplete bundle too: it reads whatever documents parse and says
why the bundle would be refused.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from trajstore.bundle.reader import Bundle, open_target
from trajstore.errors import TrajstoreError
from trajstore.jsonio import read_json
from trajstore.schema import Index, Manifest


def _summary(
    manifest: Manifest | None, index: Index | None, expected: dict | None
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if manifest is not None:
        out["bundle_id"] = manifest.bundle_id
        out["format_version"] = manifest.format_version
        out["producer"] = manifest.producer
        out["stage_capabilities"] = {
            k: c.capability for k, c in sorted(manifest.stage_contracts.items())
        }
        out["payloads"] = {
            name: {"dtype": p.dtype, "shape": list(p.shape), "bytes": p.bytes}
            for name, p in sorted(manifest.payloads.items())
        }
        out["redaction"] = manifest.get("redaction", {})
    if index is not None:
        ident = index.identity
        samples = index.samples
        groups = Counter(s.semantic_group for s in samples)
        mbs = Counter(s.micro_batch_id for s in samples)
        out["identity"] = {
            "kind": ident.kind,
            "rollout_id": ident.rollout_id,
            "step_id": ident.step_id,
            "actor_step_id": ident.get("actor_step_id"),
            "rollout_partition_ids": ident.get("rollout_partition_ids", []),
            "consumer_batch_ids": ident.get("consumer_batch_ids", []),
            "weight_lineage": ident.get("weight_lineage"),
            "rank": ident.get("rank", {}),
        }
        out["samples"] = {
            "count": len(samples),
            "response_tokens": sum(s.response_length for s in samples),
            "total_tokens": sum(s.total_length for s in samples),
            "masked_tokens": sum(sum(s.loss_mask) for s in samples),
        }
        out["groups"] = {str(g): n for g, n in sorted(groups.items(), key=lambda kv: str(kv[0]))}
        out["micro_batches"] = {
            str(m): n for m, n in sorted(mbs.items(), key=lambda kv: str(kv[0]))
        }
        out["config"] = index.config
    if expected is not None:
        out["expected_stages"] = sorted(expected)
    return out


def _lenient(path: Path) -> dict[str, Any]:
    docs: dict[str, Any] = {}
    problems: list[str] = []
    for name, model in (
        ("manifest.json", Manifest),
        ("index.json", Index),
        ("expected.json", None),
    ):
        try:
            d = read_json(path / name, name)
            docs[name] = model.from_dict(d) if model else d
        except TrajstoreError as exc:
            problems.append(str(exc))
    out = _summary(docs.get("manifest.json"), docs.get("index.json"), docs.get("expected.json"))
    out["unreadable"] = problems
    return out


def inspect_target(path: Path) -> dict[str, Any]:
    """Summary of a bundle or cohort; ``complete`` False (with the reason) if refused."""
    try:
        bset = open_target(path)
    except TrajstoreError as exc:
        members = sorted(path.glob("rank-*")) if not (path / "manifest.json").exists() else [path]
        out = {"path": str(path), "complete": False, "reason": str(exc)}
        out["members"] = [{"path": str(m), **_lenient(m)} for m in members]
        return out
    members = []
    for b in bset.bundles:
        members.append(
            {"path": str(b.path), "rank": b.rank, "warnings": b.warnings, **_bundle_summary(b)}
        )
    return {
        "path": str(path),
        "complete": True,
        "cohort_ranks": bset.cohort.ranks if bset.cohort else None,
        "members": members,
    }


def _bundle_summary(b: Bundle) -> dict[str, Any]:
    return _summary(b.manifest, b.index, b.expected)


def format_inspect(info: dict[str, Any]) -> str:
    lines = [f"{info['path']}"]
    if info["complete"]:
        status = "complete"
        if info.get("cohort_ranks"):
            status += f" cohort of ranks {info['cohort_ranks']}"
    else:
        status = f"INCOMPLETE — {info['reason']}"
    lines.append(f"  status: {status}")
    for m in info["members"]:
        if len(info["members"]) > 1 or m.get("rank") is not None:
            lines.append(f"  [{m['path']}]")
        if "bundle_id" in m:
            lines.append(f"  bundle {m['bundle_id']}  format {m['format_version']}")
        ident = m.get("identity")
        if ident:
            anchor = (
                f"actor step {ident['rollout_id']}:{ident['step_id']}"
                if ident["kind"] == "step"
                else f"rollout {ident['rollout_id']}"
            )
            lines.append(f"  identity: {ident['kind']} bundle, {anchor}")
            lines.append(
                f"    rollout partitions {ident['rollout_partition_ids']}  consumer batches "
                f"{ident['consumer_batch_ids']}"
            )
            lines.append(f"    weights {ident['weight_lineage']}  rank {ident['rank']}")
        if "samples" in m:
            s = m["samples"]
            lines.append(
                f"  samples: {s['count']}  response tokens {s['response_tokens']}  "
                f"(masked-in {s['masked_tokens']})  total tokens {s['total_tokens']}"
            )
            lines.append("  groups: " + ", ".join(f"{g} x{n}" for g, n in m["groups"].items()))
            lines.append(
                "  micro-batches: " + ", ".join(f"{b} x{n}" for b, n in m["micro_batches"].items())
            )
        if "producer" in m:
            p = m["producer"]
            lines.append(
                f"  producer: commit {p.get('commit') or '(empty)'}  torch {p.get('torch_version')}"
            )
        if "stage_capabilities" in m:
            lines.append(
                "  stages: " + ", ".join(f"{k}={v}" for k, v in m["stage_capabilities"].items())
            )
        for name, p in m.get("payloads", {}).items():
            lines.append(
                f"  payload {name:<24} {p['dtype']:<15} {str(p['shape']):<16} {p['bytes']} B"
            )
        for w in m.get("warnings", []):
            lines.append(f"  warning: {w}")
        for u in m.get("unreadable", []):
            lines.append(f"  unreadable: {u}")
    return "\n".join(lines)
