"""The store's DuckDB catalog read straight through the `duckdb` module (ls, query, sql).

Why: SQLAlchemy + duckdb_engine cost about 0.6 s to import on a loaded 2-core box and
their per-row result handling about 20 us a row, several times the whole budget of a
command that lists 10,000 steps. This module imports neither. Its statements are the
ones trajstore.catalog.queries builds with SQLAlchemy, written out for DuckDB (the same
schema, filters and order; tests/test_catalog_direct.py checks every filter of both
against each other, row for row), each run once without paging: keyset pages of a total
order concatenate to the unpaged order.

It also holds what both readers share without SQLAlchemy: the JSON form of a catalog
value, the read-only SQL check, DuckDB's lock retry, and the *listing* record that lets a
reader skip a no-op sync (`listing_record`, `listing_unchanged`; docs/catalog.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from trajstore.catalog.revisions import HEAD_REVISION, KNOWN_REVISIONS
from trajstore.errors import (
    CatalogDamagedError,
    StoreError,
    TrajstoreError,
    UsageError,
    check_known_sample,
)

CATALOG_FILE = "catalog.duckdb"
JSON_COLUMNS = frozenset(
    {"cohort_ranks", "shape", "per_layer_mismatch", "metric_error", "selection"}
)
MAX_SQL_ROWS = 100_000
_LOCK_MARKER = "Could not set lock"

# -- shared by both readers -----------------------------------------------------------


def jsonable(name: str, value: Any) -> Any:
    """A catalog value as the JSON every reader returns (one name per number)."""
    if value is None:
        return None
    if name in JSON_COLUMNS and isinstance(value, str):
        return json.loads(value)
    if isinstance(value, (str, int, float)):  # most values; bool is an int
        return value
    import datetime as dt
    import decimal
    import uuid

    if isinstance(value, dt.datetime):
        if value.tzinfo is not None:
            value = value.astimezone(dt.timezone.utc).replace(tzinfo=None)
        return value.isoformat() + "Z"
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    return value


def driver() -> Any:
    """DuckDB's C extension module, which the `duckdb` package re-exports as is
    (duckdb.connect is _duckdb.connect): the package's own Python modules cost ~0.1 s
    of imports (dataclasses, importlib.metadata) that reading the catalog never uses."""
    try:
        import _duckdb
    except ImportError:  # a DuckDB that no longer ships it separately
        import duckdb as _duckdb
    return _duckdb


def is_lock_error(exc: BaseException) -> bool:
    return _LOCK_MARKER in str(exc)


#: what DuckDB says of a database file it cannot read back: cut short, overwritten, a
#: block or a WAL entry failing its checksum
_DAMAGE_MARKERS = (
    "Could not read enough bytes",
    "not a valid DuckDB database file",
    "Corrupt database file",
    "Corrupt WAL file",
    "Failure while replaying WAL",
)


def damage_of(exc: BaseException) -> str | None:
    """DuckDB's one-line complaint if `exc`, or what it wraps (SQLAlchemy's `.orig`, a
    cause), says a database file is damaged; else None. By message, because DuckDB raises
    these as the same IOException (or its plain Error) as a held lock or a full disk."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        for line in str(getattr(e, "orig", None) or e).splitlines():
            if any(m in line for m in _DAMAGE_MARKERS):
                return line.strip()[:300]
        e = e.__cause__ or e.__context__
    return None


@contextlib.contextmanager
def damage_guard(file: str | None) -> Iterator[None]:
    """Turn DuckDB's complaint about a damaged catalog `file` (None: not a file, nothing
    to turn) into one CatalogDamagedError naming it, wherever the read or write met it."""
    try:
        yield
    except TrajstoreError:
        raise
    except Exception as exc:
        reason = damage_of(exc) if file else None
        if reason is None:
            raise
        raise CatalogDamagedError(str(file), reason) from None


