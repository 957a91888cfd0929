"""Bytes each run added to the store (issue 29 item 10): `trajstore stats`, the REST run
summary and the catalog agree with each other and with the bytes under packs/ and
objects/ of a real store holding two runs that share content.

The oracle is the store's files, read with os.stat: every object the store holds is a
loose file under objects/ or a slice of a pack file, and a pack file is the 8-byte pack
magic followed by its objects (trajstore.cas.packs). So the objects' bytes are the
loose files plus the pack files minus 8 bytes each; the pack overhead left out is that
magic and the .idx files (16 + 48 per object + 32 bytes each), which hold names, not
objects. Nothing else writes objects here, so the runs' added bytes sum to exactly that.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
import web_demo
from conftest import make_contents
from trajstore.examples import gen_long_run

from trajstore.bundle.writer import write_rank
from trajstore.catalog.overview import run_summary
from trajstore.cli import main as trajstore_main
from trajstore.store import Store
from trajstore.store.shards import store_rank_shard

pytestmark = pytest.mark.integration

FIXTURE_STORE = Path(__file__).parent / "fixtures" / "store-format1"
#: bytes in front of the objects of every pack file (`PACK_MAGIC`)
PACK_MAGIC_BYTES = 8
#: what migrations 0006's and 0005's downgrades run (DuckDB drops no column under an index)
DOWN_TO_0004 = (
    "DROP TABLE mismatch_layers",
    "DROP INDEX ix_mismatch_metrics_step",
    "DROP TABLE mismatch_metrics",
    "DROP INDEX ix_bundles_step",
    "ALTER TABLE bundles DROP COLUMN added_bytes",
    "CREATE INDEX ix_bundles_step ON bundles (run, rollout_id, step_id)",
)
GEN = ["--rollouts", "3", "--steps", "2", "--samples", "16", "--min-len", "8"]
GEN += ["--max-len", "48", "--seed", "11"]


def object_bytes_on_disk(root: Path) -> int:
    """The bytes of every object the directory store holds, from its files alone."""
    packs = [p.stat().st_size - PACK_MAGIC_BYTES for p in (root / "packs").glob("*.pack")]
    loose = [p.stat().st_size for p in (root / "objects").rglob("*") if p.is_file()]
    return sum(packs) + sum(loose)


def cli_json(*args: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert trajstore_main(list(args)) == 0
    return json.loads(out.getvalue())


def _gen(out: Path, *extra: str) -> Path:
    with contextlib.redirect_stderr(io.StringIO()):
        assert gen_long_run.main([str(out), *GEN, *extra]) == 0
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run `a`, then run `b`: the same long run with one rollout's rewards normalized
    differently (the demo's fault), so `b` shares almost everything with `a`."""
    root = tmp_path_factory.mktemp("added")
    a = _gen(root / "capture-a")
    b = _gen(root / "capture-b", "--fault-reward-norm", "1")
    with Store.open(root / "store") as st:
        assert {o.status for o in st.ingest([a], run="a")} == {"published"}
        assert {o.status for o in st.ingest([b], run="b")} == {"published"}
    return root / "store"


@pytest.fixture(scope="module")
def stats(store: Path) -> dict:
    return cli_json("stats", "--store", str(store), "--json")


@pytest.fixture(scope="module")
def rest(store: Path) -> Iterator[httpx.Client]:
    with web_demo.serve_here(store) as base, httpx.Client(base_url=base, timeout=60) as http:
        yield http


def _runs(stats: dict) -> dict[str, dict]:
    return {r["run"]: r for r in stats["runs"]}


def test_the_runs_added_bytes_sum_to_the_object_bytes_on_disk(store: Path, stats: dict) -> None:
    on_disk = object_bytes_on_disk(store)
    assert sum(r["physical_bytes"] for r in stats["runs"]) == on_disk
    assert stats["added_bytes"] == stats["physical_bytes"] == stats["stored_bytes"] == on_disk


def test_a_run_sharing_content_with_an_earlier_one_adds_little(stats: dict) -> None:
    runs = _runs(stats)
    a, b = runs["a"], runs["b"]
    # `a` came first into an empty store: it stored everything it references
    assert a["physical_bytes"] == a["referenced_bytes"]
    # `b` references as much as `a` but stored only what differs: one rollout's rewards
    # and advantages, and the small documents naming them (~11% at this tiny size)
    assert b["referenced_bytes"] > 0.9 * a["referenced_bytes"]
    assert 0 < b["physical_bytes"] < 0.2 * b["referenced_bytes"]
    assert b["dedup_ratio"] == round(b["logical_bytes"] / b["physical_bytes"], 3)


