"""A misspelt filter is refused with the names it could have been, never answered with an
empty list (which reads as "nothing diverged"): an unknown run, stage or first divergent
stage, from the CLI (both catalog readers) and REST. A store of real bundles: run
"default" (step 7:1 replayed with --record, so it has divergences) and run "gone"
(ingested, then removed with `rm`: known, with nothing left to list)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import make_contents
from inprocess_cli import cli
from test_api import serve

from trajstore.bundle.writer import write_bundle
from trajstore.catalog import queries
from trajstore.catalog.direct import DirectCatalog
from trajstore.errors import NotFoundError, UsageError
from trajstore.store import Store
from trajstore.vocab import STAGE_ORDER

pytestmark = pytest.mark.unit

RUNS = "runs: default, gone"


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("filters")
    write_bundle(root / "cap" / "replay-7-1", make_contents(step_id=1, seed=1))
    st = root / "store"
    with Store.open(st) as store:
        for run in ("default", "gone"):
            assert all(o.status == "published" for o in store.ingest([root / "cap"], run=run))
    rec = cli("replay", "--store", st, "--run", "default", "--step", "7:1", "--record")
    assert rec.returncode == 1, rec.stderr  # factory numbers are random: it diverges
    removed = cli("rm", "--store", st, "--run", "gone")
    assert removed.returncode == 0, removed.stderr
    return st


def _recorded_stage(store_dir: Path) -> str:
    res = cli("query", "divergences", "--store", store_dir, "--format", "json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)[0]["stage"]


@pytest.mark.parametrize(
    "command",
    [
        ("query", "steps"),
        ("query", "bundles"),
        ("query", "divergences"),
        ("query", "routes"),
        ("ls",),
    ],
)
def test_cli_unknown_run_is_refused_naming_the_runs(store_dir: Path, command: tuple) -> None:
    res = cli(*command, "--store", store_dir, "--run", "defualt")
    assert res.returncode == 2
    assert res.stdout == ""
    assert res.stderr.strip() == f"trajstore: error: run 'defualt' is not in the store ({RUNS})"


def test_cli_removed_run_is_known_and_lists_nothing(store_dir: Path) -> None:
    res = cli("query", "steps", "--store", store_dir, "--run", "gone")
    assert (res.returncode, res.stdout.strip()) == (0, "(no rows)"), res.stderr


def test_cli_unknown_stage_is_refused_naming_the_stages(store_dir: Path) -> None:
    res = cli("query", "divergences", "--store", store_dir, "--stage", "loss")
    assert res.returncode == 2
    assert res.stderr.strip() == (
        f"trajstore: error: stage must be one of {', '.join(STAGE_ORDER)}, got 'loss'"
    )


def test_cli_unknown_first_divergent_stage_is_refused(store_dir: Path) -> None:
    res = cli("query", "steps", "--store", store_dir, "--first-divergent-stage", "advantage")
    assert res.returncode == 2
    assert "first_divergent_stage must be one of" in res.stderr
    assert "got 'advantage'" in res.stderr


def test_cli_recorded_stage_still_filters(store_dir: Path) -> None:
    stage = _recorded_stage(store_dir)
    res = cli(
        "query", "divergences", "--store", store_dir, "--run", "default", "--stage", stage,
        "--format", "json",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert rows and {r["stage"] for r in rows} == {stage}


def test_both_catalog_readers_refuse_an_unknown_stage(store_dir: Path) -> None:
    with DirectCatalog.open(store_dir) as direct, pytest.raises(UsageError, match="'loss'"):
        direct.divergences(stage="loss")
    with DirectCatalog.open(store_dir) as direct, pytest.raises(UsageError, match="'sampel'"):
        direct.steps(first_divergent_stage="sampel")
    with Store.open(store_dir) as store, store.catalog() as cat:
        with pytest.raises(UsageError, match="'loss'"):
            queries.query_divergences(cat, stage="loss")
        with pytest.raises(UsageError, match="'sampel'"):
            queries.query_steps(cat, first_divergent_stage="sampel")


def test_both_catalog_readers_know_the_same_runs(store_dir: Path) -> None:
    from trajstore.cli._catalog import PagedReader

    with DirectCatalog.open(store_dir) as direct:
        names = direct.run_names()
    with Store.open(store_dir) as store, store.catalog() as cat:
        assert PagedReader(cat).run_names() == names == ["default", "gone"]


@pytest.mark.parametrize("path", ["/v1/divergences", "/v1/router/metrics", "/v1/stats"])
def test_rest_unknown_run_is_404_naming_the_runs(store_dir: Path, path: str) -> None:
    with serve(store_dir) as client:
        resp = client.get(path, params={"run": "defualt"})
    assert resp.status_code == 404, resp.text
    assert resp.json()["error"] == "not_found"
    assert "no run 'defualt'" in resp.json()["detail"]
    assert "'default'" in resp.json()["detail"]


def test_rest_stats_of_a_removed_run_counts_its_removed_bundles(store_dir: Path) -> None:
    with serve(store_dir) as client:
        resp = client.get("/v1/stats", params={"run": "gone"})
    assert resp.status_code == 200, resp.text
    assert (resp.json()["bundles"], resp.json()["removed_bundles"]) == (0, 1)


def test_rest_unknown_stage_is_400(store_dir: Path) -> None:
    with serve(store_dir) as client:
        div = client.get("/v1/divergences", params={"stage": "loss"})
        steps = client.get("/v1/runs/default/steps", params={"first_divergent_stage": "loss"})
        good = client.get("/v1/divergences", params={"stage": _recorded_stage(store_dir)})
    assert (div.status_code, steps.status_code) == (400, 400)
    assert "got 'loss'" in div.json()["detail"] and "got 'loss'" in steps.json()["detail"]
    assert good.status_code == 200 and good.json()["items"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--min-abs-err", "nan"), "argument --min-abs-err: 'nan' is not a finite number >= 0"),
        (("--min-abs-err", "inf"), "argument --min-abs-err: 'inf' is not a finite number >= 0"),
        (
            ("--rollout-from", "-5"),
            f"argument --rollout-from: '-5' is not a rollout id (an integer from 0 to {2**63 - 1})",
        ),
    ],
)
def test_cli_a_bound_no_row_can_meet_is_refused(store_dir: Path, args: tuple, message: str) -> None:
    # nan matched no row (an empty answer); REST refused these already (422)
    res = cli("query", "divergences", "--store", store_dir, *args)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().endswith(message)


def test_cli_a_rollout_id_past_bigint_is_refused(store_dir: Path) -> None:
    # it reached PostgreSQL as an overflow: "internal error", exit 2 with a traceback hint
    res = cli("query", "divergences", "--store", store_dir, "--rollout-to", str(2**64))
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().endswith(
        f"argument --rollout-to: '{2**64}' is not a rollout id (an integer from 0 to {2**63 - 1})"
    )


def test_both_catalog_readers_refuse_a_rollout_bound_past_bigint(store_dir: Path) -> None:
    with DirectCatalog.open(store_dir) as direct, pytest.raises(UsageError, match="rollout_from"):
        direct.steps(rollout_from=2**63)
    with (
        Store.open(store_dir) as store,
        store.catalog() as cat,
        pytest.raises(UsageError, match="rollout_to"),
    ):
        queries.query_divergences(cat, rollout_to=2**63)


def test_cli_a_limit_past_bigint_lists_every_row(store_dir: Path) -> None:
    # DuckDB refused the LIMIT as an overflow ("internal error"); no table has that many rows
    def rows(*args: str) -> list:
        res = cli("query", "bundles", "--store", store_dir, "--format", "json", *args)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)

    assert rows("--limit", str(10**20)) == rows()


def test_cli_unknown_sample_is_refused(store_dir: Path) -> None:
    # a misspelt sample id listed no divergences, which reads as "it never diverged"
    res = cli("query", "divergences", "--store", store_dir, "--sample", "s-O")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip() == "trajstore: error: sample 's-O' is in no bundle of the store"


def test_cli_known_sample_still_filters(store_dir: Path) -> None:
    res = cli(
        "query", "divergences", "--store", store_dir, "--sample", "s-0", "--format", "json"
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert {r["sample_id"] for r in json.loads(res.stdout)} <= {"s-0"}


def test_a_sample_outside_the_given_run_is_refused_naming_it(store_dir: Path) -> None:
    with DirectCatalog.open(store_dir) as direct:
        assert direct.has_sample("s-0", "gone")  # a removed run's samples are still known
        with pytest.raises(NotFoundError, match="no bundle of run 'nope'"):
            direct.divergences(sample_id="s-0", run="nope")


def test_both_catalog_readers_refuse_an_unknown_sample(store_dir: Path) -> None:
    with DirectCatalog.open(store_dir) as direct, pytest.raises(NotFoundError, match="'s-O'"):
        direct.divergences(sample_id="s-O")
    with (
        Store.open(store_dir) as store,
        store.catalog() as cat,
        pytest.raises(NotFoundError, match="'s-O'"),
    ):
        queries.query_divergences(cat, sample_id="s-O")


def test_rest_unknown_sample_is_404(store_dir: Path) -> None:
    with serve(store_dir) as client:
        resp = client.get("/v1/divergences", params={"sample_id": "s-O"})
        good = client.get("/v1/divergences", params={"sample_id": "s-0"})
    assert resp.status_code == 404, resp.text
    assert resp.json()["detail"] == "sample 's-O' is in no bundle of the store"
    assert good.status_code == 200
