"""The catalog's listings as SQL text, written once for every reader and both databases.

Each listing (bundles, actor steps, divergences, router metrics) is a frozen record of
its filters (`Listing`); `statement(after, limit)` writes its one statement: plain SQL that DuckDB
and PostgreSQL both run, parameters marked ``:p0``, ``:p1``, ... (SQLAlchemy's text()
binds; `duckdb_sql` turns them into DuckDB's ``$p0``). The CLI runs a statement whole
through the `duckdb` module (trajstore.catalog.direct: no SQLAlchemy to import), REST
and server catalogs a page at a time through SQLAlchemy (trajstore.catalog.queries):
`after` is a keyset cursor's sort key, and keyset pages of a total order concatenate to
the whole order (tests/test_catalog_direct.py checks both ways on both databases).

Importing this module imports no database library.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, ClassVar

from trajstore.errors import UsageError

#: the largest value of a BIGINT column (rollout ids, step ids); REST bounds ids the same way
BIGINT_MAX = 2**63 - 1
#: the marker of an actor step no result was recorded for (trajstore.vocab.UNREPLAYED)
_UNREPLAYED = "unreplayed"


def duckdb_sql(sql: str) -> str:
    """`sql` with DuckDB's named parameter marks."""
    return re.sub(r"(?<![:\w]):(p\d+)\b", r"$\1", sql)


def check_filter_words(status: str | None = None, **stages: str | None) -> None:
    """Refuse a verdict filter that no row can match: a status or stage name outside the
    replay vocabulary (a typo such as `loss` for `loss.policy` would list no rows, read
    as "nothing diverged"). `stages` maps each stage filter's name to its value."""
    from trajstore.vocab import STAGE_ORDER, STEP_STATUSES

    if status is not None and status not in STEP_STATUSES:
        raise UsageError(f"status must be one of {', '.join(STEP_STATUSES)}, got {status!r}")
    for name, stage in stages.items():
        if stage is not None and stage not in STAGE_ORDER:
            raise UsageError(f"{name} must be one of {', '.join(STAGE_ORDER)}, got {stage!r}")


def check_rollout_range(rollout_from: int | None, rollout_to: int | None) -> None:
    """Refuse a rollout bound that is not a rollout id: one past BIGINT reached the
    database as an overflow (PostgreSQL: an internal error)."""
    for name, value in (("rollout_from", rollout_from), ("rollout_to", rollout_to)):
        if value is not None and (type(value) is not int or not 0 <= value <= BIGINT_MAX):
            raise UsageError(
                f"{name} must be a rollout id, an integer from 0 to {BIGINT_MAX}, got {value!r}"
            )


class Sql:
    """The parameters of one statement being written: `bind` names each value."""

    def __init__(self) -> None:
        self.params: dict[str, Any] = {}

    def bind(self, value: Any) -> str:
        name = f"p{len(self.params)}"
        self.params[name] = value
        return f":{name}"

    def eq(self, where: list[str], column: str, value: Any) -> None:
        if value is not None:
            where.append(f"{column} = {self.bind(value)}")

    def range(self, where: list[str], column: str, lo: int | None, hi: int | None) -> None:
        if lo is not None:
            where.append(f"{column} >= {self.bind(lo)}")
        if hi is not None:
            where.append(f"{column} <= {self.bind(hi)}")

    def keyset(
        self, where: list[str], order: Iterable[str], after: list | None, descending: bool = False
    ) -> None:
        """The rows past a cursor's sort key `after` (None: from the start)."""
        if after is not None:
            marks = ", ".join(self.bind(value) for value in after)
            where.append(f"({', '.join(order)}) {'<' if descending else '>'} ({marks})")

    def limit(self, limit: int | None) -> str:
        return "" if limit is None else f" LIMIT {self.bind(int(limit))}"


def _where(where: list[str]) -> str:
    return f" WHERE {' AND '.join(where)}" if where else ""


def count_of(statement: tuple[str, dict]) -> tuple[str, dict]:
    """The number of rows (``n``) of a listing's whole `statement` (text, params): the
    same statement counted, so that the count and the listing cannot disagree."""
    text, params = statement
    return f"SELECT count(*) AS n FROM ({text}) AS listed", params


