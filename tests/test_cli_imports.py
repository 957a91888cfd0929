"""The import diet of the catalog-only commands (`ls`, `query`, `sql`).

A fresh interpreter runs each command on a store whose catalog is already in
step with the refs and reports which modules it imported: the catalog
(SQLAlchemy, DuckDB) and nothing of the object layer, the replay engine or the
server. A ref the catalog has not seen is still indexed (its documents are
read through the object layer, imported for that). No timing is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CAPTURE_DIR

from trajstore.cli import _catalog
from trajstore.errors import StoreError
from trajstore.store import Store
from trajstore.store.layout import StoreLayout

#: top-level packages (and trajstore modules) a catalog-only command must not import
HEAVY = ("torch", "numpy", "zarr", "fastapi", "uvicorn", "pandas", "matplotlib", "pyarrow")
HEAVY_TRAJSTORE = ("trajstore.store", "trajstore.cas", "trajstore.bundle", "trajstore.replay")

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
    ],
)
def test_catalog_only_command_imports_no_heavy_module(store_dir: Path, command: tuple) -> None:
    proc, modules = run_probe(*command, "--store", store_dir)
    assert proc.returncode == 0, proc.stderr
    assert "sqlalchemy" in modules  # the probe does see the catalog's imports
    assert heavy(modules) == []


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
