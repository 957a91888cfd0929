"""Incremental sync of the catalog from the store's refs and results.

The refs (`refs/bundles`, `refs/tombstones`) and results (`results/`) are the
truth; the catalog only indexes them. A sync lists the three directories
(cheap), applies the file names not yet in `synced_documents`, and records
them in the same transaction. Applying a document is idempotent and its
effect does not depend on the order documents arrive in, so a rebuild from
scratch (`reindex`) answers every query exactly as the incremental catalog.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from trajstore.catalog import tables
from trajstore.catalog.db import (
    Catalog,
    _duckdb_file,
    _is_lock_error,
    open_catalog,
    shown_url,
)
from trajstore.catalog.direct import dir_stat, listing_record
from trajstore.errors import (
    CatalogDamagedError,
    NotFoundError,
    StoreError,
    TrajstoreError,
    disk_full_error,
)
from trajstore.listing import DEFAULT_MARGIN_S, listing_start
from trajstore.refspace import DocRef, LocalRefSpace, RefSpace
from trajstore.vocab import Stage

LoadDocument = Callable[[str], dict]
#: a ref without stored mismatch sums -> its computed ``mismatch`` entry (reindex)
MismatchOf = Callable[[dict], dict]
Anchor = tuple  # (run, kind, rollout_id, step_id): a step or rollout, every rank

REF_VERSION = 1
TOMBSTONE_VERSION = 1
RESULT_VERSION = 1
BATCH_SIZE = 256  # documents per transaction

# directory in synced_documents -> folder of the store's ref space
DIRECTORIES = {
    "bundles": "refs/bundles",
    "tombstones": "refs/tombstones",
    "results": "results",
}
StoreSource = Path | str | RefSpace  # a store directory, or any ref space (an S3 store's)
Doc = Path | DocRef  # one document: read_bytes() and a readable str()


@dataclass(frozen=True)
class SyncStats:
    new_refs: int = 0
    new_tombstones: int = 0
    new_results: int = 0


# -- small converters ------------------------------------------------------


def _ts(value: Any) -> datetime | None:
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


def _name_time(name: str) -> datetime:
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


def _read_json(path: Doc, what: str) -> dict:
    """`path`: a Path or a ref-space document (`read_bytes()`, `str()`)."""
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as exc:
        raise StoreError(f"{what} {path} is unreadable ({exc}); run trajstore fsck") from None
    if not isinstance(doc, dict):
        raise StoreError(f"{what} {path} is not a JSON object; run trajstore fsck")
    return doc


def _check_version(doc: dict, field: str, supported: int, path: Doc) -> None:
    version = doc.get(field)
    if not isinstance(version, int) or isinstance(version, bool):
        raise StoreError(f"{path} has no integer {field}; run trajstore fsck")
    if version > supported:
        raise StoreError(
            f"{path} has {field} {version}, newer than this trajstore ({supported}); "
            "upgrade trajstore"
        )


def _space(store: StoreSource) -> RefSpace:
    return store if isinstance(store, RefSpace) else LocalRefSpace(Path(store))


def _list_names(space: RefSpace, directory: str) -> list[str]:
    """Published document names (finished atomic creates only), sorted."""
    return [d.name for d in space.list(DIRECTORIES[directory]) if d.name.endswith(".json")]


def _anchor_clause(table: sa.Table, anchor: Anchor):
    run, kind, rollout_id, step_id = anchor
    return sa.and_(
        table.c.run == run,
        table.c.kind == kind,
        table.c.rollout_id == rollout_id,
        table.c.step_id.is_not_distinct_from(step_id),
    )


# -- applying documents, a batch at a time -----------------------------------
# DuckDB pays ~0.5 ms per statement, so a batch of documents costs a handful of
# statements per table, not a handful per document.


def _insert(conn: sa.Connection, table: sa.Table, rows: list[dict]) -> None:
    """Insert many rows; on DuckDB as one statement over list parameters."""
    if not rows:
        return
    if conn.dialect.name != "duckdb" or len(rows) == 1:
        conn.execute(table.insert(), rows)
        return
    cols = [c for c in table.columns if c.name in rows[0]]
    quote = conn.dialect.identifier_preparer.quote
    sql = "INSERT INTO {} ({}) SELECT {}".format(
        quote(table.name),
        ", ".join(quote(c.name) for c in cols),
        ", ".join(f"unnest(${i}::{c.type.compile(conn.dialect)}[])" for i, c in enumerate(cols, 1)),
    )
    params = [[row[c.name] for row in rows] for c in cols]
    conn.connection.driver_connection.execute(sql, params)


def _delete_bundles(conn: sa.Connection, keys: list[str]) -> None:
    if not keys:
        return
    for table in (
        tables.samples,
        tables.provenance,
        tables.payloads,
        tables.router_lineage,
        tables.mismatch_metrics,
        tables.mismatch_layers,
    ):
        conn.execute(table.delete().where(table.c.bundle_key.in_(keys)))
    metrics = tables.router_metrics
    conn.execute(
        metrics.delete().where(metrics.c.bundle_key.in_(keys), metrics.c.source == "producer")
    )
    conn.execute(tables.bundles.delete().where(tables.bundles.c.key.in_(keys)))


def _metric_row(metrics: dict, **ids: Any) -> dict:
    row = dict(ids)
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


def _parse_ref(name: str, path: Doc) -> tuple[str, dict]:
    doc = _read_json(path, "bundle ref")
    _check_version(doc, "ref_version", REF_VERSION, path)
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
        "published_at": _ts(doc.get("published_at")),
        "ref_name": ref_name,
    }


def _bundle_rows(
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
        rows["router_metrics"].append(
            _metric_row(
                consistency,
                source="producer",
                bundle_key=key,
                result_id=None,
                run=doc["run"],
                rollout_id=doc["rollout_id"],
                step_id=_int(doc.get("step_id")),
            )
        )
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


# -- latest attempt wins ------------------------------------------------------


def _field_getter(row: Any) -> Callable[[str], Any]:
    """Column access for a row dict (not yet inserted) or a fetched Row alike."""
    return row.get if isinstance(row, dict) else row._mapping.get


def _anchor(row: Any) -> Anchor:
    get = _field_getter(row)
    return (get("run"), get("kind"), get("rollout_id"), get("step_id"))


def _latest_attempts(rows: Iterable[Any]) -> dict[Anchor, int]:
    """The one rule, the store's (`Store.step`): per (run, kind, rollout_id, step_id),
    the highest attempt with a bundle not removed is the latest, on every rank. A
    re-capture on another rank layout thus supersedes each rank of the old attempt,
    not only the ranks it shares with it."""
    best: dict[Anchor, int] = {}
    for row in rows:
        get = _field_getter(row)
        if get("removed_at") is None:
            anchor = _anchor(row)
            best[anchor] = max(best.get(anchor, get("attempt")), get("attempt"))
    return best


def _is_latest(row: Any, latest: dict[Anchor, int]) -> bool:
    get = _field_getter(row)
    return get("removed_at") is None and latest.get(_anchor(row)) == get("attempt")


def _update_latest_flags(conn: sa.Connection, stored: list[Any], latest: dict[Anchor, int]) -> None:
    """Flip ``is_latest`` on the stored rows whose flag disagrees with ``latest``."""
    bundles = tables.bundles
    flips = [
        {"k": row.key, "v": not row.is_latest}
        for row in stored
        if bool(row.is_latest) != _is_latest(row, latest)
    ]
    if flips:
        conn.execute(
            bundles.update()
            .where(bundles.c.key == sa.bindparam("k"))
            .values(is_latest=sa.bindparam("v")),
            flips,
        )


_LATEST_COLUMNS = (
    "key",
    "run",
    "kind",
    "rollout_id",
    "step_id",
    "attempt",
    "removed_at",
    "is_latest",
)


def _set_latest(conn: sa.Connection, new: list[dict]) -> None:
    """Mark is_latest on new bundle rows (before insert) and flip existing rows."""
    bundles = tables.bundles
    anchors = {_anchor(row) for row in new}
    stored = [
        row
        for row in conn.execute(
            sa.select(*(bundles.c[name] for name in _LATEST_COLUMNS)).where(
                bundles.c.run.in_({anchor[0] for anchor in anchors}),
                bundles.c.rollout_id.in_({anchor[2] for anchor in anchors}),
            )
        )
        if _anchor(row) in anchors
    ]
    latest = _latest_attempts([*stored, *new])
    for row in new:
        row["is_latest"] = _is_latest(row, latest)
    _update_latest_flags(conn, stored, latest)


def _tolerant(load_document: LoadDocument) -> LoadDocument:
    """A loader that reads a missing object as an empty document."""

    def load(digest: str) -> dict:
        try:
            return load_document(digest)
        except NotFoundError:
            return {}

    return load


def apply_refs(
    conn: sa.Connection,
    items: list[tuple[str, Doc]],
    load_document,
    mismatch_of: MismatchOf | None = None,
) -> None:
    """Index a batch of bundle refs (file name, path). Idempotent; for a key
    published twice the later ref (by name) wins whatever the apply order."""
    parsed: dict[str, tuple[str, dict]] = {}
    for name, path in items:
        ref_name, doc = _parse_ref(name, path)
        prev = parsed.get(doc["key"])
        if prev is None or prev[0] < ref_name:
            parsed[doc["key"]] = (ref_name, doc)
    if not parsed:
        return
    bundles, tombstones = tables.bundles, tables.tombstones
    existing = dict(
        conn.execute(
            sa.select(bundles.c.key, bundles.c.ref_name).where(bundles.c.key.in_(list(parsed)))
        ).all()
    )
    keys = [k for k, (ref_name, _) in parsed.items() if existing.get(k, "") <= ref_name]
    _delete_bundles(conn, [k for k in keys if k in existing])
    tombs: dict[str, list] = {}
    for key, tname, removed_at in conn.execute(
        sa.select(
            tombstones.c.bundle_key, tombstones.c.tombstone_name, tombstones.c.removed_at
        ).where(tombstones.c.bundle_key.in_(keys))
    ):
        tombs.setdefault(key, []).append((tname, removed_at))

    rows: dict[str, list[dict]] = {
        n: [] for n in ("bundles", "samples", "provenance", "payloads", "router_lineage")
    }
    rows["router_metrics"] = []
    rows["mismatch_metrics"] = []
    rows["mismatch_layers"] = []
    for key in keys:
        ref_name, doc = parsed[key]
        later = [r for name, r in tombs.get(key, []) if name > ref_name]
        # gc may already have collected a removed bundle's documents
        loader = _tolerant(load_document) if later else load_document
        bundle = _bundle_rows(ref_name, doc, loader, rows, mismatch_of)
        if later:
            bundle["removed_at"] = min(later)
    _set_latest(conn, rows["bundles"])
    for name, table_rows in rows.items():
        _insert(conn, tables.metadata.tables[name], table_rows)

    first: dict[str, datetime | None] = {}  # run -> earliest published_at in the batch
    for r in rows["bundles"]:
        run, when = r["run"], r["published_at"]
        if run not in first or when is not None and (first[run] is None or when < first[run]):
            first[run] = when
    known = dict(
        conn.execute(
            sa.select(tables.runs.c.run, tables.runs.c.first_published_at).where(
                tables.runs.c.run.in_(first)
            )
        ).all()
    )
    _insert(
        conn,
        tables.runs,
        [{"run": r, "first_published_at": w} for r, w in first.items() if r not in known],
    )
    for run, when in first.items():
        if run in known and when is not None and (known[run] is None or when < known[run]):
            conn.execute(
                tables.runs.update().where(tables.runs.c.run == run).values(first_published_at=when)
            )


def apply_tombstone(conn: sa.Connection, name: str, path: Doc):
    """Record a tombstone; hides the bundle if its ref predates the tombstone."""
    doc = _read_json(path, "tombstone")
    _check_version(doc, "tombstone_version", TOMBSTONE_VERSION, path)
    key = doc.get("key")
    if not isinstance(key, str):
        raise StoreError(f"tombstone {path} has no key; run trajstore fsck")
    tname = name[: -len(".json")]
    removed_at = _ts(doc.get("removed_at")) or _name_time(tname)
    conn.execute(tables.tombstones.delete().where(tables.tombstones.c.tombstone_name == tname))
    conn.execute(
        tables.tombstones.insert().values(
            tombstone_name=tname, bundle_key=key, removed_at=removed_at
        )
    )
    bundles = tables.bundles
    row = conn.execute(
        sa.select(
            bundles.c.run,
            bundles.c.kind,
            bundles.c.rollout_id,
            bundles.c.step_id,
            bundles.c.removed_at,
        ).where(bundles.c.key == key, bundles.c.ref_name < tname)
    ).first()
    if row is None:
        return None
    if row.removed_at is None or removed_at < row.removed_at:
        conn.execute(bundles.update().where(bundles.c.key == key).values(removed_at=removed_at))
    return tuple(row[:4])


def apply_results(conn: sa.Connection, items: list[tuple[str, Doc]]) -> None:
    """Index a batch of replay-result documents (replacing earlier applies of them)."""
    docs = []
    for name, path in items:
        doc = _read_json(path, "replay result")
        _check_version(doc, "result_version", RESULT_VERSION, path)
        if not isinstance(doc.get("bundle_key"), str):
            raise StoreError(f"replay result {path} has no bundle_key; run trajstore fsck")
        docs.append((name[: -len(".json")], doc))
    if not docs:
        return
    result_table = tables.replay_results
    old = list(
        conn.execute(
            sa.select(result_table.c.id).where(result_table.c.result_name.in_([n for n, _ in docs]))
        ).scalars()
    )
    if old:
        for table in (tables.stage_results, tables.divergences, tables.router_metrics):
            conn.execute(table.delete().where(table.c.result_id.in_(old)))
        conn.execute(result_table.delete().where(result_table.c.id.in_(old)))
    ids = list(
        conn.execute(
            sa.select(tables.REPLAY_RESULTS_ID_SEQ.next_value()).select_from(
                sa.func.generate_series(1, len(docs))
            )
        ).scalars()
    )
    results, stages, divs, metrics = [], [], [], []
    for result_id, (rname, doc) in zip(ids, docs, strict=True):
        run = _str(doc.get("run"))
        rollout_id = _int(doc.get("rollout_id"))
        step_id = _int(doc.get("step_id"))
        results.append(
            {
                "id": result_id,
                "result_name": rname,
                "bundle_key": doc["bundle_key"],
                "run": run,
                "rollout_id": rollout_id,
                "step_id": step_id,
                "trajstore_version": _str(doc.get("trajstore_version")),
                "recorded_at": _ts(doc.get("recorded_at")),
                "status": _str(doc.get("status")),
                "first_divergent_stage": _str(doc.get("first_divergent_stage")),
                "first_divergent_rank": _int(doc.get("first_divergent_rank")),
                "root_bundle_key": _str(doc.get("root_bundle_key")),
                "selection": _json(doc.get("selection")),
            }
        )
        stages += [
            {
                "result_id": result_id,
                "position": i,
                "stage": str(s.get("stage")),
                "status": _str(s.get("status")),
                "reason": _str(s.get("reason")),
                "max_abs_error": _float(s.get("max_abs_error")),
                "mismatch_count": _int(s.get("mismatch_count")),
                "first_sample": _str(s.get("first_sample")),
                "first_field": _str(s.get("first_field")),
                "first_token": _int(s.get("first_token")),
            }
            for i, s in enumerate(doc.get("stages") or [])
        ]
        divs += [
            {
                "result_id": result_id,
                "position": i,
                "stage": str(d.get("stage")),
                "sample_id": _str(d.get("sample_id")),
                "field": _str(d.get("field")),
                "token_offset": _int(d.get("token_offset")),
                "expected": _float(d.get("expected")),
                "actual": _float(d.get("actual")),
                "abs_err": _float(d.get("abs_err")),
            }
            for i, d in enumerate(doc.get("divergences") or [])
        ]
        if isinstance(doc.get("router_metrics"), dict):
            metrics.append(
                _metric_row(
                    doc["router_metrics"],
                    source="replay",
                    bundle_key=doc["bundle_key"],
                    result_id=result_id,
                    run=run,
                    rollout_id=rollout_id,
                    step_id=step_id,
                )
            )
    _insert(conn, result_table, results)
    _insert(conn, tables.stage_results, stages)
    _insert(conn, tables.divergences, divs)
    _insert(conn, tables.router_metrics, metrics)


def recompute_latest(conn: sa.Connection, anchors: Iterable[Anchor]) -> None:
    """Re-apply `_latest_attempts` to stored anchors (after a tombstone removed a bundle)."""
    bundles = tables.bundles
    for anchor in set(anchors):
        stored = conn.execute(
            sa.select(*(bundles.c[name] for name in _LATEST_COLUMNS)).where(
                _anchor_clause(bundles, anchor)
            )
        ).all()
        _update_latest_flags(conn, stored, _latest_attempts(stored))


# -- sync / reindex ----------------------------------------------------------


def _synced_names(conn: sa.Connection, directory: str) -> set[str]:
    """Names of one directory's documents already applied to the catalog."""
    synced = tables.synced_documents
    if conn.dialect.name == "duckdb":
        # fetched in bulk by the driver: SQLAlchemy's per-row result handling costs about
        # 20 us a row, most of a no-op sync on a store of 10,000 refs
        sql = f"SELECT name FROM {synced.name} WHERE directory = ?"
        rows = conn.connection.driver_connection.execute(sql, [directory]).fetchall()
        return {row[0] for row in rows}
    return set(
        conn.execute(sa.select(synced.c.name).where(synced.c.directory == directory)).scalars()
    )


