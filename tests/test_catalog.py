"""Catalog: indexing refs/results, latest attempts, tombstones, migrations,
read-only SQL, concurrency through the file lock, in-memory snapshots.

Every ref, tombstone and result here is written by the real store: bundles are
written with trajstore's writer and ingested, `Store.remove` tombstones them,
and results go through the writer `replay --record` uses.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa
from conftest import FIXTURES, make_contents
from inprocess_cli import cli

from trajstore.bundle.writer import write_bundle, write_rank
from trajstore.catalog import (
    CATALOG_FILE,
    get_bundle,
    list_bundles,
    list_runs,
    lookup_rollout,
    lookup_step,
    migrate,
    open_catalog,
    payloads_of,
    provenance_of,
    query_divergences,
    query_router_metrics,
    query_steps,
    recorded_result_exists,
    reindex,
    results_of,
    run_readonly_sql,
    samples_of,
    stats,
    sync_catalog,
)
from trajstore.catalog import tables as t
from trajstore.errors import StoreError, UsageError
from trajstore.replay.from_store import write_result
from trajstore.store import Store

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = FIXTURES / "example_bundle"


class StoreWriter:
    """Publishes bundles, tombstones and results into a real store, as ingest,
    `trajstore rm` and `replay --record` do."""

    def __init__(self, root: Path, work: Path, url: str | None = None) -> None:
        self.root = root
        self.work = work
        self.url = url  # the catalog: None for the store's DuckDB file
        self.store = Store.open(root, durable=False)
        self.seeds = itertools.count(1)

    def load(self, digest: str) -> dict:
        return self.store.load_document(digest)

    def catalog(self, **kwargs):  # noqa: ANN003, ANN201
        """The store's catalog on the backend under test (not synced)."""
        return open_catalog(self.root, self.url, **kwargs)

    def _ingest(self, target: Path, run: str) -> list[str]:
        (out,) = self.store.ingest([target], run=run)
        assert out.status == "published", out.reason
        return out.keys

    def ingest_example(self, run: str = "default") -> str:
        """The public producer's example bundle (step 120:0); its key."""
        (key,) = self._ingest(EXAMPLE, run)
        return key

    def publish(
        self,
        rollout_id: int = 120,
        step_id: int | None = 0,
        *,
        run: str = "default",
        router: dict | None = None,
        consistency: dict | None = None,
        routes: bool = False,
    ) -> str:
        """A new single-producer bundle of step rollout_id:step_id (None: the
        rollout bundle); new content each call, so again is the next attempt.
        `routes`: with `router`, identical rollout and train routes (a MoE bundle)."""
        seed = next(self.seeds)
        kind = "rollout" if step_id is None else "step"
        contents = make_contents(kind=kind, rollout_id=rollout_id, step_id=step_id or 0, seed=seed)
        if router is not None:
            contents.config["router"] = router
        if routes:
            tokens = sum(s["total_length"] for s in contents.samples)
            ids = np.zeros((tokens, router["num_layers"], router["top_k"]), dtype=np.uint8)
            ids[..., 1] = 1
            contents.payloads["rollout_routed_experts"] = ids
            contents.payloads["train_routed_experts"] = ids.copy()
        if consistency is not None:
            contents.expected["router.consistency"] = consistency
        (key,) = self._ingest(write_bundle(self.work / f"bundle-{seed}", contents), run)
        return key

    def publish_cohort(
        self, rollout_id: int, step_id: int, ranks: int = 2, *, run: str = "default"
    ) -> list[str]:
        """A new cohort of step rollout_id:step_id; its keys by rank."""
        seed = next(self.seeds)
        dest = self.work / f"cohort-{seed}"
        for r in range(ranks):
            contents = make_contents(
                rollout_id=rollout_id, step_id=step_id, seed=seed, rank=r, world=ranks
            )
            write_rank(dest, contents, rank=r, expected_ranks=list(range(ranks)))
        return self._ingest(dest, run)

    def tombstone(self, key: str) -> None:
        assert self.store.remove([key]) == [key]

    def record(
        self,
        bundle_key: str,
        *,
        status: str = "diverged",
        stage: str | None = "advantage.estimate",
        recorded_at: str = "2026-11-30T02:00:00Z",
        version: str = "0.1.0",
    ) -> None:
        """A result document for the bundle; a diverged one has three divergences
        (abs_err 1.3, 2.3, 3.3 on samples s-0, s-1, s-2)."""
        ref = self.store.bundle(bundle_key).ref
        divergences = [
            {
                "stage": stage,
                "sample_id": f"s-{i}",
                "field": "advantages",
                "token_offset": i,
                "expected": 0.7,
                "actual": 2.0 + i,
                "abs_err": 1.3 + i,
            }
            for i in range(3 if stage else 0)
        ]
        write_result(
            self.store,
            {
                "result_version": 1,
                "bundle_key": bundle_key,
                "run": ref["run"],
                "rollout_id": ref["rollout_id"],
                "step_id": ref["step_id"],
                "trajstore_version": version,
                "recorded_at": recorded_at,
                "status": status,
                "first_divergent_stage": stage,
                "first_divergent_rank": 0 if stage else None,
                "root_bundle_key": bundle_key if stage else None,
                "selection": None,
                "stages": [
                    {
                        "stage": "advantage.estimate",
                        "status": "fail" if stage else "pass",
                        "reason": "",
                        "max_abs_error": 3.3 if stage else None,
                        "mismatch_count": 3 if stage else None,
                        "first_sample": "s-0" if stage else None,
                        "first_field": "advantages" if stage else None,
                        "first_token": 0 if stage else None,
                    }
                ],
                "divergences": divergences,
            },
        )