def test_rest_run_summary_and_stats_give_the_same_bytes(rest: httpx.Client, stats: dict) -> None:
    for run, r in _runs(stats).items():
        summary = rest.get(f"/v1/runs/{run}/summary").json()
        want = (r["bundles"], r["logical_bytes"], r["physical_bytes"], r["dedup_ratio"])
        got = (
            summary["bundles"],
            summary["logical_bytes"],
            summary["physical_bytes"],
            summary["dedup_ratio"],
        )
        assert got == want, run
        sizes = rest.get("/v1/stats", params={"run": run}).json()
        assert (sizes["logical_bytes"], sizes["physical_bytes"]) == want[1:3], run


def object_bytes_in_bucket(store: Store) -> int:
    """The bytes of every object an s3:// store holds, from the bucket's listing alone."""
    import obstore

    prefix = store.objs.loc.prefix  # type: ignore[attr-defined]
    listed = [
        m
        for batch in obstore.list(store.objs.client, prefix=prefix)  # type: ignore[attr-defined]
        for m in batch
    ]
    packs = [m["size"] - PACK_MAGIC_BYTES for m in listed if m["path"].endswith(".pack")]
    loose = [m["size"] for m in listed if m["path"].startswith(f"{prefix}objects/")]
    return sum(packs) + sum(loose)


def test_a_cohort_stored_rank_by_rank_adds_what_is_stored(store_url: str, tmp_path: Path) -> None:
    """Capture into a store rank by rank (the shards path, how capture stores into s3://):
    each rank's objects and the cohort COMPLETE written at publication count once."""
    ranks = [0, 1]
    with Store.open(store_url) as st:
        for r in reversed(ranks):
            contents = make_contents(rank=r, world=2, lengths=20, bundle_id="c")
            dest = tmp_path / f"host-{r}" / "replay-7-0"
            member = write_rank(dest, contents, rank=r, expected_ranks=ranks)
            store_rank_shard(st, member, "r")
        stored = object_bytes_in_bucket(st) if st.is_remote else object_bytes_on_disk(st.root)
    stats = cli_json("stats", "--store", store_url, "--json")
    assert stats["runs"][0]["physical_bytes"] == stored > 0


# -- stores written before added bytes were recorded --------------------------


def test_an_old_store_says_not_recorded(tmp_path: Path) -> None:
    old = tmp_path / "old"
    shutil.copytree(FIXTURE_STORE, old)
    stats = cli_json("stats", "--store", str(old), "--json")
    assert [(r["physical_bytes"], r["dedup_ratio"]) for r in stats["runs"]] == [(None, None)]
    assert stats["added_bytes"] is None
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert trajstore_main(["stats", "--store", str(old)]) == 0
    assert "not recorded" in out.getvalue().splitlines()[1]
    run = stats["runs"][0]["run"]
    with web_demo.serve_here(old) as base:
        summary = httpx.get(f"{base}/v1/runs/{run}/summary", timeout=60).json()
    assert (summary["physical_bytes"], summary["dedup_ratio"]) == (None, None)
    assert summary["logical_bytes"] == stats["runs"][0]["logical_bytes"] > 0


def test_upgrading_a_0004_catalog_backfills_added_bytes(
    tmp_path: Path, store: Path, stats: dict, catalog_url: str | None
) -> None:
    """A catalog that synced the refs at 0004 (no column) gets the column filled by the
    sync that follows the 0005 upgrade, on DuckDB and PostgreSQL alike."""
    copy = tmp_path / "store"
    shutil.copytree(store, copy, ignore=shutil.ignore_patterns("catalog.duckdb*"))
    with Store.open(copy, catalog_url=catalog_url) as st:
        st.index_new()
        with st.catalog() as cat, cat.begin() as conn:  # as 0004 left it: every ref synced
            for sql in DOWN_TO_0004:
                conn.execute(sa.text(sql))
            conn.execute(sa.text("UPDATE alembic_version SET version_num = '0004'"))
        st.index_new()
        with st.catalog() as cat:
            got = {run: run_summary(cat, run)["physical_bytes"] for run in ("a", "b")}
    assert got == {run: r["physical_bytes"] for run, r in _runs(stats).items()}


@pytest.mark.parametrize("session", [None, "s1"])
def test_a_rank_stored_again_is_the_same_shard(tmp_path: Path, session: str | None) -> None:
    """A rank's shard stored twice (a retry) is one shard whatever the second write added
    (nothing: its objects are there), and the cohort's added bytes are still on disk."""
    ranks = [0, 1]
    members = {}
    for r in ranks:
        contents = make_contents(rank=r, world=2, lengths=20, bundle_id="c")
        dest = tmp_path / f"host-{r}" / "replay-7-0"
        members[r] = write_rank(dest, contents, rank=r, expected_ranks=ranks)
    with Store.open(tmp_path / "store") as st:
        first = store_rank_shard(st, members[1], "r", session=session)
        again = store_rank_shard(st, members[1], "r", session=session)
        assert again.shard == first.shard and not again.published
        assert store_rank_shard(st, members[0], "r", session=session).published
    stats = cli_json("stats", "--store", str(tmp_path / "store"), "--json")
    assert stats["runs"][0]["physical_bytes"] == object_bytes_on_disk(tmp_path / "store")
