"""The replay engine on real bundles: fixtures, the stage DAG, capability, selection.

Bundles are written with trajstore's writer by `replay_builders` (a
mathematically consistent producer with fault knobs), or are the public
producer's fixtures. Replays go through the same path the CLI uses:
`open_target` -> `replay_sources`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES
from trajstore.examples.replay_builders import (
    Faults,
    consistent_contents,
    replay,
    stage,
    statuses,
    write_consistent,
    write_consistent_cohort,
)

from trajstore.bundle.capture_dir import resolve_target
from trajstore.bundle.writer import write_bundle
from trajstore.errors import SelectionError

pytestmark = pytest.mark.unit

RECOMPUTED = (
    "sample",
    "reward.raw",
    "reward.post_process",
    "advantage.kl",
    "advantage.estimate",
    "loss.policy",
)


# --------------------------------------------------------------------------- fixtures


def test_fixture_example_bundle_passes() -> None:
    report = replay(FIXTURES / "example_bundle")
    assert report.exit_code == 0
    assert report.first_divergent_stage is None
    assert stage(report, "loss.policy").status == "pass"


def test_fixture_divergent_bundle_names_advantage_estimate_and_three_tokens() -> None:
    report = replay(FIXTURES / "example_bundle_divergent")
    assert report.exit_code == 1
    assert report.first_divergent_stage == "advantage.estimate"
    adv = stage(report, "advantage.estimate")
    assert adv.mismatch_count == 3
    assert [(d.sample_id, d.token_offset) for d in adv.divergences] == [
        ("s-0", 0),
        ("s-0", 1),
        ("s-0", 2),
    ]
    assert stage(report, "advantage.kl").status == "pass"


def test_fixture_capture_dir_step_replays_both_ranks() -> None:
    path = resolve_target(FIXTURES / "example_capture_dir", step=(120, 0))
    report = replay(path)
    assert [b.rank for b in report.bundles] == [0, 1]
    assert report.exit_code == 0


def test_fixture_capture_dir_rollout_replays() -> None:
    path = resolve_target(FIXTURES / "example_capture_dir", rollout=120)
    report = replay(path)
    assert report.exit_code == 0
    assert stage(report, "advantage.estimate").status == "pass"


def test_major2_reward_stages_are_skipped_not_failed() -> None:
    report = replay(FIXTURES / "example_bundle")
    assert statuses(report)["reward.raw"] == "skipped"
    assert statuses(report)["reward.post_process"] == "skipped"


# --------------------------------------------------------------------------- consistent producer


def test_consistent_bundle_passes_every_recompute_stage(tmp_path: Path) -> None:
    path, _ = write_consistent(tmp_path / "b")
    report = replay(path)
    assert report.exit_code == 0
    assert all(statuses(report)[s] == "pass" for s in RECOMPUTED)


def test_consistent_bundle_with_dual_clip_and_kl_loss_passes(tmp_path: Path) -> None:
    config = {"eps_clip_c": 3.0, "use_kl_loss": True, "kl_loss_coef": 0.1, "use_unbiased_kl": True}
    path, _ = write_consistent(tmp_path / "b", config=config)
    report = replay(path)
    assert report.exit_code == 0
    assert stage(report, "loss.policy").status == "pass"


def test_rollout_level_bundle_passes(tmp_path: Path) -> None:
    path, _ = write_consistent(tmp_path / "b", kind="rollout")
    assert replay(path).exit_code == 0


# --------------------------------------------------------------------------- streamed-group fault


def test_streamed_group_fault_first_divergent_stage_is_post_process(tmp_path: Path) -> None:
    path, built = write_consistent(
        tmp_path / "b", interleave=True, faults=Faults(physical_batch_norm=12)
    )
    report = replay(path)
    assert report.exit_code == 1
    assert report.first_divergent_stage == "reward.post_process"
    assert statuses(report)["reward.raw"] == "pass"


def test_streamed_group_fault_lists_the_affected_samples(tmp_path: Path) -> None:
    path, built = write_consistent(
        tmp_path / "b", interleave=True, faults=Faults(physical_batch_norm=12)
    )
    post = stage(replay(path), "reward.post_process")
    wrong = np.abs(built.rewards.astype(np.float64) - built.correct_rewards) > 1e-5
    affected = [sid for sid, w in zip(built.sample_ids, wrong, strict=True) if w]
    assert post.mismatch_count == len(affected)
    assert [d.sample_id for d in post.divergences] == affected[:10]
    d0 = post.divergences[0]
    assert d0.expected == pytest.approx(float(built.rewards[built.sample_ids.index(d0.sample_id)]))
    assert d0.actual == pytest.approx(
        float(built.correct_rewards[built.sample_ids.index(d0.sample_id)])
    )


def test_streamed_arrival_with_correct_producer_passes(tmp_path: Path) -> None:
    # Interleaved arrival alone is not a fault: groups are semantic, not positional.
    path, _ = write_consistent(tmp_path / "b", interleave=True)
    assert replay(path).exit_code == 0


def test_post_process_divergence_propagates_to_advantages(tmp_path: Path) -> None:
    path, _ = write_consistent(
        tmp_path / "b", interleave=True, faults=Faults(physical_batch_norm=12)
    )
    report = replay(path, "advantage.estimate")
    assert report.first_divergent_stage == "advantage.estimate"
    assert stage(report, "reward.post_process").requested is False


def test_skipped_upstream_stage_feeds_recorded_rewards_downstream(tmp_path: Path) -> None:
    built = consistent_contents(interleave=True, faults=Faults(physical_batch_norm=12))
    for s in ("reward.raw", "reward.post_process"):
        built.contents.stage_contracts[s]["capability"] = "recorded-only"
    path = write_bundle(tmp_path / "b", built.contents)
    report = replay(path)
    # The recorded (faulty) rewards are the producer's inputs: its advantages agree with them.
    assert statuses(report)["reward.post_process"] == "skipped"
    assert report.exit_code == 0


# --------------------------------------------------------------------------- comparison


def test_token_error_within_manifest_tolerance_passes(tmp_path: Path) -> None:
    built = consistent_contents()
    built.contents.payloads["advantages"] = built.contents.payloads["advantages"] + np.float32(1e-3)
    built.contents.comparison_policy = {
        "exact_fields": [],
        "tolerances": {"advantage.estimate": {"atol": 1e-2, "rtol": 0.0}},
    }
    path = write_bundle(tmp_path / "b", built.contents)
    assert stage(replay(path), "advantage.estimate").status == "pass"


def test_token_error_beyond_default_tolerance_fails_with_max_abs_error(tmp_path: Path) -> None:
    built = consistent_contents()
    adv = built.contents.payloads["advantages"].copy()
    adv[built.offset_of("s-2") + 1] += np.float32(1e-3)
    built.contents.payloads["advantages"] = adv
    path = write_bundle(tmp_path / "b", built.contents)
    out = stage(replay(path), "advantage.estimate")
    assert out.mismatch_count == 1
    assert (out.divergences[0].sample_id, out.divergences[0].token_offset) == ("s-2", 1)
    assert out.max_abs_error == pytest.approx(1e-3, rel=1e-2)


def test_missing_expectation_of_recompute_stage_fails_as_incomplete(tmp_path: Path) -> None:
    path, _ = write_consistent(tmp_path / "b", drop_expected=("loss.policy",))
    report = replay(path)
    out = stage(report, "loss.policy")
    assert out.status == "fail"
    assert "incomplete bundle" in out.reason
    assert report.exit_code == 1


def test_missing_post_process_expectation_fails_as_incomplete(tmp_path: Path) -> None:
    path, _ = write_consistent(tmp_path / "b", drop_expected=("reward.post_process",))
    out = stage(replay(path), "reward.post_process")
    assert out.status == "fail"
    assert "incomplete bundle" in out.reason


# --------------------------------------------------------------------------- capability


@pytest.mark.parametrize(
    "kwargs, why",
    [
        ({"config": {"advantage_estimator": "reinforce_plus_plus"}}, "advantage_estimator"),
        ({"cp": 2}, "cp=2"),
        ({"config": {"mystery_knob": 1}}, "mystery_knob"),
    ],
    ids=["estimator", "cp2", "unknown-key"],
)
def test_unsupported_stage_requested_explicitly_fails_with_reason(
    tmp_path: Path, kwargs: dict, why: str
) -> None:
    path, _ = write_consistent(tmp_path / "b", **kwargs)
    report = replay(path, "advantage.estimate")
    out = stage(report, "advantage.estimate")
    assert out.status == "unsupported"
    assert why in out.reason
    assert report.exit_code == 1
    assert report.status == "unsupported"


@pytest.mark.parametrize(
    "kwargs",
    [{"config": {"advantage_estimator": "reinforce_plus_plus"}}, {"cp": 2}, {"config": {"x": 1}}],
    ids=["estimator", "cp2", "unknown-key"],
)
def test_unsupported_stage_not_requested_is_skipped(tmp_path: Path, kwargs: dict) -> None:
    path, _ = write_consistent(tmp_path / "b", **kwargs)
    report = replay(path)
    out = stage(report, "advantage.estimate")
    assert out.status == "skipped"
    assert out.reason.startswith("unsupported:")
    assert report.exit_code == 0


def test_estimator_other_than_grpo_keeps_kl_stage_recomputed(tmp_path: Path) -> None:
    path, _ = write_consistent(tmp_path / "b", config={"advantage_estimator": "ppo"})
    assert statuses(replay(path))["advantage.kl"] == "pass"


def test_loss_value_requested_is_unsupported(tmp_path: Path) -> None:
    path, _ = write_consistent(tmp_path / "b")
    report = replay(path, "loss.value")
    assert stage(report, "loss.value").status == "unsupported"
    assert report.exit_code == 1


def test_requested_stage_runs_its_inputs_but_counts_only_itself(tmp_path: Path) -> None:
    path, _ = write_consistent(tmp_path / "b", faults=Faults(kl_type="k1"))
    report = replay(path, "advantage.estimate")
    kl = stage(report, "advantage.kl")
    assert (kl.status, kl.requested) == ("fail", False)
    assert stage(report, "loss.policy").reason == "not requested"
    assert report.exit_code == 0


# --------------------------------------------------------------------------- selection


def test_sample_selection_expands_to_group_closure(tmp_path: Path) -> None:
    path, built = write_consistent(tmp_path / "b", groups=4, n=4)
    report = replay(path, samples=("s-5",))
    sel = report.bundles[0].selection
    assert sel.partial
    assert sorted(sel.positions.tolist()) == [4, 5, 6, 7]
    assert sel.closure_added == ["s-4", "s-6", "s-7"]


def test_partial_selection_recomputes_per_sample_stages(tmp_path: Path) -> None:
    path, _ = write_consistent(tmp_path / "b", groups=4, n=4)
    report = replay(path, groups=("g-2",))
    assert all(statuses(report)[s] == "pass" for s in RECOMPUTED[:-1])


def test_partial_selection_skips_loss_policy_with_reason(tmp_path: Path) -> None:
    path, _ = write_consistent(tmp_path / "b", groups=4, n=4)
    out = stage(replay(path, groups=("g-1",)), "loss.policy")
    assert out.status == "skipped"
    assert "partial selection" in out.reason


def test_partial_selection_with_loss_policy_requested_is_unsupported(tmp_path: Path) -> None:
    path, _ = write_consistent(tmp_path / "b", groups=4, n=4)
    report = replay(path, "loss.policy", groups=("g-1",))
    assert stage(report, "loss.policy").status == "unsupported"
    assert report.exit_code == 1


def test_selection_covering_every_sample_is_not_partial(tmp_path: Path) -> None:
    path, _ = write_consistent(tmp_path / "b", groups=2, n=4)
    report = replay(path, groups=("g-0", "g-1"))
    assert report.bundles[0].selection.partial is False
    assert stage(report, "loss.policy").status == "pass"


def test_batch_selection_closes_over_groups(tmp_path: Path) -> None:
    # Interleaved arrival: mb-0001 holds samples 4..7, one of each of the 4 groups.
    path, _ = write_consistent(tmp_path / "b", groups=4, n=4, interleave=True, micro_batch_size=4)
    sel = replay(path, batches=("mb-0001",)).bundles[0].selection
    assert sel.partial is False  # every group touched: the closure is the whole bundle


def test_combined_selection_is_the_union_of_closures(tmp_path: Path) -> None:
    path, _ = write_consistent(tmp_path / "b", groups=4, n=4, micro_batch_size=4)
    sel = replay(path, samples=("s-0",), groups=("g-2",), batches=("mb-0003",)).bundles[0].selection
    assert sel.positions.tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15]


def test_unknown_sample_is_refused(tmp_path: Path) -> None:
    path, _ = write_consistent(tmp_path / "b")
    with pytest.raises(SelectionError, match="sample s-999 not found"):
        replay(path, samples=("s-999",))


def test_batch_selection_without_micro_batch_ids_is_refused(tmp_path: Path) -> None:
    path, _ = write_consistent(tmp_path / "b", micro_batch_size=None)
    with pytest.raises(SelectionError, match="no micro_batch_id"):
        replay(path, batches=("mb-0000",))


def test_selection_on_faulty_bundle_reports_only_selected_samples(tmp_path: Path) -> None:
    path, _ = write_consistent(
        tmp_path / "b", interleave=True, faults=Faults(physical_batch_norm=12)
    )
    post = stage(replay(path, groups=("g-1",)), "reward.post_process")
    members = {f"s-{i}" for i in range(1, 32, 4)}
    assert {d.sample_id for d in post.divergences} <= members
    assert post.status == "fail"


# --------------------------------------------------------------------------- cohorts


def test_cohort_verdict_names_the_divergent_rank(tmp_path: Path) -> None:
    path = write_consistent_cohort(
        tmp_path / "c", ranks=2, faults_by_rank={1: Faults(kl_type="k1")}, groups=2, n=4
    )
    report = replay(path)
    assert report.first_divergent_stage == "advantage.kl"
    assert report.first_divergent_rank == 1
    assert report.exit_code == 1


def test_clean_cohort_passes_on_every_rank(tmp_path: Path) -> None:
    path = write_consistent_cohort(tmp_path / "c", ranks=2, groups=2, n=4)
    report = replay(path)
    assert len(report.bundles) == 2
    assert report.exit_code == 0


def test_cohort_selection_replays_only_the_rank_holding_the_group(tmp_path: Path) -> None:
    path = write_consistent_cohort(tmp_path / "c", ranks=2, groups=2, n=4)
    report = replay(path, groups=("g-3",))
    assert [b.rank for b in report.bundles] == [1]


def test_every_stage_is_a_versioned_unit_with_declared_inputs_and_outputs() -> None:
    from trajstore.replay import builtin  # noqa: F401  (registers the built-in stages)
    from trajstore.replay.registry import registered_stages
    from trajstore.vocab import STAGE_ORDER

    assert [unit.name for unit in registered_stages()] == list(STAGE_ORDER)
    for unit in registered_stages():
        assert unit.version
        if unit.run is not None:  # loss.value is never recomputed
            assert unit.inputs and unit.compared_with, unit.name
    report = replay(FIXTURES / "example_bundle")
    assert {s.version for s in report.bundles[0].stages} == {"v1"}