@pytest.fixture
def store(tmp_path: Path, catalog_url: str | None) -> StoreWriter:
    """A store whose catalog is DuckDB or PostgreSQL (the suite runs on both)."""
    return StoreWriter(tmp_path / "store", tmp_path / "bundles", catalog_url)


@pytest.fixture
def duck_store(tmp_path: Path) -> StoreWriter:
    """A store with its DuckDB file catalog, for what only a file has (locks, snapshots)."""
    return StoreWriter(tmp_path / "store", tmp_path / "bundles")


def _sync(store: StoreWriter):
    with store.catalog() as cat:
        return sync_catalog(cat, store.root, store.load)


def _answers(cat) -> dict:
    """Every query's answer, to compare two catalogs."""
    return {
        "runs": list_runs(cat),
        "bundles": list_bundles(cat, include_all_attempts=True, limit=1000),
        "steps": query_steps(cat, limit=1000),
        "divergences": query_divergences(cat, limit=1000),
        "stats": stats(cat),
        "lookup": lookup_step(cat, "default", 120, 0),
        "samples": [samples_of(cat, b["key"]) for b in list_bundles(cat, limit=1000)["items"]],
    }


def test_index_bundle_from_ref_and_documents(store):
    key = store.ingest_example()
    manifest = json.loads((EXAMPLE / "manifest.json").read_text())
    index = json.loads((EXAMPLE / "index.json").read_text())
    with store.catalog() as cat:
        assert sync_catalog(cat, store.root, store.load).new_refs == 1
        (row,) = lookup_step(cat, "default", 120, 0)
        samples = samples_of(cat, key)
        payloads = payloads_of(cat, key)
        provenance = provenance_of(cat, key)
    assert row["key"] == key and row["kind"] == "step" and row["is_latest"]
    assert row["bundle_id"] == "b-example" and row["format_version"] == "2.0.0"
    assert (row["rollout_weight"], row["actor_weight"]) == ("w-119", "w-120")
    assert row["num_samples"] == len(index["samples"]) == len(samples)
    assert row["num_response_tokens"] == sum(s["response_length"] for s in index["samples"])
    assert [s["sample_id"] for s in samples] == [s["sample_id"] for s in index["samples"]]
    assert samples[0]["semantic_group"] == "g-0" and samples[0]["micro_batch_id"] == "mb-0000"
    assert samples[1]["masked_tokens"] == 1
    assert {p["name"] for p in payloads} == set(manifest["payloads"])
    assert payloads[0]["shape"] == [10]
    assert provenance["rollout_partition"] == ["rollout-119"]
    assert provenance["micro_batch"] == ["mb-0000", "mb-0001"]


