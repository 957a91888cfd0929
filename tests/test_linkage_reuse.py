"""The rollout linkage takes the step's own advantage.estimate comparison when that stage ran
on the rollout's recomputed rewards (the same comparison), instead of redoing it.

Pinned here: the check finds the same divergences, reasons and verdicts either way, on
steps whose producer declared advantage.estimate (and no reward stage), so the stage ran on
the rollout's rewards; the fixtures are test_rollout_linkage's run (rollout 7, steps 7:0 and
7:1).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from test_rollout_linkage import ROLLOUT, RUN, _part, make_store, rollout_contents
from trajstore.examples.replay_builders import Faults

from trajstore.bundle.writer import BundleContents
from trajstore.replay.context import ReplayContext, StageMemo
from trajstore.replay.from_store import (
    Target,
    _replay_rollout,
    check_linkage,
    replay_stored,
    upstream_rewards,
)
from trajstore.replay.runner import StageRequest, replay_sources
from trajstore.replay.selection import Selection
from trajstore.store import Store

pytestmark = pytest.mark.unit


def estimating_step(step_id: int, faults: Faults | None = None) -> BundleContents:
    """A step bundle declaring every stage but the reward ones: its advantage.estimate runs
    on the rollout bundle's recomputed rewards."""
    c = _part(step_id, "step", faults)
    c.identity["rank"]["dp"] = 1
    c.stage_contracts = {
        k: v for k, v in c.stage_contracts.items() if k not in ("reward.raw", "reward.post_process")
    }
    for stage in ("reward.raw", "reward.post_process"):
        c.expected.pop(stage)
    return c


def _fresh_linkage(store: Store, step: int):  # noqa: ANN202
    """The linkage of step 7:`step` computed without the step's comparison (the full path)."""
    report = replay_stored(store, Target(run=RUN, step=(ROLLOUT, step)))
    sources = store.step(RUN, ROLLOUT, step)
    rollout_report = _replay_rollout(store, RUN, ROLLOUT, None)
    rewards = upstream_rewards(rollout_report)
    assert all(b.upstream_comparison is not None for b in report.bundles)
    assert all(b.upstream_comparison[0] is not rewards for b in report.bundles)
    plain = dataclasses.replace(
        report,
        bundles=[dataclasses.replace(b, upstream_comparison=None) for b in report.bundles],
    )
    return report, check_linkage(plain, sources, rollout_report, rewards, StageRequest())


@pytest.mark.parametrize("tamper", [False, True])
def test_linkage_from_the_steps_comparison_equals_the_full_check(
    tmp_path: Path, tamper: bool
) -> None:
    root = make_store(
        tmp_path,
        rollout=rollout_contents(tamper=tamper),
        steps={
            0: estimating_step(0),
            1: estimating_step(1, None if tamper else Faults(physical_batch_norm=12)),
        },
    )
    with Store.open(root, create=False) as store:
        for step in (0, 1):
            report, fresh = _fresh_linkage(store, step)
            assert report.linkage.to_dict() == fresh.to_dict()
        # step 7:1 consumed a faulty advantage (its own, or the tampered rollout's)
        assert report.linkage.status == "fail"
        assert report.linkage.mismatch_count > 0
        assert report.exit_code == 1
        if tamper:
            assert report.root_bundle_key == report.linkage.rollout_bundle_key
            fd = report.first_divergence()
            assert (fd["stage"], fd["downstream_stage"]) == (
                "reward.post_process",
                "advantage.estimate",
            )
            # only the tampered sample's prompt (s-1-0 .. s-1-7) changes after normalization
            assert fd["sample_id"] in {f"s-1-{i}" for i in range(8)}
        else:
            assert report.root_bundle_key is None
            assert report.first_divergent_stage == "advantage.estimate"


def _same_samples_store(tmp_path: Path, faults: Faults | None) -> Path:
    """Rollout 7 and step 7:0 of the same samples and payload bytes (the same records)."""
    rollout, step = _part(0, "rollout", faults), _part(0, "step", faults)
    for c in (rollout, step):
        c.identity["rank"]["dp"] = 1
    return make_store(tmp_path, rollout=rollout, steps={0: step})


@pytest.mark.parametrize(
    "faults",
    [None, Faults(kl_type="k1"), Faults(kl_type="k1", physical_batch_norm=12)],
)
def test_stage_outcomes_taken_from_the_rollout_equal_the_steps_own(
    tmp_path: Path, faults: Faults | None
) -> None:
    """advantage.kl and advantage.estimate of a step that read its rollout's very records
    come from the rollout's replay (StageMemo): the same outcomes as computing them."""
    root = _same_samples_store(tmp_path, faults)
    with Store.open(root, create=False) as store:
        step, rollout = store.step(RUN, ROLLOUT, 0), store.rollout(RUN, ROLLOUT)
        shared = {
            name
            for name in step[0].payload_names()
            if step[0].payload_identity(name) == rollout[0].payload_identity(name)
        }
        assert {"kl", "old_log_probs", "ref_log_probs", "advantages"} <= shared
        memo = StageMemo()
        rollout_report = replay_sources(rollout, label="ro", memo=memo)
        kept = len(memo._entries)
        rewards = upstream_rewards(rollout_report)
        upstream = [{"rewards_by_id": rewards}]
        memoized = replay_sources(step, label="st", upstream=upstream, memo=memo)
        assert kept == 2 and len(memo._entries) == kept  # the step's stages were hits
        computed = replay_sources(step, label="st", upstream=upstream)
        assert memoized.to_dict() == computed.to_dict()
        # and through the store command's path, the linkage included
        report = replay_stored(store, Target(run=RUN, step=(ROLLOUT, 0)))
        assert report.to_dict()["bundles"] == computed.to_dict()["bundles"]
        if faults is not None:
            assert report.bundles[0].outcome("advantage.kl").status == "fail"
            assert report.linkage.status == ("fail" if faults.physical_batch_norm else "pass")


@pytest.mark.parametrize("edited", [False, True])
def test_loss_mask_taken_from_the_rollout_only_when_the_lists_are_equal(
    tmp_path: Path, edited: bool
) -> None:
    rollout, step = _part(0, "rollout", None), _part(0, "step", None)
    for c in (rollout, step):
        c.identity["rank"]["dp"] = 1
    if edited:  # one token of one sample masked differently in the step
        mask = step.samples[3]["loss_mask"]
        mask[0] = 1 - mask[0]
    root = make_store(tmp_path, rollout=rollout, steps={0: step})
    with Store.open(root, create=False) as store:
        (st,), (ro,) = store.step(RUN, ROLLOUT, 0), store.rollout(RUN, ROLLOUT)
        whole = Selection(None, False)
        memo = StageMemo()
        from_rollout = ReplayContext(ro, whole, memo=memo).mask()
        memoized = ReplayContext(st, whole, memo=memo).mask()
        own = ReplayContext(st, whole).mask()
        assert memoized.dtype == own.dtype == np.float32
        assert np.array_equal(memoized, own)
        assert np.array_equal(from_rollout, own) is not edited
        assert len(memo._masks) == (2 if edited else 1)
