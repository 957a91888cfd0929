"""Catalog queries shared by the CLI and the REST API, over SQLAlchemy (any catalog).

Every function returns plain JSON-able dicts whose keys are the table column
names (one name per number). The listings (bundles, steps, divergences, router
metrics, mismatch) are the statements of trajstore.catalog.statements, which the
CLI's DuckDB reader (trajstore.catalog.direct) runs too; here they run a page at a
time (trajstore.catalog.listings: keyset cursors, at most MAX_PAGE_SIZE rows).
Hidden from every query: tombstoned bundles and superseded attempts (unless
asked for), and the results of either.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from trajstore.catalog import listings, tables
from trajstore.catalog import statements as st
from trajstore.catalog.db import Catalog
from trajstore.catalog.direct import (  # noqa: F401  (JSON_COLUMNS: re-exported)
    JSON_COLUMNS,
    MAX_SQL_ROWS,
    check_row_count,
    damage_guard,
    jsonable,
    readonly_sql_duckdb,
)
from trajstore.catalog.direct import check_readonly as _check_readonly
from trajstore.catalog.listings import (  # noqa: F401  (re-exported for api/)
    DEFAULT_PAGE_SIZE,
    MAX_PAGE_SIZE,
    decode_cursor,
    encode_cursor,
)
from trajstore.catalog.statements import STEP_SORTS  # noqa: F401  (re-exported for api/)
from trajstore.errors import UsageError

_B = tables.bundles


def _row(row: Any) -> dict:
    return {k: jsonable(k, v) for k, v in row._mapping.items()}


def executor(catalog: Catalog) -> listings.Execute:
    """The catalog's `execute` (trajstore.catalog.listings): a shared statement run
    through SQLAlchemy's text(), its `setup` first in the same transaction."""

    def execute(sql: str, params: dict[str, Any], setup: tuple[str, ...] = ()) -> list[dict]:
        with catalog.connect() as conn:
            for statement in setup:
                conn.exec_driver_sql(statement)
            return [_row(r) for r in conn.execute(sa.text(sql), params)]

    return execute


def _dialect(catalog: Catalog) -> str:
    return "duckdb" if catalog.is_duckdb else "postgresql"


# -- listings (statements.py): a page at a time -------------------------------------


def list_bundles(
    catalog: Catalog, limit: int | None = None, cursor: str | None = None, **filters: Any
) -> dict:
    """A page of statements.Bundles: bundles ordered by (run, rollout_id, step_id, rank,
    attempt); filters run, kind, rollout_from, rollout_to, include_all_attempts."""
    return listings.page(executor(catalog), st.Bundles(**filters), limit, cursor)


def query_steps(
    catalog: Catalog, limit: int | None = None, cursor: str | None = None, **filters: Any
) -> dict:
    """A page of statements.Steps: actor steps (latest attempt) with their latest replay
    verdict; filters run, first_divergent_stage, rollout_from, rollout_to, status,
    attempt, sort (STEP_SORTS). A cursor is valid for its sort and filters only."""
    listing = st.Steps(**filters)
    return listings.steps_page(executor(catalog), listing, limit, cursor, _dialect(catalog))


def query_divergences(
    catalog: Catalog, limit: int | None = None, cursor: str | None = None, **filters: Any
) -> dict:
    """A page of statements.Divergences: the divergences of each visible step's or
    rollout's latest result; filters run, stage, min_abs_err, sample_id, rollout_from,
    rollout_to."""
    return listings.page(executor(catalog), st.Divergences(**filters), limit, cursor)


def query_router_metrics(
    catalog: Catalog, limit: int | None = None, cursor: str | None = None, **filters: Any
) -> dict:
    """A page of statements.RouterMetrics: router consistency metrics of visible bundles;
    filters run, rollout_from, rollout_to, source."""
    return listings.page(executor(catalog), st.RouterMetrics(**filters), limit, cursor)


def run_names(catalog: Catalog) -> list[str]:
    """Every run the catalog knows (published once, even if removed since), sorted."""
    return [row["run"] for row in executor(catalog)(st.RUN_NAMES, {})]


def has_sample(catalog: Catalog, sample_id: str, run: str | None = None) -> bool:
    """Whether any bundle (of `run`, when given; removed ones too) holds `sample_id`."""
    return bool(executor(catalog)(*st.has_sample(sample_id, run)))


