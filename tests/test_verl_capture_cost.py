"""What verl's actor capture costs the training thread (issue 33): the trainer config is
read once per ``update_actor`` however many step bundles it flushes, and the micro-batch
payloads are packed with one kept-position index (`records._packer`) giving the values a
per-sample slice gives."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

import trajstore.integrations.verl as tv
from trajstore.integrations.adapter import SampleIds
from trajstore.integrations.verl.records import (
    MicroBatchRecord,
    _micro_batch,
    algorithm_config,
    step_records,
)

pytestmark = pytest.mark.integration  # the last test runs verl's worker


class CountingConfig(Mapping):
    """A trainer config (a mapping over an OmegaConf node) counting reads of its
    top-level keys: every read of the algorithm settings starts with one."""

    def __init__(self, node: Any):
        self.node = node
        self.reads = 0

    def __getitem__(self, key: str) -> Any:
        self.reads += 1
        return self.node[key]

    def get(self, key: str, default: Any = None) -> Any:
        self.reads += 1
        return self.node.get(key, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self.node)

    def __len__(self) -> int:
        return len(self.node)


def _record(rows: list[int], lengths: list[int], horizon: int, seed: int) -> MicroBatchRecord:
    g = torch.Generator().manual_seed(seed)
    b = len(rows)
    mask = (torch.arange(horizon).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
    field = lambda: torch.randn(b, horizon, generator=g)  # noqa: E731
    return MicroBatchRecord(
        rows=rows,
        log_probs=field(),
        old_log_probs=field(),
        advantages=field(),
        response_mask=mask,
        loss=0.5,
        entropy=field(),
        ref_log_probs=field(),
        rollout_is_weights=field(),
        groups=[r // 2 for r in rows],
        response_lengths=lengths,
    )


def test_packed_payloads_are_each_samples_slice():
    lengths = [5, 0, 7, 3, 1]
    record = _record([4, 5, 6, 7, 8], lengths, horizon=7, seed=3)
    mb = _micro_batch(record, 0, SampleIds())
    names = ("log_probs", "old_log_probs", "advantages", "entropy", "ref_log_probs")
    for name in (*names, "rollout_is_weights"):
        padded = getattr(record, name)
        expected = [float(padded[i, t]) for i in range(5) for t in range(lengths[i])]
        assert mb["payloads"][name].dtype == torch.float32
        assert mb["payloads"][name].tolist() == expected, name
    loss_mask = [int(record.response_mask[i, t]) for i in range(5) for t in range(lengths[i])]
    assert mb["payloads"]["loss_mask"].dtype == torch.int64
    assert mb["payloads"]["loss_mask"].tolist() == loss_mask
    assert [s["response_length"] for s in mb["samples"]] == lengths
    assert "rollout_log_probs" not in mb["payloads"]


@pytest.mark.parametrize("lengths", [[5, 0, 7, 3, 1], [4, 4, 4]])
def test_packed_payloads_are_new_tensors(lengths):
    """Every position kept or not: the record's later change never reaches a payload."""
    record = _record(list(range(len(lengths))), lengths, horizon=max(lengths), seed=5)
    mb = _micro_batch(record, 0, SampleIds())
    before = {name: value.clone() for name, value in mb["payloads"].items()}
    for name in ("log_probs", "old_log_probs", "advantages", "entropy", "response_mask"):
        getattr(record, name).add_(1)
    for name, value in mb["payloads"].items():
        assert torch.equal(value, before[name]), name


def test_a_field_of_another_width_is_refused():
    record = _record([0, 1], [2, 3], horizon=4, seed=0)
    record.entropy = torch.zeros(2, 5)
    with pytest.raises(IndexError):
        _micro_batch(record, 0, SampleIds())


def test_step_records_with_settings_equal_those_reading_the_config():
    from trajstore.integrations.verl.records import step_settings

    config = {"algorithm": {"adv_estimator": "grpo"}, "actor_rollout_ref": {"actor": {}}}
    records = [_record([0, 1], [2, 3], 4, 1), _record([2, 3], [4, 1], 4, 2)]
    records[1].optimizer_step = 1
    read = step_records(records, config, step=3)
    given = step_records(records, None, step=3, settings=step_settings(config))
    assert [s.recompute for s in read] == [s.recompute for s in given]
    assert [s.recompute["verl"]["horizon"] for s in given] == [4, 4]
    assert given[0].recompute["verl"]["adv_estimator"] == "grpo"


try:
    import verl  # noqa: F401
except ImportError:
    verl = None


@pytest.mark.skipif(verl is None, reason="verl is not installed")
def test_the_config_is_read_once_per_update_actor(tmp_path: Path, monkeypatch):
    """Two ``update_actor`` calls of two optimizer steps each (four step bundles): the
    config is read twice, not once a step bundle."""
    import verl_cpu as h

    from trajstore.integrations.verl.actor import STEP_KEY, capture_actor

    tv.close()
    monkeypatch.setenv("TRAJSTORE_CAPTURE", "1")
    monkeypatch.setenv("TRAJSTORE_CAPTURE_DIR", str(tmp_path / "capture"))
    monkeypatch.delenv("TRAJSTORE_CAPTURE_STORE", raising=False)
    monkeypatch.delenv("TRAJSTORE_RUN", raising=False)
    try:
        cfg = h.trainer_config(h.save_tiny_model(tmp_path / "model"))
        worker = h.build_worker(cfg)
        counting = CountingConfig(cfg)
        capture_actor(worker, counting)
        reads = []
        for step in (1, 2):
            batch = h.prepare(h.make_batch(seed=step), worker, cfg)
            tv.tag_batch(batch)
            batch.meta_info[STEP_KEY] = step
            before = counting.reads
            h.update_actor(worker, batch, cfg)
            reads.append(counting.reads - before)
        stats = tv.close()
    finally:
        tv.close()
    names = sorted(p.name for p in (tmp_path / "capture").iterdir())
    assert names == ["replay-1-0", "replay-1-1", "replay-2-0", "replay-2-1"], names
    assert stats.errors == 0
    alone = CountingConfig(cfg)
    algorithm_config(alone)
    assert alone.reads > 0  # the reads of one conversion of the config
    assert reads == [alone.reads, alone.reads], reads
