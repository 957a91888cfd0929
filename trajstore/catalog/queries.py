"""Catalog queries shared by the CLI and the REST API.

Every function returns plain JSON-able dicts whose keys are the table column
names (one name per number). Lists are paged by keyset cursors: an opaque
string encoding the last sort key, valid only for the query (filters and sort)
that returned it; pages hold at most MAX_PAGE_SIZE rows.
Hidden from every query: tombstoned bundles and superseded attempts (unless
asked for), and the results of either.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

import sqlalchemy as sa

from trajstore.catalog import tables
from trajstore.catalog.db import Catalog
from trajstore.catalog.direct import (  # noqa: F401  (JSON_COLUMNS: re-exported)
    JSON_COLUMNS,
    MAX_SQL_ROWS,
    check_filter_words,
    check_rollout_range,
    check_row_count,
    damage_guard,
    jsonable,
    readonly_sql_duckdb,
)
from trajstore.catalog.direct import check_readonly as _check_readonly
from trajstore.errors import UsageError, check_known_sample
from trajstore.vocab import UNREPLAYED

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


def _row(row: Any) -> dict:
    return {k: jsonable(k, v) for k, v in row._mapping.items()}


def _limit(limit: int | None) -> int:
    if limit is None:
        return DEFAULT_PAGE_SIZE
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE_SIZE:
        raise UsageError(f"limit must be an integer from 1 to {MAX_PAGE_SIZE}, got {limit!r}")
    return limit


def _query_digest(query: dict[str, Any]) -> str:
    """12 hex digits naming a listing's filters (every argument but limit and cursor)."""
    text = json.dumps(query, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def encode_cursor(tag: str, query: dict[str, Any], values: list) -> str:
    """An opaque cursor: the listing's tag, a digest of its filters, the last sort key.

    The digest binds the cursor to the query that made it: a keyset position from one
    run or filter set, applied to another, would answer an empty or wrong page as if
    it were the next one.
    """
    raw = json.dumps([tag, _query_digest(query), values], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _cursor_value_ok(value: object, kind: str) -> bool:
    """`kind` "s": a string; "i": an integer that fits BIGINT."""
    if kind == "s":
        return isinstance(value, str)
    return type(value) is int and -(2**63) <= value < 2**63


def decode_cursor(tag: str, query: dict[str, Any], cursor: str | None, kinds: str) -> list | None:
    """The keyset values of a cursor, one per letter of `kinds` (see `_cursor_value_ok`);
    a UsageError unless `encode_cursor(tag, query, ...)` made it.

    The types are checked because the values are bound into the page query: a
    hand-made cursor with a list, or a string where an id goes, otherwise made
    the database raise (a 500 instead of a 400).
    """
    if cursor is None:
        return None
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        got_tag, digest, values = json.loads(raw)
    except (ValueError, TypeError):
        raise UsageError("invalid cursor; pass the next_cursor of a previous page") from None
    if (
        got_tag != tag
        or not isinstance(values, list)
        or len(values) != len(kinds)
        or not all(map(_cursor_value_ok, values, kinds))
    ):
        raise UsageError(f"invalid cursor for this query ({tag})")
    if digest != _query_digest(query):
        raise UsageError(
            "cursor belongs to another query: the page that returned it had other filters; "
            "pass it with those, or start again without cursor"
        )
    return values


def _page(rows: list, limit: int, tag: str, query: dict[str, Any], key_of) -> dict:
    """{"items": [...], "next_cursor": str | None} from limit + 1 fetched rows."""
    more = len(rows) > limit
    rows = rows[:limit]
    items = [_row(r) for r in rows]
    cursor = encode_cursor(tag, query, key_of(rows[-1])) if more else None
    return {"items": items, "next_cursor": cursor}


def _after(sort_exprs: list, values: list | None):
    if values is None:
        return sa.true()
    return sa.tuple_(*sort_exprs) > sa.tuple_(*[sa.literal(v) for v in values])


def _before(sort_exprs: list, values: list | None):
    """The keyset condition of a descending order."""
    if values is None:
        return sa.true()
    return sa.tuple_(*sort_exprs) < sa.tuple_(*[sa.literal(v) for v in values])


def _rollout_range(col, rollout_from: int | None, rollout_to: int | None) -> list:
    check_rollout_range(rollout_from, rollout_to)
    clauses = []
    if rollout_from is not None:
        clauses.append(col >= rollout_from)
    if rollout_to is not None:
        clauses.append(col <= rollout_to)
    return clauses


# -- bundles -----------------------------------------------------------------

_B = tables.bundles
_BUNDLE_SORT = [
    _B.c.run,
    _B.c.rollout_id,
    sa.func.coalesce(_B.c.step_id, -1),
    sa.func.coalesce(_B.c.rank, -1),
    _B.c.attempt,
    _B.c.key,
]


def _bundle_key(row) -> list:
    step = -1 if row.step_id is None else row.step_id
    rank = -1 if row.rank is None else row.rank
    return [row.run, row.rollout_id, step, rank, row.attempt, row.key]


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


def run_names(catalog: Catalog) -> list[str]:
    """Every run the catalog knows (published once, even if removed since), sorted; as
    DirectCatalog.run_names."""
    with catalog.connect() as conn:
        return list(
            conn.execute(sa.select(tables.runs.c.run).order_by(tables.runs.c.run)).scalars()
        )


def list_bundles(
    catalog: Catalog,
    run: str | None = None,
    kind: str | None = None,
    rollout_from: int | None = None,
    rollout_to: int | None = None,
    include_all_attempts: bool = False,
    limit: int | None = None,
    cursor: str | None = None,
) -> dict:
    """Bundles ordered by (run, rollout_id, step_id, rank, attempt); a page."""
    limit = _limit(limit)
    query = {
        "run": run,
        "kind": kind,
        "rollout_from": rollout_from,
        "rollout_to": rollout_to,
        "include_all_attempts": include_all_attempts,
    }
    after = decode_cursor("bundles", query, cursor, "siiiis")
    q = sa.select(_B).where(_after(_BUNDLE_SORT, after))
    q = q.where(_B.c.removed_at.is_(None))
    if not include_all_attempts:
        q = q.where(_B.c.is_latest)
    if run is not None:
        q = q.where(_B.c.run == run)
    if kind is not None:
        q = q.where(_B.c.kind == kind)
    q = q.where(*_rollout_range(_B.c.rollout_id, rollout_from, rollout_to))
    q = q.order_by(*_BUNDLE_SORT).limit(limit + 1)
    with catalog.connect() as conn:
        rows = conn.execute(q).all()
    return _page(rows, limit, "bundles", query, _bundle_key)


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


def _has_result_at(stage: str, bundles: sa.Table) -> sa.ColumnElement[bool]:
    """Whether the cohort of `bundles`' row (latest attempt) has any result whose first
    divergent stage is `stage` (a semi-join the stage index answers)."""
    hit_bundles, hits = _B.alias("hit_b"), tables.replay_results.alias("hit_r")
    return (
        sa.exists()
        .select_from(hits.join(hit_bundles, hit_bundles.c.key == hits.c.bundle_key))
        .where(
            hits.c.first_divergent_stage == stage,
            hit_bundles.c.is_latest,
            *(
                hit_bundles.c[name] == bundles.c[name]
                for name in ("run", "kind", "rollout_id", "step_id", "attempt")
            ),
        )
    )


def whole_first(results: sa.Table) -> sa.ColumnElement:
    """Sorts a whole replay's result (no `selection`) before a partial one's: the latest
    result of a bundle is its newest whole result, else its newest partial one. A
    partial replay (some samples, groups, micro-batches or stages) passing must not
    hide the divergence the whole step was recorded with."""
    return sa.case((results.c.selection.is_(None), 0), else_=1)


def _latest_results(run: str | None, kind: str | None = "step", stage: str | None = None):
    """Per cohort (run, kind, rollout, step, attempt) of visible bundles, its latest
    result (`whole_first`, then the latest recorded_at): a subquery with the bundle's
    identity columns.

    With `stage`, only cohorts that have some result diverging first at `stage` are
    ranked (the index on first_divergent_stage finds them): a cohort whose latest
    result names `stage` is one of those, so a filter on the latest result's stage
    answers the same while ranking ~1/10 of the results. Used on PostgreSQL only, here
    and for the steps (10,000 steps, loaded 2-core box, medians of 15 alternating
    calls: 45 vs 55 ms); DuckDB's full ranking is faster than the extra semi-join
    (47 vs 53 ms with it on the results alone)."""
    result_bundles = _B.alias("rb")
    results = tables.replay_results
    q = (
        sa.select(
            result_bundles.c.run,
            result_bundles.c.kind,
            result_bundles.c.rollout_id,
            result_bundles.c.step_id,
            result_bundles.c.attempt,
            results.c.id.label("result_id"),
            results.c.bundle_key,
            results.c.status,
            results.c.first_divergent_stage,
            results.c.first_divergent_rank,
            results.c.root_bundle_key,
            results.c.recorded_at,
            results.c.trajstore_version,
            sa.func.row_number()
            .over(
                partition_by=[
                    result_bundles.c.run,
                    result_bundles.c.kind,
                    result_bundles.c.rollout_id,
                    result_bundles.c.step_id,
                    result_bundles.c.attempt,
                ],
                order_by=[
                    whole_first(results),
                    results.c.recorded_at.desc().nulls_last(),
                    results.c.id.desc(),
                ],
            )
            .label("rn"),
        )
        .select_from(results.join(result_bundles, result_bundles.c.key == results.c.bundle_key))
        .where(result_bundles.c.is_latest)
    )
    if kind is not None:
        q = q.where(result_bundles.c.kind == kind)
    if run is not None:
        q = q.where(result_bundles.c.run == run)
    if stage is not None:
        q = q.where(_has_result_at(stage, result_bundles))
    ranked = q.subquery("ranked")
    return sa.select(ranked).where(ranked.c.rn == 1).subquery("latest")


_STEP_IDENTITY = ("run", "rollout_id", "step_id", "attempt")


def _latest_attempt_steps(
    run: str | None,
    rollout_from: int | None,
    rollout_to: int | None,
    attempt: int | None = None,
    stage: str | None = None,
):
    """One row per actor step (its latest attempt, or only those whose latest attempt is
    ``attempt``): bundle count, sizes, publish time. With `stage`, only the steps with a
    result at that stage (see _latest_results)."""
    bundles = _B
    query = (
        sa.select(
            bundles.c.run,
            bundles.c.rollout_id,
            bundles.c.step_id,
            bundles.c.attempt,
            sa.func.count().label("num_bundles"),
            sa.func.sum(bundles.c.num_samples).label("num_samples"),
            sa.func.sum(bundles.c.num_tokens).label("num_tokens"),
            sa.func.max(bundles.c.published_at).label("published_at"),
        )
        .where(bundles.c.kind == "step", bundles.c.is_latest)
        .where(*_rollout_range(bundles.c.rollout_id, rollout_from, rollout_to))
        .group_by(bundles.c.run, bundles.c.rollout_id, bundles.c.step_id, bundles.c.attempt)
    )
    if run is not None:
        query = query.where(bundles.c.run == run)
    if attempt is not None:
        query = query.where(bundles.c.attempt == attempt)
    if stage is not None:
        query = query.where(_has_result_at(stage, bundles))
    return query.subquery("steps")


#: step listing orders: name -> the leading sort column (None: step order only); a leading
#: "-" reverses the whole order. Nulls sort as the coalesced value, so a keyset can pass them.
STEP_SORTS = ("step", "-step", "status", "-status", "stage", "-stage", "tokens", "-tokens")


def _step_sort_lead(sort: str, steps, latest):
    name = sort.removeprefix("-")
    if name == "status":
        return sa.func.coalesce(latest.c.status, UNREPLAYED)
    if name == "stage":
        return sa.func.coalesce(latest.c.first_divergent_stage, "")
    if name == "tokens":
        return sa.func.coalesce(steps.c.num_tokens, 0)
    return None


def _steps_page(
    steps,
    latest,
    *,
    first_divergent_stage: str | None,
    status: str | None,
    after: list | None,
    limit: int,
    sort: str = "step",
):
    """The steps joined with their latest verdict, filtered on it; limit + 1 rows, in order.

    Each row carries ``sort_key`` (the leading sort value, or null in step order)."""
    lead = _step_sort_lead(sort, steps, latest)
    order = [steps.c.run, steps.c.rollout_id, steps.c.step_id, steps.c.attempt]
    if lead is not None:
        order = [lead, *order]
    descending = sort.startswith("-")
    query = (
        sa.select(
            (lead if lead is not None else sa.null()).label("sort_key"),
            steps,
            latest.c.result_id,
            latest.c.bundle_key.label("result_bundle_key"),
            latest.c.status,
            latest.c.first_divergent_stage,
            latest.c.first_divergent_rank,
            latest.c.root_bundle_key,
            latest.c.recorded_at,
            latest.c.trajstore_version,
        )
        .select_from(
            steps.outerjoin(
                latest,
                sa.and_(*(latest.c[name] == steps.c[name] for name in _STEP_IDENTITY)),
            )
        )
        .where(_before(order, after) if descending else _after(order, after))
        .order_by(*(column.desc() if descending else column for column in order))
        .limit(limit + 1)
    )
    if first_divergent_stage is not None:
        query = query.where(latest.c.first_divergent_stage == first_divergent_stage)
    if status == UNREPLAYED:
        query = query.where(latest.c.result_id.is_(None))
    elif status is not None:
        query = query.where(latest.c.status == status)
    return query


def _with_rank_bundles(page_query, descending: bool = False):
    """The page joined with its rank bundles, in one statement: ranks and keys
    are gathered for this page only (aggregating every step costs more)."""
    page = page_query.subquery("page")
    order = [page.c.sort_key, *(page.c[name] for name in _STEP_IDENTITY)]
    member = _B.alias("member")
    return (
        sa.select(page, member.c.rank.label("member_rank"), member.c.key.label("member_key"))
        .select_from(
            page.join(
                member,
                sa.and_(
                    member.c.kind == "step",
                    member.c.is_latest,
                    *(member.c[name] == page.c[name] for name in _STEP_IDENTITY),
                ),
            )
        )
        .order_by(
            *(column.desc() if descending else column for column in order),
            sa.func.coalesce(member.c.rank, -1),
            member.c.key,
        )
    )


def _collate_steps(rows: list) -> list[dict]:
    """One item per step from its rows (one per rank bundle): ``ranks``, ``bundle_keys``."""
    items: list[dict] = []
    last_identity = None
    for row in rows:
        identity = (row.run, row.rollout_id, row.step_id, row.attempt)
        if identity != last_identity:
            item = _row(row)
            del item["member_rank"], item["member_key"], item["sort_key"]
            item["ranks"], item["bundle_keys"] = [], []
            items.append(item)
            last_identity = identity
        if row.member_rank is not None:
            items[-1]["ranks"].append(row.member_rank)
        items[-1]["bundle_keys"].append(row.member_key)
    return items


def query_steps(
    catalog: Catalog,
    run: str | None = None,
    first_divergent_stage: str | None = None,
    rollout_from: int | None = None,
    rollout_to: int | None = None,
    status: str | None = None,
    limit: int | None = None,
    cursor: str | None = None,
    attempt: int | None = None,
    sort: str = "step",
) -> dict:
    """Actor steps (latest attempt) with their latest replay verdict; a page.

    One item per (run, rollout_id, step_id): its ranks and bundle keys, and
    the most recently recorded result of any of its rank bundles (result
    columns are null when none was recorded). Filters on the verdict apply to
    that latest result only; status UNREPLAYED selects the steps with none.
    ``attempt`` keeps the steps whose latest attempt is that number. ``sort``
    is one of STEP_SORTS (default: rollout, step); a cursor is valid for its sort and filters only.
    """
    limit = _limit(limit)
    if sort not in STEP_SORTS:
        raise UsageError(f"sort must be one of {', '.join(STEP_SORTS)}, got {sort!r}")
    by_step = sort.removeprefix("-") == "step"
    tag = "steps" if sort == "step" else f"steps:{sort}"
    lead_kind = "i" if sort.removeprefix("-") == "tokens" else "s"
    query = {
        "run": run,
        "first_divergent_stage": first_divergent_stage,
        "rollout_from": rollout_from,
        "rollout_to": rollout_to,
        "status": status,
        "attempt": attempt,
        "sort": sort,
    }
    after = decode_cursor(tag, query, cursor, "siii" if by_step else lead_kind + "siii")
    check_filter_words(status, first_divergent_stage=first_divergent_stage)
    prefilter = None if catalog.is_duckdb else first_divergent_stage
    page_query = _steps_page(
        _latest_attempt_steps(run, rollout_from, rollout_to, attempt, stage=prefilter),
        _latest_results(run, stage=prefilter),
        first_divergent_stage=first_divergent_stage,
        status=status,
        after=after,
        limit=limit,
        sort=sort,
    )
    with catalog.connect() as conn:
        if conn.dialect.name == "postgresql":
            # PostgreSQL estimates the latest-result filter (row_number = 1 AND stage) at one
            # row and nests loops over every step for it; hash joins answer 10,000 steps in
            # ~30 ms instead of 60-120 (scripts/bench/bench_catalog_pg.py). For this
            # statement only: SET LOCAL ends with the transaction.
            conn.exec_driver_sql("SET LOCAL enable_nestloop = off")
        rows = conn.execute(_with_rank_bundles(page_query, sort.startswith("-"))).all()
    sort_keys = {(row.run, row.rollout_id, row.step_id, row.attempt): row.sort_key for row in rows}
    items = _collate_steps(rows)
    more = len(items) > limit
    items = items[:limit]
    next_cursor = None
    if more:
        last = [items[-1][name] for name in _STEP_IDENTITY]
        lead = [] if by_step else [jsonable("sort_key", sort_keys[tuple(last)])]
        next_cursor = encode_cursor(tag, query, lead + last)
    return {"items": items, "next_cursor": next_cursor}


def has_sample(catalog: Catalog, sample_id: str, run: str | None = None) -> bool:
    """Whether any bundle (of `run`, when given; removed ones too) holds `sample_id`."""
    s = tables.samples
    q = sa.select(sa.literal(1)).select_from(s.join(_B, _B.c.key == s.c.bundle_key))
    q = q.where(s.c.sample_id == sample_id)
    if run is not None:
        q = q.where(_B.c.run == run)
    with catalog.connect() as conn:
        return conn.execute(q.limit(1)).first() is not None


def query_divergences(
    catalog: Catalog,
    run: str | None = None,
    stage: str | None = None,
    min_abs_err: float | None = None,
    sample_id: str | None = None,
    rollout_from: int | None = None,
    rollout_to: int | None = None,
    limit: int | None = None,
    cursor: str | None = None,
) -> dict:
    """Divergences of each visible step's or rollout's latest result; a page.

    Ordered by (run, rollout_id, step_id, result_id, position).
    """
    check_filter_words(stage=stage)
    if sample_id is not None:
        check_known_sample(sample_id, has_sample(catalog, sample_id, run), run)
    limit = _limit(limit)
    query = {
        "run": run,
        "stage": stage,
        "min_abs_err": min_abs_err,
        "sample_id": sample_id,
        "rollout_from": rollout_from,
        "rollout_to": rollout_to,
    }
    after = decode_cursor("divergences", query, cursor, "siiii")
    d = tables.divergences
    latest = _latest_results(run, kind=None)
    sort = [
        latest.c.run,
        latest.c.rollout_id,
        sa.func.coalesce(latest.c.step_id, -1),
        d.c.result_id,
        d.c.position,
    ]
    q = (
        sa.select(
            latest.c.run,
            latest.c.kind,
            latest.c.rollout_id,
            latest.c.step_id,
            latest.c.attempt,
            latest.c.bundle_key,
            latest.c.trajstore_version,
            latest.c.recorded_at,
            d,
        )
        .select_from(d.join(latest, latest.c.result_id == d.c.result_id))
        .where(_after(sort, after))
        .where(*_rollout_range(latest.c.rollout_id, rollout_from, rollout_to))
        .order_by(*sort)
        .limit(limit + 1)
    )
    if stage is not None:
        q = q.where(d.c.stage == stage)
    if min_abs_err is not None:
        q = q.where(d.c.abs_err >= float(min_abs_err))
    if sample_id is not None:
        q = q.where(d.c.sample_id == sample_id)
    with catalog.connect() as conn:
        rows = conn.execute(q).all()
    return _page(
        rows,
        limit,
        "divergences",
        query,
        lambda r: [
            r.run,
            r.rollout_id,
            -1 if r.step_id is None else r.step_id,
            r.result_id,
            r.position,
        ],
    )


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


def query_router_metrics(
    catalog: Catalog,
    run: str | None = None,
    rollout_from: int | None = None,
    rollout_to: int | None = None,
    source: str | None = None,
    limit: int | None = None,
    cursor: str | None = None,
) -> dict:
    """Router consistency metrics of visible bundles (router-metrics.md names), with
    each bundle's router mode; ordered by (run, rollout_id, step_id, id)."""
    limit = _limit(limit)
    query = {"run": run, "rollout_from": rollout_from, "rollout_to": rollout_to, "source": source}
    after = decode_cursor("router_metrics", query, cursor, "siii")
    metrics, lineage = tables.router_metrics, tables.router_lineage
    sort = [
        metrics.c.run,
        metrics.c.rollout_id,
        sa.func.coalesce(metrics.c.step_id, -1),
        metrics.c.id,
    ]
    q = (
        sa.select(metrics, lineage.c.mode, _B.c.rank, _B.c.attempt)
        .select_from(
            metrics.join(_B, _B.c.key == metrics.c.bundle_key).outerjoin(
                lineage, lineage.c.bundle_key == metrics.c.bundle_key
            )
        )
        .where(_B.c.is_latest, _after(sort, after))
        .where(*_rollout_range(metrics.c.rollout_id, rollout_from, rollout_to))
        .order_by(*sort)
        .limit(limit + 1)
    )
    if run is not None:
        q = q.where(metrics.c.run == run)
    if source is not None:
        q = q.where(metrics.c.source == source)
    with catalog.connect() as conn:
        rows = conn.execute(q).all()
    return _page(
        rows,
        limit,
        "router_metrics",
        query,
        lambda row: [row.run, row.rollout_id, -1 if row.step_id is None else row.step_id, row.id],
    )


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


def mismatch_executor(catalog: Catalog):  # noqa: ANN201
    """trajstore.mismatch.query's `execute` over any catalog (SQLAlchemy)."""

    def execute(sql: str, params: dict[str, Any]) -> list[dict]:
        with catalog.connect() as conn:
            return [_row(r) for r in conn.execute(sa.text(sql), params)]

    return execute


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

    limit = _limit(limit)
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
    items = steps(mismatch_executor(catalog), q, limit + 1, offset)
    more = len(items) > limit
    items = items[:limit]
    nxt = encode_cursor("mismatch", query, [offset + limit]) if more else None
    return {"items": items, "next_cursor": nxt}


def query_mismatch_layers(
    catalog: Catalog,
    run: str,
    rollout_from: int | None = None,
    rollout_to: int | None = None,
) -> list[dict]:
    """Route mismatch per (step, layer) of a run: the web view's heat map."""
    from trajstore.mismatch.query import MismatchQuery, layers

    q = MismatchQuery(run=run, rollout_from=rollout_from, rollout_to=rollout_to)
    return layers(mismatch_executor(catalog), q)