#: the PostgreSQL advisory lock every apply transaction takes (pg_advisory_xact_lock):
#: concurrent writers' applies are serialised, so `is_latest` and `runs` stay exact
WRITER_LOCK_ID = 0x7472616A  # "traj"


@dataclass(frozen=True)
class _Doc:
    """A document read before the apply transaction (its bytes and where it came from)."""

    data: bytes
    location: str

    def read_bytes(self) -> bytes:
        return self.data

    def __str__(self) -> str:
        return self.location


def _fetch(space: RefSpace, folder: str, name: str) -> Doc:
    """The document's bytes, read now (outside any transaction); unreadable ones stay
    lazy so that applying them raises the usual one-line error."""
    ref = space.doc(f"{folder}/{name}")
    try:
        return _Doc(ref.read_bytes(), str(ref))
    except OSError:
        return ref


def _prefetched(items: list[tuple[str, Doc]], load_document: LoadDocument) -> LoadDocument:
    """A loader holding the manifest/index/expected of these refs, loaded up front, so a
    server catalog's write lock is never held while objects are fetched."""
    cache: dict[str, dict] = {}
    for _, doc in items:
        try:
            documents = json.loads(doc.read_bytes()).get("documents") or {}
        except (OSError, ValueError, AttributeError):
            continue
        for digest in documents.values():
            if isinstance(digest, str) and digest not in cache:
                try:
                    cache[digest] = load_document(digest)
                except Exception:  # applying loads it again and reports it properly
                    continue

    def load(digest: str) -> dict:
        hit = cache.get(digest)
        return hit if hit is not None else load_document(digest)

    return load


