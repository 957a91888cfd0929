"""Alembic environment for the trajstore catalog.

Run programmatically by trajstore.catalog.db (which passes an open connection
in ``config.attributes["connection"]``); also usable from the alembic CLI with
``-x url=duckdb:///path/catalog.duckdb``. Revisions are hand-written:
duckdb-engine does not reflect indexes, so autogenerate would be wrong.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context
from alembic.ddl.impl import DefaultImpl


class DuckDBImpl(DefaultImpl):
    """Alembic has no DuckDB dialect implementation; the default one works."""

    __dialect__ = "duckdb"
    transactional_ddl = True


config = context.config
connection = config.attributes.get("connection")

if connection is None:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option(
        "sqlalchemy.url"
    )
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        context.configure(connection=conn, target_metadata=None)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()
else:
    context.configure(connection=connection, target_metadata=None)
    with context.begin_transaction():
        context.run_migrations()
