"""Incremental sync state for server catalogs (docs/catalog.md "Server catalogs").

Adds sync_state: per document directory, the newest name a listing sync has
seen (`high_water`) and a count of applied documents (`applied`, a change
counter for pollers). Plain DDL that DuckDB and PostgreSQL both run. A catalog
upgraded to 0003 starts with no high-water mark, so its first incremental sync
lists everything once (skipping what synced_documents already holds).

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

DIRECTORIES = ("bundles", "tombstones", "results")


def upgrade() -> None:
    table = op.create_table(
        "sync_state",
        sa.Column("directory", sa.String, primary_key=True),
        sa.Column("high_water", sa.String),
        sa.Column("applied", sa.BigInteger, nullable=False),
    )
    op.bulk_insert(table, [{"directory": d, "high_water": None, "applied": 0} for d in DIRECTORIES])


def downgrade() -> None:
    op.drop_table("sync_state")