def test_sync_is_incremental_and_idempotent(store):
    store.record(store.publish(120, 0))
    first = _sync(store)
    again = _sync(store)
    store.publish(121, 0)
    third = _sync(store)
    assert (first.new_refs, first.new_results) == (1, 1)
    assert (again.new_refs, again.new_tombstones, again.new_results) == (0, 0, 0)
    assert third.new_refs == 1
    with store.catalog() as cat:
        assert stats(cat)["bundles"] == 2
        assert stats(cat)["results"] == 1


def test_latest_attempt_is_the_highest(store):
    keys = [store.publish(120, 0), store.publish(120, 0)]
    _sync(store)
    with store.catalog() as cat:
        latest = lookup_step(cat, "default", 120, 0)
        first = lookup_step(cat, "default", 120, 0, attempt=1)
        every = list_bundles(cat, include_all_attempts=True)["items"]
    assert [r["attempt"] for r in latest] == [2]
    assert [r["attempt"] for r in first] == [1] and not first[0]["is_latest"]
    assert [r["attempt"] for r in every] == [1, 2]
    assert [r["key"] for r in every] == keys == ["default/step-120-0/a1", "default/step-120-0/a2"]


def test_lookup_step_returns_every_rank(store):
    store.publish_cohort(120, 0)
    store.publish(120, None)
    _sync(store)
    with store.catalog() as cat:
        ranks = [r["rank"] for r in lookup_step(cat, "default", 120, 0)]
        rollout = lookup_rollout(cat, "default", 120)
        steps = query_steps(cat)["items"]
    assert ranks == [0, 1]
    assert [r["kind"] for r in rollout] == ["rollout"]
    assert [(s["ranks"], s["num_bundles"]) for s in steps] == [([0, 1], 2)]


def test_tombstone_hides_bundle_and_uncovers_previous_attempt(store):
    store.publish(120, 0)
    second = store.publish(120, 0)
    _sync(store)
    store.tombstone(second)
    assert _sync(store).new_tombstones == 1
    with store.catalog() as cat:
        assert [r["attempt"] for r in lookup_step(cat, "default", 120, 0)] == [1]
        assert get_bundle(cat, second) is None
        assert get_bundle(cat, second, include_removed=True)["removed_at"] is not None


def _latest_view(store: StoreWriter) -> dict:
    """What the readers show of step 120:0: its lookup, the latest bundles, the steps."""
    with store.catalog() as cat:
        return {
            "lookup": [(r["rank"], r["attempt"]) for r in lookup_step(cat, "default", 120, 0)],
            "bundles": [r["key"] for r in list_bundles(cat)["items"]],
            "steps": [
                (s["attempt"], s["ranks"], s["num_bundles"]) for s in query_steps(cat)["items"]
            ],
            "step_bundles": list_runs(cat)[0]["num_step_bundles"],
            "stats": stats(cat)["bundles"],
        }


