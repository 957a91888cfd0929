"""Opening the catalog: lock retry, migrations, in-memory snapshots.

DuckDB lets one process hold a database file. Every process that needs the
catalog therefore holds it briefly (open -> sync -> work -> close) and retries
the lock with backoff; writers of refs and results never touch it. A
long-running reader (the REST server) takes an in-memory snapshot once and
then syncs new documents into the snapshot itself, never holding the file.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy as sa

from trajstore.catalog.direct import CATALOG_FILE, damage_guard
from trajstore.catalog.direct import is_lock_error as _is_lock_error  # noqa: F401
from trajstore.catalog.direct import retry_lock as _retry_lock
from trajstore.catalog.stillborn import drop_stillborn_duckdb
from trajstore.catalog.tables import HEAD_REVISION, KNOWN_REVISIONS
from trajstore.errors import StoreError, UsageError

# duckdb_engine's own entry point, named directly: resolving it through the installed
# distributions' entry points (importlib.metadata) costs tens of ms on every process start.
sa.dialects.registry.register("duckdb", "duckdb_engine", "Dialect")

DEFAULT_LOCK_TIMEOUT = 30.0


def catalog_url(store_dir: Path | str | None, url: str | None = None) -> str:
    """The SQLAlchemy URL of a store's catalog (an explicit url wins)."""
    if url:
        return url
    if store_dir is None:
        raise UsageError("no catalog: pass a store directory (--store) or a catalog URL")
    return f"duckdb:///{Path(store_dir).resolve() / CATALOG_FILE}"


#: the PostgreSQL advisory lock migrations take (pg_advisory_xact_lock)
MIGRATION_LOCK_ID = 0x7472616B  # "trak"
#: the databases a catalog may live in (their dialects are the ones migrations are written for)
CATALOG_BACKENDS = ("duckdb", "postgresql")
#: how the messages show a catalog URL of each backend (DuckDB's absolute form: four slashes)
_URL_EXAMPLES = "postgresql+psycopg://user@host:5432/db or duckdb:////abs/path/catalog.duckdb"
#: how long a connection to a server catalog may take before the command fails
CONNECT_TIMEOUT_S = 10


def parse_url(url: str) -> sa.engine.URL:
    """A catalog URL, parsed; a malformed one is one line naming it."""
    try:
        parsed = sa.engine.make_url(url)
    except sa.exc.ArgumentError:
        raise StoreError(
            f"catalog URL {url!r} is not a database URL (e.g. {_URL_EXAMPLES})"
        ) from None
    backend = parsed.get_backend_name()
    if backend not in CATALOG_BACKENDS:
        # the migrations and queries are written for these two; another dialect fails
        # half-way through a migration, not with a message
        raise StoreError(f"catalog backend {backend!r} is not supported (use {_URL_EXAMPLES})")
    return parsed


