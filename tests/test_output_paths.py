"""Paths a command cannot use are refused in one line (exit 2) before any work, and a
directory the demo did not make is never deleted by it: `export` under a file,
`ingest` of a plain file, of only missing paths or with an invalid run (no store is made),
`trajstore demo` over a real store."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import make_contents
from test_cli_bundle import assert_clean_failure
from test_store import cli
from trajstore.examples.demo import DEMO_MARK, own_dirs

from trajstore.bundle.writer import write_bundle
from trajstore.store import Store

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("paths")
    write_bundle(root / "cap" / "replay-3-0", make_contents(step_id=0, rollout_id=3))
    with Store.open(root / "store") as store:
        assert all(o.status == "published" for o in store.ingest([root / "cap"]))
    return root / "store"


def test_export_under_a_file_is_refused_naming_it(store_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("kept")
    out = tmp_path / "a-file" / "sub" / "step"
    lines = assert_clean_failure(cli("export", "--store", store_dir, "--step", "3:0", out))
    assert lines == [
        f"trajstore: error: {tmp_path / 'a-file'}: exists and is not a directory (needed for {out})"
    ]
    assert (tmp_path / "a-file").read_text() == "kept"


def test_export_creates_missing_parents(store_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "new" / "dirs" / "step"
    res = cli("export", "--store", store_dir, "--step", "3:0", out)
    assert res.returncode == 0, res.stderr
    assert (out / "manifest.json").is_file()


def test_ingest_of_a_plain_file_is_refused_once(store_dir: Path, tmp_path: Path) -> None:
    f = tmp_path / "bundle.tar"
    f.write_bytes(b"not a directory")
    res = cli("ingest", "--store", store_dir, f)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert (
        res.stderr.strip() == f"trajstore: refused: {f}: not a bundle, cohort or capture directory"
    )


def test_demo_refuses_a_directory_it_did_not_make(tmp_path: Path) -> None:
    real = tmp_path / "store"
    real.mkdir()
    (real / "TRAJSTORE_STORE").write_text("a real store\n")
    res = cli("demo", real)
    assert res.returncode == 2
    assert res.stderr.strip() == (
        f"trajstore demo: error: {real} exists and was not made by the demo "
        f"(no {tmp_path / 'store-work' / DEMO_MARK}); give a new directory, or remove it yourself"
    )
    assert (real / "TRAJSTORE_STORE").read_text() == "a real store\n"
    assert not (tmp_path / "store-work").exists()


def test_demo_refuses_a_file(tmp_path: Path) -> None:
    (tmp_path / "store").write_text("kept")
    assert own_dirs(tmp_path / "store", tmp_path / "store-work") == (
        f"{tmp_path / 'store'}: exists and is not a directory"
    )
    assert (tmp_path / "store").read_text() == "kept"


def test_demo_recreates_what_it_made(tmp_path: Path) -> None:
    store, work = tmp_path / "store", tmp_path / "store-work"
    assert own_dirs(store, work) is None  # new: made, and marked
    store.mkdir()  # the last demo's store
    (store / "old-object").write_text("from the last demo")
    (work / "capture").mkdir()
    assert own_dirs(store, work) is None  # marked: recreated empty
    assert not store.exists()  # Store.open makes it again
    assert sorted(p.name for p in work.iterdir()) == [DEMO_MARK]


def test_demo_uses_an_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    assert own_dirs(tmp_path / "store", tmp_path / "store-work") is None
    assert (tmp_path / "store-work" / DEMO_MARK).is_file()


def test_ingest_says_when_it_creates_the_store(tmp_path: Path) -> None:
    # a misspelt --store is a new, empty store: said once, on stderr
    write_bundle(tmp_path / "cap" / "replay-3-0", make_contents(step_id=0, rollout_id=3))
    new = tmp_path / "runs.stoer"
    first = cli("ingest", "--store", new, tmp_path / "cap")
    assert first.returncode == 0, first.stderr
    assert first.stderr == f"trajstore: created a new store at {new}\n"
    again = cli("ingest", "--store", new, tmp_path / "cap")
    assert (again.returncode, again.stderr) == (0, "")


@pytest.mark.parametrize("run", ["", "a/b", "café", "ﬁx"])
def test_ingest_with_an_invalid_run_creates_no_store(tmp_path: Path, run: str) -> None:
    # the name was checked after the store was made: a refused command left a new store;
    # str.isalnum let "café" and the ligature "ﬁ" through the documented [A-Za-z0-9._-]
    write_bundle(tmp_path / "cap" / "replay-3-0", make_contents(step_id=0, rollout_id=3))
    res = cli("ingest", "--store", tmp_path / "new", "--run", run, tmp_path / "cap")
    lines = assert_clean_failure(res)
    assert lines == [
        f"trajstore: error: run name {run!r} must be 1-128 characters of [A-Za-z0-9._-], "
        "not starting with '.'"
    ]
    assert not (tmp_path / "new").exists()


def test_ingest_of_only_missing_paths_creates_no_store(tmp_path: Path) -> None:
    res = cli("ingest", "--store", tmp_path / "new", tmp_path / "typo", tmp_path / "typo2")
    lines = assert_clean_failure(res)
    assert lines == [
        f"trajstore: error: nothing to ingest: no such file or directory: "
        f"{tmp_path / 'typo'}, {tmp_path / 'typo2'}"
    ]
    assert not (tmp_path / "new").exists()


def test_ingest_with_one_missing_path_stores_the_rest(tmp_path: Path) -> None:
    write_bundle(tmp_path / "cap" / "replay-3-0", make_contents(step_id=0, rollout_id=3))
    res = cli("ingest", "--store", tmp_path / "new", tmp_path / "typo", tmp_path / "cap")
    assert res.returncode == 2
    assert f"trajstore: refused: {tmp_path / 'typo'}: no such file or directory" in res.stderr
    assert res.stdout.startswith("published ")


def test_a_store_given_with_a_tilde_is_under_home(tmp_path: Path) -> None:
    # `--store=~/runs` and an env file reach trajstore unexpanded: a literal ./~/runs was
    # made in the current directory, reported as "~/runs"
    write_bundle(tmp_path / "cap" / "replay-3-0", make_contents(step_id=0, rollout_id=3))
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    res = cli("ingest", "--store=~/runs", tmp_path / "cap", env={"HOME": str(home)}, cwd=cwd)
    assert res.returncode == 0, res.stderr
    assert res.stderr == f"trajstore: created a new store at {home / 'runs'}\n"
    with Store.open(home / "runs", create=False) as store:
        assert [b["key"] for b in store.bundles()] == ["default/step-3-0/a1"]
    assert list(cwd.iterdir()) == []


def test_store_open_expands_a_tilde(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    with Store.open("~/runs") as store:
        assert store.root == tmp_path / "runs"