def test_a_recapture_on_fewer_ranks_supersedes_every_rank_of_the_previous_attempt(store):
    first = store.publish_cohort(120, 0, ranks=3)
    _sync(store)
    second = store.publish_cohort(120, 0, ranks=2)  # resumed on 2 ranks: attempt 2
    _sync(store)  # incremental: attempt 1's rank 2, which attempt 2 lacks, is flipped too
    shown = {
        "lookup": [(0, 2), (1, 2)],
        "bundles": second,
        "steps": [(2, [0, 1], 2)],
        "step_bundles": 2,
        "stats": 2,
    }
    assert _latest_view(store) == shown
    with store.catalog() as cat:
        old = lookup_step(cat, "default", 120, 0, attempt=1)
        assert query_steps(cat, attempt=1)["items"] == []
    assert [r["key"] for r in old] == first and not any(r["is_latest"] for r in old)
    reindex(store.url or store.root / CATALOG_FILE, store.root, store.load)
    assert _latest_view(store) == shown
    assert store.store.remove(second) == second  # attempt 1 is back, all three ranks
    _sync(store)
    assert _latest_view(store)["lookup"] == [(0, 1), (1, 1), (2, 1)]


def test_tombstone_synced_before_its_ref_still_hides_it(store):
    key = store.publish(120, 0)
    store.tombstone(key)
    (ref,) = store.store.layout.bundle_refs.iterdir()
    hidden = ref.rename(store.root / "held-back.json")
    _sync(store)  # sees only the tombstone
    hidden.rename(ref)
    _sync(store)
    with store.catalog() as cat:
        assert lookup_step(cat, "default", 120, 0) == []


def test_query_steps_filters_by_latest_first_divergent_stage(store):
    a = store.publish(120, 0)
    b = store.publish(121, 0)
    c = store.publish(122, 0)
    store.record(a, stage="advantage.estimate")
    store.record(b, stage="loss.policy")
    store.record(c, stage="advantage.estimate", recorded_at="2026-11-30T01:00:00Z")
    store.record(c, status="pass", stage=None, recorded_at="2026-11-30T03:00:00Z")
    _sync(store)
    with store.catalog() as cat:
        hits = query_steps(cat, first_divergent_stage="advantage.estimate")["items"]
        passed = query_steps(cat, status="pass")["items"]
    assert [(h["rollout_id"], h["result_bundle_key"]) for h in hits] == [(120, a)]
    assert [p["rollout_id"] for p in passed] == [122]


def test_query_divergences_filters(store):
    key = store.publish(120, 0)
    store.record(key)
    other = store.publish(130, 0, run="fix")
    store.record(other, stage="loss.policy")
    _sync(store)
    with store.catalog() as cat:
        big = query_divergences(cat, run="default", min_abs_err=2.0)["items"]
        one = query_divergences(cat, sample_id="s-0", stage="loss.policy")["items"]
    assert [(d["sample_id"], d["abs_err"]) for d in big] == [("s-1", 2.3), ("s-2", 3.3)]
    assert [(d["run"], d["bundle_key"], d["field"]) for d in one] == [("fix", other, "advantages")]


def test_recorded_result_exists_per_version(store):
    key = store.publish(120, 0)
    store.record(key, version="0.1.0")
    _sync(store)
    with store.catalog() as cat:
        assert recorded_result_exists(cat, key, "0.1.0")
        assert not recorded_result_exists(cat, key, "0.2.0")
        assert results_of(cat, key)[0]["stages"][0]["stage"] == "advantage.estimate"


def test_router_lineage_and_producer_metrics_indexed(store):
    router = {"num_experts": 128, "num_layers": 48, "top_k": 8, "mode": "r3",
              "rollout_engine": "sglang-0.5.4", "train_engine": "megatron-core-0.14",
              "rollout_weight": "w-120", "train_weight": "w-121"}  # fmt: skip
    store.publish(
        120, 0, router=router, consistency={"route_mismatch_rate": 0.01, "f_tau_2": 0.002}
    )
    _sync(store)
    with store.catalog() as cat:
        columns, rows = run_readonly_sql(
            cat,
            "SELECT l.mode, l.num_layers, m.source, m.route_mismatch_rate, m.f_tau_2, m.kl_k1 "
            "FROM router_lineage l JOIN router_metrics m USING (bundle_key)",
        )
    assert columns == ["mode", "num_layers", "source", "route_mismatch_rate", "f_tau_2", "kl_k1"]
    assert rows == [["r3", 48, "producer", 0.01, 0.002, None]]


