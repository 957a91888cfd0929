"""What a trainer hands the capture API: ids, settings and values one step away from right.

A misconfiguration fails at construction with `CaptureConfigError` naming the field; an id
or value the training loop passes is read as the same number everywhere, or counted and
logged, never silently captured as nothing or as something else.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from trajstore.bundle.capture_dir import list_capture
from trajstore.bundle.reader import is_cohort_dir
from trajstore.capture import CaptureConfig, CaptureConfigError, CaptureManager
from trajstore.capture.manager import NULL_STEP

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 5  # one_step's two samples: 3 + 2 response tokens
SAMPLES = [
    {"sample_id": "a", "group_index": 0, "response_length": 3, "total_length": 5},
    {"sample_id": "b", "group_index": 0, "response_length": 2, "total_length": 4},
]
LOSS_METRICS = ("loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl", "kl_loss")


def enabled(out: Path, **kw) -> CaptureConfig:
    return CaptureConfig(enabled=True, output_dir=out, run="t", **kw)


def add(step, mb_id=0, samples=SAMPLES, **kw) -> None:
    """One micro-batch of `samples` (flat per-token tensors over their responses)."""
    n = sum(s["response_length"] for s in samples)
    step.add(
        mb_id,
        samples=samples,
        log_probs=torch.full((n,), -1.0),
        old_log_probs=torch.full((n,), -1.1),
        advantages=torch.full((n,), 0.5),
        **kw,
    )


def written(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir())


# --------------------------------------------------------------------------- step filter ids


@pytest.mark.parametrize(
    ("rollout_id", "step_id"),
    [
        ("0", "1"),
        (torch.tensor(0), torch.tensor(1)),
        (np.int64(0), np.int32(1)),
        (0.0, torch.tensor(1.0)),
    ],
    ids=["str", "tensor", "numpy", "integral-float"],
)
def test_step_filter_matches_ids_however_the_trainer_spells_them(tmp_path, rollout_id, step_id):
    # before: the filter compared raw values, so ("0", "1") never matched {(0, 1)}
    cap = CaptureManager(enabled(tmp_path, steps={(0, 1)}))
    with cap.step(rollout_id, step_id) as st:
        add(st)
    stats = cap.close()
    assert st is not NULL_STEP
    assert (stats.written, stats.skipped, stats.errors) == (1, 0, 0)
    assert written(tmp_path) == ["replay-0-1"]


def test_rollout_filter_matches_ids_however_the_trainer_spells_them(tmp_path):
    cap = CaptureManager(enabled(tmp_path, rollouts={3}))
    assert cap.wants_rollout("3") and cap.wants_rollout(torch.tensor(3))
    assert cap.rollout(np.int64(3), SAMPLES, advantages=torch.zeros(TOKENS))
    stats = cap.close()
    assert (stats.written, stats.skipped, stats.errors) == (1, 0, 0)
    assert written(tmp_path) == ["replay-rollout-3"]


@pytest.mark.parametrize("bad", ["x", -1, 1.5, True, None])
def test_an_unreadable_step_id_is_counted_not_raised(tmp_path, bad):
    cap = CaptureManager(enabled(tmp_path))
    st = cap.step(0, bad)  # int("x") used to raise into the training loop
    assert st is NULL_STEP
    assert cap.rollout(bad, SAMPLES) is False
    stats = cap.close()
    assert (stats.errors, stats.written) == (2, 0)
    assert written(tmp_path) == []


# --------------------------------------------------------------------------- CaptureConfig


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"steps": ["12"]}, r"steps: item '12' is not a \(rollout_id, step_id\) pair"),
        ({"steps": "0:1"}, "steps must be a collection"),
        ({"steps": [(0, 1, 2)]}, "steps: item"),
        ({"steps": [(-1, 0)]}, "steps: -1 is negative"),
        ({"steps": [(True, 0)]}, "steps: True is a bool"),
        ({"steps": [(0.5, 0)]}, "steps: 0.5 is not a non-negative int"),
        ({"rollouts": "12"}, "rollouts must be a collection"),
        ({"rollouts": [-1]}, "rollouts: -1 is negative"),
        ({"rollouts": ["3"]}, "rollouts: '3' is not a non-negative int"),
        ({"producer_ranks": "01"}, "producer_ranks must be a collection"),
        ({"producer_ranks": [-1]}, "producer_ranks: -1 is negative"),
        ({"rollout_ranks": [-1]}, "rollout_ranks: -1 is negative"),
        ({"rollout_ranks": []}, "rollout_ranks is empty"),
        ({"rank": True}, "rank: True is a bool"),
        ({"enabled": "false"}, "enabled must be True or False"),
        ({"block": "false"}, "block must be True or False"),
        ({"producer_commit": 123}, "producer_commit 123 is not a commit id"),
        ({"producer_commit": "/home/alice/secret repo"}, "producer_commit .* is not a commit id"),
        ({"producer_commit": "abc\n"}, "producer_commit .* is not a commit id"),
        ({"parallel": "dp"}, "parallel must be a mapping"),
        ({"redaction": {"prompt": "drop\n"}}, "redaction: redaction rule for 'prompt'"),
        ({"run": "x\n"}, "run name 'x\\\\n' must be"),
        ({"session": "job-7\n"}, "session 'job-7\\\\n' must be"),
    ],
)
def test_a_malformed_setting_is_refused_at_construction(kw, message):
    with pytest.raises(CaptureConfigError, match=message):
        CaptureConfig(**kw)


def test_steps_accept_pairs_numpy_ints_and_the_env_var_form():
    cfg = CaptureConfig(steps=[(1, np.int64(2)), [3, 4], "120:0"], rollouts=(np.int32(5),))
    assert cfg.steps == {(1, 2), (3, 4), (120, 0)} and cfg.rollouts == {5}


def test_an_empty_collection_captures_none_of_that_kind(tmp_path):
    # rollouts=frozenset(): step bundles only (the multi-rank tests rely on it)
    cap = CaptureManager(enabled(tmp_path, rollouts=frozenset()))
    assert cap.rollout(0, SAMPLES, advantages=torch.zeros(TOKENS)) is False
    with cap.step(0, 0) as st:
        add(st)
    assert (cap.close().written, written(tmp_path)) == (1, ["replay-0-0"])


def test_capture_on_with_both_filters_empty_is_refused(tmp_path):
    with pytest.raises(CaptureConfigError, match="steps and rollouts are both empty"):
        enabled(tmp_path, steps=[], rollouts=[])


def test_an_empty_steps_variable_means_every_step():
    assert CaptureConfig.from_env({"TRAJSTORE_CAPTURE_STEPS": " "}).steps is None


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("TRAJSTORE_CAPTURE_ROLLOUTS", "\u00b2"),  # str.isdigit, but int() refuses it
        ("TRAJSTORE_CAPTURE_QUEUE_SIZE", "\u00b2"),
        ("TRAJSTORE_CAPTURE_STEPS", "\u0661:0"),  # an Arabic-Indic digit: "\d" matches it
    ],
)
def test_a_non_ascii_digit_is_a_config_error_not_a_crash(var, value):
    with pytest.raises(CaptureConfigError, match=var):
        CaptureConfig.from_env({var: value})


# --------------------------------------------------------------------------- values and steps


def test_numpy_scalar_metrics_are_captured_as_numbers(tmp_path):
    # np.float32 is no float subclass: the whole step bundle used to be dropped
    cap = CaptureManager(enabled(tmp_path))
    metrics = {name: np.float32(0.5) for name in LOSS_METRICS} | {"loss": np.float64(0.25)}
    with cap.step(0, 0) as st:
        add(st, metrics=metrics)
    stats = cap.close()
    assert (stats.written, stats.errors) == (1, 0)
    expected = json.loads((tmp_path / "replay-0-0" / "expected.json").read_text())
    assert expected["loss.policy"]["loss"] == pytest.approx(0.25)
    assert expected["loss.policy"]["pg_loss"] == pytest.approx(0.5)


def test_a_step_never_ended_is_counted_and_named_at_close(tmp_path, caplog):
    cap = CaptureManager(enabled(tmp_path))
    forgotten = cap.step(3, 7)
    add(forgotten)  # the trainer never calls end() nor leaves a `with` block
    unused = cap.step(3, 8)  # opened, given nothing: nothing was lost
    with cap.step(3, 9) as st:
        add(st)
    with caplog.at_level(logging.WARNING, logger="trajstore.capture"):
        stats = cap.close()
    assert (stats.abandoned, stats.written, stats.errors) == (1, 1, 0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "3:7" in warnings[0] and "3:8" not in warnings[0]
    assert unused is not NULL_STEP and written(tmp_path) == ["replay-3-9"]


def test_a_discarded_step_is_not_abandoned(tmp_path):
    cap = CaptureManager(enabled(tmp_path))
    with pytest.raises(RuntimeError), cap.step(0, 0) as st:
        add(st)
        raise RuntimeError("the trainer's own failure")
    assert (cap.close().abandoned, written(tmp_path)) == (0, [])


# --------------------------------------------------------------------------- micro-batch ids


def test_a_repeated_micro_batch_id_refuses_the_step(tmp_path):
    # before: both micro-batches were written as one mb-0000
    cap = CaptureManager(enabled(tmp_path))
    with cap.step(0, 0) as st:
        add(st, 0, SAMPLES[:1])
        add(st, 0, SAMPLES[1:])
    stats = cap.close()
    assert (stats.written, stats.errors) == (0, 1)


def test_micro_batch_ids_are_the_form_replay_selects(tmp_path):
    cap = CaptureManager(enabled(tmp_path))
    with cap.step(0, 0) as st:
        add(st, "0", SAMPLES[:1])
        add(st, np.int64(1), SAMPLES[1:])
    with cap.step(0, 1) as st:
        add(st, "mb-7", SAMPLES)
    with cap.step(0, 2) as st:
        add(st, "first", SAMPLES)  # replay --batch could never select it
    stats = cap.close()
    assert (stats.written, stats.errors) == (2, 1)
    index = json.loads((tmp_path / "replay-0-0" / "index.json").read_text())
    assert index["identity"]["micro_batch_ids"] == ["mb-0000", "mb-0001"]
    r = subprocess.run(
        [sys.executable, "-m", "trajstore", "replay", str(tmp_path / "replay-0-0")]
        + ["--batch", "mb-0000", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert "not of the form" not in r.stderr and "not found" not in r.stderr, r.stderr


# --------------------------------------------------------------------------- name checks: "$"
# re.match with a trailing "$" also matches before a final "\n": each check a name passes


def test_a_replay_dir_name_with_a_trailing_newline_is_not_a_bundle(tmp_path):
    for name in ("replay-0-0\n", "replay-rollout-1\n", "replay-0-1"):
        (tmp_path / name).mkdir()
    assert [p.name for p in list_capture(tmp_path)] == ["replay-0-1"]


def test_a_rank_dir_name_with_a_trailing_newline_is_not_a_cohort_member(tmp_path):
    (tmp_path / "rank-0\n").mkdir()
    assert not is_cohort_dir(tmp_path)
    (tmp_path / "rank-1").mkdir()
    assert is_cohort_dir(tmp_path)


def test_replay_batch_with_a_trailing_newline_is_refused_as_malformed(tmp_path):
    cap = CaptureManager(enabled(tmp_path))
    with cap.step(0, 0) as st:
        add(st)
    cap.close()
    r = subprocess.run(
        [sys.executable, "-m", "trajstore", "replay", str(tmp_path / "replay-0-0")]
        + ["--batch", "mb-0000\n"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 2 and "not of the form mb-NNNN" in r.stderr, r.stderr


def test_a_catalog_ref_name_with_a_trailing_newline_is_refused(tmp_path):
    from api.state import AppState
    from trajstore.errors import StoreError
    from trajstore.store.api import Store

    Store.open(tmp_path / "store").close()
    state = AppState(tmp_path / "store", None, 60.0)
    with pytest.raises(StoreError, match="malformed ref name"):
        state.stored({"ref_name": f"{'0' * 20}-1-abc\n"})
