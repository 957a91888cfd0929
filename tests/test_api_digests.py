"""A step's first lookup: summaries from sample digests (api/snapshot.py), preloaded at
the view build or loaded lazily (in batches; on the DuckDB snapshot key by key through its
samples index), answer exactly what the sample rows say; the
capabilities preloaded at start-up skip a damaged manifest without stopping the server.

In process (AppState over a real store in a temp dir); the HTTP path is covered by
tests/test_api.py, which pins the summary against the bundles' index.json.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import CAPTURE_DIR, FIXTURES
from trajstore.api import snapshot
from trajstore.api.detail import group_detail, samples_summary
from trajstore.api.state import AppState

from trajstore.catalog.queries import samples_of
from trajstore.errors import IntegrityError
from trajstore.store import Store

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The multi-rank capture (run "cap") and the single example bundle (run "ex")."""
    root = tmp_path_factory.mktemp("digests") / "store"
    with Store.open(root, durable=False) as st:
        assert all(o.status == "published" for o in st.ingest([CAPTURE_DIR], run="cap"))
        assert all(
            o.status == "published" for o in st.ingest([FIXTURES / "example_bundle"], run="ex")
        )
    return root


def _bodies(state: AppState) -> dict[tuple, bytes]:
    """Every step's and rollout's detail JSON."""
    return {
        group: group_detail(state, *group, None).model_dump_json().encode()
        for group in sorted(state.view.groups, key=str)
    }


def _oracle(state: AppState, key: str, rank: int | None) -> dict:
    """The summary's counts, groups and micro-batches computed sample row by sample row."""
    groups: dict[tuple, list[str]] = {}
    micro_batches: dict[tuple, int] = {}
    rows = samples_of(state.snap.catalog, key)
    for sample in rows:
        groups.setdefault((sample["semantic_group"], sample["group_index"]), []).append(
            sample["sample_id"]
        )
        batch = (sample["micro_batch_id"], rank if sample["rank"] is None else sample["rank"])
        micro_batches[batch] = micro_batches.get(batch, 0) + 1
    return {
        "num_samples": len(rows),
        "num_tokens": sum(sample["total_length"] or 0 for sample in rows),
        "num_response_tokens": sum(sample["response_length"] or 0 for sample in rows),
        "groups": groups,
        "micro_batches": micro_batches,
    }


def test_summary_of_each_bundle_matches_its_sample_rows(store: Path) -> None:
    state = AppState(store, None, 60.0)
    try:
        rows = [state.view.bundles[key] for key in state.view.keys]
        assert len(rows) > 3
        for row in rows:
            got = samples_summary(state.view, [row])
            want = _oracle(state, row["key"], row["rank"])
            assert want["num_samples"] > 0
            assert got.num_samples == want["num_samples"]
            assert got.num_tokens == want["num_tokens"]
            assert got.num_response_tokens == want["num_response_tokens"]
            assert {(g.semantic_group, g.group_index): g.sample_ids for g in got.groups} == want[
                "groups"
            ]
            assert {(m.micro_batch_id, m.rank): m.num_samples for m in got.micro_batches} == want[
                "micro_batches"
            ]
    finally:
        state.close()