# -- one bundle, one run: REST's reads ----------------------------------------------


def list_runs(catalog: Catalog) -> list[dict]:
    """Every run with counts over its visible (latest, not removed) bundles."""
    b = _B
    visible = (
        sa.select(
            b.c.run,
            sa.func.count().label("num_bundles"),
            sa.func.count().filter(b.c.kind == "step").label("num_step_bundles"),
            sa.func.count().filter(b.c.kind == "rollout").label("num_rollout_bundles"),
            sa.func.min(b.c.rollout_id).label("min_rollout_id"),
            sa.func.max(b.c.rollout_id).label("max_rollout_id"),
            sa.func.max(b.c.published_at).label("last_published_at"),
        )
        .where(b.c.is_latest)
        .group_by(b.c.run)
        .subquery()
    )
    q = (
        sa.select(
            tables.runs.c.run,
            tables.runs.c.first_published_at,
            visible.c.last_published_at,
            sa.func.coalesce(visible.c.num_bundles, 0).label("num_bundles"),
            sa.func.coalesce(visible.c.num_step_bundles, 0).label("num_step_bundles"),
            sa.func.coalesce(visible.c.num_rollout_bundles, 0).label("num_rollout_bundles"),
            visible.c.min_rollout_id,
            visible.c.max_rollout_id,
        )
        .select_from(tables.runs.outerjoin(visible, visible.c.run == tables.runs.c.run))
        .order_by(tables.runs.c.run)
    )
    with catalog.connect() as conn:
        return [_row(r) for r in conn.execute(q)]


def get_bundle(catalog: Catalog, key: str, *, include_removed: bool = False) -> dict | None:
    """One bundle row by key (None if unknown, or tombstoned unless include_removed)."""
    q = sa.select(_B).where(_B.c.key == key)
    if not include_removed:
        q = q.where(_B.c.removed_at.is_(None))
    with catalog.connect() as conn:
        row = conn.execute(q).first()
    return None if row is None else _row(row)


def _lookup(catalog: Catalog, kind: str, run: str, rollout_id: int, step_id, attempt):
    q = sa.select(_B).where(
        _B.c.run == run,
        _B.c.rollout_id == rollout_id,
        _B.c.kind == kind,
        _B.c.step_id.is_not_distinct_from(step_id),
        _B.c.removed_at.is_(None),
    )
    q = q.where(_B.c.is_latest) if attempt is None else q.where(_B.c.attempt == attempt)
    q = q.order_by(sa.func.coalesce(_B.c.rank, -1), _B.c.key)
    with catalog.connect() as conn:
        return [_row(r) for r in conn.execute(q)]


def lookup_step(
    catalog: Catalog, run: str, rollout_id: int, step_id: int, attempt: int | None = None
) -> list[dict]:
    """Bundle rows of every rank of actor step (rollout_id, step_id); [] if none.

    The latest attempt (each of its ranks), or exactly `attempt` when given.
    """
    return _lookup(catalog, "step", run, rollout_id, step_id, attempt)


def lookup_rollout(
    catalog: Catalog, run: str, rollout_id: int, attempt: int | None = None
) -> list[dict]:
    """Bundle rows of the rollout-level bundle(s) of `rollout_id`; [] if none."""
    return _lookup(catalog, "rollout", run, rollout_id, None, attempt)


def samples_of(
    catalog: Catalog,
    bundle_key: str,
    group: str | int | None = None,
    micro_batch: str | None = None,
) -> list[dict]:
    """Samples of a bundle in bundle order; group is "g-<i>" or the group_index."""
    s = tables.samples
    q = sa.select(s).where(s.c.bundle_key == bundle_key)
    if isinstance(group, int) and not isinstance(group, bool):
        q = q.where(s.c.group_index == group)
    elif group is not None:
        q = q.where(s.c.semantic_group == str(group))
    if micro_batch is not None:
        q = q.where(s.c.micro_batch_id == micro_batch)
    with catalog.connect() as conn:
        return [_row(r) for r in conn.execute(q.order_by(s.c.position))]


def payloads_of(catalog: Catalog, bundle_key: str) -> list[dict]:
    """Payload records of a bundle, by name."""
    p = tables.payloads
    q = sa.select(p).where(p.c.bundle_key == bundle_key).order_by(p.c.name)
    with catalog.connect() as conn:
        return [_row(r) for r in conn.execute(q)]


