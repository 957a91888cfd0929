"""trajstore.catalog.direct: the CLI's reader of a store's DuckDB catalog.

It runs the shared statements (trajstore.catalog.statements) whole through the `duckdb`
module; SQLAlchemy runs them a page at a time (trajstore.catalog.queries). Here both
answer every filter the CLI passes on the same catalog (more than a page of each:
bundles, steps, results, divergences, a tombstone, ranks), row for row, value for value
(on PostgreSQL: tests/test_catalog_direct_pg.py). And the listing record that lets a
reader skip a sync notices every created or removed document, whether the directory's
stat or its names answer.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from trajstore.catalog import open_catalog, sync_catalog
from trajstore.catalog.direct import (
    SETTLE_NS,
    DirectCatalog,
    NeedsFullOpen,
    dir_stat,
    list_local,
    listing_record,
    listing_unchanged,
)
from trajstore.cli._catalog import PagedReader
from trajstore.errors import UsageError
from trajstore.vocab import STEP_STATUSES

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
BUNDLES = 1100  # more than one 1000-row page of bundles and of steps


def bench_catalog() -> Any:
    """scripts/bench/bench_catalog.py, for its cheap big-store builder."""
    spec = importlib.util.spec_from_file_location(
        "bench_catalog", ROOT / "scripts" / "bench" / "bench_catalog.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_store(root: Path) -> dict:
    """A store of BUNDLES bundles with results, ranks and a tombstone; its documents."""
    docs, _ = bench_catalog().build_store(root, BUNDLES)
    (root / "TRAJSTORE_STORE").write_bytes(b"trajstore store, layout 1\n")
    (root / "refs" / "tombstones").mkdir()
    tombstone = {"tombstone_version": 1, "key": "bench/step-3-1/rank-None/a1"}
    (root / "refs" / "tombstones" / f"{2_000_000_000_000_000_000:020d}-1-00.json").write_text(
        json.dumps(tombstone)
    )
    return docs


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("direct") / "store"
    docs = build_store(root)
    with open_catalog(root) as cat:
        sync_catalog(cat, root, docs.__getitem__)
    return root


def both(store: Path, method: str, **kw: Any) -> tuple[Any, Any]:
    with DirectCatalog.open(store) as direct:
        fast = getattr(direct, method)(**kw)
    with open_catalog(store) as cat:
        full = getattr(PagedReader(cat), method)(**kw)
    return fast, full


CASES = [
    ("bundles", {}),
    ("bundles", {"run": "bench"}),
    ("bundles", {"run": "nope"}),
    ("bundles", {"kind": "step", "rollout_from": 3, "rollout_to": 9}),
    ("bundles", {"kind": "rollout"}),
    ("bundles", {"include_all_attempts": True, "limit": 1005}),
    ("bundles", {"limit": 7}),
    ("steps", {}),
    ("steps", {"run": "bench", "rollout_from": 2, "rollout_to": 40}),
    ("steps", {"first_divergent_stage": "advantage.estimate"}),
    ("steps", {"first_divergent_stage": "advantage.estimate", "status": "diverged"}),
    *(("steps", {"status": status}) for status in STEP_STATUSES),
    ("steps", {"limit": 1001}),
    ("steps", {"limit": 3, "rollout_from": 5}),
    ("divergences", {}),
    ("divergences", {"stage": "advantage.estimate", "min_abs_err": 1.0, "sample_id": "s-1"}),
    ("divergences", {"min_abs_err": 1.5}),
    ("divergences", {"run": "bench", "rollout_to": 30, "limit": 11}),
    ("router_metrics", {}),
    ("router_metrics", {"source": "producer", "run": "bench", "rollout_from": 1}),
]


@pytest.mark.parametrize(("method", "kw"), CASES, ids=[f"{m}-{kw}" for m, kw in CASES])
def test_direct_rows_equal_the_sqlalchemy_queries(store: Path, method: str, kw: dict) -> None:
    fast, full = both(store, method, **kw)
    assert fast == full
    assert json.dumps(fast, sort_keys=True) == json.dumps(full, sort_keys=True)


COUNTED = [(method, kw) for method, kw in CASES if "limit" not in kw]


@pytest.mark.parametrize(("method", "kw"), COUNTED, ids=[f"{m}-{kw}" for m, kw in COUNTED])
def test_both_readers_count_the_rows_of_the_whole_listing(
    store: Path, method: str, kw: dict
) -> None:
    # the count of a cut table (`ls`, `query`): the listing's statement counted, not listed
    with DirectCatalog.open(store) as direct:
        rows = getattr(direct, method)(**kw)
        fast = direct.count(method, **kw)
    with open_catalog(store) as cat:
        full = PagedReader(cat).count(method, **kw)
    assert fast == full == len(rows)


@pytest.mark.parametrize(("method", "kw"), COUNTED, ids=[f"{m}-{kw}" for m, kw in COUNTED])
@pytest.mark.parametrize("prefilter", [False, True])
def test_a_count_does_not_sort_the_rows_it_counts(method: str, kw: dict, prefilter: bool) -> None:
    """The count of a cut table reads the listing's rows in no order (the ranking of
    each step's results orders within a step: that window stays)."""
    import re

    from trajstore.catalog.listings import LISTINGS

    listing = LISTINGS[method](**kw)
    text, _ = listing.count_statement(prefilter) if method == "steps" else listing.count_statement()
    outside_windows = re.sub(r"row_number\(\) OVER \(.*?\) AS rn", "", text)
    assert "row_number" not in outside_windows
    assert "ORDER BY" not in outside_windows


