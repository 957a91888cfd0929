"""The import diet of the catalog-only commands (`ls`, `query`, `sql`).

A fresh interpreter runs each command on a store whose catalog is already in
step with the refs and reports which modules it imported: DuckDB's driver and
nothing of SQLAlchemy, the object layer, the replay engine or the server (the
catalog is read directly, trajstore.catalog.direct). A ref the catalog has not
seen is still indexed (its documents are read through the object layer,
imported for that). No timing is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CAPTURE_DIR
from inprocess_cli import cli as run_main

from trajstore.catalog import tables
from trajstore.cli import _catalog
from trajstore.errors import StoreError
from trajstore.store import Store
from trajstore.store.layout import StoreLayout

pytestmark = pytest.mark.integration

#: top-level packages (and trajstore modules) a catalog-only command must not import
HEAVY = ("torch", "numpy", "zarr", "fastapi", "uvicorn", "pandas", "matplotlib", "pyarrow")
#: ... nor, on a catalog in step with the refs, the full catalog stack
CATALOG_STACK = ("sqlalchemy", "duckdb_engine", "alembic", "duckdb")
HEAVY_TRAJSTORE = ("trajstore.store", "trajstore.cas", "trajstore.bundle", "trajstore.replay")
#: ... nor, listing bundles, steps, divergences or routes, or running SQL, these standard
#: library modules nothing on that path needs (`dataclasses` imports `inspect`: ~6 ms
#: of every start); `query mismatch` still does (trajstore.mismatch's records)
STDLIB_UNUSED = ("dataclasses", "inspect")

PROBE = """
import json, sys
from trajstore.cli import main
code = main(sys.argv[1:])
sys.stdout.flush()
sys.stderr.write("\\nMODULES " + json.dumps(sorted(sys.modules)) + "\\n")
sys.exit(code)
"""


def run_probe(*args: str | Path) -> tuple[subprocess.CompletedProcess, set[str]]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = [x for x in proc.stderr.splitlines() if x.startswith("MODULES ")][-1]
    return proc, set(json.loads(line.removeprefix("MODULES ")))


def heavy(modules: set[str]) -> list[str]:
    return sorted(
        m
        for m in modules
        if m.split(".")[0] in HEAVY or any(m == t or m.startswith(t + ".") for t in HEAVY_TRAJSTORE)
    )


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    st = tmp_path_factory.mktemp("diet") / "store"
    with Store.open(st) as store:
        assert all(o.status == "published" for o in store.ingest([CAPTURE_DIR], run="r"))
        store.runs()  # the catalog is synced: the commands below find nothing new
    return st


@pytest.mark.parametrize(
    "command",
    [
        ("ls",),
        ("ls", "--json", "--all-attempts"),
        ("query", "steps"),
        ("query", "bundles", "--format", "json"),
        ("query", "divergences"),
        ("query", "routes"),
        ("sql", "SELECT count(*) AS n FROM bundles"),
        ("query", "mismatch", "--run", "r"),
        ("query", "mismatch", "--run", "r", "--json", "--metric", "old_kl_k3", "--top", "3"),
        ("query", "mismatch", "--run", "r", "--first-above", "0", "--fail-above", "1e9"),
    ],
)
def test_catalog_only_command_imports_no_heavy_module(store_dir: Path, command: tuple) -> None:
    proc, modules = run_probe(*command, "--store", store_dir)
    assert proc.returncode == 0, proc.stderr
    assert "_duckdb" in modules  # the probe does see the catalog's imports
    assert heavy(modules) == []
    assert sorted(m for m in modules if m.split(".")[0] in CATALOG_STACK) == []
    assert "trajstore.catalog.sync" not in modules
    if command[:2] != ("query", "mismatch"):
        assert sorted(modules.intersection(STDLIB_UNUSED)) == []


def test_a_new_ref_is_still_indexed_through_the_object_layer(
    store_dir: Path, tmp_path: Path
) -> None:
    import shutil

    st = tmp_path / "store"
    shutil.copytree(store_dir, st)
    with Store.open(st) as store:
        before = len(store.bundles(all_attempts=True))
    # a ref published behind the catalog's back (ingest never touches the catalog)
    with Store.open(st) as store:
        store.ingest([CAPTURE_DIR], run="other")
    proc, modules = run_probe("ls", "--json", "--all-attempts", "--store", st)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout[: proc.stdout.rindex("]") + 1])
    assert len(rows) == 2 * before
    assert {r["run"] for r in rows} == {"r", "other"}
    assert "trajstore.store" in modules


def test_store_check_mirrors_the_store_layout(tmp_path: Path) -> None:
    layout = StoreLayout(tmp_path)
    assert tmp_path / _catalog.MARKER == layout.marker
    assert tmp_path / _catalog.BUNDLE_REFS == layout.bundle_refs
    with pytest.raises(StoreError) as not_store:
        _catalog.store_root(tmp_path)
    with pytest.raises(StoreError) as by_store:
        Store.open(tmp_path, create=False)
    assert str(not_store.value) == str(by_store.value)
    layout.ensure()
    assert _catalog.store_root(tmp_path) == tmp_path


# -- when the catalog is synced (trajstore.catalog.direct: the listing record) ----------


def copy_store(src: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(src, dest)
    return dest


def sql_rows(store: Path, sql: str) -> list[dict]:
    """An oracle: `trajstore sql` in this process (its imports are not what is checked)."""
    proc = run_main("sql", sql, "--format", "json", "--store", store)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def listed_names(store: Path, directory: str) -> int:
    (row,) = sql_rows(store, f"SELECT listing FROM sync_state WHERE directory = '{directory}'")
    return json.loads(row["listing"])["names"]


def test_unchanged_refs_are_read_without_a_sync(store_dir: Path, tmp_path: Path) -> None:
    st = copy_store(store_dir, tmp_path / "store")
    with Store.open(st) as store:
        expected = store.bundles(all_attempts=True)
    for _ in range(2):
        proc, modules = run_probe("ls", "--json", "--all-attempts", "--store", st)
        assert proc.returncode == 0, proc.stderr
        assert "trajstore.catalog.sync" not in modules
        rows = json.loads(proc.stdout[: proc.stdout.rindex("]") + 1])
        assert [r["key"] for r in rows] == [r["key"] for r in expected]


def test_a_new_ref_is_synced_once_then_read_directly(store_dir: Path, tmp_path: Path) -> None:
    st = copy_store(store_dir, tmp_path / "store")
    with Store.open(st) as store:
        store.ingest([CAPTURE_DIR], run="other")  # refs only: ingest never touches the catalog
    proc, modules = run_probe("ls", "--store", st)
    assert proc.returncode == 0, proc.stderr
    assert "trajstore.catalog.sync" in modules
    assert any(line.startswith("other/") for line in proc.stdout.splitlines())
    proc, modules = run_probe("ls", "--store", st)
    assert proc.returncode == 0, proc.stderr
    assert "trajstore.catalog.sync" not in modules


def test_a_removed_ref_is_noticed(store_dir: Path, tmp_path: Path) -> None:
    st = copy_store(store_dir, tmp_path / "store")
    refs = sorted((st / _catalog.BUNDLE_REFS).iterdir())
    before = listed_names(st, "bundles")
    assert before == len(refs)
    refs[-1].unlink()
    proc, modules = run_probe("ls", "--store", st)
    assert proc.returncode == 0, proc.stderr
    assert "trajstore.catalog.sync" in modules
    assert listed_names(st, "bundles") == before - 1


def test_a_new_tombstone_is_synced(store_dir: Path, tmp_path: Path) -> None:
    st = copy_store(store_dir, tmp_path / "store")
    with Store.open(st) as store:
        key = store.bundles()[0]["key"]
        store.remove([key])
    proc, modules = run_probe("ls", "--store", st)
    assert proc.returncode == 0, proc.stderr
    assert "trajstore.catalog.sync" in modules
    assert key not in proc.stdout.split()


def set_revision(store: Path, revision: str, *, drop_listing: bool = False) -> None:
    import duckdb

    con = duckdb.connect(str(store / "catalog.duckdb"))
    try:
        if drop_listing:  # the schema of 0003: without 0004's listing and 0005's added_bytes
            con.execute("ALTER TABLE sync_state DROP COLUMN listing")
            con.execute("DROP TABLE mismatch_metrics")  # and of 0006
            con.execute("DROP TABLE mismatch_layers")
            con.execute("DROP INDEX ix_bundles_step")  # DuckDB drops no column under an index
            con.execute("ALTER TABLE bundles DROP COLUMN added_bytes")
            con.execute("CREATE INDEX ix_bundles_step ON bundles (run, rollout_id, step_id)")
        con.execute("UPDATE alembic_version SET version_num = ?", [revision])
    finally:
        con.close()


def test_an_older_catalog_is_migrated_as_before(store_dir: Path, tmp_path: Path) -> None:
    st = copy_store(store_dir, tmp_path / "store")
    expected = run_main("query", "bundles", "--store", st)  # the oracle: in this process
    set_revision(st, "0003", drop_listing=True)
    proc, modules = run_probe("query", "bundles", "--store", st)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected.stdout
    assert "alembic" in modules
    assert sql_rows(st, "SELECT version_num FROM alembic_version") == [
        {"version_num": tables.HEAD_REVISION}
    ]


def test_a_newer_catalog_is_refused_in_one_line(store_dir: Path, tmp_path: Path) -> None:
    from trajstore.catalog import open_catalog

    st = copy_store(store_dir, tmp_path / "store")
    set_revision(st, "9999")
    with pytest.raises(StoreError) as full_open:
        open_catalog(st)
    for command in (("ls",), ("query", "steps"), ("sql", "SELECT 1")):
        proc, modules = run_probe(*command, "--store", st)
        assert proc.returncode == 2
        assert proc.stdout == ""
        assert proc.stderr.splitlines()[0] == f"trajstore: error: {full_open.value}"
        assert "9999" in proc.stderr and "upgrade trajstore" in proc.stderr
        assert "sqlalchemy" not in modules  # refused by the direct reader itself


def test_the_command_map_names_the_module_that_registers_each_command() -> None:
    import argparse
    import importlib

    from trajstore.cli import COMMAND_MODULES, COMMANDS

    registered = {}
    for name in COMMAND_MODULES:
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(name).register(sub)
        registered.update(dict.fromkeys(sub.choices, name))
    assert registered == COMMANDS


@pytest.mark.parametrize(
    "argv",
    [("ls", "--bogus"), ("query", "stepz"), ("sql",), ("ls", "--help"), ("diff", "--help")],
)
def test_a_command_parsed_alone_reads_as_with_every_command(argv: tuple) -> None:
    """Usage, help and errors of a command line are those of the full parser."""
    import contextlib
    import io

    from trajstore.cli import _command_of, build_parser

    def parse(parser) -> tuple:  # noqa: ANN001
        out, err = io.StringIO(), io.StringIO()
        with (
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            pytest.raises(SystemExit) as done,
        ):
            parser.parse_args(list(argv))
        return done.value.code, out.getvalue(), err.getvalue()

    assert _command_of(list(argv)) == argv[0]
    assert parse(build_parser(argv[0])) == parse(build_parser())
