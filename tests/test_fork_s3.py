"""Worker processes and an s3:// store: obstore's runtime does not survive a fork.

The first S3 request of a process starts obstore's process-wide runtime (tokio
threads); a process forked after that has none of those threads, and its first
request waits for them forever. So once obstore is loaded the local executor's
workers come from a fork server, never from a fork of the command that has just
listed the store, and a process that was forked after S3 use (a user's own fork, a
capture writer thread in it) gets one clear error instead of hanging; capture's writer
process (the default) is started, not forked, and publishes.

A command that hangs never returns: each runs in its own session under a generous
harness timeout (`HANG_S`, not a measured bound), after which it and every process
it started are killed and the test fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from trajstore.examples.replay_builders import write_consistent

from trajstore.store import Store

pytestmark = pytest.mark.integration

#: how long a command may take before it is taken to hang (minutes of margin: the old
#: code parked its workers for good)
HANG_S = 300
TESTS = Path(__file__).resolve().parent
BUNDLES = 3


def run(what: str, args: list[str]) -> subprocess.CompletedProcess:
    """`args` to completion, or a test failure naming `what` once it has run `HANG_S`."""
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the command and every worker it forked
        out, err = proc.communicate()
        pytest.fail(f"{what}: still running after {HANG_S} s, killed\n{err[-2000:]}")
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def _capture(root: Path) -> Path:
    for s in range(BUNDLES):
        write_consistent(root / f"replay-3-{s}", kind="step", rollout_id=3, step_id=s, seed=s)
    return root


def test_replay_all_on_two_local_workers_on_s3_finishes(s3_env: Any, tmp_path: Path) -> None:
    url = s3_env.fresh_url("fork-replay")
    with Store.open(url) as store:
        assert {o.status for o in store.ingest([_capture(tmp_path / "cap")])} == {"published"}
    proc = run(
        "replay --all --workers 2",
        [sys.executable, "-m", "trajstore", "replay", "--store", url, "--all", "--record"]
        + ["--workers", "2", "--json"],
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert (summary["total"], summary["pass"], summary["refused"]) == (BUNDLES, BUNDLES, 0)
    with Store.open(url, create=False) as store:  # each bundle's result written once
        assert len(store.space.list("results")) == BUNDLES


INGEST_ON_TWO_WORKERS = """
import sys
from trajstore.executors import ExecutorSpec
from trajstore.store.ingest_batch import ingest_on_executor
outcomes = ingest_on_executor(sys.argv[1], [sys.argv[2]], "r", ExecutorSpec("local", 2))
print(" ".join(sorted(o.status for o in outcomes)))
"""


def test_ingest_on_two_local_workers_on_s3_finishes(s3_env: Any, tmp_path: Path) -> None:
    url = s3_env.fresh_url("fork-ingest")
    cap = _capture(tmp_path / "cap")
    # the parent opens (creates) the store before it starts the workers
    proc = run("ingest on 2 workers", [sys.executable, "-c", INGEST_ON_TWO_WORKERS, url, str(cap)])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["published"] * BUNDLES
    with Store.open(url, create=False) as store:
        assert sorted(b["key"] for b in store.bundles()) == [
            f"r/step-3-{s}/a1" for s in range(BUNDLES)
        ]


#: a process that used the store, then forks; the child captures one step into it
CAPTURE_IN_A_FORKED_CHILD = """
import logging, os, sys
sys.path.insert(0, sys.argv[2])
from test_capture import one_step
from trajstore.capture import CaptureConfig, CaptureManager
from trajstore.store import Store

logging.basicConfig(level=logging.ERROR, format="%(message)s")
url = sys.argv[1]
Store.open(url).close()  # S3 requests: this process's runtime is started
pid = os.fork()
if pid == 0:
    config = CaptureConfig(enabled=True, store_dir=url, run="t", block=True, writer=sys.argv[3])
    cap = CaptureManager(config)
    one_step(cap, 0, 0)
    stats = cap.close()
    os._exit(10 + stats.errors)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_capture_in_a_process_forked_after_s3_use_counts_a_clear_error_not_a_hang(
    s3_env: Any, tmp_path: Path
) -> None:
    """The writer thread would make the forked process's S3 requests itself."""
    url = s3_env.fresh_url("fork-capture")
    proc = run(
        "capture in a forked child",
        [sys.executable, "-c", CAPTURE_IN_A_FORKED_CHILD, url, str(TESTS), "thread"],
    )
    assert proc.returncode == 11, proc.stderr  # the child counted one error, and returned
    why = [line for line in proc.stderr.splitlines() if "was forked from one" in line]
    assert len(why) == 1 and "'spawn' or 'forkserver'" in why[0], proc.stderr
    with Store.open(url, create=False) as store:
        assert store.bundles() == []


def test_capture_in_a_process_forked_after_s3_use_publishes_through_the_writer_process(
    s3_env: Any, tmp_path: Path
) -> None:
    """The writer process is started, not forked: its S3 runtime is its own."""
    url = s3_env.fresh_url("fork-capture-process")
    proc = run(
        "capture in a forked child, writer process",
        [sys.executable, "-c", CAPTURE_IN_A_FORKED_CHILD, url, str(TESTS), "process"],
    )
    assert proc.returncode == 10, proc.stderr  # no error counted
    with Store.open(url, create=False) as store:
        assert [(b["rollout_id"], b["step_id"]) for b in store.bundles()] == [(0, 0)]