def _writer_lock(conn: sa.Connection) -> None:
    """Serialise apply transactions on a server catalog (DuckDB: one process anyway)."""
    if conn.dialect.name == "postgresql":
        conn.execute(sa.select(sa.func.pg_advisory_xact_lock(WRITER_LOCK_ID)))


def _synced_among(conn: sa.Connection, directory: str, names: list[str]) -> set[str]:
    """Which of `names` are already applied (one bounded query, not the whole table)."""
    synced = tables.synced_documents
    found: set[str] = set()
    for start in range(0, len(names), 1000):
        part = names[start : start + 1000]
        found.update(
            conn.execute(
                sa.select(synced.c.name).where(
                    synced.c.directory == directory, synced.c.name.in_(part)
                )
            ).scalars()
        )
    return found


def _apply_batch(
    catalog: Catalog,
    space: RefSpace,
    directory: str,
    names: list[str],
    load_document: LoadDocument | None,
    mismatch_of: MismatchOf | None = None,
) -> int:
    """Apply one batch of documents in one transaction; returns how many were new.

    On a server catalog the transaction takes the writer lock and skips names another
    process applied meanwhile, so concurrent syncs never apply a document twice.
    """
    if directory == "bundles" and load_document is None:
        raise StoreError("sync of bundle refs needs a document loader")
    folder = DIRECTORIES[directory]
    items = [(name, _fetch(space, folder, name)) for name in names]
    if directory == "bundles":
        load_document = _prefetched(items, load_document)
    with catalog.begin() as conn:
        _writer_lock(conn)
        if not catalog.is_duckdb:
            done = _synced_among(conn, directory, names)
            items = [(name, doc) for name, doc in items if name not in done]
        if not items:
            return 0
        if directory == "bundles":
            apply_refs(conn, items, load_document, mismatch_of)
        elif directory == "tombstones":
            anchors = [apply_tombstone(conn, name, doc) for name, doc in items]
            recompute_latest(conn, (a for a in anchors if a is not None))
        else:
            apply_results(conn, items)
        _insert(
            conn,
            tables.synced_documents,
            [{"directory": directory, "name": name} for name, _ in items],
        )
        state = tables.sync_state
        conn.execute(
            state.update()
            .where(state.c.directory == directory)
            .values(applied=state.c.applied + len(items))
        )
    return len(items)