def _joined(left: str, right: str, names: Iterable[str]) -> str:
    return " AND ".join(f"{left}.{name} = {right}.{name}" for name in names)


def _coalesced(value: Any) -> int:
    """A nullable sort column's value in the order (nulls sort as -1)."""
    return -1 if value is None else value


#: the identity of a cohort of bundles (its ranks share it) and of an actor step
COHORT = ("run", "kind", "rollout_id", "step_id", "attempt")
STEP_IDENTITY = ("run", "rollout_id", "step_id", "attempt")


def whole_first(results: str) -> str:
    """The sort key (false first) that puts a whole replay's result (no `selection`)
    before a partial one's, over the results table or alias `results`: the latest result
    of a bundle is its newest whole result, else its newest partial one; a partial replay
    passing must not hide the divergence the whole step was recorded with. The one
    definition of that rule (the SQLAlchemy readers use it through queries.whole_first)."""
    return f"({results}.selection IS NOT NULL)"


WHOLE_FIRST = whole_first("r")


def has_result_at(sql: Sql, stage: str, bundles: str) -> str:
    """Whether the cohort of `bundles`' row (latest attempt) has any result whose first
    divergent stage is `stage`: a semi-join the stage index answers."""
    return (
        "EXISTS (SELECT 1 FROM replay_results AS hit_r JOIN bundles AS hit_b "
        f"ON hit_b.key = hit_r.bundle_key WHERE hit_r.first_divergent_stage = {sql.bind(stage)} "
        f"AND hit_b.is_latest AND {_joined('hit_b', bundles, COHORT)})"
    )


def _visible(sql: Sql, alias: str, stage: str | None, **equal: Any) -> list[str]:
    """The conditions on bundles `alias`: the latest attempt, each given column equal to
    its value (None: any), and with `stage` the semi-join has_result_at."""
    where = [f"{alias}.is_latest"]
    for name, value in equal.items():
        sql.eq(where, f"{alias}.{name}", value)
    if stage is not None:
        where.append(has_result_at(sql, stage, alias))
    return where


def latest_results(
    sql: Sql,
    run: str | None,
    kind: str | None = "step",
    stage: str | None = None,
    within: str | None = None,
) -> str:
    """Per cohort of visible bundles, its latest result (WHOLE_FIRST, then the latest
    recorded_at): a subquery with the cohort's columns, ``result_id`` and ``rn``.

    With `within`, the name of a relation of actor steps (one row per STEP_IDENTITY, as
    latest_attempt_steps has them), only those steps' results are ranked: a step's
    cohort is ranked whole or not at all, so each of them gets the same latest result.

    With `stage`, only cohorts that have some result diverging first at `stage` are
    ranked (the index on first_divergent_stage finds them): a cohort whose latest result
    names `stage` is one of those, so a filter on the latest result's stage answers the
    same while ranking ~1/10 of the results. For PostgreSQL only, here and for the steps
    (10,000 steps, loaded 2-core box, medians of 15 alternating calls: 45 vs 55 ms);
    DuckDB's full ranking is faster than the extra semi-join (47 vs 53 ms with it)."""
    where = _visible(sql, "rb", stage, kind=kind, run=run)
    cohort = ", ".join(f"rb.{name}" for name in COHORT)
    chosen = (
        ""
        if within is None
        else f" JOIN {within} AS chosen ON {_joined('chosen', 'rb', STEP_IDENTITY)}"
    )
    return (
        f"SELECT * FROM (SELECT {cohort}, r.id AS result_id, r.bundle_key, r.status, "
        "r.first_divergent_stage, r.first_divergent_rank, r.root_bundle_key, r.recorded_at, "
        f"r.trajstore_version, row_number() OVER (PARTITION BY {cohort} ORDER BY "
        f"{WHOLE_FIRST}, r.recorded_at DESC NULLS LAST, r.id DESC) AS rn "
        f"FROM replay_results AS r JOIN bundles AS rb ON rb.key = r.bundle_key{chosen}"
        f"{_where(where)}) AS ranked WHERE ranked.rn = 1"
    )


