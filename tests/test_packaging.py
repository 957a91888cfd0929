"""What a wheel holds: one top-level name, every subpackage, the demo and its data.

The repository keeps `api/`, `migrations/` and `examples/` beside `trajstore/`;
pyproject.toml installs them as `trajstore.api`, `trajstore.migrations` and
`trajstore.examples`, listing every package by hand. These tests keep that list
honest and check that the installed names are the ones everything imports.
"""

from __future__ import annotations

import filecmp
from pathlib import Path

import pytest
import tomllib
from conftest import DemoRun

from trajstore.catalog.db import migrations_dir

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
#: repository folder -> the package name it installs as
FOLDERS = {
    "trajstore": "trajstore",
    "api": "trajstore.api",
    "migrations": "trajstore.migrations",
    "examples": "trajstore.examples",
}


def _setuptools_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_listed_and_nothing_else() -> None:
    found = set()
    for folder, package in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *parts)))
    assert set(_setuptools_config()["packages"]) == found


def test_the_only_top_level_name_is_trajstore() -> None:
    config = _setuptools_config()
    assert {name.split(".")[0] for name in config["packages"]} == {"trajstore"}
    assert config["package-dir"] == {
        package: folder for folder, package in FOLDERS.items() if folder != "trajstore"
    }


def test_alembic_revisions_are_found_in_the_installed_package() -> None:
    from trajstore import migrations

    location = migrations_dir()
    assert location == Path(migrations.__file__).resolve().parent
    assert (location / "env.py").is_file() and any((location / "versions").glob("0001_*.py"))


def test_the_demo_data_is_the_public_producers_fixtures() -> None:
    """The demo ships a copy of two fixture trees; a drifted copy fails here."""
    from trajstore import examples

    shipped = Path(examples.__file__).resolve().parent / "data" / "relax-v2"
    for tree in ("example_capture_dir", "example_bundle"):
        left, right = shipped / tree, ROOT / "tests" / "fixtures" / "relax-v2" / tree
        files = sorted(p.relative_to(right) for p in right.rglob("*") if p.is_file())
        assert sorted(p.relative_to(left) for p in left.rglob("*") if p.is_file()) == files
        _, mismatch, errors = filecmp.cmpfiles(left, right, [str(f) for f in files], shallow=False)
        assert (mismatch, errors) == ([], [])


def test_trajstore_demo_runs_outside_the_checkout(demo_run: DemoRun) -> None:
    """`trajstore demo DIR` from a directory that is not the checkout: every expectation holds."""
    assert demo_run.returncode == 0, demo_run.output[-4000:]
    assert "done: all expectations met" in demo_run.output
    assert any((demo_run.cwd / "demo-store").iterdir())