def _raise_mark(catalog: Catalog, directory: str, listed: list[str]) -> None:
    """Record the newest listed name as the directory's high-water mark (never lowers it)."""
    if not listed:
        return
    state = tables.sync_state
    newest = max(listed)
    with catalog.begin() as conn:
        conn.execute(
            state.update()
            .where(
                state.c.directory == directory,
                sa.or_(state.c.high_water.is_(None), state.c.high_water < newest),
            )
            .values(high_water=newest)
        )


#: documents applied by one sync after which a server catalog's statistics are refreshed
ANALYZE_AFTER = 500


def _analyze_if_bulk(catalog: Catalog, applied: int) -> None:
    """Refresh PostgreSQL's planner statistics after a bulk apply (a first sync, a
    reindex): with the empty tables' estimates the planner picks nested loops that
    turn a 40 ms query_steps into seconds. Autovacuum would get there, minutes later."""
    if catalog.is_duckdb or applied < ANALYZE_AFTER:
        return
    names = ", ".join(table.name for table in (*tables.INDEX_TABLES, tables.sync_state))
    with catalog.begin() as conn:
        conn.exec_driver_sql(f"ANALYZE {names}")


def _record_listing(catalog: Catalog, directory: str, record: str) -> None:
    """Store the listing a sync has just applied in full (sync_state.listing), so that a
    reader which lists the same skips the sync (trajstore.catalog.direct). Stat and names
    were taken before the applies: the record never names a document that is not in the
    catalog. Written only when it changed."""
    state = tables.sync_state
    with catalog.begin() as conn:
        conn.execute(
            state.update()
            .where(
                state.c.directory == directory,
                sa.or_(state.c.listing.is_(None), state.c.listing != record),
            )
            .values(listing=record)
        )


