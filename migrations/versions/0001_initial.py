"""Initial catalog: runs, bundles, samples, provenance, payloads, router lineage,
tombstones, replay results, stage results, divergences, synced documents.

Revision ID: 0001
Revises:

Frozen: released catalogs were built by this DDL, so it is never edited; a
schema change is a new revision. The head schema is also declared in
trajstore/catalog/tables.py; tests/test_catalog.py::
test_migrations_build_exactly_the_declared_tables checks that all migrations
together build exactly those tables.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("run", sa.String, primary_key=True),
        sa.Column("first_published_at", sa.DateTime),
    )
    op.create_table(
        "bundles",
        sa.Column("key", sa.String, primary_key=True),
        sa.Column("run", sa.String, nullable=False),
        sa.Column("kind", sa.String, nullable=False),
        sa.Column("bundle_id", sa.String),
        sa.Column("rollout_id", sa.BigInteger, nullable=False),
        sa.Column("step_id", sa.BigInteger),
        sa.Column("rank", sa.Integer),
        sa.Column("cohort_ranks", sa.Text),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("is_latest", sa.Boolean, nullable=False),
        sa.Column("removed_at", sa.DateTime),
        sa.Column("format_version", sa.String),
        sa.Column("producer_commit", sa.String),
        sa.Column("producer_torch_version", sa.String),
        sa.Column("content_digest", sa.String),
        sa.Column("num_samples", sa.Integer),
        sa.Column("num_tokens", sa.BigInteger),
        sa.Column("num_response_tokens", sa.BigInteger),
        sa.Column("logical_bytes", sa.BigInteger),
        sa.Column("physical_bytes", sa.BigInteger),
        sa.Column("rollout_weight", sa.String),
        sa.Column("actor_weight", sa.String),
        sa.Column("dp_size", sa.Integer),
        sa.Column("tp_size", sa.Integer),
        sa.Column("pp_size", sa.Integer),
        sa.Column("cp_size", sa.Integer),
        sa.Column("manifest_hash", sa.String),
        sa.Column("index_hash", sa.String),
        sa.Column("expected_hash", sa.String),
        sa.Column("published_at", sa.DateTime),
        sa.Column("ref_name", sa.String, nullable=False),
    )
    op.create_index("ix_bundles_step", "bundles", ["run", "rollout_id", "step_id"])
    op.create_table(
        "samples",
        sa.Column("bundle_key", sa.String, primary_key=True),
        sa.Column("position", sa.Integer, primary_key=True),
        sa.Column("sample_id", sa.String, nullable=False),
        sa.Column("group_index", sa.Integer),
        sa.Column("semantic_group", sa.String),
        sa.Column("normalization_cohort", sa.String),
        sa.Column("micro_batch_id", sa.String),
        sa.Column("rank", sa.Integer),
        sa.Column("response_length", sa.Integer),
        sa.Column("total_length", sa.Integer),
        sa.Column("reward", sa.Double),
        sa.Column("raw_reward", sa.Double),
        sa.Column("masked_tokens", sa.Integer),
        sa.Column("label_hash", sa.String),
    )
    op.create_table(
        "provenance",
        sa.Column("bundle_key", sa.String, primary_key=True),
        sa.Column("kind", sa.String, primary_key=True),
        sa.Column("position", sa.Integer, primary_key=True),
        sa.Column("value", sa.String, nullable=False),
    )
    op.create_index("ix_provenance_value", "provenance", ["kind", "value"])
    op.create_table(
        "payloads",
        sa.Column("bundle_key", sa.String, primary_key=True),
        sa.Column("name", sa.String, primary_key=True),
        sa.Column("dtype", sa.String),
        sa.Column("shape", sa.Text),
        sa.Column("logical_bytes", sa.BigInteger),
        sa.Column("record", sa.String),
    )
    op.create_table(
        "router_lineage",
        sa.Column("bundle_key", sa.String, primary_key=True),
        sa.Column("num_layers", sa.Integer),
        sa.Column("top_k", sa.Integer),
        sa.Column("num_experts", sa.Integer),
        sa.Column("mode", sa.String),
        sa.Column("rollout_engine", sa.String),
        sa.Column("train_engine", sa.String),
        sa.Column("rollout_weight", sa.String),
        sa.Column("train_weight", sa.String),
    )
    op.create_table(
        "tombstones",
        sa.Column("tombstone_name", sa.String, primary_key=True),
        sa.Column("bundle_key", sa.String, nullable=False),
        sa.Column("removed_at", sa.DateTime),
    )
    op.create_index("ix_tombstones_key", "tombstones", ["bundle_key"])
    op.execute(sa.schema.CreateSequence(sa.Sequence("replay_results_id_seq")))
    op.create_table(
        "replay_results",
        sa.Column(
            "id",
            sa.BigInteger,
            primary_key=True,
            server_default=sa.text("nextval('replay_results_id_seq')"),
        ),
        sa.Column("result_name", sa.String, nullable=False, unique=True),
        sa.Column("bundle_key", sa.String, nullable=False),
        sa.Column("run", sa.String),
        sa.Column("rollout_id", sa.BigInteger),
        sa.Column("step_id", sa.BigInteger),
        sa.Column("trajstore_version", sa.String),
        sa.Column("recorded_at", sa.DateTime),
        sa.Column("status", sa.String),
        sa.Column("first_divergent_stage", sa.String),
        sa.Column("first_divergent_rank", sa.Integer),
        sa.Column("root_bundle_key", sa.String),
    )
    op.create_index(
        "ix_replay_results_bundle", "replay_results", ["bundle_key", "trajstore_version"]
    )
    op.create_index("ix_replay_results_stage", "replay_results", ["first_divergent_stage"])
    op.create_index("ix_replay_results_step", "replay_results", ["run", "rollout_id", "step_id"])
    op.create_table(
        "stage_results",
        sa.Column("result_id", sa.BigInteger, primary_key=True),
        sa.Column("position", sa.Integer, primary_key=True),
        sa.Column("stage", sa.String, nullable=False),
        sa.Column("status", sa.String),
        sa.Column("reason", sa.Text),
        sa.Column("max_abs_error", sa.Double),
        sa.Column("mismatch_count", sa.BigInteger),
        sa.Column("first_sample", sa.String),
        sa.Column("first_field", sa.String),
        sa.Column("first_token", sa.BigInteger),
    )
    op.create_table(
        "divergences",
        sa.Column("result_id", sa.BigInteger, primary_key=True),
        sa.Column("position", sa.Integer, primary_key=True),
        sa.Column("stage", sa.String, nullable=False),
        sa.Column("sample_id", sa.String),
        sa.Column("field", sa.String),
        sa.Column("token_offset", sa.BigInteger),
        sa.Column("expected", sa.Double),
        sa.Column("actual", sa.Double),
        sa.Column("abs_err", sa.Double),
    )
    op.create_index("ix_divergences_stage", "divergences", ["stage"])
    op.create_table(
        "synced_documents",
        sa.Column("directory", sa.String, primary_key=True),
        sa.Column("name", sa.String, primary_key=True),
    )


def downgrade() -> None:
    for table in (
        "synced_documents",
        "divergences",
        "stage_results",
        "replay_results",
        "tombstones",
        "router_lineage",
        "payloads",
        "provenance",
        "samples",
        "bundles",
        "runs",
    ):
        op.drop_table(table)
    op.execute(sa.schema.DropSequence(sa.Sequence("replay_results_id_seq")))
