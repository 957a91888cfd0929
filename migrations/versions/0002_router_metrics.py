"""Router consistency metrics (router-metrics.md) and the replay selection.

Adds the router_metrics table and replay_results.selection. Both are derived
from documents that are already indexed, so the upgrade forgets which
documents were synced: the next sync re-applies every ref and result
(applying is idempotent) and so backfills the new columns.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(sa.schema.CreateSequence(sa.Sequence("router_metrics_id_seq")))
    op.create_table(
        "router_metrics",
        sa.Column(
            "id",
            sa.BigInteger,
            primary_key=True,
            server_default=sa.text("nextval('router_metrics_id_seq')"),
        ),
        sa.Column("source", sa.String, nullable=False),
        sa.Column("bundle_key", sa.String, nullable=False),
        sa.Column("result_id", sa.BigInteger),
        sa.Column("run", sa.String),
        sa.Column("rollout_id", sa.BigInteger),
        sa.Column("step_id", sa.BigInteger),
        sa.Column("valid_tokens", sa.BigInteger),
        sa.Column("valid_token_layers", sa.BigInteger),
        sa.Column("route_mismatch_rate", sa.Double),
        sa.Column("expert_slot_mismatch", sa.Double),
        sa.Column("token_any_mismatch", sa.Double),
        sa.Column("per_layer_mismatch", sa.Text),
        sa.Column("f_tau_2", sa.Double),
        sa.Column("kl_k1", sa.Double),
        sa.Column("kl_k3", sa.Double),
        sa.Column("logprob_abs_diff", sa.Double),
        sa.Column("metric_error", sa.Text),
    )
    op.create_index("ix_router_metrics_step", "router_metrics", ["run", "rollout_id", "step_id"])
    op.create_index("ix_router_metrics_bundle", "router_metrics", ["bundle_key"])
    op.add_column("replay_results", sa.Column("selection", sa.Text))
    op.execute("DELETE FROM synced_documents")


def downgrade() -> None:
    op.drop_column("replay_results", "selection")
    op.drop_index("ix_router_metrics_bundle", "router_metrics")
    op.drop_index("ix_router_metrics_step", "router_metrics")
    op.drop_table("router_metrics")
    op.execute(sa.schema.DropSequence(sa.Sequence("router_metrics_id_seq")))