def test_pagination_walks_everything_exactly_once(store):
    for rollout in range(5):
        for step in range(3):
            store.record(store.publish(rollout, step))
        store.publish(rollout, None)
    _sync(store)
    with store.catalog() as cat:
        seen, cursor = [], None
        while True:
            page = list_bundles(cat, limit=4, cursor=cursor)
            seen += [b["key"] for b in page["items"]]
            if not (cursor := page["next_cursor"]):
                break
        steps, cursor = [], None
        while True:
            page = query_steps(cat, limit=2, cursor=cursor)
            steps += [(s["rollout_id"], s["step_id"]) for s in page["items"]]
            if not (cursor := page["next_cursor"]):
                break
        divs, cursor = [], None
        while True:
            page = query_divergences(cat, limit=7, cursor=cursor)
            divs += [(d["result_id"], d["position"]) for d in page["items"]]
            if not (cursor := page["next_cursor"]):
                break
        everything = list_bundles(cat, limit=1000)["items"]
    assert seen == [b["key"] for b in everything] and len(set(seen)) == 20
    assert steps == [(r, s) for r in range(5) for s in range(3)]
    assert len(divs) == len(set(divs)) == 45


def test_a_cursor_is_valid_only_for_the_query_that_returned_it(store):
    """A cursor is bound to its listing's filters, not its page size: a keyset position
    from run "a" applied to run "b" answered an empty or wrong page as the next one."""
    router = {"num_experts": 8, "num_layers": 2, "top_k": 2, "mode": "r3"}
    for run in ("a", "b"):
        for rollout in range(2):
            key = store.publish(rollout, 0, run=run, router=router, consistency={"f_tau_2": 0})
            store.record(key)
    _sync(store)
    listings = [
        (list_bundles, {"run": "a"}, {"run": "b"}),
        (list_bundles, {"run": "a"}, {"run": "a", "kind": "step"}),
        (query_steps, {"run": "a"}, {"run": "b"}),
        (
            query_steps,
            {"run": "a", "sort": "-status"},
            {"run": "a", "sort": "-status", "attempt": 1},
        ),
        (query_divergences, {"run": "a"}, {"run": "b"}),
        (query_divergences, {"run": "a"}, {"run": "a", "min_abs_err": 2.0}),
        (query_router_metrics, {"run": "a"}, {"run": "b"}),
        (query_router_metrics, {"run": "a"}, {"run": "a", "rollout_to": 1}),
    ]
    with store.catalog() as cat:
        for listing, mine, other in listings:
            cursor = listing(cat, limit=1, **mine)["next_cursor"]
            assert listing(cat, limit=5, cursor=cursor, **mine)["items"], (listing, mine)
            with pytest.raises(UsageError, match="^cursor belongs to another query: "):
                listing(cat, cursor=cursor, **other)


def test_page_size_is_bounded(store):
    with store.catalog() as cat, pytest.raises(UsageError, match="1000"):
        list_bundles(cat, limit=1001)


def test_bad_cursor_is_a_usage_error(store):
    with store.catalog() as cat, pytest.raises(UsageError, match="cursor"):
        query_steps(cat, cursor="not-a-cursor")


def _catalog_target(tmp_path: Path, catalog_url: str | None) -> tuple[Path, str]:
    """(store directory, catalog URL) of an empty catalog on the backend under test."""
    root = tmp_path / "store"
    root.mkdir()
    return root, catalog_url or f"duckdb:///{root / CATALOG_FILE}"