def test_the_fixture_exercises_pages_results_and_the_tombstone(store: Path) -> None:
    fast, _ = both(store, "bundles", include_all_attempts=True)
    assert len(fast) > 1000
    assert "bench/step-3-1/rank-None/a1" not in {r["key"] for r in fast}
    with DirectCatalog.open(store) as direct:
        removed = direct.readonly_sql("SELECT key FROM bundles WHERE removed_at IS NOT NULL")
    assert removed == (["key"], [["bench/step-3-1/rank-None/a1"]])
    steps, _ = both(store, "steps")
    assert len(steps) > 1000
    assert {len(s["ranks"]) for s in steps} == {0, 2}
    assert {s["status"] for s in steps} == {"pass", "diverged"}


@pytest.mark.parametrize("method", ["bundles", "steps"])
def test_projected_rows_are_the_full_rows_cut_to_those_columns(store: Path, method: str) -> None:
    columns = ("key", "num_samples", "published_at", "is_latest", "rank", "cohort_ranks")
    if method == "steps":
        columns = ("run", "status", "recorded_at", "first_divergent_rank")
    with DirectCatalog.open(store) as direct:
        full = getattr(direct, method)()
        cut = getattr(direct, method)(columns=columns)
    assert len(cut) == len(full)
    for a, b in zip(cut, full, strict=True):
        assert all(a[c] == b[c] for c in columns)


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT count(*) AS n FROM bundles",
        "SELECT * FROM replay_results ORDER BY id LIMIT 30",
        "SELECT key, published_at, cohort_ranks FROM bundles ORDER BY key LIMIT 5",
        "EXPLAIN SELECT 1",
    ],
)
def test_direct_sql_equals_the_sqlalchemy_path(store: Path, sql: str) -> None:
    with DirectCatalog.open(store) as direct:
        fast = direct.readonly_sql(sql)
    with open_catalog(store) as cat:
        full = PagedReader(cat).readonly_sql(sql)
    assert fast == full


@pytest.mark.parametrize(
    "sql",
    ["DELETE FROM bundles", "SELECT 1; SELECT 2", "SELEC 1", "SELECT nope FROM bundles"],
)
def test_direct_sql_refuses_as_the_sqlalchemy_path(store: Path, sql: str) -> None:
    with DirectCatalog.open(store) as direct, pytest.raises(UsageError) as fast:
        direct.readonly_sql(sql)
    with open_catalog(store) as cat, pytest.raises(UsageError) as full:
        PagedReader(cat).readonly_sql(sql)
    assert str(fast.value) == str(full.value)


