"""The PostgreSQL server the catalog tests run against, and a fresh schema per test.

The URL comes from TRAJSTORE_TEST_POSTGRES_URL (default: the trust-auth server on
127.0.0.1:5432, database `test`). Each test gets its own schema (a random name,
put first on the connection's search_path) and drops it afterwards, so tests never
see each other's rows and a re-run starts clean. Where no server answers, the
tests skip with one visible line, except when CI is set: then they fail.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

import pytest
import sqlalchemy as sa

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def server_url() -> str:
    return os.environ.get("TRAJSTORE_TEST_POSTGRES_URL") or DEFAULT_URL


@lru_cache(maxsize=1)
def _unreachable() -> str | None:
    """Why the server cannot be used (None when it can); asked once per session."""
    url = server_url()
    engine = sa.create_engine(url, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except Exception as exc:  # any failure to reach it: the reason is the message
        shown = sa.engine.make_url(url).render_as_string(hide_password=True)
        return f"PostgreSQL not reachable at {shown}: {str(exc).splitlines()[0]}"
    finally:
        engine.dispose()
    return None


def require_server() -> None:
    """Skip (its reason is the one line pytest -rs prints) or, with CI set, fail when the
    server is unreachable."""
    reason = _unreachable()
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: the PostgreSQL tests must run)")
    pytest.skip(reason)


def schema_url(schema: str) -> str:
    """The server URL with `schema` first on the search_path (libpq `options`)."""
    url = sa.engine.make_url(server_url())
    return url.update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
        hide_password=False
    )


@contextmanager
def fresh_schema() -> Iterator[str]:
    """A new empty schema's URL; the schema is dropped afterwards."""
    require_server()
    schema = f"trajstore_test_{uuid.uuid4().hex[:12]}"
    engine = sa.create_engine(server_url())
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
        yield schema_url(schema)
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        engine.dispose()