def test_migration_from_0001_keeps_rows(tmp_path, catalog_url):
    root, url = _catalog_target(tmp_path, catalog_url)
    engine = sa.create_engine(url)
    migrate(engine, "0001")
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO bundles "
            "(key, run, kind, rollout_id, step_id, attempt, is_latest, ref_name)"
            " VALUES ('k', 'default', 'step', 120, 0, 1, true, 'r1')"
        )
        conn.exec_driver_sql(
            "INSERT INTO replay_results (result_name, bundle_key, status) VALUES ('x', 'k', 'pass')"
        )
    engine.dispose()
    with open_catalog(root, url) as cat:
        assert cat.revision() == t.HEAD_REVISION
        assert [r["key"] for r in lookup_step(cat, "default", 120, 0)] == ["k"]
        _, rows = run_readonly_sql(cat, "SELECT id, status, selection FROM replay_results")
        _, metrics = run_readonly_sql(cat, "SELECT count(*) FROM router_metrics")
    assert rows == [[1, "pass", None]] and metrics == [[0]]


_INDEX_NAMES = {
    "duckdb": "SELECT index_name FROM duckdb_indexes()",
    "postgresql": "SELECT indexname FROM pg_indexes WHERE schemaname = current_schema()",
}


def test_migrations_build_exactly_the_declared_tables(tmp_path, catalog_url):
    root, url = _catalog_target(tmp_path, catalog_url)
    with open_catalog(root, url) as cat, cat.connect() as conn:
        got = {
            (table, column)
            for table, column in conn.exec_driver_sql(
                "SELECT table_name, column_name FROM information_schema.columns"
                " WHERE table_name <> 'alembic_version' AND table_schema = current_schema()"
            )
        }
        indexes = {r[0] for r in conn.exec_driver_sql(_INDEX_NAMES[conn.dialect.name])}
    want = {(table.name, c.name) for table in t.metadata.tables.values() for c in table.columns}
    want_indexes = {i.name for table in t.metadata.tables.values() for i in table.indexes}
    assert got == want
    assert want_indexes <= indexes


def test_newer_catalog_is_refused(tmp_path, catalog_url):
    root, url = _catalog_target(tmp_path, catalog_url)
    with open_catalog(root, url) as cat, cat.begin() as conn:
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = '9999'")
    with pytest.raises(StoreError, match="newer than this trajstore.*upgrade trajstore"):
        open_catalog(root, url)


def test_reindex_after_deleting_catalog_gives_identical_answers(store):
    first = store.publish(120, 0)
    store.record(first)
    _sync(store)
    store.publish(120, 0)
    gone = store.publish(121, 0)
    store.publish(121, None)
    _sync(store)
    store.tombstone(gone)
    rank0, _ = store.publish_cohort(122, 0)
    store.record(rank0, stage="loss.policy")
    _sync(store)
    with store.catalog() as cat:
        before = _answers(cat)
    if store.url is None:
        (store.root / CATALOG_FILE).unlink()
    stats_ = reindex(store.url or store.root / CATALOG_FILE, store.root, store.load)
    with store.catalog() as cat:
        after = _answers(cat)
    assert (stats_.new_refs, stats_.new_tombstones, stats_.new_results) == (6, 1, 2)
    assert after == before


def test_reindex_of_a_corrupt_catalog_file_rebuilds_it(duck_store):
    store = duck_store
    store.publish(120, 0)
    (store.root / CATALOG_FILE).write_bytes(b"not a duckdb file" * 100)
    stats_ = reindex(store.root / CATALOG_FILE, store.root, store.load)
    with store.catalog() as cat:
        assert len(lookup_step(cat, "default", 120, 0)) == 1
    assert "not a valid DuckDB database file" in stats_.reason
    assert Path(stats_.moved_aside).read_bytes() == b"not a duckdb file" * 100


def _filled(store: StoreWriter) -> None:
    """Rows in every kind of table: attempts, a tombstone, a cohort, results."""
    first = store.publish(120, 0)
    store.record(first)
    store.publish(120, 0)
    store.tombstone(store.publish(121, 0))
    rank0, _ = store.publish_cohort(122, 0)
    store.record(rank0, stage="loss.policy")
    router = {"num_layers": 2, "top_k": 2, "num_experts": 4}
    store.publish(123, 0, router=router, consistency={"route_mismatch_rate": 0.01}, routes=True)
    _sync(store)


