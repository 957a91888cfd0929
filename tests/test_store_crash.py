"""Crash safety and concurrency of the store,
with real processes (SIGKILL, SIGINT, parallel ingests)."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import make_contents
from inprocess_cli import cli
from store_checks import visible_bundles

from trajstore.bundle.writer import write_bundle, write_rank
from trajstore.store import Store

pytestmark = pytest.mark.integration


def _capture(
    root: Path, steps: list[int], *, cohort_step: int | None = None, tokens: int = 4000
) -> list[Path]:
    out = []
    for s in steps:
        dest = root / f"replay-7-{s}"
        if s == cohort_step:
            for r in (0, 1):
                write_rank(
                    dest,
                    make_contents(
                        lengths=tokens, step_id=s, rank=r, world=2, seed=s, bundle_id="c"
                    ),
                    rank=r,
                    expected_ranks=[0, 1],
                )
        else:
            write_bundle(dest, make_contents(lengths=tokens, step_id=s, seed=s))
        out.append(dest)
    return out


def _ingest_cmd(st: Path | str, *paths: Path) -> list[str]:
    return [sys.executable, "-m", "trajstore", "ingest", "--store", str(st), *map(str, paths)]


def test_sigkill_at_random_points_leaves_a_consistent_store(tmp_path: Path, store_url: str) -> None:
    targets = _capture(tmp_path / "cap", list(range(6)), cohort_step=3, tokens=12000)
    # Calibrate kill points to this machine: how long does a whole ingest take?
    t0 = time.monotonic()
    subprocess.run(
        _ingest_cmd(store_url + "-scratch", tmp_path / "cap"), check=True, capture_output=True
    )
    full = time.monotonic() - t0
    st = store_url  # a directory or an s3:// prefix (conftest.store_url)
    Store.open(st).close()
    rng = random.Random(1234)
    for _ in range(3 if "://" in st else 5):  # fewer kills on S3: test-time budget
        proc = subprocess.Popen(
            _ingest_cmd(st, tmp_path / "cap"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        time.sleep(rng.uniform(0.3, 0.95) * full)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        fs = cli("fsck", "--store", st)
        assert fs.returncode == 0, fs.stderr
        visible_bundles(st, targets, tmp_path)
    done = cli("ingest", "--store", st, tmp_path / "cap")
    assert done.returncode == 0, done.stderr
    assert visible_bundles(st, targets, tmp_path) == len(targets)
    assert cli("fsck", "--store", st).returncode == 0


def test_two_ingests_and_a_reader_all_succeed(tmp_path: Path, store_url: str) -> None:
    a = _capture(tmp_path / "a", [0, 1, 2], tokens=2000)
    b = _capture(tmp_path / "b", [3, 4, 5], cohort_step=4, tokens=2000)
    st = store_url  # a directory or an s3:// prefix (conftest.store_url)
    Store.open(st).close()
    reader = (
        "import sys; from trajstore.store import Store\n"
        "s = Store.open(sys.argv[1])\n"
        "for _ in range(6): s.bundles()\n"
    )
    procs = [
        subprocess.Popen(_ingest_cmd(st, tmp_path / "a"), stderr=subprocess.PIPE, text=True),
        subprocess.Popen(_ingest_cmd(st, tmp_path / "b"), stderr=subprocess.PIPE, text=True),
        subprocess.Popen(
            [sys.executable, "-c", reader, str(st)], stderr=subprocess.PIPE, text=True
        ),
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    keys = {row["key"] for row in Store.open(st).bundles()}
    assert len(keys) == 7  # 5 single bundles + 2 ranks
    assert visible_bundles(st, a + b, tmp_path) == 6


# -- Ctrl-C in the middle of an ingest ------------------------------------------------
#
# The source holds steps 0..3 with step 2 a cohort whose rank-1 COMPLETE is a named
# pipe: the ingest publishes steps 0 and 1, then blocks reading the pipe (the gate of
# step 2). The test opens the pipe's write end, which succeeds only once the ingest
# has it open for reading, so SIGINT lands while the ingest is provably in progress,
# with no sleep. Steps 10 and 11 were stored by an earlier ingest.

INTERRUPTED_STEP = 2


@dataclass
class Interrupted:
    """An ingest stopped by SIGINT at step 2, and what it left behind."""

    store: Path
    source: Path
    earlier: list[Path]  # stored by a previous ingest
    targets: list[Path]  # the interrupted ingest's source bundles, in ingest order
    proc: subprocess.CompletedProcess


def _open_write_end_once_read(pipe: Path, proc: subprocess.Popen) -> int:
    """The pipe's write end, once `proc` has opened it for reading (ENXIO until then)."""
    while True:
        try:
            return os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(
                f"ingest ended (rc {proc.returncode}) before reading the pipe:\n{out}\n{err}"
            )
        time.sleep(0.01)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory) -> Interrupted:
    tmp = tmp_path_factory.mktemp("ctrl-c")
    st = tmp / "st"
    earlier = _capture(tmp / "earlier", [10, 11])
    assert cli("ingest", "--store", st, tmp / "earlier").returncode == 0
    targets = _capture(tmp / "cap", list(range(4)), cohort_step=INTERRUPTED_STEP)
    pipe = targets[INTERRUPTED_STEP] / "rank-1" / "COMPLETE"
    complete = pipe.read_bytes()
    pipe.unlink()
    os.mkfifo(pipe)
    proc = subprocess.Popen(
        _ingest_cmd(st, tmp / "cap"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    fd = _open_write_end_once_read(pipe, proc)
    try:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        os.close(fd)
    pipe.unlink()  # the source is whole again, for the re-run
    pipe.write_bytes(complete)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return Interrupted(st, tmp / "cap", earlier, targets, done)


def _visible_keys(st: Path) -> set[str]:
    ls = cli("ls", "--store", st, "--json")
    assert ls.returncode == 0, ls.stderr
    return {row["key"] for row in json.loads(ls.stdout)}


def _step_keys(*steps: int) -> set[str]:
    return {f"default/step-7-{s}/a1" for s in steps}


def test_ctrl_c_exits_130_and_names_what_was_stored(interrupted: Interrupted) -> None:
    p = interrupted.proc
    assert p.returncode == 130, p.stderr
    assert [line.split()[0] for line in p.stdout.splitlines()] == ["published", "published"]
    assert [line.split()[1].rstrip(":") for line in p.stdout.splitlines()] == [
        str(t) for t in interrupted.targets[:2]
    ]
    assert p.stderr.strip().splitlines()[-1] == (
        "trajstore: interrupted after 2 target(s) were stored; "
        "run the same ingest again to store the rest (stored ones are skipped)"
    )


def test_ctrl_c_leaves_a_store_that_fsck_passes(interrupted: Interrupted) -> None:
    fs = cli("fsck", "--store", interrupted.store)
    assert fs.returncode == 0, fs.stderr


def test_ctrl_c_leaves_only_complete_bundles_in_the_catalog(interrupted: Interrupted) -> None:
    assert _visible_keys(interrupted.store) == _step_keys(10, 11, 0, 1)


def test_ctrl_c_keeps_earlier_and_finished_bundles_intact(
    interrupted: Interrupted, tmp_path: Path
) -> None:
    finished = interrupted.earlier + interrupted.targets[:INTERRUPTED_STEP]
    assert visible_bundles(interrupted.store, finished, tmp_path) == len(finished)


def test_rerun_after_ctrl_c_stores_the_rest(interrupted: Interrupted, tmp_path: Path) -> None:
    st = tmp_path / "st"
    shutil.copytree(interrupted.store, st)  # the other tests see the interrupted store
    rerun = cli("ingest", "--store", st, interrupted.source)
    assert rerun.returncode == 0, rerun.stderr
    assert [line.split()[0] for line in rerun.stdout.splitlines()] == [
        "unchanged",
        "unchanged",
        "published",
        "published",
    ]
    assert _visible_keys(st) == _step_keys(10, 11, 0, 1, 3) | {
        f"default/step-7-{INTERRUPTED_STEP}/rank-{r}/a1" for r in (0, 1)
    }
    every = interrupted.earlier + interrupted.targets
    assert visible_bundles(st, every, tmp_path) == len(every)
    assert cli("fsck", "--store", st).returncode == 0
