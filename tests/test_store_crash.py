"""Crash safety and concurrency of the store, with real processes (SIGKILL, parallel ingests)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import make_contents
from test_store import cli, tree_equal

from trajstore.bundle.writer import write_bundle, write_rank
from trajstore.errors import NotFoundError
from trajstore.store import Store, export_bundles


def _capture(root: Path, steps: list[int], *, cohort_step: int | None = None, tokens: int = 4000) -> list[Path]:
    out = []
    for s in steps:
        dest = root / f"replay-7-{s}"
        if s == cohort_step:
            for r in (0, 1):
                write_rank(dest, make_contents(lengths=tokens, step_id=s, rank=r, world=2, seed=s, bundle_id="c"), rank=r, expected_ranks=[0, 1])
        else:
            write_bundle(dest, make_contents(lengths=tokens, step_id=s, seed=s))
        out.append(dest)
    return out


def _ingest_cmd(st: Path, *paths: Path) -> list[str]:
    return [sys.executable, "-m", "trajstore", "ingest", "--store", str(st), *map(str, paths)]


def _check_all_or_nothing(st: Path, targets: list[Path], tmp: Path) -> int:
    """Every bundle is fully visible (and exports byte-identical) or absent; returns how many are visible."""
    store = Store.open(st, create=False)
    visible = 0
    for t in targets:
        step = int(t.name.rsplit("-", 1)[1])
        try:
            bundles = store.step("default", 7, step)
        except NotFoundError:
            continue
        out = tmp / f"check-{time.monotonic_ns()}"
        export_bundles(bundles, out)
        assert tree_equal(t, out), t
        visible += 1
    return visible


def test_sigkill_at_random_points_leaves_a_consistent_store(tmp_path: Path) -> None:
    targets = _capture(tmp_path / "cap", list(range(6)), cohort_step=3, tokens=12000)
    # Calibrate kill points to this machine: how long does a whole ingest take?
    t0 = time.monotonic()
    subprocess.run(_ingest_cmd(tmp_path / "scratch", tmp_path / "cap"), check=True, capture_output=True)
    full = time.monotonic() - t0
    st = tmp_path / "st"
    Store.open(st).close()
    rng = random.Random(1234)
    for _ in range(5):
        proc = subprocess.Popen(_ingest_cmd(st, tmp_path / "cap"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.3, 0.95) * full)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        fs = cli("fsck", "--store", st)
        assert fs.returncode == 0, fs.stderr
        _check_all_or_nothing(st, targets, tmp_path)
    done = cli("ingest", "--store", st, tmp_path / "cap")
    assert done.returncode == 0, done.stderr
    assert _check_all_or_nothing(st, targets, tmp_path) == len(targets)
    assert cli("fsck", "--store", st).returncode == 0


def test_two_ingests_and_a_reader_all_succeed(tmp_path: Path) -> None:
    a = _capture(tmp_path / "a", [0, 1, 2], tokens=2000)
    b = _capture(tmp_path / "b", [3, 4, 5], cohort_step=4, tokens=2000)
    st = tmp_path / "st"
    Store.open(st).close()
    reader = (
        "import sys; from trajstore.store import Store\n"
        "s = Store.open(sys.argv[1])\n"
        "for _ in range(6): s.bundles()\n"
    )
    procs = [
        subprocess.Popen(_ingest_cmd(st, tmp_path / "a"), stderr=subprocess.PIPE, text=True),
        subprocess.Popen(_ingest_cmd(st, tmp_path / "b"), stderr=subprocess.PIPE, text=True),
        subprocess.Popen([sys.executable, "-c", reader, str(st)], stderr=subprocess.PIPE, text=True),
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    keys = {row["key"] for row in Store.open(st).bundles()}
    assert len(keys) == 7  # 5 single bundles + 2 ranks
    assert _check_all_or_nothing(st, a + b, tmp_path) == 6


@pytest.mark.skipif(os.name != "posix", reason="SIGINT semantics")
def test_ctrl_c_leaves_a_consistent_store(tmp_path: Path) -> None:
    targets = _capture(tmp_path / "cap", list(range(4)))
    st = tmp_path / "st"
    Store.open(st).close()
    proc = subprocess.Popen(_ingest_cmd(st, tmp_path / "cap"), stderr=subprocess.PIPE, text=True)
    time.sleep(0.8)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    # 130: the CLI caught it; -SIGINT: it landed outside Python code (start-up, shutdown)
    assert proc.returncode in (0, 130, -signal.SIGINT)
    assert cli("fsck", "--store", st).returncode == 0
    _check_all_or_nothing(st, targets, tmp_path)