def provenance_of(catalog: Catalog, bundle_key: str) -> dict[str, list[str]]:
    """Physical/semantic provenance of a bundle: {kind: [value, ...]}."""
    p = tables.provenance
    q = sa.select(p.c.kind, p.c.value).where(p.c.bundle_key == bundle_key)
    out: dict[str, list[str]] = {}
    with catalog.connect() as conn:
        for kind, value in conn.execute(q.order_by(p.c.kind, p.c.position)):
            out.setdefault(kind, []).append(value)
    return out


def router_lineage_of(catalog: Catalog, bundle_key: str) -> dict | None:
    """config.router of a bundle, or None when it has no routes."""
    lineage = tables.router_lineage
    with catalog.connect() as conn:
        row = conn.execute(sa.select(lineage).where(lineage.c.bundle_key == bundle_key)).first()
    return None if row is None else _row(row)


# -- results -----------------------------------------------------------------


def whole_first(results: sa.Table) -> sa.ColumnElement:
    """statements.whole_first over a SQLAlchemy table: ascending sorts a bundle's whole
    replay results (no `selection`) before its partial ones."""
    return sa.literal_column(st.whole_first(results.name))


def results_of(catalog: Catalog, bundle_key: str) -> list[dict]:
    """Every recorded result of one bundle, newest first, each with its "stages"."""
    result_table, stage_table = tables.replay_results, tables.stage_results
    with catalog.connect() as conn:
        results = [
            _row(x)
            for x in conn.execute(
                sa.select(result_table)
                .where(result_table.c.bundle_key == bundle_key)
                .order_by(result_table.c.recorded_at.desc().nulls_last(), result_table.c.id.desc())
            )
        ]
        for res in results:
            res["stages"] = [
                _row(x)
                for x in conn.execute(
                    sa.select(stage_table)
                    .where(stage_table.c.result_id == res["id"])
                    .order_by(stage_table.c.position)
                )
            ]
    return results


def recorded_result_exists(catalog: Catalog, bundle_key: str, trajstore_version: str) -> bool:
    """Whether this trajstore version already recorded a result for the bundle
    (replay --all --record skips it, so an interrupted run resumes)."""
    results = tables.replay_results
    q = sa.select(sa.literal(1)).where(
        results.c.bundle_key == bundle_key, results.c.trajstore_version == trajstore_version
    )
    with catalog.connect() as conn:
        return conn.execute(q.limit(1)).first() is not None


def _total(column, *where):  # noqa: ANN001, ANN202
    """sum() as a BIGINT, 0 when empty: PostgreSQL sums bigints as NUMERIC (a Decimal,
    which JSON would show as a float), DuckDB as HUGEINT."""
    summed = sa.func.sum(column)
    if where:
        summed = summed.filter(*where)
    return sa.cast(sa.func.coalesce(summed, 0), sa.BigInteger)


def stats(catalog: Catalog, run: str | None = None) -> dict:
    """Counts and sizes over the catalog (or one run).

    Sizes are over the bundles the store still holds (not removed; superseded attempts
    included), as `trajstore stats` counts them from the refs: `logical_bytes` what
    they hold, `physical_bytes` what their ingests added to the object store (each
    object once, by the bundle that stored it; not the column `physical_bytes`, every
    object each bundle references, shared ones once per bundle). Null ("not recorded")
    when any of them was ingested before trajstore recorded added bytes.
    """
    bundles, results = _B, tables.replay_results
    run_filter = [bundles.c.run == run] if run is not None else []
    visible = bundles.c.is_latest
    held = bundles.c.removed_at.is_(None)
    with catalog.connect() as conn:
        row = conn.execute(
            sa.select(
                sa.func.count(sa.distinct(bundles.c.run)).label("runs"),
                sa.func.count().filter(visible).label("bundles"),
                sa.func.count().filter(visible, bundles.c.kind == "step").label("step_bundles"),
                sa.func.count()
                .filter(visible, bundles.c.kind == "rollout")
                .label("rollout_bundles"),
                sa.func.count().filter(bundles.c.removed_at.is_not(None)).label("removed_bundles"),
                sa.func.count()
                .filter(bundles.c.removed_at.is_(None), sa.not_(visible))
                .label("superseded_bundles"),
                _total(bundles.c.num_samples, visible).label("samples"),
                _total(bundles.c.num_tokens, visible).label("num_tokens"),
                _total(bundles.c.logical_bytes, held).label("logical_bytes"),
                _total(bundles.c.added_bytes, held).label("physical_bytes"),
                sa.func.count().filter(held, bundles.c.added_bytes.is_(None)).label("unrecorded"),
            ).where(*run_filter)
        ).one()
        out = _row(row)
        if out.pop("unrecorded"):
            out["physical_bytes"] = None
        rq = sa.select(results.c.status, sa.func.count()).group_by(results.c.status)
        if run is not None:
            rq = rq.where(results.c.run == run)
        by_status = {status: n for status, n in conn.execute(rq)}
    out["results"] = sum(by_status.values())
    out["results_by_status"] = dict(sorted((k or "", v) for k, v in by_status.items()))
    return out