def _source(catalog: Catalog, store_dir: StoreSource | None) -> RefSpace:
    source = store_dir if store_dir is not None else catalog.store_dir
    if source is None:
        raise StoreError("sync needs the store directory (--store)")
    return _space(source)


def sync_catalog(
    catalog: Catalog,
    store_dir: StoreSource | None = None,
    load_document: LoadDocument | None = None,
    *,
    batch_size: int = BATCH_SIZE,
    mismatch_of: MismatchOf | None = None,
) -> SyncStats:
    """Apply refs, tombstones and results not yet in the catalog (a full listing).

    Works the same on the file catalog and on an in-memory snapshot, for a
    store directory or any ref space (an S3 store's). The DuckDB catalog of a
    local store syncs this way on every open; a server catalog uses it only to
    rebuild (reindex) and keeps current with `sync_new`.
    """
    store = _source(catalog, store_dir)
    counts = {}
    # tombstones first: a ref removed (and perhaps collected) is then indexed as removed
    for directory in ("tombstones", "bundles", "results"):
        folder = store.root / DIRECTORIES[directory] if isinstance(store, LocalRefSpace) else None
        listed_ns = time.time_ns()
        stat = dir_stat(folder) if folder is not None else None
        names = _list_names(store, directory)
        with catalog.connect() as conn:
            done = _synced_names(conn, directory)
        new = [n for n in names if n not in done]
        counts[directory] = 0
        for start in range(0, len(new), batch_size):
            batch = new[start : start + batch_size]
            counts[directory] += _apply_batch(
                catalog, store, directory, batch, load_document, mismatch_of
            )
        if not catalog.is_duckdb:
            _raise_mark(catalog, directory, names)
        elif folder is not None:
            _record_listing(catalog, directory, listing_record(names, stat, listed_ns))
    _analyze_if_bulk(catalog, sum(counts.values()))
    return SyncStats(
        new_refs=counts["bundles"],
        new_tombstones=counts["tombstones"],
        new_results=counts["results"],
    )


