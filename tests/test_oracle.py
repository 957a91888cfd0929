"""The independent oracle (examples/oracle.py) is right, and the engine agrees with it.

Replay tests trust `oracle` for the values a correct producer records, so
the oracle itself is checked against the public producer's recorded numbers
and hand-computed values; then bundles built by the oracle under every
config knob the stages read must replay clean; and bundles written by
scripts/gen_long_run.py (which uses the library's kernels, as a shipped
generator may) must hold the oracle's values, so tests built on that
generator rest on the oracle too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import FIXTURES
from trajstore.examples import oracle
from trajstore.examples.replay_builders import replay, statuses, write_consistent

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
ATOL, RTOL = 1e-6, 1e-5
RECOMPUTED = (
    "sample",
    "reward.raw",
    "reward.post_process",
    "advantage.kl",
    "advantage.estimate",
    "loss.policy",
)
PRODUCER_BUNDLES = (
    FIXTURES / "example_bundle",
    FIXTURES / "example_capture_dir" / "replay-120-0" / "rank-0",
    FIXTURES / "example_capture_dir" / "replay-120-0" / "rank-1",
)


def load(bundle: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, np.ndarray]]:
    """index.json, expected.json and every payload of a plain bundle directory."""
    index = json.loads((bundle / "index.json").read_text(encoding="utf-8"))
    expected = json.loads((bundle / "expected.json").read_text(encoding="utf-8"))
    payloads = {
        p.stem: torch.load(p, weights_only=True).numpy()
        for p in sorted((bundle / "payloads").glob("*.pt"))
    }
    return index, expected, payloads


def mask_and_lengths(samples: list[dict[str, Any]]) -> tuple[np.ndarray, list[int]]:
    mask = np.concatenate([np.asarray(s["loss_mask"], dtype=np.float32) for s in samples])
    return mask, [int(s["response_length"]) for s in samples]


def close(actual: Any, expected: Any) -> None:
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), atol=ATOL, rtol=RTOL)


# --------------------------------------------------------------------------- oracle vs producer


@pytest.mark.parametrize("bundle", PRODUCER_BUNDLES, ids=lambda p: p.name)
def test_oracle_loss_matches_producer_recorded_loss(bundle: Path) -> None:
    index, expected, p = load(bundle)
    mask, lengths = mask_and_lengths(index["samples"])
    out = oracle.loss_from_config(index["config"], p, mask, lengths)
    assert set(expected["loss.policy"]) <= set(out)
    for key, val in expected["loss.policy"].items():
        assert out[key] == pytest.approx(val, abs=ATOL, rel=RTOL), key


@pytest.mark.parametrize("bundle", PRODUCER_BUNDLES, ids=lambda p: p.name)
def test_oracle_kl_matches_producer_kl_payload(bundle: Path) -> None:
    index, _, p = load(bundle)
    close(
        oracle.approx_kl(p["old_log_probs"], p["ref_log_probs"], index["config"]["kl_loss_type"]),
        p["kl"],
    )


@pytest.mark.parametrize("bundle", PRODUCER_BUNDLES, ids=lambda p: p.name)
def test_oracle_advantages_match_producer_advantages(bundle: Path) -> None:
    index, _, p = load(bundle)
    samples = index["samples"]
    _, lengths = mask_and_lengths(samples)
    close(oracle.grpo_advantages([s["reward"] for s in samples], lengths), p["advantages"])


# --------------------------------------------------------------------------- oracle vs hand values


def test_oracle_group_of_two_normalizes_to_plus_minus_one_over_sqrt_two() -> None:
    # centred +-0.5, unbiased std sqrt(0.5): +-0.5 / (0.7071 + 1e-6)
    close(
        oracle.group_normalize([1.0, 0.0], [0, 0], 2),
        [0.5 / (0.5**0.5 + 1e-6), -0.5 / (0.5**0.5 + 1e-6)],
    )


def test_oracle_std_is_unbiased_and_groups_are_semantic() -> None:
    # group 3 holds positions 0, 2, 4 (interleaved): rewards 1, 2, 6 -> mean 3, std sqrt(7)
    out = oracle.group_normalize([1.0, 5.0, 2.0, 5.0, 6.0, 5.0], [3, 9, 3, 9, 3, 9], 3)
    close(out[[0, 2, 4]], np.array([-2.0, -1.0, 3.0]) / (7**0.5 + 1e-6))
    close(out[[1, 3, 5]], [0.0, 0.0, 0.0])


def test_oracle_clip_uses_eps_clip_high_above_one() -> None:
    # ratio e^0.25 ~ 1.284 with A = 1: clipped at 1.28 -> pg = -1.28, clip fraction 1
    out = oracle.policy_loss(
        [0.0], [0.25], [1.0], [0.0], [1.0], [1], eps_clip=0.2, eps_clip_high=0.28
    )
    assert (out["pg_loss"], out["pg_clipfrac"]) == pytest.approx((-1.28, 1.0))


def test_oracle_k3_is_exp_neg_minus_one_plus_log_ratio() -> None:
    close(oracle.approx_kl([0.0], [-1.0], "k3"), [np.exp(-1.0) - 1 + 1.0])


# --------------------------------------------------------------------------- engine vs oracle

CONFIGS: dict[str, dict[str, Any]] = {
    "kl-k1": {"kl_loss_type": "k1"},
    "kl-k2": {"kl_loss_type": "k2"},
    "kl-low-var": {"kl_loss_type": "low_var_kl"},
    "no-std-norm": {"grpo_std_normalization": False},
    "no-reward-norm": {"rewards_normalization": False},
    "symmetric-clip": {"eps_clip_high": None, "eps_clip": 0.1},
    "dual-clip": {"eps_clip_c": 1.5},
    "kl-loss-k2": {"use_kl_loss": True, "kl_loss_coef": 0.3, "kl_loss_type": "k2"},
    "kl-loss-unbiased-low-var": {
        "use_kl_loss": True,
        "kl_loss_coef": 0.2,
        "kl_loss_type": "low_var_kl",
        "use_unbiased_kl": True,
    },
    "no-kl-no-entropy": {"kl_coef": 0.0, "entropy_coef": 0.0},
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_oracle_built_bundle_replays_clean(tmp_path: Path, config: dict[str, Any]) -> None:
    path, _ = write_consistent(tmp_path / "b", config=config, interleave=True)
    report = replay(path)
    assert {s: statuses(report)[s] for s in RECOMPUTED} == dict.fromkeys(RECOMPUTED, "pass")


def test_oracle_built_singleton_groups_replay_clean(tmp_path: Path) -> None:
    # n_samples_per_prompt == 1: no std division, every reward centres to 0
    path, built = write_consistent(tmp_path / "b", groups=6, n=1)
    assert not built.rewards.any()
    assert replay(path).exit_code == 0


# --------------------------------------------------------------------------- generator vs oracle


@pytest.fixture(scope="module")
def long_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gen") / "run"
    args = ["--rollouts", "2", "--steps", "2", "--samples", "16", "--per-prompt", "4"]
    args += ["--min-len", "5", "--max-len", "40", "--seed", "3"]
    proc = subprocess.run(
        [sys.executable, "-m", "trajstore.examples.gen_long_run", str(out), *args],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    return out


def test_gen_long_run_rewards_are_the_oracle_group_normalization(long_run: Path) -> None:
    for rid in (0, 1):
        index, expected, _ = load(long_run / f"replay-rollout-{rid}")
        samples = index["samples"]
        want = oracle.group_normalize(
            [s["raw_reward"] for s in samples],
            [s["group_index"] for s in samples],
            index["config"]["n_samples_per_prompt"],
        )
        close(expected["reward.post_process"]["rewards"], want)
        close([s["reward"] for s in samples], want)


def test_gen_long_run_step_values_are_the_oracle_values(long_run: Path) -> None:
    steps = sorted(long_run.glob("replay-[0-9]*-[0-9]*"))
    assert len(steps) == 4
    for step in steps:
        index, expected, p = load(step)
        mask, lengths = mask_and_lengths(index["samples"])
        close(
            p["advantages"],
            oracle.grpo_advantages([s["reward"] for s in index["samples"]], lengths),
        )
        close(p["kl"], np.zeros(sum(lengths), dtype=np.float32))
        want = oracle.loss_from_config(index["config"], p, mask, lengths)
        for key, val in expected["loss.policy"].items():
            assert val == pytest.approx(want[key], abs=ATOL, rel=RTOL), f"{step.name} {key}"
