"""Training-inference mismatch per bundle (docs/mismatch.md).

Adds mismatch_metrics (one row per bundle ref: the sums the store computed when it
stored the bundle, ref key "mismatch") and mismatch_layers (route mismatches per MoE
layer). Both derive from the refs, so, as 0002 did, the upgrade forgets which documents
were synced: the next sync re-applies every ref (idempotent) and fills the new tables.
A ref stored before the sums existed gets a row whose metrics are null with the reason
"not_computed"; `trajstore reindex` computes those from the payloads.

The column list is written out here (not imported): a released migration is frozen.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

_PAIRS = ("old", "current", "train")
_PAIR_FIELDS = (
    ("n", sa.BigInteger),
    ("abs_dlogp_sum", sa.Double),
    ("abs_dlogp_max", sa.Double),
    ("abs_dp_sum", sa.Double),
    ("abs_dp_max", sa.Double),
    ("d_sum", sa.Double),
    ("k3_sum", sa.Double),
    ("mult_sum", sa.Double),
    ("pr_sum", sa.Double),
    ("pt_sum", sa.Double),
    ("pr2_sum", sa.Double),
    ("pt2_sum", sa.Double),
    ("prpt_sum", sa.Double),
    ("gt_0_1", sa.BigInteger),
    ("gt_0_5", sa.BigInteger),
    ("gt_ln2", sa.BigInteger),
    ("gt_1", sa.BigInteger),
    ("ratio_min", sa.Double),
    ("ratio_max", sa.Double),
    ("clip_c", sa.Double),
    ("clip_count", sa.BigInteger),
    ("error", sa.Text),
)
_ROUTE_FIELDS = (
    ("route_valid_tokens", sa.BigInteger),
    ("route_valid_token_layers", sa.BigInteger),
    ("route_mismatches", sa.BigInteger),
    ("route_missing_slots", sa.BigInteger),
    ("route_mismatched_tokens", sa.BigInteger),
    ("route_top_k", sa.BigInteger),
    ("route_error", sa.Text),
)


def upgrade() -> None:
    op.create_table(
        "mismatch_metrics",
        sa.Column("bundle_key", sa.String, primary_key=True),
        sa.Column("run", sa.String, nullable=False),
        sa.Column("kind", sa.String, nullable=False),
        sa.Column("rollout_id", sa.BigInteger, nullable=False),
        sa.Column("step_id", sa.BigInteger),
        *(sa.Column(f"{p}_{f}", t) for p in _PAIRS for f, t in _PAIR_FIELDS),
        *(sa.Column(f, t) for f, t in _ROUTE_FIELDS),
        sa.Column("worst", sa.Text),
        sa.Column("document", sa.String),
    )
    op.create_index(
        "ix_mismatch_metrics_step", "mismatch_metrics", ["run", "rollout_id", "step_id"]
    )
    op.create_table(
        "mismatch_layers",
        sa.Column("bundle_key", sa.String, primary_key=True),
        sa.Column("layer", sa.Integer, primary_key=True),
        sa.Column("mismatches", sa.BigInteger, nullable=False),
        sa.Column("observations", sa.BigInteger, nullable=False),
    )
    op.execute("DELETE FROM synced_documents")
    # the listing a reader compares to skip a sync: forgotten with the documents
    op.execute("UPDATE sync_state SET high_water = NULL, listing = NULL")


def downgrade() -> None:
    op.drop_table("mismatch_layers")
    op.drop_index("ix_mismatch_metrics_step", "mismatch_metrics")
    op.drop_table("mismatch_metrics")