def test_sql_over_the_row_cap_is_refused_not_cut_by_both_paths(store: Path) -> None:
    from trajstore.catalog.queries import run_readonly_sql

    with DirectCatalog.open(store) as direct:
        assert len(direct.readonly_sql("SELECT * FROM range(10)", max_rows=10)[1]) == 10
        with pytest.raises(UsageError, match="more than 10 rows") as fast:
            direct.readonly_sql("SELECT * FROM range(11)", max_rows=10)
    with open_catalog(store) as cat:
        assert len(run_readonly_sql(cat, "SELECT * FROM range(10)", max_rows=10)[1]) == 10
        with pytest.raises(UsageError) as full:
            run_readonly_sql(cat, "SELECT * FROM range(11)", max_rows=10)
    assert str(fast.value) == str(full.value)


def test_a_catalog_without_a_listing_record_is_opened_the_full_way(tmp_path: Path) -> None:
    root = tmp_path / "store"
    (root / "refs" / "bundles").mkdir(parents=True)
    with pytest.raises(NeedsFullOpen):  # no catalog file yet
        DirectCatalog.open(root)
    with open_catalog(root):
        pass
    with pytest.raises(NeedsFullOpen):  # never synced: nothing says which refs it holds
        DirectCatalog.open(root)
    with open_catalog(root) as cat:
        sync_catalog(cat, root, lambda digest: {})
    DirectCatalog.open(root).close()


# -- the listing record ----------------------------------------------------------------


def record_of(folder: Path) -> str:
    listed_ns = time.time_ns()
    stat = dir_stat(folder)
    return listing_record(list_local(folder), stat, listed_ns)


def settle(folder: Path) -> None:
    """Date the directory's mtime back, as if its last change were long ago."""
    past = time.time_ns() - 10 * SETTLE_NS
    os.utime(folder, ns=(past, past))


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    folder = tmp_path / "refs"
    folder.mkdir()
    for i in range(5):
        (folder / f"{i:020d}-1-00.json").write_text("{}")
    (folder / ".tmp-partial.json").write_text("")  # an unfinished atomic create: not listed
    return folder


@pytest.mark.parametrize("settled", [True, False], ids=["settled", "recent"])
def test_an_unchanged_directory_matches_its_record(folder: Path, settled: bool) -> None:
    if settled:
        settle(folder)
    assert listing_unchanged(record_of(folder), folder)[0]


@pytest.mark.parametrize("settled", [True, False], ids=["settled", "recent"])
def test_a_created_document_is_noticed(folder: Path, settled: bool) -> None:
    if settled:
        settle(folder)
    record = record_of(folder)
    (folder / f"{9:020d}-1-00.json").write_text("{}")
    assert listing_unchanged(record, folder) == (False, None)


@pytest.mark.parametrize("settled", [True, False], ids=["settled", "recent"])
def test_a_removed_document_is_noticed(folder: Path, settled: bool) -> None:
    if settled:
        settle(folder)
    record = record_of(folder)
    (folder / f"{2:020d}-1-00.json").unlink()
    assert listing_unchanged(record, folder) == (False, None)


def test_a_renamed_document_is_noticed_by_its_names(folder: Path) -> None:
    record = record_of(folder)
    stat = os.stat(folder)
    (folder / f"{2:020d}-1-00.json").rename(folder / f"{7:020d}-1-00.json")
    os.utime(folder, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same count and mtime
    assert listing_unchanged(record, folder) == (False, None)


def test_a_matching_listing_is_renewed_once_the_directory_settled(folder: Path) -> None:
    record = record_of(folder)  # taken right after the writes: its stat cannot vouch
    settle(folder)
    same, renewed = listing_unchanged(record, folder)
    assert same and renewed is not None
    assert json.loads(renewed)["stat"] == dir_stat(folder)
    assert listing_unchanged(renewed, folder) == (True, None)


def test_a_missing_directory_matches_an_empty_listing(tmp_path: Path) -> None:
    record = listing_record([], None, time.time_ns())
    assert listing_unchanged(record, tmp_path / "absent")[0]
    (tmp_path / "absent").mkdir()
    (tmp_path / "absent" / "x.json").write_text("{}")
    assert not listing_unchanged(record, tmp_path / "absent")[0]
