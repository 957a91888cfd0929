"""`--status unreplayed`: steps with no recorded replay result, the same from the
query function, the CLI and REST (a store of real bundles, one of them replayed
with `replay --record`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FIXTURES, make_contents
from inprocess_cli import cli
from test_api import serve

from trajstore.bundle.writer import write_bundle
from trajstore.catalog import queries
from trajstore.cli import query_cmds
from trajstore.errors import UsageError
from trajstore.store import Store

pytestmark = pytest.mark.unit

STEPS = (0, 1, 2)
REPLAYED = 1
DIVERGENT = FIXTURES / "example_bundle_divergent"


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 7:0, 7:1, 7:2 ingested; only 7:1 replayed with --record (it diverges:
    factory numbers are random)."""
    root = tmp_path_factory.mktemp("status")
    for s in STEPS:
        write_bundle(root / "cap" / f"replay-7-{s}", make_contents(step_id=s, seed=s))
    st = root / "store"
    with Store.open(st) as store:
        assert all(o.status == "published" for o in store.ingest([root / "cap"]))
    rec = cli("replay", "--store", st, "--step", f"7:{REPLAYED}", "--record")
    assert rec.returncode == 1, rec.stderr
    return st


def _steps(rows: list[dict]) -> list[tuple[int, int]]:
    return [(r["rollout_id"], r["step_id"]) for r in rows]


def test_query_function_lists_steps_without_a_result(store_dir: Path) -> None:
    with Store.open(store_dir) as store, store.catalog() as cat:
        items = queries.query_steps(cat, status="unreplayed")["items"]
    assert _steps(items) == [(7, 0), (7, 2)]
    assert all(r["status"] is None and r["result_id"] is None for r in items)


def test_recorded_verdict_filter_still_excludes_unreplayed_steps(store_dir: Path) -> None:
    with Store.open(store_dir) as store, store.catalog() as cat:
        items = queries.query_steps(cat, status="diverged")["items"]
    assert _steps(items) == [(7, REPLAYED)]


def test_unknown_status_is_a_usage_error(store_dir: Path) -> None:
    with (
        Store.open(store_dir) as store,
        store.catalog() as cat,
        pytest.raises(UsageError, match="unreplayed"),
    ):
        queries.query_steps(cat, status="unreplyed")


def test_cli_offers_exactly_the_statuses_the_query_accepts(store_dir: Path) -> None:
    with Store.open(store_dir) as store, store.catalog() as cat:
        for status in query_cmds.STEP_STATUSES:
            queries.query_steps(cat, status=status)  # each accepted
        with pytest.raises(UsageError, match=", ".join(query_cmds.STEP_STATUSES)):
            queries.query_steps(cat, status="passed")


def test_cli_query_steps_status_unreplayed(store_dir: Path) -> None:
    res = cli("query", "steps", "--store", store_dir, "--status", "unreplayed", "--format", "json")
    assert res.returncode == 0, res.stderr
    assert _steps(json.loads(res.stdout)) == [(7, 0), (7, 2)]


def test_rest_steps_status_unreplayed_matches_the_cli(store_dir: Path) -> None:
    res = cli("query", "steps", "--store", store_dir, "--status", "unreplayed", "--format", "json")
    with serve(store_dir) as client:
        resp = client.get("/v1/runs/default/steps", params={"status": "unreplayed"})
    assert resp.status_code == 200, resp.text
    assert _steps(resp.json()["items"]) == _steps(json.loads(res.stdout)) == [(7, 0), (7, 2)]


