"""The router.consistency stage: recorded producer metrics recomputed from the payloads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from trajstore.bundle.reader import open_target
from trajstore.bundle.writer import BundleContents, write_bundle
from trajstore.replay.selection import Selection
from trajstore.replay.stages import ReplayContext
from trajstore.router.metrics import compute_router_metrics
from trajstore.router.stage import router_capability, stage_router_consistency

pytestmark = pytest.mark.unit

E, L, K = 8, 2, 2
TOTAL, RESP, N = 6, 3, 2
ROUTER = {"num_experts": E, "num_layers": L, "top_k": K, "mode": "baseline"}


def routed_contents(
    *, recorded: str | None = "honest", train_routes: bool = True, router=ROUTER
) -> BundleContents:
    """Two samples, routes where 3 of 12 valid (token, layer) pairs differ."""
    rng = np.random.default_rng(0)
    rollout = np.stack([rng.permutation(E)[:K] for _ in range(N * TOTAL * L)]).reshape(
        N * TOTAL, L, K
    )
    rollout = rollout.astype(np.uint8)
    train = rollout.copy()
    for t in (3, 4, 9):  # response tokens (positions 3-5 and 9-11 are responses)
        train[t, 0] = [e for e in range(E) if e not in rollout[t, 0]][:K]
    lp_r = rng.normal(-1.0, 0.3, N * RESP).astype(np.float32)
    lp_t = (lp_r + rng.normal(0, 0.05, N * RESP)).astype(np.float32)
    payloads = {
        "rollout_routed_experts": rollout,
        "rollout_log_probs": lp_r,
        "train_log_probs": lp_t,
    }
    if train_routes:
        payloads["train_routed_experts"] = train
    expected = {}
    if recorded is not None:
        other = train if recorded == "honest" else rollout  # "self": target compared with itself
        m = compute_router_metrics(
            rollout,
            other,
            total_lengths=[TOTAL] * N,
            response_lengths=[RESP] * N,
            loss_masks=[[1] * RESP] * N,
            num_experts=E,
            num_layers=L,
            top_k=K,
            rollout_log_probs=lp_r,
            train_log_probs=lp_t,
        )
        expected["router.consistency"] = {**m.to_dict(), "hang_count": 0}
    samples = [
        {
            "sample_id": f"s-{i}",
            "group_index": 0,
            "response_length": RESP,
            "total_length": TOTAL,
            "loss_mask": [1] * RESP,
            "reward": 0.0,
        }
        for i in range(N)
    ]
    config = {"advantage_estimator": "grpo"} | ({"router": router} if router is not None else {})
    return BundleContents(
        bundle_id="routed",
        identity={"actor_step_id": {"rollout_id": 1, "step_id": 0}, "rollout_id": None},
        samples=samples,
        config=config,
        payloads=payloads,
        expected=expected,
        producer={"commit": "test", "dirty_patch_digest": "", "torch_version": "2"},
    )


def open_routed(tmp_path: Path, **kw):
    return open_target(write_bundle(tmp_path / "b", routed_contents(**kw))).first


def run_stage(bundle):
    return stage_router_consistency(ReplayContext(bundle, Selection(None, False)))


def test_honest_producer_passes(tmp_path):
    out = run_stage(open_routed(tmp_path))
    assert out.status == "pass", out.reason
    assert out.mismatch_count == 0


def test_self_compared_producer_is_caught(tmp_path):
    out = run_stage(open_routed(tmp_path, recorded="self"))
    assert out.status == "fail"
    fields = {d.field for d in out.divergences}
    assert {"route_mismatch_rate", "token_any_mismatch"} <= fields
    rate = next(d for d in out.divergences if d.field == "route_mismatch_rate")
    assert rate.expected == 0.0 and rate.actual == pytest.approx(3 / 12)
    assert "compared with itself" in out.reason


def test_recorded_zero_where_routes_are_missing_is_caught(tmp_path):
    """The producer said 0; the bundle has no train routes, so the truth is null."""
    bundle = open_routed(tmp_path, train_routes=False)
    out = run_stage(bundle)
    assert out.status == "fail"
    rate = next(d for d in out.divergences if d.field == "route_mismatch_rate")
    assert rate.actual is None
    assert "metric_error" in {d.field for d in out.divergences}


def test_capability_recompute_when_recorded(tmp_path):
    assert router_capability(open_routed(tmp_path)) == ("recompute", "")


def test_capability_skipped_when_nothing_recorded(tmp_path):
    cap, why = router_capability(open_routed(tmp_path, recorded=None))
    assert cap == "skipped" and "recorded no router.consistency" in why


def test_capability_unsupported_without_router_config(tmp_path):
    cap, why = router_capability(open_routed(tmp_path, router=None))
    assert cap == "unsupported" and "config.router" in why


def test_partial_selection_skips(tmp_path):
    bundle = open_routed(tmp_path)
    out = stage_router_consistency(ReplayContext(bundle, Selection(np.array([0]), True)))
    assert out.status == "skipped"