def latest_attempt_steps(
    sql: Sql,
    run: str | None,
    rollout_from: int | None,
    rollout_to: int | None,
    attempt: int | None = None,
    stage: str | None = None,
) -> str:
    """One row per actor step (its latest attempt, or only those whose latest attempt is
    `attempt`): bundle count, sizes, publish time. With `stage`, only the steps with a
    result at that stage (see latest_results). Sums are cast to BIGINT: PostgreSQL sums
    bigints as NUMERIC (a float in JSON), DuckDB as HUGEINT."""
    where = ["b.kind = 'step'"]
    sql.range(where, "b.rollout_id", rollout_from, rollout_to)
    where += _visible(sql, "b", stage, run=run, attempt=attempt)
    identity = ", ".join(f"b.{name}" for name in STEP_IDENTITY)
    return (
        f"SELECT {identity}, count(*) AS num_bundles, "
        "CAST(sum(b.num_samples) AS BIGINT) AS num_samples, "
        "CAST(sum(b.num_tokens) AS BIGINT) AS num_tokens, max(b.published_at) AS published_at "
        f"FROM bundles AS b{_where(where)} GROUP BY {identity}"
    )


class Listing:
    """What every listing has: `tag` and `kinds` name its cursors (one letter per sort
    value: "s" a string, "i" an integer), `query` its filters (which a cursor is bound
    to), `key_of(row)` a row's sort key, `statement(...)` its SQL.

    A listing is a frozen record of its filters, FIELDS (name, default) in order: built
    from them by keyword or position, compared, hashed and shown by them, `_check`ed
    once built. What a frozen dataclass would give, written out: `dataclasses` (with
    `inspect`) is the one import of the ls/query/sql path that nothing else there needs
    (tests/test_cli_imports.py)."""

    __slots__ = ()
    FIELDS: ClassVar[tuple[tuple[str, Any], ...]] = ()
    tag: ClassVar[str]
    kinds: ClassVar[str]

    def __init__(self, *args: Any, **filters: Any) -> None:
        name = type(self).__name__
        names = [field for field, _ in self.FIELDS]
        if len(args) > len(names):
            raise TypeError(f"{name}() takes at most {len(names)} arguments, got {len(args)}")
        given = dict(zip(names, args, strict=False))
        for field, value in filters.items():
            if field not in names:
                raise TypeError(f"{name}() got an unexpected keyword argument {field!r}")
            if field in given:
                raise TypeError(f"{name}() got multiple values for argument {field!r}")
            given[field] = value
        for field, default in self.FIELDS:
            object.__setattr__(self, field, given.get(field, default))
        self._check()

    def _check(self) -> None:
        """Refuse filters no listing answers (UsageError)."""

    def _values(self) -> tuple:
        return tuple(getattr(self, field) for field, _ in self.FIELDS)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete field {name!r}")

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._values() == other._values()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        shown = ", ".join(f"{field}={getattr(self, field)!r}" for field, _ in self.FIELDS)
        return f"{type(self).__name__}({shown})"

    def __reduce__(self) -> tuple:
        return type(self), self._values()

    @property
    def query(self) -> dict[str, Any]:
        """The filters by name (what a cursor is bound to)."""
        return {field: getattr(self, field) for field, _ in self.FIELDS}


_BUNDLE_ORDER = (
    "run",
    "rollout_id",
    "coalesce(step_id, -1)",
    "coalesce(rank, -1)",
    "attempt",
    "key",
)