# -- read-only SQL -----------------------------------------------------------


def run_readonly_sql(
    catalog: Catalog, sql: str, *, max_rows: int = MAX_SQL_ROWS
) -> tuple[list[str], list[list]]:
    """Run one read-only statement; returns (column names, rows as lists).

    Refused unless DuckDB's parser sees exactly one SELECT-like statement, and
    run inside a READ ONLY transaction that is rolled back. On DuckDB, file
    access from SQL (read_csv, ...) is switched off for the catalog's database
    (for the rest of this process: the setting cannot be switched back on).
    """
    _check_readonly(sql)
    if catalog.is_duckdb:
        with damage_guard(catalog.file):
            raw = catalog.engine.raw_connection()
            try:
                columns, rows = readonly_sql_duckdb(raw.driver_connection, sql, max_rows)
            finally:
                raw.close()
        return columns, rows
    with catalog.connect() as conn:
        try:
            conn.exec_driver_sql("SET TRANSACTION READ ONLY")
            result = conn.exec_driver_sql(sql)
            columns = list(result.keys())
            rows = check_row_count(result.fetchmany(max_rows + 1), max_rows)
        except sa.exc.DBAPIError as exc:
            raise UsageError(f"SQL failed: {str(exc.orig).splitlines()[0]}") from None
        finally:
            conn.rollback()
    return columns, [[jsonable("", v) for v in row] for row in rows]


# -- training-inference mismatch (trajstore.mismatch) --------------------------------


def query_mismatch(
    catalog: Catalog,
    run: str,
    metric: str | None = None,
    above: float | None = None,
    top: int | None = None,
    layer: int | None = None,
    rollout_from: int | None = None,
    rollout_to: int | None = None,
    first_above: float | None = None,
    limit: int | None = None,
    cursor: str | None = None,
) -> dict:
    """Per-step mismatch of one run (docs/mismatch.md), a page at a time: the CLI's
    `query mismatch` filters; pages follow the listing's order (offset cursor)."""
    from trajstore.mismatch.metrics import DEFAULT_METRIC
    from trajstore.mismatch.query import MismatchQuery, steps

    limit = listings.page_limit(limit)
    q = MismatchQuery(
        run=run,
        metric=metric or DEFAULT_METRIC,
        above=above,
        top=top,
        layer=layer,
        rollout_from=rollout_from,
        rollout_to=rollout_to,
        first_above=first_above,
    )
    query = {k: v for k, v in vars(q).items()}
    after = decode_cursor("mismatch", query, cursor, "i")
    offset = after[0] if after else 0
    items = steps(executor(catalog), q, limit + 1, offset)
    more = len(items) > limit
    items = items[:limit]
    nxt = encode_cursor("mismatch", query, [offset + limit]) if more else None
    return {"items": items, "next_cursor": nxt}


def query_mismatch_heat(
    catalog: Catalog,
    run: str,
    rollout_from: int | None = None,
    rollout_to: int | None = None,
    bins: int | None = None,
) -> dict:
    """The web view's heat map of a run in at most `bins` columns (`mismatch.query.heat`):
    a long run's columns each sum consecutive steps, so the map stays a few thousand
    cells however many steps it has."""
    from trajstore.mismatch.query import MismatchQuery, heat

    q = MismatchQuery(run=run, rollout_from=rollout_from, rollout_to=rollout_to)
    return heat(executor(catalog), q, bins)