def _truncate_to_half(file: Path) -> int:
    """Cut a catalog file in half, as a full disk or a bad copy leaves it; its new size."""
    size = file.stat().st_size // 2
    os.truncate(file, size)
    return size


def _tables(file: Path) -> dict[str, list]:
    """Every row of every table of a DuckDB catalog, sorted (sync_state without the time
    and stat of its last listing)."""
    import duckdb

    with duckdb.connect(str(file), read_only=True) as con:
        names = [n for (n,) in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()]
        out = {n: con.execute(f'SELECT * FROM "{n}" ORDER BY ALL').fetchall() for n in names}
        out["sync_state"] = con.execute(
            "SELECT directory, high_water, applied FROM sync_state ORDER BY ALL"
        ).fetchall()
    return out


def test_a_damaged_catalog_file_is_one_line_naming_it_and_reindex(duck_store):
    store = duck_store
    _filled(store)
    file = store.root / CATALOG_FILE
    _truncate_to_half(file)
    for command in (["ls"], ["query", "steps"], ["sql", "SELECT count(*) FROM samples"]):
        proc = cli(*command, "--store", store.root)
        assert proc.returncode == 2 and proc.stdout == "", command
        (line,) = proc.stderr.splitlines()
        assert line.startswith(f"trajstore: error: catalog {file} cannot be read (IO Error: ")
        assert line.endswith(f"; run: trajstore reindex --store {store.root}"), command


def test_reindex_moves_a_damaged_catalog_aside_and_rebuilds_every_table(duck_store):
    store = duck_store
    _filled(store)
    file = store.root / CATALOG_FILE
    size = _truncate_to_half(file)

    proc = cli("reindex", "--store", store.root)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("reindexed: 6 refs, 1 tombstones, 2 results")
    (aside,) = store.root.glob(f"{CATALOG_FILE}.damaged-*")
    assert aside.stat().st_size == size  # the user's file, kept as it was
    (line,) = proc.stderr.splitlines()
    assert line.startswith("trajstore: the catalog could not be read (IO Error: ")
    assert line.endswith(f"moved aside to {aside} and rebuilt from the refs")
    rebuilt = _tables(file)

    file.unlink()  # the documented fix before: a reindex of a deleted catalog
    assert cli("reindex", "--store", store.root).returncode == 0
    assert rebuilt == _tables(file)
    assert all(rebuilt.values())  # rows in every table
    assert cli("ls", "--store", store.root).returncode == 0


def test_reindex_of_a_server_catalog_moves_nothing_aside(duck_store):
    """Only a DuckDB file is the store's to move: a server catalog's error is one line."""
    store = duck_store
    store.publish(120, 0)
    url = "postgresql+psycopg://nobody@127.0.0.1:1/nothing"
    proc = cli("reindex", "--store", store.root, "--catalog", url)
    assert proc.returncode == 2
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"trajstore: error: cannot connect to catalog {url}")
    assert not list(store.root.glob("*.damaged-*"))


@pytest.mark.parametrize(
    "sql",
    [
        "INSERT INTO runs VALUES ('x', NULL)",
        "UPDATE bundles SET attempt = 9",
        "DELETE FROM bundles",
        "CREATE TABLE evil (a INT)",
        "DROP TABLE bundles",
        "ATTACH '/tmp/evil.duckdb' AS evil",
        "COPY bundles TO '/tmp/evil.csv'",
        "SELECT 1; DROP TABLE bundles",
        "WITH x AS (SELECT 1) INSERT INTO runs SELECT 'x', NULL",
        "EXPLAIN ANALYZE DELETE FROM bundles",
        "PRAGMA enable_profiling",
        "SET threads = 1",
        "SELECT * FROM read_csv('/etc/passwd')",
    ],
)
def test_readonly_sql_refuses_writes(store, sql):
    store.publish(120, 0)
    _sync(store)
    with store.catalog() as cat:
        with pytest.raises(UsageError):
            run_readonly_sql(cat, sql)
        assert stats(cat)["bundles"] == 1
        assert not sa.inspect(cat.engine).has_table("evil")


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT key, attempt FROM bundles",
        "WITH b AS (SELECT * FROM bundles) SELECT count(*) FROM b",
        "EXPLAIN SELECT * FROM samples",
    ],
)
def test_readonly_sql_allows_reads(store, sql):
    store.publish(120, 0)
    _sync(store)
    with store.catalog() as cat:
        columns, rows = run_readonly_sql(cat, sql)
    assert columns and rows
    json.dumps(rows)


