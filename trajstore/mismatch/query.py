"""Per-step mismatch over a run: one SQL statement, run by either catalog reader.

The statement is plain SQL that DuckDB and PostgreSQL both run; `execute` is the
reader's (trajstore.catalog.direct's DuckDB connection, or SQLAlchemy for any catalog),
so the CLI, REST and the web view answer from the same text. Parameters are written
``:pN`` (SQLAlchemy's binds) and turned into DuckDB's ``$pN`` by `duckdb_sql`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trajstore.errors import UsageError
from trajstore.mismatch.metrics import DEFAULT_METRIC, METRICS, PAIRS

#: (sql, params) -> rows as dicts
Execute = Callable[[str, dict[str, Any]], list[dict[str, Any]]]
STEP_COLUMNS = (
    "run",
    "kind",
    "rollout_id",
    "step_id",
    "attempt",
    "ranks",
    "metric",
    "value",
    "tokens",
    "reason",
)


@dataclass(frozen=True)
class MismatchQuery:
    """The filters `trajstore query mismatch`, REST and the web view share."""

    run: str
    metric: str = DEFAULT_METRIC
    above: float | None = None
    top: int | None = None
    layer: int | None = None
    rollout_from: int | None = None
    rollout_to: int | None = None
    first_above: float | None = None

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise UsageError(f"unknown metric {self.metric!r}; known: {', '.join(sorted(METRICS))}")
        if self.layer is not None:
            if self.metric != "route_mismatch_rate":
                raise UsageError("--layer applies to route_mismatch_rate only")
            if self.layer < 0:
                raise UsageError(f"--layer must be >= 0, got {self.layer}")
        if self.top is not None and self.top < 1:
            raise UsageError(f"--top must be >= 1, got {self.top}")
        if self.top is not None and self.first_above is not None:
            raise UsageError("--top and --first-above cannot be combined")
        lo, hi = self.rollout_from, self.rollout_to
        if lo is not None and hi is not None and lo > hi:
            raise UsageError(f"--from {lo} is after --to {hi}")


def worst_pair(metric: str) -> tuple[str, ...]:
    """The log-prob pairs whose worst token a step of `metric` leads to, in preference."""
    family = METRICS[metric].family
    names = [pair for pair, _ in PAIRS]
    if family in names:
        return (family,)
    return ("train", "old", "current")


def _run_where(q: MismatchQuery, params: dict[str, Any]) -> list[str]:
    """The conditions selecting `q`'s run (``:p0``, in `params` already) and rollout range
    among the latest bundles, adding the range's parameters to `params`."""
    where = ["b.is_latest", "m.run = :p0"]
    if q.rollout_from is not None:
        params["p2"] = q.rollout_from
        where.append("m.rollout_id >= :p2")
    if q.rollout_to is not None:
        params["p3"] = q.rollout_to
        where.append("m.rollout_id <= :p3")
    return where


def step_sql(q: MismatchQuery, limit: int | None = None, offset: int = 0) -> tuple[str, dict]:
    """The statement listing `q`'s steps: STEP_COLUMNS plus ``worst`` (the steps' bundle
    keys and worst-token JSON, one line per rank)."""
    params: dict[str, Any] = {"p0": q.run}
    m = METRICS[q.metric]
    value, tokens, reason = m.value, m.tokens, m.reason
    join = ""
    if q.layer is not None:
        params["p1"] = q.layer
        join = (
            " LEFT OUTER JOIN mismatch_layers AS l ON l.bundle_key = m.bundle_key AND l.layer = :p1"
        )
        obs = "sum(l.observations)"
        reason = (
            f"coalesce({m.reason}, CASE WHEN coalesce({obs}, 0) = 0 THEN "
            "'no_observation: nothing compared at this layer' END)"
        )
        value = (
            f"CASE WHEN ({reason}) IS NULL THEN "
            f"CAST(sum(l.mismatches) AS DOUBLE PRECISION) / nullif({obs}, 0) END"
        )
        tokens = obs
    where = _run_where(q, params)
    inner = (
        "SELECT m.run, m.kind, m.rollout_id, m.step_id, max(b.attempt) AS attempt, "
        f"count(*) AS ranks, {value} AS value, {tokens} AS tokens, {reason} AS reason, "
        "string_agg(m.bundle_key || ' ' || coalesce(m.worst, 'null'), chr(10)) AS worst "
        "FROM mismatch_metrics AS m JOIN bundles AS b ON b.key = m.bundle_key"
        f"{join} WHERE {' AND '.join(where)} "
        "GROUP BY m.run, m.kind, m.rollout_id, m.step_id"
    )
    outer_where = []
    threshold = q.first_above if q.first_above is not None else q.above
    if threshold is not None:
        params["p4"] = float(threshold)
        outer_where.append("s.value > :p4")
    if q.top is not None:
        outer_where.append("s.value IS NOT NULL")
    order = "s.rollout_id, coalesce(s.step_id, -1), s.kind"
    if q.top is not None:
        order = "s.value DESC, " + order
    n = q.top if q.top is not None else 1 if q.first_above is not None else None
    if limit is not None:
        n = limit if n is None else min(n, limit)
    sql = (
        f"SELECT s.*, '{q.metric}' AS metric FROM ({inner}) AS s"
        + (f" WHERE {' AND '.join(outer_where)}" if outer_where else "")
        + f" ORDER BY {order}"
    )
    if n is not None:
        params["p5"] = int(n)
        sql += " LIMIT :p5"
    if offset:
        params["p6"] = int(offset)
        sql += " OFFSET :p6"
    return sql, params