def _list_after(space: RefSpace, directory: str, after: str | None) -> list[str]:
    """Document names after `after` (all when None), sorted.

    A space with `list_after(folder, after)` (an object store: one listing request
    from `after` on, e.g. S3 ListObjectsV2 StartAfter) is asked for exactly those; a
    local directory is read by name only (one readdir, no per-file stat or read).
    """
    folder = DIRECTORIES[directory]
    lister = getattr(space, "list_after", None)
    if lister is not None:
        names = [d if isinstance(d, str) else d.name for d in lister(folder, after)]
    elif isinstance(space, LocalRefSpace):
        try:
            with os.scandir(space.root / folder) as entries:
                names = [e.name for e in entries if not e.name.startswith(".")]
        except FileNotFoundError:
            names = []
    else:
        names = [d.name for d in space.list(folder)]
    return sorted(n for n in names if n.endswith(".json") and (after is None or n > after))


@dataclass(frozen=True)
class IncrementalStats(SyncStats):
    """A `sync_new`: what was applied, and how many names the listing returned."""

    listed: int = 0
    listed_after: dict[str, str | None] | None = None


def sync_new(
    catalog: Catalog,
    store_dir: StoreSource | None = None,
    load_document: LoadDocument | None = None,
    *,
    margin_s: float = DEFAULT_MARGIN_S,
    batch_size: int = BATCH_SIZE,
) -> IncrementalStats:
    """Apply the documents published since the high-water mark (server catalogs).

    Lists only names after (mark - margin): the cost follows what is new, not the
    store's size. Names are `<time_ns>-<pid>-<hex>`, so a document named up to
    `margin_s` before the newest one already seen (clock skew between hosts, a slow
    upload) is still found; what the listing returns is checked against
    synced_documents by name (one bounded query), and only the missing ones are
    read and applied. Then the mark moves to the newest listed name. Correct with
    any number of concurrent writers: applies are serialised and skip what another
    process applied first (`_apply_batch`).
    """
    store = _source(catalog, store_dir)
    state = tables.sync_state
    with catalog.connect() as conn:
        marks = dict(conn.execute(sa.select(state.c.directory, state.c.high_water)).all())
    now_ns = time.time_ns()
    counts: dict[str, int] = {}
    starts: dict[str, str | None] = {}
    listed = 0
    for directory in ("tombstones", "bundles", "results"):
        after = listing_start(marks.get(directory), margin_s, now_ns=now_ns)
        starts[directory] = after
        names = _list_after(store, directory, after)
        listed += len(names)
        with catalog.connect() as conn:
            done = _synced_among(conn, directory, names)
        new = [n for n in names if n not in done]
        counts[directory] = 0
        for start in range(0, len(new), batch_size):
            batch = new[start : start + batch_size]
            counts[directory] += _apply_batch(catalog, store, directory, batch, load_document)
        _raise_mark(catalog, directory, names)
    _analyze_if_bulk(catalog, sum(counts.values()))
    return IncrementalStats(
        new_refs=counts["bundles"],
        new_tombstones=counts["tombstones"],
        new_results=counts["results"],
        listed=listed,
        listed_after=starts,
    )


