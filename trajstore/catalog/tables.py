"""Catalog schema at the head revision (SQLAlchemy Core).

The catalog is an index over the store's refs and result documents; every row
here can be rebuilt from them (`trajstore reindex`).

The schema is declared twice, on purpose: here (the head, what the code
queries) and in the hand-written migrations in `migrations/versions/` (how a
catalog of any earlier revision gets here). Released migrations are frozen,
never edited; a schema change is a new revision there plus the same change
here. tests/test_catalog.py::test_migrations_build_exactly_the_declared_tables
migrates an empty catalog to the head and asserts it has exactly these
tables' columns and indexes, so the two declarations cannot drift apart.

Conventions, so that SQL users and JSON consumers see one name per number:
timestamps are naive UTC; lists/objects are JSON text; no foreign keys
(DuckDB restricts updates of referenced rows), only indexes.
"""

from __future__ import annotations

import sqlalchemy as sa

# The revisions this code knows (the last one is the head) live in revisions.py, which
# the CLI's direct reader imports without SQLAlchemy.
from trajstore.catalog.revisions import HEAD_REVISION, KNOWN_REVISIONS  # noqa: E402, F401
from trajstore.mismatch.metrics import sum_columns as mismatch_sum_columns

metadata = sa.MetaData()

REPLAY_RESULTS_ID_SEQ = sa.Sequence("replay_results_id_seq", metadata=metadata)
ROUTER_METRICS_ID_SEQ = sa.Sequence("router_metrics_id_seq", metadata=metadata)

runs = sa.Table(
    "runs",
    metadata,
    sa.Column("run", sa.String, primary_key=True),
    sa.Column("first_published_at", sa.DateTime),
)

bundles = sa.Table(
    "bundles",
    metadata,
    sa.Column("key", sa.String, primary_key=True),
    sa.Column("run", sa.String, nullable=False),
    sa.Column("kind", sa.String, nullable=False),  # "step" | "rollout"
    sa.Column("bundle_id", sa.String),
    sa.Column("rollout_id", sa.BigInteger, nullable=False),
    sa.Column("step_id", sa.BigInteger),  # null for kind "rollout"
    sa.Column("rank", sa.Integer),  # null for a single-producer bundle
    sa.Column("cohort_ranks", sa.Text),  # JSON list of ints
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("is_latest", sa.Boolean, nullable=False),
    sa.Column("removed_at", sa.DateTime),  # set by a tombstone (trajstore rm)
    sa.Column("format_version", sa.String),
    sa.Column("producer_commit", sa.String),
    sa.Column("producer_torch_version", sa.String),
    sa.Column("content_digest", sa.String),
    sa.Column("num_samples", sa.Integer),
    sa.Column("num_tokens", sa.BigInteger),  # sum of total_length
    sa.Column("num_response_tokens", sa.BigInteger),  # sum of response_length
    sa.Column("logical_bytes", sa.BigInteger),
    sa.Column("physical_bytes", sa.BigInteger),  # bytes of every object it references
    sa.Column("added_bytes", sa.BigInteger),  # bytes its ingest stored (0005); null: not recorded
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
    sa.Index("ix_bundles_step", "run", "rollout_id", "step_id"),
)

samples = sa.Table(
    "samples",
    metadata,
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
    sa.Column("reward", sa.Double),  # null when the reward is per-token
    sa.Column("raw_reward", sa.Double),
    sa.Column("masked_tokens", sa.Integer),  # response tokens with loss_mask 0
    sa.Column("label_hash", sa.String),
)

provenance = sa.Table(
    "provenance",
    metadata,
    sa.Column("bundle_key", sa.String, primary_key=True),
    # rollout_partition | consumer_batch | micro_batch | semantic_group | normalization_cohort
    sa.Column("kind", sa.String, primary_key=True),
    sa.Column("position", sa.Integer, primary_key=True),
    sa.Column("value", sa.String, nullable=False),
    sa.Index("ix_provenance_value", "kind", "value"),
)

