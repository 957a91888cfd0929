"""The shared catalog statements on PostgreSQL, both ways they are run.

tests/test_catalog_direct.py checks the two executors of trajstore.catalog.statements on
a DuckDB file (the CLI's whole listings through the `duckdb` module, REST's pages through
SQLAlchemy). Here the same store is synced into a PostgreSQL schema and each listing is
run whole through the server's own driver (psycopg, no SQLAlchemy on the statement) and
page by page through SQLAlchemy; both must equal each other and, value for value, what
the DuckDB reader answers for the same store: another database engine is the oracle for
the statement's portability (a NUMERIC sum, a NULL ordered differently, a cursor of the
wrong type would show).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import test_catalog_direct as on_duckdb
from pg_server import fresh_schema

from trajstore.catalog import open_catalog, sync_catalog
from trajstore.catalog.direct import DirectCatalog, jsonable
from trajstore.catalog.listings import Listings
from trajstore.catalog.statements import STEP_SORTS
from trajstore.cli._catalog import PagedReader

pytestmark = pytest.mark.integration


class DriverListings(Listings):
    """The whole listings run on a PostgreSQL connection of the driver itself: the
    statement's ``:pN`` marks written as psycopg's ``%(pN)s``."""

    dialect = "postgresql"

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def execute(self, sql: str, params: dict, setup: tuple[str, ...] = ()) -> list[dict]:
        import re

        cur = self.raw.cursor()
        try:
            for statement in setup:
                cur.execute(statement)
            cur.execute(re.sub(r"(?<![:\w]):(p\d+)\b", r"%(\1)s", sql), params)
            names = [d[0] for d in cur.description]
            return [{n: jsonable(n, v) for n, v in zip(names, row, strict=True)} for row in cur]
        finally:
            cur.close()
            self.raw.rollback()


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """One store, its catalog synced into its DuckDB file and into a PostgreSQL schema."""
    root = tmp_path_factory.mktemp("direct-pg") / "store"
    docs = on_duckdb.build_store(root)
    with open_catalog(root) as cat:
        sync_catalog(cat, root, docs.__getitem__)
    with fresh_schema() as url:
        with open_catalog(None, url) as cat:
            sync_catalog(cat, root, docs.__getitem__)
        yield root, url


SORTED = [("steps", {"sort": sort, "limit": 1003}) for sort in STEP_SORTS] + [
    ("steps", {"sort": "-tokens", "first_divergent_stage": "advantage.estimate"}),
    ("steps", {"sort": "status", "status": "diverged", "rollout_from": 7}),
]
CASES = on_duckdb.CASES + SORTED


@contextlib.contextmanager
def readers(
    stores: tuple[Path, str],
) -> Iterator[tuple[PagedReader, DriverListings, DirectCatalog]]:
    """The three readers compared: paged through SQLAlchemy and whole through psycopg on
    PostgreSQL, and DuckDB's direct reader of the same store."""
    root, url = stores
    with open_catalog(None, url) as cat:
        raw = cat.engine.raw_connection()
        try:
            with DirectCatalog.open(root) as direct:
                yield PagedReader(cat), DriverListings(raw.driver_connection), direct
        finally:
            raw.close()


@pytest.mark.parametrize(("method", "kw"), CASES, ids=[f"{m}-{kw}" for m, kw in CASES])
def test_both_executors_answer_as_the_duckdb_reader(
    stores: tuple[Path, str], method: str, kw: dict
) -> None:
    with readers(stores) as (paged_reader, driver, direct):
        paged = getattr(paged_reader, method)(**kw)
        whole = getattr(driver, method)(**kw)
        duckdb = getattr(direct, method)(**kw)
    shown = [json.dumps(rows, sort_keys=True) for rows in (whole, paged, duckdb)]
    assert shown[0] == shown[1] == shown[2]


COUNTED = [(method, kw) for method, kw in CASES if "limit" not in kw]


@pytest.mark.parametrize(("method", "kw"), COUNTED, ids=[f"{m}-{kw}" for m, kw in COUNTED])
def test_both_executors_count_as_the_duckdb_reader(
    stores: tuple[Path, str], method: str, kw: dict
) -> None:
    # the count of a cut `ls`/`query` table (its listing's statement counted)
    with readers(stores) as (paged_reader, driver, direct):
        paged = paged_reader.count(method, **kw)
        whole = driver.count(method, **kw)
        rows = getattr(direct, method)(**kw)
        duckdb = direct.count(method, **kw)
    assert whole == paged == duckdb == len(rows)