def retry_lock(action: Callable[[], Any], what: str, timeout: float) -> Any:
    """Run action(), retrying DuckDB's file-lock error with backoff until timeout."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        try:
            return action()
        except Exception as exc:  # duckdb.IOException, maybe wrapped by SQLAlchemy
            if not is_lock_error(exc):
                raise
            if time.monotonic() >= deadline:
                raise StoreError(
                    f"catalog {what} is locked by another process ({_LOCK_MARKER}) for more "
                    f"than {timeout:g}s; wait for it to finish or raise the lock timeout"
                ) from None
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 1.6, 0.5)


_READ_TYPES = {"SELECT"}
_SAFE_PRAGMAS = {
    "table_info",
    "show_tables",
    "show_tables_expanded",
    "database_size",
    "storage_info",
    "version",
    "show",
}
_PRAGMA_RE = re.compile(r"^\s*pragma\s+([a-z_]+)", re.IGNORECASE)
_EXPLAIN_RE = re.compile(r"^\s*explain\s+(analy[sz]e\s+)?", re.IGNORECASE)


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


#: the largest value of a BIGINT column (rollout ids, step ids); REST bounds ids the same way
BIGINT_MAX = 2**63 - 1


def check_rollout_range(rollout_from: int | None, rollout_to: int | None) -> None:
    """Refuse a rollout bound that is not a rollout id: one past BIGINT reached the
    database as an overflow (PostgreSQL: an internal error)."""
    for name, value in (("rollout_from", rollout_from), ("rollout_to", rollout_to)):
        if value is not None and (type(value) is not int or not 0 <= value <= BIGINT_MAX):
            raise UsageError(
                f"{name} must be a rollout id, an integer from 0 to {BIGINT_MAX}, got {value!r}"
            )


def check_readonly(sql: str) -> None:
    """Refuse anything but one read-only statement, using DuckDB's own parser."""
    duckdb = driver()

    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise UsageError(f"SQL does not parse: {str(exc).splitlines()[0]}") from None
    if len(statements) != 1:
        raise UsageError(f"give exactly one SQL statement, got {len(statements)}")
    (stmt,) = statements
    kind = stmt.type.name
    if kind in _READ_TYPES:
        return
    if kind == "EXPLAIN":
        check_readonly(_EXPLAIN_RE.sub("", stmt.query, count=1))
        return
    if kind == "PRAGMA":
        m = _PRAGMA_RE.match(stmt.query)
        if m and m.group(1).lower() in _SAFE_PRAGMAS:
            return
    raise UsageError(f"only read-only SQL is allowed (SELECT, WITH, EXPLAIN, ...), not {kind}")


def check_row_count(rows: list, max_rows: int) -> list:
    """`rows` (fetched up to max_rows + 1), refused when there are more than max_rows: a
    result cut short without a word would read as the whole answer."""
    if len(rows) > max_rows:
        raise UsageError(
            f"the statement returns more than {max_rows:,} rows, the most `sql` prints; "
            "add LIMIT/OFFSET or aggregate"
        )
    return rows


def readonly_sql_duckdb(raw: Any, sql: str, max_rows: int) -> tuple[list[str], list[list]]:
    """One checked read-only statement on a DuckDB connection, in a READ ONLY transaction
    that is rolled back; file access from SQL is switched off first (for good)."""
    cur = raw.cursor()
    try:
        cur.execute("SET enable_external_access = false")
        cur.execute("BEGIN TRANSACTION READ ONLY")
        try:
            cur.execute(sql)
            columns = [d[0] for d in (cur.description or [])]
            rows = check_row_count(cur.fetchmany(max_rows + 1), max_rows) if columns else []
        finally:
            cur.execute("ROLLBACK")
    except UsageError:
        raise
    except Exception as exc:
        if damage_of(exc) is not None:
            raise  # the file, not the statement: the caller names the file and the fix
        raise UsageError(f"SQL failed: {str(exc).splitlines()[0]}") from None
    finally:
        cur.close()
    return columns, [[jsonable("", v) for v in row] for row in rows]


# -- the listing a sync applied ----------------------------------------------------------

#: a directory's stat stands for its listing only if it was last modified this long before
#: the listing was taken: a later create/unlink then moves its mtime even on a filesystem
#: whose timestamps are a clock tick coarse (a change within the same tick as the previous
#: one would not)
SETTLE_NS = 1_000_000_000


def list_local(folder: Path) -> list[str]:
    """A store directory's document names, sorted: the names a sync lists
    (LocalRefSpace.list: no dot files, regular files, ``.json``)."""
    try:
        with os.scandir(folder) as entries:
            names = [
                e.name
                for e in entries
                if e.name.endswith(".json") and not e.name.startswith(".") and e.is_file()
            ]
    except FileNotFoundError:
        return []
    names.sort()
    return names


