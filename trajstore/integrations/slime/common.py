"""Names shared by the slime importer and exporter: sample ids, file names, field roles."""

from __future__ import annotations

from typing import Any

from trajstore.integrations.adapter import FrameworkAdapter

#: the index.json key (top level and per sample) holding what trajstore does not model
EXT = "slime"
#: a rollout dump's per-sample fields kept as payloads: field -> rows they cover
ROLLOUT_ARRAYS: dict[str, str] = {
    "tokens": "total",
    "rollout_log_probs": "response",
    "teacher_log_probs": "response",
    "rollout_routed_experts": "routes",
}
#: route fields a train dump may carry (slime ships the rollout's when R3 is off; a fork
#: that dumps Megatron's routes adds the training side)
TRAIN_ROUTES = ("rollout_routed_experts", "train_routed_experts")
#: per-token fields slime's train dump defines (train_data_utils' context-parallel fields):
#: one value per response token, refused by name when their length is not that
SLIME_PER_TOKEN = (
    "rollout_log_probs",
    "teacher_log_probs",
    "log_probs",
    "ref_log_probs",
    "values",
    "advantages",
    "returns",
    "kl",
    "entropy",
    "opd_reverse_kl",
)
#: train-dump per-sample fields that become sample-record fields, not payloads
TRAIN_RECORD_FIELDS = ("response_lengths", "total_lengths", "loss_masks")
#: the evaluation dumps' run: the training run's name plus this
EVAL_SUFFIX = "-eval"


def sample_id(rollout_id: int, position: int) -> str:
    """A sample's id: its rollout and its position in the rollout dump's ``samples``
    (the train dump's ``rollout_position``), shared by the rollout and step bundles."""
    return f"r{rollout_id}-s{position}"


def micro_batch_id(dp_rank: int, number: int) -> str:
    """The ``number``-th micro-batch of one optimizer step on data-parallel rank ``dp_rank``."""
    return f"mb-d{dp_rank}-{number:04d}"


def rollout_file(rollout_id: int, evaluation: bool) -> str:
    return f"eval_{rollout_id}.pt" if evaluation else f"rollout_{rollout_id}.pt"


def train_file(rollout_id: int) -> str:
    return f"train_{rollout_id}.pt"


class SlimeAdapter(FrameworkAdapter):
    """slime's dumps: read without importing slime (nothing to install); the arguments
    replay reads (`trajstore.integrations.slime.config.read_args`) as ``config.slime``."""

    name = "slime"

    def recompute_config(self, source: Any, **options: Any) -> dict[str, Any]:
        return {EXT: {**source, **options}}


SLIME = SlimeAdapter()
