"""The listing a local catalog was last synced from, so readers can skip a no-op sync.

Adds sync_state.listing: per document directory, JSON text describing the last full
listing whose documents were all applied (a digest of the sorted names, their count,
and the directory's stat). A reader of the store's DuckDB file that finds the same
listing skips the sync (docs/catalog.md "Skipping the sync"). Null until the next
sync, so a catalog upgraded to 0004 syncs as before once.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("sync_state", sa.Column("listing", sa.Text))


def downgrade() -> None:
    op.drop_column("sync_state", "listing")