def test_rest_unknown_status_is_a_400(store_dir: Path) -> None:
    with serve(store_dir) as client:
        resp = client.get("/v1/runs/default/steps", params={"status": "unreplyed"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"] == "bad_request"


@pytest.fixture(scope="module")
def partly_replayed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The divergent fixture step 120:0, recorded whole (it diverges), then recorded again
    for its passing group g-1 and for the stage advantage.kl alone (both pass)."""
    st = tmp_path_factory.mktemp("partial") / "store"
    with Store.open(st) as store:
        assert all(o.status == "published" for o in store.ingest([DIVERGENT], run="r"))
    base = ("replay", "--store", st, "--step", "120:0", "--no-link", "--record")
    assert cli(*base).returncode == 1
    assert cli(*base, "--group", "g-1").returncode == 0
    assert cli(*base, "--stage", "advantage.kl").returncode == 0
    return st


def test_a_partial_replay_recorded_later_does_not_hide_the_steps_divergence(
    partly_replayed: Path,
) -> None:
    """The step's status is its latest whole replay's; the passing parts stay in its history."""
    with Store.open(partly_replayed) as store, store.catalog() as cat:
        (row,) = queries.query_steps(cat)["items"]
        history = queries.results_of(cat, "r/step-120-0/a1")
    assert (row["status"], row["first_divergent_stage"]) == ("diverged", "advantage.estimate")
    assert [(r["status"], r["selection"]) for r in history] == [
        ("pass", {"stages": ["advantage.kl"]}),
        ("pass", {"samples": [], "groups": ["g-1"], "batches": []}),
        ("diverged", None),
    ]
    res = cli("query", "steps", "--store", partly_replayed, "--format", "json")
    assert [r["status"] for r in json.loads(res.stdout)] == ["diverged"]
    with serve(partly_replayed) as client:
        listed = client.get("/v1/runs/r/steps").json()["items"]
        detail = client.get("/v1/runs/r/steps/120:0").json()
    assert [r["status"] for r in listed] == ["diverged"]
    assert detail["latest_verdict"]["status"] == "diverged"


def test_replay_all_record_replays_a_step_only_partly_recorded(tmp_path: Path) -> None:
    """--all --record skips bundles already recorded; a recorded group is not the step."""
    st = tmp_path / "store"
    with Store.open(st) as store:
        assert all(o.status == "published" for o in store.ingest([DIVERGENT], run="r"))
    part = cli("replay", "--store", st, "--step", "120:0", "--group", "g-1", "--record")
    assert part.returncode == 0, part.stderr
    res = cli("replay", "--store", st, "--all", "--record", "--json")
    assert res.returncode == 1, res.stderr
    summary = json.loads(res.stdout)
    assert (summary["total"], summary["skipped_already_recorded"]) == (1, 0)
    with Store.open(st) as store, store.catalog() as cat:
        assert [r["status"] for r in queries.query_steps(cat)["items"]] == ["diverged"]


def _table(text: str) -> list[dict[str, str]]:
    """The rows of a printed table, each cell cut at its header's column."""
    head, *lines = text.splitlines()
    names = head.split()
    starts = [
        head.index(f"{name} " if i < len(names) - 1 else name) for i, name in enumerate(names)
    ]
    ends = [*starts[1:], None]
    return [
        {name: line[a:b].strip() for name, a, b in zip(names, starts, ends, strict=True)}
        for line in lines
    ]


def test_the_steps_table_leaves_nothing_blank_not_null_or_empty_brackets(store_dir: Path) -> None:
    """A person reads the table: a step never replayed has no status, a single-producer
    step no ranks and no divergent rank; those cells are blank (JSON keeps null and [])."""
    res = cli("query", "steps", "--store", store_dir)
    assert res.returncode == 0, res.stderr
    assert "null" not in res.stdout.split() and "[]" not in res.stdout.split(), res.stdout
    rows = {(r["rollout_id"], r["step_id"]): r for r in _table(res.stdout)}
    assert set(rows) == {("7", str(s)) for s in STEPS}
    unreplayed = rows[("7", "0")]
    assert [unreplayed[c] for c in ("ranks", "status", "first_divergent_stage")] == ["", "", ""]
    replayed = rows[("7", str(REPLAYED))]
    assert replayed["status"] == "diverged" and replayed["first_divergent_stage"]
    assert (replayed["ranks"], replayed["first_divergent_rank"]) == ("", "")
    as_json = cli("query", "steps", "--store", store_dir, "--format", "json")
    first = json.loads(as_json.stdout)[0]
    assert (first["ranks"], first["status"]) == ([], None)


def test_the_sql_table_leaves_a_null_blank(store_dir: Path) -> None:
    res = cli("sql", "--store", store_dir, "SELECT 1 AS a, NULL AS b, 2 AS c")
    assert res.returncode == 0, res.stderr
    assert _table(res.stdout) == [{"a": "1", "b": "", "c": "2"}]