payloads = sa.Table(
    "payloads",
    metadata,
    sa.Column("bundle_key", sa.String, primary_key=True),
    sa.Column("name", sa.String, primary_key=True),
    sa.Column("dtype", sa.String),
    sa.Column("shape", sa.Text),  # JSON list of ints
    sa.Column("logical_bytes", sa.BigInteger),
    sa.Column("record", sa.String),  # object hash of the payload record
)

router_lineage = sa.Table(
    "router_lineage",
    metadata,
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

tombstones = sa.Table(
    "tombstones",
    metadata,
    sa.Column("tombstone_name", sa.String, primary_key=True),
    sa.Column("bundle_key", sa.String, nullable=False),
    sa.Column("removed_at", sa.DateTime),
    sa.Index("ix_tombstones_key", "bundle_key"),
)

replay_results = sa.Table(
    "replay_results",
    metadata,
    sa.Column(
        "id",
        sa.BigInteger,
        REPLAY_RESULTS_ID_SEQ,
        primary_key=True,
        server_default=REPLAY_RESULTS_ID_SEQ.next_value(),
    ),
    sa.Column("result_name", sa.String, nullable=False, unique=True),
    sa.Column("bundle_key", sa.String, nullable=False),
    sa.Column("run", sa.String),
    sa.Column("rollout_id", sa.BigInteger),
    sa.Column("step_id", sa.BigInteger),
    sa.Column("trajstore_version", sa.String),
    sa.Column("recorded_at", sa.DateTime),
    sa.Column("status", sa.String),  # pass | diverged | refused | unsupported
    sa.Column("first_divergent_stage", sa.String),
    sa.Column("first_divergent_rank", sa.Integer),
    sa.Column("root_bundle_key", sa.String),
    sa.Column("selection", sa.Text),  # JSON; added in 0002
    sa.Index("ix_replay_results_bundle", "bundle_key", "trajstore_version"),
    sa.Index("ix_replay_results_stage", "first_divergent_stage"),
    sa.Index("ix_replay_results_step", "run", "rollout_id", "step_id"),
)

stage_results = sa.Table(
    "stage_results",
    metadata,
    sa.Column("result_id", sa.BigInteger, primary_key=True),
    sa.Column("position", sa.Integer, primary_key=True),
    sa.Column("stage", sa.String, nullable=False),
    sa.Column("status", sa.String),  # pass | fail | skipped | unsupported
    sa.Column("reason", sa.Text),
    sa.Column("max_abs_error", sa.Double),
    sa.Column("mismatch_count", sa.BigInteger),
    sa.Column("first_sample", sa.String),
    sa.Column("first_field", sa.String),
    sa.Column("first_token", sa.BigInteger),
)

divergences = sa.Table(
    "divergences",
    metadata,
    sa.Column("result_id", sa.BigInteger, primary_key=True),
    sa.Column("position", sa.Integer, primary_key=True),
    sa.Column("stage", sa.String, nullable=False),
    sa.Column("sample_id", sa.String),
    sa.Column("field", sa.String),
    sa.Column("token_offset", sa.BigInteger),
    sa.Column("expected", sa.Double),
    sa.Column("actual", sa.Double),
    sa.Column("abs_err", sa.Double),
    sa.Index("ix_divergences_stage", "stage"),
)

# Added in 0002. One row per measurement: source "producer" (expected.json
# router.consistency of a bundle) or "replay" (router_metrics of a result).
ROUTER_METRIC_NAMES: tuple[str, ...] = (
    "valid_tokens",
    "valid_token_layers",
    "route_mismatch_rate",
    "expert_slot_mismatch",
    "token_any_mismatch",
    "per_layer_mismatch",
    "f_tau_2",
    "kl_k1",
    "kl_k3",
    "logprob_abs_diff",
)

router_metrics = sa.Table(
    "router_metrics",
    metadata,
    sa.Column(
        "id",
        sa.BigInteger,
        ROUTER_METRICS_ID_SEQ,
        primary_key=True,
        server_default=ROUTER_METRICS_ID_SEQ.next_value(),
    ),
    sa.Column("source", sa.String, nullable=False),  # producer | replay
    sa.Column("bundle_key", sa.String, nullable=False),
    sa.Column("result_id", sa.BigInteger),  # null for source "producer"
    sa.Column("run", sa.String),
    sa.Column("rollout_id", sa.BigInteger),
    sa.Column("step_id", sa.BigInteger),
    sa.Column("valid_tokens", sa.BigInteger),
    sa.Column("valid_token_layers", sa.BigInteger),
    sa.Column("route_mismatch_rate", sa.Double),
    sa.Column("expert_slot_mismatch", sa.Double),
    sa.Column("token_any_mismatch", sa.Double),
    sa.Column("per_layer_mismatch", sa.Text),  # JSON list of floats, length num_layers
    sa.Column("f_tau_2", sa.Double),
    sa.Column("kl_k1", sa.Double),
    sa.Column("kl_k3", sa.Double),
    sa.Column("logprob_abs_diff", sa.Double),
    sa.Column("metric_error", sa.Text),  # JSON list of codes; null when none
    sa.Index("ix_router_metrics_step", "run", "rollout_id", "step_id"),
    sa.Index("ix_router_metrics_bundle", "bundle_key"),
)

# Added in 0006. One row per bundle ref: the training-inference mismatch sums the store
# computed when it stored the bundle (ref key "mismatch", docs/mismatch.md); per-step
# values are derived from them by trajstore.mismatch.metrics. `worst`: JSON, per log-prob
# pair the few tokens of largest |d|; `document`: the digest of the per-sample document.
_SQL_TYPES = {"BIGINT": sa.BigInteger, "DOUBLE": sa.Double, "TEXT": sa.Text}

mismatch_metrics = sa.Table(
    "mismatch_metrics",
    metadata,
    sa.Column("bundle_key", sa.String, primary_key=True),
    sa.Column("run", sa.String, nullable=False),
    sa.Column("kind", sa.String, nullable=False),
    sa.Column("rollout_id", sa.BigInteger, nullable=False),
    sa.Column("step_id", sa.BigInteger),
    *(sa.Column(name, _SQL_TYPES[kind]()) for name, kind in mismatch_sum_columns()),
    sa.Column("worst", sa.Text),
    sa.Column("document", sa.String),
    sa.Index("ix_mismatch_metrics_step", "run", "rollout_id", "step_id"),
)

# Added in 0006: route mismatches per MoE layer of each bundle (numerator, denominator).
mismatch_layers = sa.Table(
    "mismatch_layers",
    metadata,
    sa.Column("bundle_key", sa.String, primary_key=True),
    sa.Column("layer", sa.Integer, primary_key=True),
    sa.Column("mismatches", sa.BigInteger, nullable=False),
    sa.Column("observations", sa.BigInteger, nullable=False),
)

synced_documents = sa.Table(
    "synced_documents",
    metadata,
    sa.Column("directory", sa.String, primary_key=True),  # bundles | tombstones | results
    sa.Column("name", sa.String, primary_key=True),
)

# Added in 0003. One row per directory of synced_documents (bundles, tombstones,
# results), created by the migration. `high_water`: the newest document name a
# listing sync has seen; the incremental sync (sync_new) lists only names after
# it minus a clock-skew margin. `applied`: documents applied so far, a change
# counter that a server polls instead of listing the store. `listing` (0004): JSON text
# naming the last full listing of the directory whose documents were all applied
# (trajstore.catalog.listing); a reader that lists the same skips the sync.
SYNC_DIRECTORIES: tuple[str, ...] = ("bundles", "tombstones", "results")

sync_state = sa.Table(
    "sync_state",
    metadata,
    sa.Column("directory", sa.String, primary_key=True),
    sa.Column("high_water", sa.String),
    sa.Column("applied", sa.BigInteger, nullable=False),
    sa.Column("listing", sa.Text),
)

# Tables whose rows derive from documents; reindex empties exactly these.
INDEX_TABLES = (
    runs,
    bundles,
    samples,
    provenance,
    payloads,
    router_lineage,
    tombstones,
    replay_results,
    stage_results,
    divergences,
    router_metrics,
    mismatch_metrics,
    mismatch_layers,
    synced_documents,
)