class Bundles(Listing):
    """Bundles, not removed, of their latest attempt (every attempt with
    include_all_attempts), ordered by (run, rollout_id, step_id, rank, attempt, key)."""

    FIELDS = (
        ("run", None),
        ("kind", None),
        ("rollout_from", None),
        ("rollout_to", None),
        ("include_all_attempts", False),
    )
    __slots__ = tuple(field for field, _ in FIELDS)
    run: str | None
    kind: str | None
    rollout_from: int | None
    rollout_to: int | None
    include_all_attempts: bool
    tag: ClassVar[str] = "bundles"
    kinds: ClassVar[str] = "siiiis"

    def _check(self) -> None:
        check_rollout_range(self.rollout_from, self.rollout_to)

    def statement(
        self,
        after: list | None = None,
        limit: int | None = None,
        columns: Any = None,
        ordered: bool = True,
    ) -> tuple[str, dict]:
        """Only `columns` when given (text output needs a few: fetching all 31 columns of
        10,000 rows costs ~150 ms here); `ordered`: False, in no order (what a count
        reads)."""
        sql = Sql()
        where = ["removed_at IS NULL"] + ([] if self.include_all_attempts else ["is_latest"])
        sql.eq(where, "run", self.run)
        sql.eq(where, "kind", self.kind)
        sql.range(where, "rollout_id", self.rollout_from, self.rollout_to)
        sql.keyset(where, _BUNDLE_ORDER, after)
        selected = ", ".join(f'"{c}"' for c in columns) if columns else "*"
        text = f"SELECT {selected} FROM bundles{_where(where)}"
        text += f" ORDER BY {', '.join(_BUNDLE_ORDER)}" if ordered else ""
        return text + sql.limit(limit), sql.params

    def count_statement(self) -> tuple[str, dict]:
        """How many rows the whole listing has (``n``): its rows, not sorted."""
        return count_of(self.statement(columns=("key",), ordered=False))

    @staticmethod
    def key_of(row: dict) -> list:
        step, rank = _coalesced(row["step_id"]), _coalesced(row["rank"])
        return [row["run"], row["rollout_id"], step, rank, row["attempt"], row["key"]]


#: step listing orders: name -> the leading sort column (None: step order only); a leading
#: "-" reverses the whole order. Nulls sort as the coalesced value, so a keyset can pass them.
STEP_SORTS = ("step", "-step", "status", "-status", "stage", "-stage", "tokens", "-tokens")
_STEP_LEADS = {
    "status": f"coalesce(latest.status, '{_UNREPLAYED}')",
    "stage": "coalesce(latest.first_divergent_stage, '')",
    "tokens": "coalesce(steps.num_tokens, 0)",
}
#: the columns of a steps item before ranks and bundle_keys: name -> expression
_STEP_COLUMNS = {
    **{
        name: f"steps.{name}"
        for name in (*STEP_IDENTITY, "num_bundles", "num_samples", "num_tokens", "published_at")
    },
    "result_id": "latest.result_id",
    "result_bundle_key": "latest.bundle_key AS result_bundle_key",
    **{
        name: f"latest.{name}"
        for name in (
            "status",
            "first_divergent_stage",
            "first_divergent_rank",
            "root_bundle_key",
            "recorded_at",
            "trajstore_version",
        )
    },
}


