"""Running the catalog's listings (trajstore.catalog.statements): a page at a time behind
a keyset cursor (REST), or whole (the CLI), over any reader's `execute`.

`execute(sql, params, setup=())` runs one statement of statements.py (``:pN`` marks) and
returns its rows as dicts of JSON values (`jsonable`); `setup` are statements run first in
the same transaction (a planner setting). trajstore.catalog.queries gives one over
SQLAlchemy (any catalog), trajstore.catalog.direct over the `duckdb` module.

Cursors are opaque strings encoding the last sort key, valid only for the query (filters
and sort) that returned them; pages hold at most MAX_PAGE_SIZE rows.
Importing this module imports no database library.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable
from typing import Any

from trajstore.catalog import statements as st
from trajstore.errors import UsageError, check_known_sample

#: (sql, params, setup) -> rows as dicts of JSON values
Execute = Callable[..., list[dict[str, Any]]]
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
#: PostgreSQL estimates the latest-result filter (row_number = 1 AND stage) at one row and
#: nests loops over every step for it; hash joins answer 10,000 steps in ~30 ms instead of
#: 60-120 (scripts/bench/bench_catalog_pg.py). SET LOCAL ends with the transaction.
PG_STEPS_SETUP = ("SET LOCAL enable_nestloop = off",)


def page_limit(limit: int | None) -> int:
    """A page's size: DEFAULT_PAGE_SIZE, or `limit` from 1 to MAX_PAGE_SIZE."""
    if limit is None:
        return DEFAULT_PAGE_SIZE
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE_SIZE:
        raise UsageError(f"limit must be an integer from 1 to {MAX_PAGE_SIZE}, got {limit!r}")
    return limit


def whole_limit(limit: int | None) -> int | None:
    """A whole listing's row limit: none for None or one no table can reach (past BIGINT,
    which the database refuses), as the paged reader treats it."""
    if isinstance(limit, bool) or (limit is not None and not isinstance(limit, int)):
        raise UsageError(f"limit must be an integer >= 1, got {limit!r}")
    if limit is not None and limit < 1:
        raise UsageError(f"limit must be an integer >= 1, got {limit}")
    return None if limit is None or limit > st.BIGINT_MAX else limit


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


def _known_sample(execute: Execute, listing: Any) -> None:
    """A divergences filter on a sample no bundle holds is refused (NotFoundError)."""
    sample_id = getattr(listing, "sample_id", None)
    if sample_id is not None:
        found = bool(execute(*st.has_sample(sample_id, listing.run)))
        check_known_sample(sample_id, found, listing.run)


def page(execute: Execute, listing: Any, limit: int | None, cursor: str | None) -> dict:
    """{"items": [...], "next_cursor": str | None}: one page of a Bundles, Divergences or
    RouterMetrics listing after `cursor`."""
    _known_sample(execute, listing)
    limit = page_limit(limit)
    after = decode_cursor(listing.tag, listing.query, cursor, listing.kinds)
    rows = execute(*listing.statement(after, limit + 1))
    more = len(rows) > limit
    items = rows[:limit]
    last = encode_cursor(listing.tag, listing.query, listing.key_of(items[-1])) if more else None
    return {"items": items, "next_cursor": last}


def steps_page(
    execute: Execute, listing: st.Steps, limit: int | None, cursor: str | None, dialect: str
) -> dict:
    """One page of a Steps listing after `cursor`; `dialect` ("duckdb", "postgresql")
    chooses the plan (the stage prefilter and PG_STEPS_SETUP on PostgreSQL)."""
    limit = page_limit(limit)
    after = decode_cursor(listing.tag, listing.query, cursor, listing.kinds)
    pg = dialect == "postgresql"
    sql, params = listing.statement(after, limit + 1, prefilter=pg)
    items, leads = st.collate_steps(execute(sql, params, PG_STEPS_SETUP if pg else ()))
    more = len(items) > limit
    items = items[:limit]
    next_cursor = None
    if more:
        lead = [] if listing.sort.removeprefix("-") == "step" else [leads[limit - 1]]
        last = [items[-1][name] for name in st.STEP_IDENTITY]
        next_cursor = encode_cursor(listing.tag, listing.query, lead + last)
    return {"items": items, "next_cursor": next_cursor}


