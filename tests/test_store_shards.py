"""Cohort shards stored rank by rank (trajstore.store.shards), on a directory and on S3."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import make_contents
from store_checks import tree_equal

from trajstore.bundle.writer import write_rank
from trajstore.store import Store, export_bundles
from trajstore.store.maintenance import fsck, gc
from trajstore.store.shards import store_rank_shard

pytestmark = pytest.mark.integration

RANKS = [0, 1]


def _member(root: Path, rank: int, seed: int = 0) -> Path:
    """Rank `rank` of a 2-rank cohort written alone, as on its own host."""
    contents = make_contents(rank=rank, world=2, lengths=20, bundle_id="c", seed=seed)
    return write_rank(root / "replay-7-0", contents, rank=rank, expected_ranks=RANKS)


def test_the_last_shard_publishes_a_cohort_equal_to_a_local_capture(
    store_url: str, tmp_path: Path
) -> None:
    with Store.open(store_url, durable=False) as store:
        first = store_rank_shard(store, _member(tmp_path / "host-1", 1), "r")
        assert not first.published and store.attempts("r", "step", 7, 0) == []
        last = store_rank_shard(store, _member(tmp_path / "host-0", 0), "r")
        assert last.published and last.keys == ["r/step-7-0/rank-0/a1", "r/step-7-0/rank-1/a1"]
        assert store.space.walk("capture") == []  # published: the shards are gone
        out = export_bundles(store.step("r", 7, 0), tmp_path / "out" / "replay-7-0")
    local = tmp_path / "local"
    for r in RANKS:
        _member(local, r)
    assert tree_equal(local / "replay-7-0", out)


def test_gc_keeps_the_objects_of_an_unpublished_shard(store_url: str, tmp_path: Path) -> None:
    with Store.open(store_url, durable=False) as store:
        store_rank_shard(store, _member(tmp_path / "host-1", 1), "r")
        assert gc(store, grace_s=0)["objects_dropped"] == 0
        store_rank_shard(store, _member(tmp_path / "host-0", 0), "r")
        assert fsck(store).ok
        assert [b.rank for b in store.step("r", 7, 0)] == RANKS


def test_a_session_keeps_a_recapture_apart_from_a_dead_ranks_cohort(
    store_url: str, tmp_path: Path
) -> None:
    with Store.open(store_url, durable=False) as store:
        store_rank_shard(store, _member(tmp_path / "old-0", 0, seed=1), "r", session="job-1")
        # rank 1 of job-1 died; job-2 re-captures the step with other numbers
        store_rank_shard(store, _member(tmp_path / "new-1", 1, seed=2), "r", session="job-2")
        last = store_rank_shard(store, _member(tmp_path / "new-0", 0, seed=2), "r", session="job-2")
        assert last.published
        out = export_bundles(store.step("r", 7, 0), tmp_path / "out" / "replay-7-0")
        assert [d.name for d in store.space.walk("capture")] == ["r/step-7-0/s-job-1/rank-0.json"]
    assert tree_equal(tmp_path / "new-0" / "replay-7-0" / "rank-0", out / "rank-0")