def _digest(names: list[str]) -> str:
    return hashlib.blake2b("\n".join(names).encode(), digest_size=20).hexdigest()


def dir_stat(folder: Path) -> list[int] | None:
    """What of a directory's stat changes when an entry is created or removed."""
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        return None
    return [st.st_mtime_ns, st.st_ino, st.st_dev]


def listing_record(names: list[str], stat: list[int] | None, listed_ns: int | None) -> str:
    """The JSON text stored in sync_state.listing once every one of `names` is applied.
    `stat`/`listed_ns`: the directory's stat, taken at `listed_ns` before the listing
    (None for a ref space without local directories)."""
    return json.dumps(
        {"names": len(names), "digest": _digest(names), "stat": stat, "listed_ns": listed_ns},
        sort_keys=True,
    )


def listing_unchanged(recorded: str | None, folder: Path) -> tuple[bool, str | None]:
    """Whether `folder` still holds exactly the names of the recorded listing, and, when
    the names had to be compared, a record to store in its place (None: keep it).

    The directory's stat answers when it is the recorded one and was already settled
    when that listing was taken (SETTLE_NS); otherwise the names are listed and their
    digest compared (about 20 ms per 10,000 names here), and if they match the record
    is renewed with the stat taken before this listing, so that the next reader of a
    settled directory needs only the stat. Any created or removed document changes
    the stat or the names."""
    if not recorded:
        return False, None
    try:
        rec = json.loads(recorded)
        stat, listed_ns = rec["stat"], rec["listed_ns"]
    except (ValueError, KeyError, TypeError):
        return False, None
    settled = stat is not None and listed_ns is not None and stat[0] <= listed_ns - SETTLE_NS
    now_ns = time.time_ns()
    current = dir_stat(folder)
    if settled and stat == current:
        return True, None
    names = list_local(folder)
    if len(names) != rec.get("names") or _digest(names) != rec.get("digest"):
        return False, None
    renewed = listing_record(names, current, now_ns)
    return True, (renewed if current is not None and current[0] <= now_ns - SETTLE_NS else None)


# -- the direct reader ------------------------------------------------------------------

#: sync_state directory -> folder of a local store (trajstore.catalog.sync.DIRECTORIES)
SYNC_FOLDERS = {"tombstones": "refs/tombstones", "bundles": "refs/bundles", "results": "results"}


#: DuckDB result types whose Python values jsonable returns unchanged
_PLAIN = frozenset(
    {"VARCHAR", "BOOLEAN", "TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT", "DOUBLE"}
    | {"UTINYINT", "USMALLINT", "UINTEGER", "UBIGINT", "FLOAT"}
)


