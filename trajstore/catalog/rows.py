"""The catalog rows each document becomes: a bundle ref (its bundle, samples, payloads,
provenance, router lineage and metrics, mismatch sums) and a replay result (its stages,
divergences and router metrics). Pure functions of the documents; `catalog.apply`
writes what they return.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trajstore.catalog import tables
from trajstore.errors import StoreError
from trajstore.refspace import DocRef
from trajstore.vocab import Stage

LoadDocument = Callable[[str], dict]
#: a ref without stored mismatch sums -> its computed ``mismatch`` entry (reindex)
MismatchOf = Callable[[dict], dict]
Doc = Path | DocRef  # one document: read_bytes() and a readable str()

REF_VERSION = 1


TOMBSTONE_VERSION = 1


RESULT_VERSION = 1


# -- small converters ------------------------------------------------------


def ts(value: Any) -> datetime | None:
    """ISO-8601 (with Z or an offset) -> naive UTC datetime."""
    if value in (None, ""):
        return None
    text = str(value)
    if text.endswith("Z"):
        text = text[:-1] + "+00:00"
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        return None
    if parsed.tzinfo is not None:
        parsed = parsed.astimezone(timezone.utc).replace(tzinfo=None)
    return parsed


def name_time(name: str) -> datetime:
    """Creation time encoded in a document name (`<time_ns:020d>-<pid>-<hex>`)."""
    try:
        ns = int(name.split("-", 1)[0])
    except ValueError:
        ns = 0
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).replace(tzinfo=None)


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def _str(value: Any) -> str | None:
    return None if value is None else str(value)


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True)


def read_json(path: Doc, what: str) -> dict:
    """`path`: a Path or a ref-space document (`read_bytes()`, `str()`)."""
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as exc:
        raise StoreError(f"{what} {path} is unreadable ({exc}); run trajstore fsck") from None
    if not isinstance(doc, dict):
        raise StoreError(f"{what} {path} is not a JSON object; run trajstore fsck")
    return doc


def check_version(doc: dict, field: str, supported: int, path: Doc) -> None:
    version = doc.get(field)
    if not isinstance(version, int) or isinstance(version, bool):
        raise StoreError(f"{path} has no integer {field}; run trajstore fsck")
    if version > supported:
        raise StoreError(
            f"{path} has {field} {version}, newer than this trajstore ({supported}); "
            "upgrade trajstore"
        )


# -- a bundle ref ------------------------------------------------------------


def _anchor_of(doc: dict) -> dict[str, Any]:
    """The run, rollout and step a ref or a result names (the columns of each row of it)."""
    return {
        "run": _str(doc.get("run")),
        "rollout_id": _int(doc.get("rollout_id")),
        "step_id": _int(doc.get("step_id")),
    }


def _metric_row(metrics: dict, source: str, doc: dict, key: str, result_id: int | None) -> dict:
    """A ``router_metrics`` row: `metrics` of the bundle `key`, from a ref or a result `doc`."""
    row = {"source": source, "bundle_key": key, "result_id": result_id, **_anchor_of(doc)}
    for name in tables.ROUTER_METRIC_NAMES:
        value = metrics.get(name)
        if name == "per_layer_mismatch":
            row[name] = _json(value) if isinstance(value, list) else None
        elif name in ("valid_tokens", "valid_token_layers"):
            row[name] = _int(value)
        else:
            row[name] = _float(value)
    errors = metrics.get("metric_error")
    if isinstance(errors, str):
        errors = [errors]
    row["metric_error"] = _json(list(errors)) if errors else None
    return row


_PROVENANCE_FIELDS = (
    ("rollout_partition", "rollout_partition_ids"),
    ("consumer_batch", "consumer_batch_ids"),
    ("micro_batch", "micro_batch_ids"),
    ("semantic_group", "semantic_group_ids"),
    ("normalization_cohort", "normalization_cohort_ids"),
)


def parse_ref(name: str, path: Doc) -> tuple[str, dict]:
    doc = read_json(path, "bundle ref")
    check_version(doc, "ref_version", REF_VERSION, path)
    try:
        doc["key"] = str(doc["key"])
        doc["run"] = str(doc["run"])
        doc["kind"] = str(doc["kind"])
        doc["rollout_id"] = int(doc["rollout_id"])
        doc["attempt"] = int(doc["attempt"])
        if not isinstance(doc["documents"], dict):
            raise TypeError("documents")
    except (KeyError, TypeError, ValueError) as exc:
        raise StoreError(f"bundle ref {path} lacks a valid {exc}; run trajstore fsck") from None
    return name[: -len(".json")], doc


def _sample_rows(key: str, rank: int | None, index: dict) -> list[dict]:
    """One ``samples`` row per index sample, in bundle order."""
    identity = index.get("identity") or {}
    cohorts = identity.get("normalization_cohort_ids") or []
    rows = []
    for position, sample in enumerate(index.get("samples") or []):
        group_index = _int(sample.get("group_index"))
        cohort = sample.get("normalization_cohort_id") or (
            cohorts[0] if len(cohorts) == 1 else None
        )
        rows.append(
            {
                "bundle_key": key,
                "position": position,
                "sample_id": str(sample.get("sample_id")),
                "group_index": group_index,
                "semantic_group": None if group_index is None else f"g-{group_index}",
                "normalization_cohort": _str(cohort),
                "micro_batch_id": _str(sample.get("micro_batch_id")),
                "rank": rank,
                "response_length": _int(sample.get("response_length")),
                "total_length": _int(sample.get("total_length")),
                "reward": _float(sample.get("reward")),
                "raw_reward": _float(sample.get("raw_reward")),
                "masked_tokens": sum(1 for mask in (sample.get("loss_mask") or []) if mask == 0),
                "label_hash": _str(sample.get("label_hash")),
            }
        )
    return rows


def _provenance_rows(key: str, identity: dict) -> list[dict]:
    """The identity's id lists (partitions, batches, groups, cohorts), one row per id."""
    return [
        {"bundle_key": key, "kind": kind, "position": position, "value": str(value)}
        for kind, field in _PROVENANCE_FIELDS
        for position, value in enumerate(identity.get(field) or [])
    ]


