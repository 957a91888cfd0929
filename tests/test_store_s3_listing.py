"""What an S3 store lists per command: with a warm local cache, only what is new (plus the
clock-skew margin), counted by the `listed` counters of the real S3 classes on SeaweedFS;
and that the cache is never trusted blindly (gc'd packs, other hosts, corruption)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_contents
from test_store import cli

from trajstore.bundle.writer import write_bundle
from trajstore.store import Store
from trajstore.store.api import REF_CACHE, store_cache_dir
from trajstore.store.maintenance import fsck, gc

pytestmark = pytest.mark.integration

#: steps published before the command under test
N = 5


def _bundle(tmp: Path, step: int, seed: int = 0) -> Path:
    return write_bundle(
        tmp / f"b{step}-{seed}" / f"replay-7-{step}", make_contents(step_id=step, seed=seed)
    )


def _ingest_each(url: str, tmp: Path, steps: range) -> None:
    """One ingest (one ref, one pack) per step, as separate commands would."""
    for step in steps:
        with Store.open(url) as store:
            store.ingest([_bundle(tmp, step)])


def _log_probs(store: Store, step: int) -> torch.Tensor:
    (b,) = store.step("default", 7, step)
    return b.payload_tensor("log_probs")


@pytest.fixture
def zero_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    """No margin: what is listed beyond the new names is the mark itself, so counts are exact."""
    monkeypatch.setenv("TRAJSTORE_CATALOG_MARGIN_S", "0")


def test_an_open_after_one_ingest_lists_only_the_new_ref_and_pack(
    s3_env: Any, zero_margin: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = s3_env.fresh_url("listing")
    _ingest_each(url, tmp_path, range(N))
    with Store.open(url) as store:  # warms the cache with every ref
        store.refs.live()
    monkeypatch.setenv("TRAJSTORE_CACHE_DIR", str(tmp_path / "host-b"))
    _ingest_each(url, tmp_path, range(N, N + 1))  # another host's ingest
    monkeypatch.setenv("TRAJSTORE_CACHE_DIR", str(tmp_path / "trajstore-cache"))
    with Store.open(url) as warm:
        assert len(_log_probs(warm, N)) > 0
        assert len(warm.refs.live()) == N + 1
        # the newest ref already known (the mark) and the new one; the mark's pack and the
        # new pack (a .pack and an .idx each)
        assert warm.space.listed == 2
        assert warm.objs.listed == 4
    monkeypatch.setenv("TRAJSTORE_CACHE_DIR", str(tmp_path / "cold-cache"))
    with Store.open(url) as cold:  # the baseline: no cache lists everything
        assert len(cold.refs.live()) == N + 1
        assert cold.space.listed == N + 1
        assert cold.objs.listed >= 2 * (N + 1)


def test_the_margin_window_is_listed_again(s3_env: Any, tmp_path: Path) -> None:
    url = s3_env.fresh_url("margin")
    _ingest_each(url, tmp_path, range(2))
    with Store.open(url) as store:
        store.refs.live()
    with Store.open(url) as store:  # everything is younger than the default 300 s margin
        assert len(store.refs.live()) == 2
        assert store.space.listed == 2


def test_another_hosts_new_ref_is_seen(s3_env: Any, zero_margin: None, tmp_path: Path) -> None:
    url = s3_env.fresh_url("hosts")
    _ingest_each(url, tmp_path, range(2))
    with Store.open(url) as store:
        store.refs.live()
        # another host: its own process and cache directory
        proc = cli(
            "ingest",
            "--store",
            url,
            _bundle(tmp_path, 9),
            env={"TRAJSTORE_CACHE_DIR": str(tmp_path / "host-b")},
        )
        assert proc.returncode == 0, proc.stderr
        assert len(_log_probs(store, 9)) > 0  # the open store: a lookup that misses lists
    with Store.open(url) as store:
        assert sorted(e.step_id for e in store.refs.live().values()) == [0, 1, 9]


def test_a_ref_named_before_the_margin_is_found_by_a_lookup(
    s3_env: Any, zero_margin: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer whose clock is behind by more than the margin: its ref sorts before the
    mark; a lookup that misses lists in full and finds it."""
    url = s3_env.fresh_url("skew")
    _ingest_each(url, tmp_path, range(2))
    with Store.open(url) as store:  # this host's cache: steps 0 and 1
        store.refs.live()
    cache = tmp_path / "trajstore-cache"
    monkeypatch.setenv("TRAJSTORE_CACHE_DIR", str(tmp_path / "host-b"))
    with Store.open(url) as store:  # the late host publishes step 5 under an early name
        store.ingest([_bundle(tmp_path, 5)])
        name = next(e.name for e in store.refs.live().values() if e.step_id == 5)
        data = store.space.read(f"refs/bundles/{name}.json")
        store.space.delete(f"refs/bundles/{name}.json")
        assert store.space.create_if_absent(f"refs/bundles/{1:020d}-1-0123456789ab.json", data)
    monkeypatch.setenv("TRAJSTORE_CACHE_DIR", str(cache))
    with Store.open(url) as store:
        assert 5 not in {e.step_id for e in store.refs.live().values()}  # beyond the bound
        assert len(_log_probs(store, 5)) > 0
        assert 5 in {e.step_id for e in store.refs.live().values()}