def changes(catalog: Catalog) -> int:
    """Documents applied to this catalog so far: a counter that grows with every sync
    that applied something (a server polls it instead of listing the store)."""
    state = tables.sync_state
    with catalog.connect() as conn:
        return int(
            conn.execute(sa.select(sa.func.coalesce(sa.func.sum(state.c.applied), 0))).scalar_one()
        )


@dataclass(frozen=True)
class ReindexStats(SyncStats):
    #: where a DuckDB file that could not be read or written was moved (None: it was fine)
    moved_aside: str | None = None
    #: DuckDB's complaint about that file
    reason: str | None = None


def reindex(
    catalog_path_or_url: Path | str,
    store_dir: StoreSource,
    load_document: LoadDocument,
    *,
    lock_timeout: float | None = None,
    mismatch_of: MismatchOf | None = None,
) -> ReindexStats:
    """Rebuild the catalog from refs and results alone.

    A readable catalog is emptied and refilled under its lock. A DuckDB file that cannot
    be opened, or that fails a read or write while it is emptied and refilled (cut short,
    overwritten), is moved aside as `<file>.damaged-<UTC time>` (never deleted: it is the
    user's file) and the catalog is rebuilt in a new file, exactly as after deleting it.
    A held lock, a full disk, a catalog newer than this trajstore and a server catalog's
    errors are raised, never rebuilt. `mismatch_of` computes the mismatch sums of a ref
    stored without them (trajstore.mismatch; the CLI passes the store's).
    """
    target = str(catalog_path_or_url)
    url = target if "://" in target else f"duckdb:///{Path(target).resolve()}"
    kwargs = {} if lock_timeout is None else {"lock_timeout": lock_timeout}
    home = None if isinstance(store_dir, RefSpace) else store_dir
    file = _duckdb_file(sa.engine.make_url(url))
    try:
        catalog = open_catalog(home, url, **kwargs)
    except Exception as exc:
        reason = _unusable_file(exc) if file is not None else None
        if reason is None:
            if isinstance(exc, TrajstoreError) or disk_full_error(exc):
                raise
            line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise StoreError(f"cannot open catalog {shown_url(url)} for reindex: {line}") from None
    else:
        try:
            return _refill(catalog, store_dir, load_document, mismatch_of)
        except CatalogDamagedError as exc:  # a block the open did not read
            if file is None:
                raise
            reason = exc.reason
    aside = _move_aside(Path(file))
    stats = _refill(open_catalog(home, url, **kwargs), store_dir, load_document, mismatch_of)
    return replace(stats, moved_aside=None if aside is None else str(aside), reason=reason)