def _payload_rows(key: str, ref_payloads: dict) -> list[dict]:
    return [
        {
            "bundle_key": key,
            "name": str(name),
            "dtype": _str(payload.get("dtype")),
            "shape": _json(payload.get("shape")),
            "logical_bytes": _int(payload.get("logical_bytes")),
            "record": _str(payload.get("record")),
        }
        for name, payload in sorted(ref_payloads.items())
    ]


def _router_lineage_row(key: str, index: dict) -> dict | None:
    """The recompute config's router lineage, when the bundle declares one."""
    router = (index.get("config") or {}).get("router")
    if not isinstance(router, dict):
        return None
    return {
        "bundle_key": key,
        "num_layers": _int(router.get("num_layers")),
        "top_k": _int(router.get("top_k")),
        "num_experts": _int(router.get("num_experts")),
        "mode": _str(router.get("mode")),
        "rollout_engine": _str(router.get("rollout_engine")),
        "train_engine": _str(router.get("train_engine")),
        "rollout_weight": _str(router.get("rollout_weight")),
        "train_weight": _str(router.get("train_weight")),
    }


def _bundle_row(ref_name: str, doc: dict, manifest: dict, index: dict, samples: list[dict]) -> dict:
    """The ``bundles`` row (``is_latest`` decided later, by `_set_latest`)."""
    documents = doc["documents"]
    identity = index.get("identity") or {}
    lineage = identity.get("weight_lineage") or {}
    world = identity.get("rank") or {}
    producer = manifest.get("producer") or {}
    ref_payloads = doc.get("payloads") or {}
    return {
        "key": doc["key"],
        "run": doc["run"],
        "kind": doc["kind"],
        "bundle_id": _str(doc.get("bundle_id")),
        "rollout_id": doc["rollout_id"],
        "step_id": _int(doc.get("step_id")),
        "rank": _int(doc.get("rank")),
        "cohort_ranks": _json(doc.get("cohort_ranks")),
        "attempt": doc["attempt"],
        "is_latest": False,
        "removed_at": None,
        "format_version": _str(doc.get("format_version") or manifest.get("format_version")),
        "producer_commit": _str(producer.get("commit")),
        "producer_torch_version": _str(producer.get("torch_version")),
        "content_digest": _str(doc.get("content_digest")),
        "num_samples": len(samples),
        "num_tokens": sum(sample["total_length"] or 0 for sample in samples),
        "num_response_tokens": sum(sample["response_length"] or 0 for sample in samples),
        "logical_bytes": sum(
            int(payload.get("logical_bytes") or 0) for payload in ref_payloads.values()
        ),
        "physical_bytes": _int(doc.get("physical_bytes")),
        "added_bytes": _int(doc.get("added_bytes")),
        "rollout_weight": _str(lineage.get("rollout_weight")),
        "actor_weight": _str(lineage.get("actor_weight")),
        "dp_size": _int(world.get("dp")),
        "tp_size": _int(world.get("tp")),
        "pp_size": _int(world.get("pp")),
        "cp_size": _int(world.get("cp")),
        "manifest_hash": _str(documents.get("manifest")),
        "index_hash": _str(documents.get("index")),
        "expected_hash": _str(documents.get("expected")),
        "published_at": ts(doc.get("published_at")),
        "ref_name": ref_name,
    }


