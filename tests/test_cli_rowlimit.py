"""The row limit of `ls` and `query` tables (docs/cli.md).

A table prints the first TABLE_ROWS rows of its listing, in the listing's order, and one
line on stderr with the exact number of rows left out; --limit N keeps N rows (0: every
row); CSV and JSON list every row unless --limit is given. The commands run in-process
(trajstore.cli.main) on a store of more than TABLE_ROWS steps and bundles, built the
cheap way (refs and results written directly, scripts/bench/bench_catalog.py). The
oracles are the full CSV/JSON listings and counts taken with `trajstore sql`.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from test_catalog_direct import bench_catalog

from trajstore.catalog import open_catalog, sync_catalog
from trajstore.cli import main
from trajstore.cli._catalog import TABLE_ROWS

pytestmark = pytest.mark.unit

#: bundles of the store: about 1.1 per step, 4 steps per rollout (bench_catalog), so
#: more than TABLE_ROWS steps and bundles, and rollouts 0 to past 270
BUNDLES = 1300


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("rowlimit") / "store"
    docs, _ = bench_catalog().build_store(root, BUNDLES)
    (root / "TRAJSTORE_STORE").write_bytes(b"trajstore store, layout 1\n")
    with open_catalog(root) as cat:
        sync_catalog(cat, root, docs.__getitem__)
    return root


def run(capsys: pytest.CaptureFixture, *args: str | Path) -> tuple[str, str]:
    """stdout and stderr of a command that exits 0."""
    capsys.readouterr()
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


def sql_count(capsys: pytest.CaptureFixture, store: Path, statement: str) -> int:
    out, _ = run(capsys, "sql", "--store", store, "--format", "json", statement)
    return json.loads(out)[0]["n"]


def csv_rows(capsys: pytest.CaptureFixture, store: Path, *args: str) -> list[dict]:
    out, err = run(capsys, "query", *args, "--store", store, "--format", "csv")
    assert err == ""
    return list(csv.DictReader(io.StringIO(out)))


def table_lines(out: str) -> list[list[str]]:
    """The table's rows (header dropped), split on blanks: the leading columns are never
    blank (the identity of a step, a bundle key)."""
    lines = out.splitlines()
    return [line.split() for line in lines[1:]]


def left_out(n: int, also: str | None) -> str:
    tail = "" if also is None else f" (as does {also})"
    rows = "row" if n == 1 else "rows"
    return f"trajstore: {n} more {rows} not shown; --limit 0 lists every row{tail}\n"


#: the steps of the listing: latest attempts of step bundles, one per identity
STEP_COUNT = (
    "SELECT count(*) AS n FROM (SELECT DISTINCT run, rollout_id, step_id, attempt "
    "FROM bundles WHERE kind = 'step' AND is_latest{where}) AS s"
)
BUNDLE_COUNT = "SELECT count(*) AS n FROM bundles WHERE is_latest AND removed_at IS NULL"


def test_the_store_has_more_rows_than_a_table_shows(capsys: pytest.CaptureFixture, store: Path):
    assert sql_count(capsys, store, STEP_COUNT.format(where="")) > TABLE_ROWS + 100
    assert sql_count(capsys, store, BUNDLE_COUNT) > TABLE_ROWS + 100


def test_a_steps_table_shows_the_first_rows_and_counts_the_rest(
    capsys: pytest.CaptureFixture, store: Path
) -> None:
    full = csv_rows(capsys, store, "steps")
    assert len(full) == sql_count(capsys, store, STEP_COUNT.format(where=""))
    out, err = run(capsys, "query", "steps", "--store", store)
    rows = table_lines(out)
    assert len(rows) == TABLE_ROWS
    identity = ("run", "rollout_id", "step_id", "attempt")
    assert [r[:4] for r in rows] == [[f[c] for c in identity] for f in full[:TABLE_ROWS]]
    assert err == left_out(len(full) - TABLE_ROWS, "--format csv or json")


def test_ls_shows_the_first_bundles_and_counts_the_rest(
    capsys: pytest.CaptureFixture, store: Path
) -> None:
    out, err = run(capsys, "ls", "--store", store, "--json")
    assert err == ""
    full = [r["key"] for r in json.loads(out)]
    assert len(full) == sql_count(capsys, store, BUNDLE_COUNT)
    out, err = run(capsys, "ls", "--store", store)
    assert [r[0] for r in table_lines(out)] == full[:TABLE_ROWS]
    assert err == left_out(len(full) - TABLE_ROWS, "--json")
    # query bundles: the same listing, the same cut
    out, err = run(capsys, "query", "bundles", "--store", store)
    assert [r[0] for r in table_lines(out)] == full[:TABLE_ROWS]
    assert err == left_out(len(full) - TABLE_ROWS, "--format csv or json")


def test_a_table_of_exactly_the_limit_is_whole(capsys: pytest.CaptureFixture, store: Path):
    # rollouts 20..269: 250 rollouts of 4 steps, TABLE_ROWS steps; one rollout more is 4 past
    assert TABLE_ROWS == 1000
    span = ("--rollout-from", "20", "--rollout-to")
    out, err = run(capsys, "query", "steps", "--store", store, *span, "269")
    assert len(table_lines(out)) == TABLE_ROWS and err == ""
    out, err = run(capsys, "query", "steps", "--store", store, *span, "270")
    assert len(table_lines(out)) == TABLE_ROWS
    assert err == left_out(4, "--format csv or json")


def test_filters_are_counted_as_listed(capsys: pytest.CaptureFixture, store: Path) -> None:
    where = " AND rollout_id >= 5"
    full = csv_rows(capsys, store, "steps", "--rollout-from", "5")
    assert len(full) == sql_count(capsys, store, STEP_COUNT.format(where=where)) > TABLE_ROWS
    _, err = run(capsys, "query", "steps", "--store", store, "--rollout-from", "5")
    assert err == left_out(len(full) - TABLE_ROWS, "--format csv or json")


@pytest.mark.parametrize("n", [1, 7, 1100])
def test_limit_overrides_the_table_rows(capsys: pytest.CaptureFixture, store: Path, n: int):
    full = csv_rows(capsys, store, "steps")
    out, err = run(capsys, "query", "steps", "--store", store, "--limit", str(n))
    rows = table_lines(out)
    assert [r[:4] for r in rows] == [
        [f[c] for c in ("run", "rollout_id", "step_id", "attempt")] for f in full[:n]
    ]
    assert err == left_out(len(full) - n, None)


def test_limit_0_lists_every_row(capsys: pytest.CaptureFixture, store: Path) -> None:
    full = csv_rows(capsys, store, "steps")
    out, err = run(capsys, "query", "steps", "--store", store, "--limit", "0")
    assert len(table_lines(out)) == len(full) and err == ""
    out, err = run(capsys, "ls", "--store", store, "--limit", "0")
    assert len(table_lines(out)) == sql_count(capsys, store, BUNDLE_COUNT) and err == ""


def test_ls_limit(capsys: pytest.CaptureFixture, store: Path) -> None:
    total = sql_count(capsys, store, BUNDLE_COUNT)
    out, err = run(capsys, "ls", "--store", store, "--json")
    keys = [r["key"] for r in json.loads(out)]
    out, err = run(capsys, "ls", "--store", store, "--limit", "5")
    assert [r[0] for r in table_lines(out)] == keys[:5]
    assert err == left_out(total - 5, None)
    out, err = run(capsys, "ls", "--store", store, "--limit", "5", "--json")
    assert [r["key"] for r in json.loads(out)] == keys[:5] and err == ""


@pytest.mark.parametrize("fmt", ["csv", "json"])
@pytest.mark.parametrize("what", ["steps", "bundles"])
def test_csv_and_json_list_every_row(
    capsys: pytest.CaptureFixture, store: Path, what: str, fmt: str
) -> None:
    out, err = run(capsys, "query", what, "--store", store, "--format", fmt)
    n = len(json.loads(out)) if fmt == "json" else len(out.splitlines()) - 1
    expected = STEP_COUNT.format(where="") if what == "steps" else BUNDLE_COUNT
    assert n == sql_count(capsys, store, expected) and err == ""
    out, err = run(capsys, "query", what, "--store", store, "--format", fmt, "--limit", "3")
    n = len(json.loads(out)) if fmt == "json" else len(out.splitlines()) - 1
    assert n == 3 and err == ""


def test_divergences_cut_by_limit_are_counted(capsys: pytest.CaptureFixture, store: Path):
    full = csv_rows(capsys, store, "divergences")
    assert len(full) == sql_count(capsys, store, "SELECT count(*) AS n FROM divergences")
    out, err = run(capsys, "query", "divergences", "--store", store, "--limit", "3")
    assert [r[3] for r in table_lines(out)] == [f["bundle_key"] for f in full[:3]]
    assert err == left_out(len(full) - 3, None)
    _, err = run(capsys, "query", "divergences", "--store", store)
    assert len(full) <= TABLE_ROWS and err == ""


def test_no_line_when_nothing_is_left_out(capsys: pytest.CaptureFixture, store: Path):
    for args in (("query", "steps", "--rollout-to", "5"), ("ls", "--run", "bench", "--limit", "0")):
        _, err = run(capsys, *args, "--store", store)
        assert err == ""
    out, err = run(capsys, "query", "routes", "--store", store)
    assert out == "(no rows)\n" and err == ""


def test_a_negative_limit_is_refused(capsys: pytest.CaptureFixture, store: Path) -> None:
    for command in (("ls",), ("query", "steps")):
        capsys.readouterr()
        assert main([*command, "--store", str(store), "--limit", "-1"]) == 2
        assert "--limit must be >= 0" in capsys.readouterr().err