def shown_url(url: sa.engine.URL | str) -> str:
    """The URL as messages show it: the password masked."""
    if isinstance(url, str):
        url = parse_url(url)
    return url.render_as_string(hide_password=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _engine_options(url: sa.engine.URL) -> dict:
    """Engine options per backend: a bounded connect time on a server, so that an
    unreachable host fails the command in seconds instead of hanging it."""
    if url.get_backend_name() == "postgresql" and "connect_timeout" not in url.query:
        return {"connect_args": {"connect_timeout": CONNECT_TIMEOUT_S}}
    return {}


def _duckdb_file(url: sa.engine.URL) -> str | None:
    """The database file of a DuckDB URL; None for other backends and :memory:."""
    if url.get_backend_name() != "duckdb":
        return None
    db = url.database or ":memory:"
    return None if db.startswith(":memory:") else db


class Catalog:
    """An open catalog. Holds its DuckDB file (if any) until close().

    `engine` and `connect()` re-take the file lock (with retry) if
    snapshot_in_memory() released it.
    """

    def __init__(
        self,
        url: str,
        *,
        store_dir: Path | None = None,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    ) -> None:
        self.url = url
        self.store_dir = Path(store_dir) if store_dir is not None else None
        self.lock_timeout = lock_timeout
        self._sa_url = parse_url(url)
        self.shown_url = shown_url(self._sa_url)
        self.file = _duckdb_file(self._sa_url)
        self._engine: sa.Engine | None = None
        self._keeper = None  # a checked-out DBAPI connection: holds the file / memory db
        self._closed = False

    # -- lifetime ---------------------------------------------------------
    @property
    def is_duckdb(self) -> bool:
        return self._sa_url.get_backend_name() == "duckdb"

    @property
    def engine(self) -> sa.Engine:
        self._ensure_open()
        assert self._engine is not None
        return self._engine

    def _ensure_open(self) -> None:
        if self._closed:
            raise StoreError(f"catalog {self.shown_url} is closed")
        if self._engine is not None:
            return
        try:
            engine = sa.create_engine(self._sa_url, **_engine_options(self._sa_url))
        except (ImportError, sa.exc.ArgumentError) as exc:
            raise StoreError(f"cannot use catalog {self.shown_url}: {_first_line(exc)}") from None
        try:
            self._keeper = _retry_lock(
                engine.raw_connection, self.file or self.shown_url, self.lock_timeout
            )
        except Exception as exc:  # the driver's own error (psycopg.OperationalError, ...)
            engine.dispose()
            if not self.is_duckdb:
                reason = _first_line(getattr(exc, "orig", None) or exc)
                raise StoreError(f"cannot connect to catalog {self.shown_url}: {reason}") from None
            raise
        except BaseException:
            engine.dispose()
            raise
        self._engine = engine

    def _release(self) -> None:
        if self._keeper is not None:
            with contextlib.suppress(Exception):
                self._keeper.close()
            self._keeper = None
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    def close(self) -> None:
        """Release the catalog (and with it DuckDB's file lock)."""
        self._release()
        self._closed = True

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- use --------------------------------------------------------------
    @contextlib.contextmanager
    def connect(self) -> Iterator[sa.Connection]:
        """A connection; commit explicitly or use begin() for a transaction. A damaged
        DuckDB file met by anything done with it is one CatalogDamagedError."""
        with damage_guard(self.file), self.engine.connect() as conn:
            yield conn

    @contextlib.contextmanager
    def begin(self) -> Iterator[sa.Connection]:
        """A connection inside one transaction, committed on success."""
        with damage_guard(self.file), self.engine.begin() as conn:
            yield conn

    def revision(self) -> str | None:
        """The catalog's Alembic revision (None for an empty database)."""
        with self.connect() as conn:
            return _current_revision(conn)

    def snapshot_in_memory(self) -> Catalog:
        """Copy this DuckDB file catalog into a private in-memory DuckDB.

        Releases this catalog's file lock (it is re-taken on next use) so the
        copy can attach the file read-only; the snapshot never holds the file.
        Keep it current with sync_catalog(snapshot, store_dir, ...).
        """
        if not self.is_duckdb or self.file is None:
            raise UsageError(
                "an in-memory snapshot needs a DuckDB file catalog; a server catalog on "
                "another backend can be used directly"
            )
        self._release()
        snap = Catalog(
            f"duckdb:///:memory:trajstore-snapshot-{uuid.uuid4().hex}",
            store_dir=self.store_dir,
            lock_timeout=self.lock_timeout,
        )
        snap._ensure_open()
        raw = snap._keeper.driver_connection
        path = self.file.replace("'", "''")

        def attach():
            raw.execute(f"ATTACH '{path}' AS trajstore_src (READ_ONLY)")

        with damage_guard(self.file):
            _retry_lock(attach, self.file, self.lock_timeout)
            try:
                raw.execute("COPY FROM DATABASE trajstore_src TO memory")
            finally:
                raw.execute("DETACH trajstore_src")
        return snap


def _current_revision(conn: sa.Connection) -> str | None:
    if conn.dialect.name == "duckdb":
        # one catalog query instead of the reflection machinery behind inspect().has_table
        found = conn.exec_driver_sql(
            "SELECT 1 FROM duckdb_tables() WHERE database_name = current_database() "
            "AND schema_name = current_schema() AND table_name = 'alembic_version'"
        ).first()
        if found is None:
            return None
    elif not sa.inspect(conn).has_table("alembic_version"):
        return None
    return conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar()


def migrations_dir() -> Path:
    """The installed `trajstore.migrations` package's directory (found by import, not by cwd)."""
    from trajstore import migrations

    path = Path(migrations.__file__).resolve().parent
    if not (path / "env.py").is_file():
        raise StoreError(f"trajstore installation is broken: {path}/env.py is missing; reinstall")
    return path


def migrate(engine: sa.Engine, revision: str = "head") -> None:
    """Run the hand-written Alembic revisions up to `revision` on `engine`."""
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # processes on many hosts may open a new server catalog at once: one migrates,
            # the others wait here and then find it at the head (DDL is transactional)
            conn.execute(sa.select(sa.func.pg_advisory_xact_lock(MIGRATION_LOCK_ID)))
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def open_catalog(
    store_dir: Path | str | None,
    url: str | None = None,
    *,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
) -> Catalog:
    """Open (creating or upgrading as needed) the catalog of a store.

    Refuses a catalog written by a newer trajstore. The caller should close()
    it promptly (or use it as a context manager): a DuckDB file admits one
    process at a time.
    """
    catalog = Catalog(
        catalog_url(store_dir, url),
        store_dir=Path(store_dir) if store_dir is not None else None,
        lock_timeout=lock_timeout,
    )
    try:
        if catalog.file is not None:
            Path(catalog.file).parent.mkdir(parents=True, exist_ok=True)
            drop_stillborn_duckdb(Path(catalog.file))
        with damage_guard(catalog.file):  # the file's first read is here, or in a migration
            current = catalog.revision()
            if current is not None and current not in KNOWN_REVISIONS:
                raise StoreError(
                    f"catalog is at revision {current}, newer than this trajstore "
                    f"({HEAD_REVISION}); upgrade trajstore"
                )
            if current != HEAD_REVISION:
                migrate(catalog.engine, "head")
    except BaseException:
        catalog.close()
        raise
    return catalog
