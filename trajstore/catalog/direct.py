"""The store's DuckDB catalog read straight through the `duckdb` module (ls, query, sql).

Why: SQLAlchemy + duckdb_engine cost about 0.6 s to import on a loaded 2-core box and
their per-row result handling about 20 us a row, several times the whole budget of a
command that lists 10,000 steps. This module imports neither. `DirectCatalog` executes
the statements every reader shares (trajstore.catalog.statements, run whole by
trajstore.catalog.listings.Listings); REST runs the same ones a page at a time through
SQLAlchemy (trajstore.catalog.queries).

It also holds what both readers share without SQLAlchemy: the JSON form of a catalog
value, the read-only SQL check, DuckDB's lock retry, and the *listing* record that lets a
reader skip a no-op sync (`listing_record`, `listing_unchanged`; docs/catalog.md).
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from trajstore.catalog.listings import Listings
from trajstore.catalog.revisions import HEAD_REVISION, KNOWN_REVISIONS
from trajstore.catalog.statements import duckdb_sql
from trajstore.errors import (
    CatalogDamagedError,
    StoreError,
    TrajstoreError,
    UsageError,
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
        {
            "names": len(names),
            "digest": _digest(names),
            "stat": stat,
            "listed_ns": listed_ns,
            "last": max(names) if names else None,
        },
        sort_keys=True,
    )


def accounted_last(recorded: str | None, names: list[str]) -> str | None:
    """The greatest name of the recorded listing when the sorted `names` that are <= it
    are exactly that listing (same count and digest): then only names after it can be
    new to the catalog. None (compare in full): no record, an old record without
    `last`, a late document with an older name, a removed one, any mismatch."""
    if not recorded:
        return None
    try:
        rec = json.loads(recorded)
        last, count, digest = rec["last"], rec["names"], rec["digest"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(last, str) or not isinstance(count, int) or count <= 0:
        return None
    older = bisect.bisect_right(names, last)
    if older != count or _digest(names[:older]) != digest:
        return None
    return last


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


class DirectCatalog(Listings):
    """A store's DuckDB catalog file held open through the `duckdb` module; its listings
    (Listings: bundles, steps, divergences, ...) are the shared statements run whole."""

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

    def execute(self, sql: str, params: dict, setup: tuple[str, ...] = ()) -> list[dict]:
        """Rows of a shared statement (``:pN`` marks) as dicts of JSON values, as
        queries.execute's. Converted per column type: text, numbers and booleans pass as
        is (jsonable returns them unchanged), a naive TIMESTAMP becomes its isoformat +
        "Z", the rest goes through jsonable. `setup` is for PostgreSQL: not run here."""
        cur = self.con.execute(duckdb_sql(sql), params)
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

    def readonly_sql(
        self, sql: str, *, max_rows: int = MAX_SQL_ROWS
    ) -> tuple[list[str], list[list]]:
        """As run_readonly_sql."""
        check_readonly(sql)
        return readonly_sql_duckdb(self.con, sql, max_rows)