def test_a_host_whose_clock_runs_ahead_hides_no_later_ref(
    s3_env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ref named an hour ahead raises the mark into the future; listings still start at
    this host's clock less the margin, so a ref published after it is listed."""
    monkeypatch.setenv("TRAJSTORE_CATALOG_MARGIN_S", "60")
    url = s3_env.fresh_url("ahead")
    _ingest_each(url, tmp_path, range(1))
    with Store.open(url) as store:
        store.ingest([_bundle(tmp_path, 1)])
        name = next(e.name for e in store.refs.live().values() if e.step_id == 1)
        data = store.space.read(f"refs/bundles/{name}.json")
        store.space.delete(f"refs/bundles/{name}.json")
        ahead = f"{time.time_ns() + 3600 * 10**9:020d}-1-0123456789ab"
        assert store.space.create_if_absent(f"refs/bundles/{ahead}.json", data)
    with Store.open(url) as store:  # this host's cache now holds the future mark
        assert {e.step_id for e in store.refs.live().values()} == {0, 1}
    monkeypatch.setenv("TRAJSTORE_CACHE_DIR", str(tmp_path / "host-b"))
    _ingest_each(url, tmp_path, range(2, 3))
    monkeypatch.setenv("TRAJSTORE_CACHE_DIR", str(tmp_path / "trajstore-cache"))
    with Store.open(url) as store:
        assert {e.step_id for e in store.refs.live().values()} == {0, 1, 2}


def test_a_pack_that_gc_removed_is_handled_from_a_stale_cache(
    s3_env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = s3_env.fresh_url("gc")
    with Store.open(url) as store:  # both bundles in one pack
        gone = _bundle(tmp_path, 1, seed=2)
        store.ingest([_bundle(tmp_path, 0, seed=1), gone])
    with Store.open(url) as a:
        want = _log_probs(a, 0)
    monkeypatch.setenv("TRAJSTORE_CACHE_DIR", str(tmp_path / "host-b"))
    with Store.open(url) as b:  # another host removes step 1 and rewrites the pack
        b.remove(["default/step-7-1/a1"])
        assert gc(b, grace_s=0)["objects_dropped"] > 0
    monkeypatch.setenv("TRAJSTORE_CACHE_DIR", str(tmp_path / "trajstore-cache"))
    with Store.open(url) as a:  # its cache still names the removed pack
        # ingesting the removed content again uploads it (the cached pack is not trusted)
        a.ingest([gone])
    with Store.open(url) as a:
        assert torch.equal(_log_probs(a, 0), want)  # read from where gc moved it
    monkeypatch.setenv("TRAJSTORE_CACHE_DIR", str(tmp_path / "host-c"))
    with Store.open(url) as c:
        rep = fsck(c, deep=False)
        assert rep.problems == []
        assert len(_log_probs(c, 1)) > 0


@pytest.mark.parametrize("damage", ["garbage", "another store's"])
def test_a_corrupt_or_foreign_ref_cache_is_ignored_and_rebuilt(
    s3_env: Any, tmp_path: Path, damage: str
) -> None:
    url = s3_env.fresh_url("corrupt")
    _ingest_each(url, tmp_path, range(3))
    with Store.open(url) as store:
        store.refs.live()
        cache = store.root / REF_CACHE
    if damage == "garbage":
        cache.write_bytes(b"\x00not json{")
    else:
        other = s3_env.fresh_url("other")
        _ingest_each(other, tmp_path / "o", range(3, 5))
        with Store.open(other) as store:
            store.refs.live()
            marker = store.space.read("TRAJSTORE_STORE")
        foreign = store_cache_dir(other, marker) / REF_CACHE
        doc = json.loads(foreign.read_text())
        doc["location"] = json.loads(cache.read_text())["location"]  # as if copied over
        cache.write_text(json.dumps(doc))
    with Store.open(url) as store:
        assert sorted(e.step_id for e in store.refs.live().values()) == [0, 1, 2]
        assert store.space.listed == 3  # a full listing
    assert json.loads(cache.read_text())["format"] == "trajstore-refindex-2"


def test_list_names_of_an_s3_space_are_the_names_list_gives(s3_env: Any, tmp_path: Path) -> None:
    url = s3_env.fresh_url("names")
    _ingest_each(url, tmp_path, range(2))
    with Store.open(url) as store:
        space = store.space
        assert space.list_names("refs/nothing-here") == []
        names = space.list_names("refs/bundles")
        assert len(names) == 2
        assert names == [d.name for d in space.list("refs/bundles")]
