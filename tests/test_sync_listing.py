"""The bounded catalog sync (trajstore.catalog.sync.sync_catalog): when the recorded
listing is accounted for, only names after its `last` are compared with the catalog;
anything else falls back to the full comparison."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from trajstore.catalog import open_catalog, sync_catalog, tables

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
CLOCK = 1_800_000_000_000_000_000


def bench_catalog() -> Any:
    spec = importlib.util.spec_from_file_location(
        "bench_catalog", ROOT / "scripts" / "bench" / "bench_catalog.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def store(tmp_path: Path) -> tuple[Path, dict]:
    root = tmp_path / "store"
    docs, _ = bench_catalog().build_store(root, 40, clock=CLOCK)
    (root / "TRAJSTORE_STORE").write_bytes(b"trajstore store, layout 1\n")
    with open_catalog(root) as cat:
        sync_catalog(cat, root, docs.__getitem__)
    return root, docs


def add(root: Path, docs: dict, clock: int, run: str) -> int:
    before = len(list((root / "refs" / "bundles").iterdir()))
    more, _ = bench_catalog().build_store(root, 8, seed=1, run=run, first_rollout=0, clock=clock)
    docs.update(more)
    return len(list((root / "refs" / "bundles").iterdir())) - before


def synced(root: Path) -> set[str]:
    with open_catalog(root) as cat, cat.connect() as conn:
        t = tables.synced_documents
        q = sa.select(t.c.name).where(t.c.directory == "bundles")
        return set(conn.execute(q).scalars())


def forget(root: Path, name: str) -> None:
    """Drop one applied name from the catalog's synced set (not from its rows)."""
    with open_catalog(root) as cat, cat.begin() as conn:
        t = tables.synced_documents
        conn.execute(t.delete().where(t.c.directory == "bundles", t.c.name == name))


def names(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "refs" / "bundles").iterdir())


def test_the_bounded_path_applies_exactly_the_new_names(store: tuple[Path, dict]) -> None:
    root, docs = store
    added = add(root, docs, CLOCK + 10**15, "later")
    with open_catalog(root) as cat:
        stats = sync_catalog(cat, root, docs.__getitem__)
    assert stats.new_refs == added > 0
    assert synced(root) == set(names(root))


def test_the_bounded_path_does_not_read_the_synced_names_up_to_last(
    store: tuple[Path, dict],
) -> None:
    root, docs = store
    oldest = names(root)[0]
    forget(root, oldest)  # a full comparison would apply it again
    added = add(root, docs, CLOCK + 10**15, "later")
    with open_catalog(root) as cat:
        stats = sync_catalog(cat, root, docs.__getitem__)
    assert stats.new_refs == added
    assert oldest not in synced(root)


def test_a_late_ref_with_an_older_name_is_still_applied(store: tuple[Path, dict]) -> None:
    root, docs = store
    added = add(root, docs, CLOCK - 10**15, "early")
    with open_catalog(root) as cat:
        stats = sync_catalog(cat, root, docs.__getitem__)
    assert stats.new_refs == added > 0
    assert synced(root) == set(names(root))


def test_a_removed_document_makes_it_fall_back(store: tuple[Path, dict]) -> None:
    root, docs = store
    listed = names(root)
    forget(root, listed[0])
    (root / "refs" / "bundles" / listed[1]).unlink()
    with open_catalog(root) as cat:
        stats = sync_catalog(cat, root, docs.__getitem__)
    assert stats.new_refs == 1  # the full comparison finds the forgotten name
    assert listed[0] in synced(root)


def test_an_old_record_without_last_falls_back_and_syncs_right(store: tuple[Path, dict]) -> None:
    root, docs = store
    with open_catalog(root) as cat, cat.begin() as conn:
        state = tables.sync_state
        q = sa.select(state.c.listing).where(state.c.directory == "bundles")
        rec = json.loads(conn.execute(q).scalar_one())
        del rec["last"]
        conn.execute(
            state.update()
            .where(state.c.directory == "bundles")
            .values(listing=json.dumps(rec, sort_keys=True))
        )
    oldest = names(root)[0]
    forget(root, oldest)
    added = add(root, docs, CLOCK + 10**15, "later")
    with open_catalog(root) as cat:
        stats = sync_catalog(cat, root, docs.__getitem__)
    assert stats.new_refs == added + 1
    assert synced(root) == set(names(root))
