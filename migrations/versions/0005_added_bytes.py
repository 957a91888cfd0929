"""Bytes each bundle added to the object store (issue 29 item 10).

Adds bundles.added_bytes: the bytes of the objects a bundle's ingest stored, those
not held before (the ref's `added_bytes`). bundles.physical_bytes stays what it
always held, the bytes of every object the bundle references, shared ones
included, so summing it over a run counted shared objects once per bundle. Null
for a ref written before trajstore recorded it: "not recorded", never a guess.

The column is derived from the bundle refs, so the upgrade forgets which refs
were synced (and the bundles directory's high-water mark and listing): the next
sync re-applies every ref (applying is idempotent) and so backfills it. Plain
DDL that DuckDB and PostgreSQL both run.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("bundles", sa.Column("added_bytes", sa.BigInteger))
    op.execute("DELETE FROM synced_documents WHERE directory = 'bundles'")
    op.execute(
        "UPDATE sync_state SET high_water = NULL, listing = NULL WHERE directory = 'bundles'"
    )


def downgrade() -> None:
    # DuckDB drops no column of a table that has an index
    op.drop_index("ix_bundles_step", "bundles")
    op.drop_column("bundles", "added_bytes")
    op.create_index("ix_bundles_step", "bundles", ["run", "rollout_id", "step_id"])
