"""The ref index's live view is updated by what each refresh reads (not rebuilt from every
ref): after publishes, removals, recaptures and refs written by another process, it is
what a fresh index built from the same refs says, and a view handed out earlier stays as
it was."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import make_contents
from test_store import cli

from trajstore.bundle.writer import write_bundle
from trajstore.store import Store
from trajstore.store.layout import RefIndex

pytestmark = pytest.mark.integration


def _capture(root: Path, steps: range, *, seed: int = 0, rollout_id: int = 7) -> Path:
    for s in steps:
        write_bundle(
            root / f"replay-{rollout_id}-{s}",
            make_contents(lengths=40, rollout_id=rollout_id, step_id=s, seed=seed + s),
        )
    return root


def _fresh(store: Store) -> RefIndex:
    return RefIndex(store.space)


def _anchors(index: RefIndex) -> dict[tuple, list[str]]:
    """Every live anchor's keys, as `at_anchor` gives them (order aside)."""
    return {
        a: sorted(e.key for e in index.at_anchor(*a))
        for a in {(e.run, e.kind, e.rollout_id, e.step_id) for e in index.live().values()}
    }


def _same_as_fresh(store: Store) -> None:
    fresh = _fresh(store)
    assert store.refs.live() == fresh.live()
    assert _anchors(store.refs) == _anchors(fresh)


def test_new_refs_join_the_live_view(tmp_path: Path) -> None:
    with Store.open(tmp_path / "st") as store:
        store.ingest([_capture(tmp_path / "a", range(3))], run="r")
        assert len(store.refs.live()) == 3 and _anchors(store.refs)  # built, then updated
        store.ingest([_capture(tmp_path / "b", range(3, 6))], run="r")
        assert sorted(store.refs.live()) == [f"r/step-7-{s}/a1" for s in range(6)]
        _same_as_fresh(store)


def test_a_removed_bundle_leaves_the_live_view_and_its_anchor(tmp_path: Path) -> None:
    with Store.open(tmp_path / "st") as store:
        store.ingest([_capture(tmp_path / "a", range(3))], run="r")
        store.refs.live(), _anchors(store.refs)
        store.remove(["r/step-7-1/a1"])
        assert "r/step-7-1/a1" not in store.refs.live()
        assert store.refs.at_anchor("r", "step", 7, 1) == []
        _same_as_fresh(store)


def test_a_recapture_replaces_the_older_attempt(tmp_path: Path) -> None:
    with Store.open(tmp_path / "st") as store:
        store.ingest([_capture(tmp_path / "a", range(2))], run="r")
        store.refs.live(), _anchors(store.refs)
        store.ingest([_capture(tmp_path / "b", range(1), seed=50)], run="r")
        live = store.refs.live()
        assert sorted(live) == ["r/step-7-0/a1", "r/step-7-0/a2", "r/step-7-1/a1"]
        assert sorted(e.attempt for e in store.refs.at_anchor("r", "step", 7, 0)) == [1, 2]
        _same_as_fresh(store)


def test_a_key_published_again_after_its_removal_is_live_again(tmp_path: Path) -> None:
    """The tombstone is older than the new ref of the same key: the key is live."""
    cap = _capture(tmp_path / "a", range(2))
    with Store.open(tmp_path / "st") as store:
        store.ingest([cap], run="r")
        store.refs.live(), _anchors(store.refs)
        store.remove(run="r")
        assert store.refs.live() == {}
        store.ingest([cap], run="r")
        assert sorted(store.refs.live()) == ["r/step-7-0/a1", "r/step-7-1/a1"]
        _same_as_fresh(store)


