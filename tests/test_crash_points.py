"""`trajstore ingest` killed right after each of its writes, on a local and an S3 store.

The random-moment SIGKILL test (test_store_crash.py) rarely lands between two given
writes. Here the ingest process kills itself (SIGKILL) the moment the n-th write of
one kind has landed, the write points the full-disk sweep found: a pack's body, its
index (the pack's commit point), an attempt claim, a ref guard, a ref. The writes are
seen at the standard library and obstore calls that make them (`os.replace`,
`os.link`, `obstore.put`), so the code under test runs unchanged. After each kill the
store passes `fsck`, every bundle is whole or absent (a cohort with one rank's ref is
absent), and a rerun publishes everything as attempt 1.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from store_checks import visible_bundles
from test_store_crash import _capture

from trajstore.store import Store
from trajstore.store.maintenance import fsck

pytestmark = pytest.mark.integration

#: kills the ingest it runs (argv[3:], the CLI's arguments) right after the argv[2]-th
#: write to a name matching argv[1] (a regular expression) has returned
CRASH_AFTER = r"""
import os, re, signal, sys, threading
import obstore

pattern, nth = re.compile(sys.argv[1]), int(sys.argv[2])
lock = threading.Lock()
seen = 0

def after(real):
    def write(*args, **kwargs):
        global seen
        out = real(*args, **kwargs)
        if pattern.search(str(args[1])):
            with lock:
                seen += 1
                if seen == nth:
                    os.kill(os.getpid(), signal.SIGKILL)
        return out
    return write

os.replace, os.link, obstore.put = after(os.replace), after(os.link), after(obstore.put)
from trajstore.cli import main
sys.exit(main(sys.argv[3:]))
"""

#: what each write point's name looks like (a store directory's path or an S3 key)
WRITES = {
    "pack body": r"(^|/)packs/[^/]+\.pack$",
    "pack index": r"(^|/)packs/[^/]+\.idx$",
    "attempt claim": r"(^|/)claims/[^/]+\.a\d+$",
    "ref guard": r"(^|/)claims/[^/]+\.ref\d+$",
    "ref": r"(^|/)refs/bundles/[^/]+\.json$",
}
#: (write, n, bundles visible after the kill): step 7:0 is one bundle, 7:1 a two-rank
#: cohort; its first ref (the 2nd ref of the ingest) alone must not make it visible
POINTS = [
    ("pack body", 1, 0),
    ("pack index", 1, 0),
    ("attempt claim", 1, 0),
    ("ref guard", 1, 0),
    ("ref", 1, 1),
    ("ref", 2, 1),
]


@pytest.mark.parametrize(
    ("write", "nth", "visible"), POINTS, ids=[f"{w.replace(' ', '-')}-{n}" for w, n, _ in POINTS]
)
def test_a_kill_right_after_a_write_leaves_whole_or_absent_bundles(
    store_url: str, tmp_path: Path, write: str, nth: int, visible: int
) -> None:
    targets = _capture(tmp_path / "cap", [0, 1], cohort_step=1, tokens=300)
    Store.open(store_url).close()
    proc = subprocess.run(
        [sys.executable, "-c", CRASH_AFTER, WRITES[write], str(nth)]
        + ["ingest", "--store", store_url, str(tmp_path / "cap")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr  # it reached that write
    with Store.open(store_url, create=False) as store:
        report = fsck(store)
    assert report.ok, report.problems
    assert visible_bundles(store_url, targets, tmp_path) == visible
    with Store.open(store_url) as store:
        assert {o.status for o in store.ingest([tmp_path / "cap"])} <= {"published", "unchanged"}
        assert [store.attempts("default", "step", 7, s) for s in (0, 1)] == [[1], [1]]
        assert fsck(store).ok
    assert visible_bundles(store_url, targets, tmp_path) == len(targets)


#: (write, n, steps visible after the kill) in a batch of four single bundles, steps 0-3:
#: the batch's objects go to one pack whose flush precedes every ref of the batch, and its
#: refs are created in target order, so a kill leaves a prefix of the targets whole
BATCH_POINTS = [
    ("pack body", 1, []),
    ("pack index", 1, []),
    ("ref guard", 4, []),
    ("ref", 2, [0, 1]),
]


@pytest.mark.parametrize(
    ("write", "nth", "steps"),
    BATCH_POINTS,
    ids=[f"{w.replace(' ', '-')}-{n}" for w, n, _ in BATCH_POINTS],
)
def test_a_kill_inside_a_batch_leaves_a_prefix_of_whole_bundles(
    tmp_path: Path, write: str, nth: int, steps: list[int]
) -> None:
    store_dir = tmp_path / "store"
    targets = _capture(tmp_path / "cap", [0, 1, 2, 3], tokens=300)
    Store.open(store_dir).close()
    proc = subprocess.run(
        [sys.executable, "-c", CRASH_AFTER, WRITES[write], str(nth)]
        + ["ingest", "--store", str(store_dir), str(tmp_path / "cap")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    with Store.open(store_dir, create=False) as store:
        assert fsck(store).ok
        live = sorted(e.step_id for e in store.refs.live().values())
    assert live == steps
    assert visible_bundles(store_dir, targets, tmp_path) == len(steps)  # whole, byte for byte
    with Store.open(store_dir) as store:
        assert {o.status for o in store.ingest([tmp_path / "cap"])} <= {"published", "unchanged"}
        assert [store.attempts("default", "step", 7, s) for s in range(4)] == [[1]] * 4
        assert fsck(store).ok
    assert visible_bundles(store_dir, targets, tmp_path) == 4
