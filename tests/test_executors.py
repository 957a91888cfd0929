"""--workers is bounded where it forks: the local executor starts at most
max(64, CPUs) processes (a typo such as 100000 forked until the machine ran out of
processes); a Ray executor only caps tasks in flight, so it takes any positive count."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import make_contents
from test_cli_bundle import assert_clean_failure
from test_store import cli

from trajstore.bundle.writer import write_bundle
from trajstore.errors import UsageError
from trajstore.executors import LOCAL_MAX_WORKERS, ExecutorSpec
from trajstore.store import Store

pytestmark = pytest.mark.unit

CAP = max(LOCAL_MAX_WORKERS, os.cpu_count() or 1)


def test_local_workers_past_the_cap_are_refused_naming_it() -> None:
    with pytest.raises(UsageError, match=f"forks at most {CAP} processes"):
        ExecutorSpec("local", CAP + 1)


def test_local_workers_at_the_cap_are_accepted() -> None:
    assert ExecutorSpec("local", CAP).workers == CAP


def test_ray_workers_are_not_capped() -> None:
    assert ExecutorSpec("ray", 100_000).workers == 100_000


def test_replay_all_with_too_many_workers_exits_2_before_any_work(tmp_path: Path) -> None:
    write_bundle(tmp_path / "cap" / "replay-3-0", make_contents(step_id=0, rollout_id=3))
    with Store.open(tmp_path / "store") as store:
        assert all(o.status == "published" for o in store.ingest([tmp_path / "cap"]))
    # one past the cap: were the check gone, this forks CAP + 1 processes, not 100,000
    over = str(CAP + 1)
    res = cli("replay", "--store", tmp_path / "store", "--all", "--record", "--workers", over)
    lines = assert_clean_failure(res)
    assert lines == [
        f"trajstore: error: --workers {over}: the local executor forks at most {CAP} processes "
        f"({LOCAL_MAX_WORKERS}, or this machine's CPUs if more); use --executor ray for more"
    ]
    assert not list((tmp_path / "store" / "results").rglob("*.json"))
