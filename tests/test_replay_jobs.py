"""How `replay --all` cuts its targets into jobs (`replay.batch._chunks`).

A step's linkage check replays its rollout, once per worker process (the rollout cache), so
a rollout id whose targets are cut over two jobs that two workers run at the same time is
replayed by both. These pin the job plan: a rollout id in one job up to GROUP_MAX
targets, small ones sharing a job up to CHUNK, every target exactly once and in order.
"""

from __future__ import annotations

import pytest

from trajstore.replay.batch import CHUNK, GROUP_MAX, BatchTarget, _chunks

pytestmark = pytest.mark.unit


def rollout_id(run: str, rid: int, steps: int) -> list[BatchTarget]:
    """A rollout bundle and its `steps` step bundles, in list_targets' order."""
    first = [BatchTarget(run, "rollout", rid, None, (f"{run}/rollout-{rid}/a1",))]
    return first + [
        BatchTarget(run, "step", rid, s, (f"{run}/step-{rid}-{s}/a1",)) for s in range(steps)
    ]


def test_a_rollout_and_its_four_steps_are_one_job() -> None:
    targets = rollout_id("r", 1, 4) + rollout_id("r", 2, 4)
    assert _chunks(targets, CHUNK) == [tuple(targets[:5]), tuple(targets[5:])]


def test_small_rollout_ids_share_a_job_up_to_chunk() -> None:
    targets = rollout_id("r", 1, 1) + rollout_id("r", 2, 1) + rollout_id("r", 3, 1)
    assert [len(job) for job in _chunks(targets, CHUNK)] == [4, 2]


def test_a_rollout_id_over_group_max_is_cut_in_pieces_of_group_max() -> None:
    targets = rollout_id("r", 1, 2 * GROUP_MAX + 2)
    jobs = _chunks(targets, CHUNK)
    assert [len(job) for job in jobs] == [GROUP_MAX, GROUP_MAX, 3]
    assert [t for job in jobs for t in job] == targets


def test_the_same_rollout_id_of_two_runs_is_two_groups() -> None:
    targets = rollout_id("a", 1, 4) + rollout_id("b", 1, 4)
    assert [{t.run for t in job} for job in _chunks(targets, CHUNK)] == [{"a"}, {"b"}]