def test_lazy_digests_give_the_preloaded_bodies(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    preloaded = AppState(store, None, 60.0)
    try:
        want = _bodies(preloaded)
    finally:
        preloaded.close()
    # nothing preloaded or packed, one bundle besides the asked ones per batch: the lazy path
    monkeypatch.setattr(snapshot, "PRELOAD_SAMPLES", 0)
    monkeypatch.setattr(snapshot, "PACKED_CHARS", 0)
    monkeypatch.setattr(snapshot, "DIGEST_BATCH", 1)
    lazy = AppState(store, None, 60.0)
    try:
        assert lazy.view.samples.digests([], ()) == {}
        assert not lazy.view.samples._digests  # noqa: SLF001 (the path under test)
        assert not lazy.view.samples._packed  # noqa: SLF001
        assert _bodies(lazy) == want
        assert lazy.view.samples._digests  # noqa: SLF001
    finally:
        lazy.close()


def test_a_digest_miss_reads_the_snapshot_through_its_samples_index(store: Path) -> None:
    """The server's in-memory snapshot indexes samples by bundle key, and DuckDB answers a
    miss's equality from it (the executed plan's scan is an index scan, not a full one)."""
    state = AppState(store, None, 60.0)
    try:
        catalog = state.snap.catalog
        with catalog.connect() as conn:
            indexes = conn.exec_driver_sql(
                "SELECT index_name FROM duckdb_indexes() WHERE table_name = 'samples'"
            ).scalars()
            assert snapshot.SNAPSHOT_SAMPLES_INDEX in set(indexes)
            key = state.view.keys[0]
            plan = "\n".join(
                str(row[-1])
                for row in conn.exec_driver_sql(
                    "EXPLAIN ANALYZE SELECT sample_id FROM samples WHERE bundle_key = ?", (key,)
                )
            )
        assert "Type: Index Scan" in plan, plan
    finally:
        state.close()


def test_a_lazy_digest_of_a_step_synced_after_earlier_misses_is_read(
    tmp_path: Path, make_bundle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A digest miss reads through one connection held across misses (not a pool checkout
    each): a step synced after that connection's first use is still read whole (no
    transaction of the first miss outlives it)."""
    monkeypatch.setattr(snapshot, "PRELOAD_SAMPLES", 0)  # every digest loads on a miss
    monkeypatch.setattr(snapshot, "PACKED_CHARS", 0)
    root = tmp_path / "store"
    with Store.open(root, durable=False) as st:
        assert st.ingest([make_bundle(rollout_id=0, step_id=0)], run="r")[0].status == "published"
        state = AppState(root, None, 3600.0)
        try:
            first = group_detail(state, "r", "step", 0, 0, None)
            assert first.samples.num_samples > 0
            (outcome,) = st.ingest([make_bundle(rollout_id=1, step_id=0)], run="r")
            assert outcome.status == "published"
            assert state.snap.refresh(force=True)
            (row,) = state.view.groups["r", "step", 1, 0]
            got = group_detail(state, "r", "step", 1, 0, None).samples
            want = _oracle(state, row["key"], row["rank"])
            assert want["num_samples"] > 0
            assert got.num_samples == want["num_samples"]
            assert got.num_tokens == want["num_tokens"]
            assert {(g.semantic_group, g.group_index): g.sample_ids for g in got.groups} == want[
                "groups"
            ]
        finally:
            state.close()


def test_a_step_synced_after_start_is_packed_by_the_view_build(tmp_path: Path, make_bundle) -> None:
    """A DuckDB snapshot packs every bundle's digest at start-up and each new bundle's at the
    view build after its sync (a key-filtered pack); lookups read those, not sample rows."""
    root = tmp_path / "store"
    with Store.open(root, durable=False) as st:
        assert st.ingest([make_bundle(rollout_id=0, step_id=0)], run="r")[0].status == "published"
        state = AppState(root, None, 3600.0)
        try:
            cache = state.view.samples
            assert set(cache._packed) == set(state.view.keys)  # noqa: SLF001 (under test)
            (outcome,) = st.ingest([make_bundle(rollout_id=1, step_id=0)], run="r")
            assert outcome.status == "published"
            assert state.snap.refresh(force=True)
            assert set(cache._packed) == set(state.view.keys)  # noqa: SLF001
            for group in [("r", "step", 0, 0), ("r", "step", 1, 0)]:
                (row,) = state.view.groups[group]
                got = group_detail(state, *group, None).samples
                want = _oracle(state, row["key"], row["rank"])
                assert want["num_samples"] > 0
                assert got.num_samples == want["num_samples"]
                assert got.num_tokens == want["num_tokens"]
                assert got.num_response_tokens == want["num_response_tokens"]
                assert {
                    (g.semantic_group, g.group_index): g.sample_ids for g in got.groups
                } == want["groups"]
                assert {
                    (m.micro_batch_id, m.rank): m.num_samples for m in got.micro_batches
                } == want["micro_batches"]
        finally:
            state.close()


def test_a_store_over_the_packing_bound_reads_the_rest_on_first_use(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packing stops at PACKED_CHARS; the bundles not packed are read from their sample rows,
    and every body is the one of a fully packed snapshot."""
    whole = AppState(store, None, 60.0)
    try:
        want = _bodies(whole)
        one = min(len(text) for text in whole.view.samples._packed.values())  # noqa: SLF001
    finally:
        whole.close()
    monkeypatch.setattr(snapshot, "PACKED_CHARS", one)
    bounded = AppState(store, None, 60.0)
    try:
        packed = bounded.view.samples._packed  # noqa: SLF001
        assert 1 <= len(packed) < len(bounded.view.keys)
        assert _bodies(bounded) == want
    finally:
        bounded.close()


def _samples_table(con: Any) -> None:
    con.execute(
        "CREATE TABLE samples (bundle_key VARCHAR, position INTEGER, sample_id VARCHAR, "
        "semantic_group VARCHAR, group_index INTEGER, micro_batch_id VARCHAR, "
        "rank INTEGER, total_length INTEGER, response_length INTEGER)"
    )
    con.execute(f"CREATE INDEX {snapshot.SNAPSHOT_SAMPLES_INDEX} ON samples (bundle_key)")


def _packed(con: Any, keys: list[str]) -> dict[str, snapshot.SampleDigest]:
    return {
        key: snapshot._unpack(text)  # noqa: SLF001
        for part in snapshot._pack_digests(con, keys)  # noqa: SLF001
        for key, text in part
    }


def test_a_packed_digest_is_the_digest_of_the_sample_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Packed in DuckDB as JSON and unpacked here, a digest is the one its sample rows give:
    ids that JSON must escape, missing groups, ranks and lengths, groups interleaved; by
    key list or (more keys than PACK_CHUNK) by key ranges, which leave out the keys in a
    range that were not asked for."""
    import duckdb

    odd = ['quo"te', "back\\slash", "new\nline", "tab\t", "ünï ✓", "\x01ctl", "", "s-7"]
    rows = []
    for position, sample_id in enumerate(odd):
        group = [None, "g-a", 'g-"b'][position % 3]
        index = None if group is None else position % 2
        rank = None if position % 4 == 0 else position % 2
        total = None if position == 3 else 100 + position
        response = None if position == 5 else position
        micro_batch = None if position == 6 else f"mb-{position // 3}"
        rows.append(("k1", position, sample_id, group, index, micro_batch, rank, total, response))
    rows.append(("k2", 0, "only", "g", 0, "mb", 0, None, None))
    rows.append(("k3", 0, "x", None, None, None, None, 1, 1))
    con = duckdb.connect(":memory:")
    try:
        _samples_table(con)
        for row in reversed(rows):
            con.execute("INSERT INTO samples VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", list(row))
        want = snapshot._load_digests_by_key(con, ["k1", "k2", "k3"])  # noqa: SLF001
        assert want["k1"].num_samples == len(odd)
        assert _packed(con, ["k3", "k1", "k2"]) == want
        assert _packed(con, ["k2", "absent"]) == {"k2": want["k2"]}
        monkeypatch.setattr(snapshot, "PACK_CHUNK", 2)  # by ranges: k1..k3 (holds k2), zz
        assert _packed(con, ["k3", "k1", "zz"]) == {"k1": want["k1"], "k3": want["k3"]}
        monkeypatch.setattr(snapshot, "PACK_CHUNK", 1)
        assert _packed(con, ["k3", "k2", "k1"]) == want
    finally:
        con.close()


def test_a_digest_read_by_key_is_in_sample_order_whatever_the_row_order() -> None:
    """The rows of a miss come back in the table's (or the index's) order, which need not
    be the samples' order: a group's sample ids are listed by position all the same."""
    import duckdb

    con = duckdb.connect(":memory:")
    try:
        _samples_table(con)
        for position in (2, 0, 3, 1):
            con.execute(
                "INSERT INTO samples VALUES ('k', ?, ?, 'g', 0, 'mb', NULL, 10, 4)",
                [position, f"s-{position}"],
            )
        (digest,) = snapshot._load_digests_by_key(con, ["k", "absent"]).values()  # noqa: SLF001
        assert digest.groups == {("g", 0): ["s-0", "s-1", "s-2", "s-3"]}
        assert (digest.num_samples, digest.num_tokens, digest.num_response_tokens) == (4, 40, 16)
        assert digest.micro_batches == {("mb", None): 4}
    finally:
        con.close()


def test_a_damaged_manifest_is_skipped_at_start_and_fails_its_lookup(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with Store.open(root, durable=False) as st:
        assert all(
            o.status == "published" for o in st.ingest([FIXTURES / "example_bundle"], run="ex")
        )
    first = AppState(root, None, 60.0)  # syncs the catalog file while the manifest is whole
    try:
        (group,) = [g for g in first.view.groups if g[1] == "step"]
        (row,) = first.view.groups[group]
    finally:
        first.close()
    with Store.open(root, create=False) as st:
        loc = st.objs._index[row["manifest_hash"]]  # noqa: SLF001 (where to damage it)
        pack = root / "packs" / f"{loc.pack}.pack"
    data = bytearray(pack.read_bytes())
    data[loc.offset + loc.length // 2] ^= 0xFF
    pack.write_bytes(bytes(data))
    state = AppState(root, None, 60.0)
    try:
        with pytest.raises(IntegrityError, match=row["manifest_hash"]):
            group_detail(state, *group, None)
    finally:
        state.close()