@pytest.mark.parametrize(
    "sql",
    ["DESCRIBE bundles", "SHOW TABLES", "PRAGMA table_info('bundles')", "SUMMARIZE samples"],
)
def test_readonly_sql_allows_duckdb_reads(duck_store, sql):
    store = duck_store
    store.publish(120, 0)
    _sync(store)
    with store.catalog() as cat:
        columns, rows = run_readonly_sql(cat, sql)
    assert columns and rows
    json.dumps(rows)


def test_sync_still_works_after_readonly_sql(store):
    store.publish(120, 0)
    with store.catalog() as cat:
        run_readonly_sql(cat, "SELECT 1")
        store.publish(121, 0)
        assert sync_catalog(cat, store.root, store.load).new_refs == 2


SYNCER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from trajstore.catalog import open_catalog, sync_catalog
    from trajstore.store import Store
    store = Path(sys.argv[1])
    load = Store.open(store, create=False).load_document
    with open_catalog(store, lock_timeout=120) as cat:
        sync_catalog(cat, store, load)
        if len(sys.argv) > 2:  # hold the catalog until told to let go
            print("holding", flush=True)
            sys.stdin.readline()
    """
)


def _spawn(store: StoreWriter, *, hold: bool = False) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, "-c", SYNCER, str(store.root)] + (["hold"] if hold else []),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_concurrent_syncers_retry_the_lock_and_index_everything(duck_store):
    store = duck_store
    keys = {store.publish(r, 0) for r in range(10)}
    holder = _spawn(store, hold=True)
    assert holder.stdout.readline().strip() == "holding"
    keys |= {store.publish(r, 0) for r in range(10, 20)}
    syncers = [_spawn(store), _spawn(store)]
    assert all(p.poll() is None for p in syncers)  # blocked on the lock, not failed
    holder.communicate("go\n")
    results = [p.communicate() for p in syncers]
    assert holder.returncode == 0
    assert [p.returncode for p in syncers] == [0, 0], results
    with store.catalog() as cat:
        indexed = {b["key"] for b in list_bundles(cat, limit=1000)["items"]}
    assert indexed == keys


def test_lock_timeout_names_the_lock(duck_store):
    store = duck_store
    holder = _spawn(store, hold=True)
    assert holder.stdout.readline().strip() == "holding"
    try:
        with pytest.raises(StoreError, match="locked by another process"):
            store.catalog(lock_timeout=0.2)
    finally:
        holder.communicate("go\n")


def test_snapshot_answers_while_file_is_held_and_refreshes(duck_store):
    store = duck_store
    store.publish(120, 0)
    with store.catalog() as cat:
        sync_catalog(cat, store.root, store.load)
        snap = cat.snapshot_in_memory()
    try:
        store.publish(121, 0)
        writer = _spawn(store, hold=True)  # another process writes the file catalog
        assert writer.stdout.readline().strip() == "holding"
        try:
            assert len(lookup_step(snap, "default", 120, 0)) == 1
            assert lookup_step(snap, "default", 121, 0) == []
            store.publish(122, 0)
            assert sync_catalog(snap, store.root, store.load).new_refs == 2
            assert len(lookup_step(snap, "default", 122, 0)) == 1
        finally:
            writer.communicate("go\n")
        assert writer.returncode == 0
    finally:
        snap.close()