class Steps(Listing):
    """Actor steps (latest attempt) with their latest replay verdict.

    One item per (run, rollout_id, step_id): its ranks and bundle keys, and the most
    recently recorded result of any of its rank bundles (result columns are null when
    none was recorded). Filters on the verdict apply to that latest result only; status
    UNREPLAYED selects the steps with none. ``attempt`` keeps the steps whose latest
    attempt is that number. ``sort`` is one of STEP_SORTS (default: rollout, step)."""

    FIELDS = (
        ("run", None),
        ("first_divergent_stage", None),
        ("rollout_from", None),
        ("rollout_to", None),
        ("status", None),
        ("attempt", None),
        ("sort", "step"),
    )
    __slots__ = tuple(field for field, _ in FIELDS)
    run: str | None
    first_divergent_stage: str | None
    rollout_from: int | None
    rollout_to: int | None
    status: str | None
    attempt: int | None
    sort: str

    def _check(self) -> None:
        if self.sort not in STEP_SORTS:
            raise UsageError(f"sort must be one of {', '.join(STEP_SORTS)}, got {self.sort!r}")
        check_filter_words(self.status, first_divergent_stage=self.first_divergent_stage)
        check_rollout_range(self.rollout_from, self.rollout_to)

    @property
    def tag(self) -> str:  # type: ignore[override]
        return "steps" if self.sort == "step" else f"steps:{self.sort}"

    @property
    def kinds(self) -> str:  # type: ignore[override]
        lead = self.sort.removeprefix("-")
        return "siii" if lead == "step" else ("i" if lead == "tokens" else "s") + "siii"

    @property
    def verdict_free(self) -> bool:
        """Whether the listing's steps and their order need no replay verdict: no filter
        on the latest result's status or stage, and a sort on step or tokens. Then a
        page's steps are chosen first and only their results ranked, and the count
        ranks none (`_page`, `count_statement`)."""
        return (
            self.status is None
            and self.first_divergent_stage is None
            and self.sort.removeprefix("-") in ("step", "tokens")
        )

    def statement(
        self,
        after: list | None = None,
        limit: int | None = None,
        columns: Any = None,
        prefilter: bool = False,
    ) -> tuple[str, dict]:
        """The steps joined with their latest verdict, filtered on it, at most `limit`
        steps in order; then joined with their rank bundles (``member_rank``,
        ``member_key``: one row per rank bundle, `collate_steps` gathers them) in the
        same statement, so that ranks are gathered for these steps only. Each row carries
        ``sort_key`` (the leading sort value, or null in step order). Only `columns` (and
        the step's identity) when given; `prefilter`: the stage semi-join
        (latest_results), which PostgreSQL wants."""
        sql = Sql()
        page = self._page(sql, after, limit, columns, prefilter)
        direction = " DESC" if self.sort.startswith("-") else ""
        page_order = ", ".join(f"page.{n}{direction}" for n in ("sort_key", *STEP_IDENTITY))
        text = (
            "SELECT page.*, member.rank AS member_rank, member.key AS member_key "
            f"FROM ({page}) AS page JOIN bundles AS member ON member.kind = 'step' "
            f"AND member.is_latest AND {_joined('member', 'page', STEP_IDENTITY)} "
            f"ORDER BY {page_order}, coalesce(member.rank, -1), member.key"
        )
        return text, sql.params

    def count_statement(self, prefilter: bool = False) -> tuple[str, dict]:
        """How many steps (``n``) the whole listing has: its page of steps, counted
        (each step has a row there, whatever its number of rank bundles). A
        verdict-free listing counts the latest attempts' steps alone: each has one row
        in the listing, whatever its results, so none is ranked."""
        sql = Sql()
        if self.verdict_free:
            steps = latest_attempt_steps(
                sql, self.run, self.rollout_from, self.rollout_to, self.attempt
            )
            return count_of((steps, sql.params))
        page = self._page(sql, None, None, STEP_IDENTITY, prefilter, ordered=False)
        return count_of((page, sql.params))

    def _page(
        self,
        sql: Sql,
        after: list | None,
        limit: int | None,
        columns: Any,
        prefilter: bool,
        ordered: bool = True,
    ) -> str:
        """The steps of `statement`, one row each, in order (before their rank bundles).

        A verdict-free page (`verdict_free`, with a `limit`) picks its steps first
        (``chosen_steps``: keyset, order, limit over the latest attempts) and ranks the
        results of those steps only; any other listing ranks the latest result of
        every step, then filters and sorts on it. Same rows, same order. `ordered`:
        False, the whole listing in no order (what a count reads)."""
        stage = self.first_divergent_stage if prefilter else None
        steps = latest_attempt_steps(
            sql, self.run, self.rollout_from, self.rollout_to, self.attempt, stage
        )
        lead = _STEP_LEADS.get(self.sort.removeprefix("-"))
        order = [f"steps.{name}" for name in STEP_IDENTITY]
        order = order if lead is None else [lead, *order]
        descending = self.sort.startswith("-")
        direction = " DESC" if descending else ""
        order_by = ", ".join(o + direction for o in order)
        where: list[str] = []
        sql.keyset(where, order, after, descending)
        selected = [f"{lead or 'NULL'} AS sort_key"] + [
            expr
            for name, expr in _STEP_COLUMNS.items()
            if columns is None or name in columns or name in STEP_IDENTITY
        ]
        on_step = _joined("latest", "steps", STEP_IDENTITY)
        if self.verdict_free and limit is not None:
            chosen = f"SELECT * FROM ({steps}) AS steps{_where(where)} ORDER BY {order_by}"
            chosen += sql.limit(limit)
            latest = latest_results(sql, self.run, within="chosen_steps")
            return (
                f"WITH chosen_steps AS ({chosen}) SELECT {', '.join(selected)} "
                f"FROM chosen_steps AS steps LEFT OUTER JOIN ({latest}) AS latest "
                f"ON {on_step} ORDER BY {order_by}"
            )
        latest = latest_results(sql, self.run, stage=stage)
        sql.eq(where, "latest.first_divergent_stage", self.first_divergent_stage)
        if self.status == _UNREPLAYED:
            where.append("latest.result_id IS NULL")
        else:
            sql.eq(where, "latest.status", self.status)
        text = (
            f"SELECT {', '.join(selected)} FROM ({steps}) AS steps LEFT OUTER JOIN "
            f"({latest}) AS latest ON {on_step}{_where(where)}"
        )
        if ordered or limit is not None:
            text += f" ORDER BY {order_by}"
        return text + sql.limit(limit)