def _refill(
    catalog: Catalog,
    store_dir: StoreSource,
    load_document: LoadDocument,
    mismatch_of: MismatchOf | None = None,
) -> ReindexStats:
    """Empty every index table of an open catalog (closed on return), then sync it."""
    with catalog:
        with catalog.begin() as conn:
            _writer_lock(conn)  # a server catalog's writers wait, then see the empty tables
            for table in tables.INDEX_TABLES:
                conn.execute(table.delete())
            conn.execute(tables.sync_state.update().values(high_water=None, listing=None))
            if conn.dialect.name == "postgresql":
                # ids restart as in a new catalog, so the rebuilt one answers identically
                # (DuckDB cannot restart a sequence; its reindex of a readable file keeps
                # counting, and a rebuild from a moved-aside file starts at 1)
                for seq in (tables.REPLAY_RESULTS_ID_SEQ, tables.ROUTER_METRICS_ID_SEQ):
                    conn.exec_driver_sql(f"ALTER SEQUENCE {seq.name} RESTART WITH 1")
        s = sync_catalog(catalog, store_dir, load_document, mismatch_of=mismatch_of)
    return ReindexStats(s.new_refs, s.new_tombstones, s.new_results)


def _unusable_file(exc: Exception) -> str | None:
    """Why a DuckDB catalog file that failed to open is to be rebuilt (one line), or None
    when `exc` is no reason to: a damaged file or any database error opening it, but not
    a lock held by another process, a full disk or a refusal of ours (a newer catalog)."""
    if isinstance(exc, CatalogDamagedError):
        return exc.reason
    if isinstance(exc, TrajstoreError) or _is_lock_error(exc) or disk_full_error(exc):
        return None
    from trajstore.catalog.direct import driver

    db_errors = (sa.exc.DBAPIError, driver().Error)
    if not isinstance(exc, db_errors) and not isinstance(getattr(exc, "orig", None), db_errors):
        return None  # a bug of ours: rebuilding would only hide it
    text = str(getattr(exc, "orig", None) or exc).strip()
    return (text.splitlines() or [type(exc).__name__])[0][:300]


def _move_aside(file: Path) -> Path | None:
    """Rename a catalog file (and its WAL) to `<name>.damaged-<UTC time>[-N]`; the new
    name, or None when there was no file to keep."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    aside = file.with_name(f"{file.name}.damaged-{stamp}")
    n = 1
    while aside.exists() or aside.with_name(aside.name + ".wal").exists():
        n += 1
        aside = file.with_name(f"{file.name}.damaged-{stamp}-{n}")
    try:
        try:
            os.rename(file, aside)
        except FileNotFoundError:
            return None  # nothing to keep: the catalog is created anew
        with contextlib.suppress(FileNotFoundError):
            os.rename(file.with_name(file.name + ".wal"), aside.with_name(aside.name + ".wal"))
    except OSError as e:
        raise StoreError(
            f"catalog {file} cannot be read and cannot be moved aside to rebuild it: {e}"
        ) from None
    return aside