def bundle_rows(
    ref_name: str,
    doc: dict,
    load_document: LoadDocument,
    rows: dict,
    mismatch_of: MismatchOf | None = None,
) -> dict:
    """Append the rows of one bundle to `rows` (table name -> list); returns its bundle row."""
    key = doc["key"]
    documents = doc["documents"]

    def fetch(role: str) -> dict:
        digest = documents.get(role)
        return (load_document(digest) or {}) if digest else {}

    manifest, index, expected = fetch("manifest"), fetch("index"), fetch("expected")
    samples = _sample_rows(key, _int(doc.get("rank")), index)
    rows["samples"] += samples
    rows["provenance"] += _provenance_rows(key, index.get("identity") or {})
    rows["payloads"] += _payload_rows(key, doc.get("payloads") or {})
    lineage = _router_lineage_row(key, index)
    if lineage is not None:
        rows["router_lineage"].append(lineage)
    consistency = expected.get(Stage.ROUTER_CONSISTENCY)
    if isinstance(consistency, dict):
        rows["router_metrics"].append(_metric_row(consistency, "producer", doc, key, None))
    _mismatch_rows(doc, rows, mismatch_of)
    bundle = _bundle_row(ref_name, doc, manifest, index, samples)
    rows["bundles"].append(bundle)
    return bundle


#: why a ref has no mismatch sums (one stored by a trajstore before they existed)
NOT_COMPUTED = "not_computed: stored before trajstore computed mismatch; run trajstore reindex"


