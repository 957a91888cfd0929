"""What a trainer hands the capture API: ids, settings and values one step away from right.

A misconfiguration fails at construction with `CaptureConfigError` naming the field; an id
or value the training loop passes is read as the same number everywhere, or counted and
logged, never silently captured as nothing or as something else.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trajstore.bundle.capture_dir import list_capture
from trajstore.bundle.reader import is_cohort_dir
from trajstore.capture import CaptureConfig, CaptureManager

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