def test_refs_another_process_publishes_and_removes_are_read_in(tmp_path: Path) -> None:
    st = tmp_path / "st"
    with Store.open(st) as store:
        store.ingest([_capture(tmp_path / "a", range(3))], run="r")
        store.refs.live(), _anchors(store.refs)
        proc = cli("ingest", _capture(tmp_path / "b", range(3, 5)), "--store", st, "--run", "r")
        assert proc.returncode == 0, proc.stderr
        proc = cli("rm", "--store", st, "r/step-7-0/a1")
        assert proc.returncode == 0, proc.stderr
        store.refs.invalidate()  # the same second: a directory's mtime may not show it
        assert sorted(store.refs.live()) == [f"r/step-7-{s}/a1" for s in range(1, 5)]
        _same_as_fresh(store)


def test_a_view_handed_out_before_an_update_stays_as_it_was(tmp_path: Path) -> None:
    with Store.open(tmp_path / "st") as store:
        store.ingest([_capture(tmp_path / "a", range(2))], run="r")
        before = store.refs.live()
        kept = dict(before)
        store.remove(["r/step-7-0/a1"])
        store.ingest([_capture(tmp_path / "b", range(2, 3))], run="r")
        assert before == kept
        assert store.refs.live() != before


def test_a_ref_arriving_late_with_an_older_name_does_not_replace_the_newer(
    tmp_path: Path,
) -> None:
    """A writer whose clock is behind publishes a ref named before the newest one of its
    key (here before the tombstone too): the newer ref stays live."""
    cap = _capture(tmp_path / "a", range(1))
    with Store.open(tmp_path / "st") as store:
        store.ingest([cap], run="r")
        first = store.refs.live()["r/step-7-0/a1"].name
        store.remove(["r/step-7-0/a1"])
        store.ingest([cap], run="r")
        newer = store.refs.live()["r/step-7-0/a1"].name
        refs = tmp_path / "st" / "refs" / "bundles"
        lagging = f"{int(first.split('-')[0]) - 1:020d}-1-000000000000"
        (refs / f"{lagging}.json").write_bytes((refs / f"{first}.json").read_bytes())
        store.refs.invalidate()
        assert {k: e.name for k, e in store.refs.live().items()} == {"r/step-7-0/a1": newer}
        _same_as_fresh(store)


def test_an_unreadable_ref_is_a_problem_and_not_live(tmp_path: Path) -> None:
    from trajstore.store.layout import new_doc_name

    with Store.open(tmp_path / "st") as store:
        store.ingest([_capture(tmp_path / "a", range(1))], run="r")
        store.refs.live()
        bad = new_doc_name()
        (tmp_path / "st" / "refs" / "bundles" / f"{bad}.json").write_bytes(b"{not json")
        store.ingest([_capture(tmp_path / "b", range(1, 2))], run="r")
        assert sorted(store.refs.live()) == ["r/step-7-0/a1", "r/step-7-1/a1"]
        assert [p.split(":")[0] for p in store.refs.problems] == [f"ref {bad}"]
        _same_as_fresh(store)


def test_a_create_in_progress_is_read_once_it_is_a_document(tmp_path: Path) -> None:
    """A dot-named temp file and a folder in the refs folder are not refs: they are listed
    (and remembered as listed) without being read, and the ref a rename then creates is."""
    with Store.open(tmp_path / "st") as store:
        store.ingest([_capture(tmp_path / "a", range(2))], run="r")
        assert len(store.refs.live()) == 2
        folder = store.root / "refs" / "bundles"
        first = sorted(folder.iterdir())[0]
        late = f"{first.name[:-5]}0.json"  # sorts among the others: not only the newest is new
        (folder / f".{late}.tmp").write_bytes(first.read_bytes())
        (folder / "not-a-ref.json").mkdir()
        store.refs.invalidate()
        reads = store.refs.reads
        assert len(store.refs.live()) == 2 and store.refs.reads == reads
        (folder / f".{late}.tmp").rename(folder / late)
        store.refs.invalidate()
        store.refs.live()
        assert store.refs.reads == reads + 1  # the renamed one, and nothing listed before
        _same_as_fresh(store)