#: a run's steps in the heat map's order (its columns, and the bins over them)
_STEP_ORDER = "c.rollout_id, coalesce(c.step_id, -1), c.kind"


def _cells_sql(q: MismatchQuery) -> tuple[str, dict]:
    """Route mismatches and observations per (step, layer) of `q`'s run and range, as a
    statement to select from (no order)."""
    params: dict[str, Any] = {"p0": q.run}
    where = [*_run_where(q, params), "m.route_error IS NULL"]
    sql = (
        "SELECT m.kind, m.rollout_id, m.step_id, l.layer, sum(l.mismatches) AS mismatches, "
        "sum(l.observations) AS observations FROM mismatch_metrics AS m "
        "JOIN bundles AS b ON b.key = m.bundle_key "
        "JOIN mismatch_layers AS l ON l.bundle_key = m.bundle_key "
        f"WHERE {' AND '.join(where)} "
        "GROUP BY m.kind, m.rollout_id, m.step_id, l.layer"
    )
    return sql, params


def layer_sql(q: MismatchQuery) -> tuple[str, dict]:
    """Route mismatch per (step, layer) of `q`'s run and range (the heat map)."""
    cells, params = _cells_sql(q)
    return f"SELECT c.* FROM ({cells}) AS c ORDER BY {_STEP_ORDER}, c.layer", params


def heat_steps_sql(q: MismatchQuery) -> tuple[str, dict]:
    """The steps that have heat-map cells, in the heat map's order."""
    cells, params = _cells_sql(q)
    sql = (
        f"SELECT c.kind, c.rollout_id, c.step_id FROM ({cells}) AS c "
        f"GROUP BY c.kind, c.rollout_id, c.step_id ORDER BY {_STEP_ORDER}"
    )
    return sql, params


def binned_layer_sql(q: MismatchQuery, width: int) -> tuple[str, dict]:
    """Route mismatches and observations per (bin, layer): a bin is `width` consecutive
    steps of `heat_steps_sql`'s order, named by its first step's index there."""
    cells, params = _cells_sql(q)
    params["p7"] = int(width)
    sql = (
        f"WITH indexed AS (SELECT c.*, DENSE_RANK() OVER (ORDER BY {_STEP_ORDER}) - 1 AS idx "
        f"FROM ({cells}) AS c), "
        "binned AS (SELECT i.layer, i.mismatches, i.observations, i.idx - i.idx % :p7 AS bin "
        "FROM indexed AS i) "
        "SELECT bin, layer, sum(mismatches) AS mismatches, sum(observations) AS observations "
        "FROM binned GROUP BY bin, layer ORDER BY bin, layer"
    )
    return sql, params


def duckdb_sql(sql: str) -> str:
    """`sql` with DuckDB's named parameter marks."""
    return re.sub(r":(p\d+)\b", r"$\1", sql)


def _worst(text: str | None, pairs: tuple[str, ...]) -> dict[str, Any] | None:
    """The step's worst token (largest |d| over its ranks) of the first pair measured."""
    best: dict[str, Any] | None = None
    for pair in pairs:
        for line in (text or "").splitlines():
            key, _, doc = line.partition(" ")
            worst = json.loads(doc) if doc and doc != "null" else None
            for w in (worst or {}).get(pair) or []:
                if best is None or w["abs_dlogp"] > best["abs_dlogp"]:
                    best = {"pair": pair, "bundle_key": key, **w}
        if best is not None:
            return best
    return best


def steps(
    execute: Execute, q: MismatchQuery, limit: int | None = None, offset: int = 0
) -> list[dict[str, Any]]:
    """`q`'s steps, each with its worst token (or None)."""
    sql, params = step_sql(q, limit, offset)
    pairs = worst_pair(q.metric)
    rows = execute(sql, params)
    out = []
    for row in rows:
        item = {c: row.get(c) for c in STEP_COLUMNS}
        if q.layer is not None:
            item["layer"] = q.layer
        item["worst"] = _worst(row.get("worst"), pairs)
        out.append(item)
    return out


