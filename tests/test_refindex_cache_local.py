"""A local store keeps its parsed refs in `<store>/ref-index.json`: a later process reads
only the ref documents published since (and the newest one, to check the cache), and what
it sees is what an index built from every document says, whatever happened in between."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_refindex_incremental import _capture

from trajstore.store import Store, layout
from trajstore.store.api import REF_CACHE
from trajstore.store.layout import RefIndex

pytestmark = pytest.mark.integration


def _store(tmp_path: Path, steps: range) -> Path:
    root = tmp_path / "st"
    with Store.open(root) as store:
        store.ingest([_capture(tmp_path / f"cap-{steps.start}", steps)], run="r")
    return root


def _built_cache(root: Path) -> None:
    """Drop whatever cache there is and build it anew from every ref (a first build writes it)."""
    (root / REF_CACHE).unlink(missing_ok=True)
    with Store.open(root) as store:
        store.refs.live()
    assert (root / REF_CACHE).is_file()


def _open_live(root: Path) -> tuple[dict, int, dict]:
    """(live view, documents this open read, live view of an index without a cache)."""
    with Store.open(root) as store:
        live = store.refs.live()
        return live, store.refs.reads, RefIndex(store.space).live()


def test_a_second_open_reads_only_the_newest_ref_to_check_the_cache(tmp_path: Path) -> None:
    root = _store(tmp_path, range(4))
    _built_cache(root)
    live, reads, fresh = _open_live(root)
    assert reads == 1
    assert live == fresh and len(live) == 4


def test_an_open_without_a_cache_reads_every_ref(tmp_path: Path) -> None:
    root = _store(tmp_path, range(4))
    (root / REF_CACHE).unlink(missing_ok=True)
    with Store.open(root) as store:
        store.refs.live()
        assert store.refs.reads == 4


def test_refs_published_since_the_cache_are_read_and_no_other(tmp_path: Path) -> None:
    root = _store(tmp_path, range(3))
    _built_cache(root)
    with Store.open(root) as other:  # another process's ingest
        other.ingest([_capture(tmp_path / "more", range(3, 5))], run="r")
    cached = (root / REF_CACHE).read_bytes()
    live, reads, fresh = _open_live(root)
    assert reads == 1 + 2
    assert live == fresh and len(live) == 5
    assert (root / REF_CACHE).read_bytes() == cached  # 2 new refs: below the rewrite threshold


def test_a_ref_file_gone_since_the_cache_is_not_live(tmp_path: Path) -> None:
    root = _store(tmp_path, range(4))
    _built_cache(root)
    oldest = sorted((root / "refs" / "bundles").glob("*.json"))[0]
    oldest.unlink()  # by hand: the newest ref (the cache's check) is still there
    live, _, fresh = _open_live(root)
    assert live == fresh and len(live) == 3


def test_a_bundle_removed_since_the_cache_is_not_live(tmp_path: Path) -> None:
    root = _store(tmp_path, range(3))
    _built_cache(root)
    with Store.open(root) as other:
        key = sorted(other.refs.live())[0]
        other.remove([key])
    live, _, fresh = _open_live(root)
    assert key not in live
    assert live == fresh and len(live) == 2


def test_a_recaptured_step_is_its_new_attempt_after_the_cache(tmp_path: Path) -> None:
    root = _store(tmp_path, range(3))
    _built_cache(root)
    with Store.open(root) as other:  # step 1 captured again with other content
        other.ingest([_capture(tmp_path / "again", range(1, 2), seed=50)], run="r")
    live, _, fresh = _open_live(root)
    assert "r/step-7-1/a2" in live
    assert live == fresh and len(live) == 4


def _damage(cache: Path, how: str) -> None:
    doc = json.loads(cache.read_bytes())
    if how == "garbage":
        cache.write_bytes(b"\x00not json{")
        return
    if how == "foreign":
        doc["location"] = "/elsewhere/st"
    elif how == "old-format":
        doc["format"] = "trajstore-refindex-1"
    elif how == "wrong-type":  # the oldest entry's: the newest still reads back the same
        i = doc["refs"]["name"].index(min(doc["refs"]["name"]))
        doc["refs"]["rollout_id"][i] = str(doc["refs"]["rollout_id"][i])
    elif how == "short-column":
        doc["refs"]["key"] = doc["refs"]["key"][:-1]
    elif how == "stale-newest":
        doc["refs"]["content_digest"][-1] = "0" * 64
        i = doc["refs"]["name"].index(max(doc["refs"]["name"]))
        doc["refs"]["content_digest"][i] = "0" * 64
    cache.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    "how", ["garbage", "foreign", "old-format", "wrong-type", "short-column", "stale-newest"]
)
def test_a_damaged_or_foreign_cache_is_ignored_and_every_ref_read(tmp_path: Path, how: str) -> None:
    root = _store(tmp_path, range(4))
    _built_cache(root)
    _damage(root / REF_CACHE, how)
    live, reads, fresh = _open_live(root)
    assert reads >= 4  # a full read (plus the check, when the cache parsed)
    assert live == fresh and len(live) == 4


def test_the_cache_is_rewritten_once_enough_new_refs_were_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(layout, "CACHE_SAVE_MIN", 3)
    root = _store(tmp_path, range(2))
    _built_cache(root)
    with Store.open(root) as other:
        other.ingest([_capture(tmp_path / "more", range(2, 5))], run="r")
    _open_live(root)  # reads the 3 new refs: the threshold, so the cache is rewritten
    live, reads, fresh = _open_live(root)
    assert reads == 1
    assert live == fresh and len(live) == 5