def _mismatch_rows(doc: dict, rows: dict, mismatch_of: MismatchOf | None) -> None:
    """The ``mismatch_metrics`` row (and ``mismatch_layers`` rows) of one ref: its stored
    sums; a ref without them is computed by `mismatch_of` (reindex) or marked not computed."""
    from trajstore.mismatch.metrics import PAIR_FIELDS, PAIRS

    entry = doc.get("mismatch")
    if not isinstance(entry, dict) and mismatch_of is not None:
        entry = mismatch_of(doc)
    if not isinstance(entry, dict):
        entry = {}
    row: dict[str, Any] = {
        "bundle_key": doc["key"],
        "run": doc["run"],
        "kind": doc["kind"],
        "rollout_id": doc["rollout_id"],
        "step_id": _int(doc.get("step_id")),
    }
    pairs = entry.get("pairs") if isinstance(entry.get("pairs"), dict) else {}
    for pair, _ in PAIRS:
        sums = pairs.get(pair) if isinstance(pairs.get(pair), dict) else {"error": NOT_COMPUTED}
        for field, kind in PAIR_FIELDS:
            value = sums.get(field)
            if kind == "TEXT":
                row[f"{pair}_{field}"] = _str(value)
            elif kind == "BIGINT":
                row[f"{pair}_{field}"] = _int(value)
            else:
                row[f"{pair}_{field}"] = _float(value)
    routes = entry.get("routes") if isinstance(entry.get("routes"), dict) else None
    routes = routes or {"error": NOT_COMPUTED}
    for field in ("valid_tokens", "valid_token_layers", "mismatches", "missing_slots"):
        row[f"route_{field}"] = _int(routes.get(field))
    row["route_mismatched_tokens"] = _int(routes.get("mismatched_tokens"))
    row["route_top_k"] = _int(routes.get("top_k"))
    row["route_error"] = _str(routes.get("error"))
    row["worst"] = _json(entry.get("worst") or None)
    row["document"] = _str(entry.get("document"))
    rows["mismatch_metrics"].append(row)
    if routes.get("error") is None:
        mis = routes.get("per_layer_mismatches") or []
        obs = routes.get("per_layer_valid_token_layers") or []
        rows["mismatch_layers"] += [
            {"bundle_key": doc["key"], "layer": i, "mismatches": int(m), "observations": int(o)}
            for i, (m, o) in enumerate(zip(mis, obs, strict=False))
        ]


# -- a replay result -----------------------------------------------------------

#: column -> converter of the ``stage_results`` and ``divergences`` rows of a result
_STAGE_FIELDS: dict[str, Callable[[Any], Any]] = {
    "stage": str,
    "status": _str,
    "reason": _str,
    "max_abs_error": _float,
    "mismatch_count": _int,
    "first_sample": _str,
    "first_field": _str,
    "first_token": _int,
}
_DIVERGENCE_FIELDS: dict[str, Callable[[Any], Any]] = {
    "stage": str,
    "sample_id": _str,
    "field": _str,
    "token_offset": _int,
    "expected": _float,
    "actual": _float,
    "abs_err": _float,
}


def _listed_rows(result_id: int, items: Any, fields: dict[str, Callable[[Any], Any]]) -> list[dict]:
    """One row per item of a result's list (its stages, its divergences), in order."""
    return [
        {
            "result_id": result_id,
            "position": i,
            **{name: convert(item.get(name)) for name, convert in fields.items()},
        }
        for i, item in enumerate(items or [])
    ]


def result_rows(result_id: int, name: str, doc: dict) -> dict[str, list[dict]]:
    """The rows of one replay result (`name` without `.json`), by table name."""
    result = {
        "id": result_id,
        "result_name": name,
        "bundle_key": doc["bundle_key"],
        **_anchor_of(doc),
        "trajstore_version": _str(doc.get("trajstore_version")),
        "recorded_at": ts(doc.get("recorded_at")),
        "status": _str(doc.get("status")),
        "first_divergent_stage": _str(doc.get("first_divergent_stage")),
        "first_divergent_rank": _int(doc.get("first_divergent_rank")),
        "root_bundle_key": _str(doc.get("root_bundle_key")),
        "selection": _json(doc.get("selection")),
    }
    metrics = doc.get("router_metrics")
    if isinstance(metrics, dict):
        metric_rows = [_metric_row(metrics, "replay", doc, doc["bundle_key"], result_id)]
    else:
        metric_rows = []
    return {
        "replay_results": [result],
        "stage_results": _listed_rows(result_id, doc.get("stages"), _STAGE_FIELDS),
        "divergences": _listed_rows(result_id, doc.get("divergences"), _DIVERGENCE_FIELDS),
        "router_metrics": metric_rows,
    }