def _rate(mismatches: Any, observations: Any) -> float | None:
    return int(mismatches) / int(observations) if observations else None


def layers(execute: Execute, q: MismatchQuery) -> list[dict[str, Any]]:
    """Per (step, layer): mismatches, observations and their rate (None when nothing
    was compared at that layer)."""
    sql, params = layer_sql(q)
    out = []
    for row in execute(sql, params):
        row["rate"] = _rate(row["mismatches"], row["observations"])
        out.append(row)
    return out


def heat(execute: Execute, q: MismatchQuery, bins: int | None = None) -> dict[str, Any]:
    """The heat map of `q`'s run and range in at most `bins` columns: ``steps`` (how many
    steps have cells), ``bin_steps`` (steps a column) and ``items``. One step a column
    (`layers`' items) while the steps fit; past that, consecutive steps are summed into
    ``columns`` of ``bin_steps`` (the last may hold fewer), each naming its ``first`` and
    ``last`` step and how many ``steps`` it holds, and each item is a column's layer
    (``column``, its index) with its summed mismatches and observations and their rate.
    A column's rate is its sums' ratio, never a mean of rates, so a column weighs its
    steps by what they compared."""
    if bins is not None and bins < 1:
        raise UsageError(f"bins must be >= 1, got {bins}")
    if bins is None:
        items = layers(execute, q)
        seen = {(c["kind"], c["rollout_id"], c["step_id"]) for c in items}
        return {"steps": len(seen), "bin_steps": 1, "items": items}
    sql, params = heat_steps_sql(q)
    order = execute(sql, params)
    n = len(order)
    if n <= bins:
        return {"steps": n, "bin_steps": 1, "items": layers(execute, q)}
    width = -(-n // bins)
    columns = []
    for start in range(0, n, width):
        end = min(start + width, n) - 1
        columns.append(
            {"first": dict(order[start]), "last": dict(order[end]), "steps": end - start + 1}
        )
    sql, params = binned_layer_sql(q, width)
    items = [
        {
            "column": int(row["bin"]) // width,
            "layer": row["layer"],
            "mismatches": int(row["mismatches"]),
            "observations": int(row["observations"]),
            "rate": _rate(row["mismatches"], row["observations"]),
        }
        for row in execute(sql, params)
    ]
    return {"steps": n, "bin_steps": width, "columns": columns, "items": items}


#: the latest bundles (ranks) of one actor step and the digests of their documents
_DOCUMENT_SQL = (
    "SELECT m.bundle_key, b.rank, b.attempt, m.document FROM mismatch_metrics AS m "
    "JOIN bundles AS b ON b.key = m.bundle_key WHERE b.is_latest AND m.run = :p0 "
    "AND m.kind = 'step' AND m.rollout_id = :p1 AND m.step_id = :p2 "
    "ORDER BY coalesce(b.rank, -1)"
)


def sample_worst(
    execute: Execute,
    load_document: Callable[[str], dict[str, Any]],
    run: str,
    rollout_id: int,
    step_id: int,
    pair: str | None = None,
) -> dict[str, Any] | None:
    """Every sample's worst token of one step (the per-sample document each bundle's
    mismatch sums were stored with), worst first: ``items`` of ``pair``, ``bundle_key``,
    ``rank``, ``sample_id``, ``position``, ``offset``, ``rollout``, ``trainer``,
    ``abs_dlogp``; ``without_document``: the step's bundles stored without one (a ref
    stored before the sums existed, whose sums ``reindex`` computed). None when the run
    has no such step. `pair` keeps one log-prob pair."""
    names = [name for name, _ in PAIRS]
    if pair is not None and pair not in names:
        raise UsageError(f"unknown pair {pair!r}; known: {', '.join(names)}")
    rows = execute(_DOCUMENT_SQL, {"p0": run, "p1": rollout_id, "p2": step_id})
    if not rows:
        return None
    items: list[dict[str, Any]] = []
    missing = []
    for row in rows:
        if not row["document"]:
            missing.append(row["bundle_key"])
            continue
        per_pair = load_document(row["document"]).get("worst_per_sample") or {}
        for name in names:
            if pair in (None, name):
                items += [
                    {"pair": name, "bundle_key": row["bundle_key"], "rank": row["rank"], **w}
                    for w in per_pair.get(name) or []
                ]
    items.sort(
        key=lambda w: (-w["abs_dlogp"], names.index(w["pair"]), w["rank"] or 0, w["position"])
    )
    return {"attempt": max(r["attempt"] for r in rows), "items": items, "without_document": missing}