#: the listings by the name of the reader method that runs them whole (Listings)
LISTINGS: dict[str, type] = {
    "bundles": st.Bundles,
    "steps": st.Steps,
    "divergences": st.Divergences,
    "router_metrics": st.RouterMetrics,
}


def count(execute: Execute, what: str, filters: dict[str, Any], dialect: str = "duckdb") -> int:
    """How many rows the whole listing `what` (a LISTINGS name) with `filters` has: its
    `count_statement`, so that only the number, not the rows, leaves the database."""
    listing = LISTINGS[what](**filters)
    if isinstance(listing, st.Steps):
        pg = dialect == "postgresql"
        sql, params = listing.count_statement(prefilter=pg)
        rows = execute(sql, params, PG_STEPS_SETUP if pg else ())
    else:
        rows = execute(*listing.count_statement())
    return int(rows[0]["n"])


class Listings:
    """The whole listings the CLI prints (ls, query), over `execute`: one statement each,
    no paging. A reader (trajstore.catalog.direct.DirectCatalog) sets `execute` and
    `dialect`. `limit` keeps the first rows; `columns`, for bundles and steps, the
    columns a table shows (the step's identity, ranks and bundle keys always)."""

    execute: Execute
    dialect: str = "duckdb"

    def run_names(self) -> list[str]:
        """Every run the catalog knows (published once, even if removed since), sorted."""
        return [row["run"] for row in self.execute(st.RUN_NAMES, {})]

    def has_sample(self, sample_id: str, run: str | None = None) -> bool:
        """Whether any bundle (of `run`, when given; removed ones too) holds `sample_id`."""
        return bool(self.execute(*st.has_sample(sample_id, run)))

    def bundles(self, limit: int | None = None, columns: Any = None, **filters: Any) -> list:
        """As list_bundles (statements.Bundles), every page."""
        listing = st.Bundles(**filters)
        return self.execute(*listing.statement(limit=whole_limit(limit), columns=columns))

    def steps(self, limit: int | None = None, columns: Any = None, **filters: Any) -> list:
        """As query_steps (statements.Steps), every page."""
        listing = st.Steps(**filters)
        pg = self.dialect == "postgresql"
        sql, params = listing.statement(limit=whole_limit(limit), columns=columns, prefilter=pg)
        return st.collate_steps(self.execute(sql, params))[0]

    def divergences(self, limit: int | None = None, **filters: Any) -> list:
        """As query_divergences (statements.Divergences), every page."""
        listing = st.Divergences(**filters)
        _known_sample(self.execute, listing)
        return self.execute(*listing.statement(limit=whole_limit(limit)))

    def router_metrics(self, limit: int | None = None, **filters: Any) -> list:
        """As query_router_metrics (statements.RouterMetrics), every page."""
        listing = st.RouterMetrics(**filters)
        return self.execute(*listing.statement(limit=whole_limit(limit)))

    def count(self, what: str, **filters: Any) -> int:
        """How many rows the whole listing `what` ("bundles", "steps", "divergences",
        "router_metrics": the method listing it) has with these filters."""
        return count(self.execute, what, filters, self.dialect)

    def mismatch(self, q: Any, limit: int | None = None) -> list[dict]:
        """As query_mismatch, every page."""
        from trajstore.mismatch.query import steps

        return steps(self.execute, q, limit)

    def mismatch_layers(self, q: Any) -> list[dict]:
        """Route mismatch per (step, layer) (`mismatch.query.layers`)."""
        from trajstore.mismatch.query import layers

        return layers(self.execute, q)
