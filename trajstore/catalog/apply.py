"""Applying documents to the catalog, a batch in one transaction: a ref's rows (the later
ref of a key wins), a tombstone (hiding the bundle it names), a replay result, and the
`is_latest` flags (the highest attempt of an anchor not removed, on every rank).

DuckDB pays ~0.5 ms per statement, so a batch of documents costs a handful of
statements per table, not a handful per document.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from trajstore.catalog import tables
from trajstore.catalog.rows import (
    RESULT_VERSION,
    TOMBSTONE_VERSION,
    Doc,
    LoadDocument,
    MismatchOf,
    bundle_rows,
    check_version,
    name_time,
    parse_ref,
    read_json,
    result_rows,
    ts,
)
from trajstore.errors import NotFoundError, StoreError

Anchor = tuple  # (run, kind, rollout_id, step_id): a step or rollout, every rank


def _anchor_clause(table: sa.Table, anchor: Anchor):
    run, kind, rollout_id, step_id = anchor
    return sa.and_(
        table.c.run == run,
        table.c.kind == kind,
        table.c.rollout_id == rollout_id,
        table.c.step_id.is_not_distinct_from(step_id),
    )


def insert_rows(conn: sa.Connection, table: sa.Table, rows: list[dict]) -> None:
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


# -- the documents --------------------------------------------------------------


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
        ref_name, doc = parse_ref(name, path)
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
        bundle = bundle_rows(ref_name, doc, loader, rows, mismatch_of)
        if later:
            bundle["removed_at"] = min(later)
    _set_latest(conn, rows["bundles"])
    for name, table_rows in rows.items():
        insert_rows(conn, tables.metadata.tables[name], table_rows)

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
    insert_rows(
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
    doc = read_json(path, "tombstone")
    check_version(doc, "tombstone_version", TOMBSTONE_VERSION, path)
    key = doc.get("key")
    if not isinstance(key, str):
        raise StoreError(f"tombstone {path} has no key; run trajstore fsck")
    tname = name[: -len(".json")]
    removed_at = ts(doc.get("removed_at")) or name_time(tname)
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
        doc = read_json(path, "replay result")
        check_version(doc, "result_version", RESULT_VERSION, path)
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
    rows: dict[str, list[dict]] = {
        name: [] for name in ("replay_results", "stage_results", "divergences", "router_metrics")
    }
    for result_id, (rname, doc) in zip(ids, docs, strict=True):
        for table, table_rows in result_rows(result_id, rname, doc).items():
            rows[table] += table_rows
    for table, table_rows in rows.items():
        insert_rows(conn, tables.metadata.tables[table], table_rows)


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