def _json_text(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else jsonable("", value)


def _timestamp(value: Any) -> str:
    """jsonable of a naive datetime (DuckDB's TIMESTAMP)."""
    return value.isoformat() + "Z"


class NeedsFullOpen(Exception):
    """The direct reader cannot serve this catalog as it is (no file yet, an older
    revision to migrate, documents not yet synced): open it the full way."""


class DirectCatalog:
    """A store's DuckDB catalog file held open through the `duckdb` module."""

    def __init__(self, con: Any, file: str) -> None:
        self.con = con
        self.file = file

    @classmethod
    def open(cls, store_dir: Path, *, lock_timeout: float = 30.0) -> DirectCatalog:
        """Open the store's catalog if it is at the head revision and in step with the
        refs; NeedsFullOpen otherwise. A catalog newer than this trajstore is refused
        with open_catalog's message."""
        file = store_dir.resolve() / CATALOG_FILE
        if not file.is_file() or file.stat().st_size == 0:  # an empty one: see stillborn.py
            raise NeedsFullOpen("no catalog file")
        with damage_guard(str(file)):
            return cls._open(store_dir, file, lock_timeout)

    @classmethod
    def _open(cls, store_dir: Path, file: Path, lock_timeout: float) -> DirectCatalog:
        duckdb = driver()

        con = retry_lock(lambda: duckdb.connect(str(file)), str(file), lock_timeout)
        try:
            try:
                (current,) = con.execute("SELECT version_num FROM alembic_version").fetchone()
            except (duckdb.Error, TypeError):
                raise NeedsFullOpen("no revision") from None
            if current not in KNOWN_REVISIONS:
                raise StoreError(
                    f"catalog is at revision {current}, newer than this trajstore "
                    f"({HEAD_REVISION}); upgrade trajstore"
                )
            if current != HEAD_REVISION:
                raise NeedsFullOpen(f"revision {current} needs a migration")
            recorded = dict(con.execute("SELECT directory, listing FROM sync_state").fetchall())
            renewed = {}
            for directory, folder in SYNC_FOLDERS.items():
                same, record = listing_unchanged(recorded.get(directory), store_dir / folder)
                if not same:
                    raise NeedsFullOpen(f"{folder} changed since the last sync")
                if record is not None:
                    renewed[directory] = record
            for directory, record in renewed.items():
                con.execute(
                    "UPDATE sync_state SET listing = ? WHERE directory = ?", [record, directory]
                )
        except BaseException:
            con.close()
            raise
        return cls(con, str(file))

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> DirectCatalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _rows(self, sql: str, params: list) -> list[dict]:
        """Rows as dicts of JSON values (queries._row). Converted per column type: text,
        numbers and booleans pass as is (jsonable returns them unchanged), a naive
        TIMESTAMP becomes its isoformat + "Z", the rest goes through jsonable."""
        cur = self.con.execute(sql, params)
        names = [d[0] for d in cur.description]
        convert = []
        for n, (name, kind, *_) in enumerate(cur.description):
            if name in JSON_COLUMNS:
                convert.append((n, name, _json_text))
            elif str(kind) == "TIMESTAMP":
                convert.append((n, name, _timestamp))
            elif str(kind) not in _PLAIN:
                convert.append((n, name, lambda v, name=name: jsonable(name, v)))
        out = []
        for row in cur.fetchall():
            item = dict(zip(names, row, strict=True))
            for n, name, fn in convert:
                value = row[n]
                if value is not None:
                    item[name] = fn(value)
            out.append(item)
        return out

    # -- the queries (trajstore.catalog.queries, unpaged) --------------------------------

    def has_sample(self, sample_id: str, run: str | None = None) -> bool:
        """Whether any bundle (of `run`, when given; removed ones too) holds `sample_id`."""
        sql = "SELECT 1 FROM samples AS s JOIN bundles AS b ON b.key = s.bundle_key "
        sql += "WHERE s.sample_id = ?" + (" AND b.run = ?" if run is not None else "")
        params = [sample_id] + ([run] if run is not None else [])
        return self.con.execute(sql + " LIMIT 1", params).fetchone() is not None

    def run_names(self) -> list[str]:
        """Every run the catalog knows (published once, even if removed since), sorted."""
        return [row["run"] for row in self._rows("SELECT run FROM runs ORDER BY run", [])]

    def bundles(
        self,
        run: str | None = None,
        kind: str | None = None,
        rollout_from: int | None = None,
        rollout_to: int | None = None,
        include_all_attempts: bool = False,
        limit: int | None = None,
        columns: tuple[str, ...] | None = None,
    ) -> list[dict]:
        """As list_bundles, every page; only `columns` when given (text output needs a
        few: fetching all 31 columns of 10,000 rows costs ~150 ms here)."""
        where, params = ["removed_at IS NULL"], []
        if not include_all_attempts:
            where.append("is_latest")
        _eq(where, params, "run", run)
        _eq(where, params, "kind", kind)
        _range(where, params, "rollout_id", rollout_from, rollout_to)
        selected = ", ".join(f'"{c}"' for c in columns) if columns else "*"
        sql = (
            f"SELECT {selected} FROM bundles "
            f"WHERE {' AND '.join(where)} ORDER BY run, rollout_id, "
            "coalesce(step_id, -1), coalesce(rank, -1), attempt, key"
        )
        return self._rows(sql + _limit(params, limit), params)

    def steps(
        self,
        run: str | None = None,
        first_divergent_stage: str | None = None,
        rollout_from: int | None = None,
        rollout_to: int | None = None,
        status: str | None = None,
        limit: int | None = None,
        columns: tuple[str, ...] | None = None,
    ) -> list[dict]:
        """As query_steps (step order, DuckDB's plan: no stage prefilter), every page;
        only `columns` (and the step's identity, ranks, bundle_keys) when given."""
        from trajstore.vocab import UNREPLAYED

        check_filter_words(status, first_divergent_stage=first_divergent_stage)
        params: list = []
        step_where = ["kind = 'step'", "is_latest"]
        _range(step_where, params, "rollout_id", rollout_from, rollout_to)
        _eq(step_where, params, "run", run)
        latest_sql = _latest_results_sql(params, run, "step")
        page_where: list[str] = []
        _eq(page_where, params, "latest.first_divergent_stage", first_divergent_stage)
        if status == UNREPLAYED:
            page_where.append("latest.result_id IS NULL")
        else:
            _eq(page_where, params, "latest.status", status)
        selected = [
            expr
            for name, expr in _STEP_PAGE_COLUMNS
            if columns is None or name in columns or name in _STEP_IDENTITY
        ]
        page_sql = (
            f"SELECT {', '.join(selected)} "
            "FROM (SELECT run, rollout_id, step_id, attempt, count(*) AS num_bundles, "
            "sum(num_samples) AS num_samples, sum(num_tokens) AS num_tokens, "
            "max(published_at) AS published_at FROM bundles "
            f"WHERE {' AND '.join(step_where)} GROUP BY run, rollout_id, step_id, attempt) "
            f"AS steps LEFT OUTER JOIN ({latest_sql}) AS latest ON latest.run = steps.run "
            "AND latest.rollout_id = steps.rollout_id AND latest.step_id = steps.step_id "
            "AND latest.attempt = steps.attempt"
            + (f" WHERE {' AND '.join(page_where)}" if page_where else "")
            + " ORDER BY steps.run, steps.rollout_id, steps.step_id, steps.attempt"
        )
        page_sql += _limit(params, limit)
        sql = (
            "SELECT page.*, member.rank AS member_rank, member.key AS member_key "
            f"FROM ({page_sql}) AS page JOIN bundles AS member ON member.kind = 'step' "
            "AND member.is_latest AND member.run = page.run "
            "AND member.rollout_id = page.rollout_id AND member.step_id = page.step_id "
            "AND member.attempt = page.attempt ORDER BY page.run, page.rollout_id, "
            "page.step_id, page.attempt, coalesce(member.rank, -1), member.key"
        )
        items: list[dict] = []
        last = None
        for row in self._rows(sql, params):
            identity = (row["run"], row["rollout_id"], row["step_id"], row["attempt"])
            rank, key = row.pop("member_rank"), row.pop("member_key")
            if identity != last:
                row["ranks"], row["bundle_keys"] = [], []
                items.append(row)
                last = identity
            if rank is not None:
                items[-1]["ranks"].append(rank)
            items[-1]["bundle_keys"].append(key)
        return items

    def divergences(
        self,
        run: str | None = None,
        stage: str | None = None,
        min_abs_err: float | None = None,
        sample_id: str | None = None,
        rollout_from: int | None = None,
        rollout_to: int | None = None,
        limit: int | None = None,
    ) -> list[dict]:
        """As query_divergences, every page."""
        check_filter_words(stage=stage)
        if sample_id is not None:
            check_known_sample(sample_id, self.has_sample(sample_id, run), run)
        params: list = []
        latest_sql = _latest_results_sql(params, run, None)
        where: list[str] = []
        _range(where, params, "latest.rollout_id", rollout_from, rollout_to)
        _eq(where, params, "d.stage", stage)
        if min_abs_err is not None:
            where.append("d.abs_err >= ?")
            params.append(float(min_abs_err))
        _eq(where, params, "d.sample_id", sample_id)
        sql = (
            "SELECT latest.run, latest.kind, latest.rollout_id, latest.step_id, "
            "latest.attempt, latest.bundle_key, latest.trajstore_version, latest.recorded_at, "
            f"d.* FROM divergences AS d JOIN ({latest_sql}) AS latest "
            "ON latest.result_id = d.result_id"
            + (f" WHERE {' AND '.join(where)}" if where else "")
            + " ORDER BY latest.run, latest.rollout_id, coalesce(latest.step_id, -1), "
            "d.result_id, d.position"
        )
        return self._rows(sql + _limit(params, limit), params)

    def router_metrics(
        self,
        run: str | None = None,
        rollout_from: int | None = None,
        rollout_to: int | None = None,
        source: str | None = None,
        limit: int | None = None,
    ) -> list[dict]:
        """As query_router_metrics, every page."""
        params: list = []
        where = ["b.is_latest"]
        _range(where, params, "m.rollout_id", rollout_from, rollout_to)
        _eq(where, params, "m.run", run)
        _eq(where, params, "m.source", source)
        sql = (
            "SELECT m.*, lineage.mode, b.rank, b.attempt FROM router_metrics AS m "
            "JOIN bundles AS b ON b.key = m.bundle_key "
            "LEFT OUTER JOIN router_lineage AS lineage ON lineage.bundle_key = m.bundle_key "
            f"WHERE {' AND '.join(where)} "
            "ORDER BY m.run, m.rollout_id, coalesce(m.step_id, -1), m.id"
        )
        return self._rows(sql + _limit(params, limit), params)

    def _named(self, sql: str, params: dict) -> list[dict]:
        """trajstore.mismatch.query's `execute`: its statement with DuckDB's marks."""
        from trajstore.mismatch.query import duckdb_sql

        return self._rows(duckdb_sql(sql), params)

    def mismatch(self, q: Any, limit: int | None = None) -> list[dict]:
        """As query_mismatch, every page."""
        from trajstore.mismatch.query import steps

        return steps(self._named, q, limit)

    def mismatch_layers(self, q: Any) -> list[dict]:
        """As query_mismatch_layers."""
        from trajstore.mismatch.query import layers

        return layers(self._named, q)

    def readonly_sql(
        self, sql: str, *, max_rows: int = MAX_SQL_ROWS
    ) -> tuple[list[str], list[list]]:
        """As run_readonly_sql."""
        check_readonly(sql)
        return readonly_sql_duckdb(self.con, sql, max_rows)


_STEP_IDENTITY = ("run", "rollout_id", "step_id", "attempt")
#: the columns of a query_steps item before ranks and bundle_keys: (name, expression)
_STEP_PAGE_COLUMNS = [
    *((name, f"steps.{name}") for name in _STEP_IDENTITY),
    *((name, f"steps.{name}") for name in ("num_bundles", "num_samples", "num_tokens")),
    ("published_at", "steps.published_at"),
    ("result_id", "latest.result_id"),
    ("result_bundle_key", "latest.bundle_key AS result_bundle_key"),
    *(
        (name, f"latest.{name}")
        for name in (
            "status",
            "first_divergent_stage",
            "first_divergent_rank",
            "root_bundle_key",
            "recorded_at",
            "trajstore_version",
        )
    ),
]


def _eq(where: list[str], params: list, column: str, value: Any) -> None:
    if value is not None:
        where.append(f"{column} = ?")
        params.append(value)


def _range(where: list[str], params: list, column: str, lo: int | None, hi: int | None) -> None:
    check_rollout_range(lo, hi)
    if lo is not None:
        where.append(f"{column} >= ?")
        params.append(lo)
    if hi is not None:
        where.append(f"{column} <= ?")
        params.append(hi)


def _limit(params: list, limit: int | None) -> str:
    """A LIMIT clause; none for a limit no table can reach (past BIGINT, which the
    database refuses), as the paged reader treats it."""
    if isinstance(limit, bool) or (limit is not None and not isinstance(limit, int)):
        raise UsageError(f"limit must be an integer >= 1, got {limit!r}")
    if limit is not None and limit < 1:
        raise UsageError(f"limit must be an integer >= 1, got {limit}")
    if limit is None or limit > BIGINT_MAX:
        return ""
    params.append(int(limit))
    return " LIMIT ?"


def _latest_results_sql(params: list, run: str | None, kind: str | None) -> str:
    """queries._latest_results: per cohort of latest bundles, its newest result (a whole
    replay's before a partial one's: queries.whole_first)."""
    where = ["rb.is_latest"]
    _eq(where, params, "rb.kind", kind)
    _eq(where, params, "rb.run", run)
    return (
        "SELECT * FROM (SELECT rb.run, rb.kind, rb.rollout_id, rb.step_id, rb.attempt, "
        "r.id AS result_id, r.bundle_key, r.status, r.first_divergent_stage, "
        "r.first_divergent_rank, r.root_bundle_key, r.recorded_at, r.trajstore_version, "
        "row_number() OVER (PARTITION BY rb.run, rb.kind, rb.rollout_id, rb.step_id, "
        "rb.attempt ORDER BY (r.selection IS NOT NULL), r.recorded_at DESC NULLS LAST, "
        "r.id DESC) AS rn "
        "FROM replay_results AS r JOIN bundles AS rb ON rb.key = r.bundle_key "
        f"WHERE {' AND '.join(where)}) AS ranked WHERE ranked.rn = 1"
    )