def collate_steps(rows: list[dict]) -> tuple[list[dict], list]:
    """One item per step from the steps statement's rows (one per rank bundle), with its
    ``ranks`` and ``bundle_keys``; and each item's ``sort_key``."""
    items: list[dict] = []
    leads: list = []
    last = None
    for row in rows:
        identity = (row["run"], row["rollout_id"], row["step_id"], row["attempt"])
        rank, key = row.pop("member_rank"), row.pop("member_key")
        if identity != last:
            leads.append(row.pop("sort_key"))
            row["ranks"], row["bundle_keys"] = [], []
            items.append(row)
            last = identity
        if rank is not None:
            items[-1]["ranks"].append(rank)
        items[-1]["bundle_keys"].append(key)
    return items, leads


def step_verdicts(
    run: str, rollout_from: int | None = None, rollout_to: int | None = None
) -> tuple[str, dict]:
    """(rollout_id, status, first_divergent_stage, n: step count) over the run's steps,
    their verdict as the step listing has it (trajstore.catalog.overview)."""
    check_rollout_range(rollout_from, rollout_to)
    sql = Sql()
    steps = latest_attempt_steps(sql, run, rollout_from, rollout_to)
    latest = latest_results(sql, run)
    status = f"coalesce(latest.status, '{_UNREPLAYED}')"
    text = (
        f"SELECT steps.rollout_id, {status} AS status, latest.first_divergent_stage, "
        f"count(*) AS n FROM ({steps}) AS steps LEFT OUTER JOIN ({latest}) AS latest "
        f"ON {_joined('latest', 'steps', STEP_IDENTITY)} "
        f"GROUP BY steps.rollout_id, {status}, latest.first_divergent_stage"
    )
    return text, sql.params


