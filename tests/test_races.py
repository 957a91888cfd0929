"""Races on one store, with real processes (issue 18 item 3).

`gc --grace 0` in a loop while two ingests and a replay-all run: no published
bundle loses an object, no reader sees a partial bundle (the gc lock,
trajstore.store.gclock, makes the grace rule hold at 0). `rm` of a run while
`trajstore serve` serves it: 404 afterwards, never a 500.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import make_contents
from inprocess_cli import cli
from serving import served
from store_checks import visible_bundles

from trajstore.bundle.writer import write_bundle, write_rank
from trajstore.store import Store
from trajstore.store.maintenance import fsck, gc

pytestmark = pytest.mark.integration

#: a loop of CLI passes in one process (`trajstore.cli.main`, no interpreter start per
#: pass) up to a pass that began after the stop file appeared; writes
#: "<passes> <bad exits> <objects dropped by gc, or bundles replayed>"
LOOP = """
import contextlib, io, json, os, sys
from trajstore.cli import main
stop, out, ok = sys.argv[1], sys.argv[2], {int(c) for c in sys.argv[3].split(",")}
argv = sys.argv[4:]
passes = bad = dropped = 0
done = False
while not done:  # at least one pass, and one more after the stop file appears
    done = os.path.exists(stop)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    passes += 1
    if rc not in ok:
        bad += 1
        sys.stderr.write(f"exit {rc}\\n")
    elif argv[0] == "gc":
        dropped += json.loads(buf.getvalue())["objects_dropped"]
    else:  # replay --json: bundles replayed; a refused (unreadable) one counts as bad
        report = json.loads(buf.getvalue())
        dropped += report["total"]
        bad += report["refused"]
with open(out, "w") as f:
    f.write(f"{passes} {bad} {dropped}")
