"""Capture from many hosts into an S3 store (TRAJSTORE_CAPTURE_STORE=s3://...).

Each rank is a separate process with its own temp dir, home and cache (no path
is shared, as on different hosts); they meet only in the S3 server. The last
rank to finish publishes the cohort; a rank killed before it finishes leaves
nothing published.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from test_store import cli

from trajstore.errors import StoreError
from trajstore.store import Store

RANKS = [0, 1]

#: one DP rank of a real tiny GRPO step, captured from the environment's variables;
#: it trains only once the file argv[2] exists (argv[1] is its rank)
RANK_SCRIPT = """
import sys, time
from pathlib import Path
from trajstore.capture import CaptureManager
from trajstore.examples import tiny_grpo

rank, go = int(sys.argv[1]), Path(sys.argv[2])
loop = tiny_grpo.TinyGRPO(seed=rank, tag=f"k{rank}-", group_offset=1000 * rank)
cap = CaptureManager.from_env(recompute=loop.recompute_config(), rank=rank,
                              producer_ranks=[0, 1], rollout_ranks=[0],
                              parallel={"dp": 2, "tp": 1, "pp": 1, "cp": 1})
loop.capture = cap
ro = loop.rollout(0)
while not go.exists():
    time.sleep(0.01)
loop.train_step(ro, 0)
stats = cap.close()
print(stats.written, stats.errors, stats.ingested)
sys.exit(0 if (stats.written, stats.errors) == (2 if rank == 0 else 1, 0) else 3)
"""


def _host(tmp: Path, name: str, s3: Any, url: str) -> tuple[Path, dict[str, str]]:
    """A private directory and environment for one rank ("a host")."""
    home = tmp / name
    (home / "tmp").mkdir(parents=True)
    env = {
        **os.environ,
        **s3.env(),
        "HOME": str(home),
        "TMPDIR": str(home / "tmp"),
        "TRAJSTORE_CACHE_DIR": str(home / "cache"),
        "TRAJSTORE_CAPTURE": "1",
        "TRAJSTORE_CAPTURE_STORE": url,
        "TRAJSTORE_RUN": "mr",
        "TRAJSTORE_CAPTURE_STEPS": "0:0",
    }
    env.pop("TRAJSTORE_CAPTURE_DIR", None)
    return home, env


def _start(rank: int, home: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", RANK_SCRIPT, str(rank), str(home / "go")],
        cwd=home,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _refs(url: str) -> list[str]:
    with Store.open(url, create=False) as store:
        return [d.name for d in store.space.list("refs/bundles")]


def _kinds_once(url: str, want: list[str], timeout_s: float = 120) -> list[str]:
    """The kinds of the published refs once they are `want` (or whatever they are at the
    timeout): a capture publishes from its writer thread, a while after the step."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with Store.open(url, create=False) as store:
                kinds = [e.kind for e in store.refs.all()]
        except StoreError:  # the capture has not created the store yet
            kinds = []
        if kinds == want or time.monotonic() > deadline:
            return kinds
        time.sleep(0.1)


def test_two_ranks_on_two_hosts_publish_one_cohort(s3_env: Any, tmp_path: Path) -> None:
    url = s3_env.fresh_url("capture")
    hosts = {r: _host(tmp_path, f"host-{r}", s3_env, url) for r in RANKS}
    procs = {r: _start(r, *hosts[r]) for r in RANKS}
    # rank 0's rollout bundle is published by its capture writer, in the background
    assert _kinds_once(url, ["rollout"]) == ["rollout"]
    (hosts[1][0] / "go").touch()  # rank 1 first: it stores its shard, publishes nothing
    out1, err1 = procs[1].communicate(timeout=180)
    assert procs[1].returncode == 0, err1
    with Store.open(url, create=False) as store:
        assert [e.kind for e in store.refs.all()] == ["rollout"]  # rank 0's rollout only
    (hosts[0][0] / "go").touch()
    out0, err0 = procs[0].communicate(timeout=180)
    assert procs[0].returncode == 0, err0
    assert out0.split()[2] == "2" and out1.split()[2] == "0"  # rank 0 published the cohort
    with Store.open(url, create=False) as store:
        ranks = store.step("mr", 0, 0)
        assert [b.rank for b in ranks] == RANKS and {b.attempt for b in ranks} == {1}
        assert store.attempts("mr", "step", 0, 0) == [1]
    for r in RANKS:  # nothing stayed in either host's private staging
        assert not any((hosts[r][0] / "tmp").rglob("COMPLETE*"))
    proc = cli("replay", "--store", url, "--run", "mr", "--step", "0:0", "--json")
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["bundles"]) == len(RANKS)


def test_a_rank_killed_before_it_finishes_leaves_no_cohort(s3_env: Any, tmp_path: Path) -> None:
    url = s3_env.fresh_url("killed")
    hosts = {r: _host(tmp_path, f"host-{r}", s3_env, url) for r in RANKS}
    procs = {r: _start(r, *hosts[r]) for r in RANKS}
    (hosts[0][0] / "go").touch()
    _, err0 = procs[0].communicate(timeout=180)
    assert procs[0].returncode == 0, err0
    deadline = time.monotonic() + 120  # rank 1 is alive and has not captured its step
    while procs[1].poll() is None and time.monotonic() < deadline:
        if _refs(url):  # the store exists once rank 0's rollout is in
            break
        time.sleep(0.05)
    assert procs[1].poll() is None
    os.kill(procs[1].pid, signal.SIGKILL)
    procs[1].communicate(timeout=30)
    assert procs[1].returncode == -signal.SIGKILL
    with Store.open(url, create=False) as store:
        assert [e.kind for e in store.refs.all()] == ["rollout"]
        assert store.attempts("mr", "step", 0, 0) == []
        shards = store.space.list("capture/mr/step-0-0/g1")
    assert [d.name for d in shards] == ["rank-0.json"]  # rank 0's shard waits, unpublished
    proc = cli("replay", "--store", url, "--run", "mr", "--step", "0:0")
    assert proc.returncode == 2 and "has no step 0:0" in proc.stderr