class Divergences(Listing):
    """Divergences of each visible step's or rollout's latest result, ordered by
    (run, rollout_id, step_id, result_id, position)."""

    FIELDS = (
        ("run", None),
        ("stage", None),
        ("min_abs_err", None),
        ("sample_id", None),
        ("rollout_from", None),
        ("rollout_to", None),
    )
    __slots__ = tuple(field for field, _ in FIELDS)
    run: str | None
    stage: str | None
    min_abs_err: float | None
    sample_id: str | None
    rollout_from: int | None
    rollout_to: int | None
    tag: ClassVar[str] = "divergences"
    kinds: ClassVar[str] = "siiii"

    def _check(self) -> None:
        check_filter_words(stage=self.stage)

    def statement(
        self, after: list | None = None, limit: int | None = None, ordered: bool = True
    ) -> tuple[str, dict]:
        """`ordered`: False, in no order (what a count reads)."""
        check_rollout_range(self.rollout_from, self.rollout_to)
        sql = Sql()
        latest = latest_results(sql, self.run, kind=None)
        where: list[str] = []
        order = (
            "latest.run",
            "latest.rollout_id",
            "coalesce(latest.step_id, -1)",
            "d.result_id",
            "d.position",
        )
        sql.keyset(where, order, after)
        sql.range(where, "latest.rollout_id", self.rollout_from, self.rollout_to)
        sql.eq(where, "d.stage", self.stage)
        if self.min_abs_err is not None:
            where.append(f"d.abs_err >= {sql.bind(float(self.min_abs_err))}")
        sql.eq(where, "d.sample_id", self.sample_id)
        text = (
            "SELECT latest.run, latest.kind, latest.rollout_id, latest.step_id, "
            "latest.attempt, latest.bundle_key, latest.trajstore_version, latest.recorded_at, "
            f"d.* FROM divergences AS d JOIN ({latest}) AS latest "
            f"ON latest.result_id = d.result_id{_where(where)}"
        )
        text += f" ORDER BY {', '.join(order)}" if ordered else ""
        return text + sql.limit(limit), sql.params

    def count_statement(self) -> tuple[str, dict]:
        """How many rows the whole listing has (``n``): its rows, not sorted."""
        return count_of(self.statement(ordered=False))

    @staticmethod
    def key_of(row: dict) -> list:
        step = _coalesced(row["step_id"])
        return [row["run"], row["rollout_id"], step, row["result_id"], row["position"]]


class RouterMetrics(Listing):
    """Router consistency metrics of visible bundles (router-metrics.md names), with each
    bundle's router mode, rank and attempt; ordered by (run, rollout_id, step_id, id)."""

    FIELDS = (("run", None), ("rollout_from", None), ("rollout_to", None), ("source", None))
    __slots__ = tuple(field for field, _ in FIELDS)
    run: str | None
    rollout_from: int | None
    rollout_to: int | None
    source: str | None
    tag: ClassVar[str] = "router_metrics"
    kinds: ClassVar[str] = "siii"

    def statement(
        self, after: list | None = None, limit: int | None = None, ordered: bool = True
    ) -> tuple[str, dict]:
        """`ordered`: False, in no order (what a count reads)."""
        check_rollout_range(self.rollout_from, self.rollout_to)
        sql = Sql()
        where = ["b.is_latest"]
        order = ("m.run", "m.rollout_id", "coalesce(m.step_id, -1)", "m.id")
        sql.keyset(where, order, after)
        sql.range(where, "m.rollout_id", self.rollout_from, self.rollout_to)
        sql.eq(where, "m.run", self.run)
        sql.eq(where, "m.source", self.source)
        text = (
            "SELECT m.*, lineage.mode, b.rank, b.attempt FROM router_metrics AS m "
            "JOIN bundles AS b ON b.key = m.bundle_key "
            "LEFT OUTER JOIN router_lineage AS lineage ON lineage.bundle_key = m.bundle_key"
            f"{_where(where)}"
        )
        text += f" ORDER BY {', '.join(order)}" if ordered else ""
        return text + sql.limit(limit), sql.params

    def count_statement(self) -> tuple[str, dict]:
        """How many rows the whole listing has (``n``): its rows, not sorted."""
        return count_of(self.statement(ordered=False))

    @staticmethod
    def key_of(row: dict) -> list:
        return [row["run"], row["rollout_id"], _coalesced(row["step_id"]), row["id"]]


def has_sample(sample_id: str, run: str | None = None) -> tuple[str, dict]:
    """Whether any bundle (of `run`, when given; removed ones too) holds `sample_id`: a
    row or none."""
    sql = Sql()
    where = [f"s.sample_id = {sql.bind(sample_id)}"]
    sql.eq(where, "b.run", run)
    text = "SELECT 1 AS hit FROM samples AS s JOIN bundles AS b ON b.key = s.bundle_key"
    return text + _where(where) + " LIMIT 1", sql.params


#: every run the catalog knows (published once, even if removed since), sorted
RUN_NAMES = "SELECT run FROM runs ORDER BY run"