"""


def _capture(
    root: Path, steps: range, tokens: int = 1500, seed: int = 0, cohort: int | None = None
) -> list[Path]:
    """Bundles of steps 7:s (step `cohort` a 2-rank cohort); the same `seed` gives the
    same content (deduplicated)."""
    out = []
    for s in steps:
        dest = root / f"replay-7-{s}"
        if s == cohort:
            for r in (0, 1):
                contents = make_contents(
                    lengths=tokens, step_id=s, seed=seed + s, rank=r, world=2, bundle_id="c"
                )
                write_rank(dest, contents, rank=r, expected_ranks=[0, 1])
        else:
            write_bundle(dest, make_contents(lengths=tokens, step_id=s, seed=seed + s))
        out.append(dest)
    return out


def _loop(tmp: Path, name: str, ok: str, *argv: str) -> tuple[subprocess.Popen, Path]:
    out = tmp / f"{name}.out"
    proc = subprocess.Popen(
        [sys.executable, "-c", LOOP, str(tmp / "stop"), str(out), ok, *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, out


def test_gc_grace_0_in_a_loop_beside_two_ingests_and_a_replay_all(tmp_path: Path) -> None:
    st = tmp_path / "store"
    # Garbage the ingests will deduplicate against (steps 0-9: whether a gc pass sees it
    # before an ingest re-references it is the race), and some they will not (steps 10-11:
    # whichever pass comes first collects it): run "old" stored, then removed.
    old = _capture(tmp_path / "old", range(0, 12))
    assert cli("ingest", "--store", st, "--run", "old", tmp_path / "old").returncode == 0
    assert cli("rm", "--store", st, "--run", "old").returncode == 0
    # Two ingests of overlapping content (step 5 a 2-rank cohort): each deduplicates
    # against the other's objects.
    a = _capture(tmp_path / "a", range(0, 8), cohort=5)
    b = _capture(tmp_path / "b", range(2, 10), cohort=5)
    assert old and a and b
    gc_proc, gc_out = _loop(tmp_path, "gc", "0", "gc", "--store", str(st), "--grace", "0", "--json")
    # every run: `--run a` is refused (exit 2) until a's first bundle is published
    replay_proc, replay_out = _loop(
        tmp_path, "replay", "0,1", "replay", "--store", str(st), "--all", "--json"
    )
    ingests = [
        subprocess.Popen(
            [sys.executable, "-m", "trajstore", "ingest", "--store", str(st), "--run", run, str(p)],
            stderr=subprocess.PIPE,
            text=True,
        )
        for run, p in (("a", tmp_path / "a"), ("b", tmp_path / "b"))
    ]
    try:
        for p in ingests:
            _, err = p.communicate(timeout=240)
            assert p.returncode == 0, err
    finally:
        (tmp_path / "stop").touch()
    for proc in (gc_proc, replay_proc):
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
    gc_passes, gc_bad, dropped = map(int, gc_out.read_text().split())
    replays, replay_bad, replayed = map(int, replay_out.read_text().split())
    print(
        f"gc passes {gc_passes} (objects dropped {dropped}), "
        f"replay-all passes {replays} ({replayed} bundles replayed)"
    )
    assert gc_bad == 0 and replay_bad == 0
    assert gc_passes >= 2 and replays >= 1 and replayed >= 1
    assert dropped > 0  # the removed run's objects were collected while the ingests ran
    fsck = cli("fsck", "--store", st)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    assert visible_bundles(st, a, tmp_path, run="a") == 8
    assert visible_bundles(st, b, tmp_path, run="b") == 8
    done = cli("replay", "--store", st, "--all", "--run", "b")
    assert done.returncode in (0, 1), done.stderr


def test_a_writer_whose_index_predates_a_gc_stores_the_swept_objects_again(
    tmp_path: Path,
) -> None:
    """A long-lived writer knows objects from before a gc swept them (its in-memory
    pack index): its next ingest of the same content must write them again."""
    st = tmp_path / "store"
    cap = _capture(tmp_path / "cap", range(0, 2))
    with Store.open(st) as writer:
        writer.ingest(cap, run="old")
        writer.remove(run="old")
        with Store.open(st) as other:
            assert gc(other, grace_s=0)["objects_dropped"] > 0
        assert {o.status for o in writer.ingest(cap, run="new")} == {"published"}
    assert fsck(Store.open(st, create=False)).ok
    assert visible_bundles(st, cap, tmp_path, run="new") == 2


# -- rm while serving -------------------------------------------------------------


@pytest.fixture
def serving_store(tmp_path: Path) -> Iterator[tuple[Path, httpx.Client]]:
    st = tmp_path / "store"
    with Store.open(st) as store:
        for seed, run in ((0, "keep"), (100, "gone")):
            outs = store.ingest(_capture(tmp_path / run, range(0, 3), seed=seed), run=run)
            assert {o.status for o in outs} == {"published"}
    with (
        served(st) as (_, port),
        httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client,
    ):
        yield st, client


def _urls(client: httpx.Client, run: str) -> list[str]:
    detail = client.get(f"/v1/runs/{run}/steps/7:1")
    assert detail.status_code == 200, detail.text
    key = detail.json()["bundles"][0]["key"]
    return [
        f"/v1/runs/{run}/steps/7:1",
        f"/v1/bundles/{key}",
        f"/v1/bundles/{key}/samples",
        f"/v1/bundles/{key}/payloads/log_probs?format=raw",
        f"/v1/bundles/{key}/payloads/kl?format=npy&sample=s-1",
    ]


def test_rm_of_a_served_run_answers_404_afterwards_never_500(
    serving_store: tuple[Path, httpx.Client],
) -> None:
    st, client = serving_store
    gone, keep = _urls(client, "gone"), _urls(client, "keep")
    seen: dict[int, int] = {}
    errors: list[str] = []
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            for u in gone + keep:
                r = client.get(u)
                seen[r.status_code] = seen.get(r.status_code, 0) + 1
                if r.status_code not in ((200,) if u in keep else (200, 404)):
                    errors.append(f"{u}: {r.status_code} {r.text[:200]}")

    threads = [threading.Thread(target=hammer) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        rm = cli("rm", "--store", st, "--run", "gone")
        assert rm.returncode == 0, rm.stderr
        gc = cli("gc", "--store", st, "--grace", "0", "--json")  # its objects go too
        assert gc.returncode == 0, gc.stderr
        assert json.loads(gc.stdout)["objects_dropped"] > 0
        # The server notices the tombstone within its poll interval; from then on, 404.
        deadline = time.monotonic() + 30
        while client.get(gone[0]).status_code != 404:
            assert time.monotonic() < deadline, "the removed run is still served"
            time.sleep(0.1)
        time.sleep(1.0)  # the hammering threads keep asking after the 404 too
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    print(f"status counts while rm and gc ran: {seen}")
    assert not errors, errors[:5]
    for u in gone:
        r = client.get(u)
        assert r.status_code == 404 and r.json()["error"] == "not_found", (u, r.text)
    for u in keep:
        assert client.get(u).status_code == 200, u


# -- where no lock reaches every writer -------------------------------------------


def test_gc_refuses_a_short_grace_on_an_s3_store(s3_env, tmp_path: Path) -> None:  # noqa: ANN001
    """On S3 nothing stops gc from sweeping another host's in-flight ingest: the CLI
    refuses a grace under 10 minutes there, in one line, and keeps the store as it was."""
    url = s3_env.fresh_url("grace")
    with Store.open(url) as store:
        store.ingest(_capture(tmp_path / "cap", range(0, 1)), run="r")
    proc = cli("gc", "--store", url, "--grace", "0")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("trajstore: error: gc --grace 0s refused on s3://") and "10m" in line
    assert cli("gc", "--store", url, "--grace", "10m").returncode == 0
    assert cli("fsck", "--store", url).returncode == 0
