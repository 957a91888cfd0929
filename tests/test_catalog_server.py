"""Server catalogs: --catalog everywhere, writers keep the rows current, readers never
list the refs, incremental sync from a high-water mark, concurrent writers on one
PostgreSQL catalog, and the REST server on it.

PostgreSQL comes from tests/pg_server.py (a fresh schema per test; skipped with one
line, or failed under CI, when no server answers). The incremental-sync tests run on
DuckDB and PostgreSQL alike (`catalog_url`).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from conftest import FIXTURES
from inprocess_cli import cli
from pg_server import fresh_schema
from trajstore.api.app import create_app

from trajstore.catalog import (
    CATALOG_FILE,
    list_bundles,
    lookup_step,
    open_catalog,
    run_readonly_sql,
    sync_new,
)
from trajstore.catalog import tables as t
from trajstore.errors import UsageError
from trajstore.store import Store

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = FIXTURES / "example_bundle"


@pytest.fixture
def pg_url() -> Iterator[str]:
    with fresh_schema() as url:
        yield url


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`trajstore ARGS` in this process (tests/inprocess_cli.py): nothing here is about the
    process, only its exit code, stdout and stderr."""
    return cli(*args, env=env)


def _publish(root: Path, bundles: list[Path], run: str = "default") -> list[str]:
    """Ingest with a store that has no server catalog: refs only (a writer that
    published and then died before touching the catalog looks exactly like this)."""
    with Store.open(root, durable=False) as store:
        return [key for path in bundles for key in store.ingest([path], run=run)[0].keys]


def _bundles(make_bundle, n: int, first_rollout: int = 0) -> list[Path]:
    return [make_bundle(rollout_id=first_rollout + i, step_id=0, seed=i) for i in range(n)]


# -- the incremental sync, on both backends ------------------------------------------


def test_sync_new_lists_only_refs_after_the_mark(tmp_path, make_bundle, catalog_url):
    root = tmp_path / "store"
    _publish(root, _bundles(make_bundle, 5))
    with Store.open(root) as store, open_catalog(root, catalog_url) as cat:
        first = sync_new(cat, root, store.load_document, margin_s=0)
        _publish(root, [make_bundle(rollout_id=50, step_id=0, seed=50)])
        second = sync_new(cat, root, store.load_document, margin_s=0)
        assert len(list_bundles(cat, limit=100)["items"]) == 6
    assert (first.listed, first.new_refs) == (5, 5)
    # the new ref, and the mark again (the listing starts at the mark's clock reading)
    assert (second.listed, second.new_refs) == (2, 1)
    assert second.listed_after["bundles"] is not None


def test_sync_new_finds_a_ref_named_before_the_mark_within_the_margin(
    tmp_path, make_bundle, catalog_url
):
    """A host whose clock lags publishes a ref whose name sorts before the mark."""
    root = tmp_path / "store"
    _publish(root, _bundles(make_bundle, 1))
    with Store.open(root) as store, open_catalog(root, catalog_url) as cat:
        sync_new(cat, root, store.load_document, margin_s=0)
        (newest,) = (root / "refs" / "bundles").iterdir()
        _publish(root, [make_bundle(rollout_id=7, step_id=0, seed=7)])
        late = max((root / "refs" / "bundles").iterdir())
        skewed_ns = int(newest.name.split("-")[0]) - 2_000_000_000  # 2 s "in the past"
        late.rename(late.with_name(f"{skewed_ns:020d}-1-{'a' * 12}.json"))
        without_margin = sync_new(cat, root, store.load_document, margin_s=0)
        with_margin = sync_new(cat, root, store.load_document, margin_s=60)
        assert len(lookup_step(cat, "default", 7, 0)) == 1
    assert without_margin.new_refs == 0
    assert with_margin.new_refs == 1


def test_sync_new_finds_a_ref_of_the_marks_clock_reading_named_before_it(
    tmp_path, make_bundle, catalog_url
):
    """Margin 0: a ref whose name has the mark's clock reading but sorts before the mark
    (another host, the same nanosecond) is listed, as the margin promises: only names
    more than the margin before the mark's time can be missed."""
    root = tmp_path / "store"
    _publish(root, _bundles(make_bundle, 1))
    with Store.open(root) as store, open_catalog(root, catalog_url) as cat:
        sync_new(cat, root, store.load_document, margin_s=0)
        (mark,) = (root / "refs" / "bundles").iterdir()
        _publish(root, [make_bundle(rollout_id=7, step_id=0, seed=7)])
        late = max((root / "refs" / "bundles").iterdir())
        late.rename(late.with_name(f"{mark.name.split('-')[0]}-0-{'0' * 12}.json"))
        same_time = sync_new(cat, root, store.load_document, margin_s=0)
        assert len(lookup_step(cat, "default", 7, 0)) == 1
    assert same_time.new_refs == 1


def test_a_host_whose_clock_runs_ahead_does_not_hide_later_refs(tmp_path, make_bundle, catalog_url):
    """Its ref's name lies an hour in the future and becomes the mark; a ref published
    after it, named by a correct clock, is still listed."""
    root = tmp_path / "store"
    _publish(root, _bundles(make_bundle, 1))
    (ahead,) = (root / "refs" / "bundles").iterdir()
    future_ns = int(ahead.name.split("-")[0]) + 3600 * 10**9
    ahead.rename(ahead.with_name(f"{future_ns:020d}-1-{'c' * 12}.json"))
    with Store.open(root) as store, open_catalog(root, catalog_url) as cat:
        sync_new(cat, root, store.load_document, margin_s=60)
        _publish(root, [make_bundle(rollout_id=8, step_id=0, seed=8)])
        later = sync_new(cat, root, store.load_document, margin_s=60)
    assert later.new_refs == 1


# -- PostgreSQL: writers, readers, crash healing -----------------------------------


def test_ingest_writes_rows_to_the_server_catalog_and_no_duckdb_file(tmp_path, pg_url):
    root = tmp_path / "store"
    with Store.open(root, catalog_url=pg_url) as store:
        (outcome,) = store.ingest([EXAMPLE])
    with open_catalog(None, pg_url) as cat:
        rows = lookup_step(cat, "default", 120, 0)
    assert [r["key"] for r in rows] == outcome.keys
    assert not (root / CATALOG_FILE).exists()


def test_readers_of_a_server_catalog_do_not_list_the_refs(tmp_path, pg_url):
    root = tmp_path / "store"
    with Store.open(root, catalog_url=pg_url) as store:
        store.ingest([EXAMPLE])
    # a listing reader would have to apply this unreadable ref and fail on it
    (root / "refs" / "bundles" / f"{time.time_ns():020d}-1-{'b' * 12}.json").write_text("{")
    with Store.open(root, catalog_url=pg_url) as store:
        assert [r["key"] for r in store.bundles()] == ["default/step-120-0/a1"]
    listed = _cli("ls", "--store", str(root), "--catalog", pg_url, "--json")
    assert listed.returncode == 0, listed.stderr
    assert [r["key"] for r in json.loads(listed.stdout)] == ["default/step-120-0/a1"]


def test_a_writer_that_died_before_its_rows_is_healed_by_the_next_writer(
    tmp_path, pg_url, make_bundle
):
    root = tmp_path / "store"
    orphan = _publish(root, [make_bundle(rollout_id=1, step_id=0, seed=1)])
    with Store.open(root, catalog_url=pg_url) as store:
        (outcome,) = store.ingest([make_bundle(rollout_id=2, step_id=0, seed=2)])
        keys = {r["key"] for r in store.bundles()}
    assert keys == {*orphan, *outcome.keys}


def test_rm_and_replay_record_reach_the_server_catalog(tmp_path, pg_url, make_bundle):
    root = tmp_path / "store"
    keep = make_bundle(rollout_id=1, step_id=0, seed=1)
    gone = make_bundle(rollout_id=2, step_id=0, seed=2)
    ingested = _cli("ingest", str(keep), str(gone), "--store", str(root), "--catalog", pg_url)
    assert ingested.returncode == 0, ingested.stderr
    env = {"TRAJSTORE_CATALOG": pg_url}  # the environment stands for --catalog
    removed = _cli("rm", "--store", str(root), "default/step-2-0/a1", env=env)
    replayed = _cli("replay", "--store", str(root), "--step", "1:0", "--record", env=env)
    assert removed.returncode == 0, removed.stderr
    assert replayed.returncode in (0, 1), replayed.stderr
    with open_catalog(None, pg_url) as cat:
        _, rows = run_readonly_sql(
            cat,
            "SELECT b.key, b.removed_at IS NOT NULL, count(r.id) FROM bundles b "
            "LEFT JOIN replay_results r ON r.bundle_key = b.key GROUP BY 1, 2 ORDER BY 1",
        )
    assert rows == [["default/step-1-0/a1", False, 1], ["default/step-2-0/a1", True, 0]]


def test_a_writers_catalog_update_lists_only_the_refs_after_the_mark(
    tmp_path, pg_url, make_bundle, monkeypatch
):
    monkeypatch.setenv("TRAJSTORE_CATALOG_MARGIN_S", "0")
    root = tmp_path / "store"
    with Store.open(root, catalog_url=pg_url) as store:
        for seed in range(4):
            store.ingest([make_bundle(rollout_id=seed, step_id=0, seed=seed)])
    _publish(root, [make_bundle(rollout_id=9, step_id=0, seed=9)])  # never reached it
    with Store.open(root, catalog_url=pg_url) as store:
        update = store.index_new()
        assert len(store.bundles()) == 5
    assert (update.listed, update.new_refs) == (2, 1)  # the new ref and the mark


def test_a_bad_margin_is_a_usage_error(tmp_path, pg_url, monkeypatch):
    monkeypatch.setenv("TRAJSTORE_CATALOG_MARGIN_S", "five minutes")
    store = Store.open(tmp_path / "store", catalog_url=pg_url)
    with store, pytest.raises(UsageError, match="TRAJSTORE_CATALOG_MARGIN_S"):
        store.index_new()


def test_a_bad_catalog_url_is_one_line_with_the_password_masked(tmp_path):
    root = tmp_path / "store"
    _publish(root, [EXAMPLE])
    url = "postgresql+psycopg://bob:s3cret@127.0.0.1:1/nowhere"
    out = _cli("ls", "--store", str(root), "--catalog", url)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "s3cret" not in out.stderr
    assert "cannot connect to catalog postgresql+psycopg://bob:***@127.0.0.1:1/nowhere" in (
        out.stderr
    )


OPENER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from trajstore.catalog import open_catalog
    url, go = sys.argv[1], Path(sys.argv[2])
    print("ready", flush=True)
    while not go.exists():  # start together, imports done
        time.sleep(0.005)
    open_catalog(None, url).close()
    """
)


def test_processes_opening_a_new_server_catalog_at_once_all_succeed(tmp_path, pg_url):
    """One migrates it; the others wait for it and find it at the head."""
    go = tmp_path / "go"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", OPENER, pg_url, str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for _ in range(3)
    ]
    assert [p.stdout.readline().strip() for p in procs] == ["ready"] * 3
    go.touch()
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errors
    with open_catalog(None, pg_url) as cat:
        _, versions = run_readonly_sql(cat, "SELECT version_num FROM alembic_version")
    assert versions == [[t.HEAD_REVISION]]


WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from trajstore.store import Store
    root, url, run, *bundles = sys.argv[1:]
    with Store.open(Path(root), catalog_url=url, durable=False) as store:
        for path in bundles:  # one ingest (and one catalog update) per bundle
            (outcome,) = store.ingest([path], run=run)
            assert outcome.status == "published", outcome.reason
    """
)

READER = textwrap.dedent(
    """
    import json, sys, time
    from trajstore.catalog import list_bundles, open_catalog
    url, stop = sys.argv[1], sys.argv[2]
    seen = []
    from pathlib import Path
    while True:
        done = Path(stop).exists()
        with open_catalog(None, url) as cat:
            keys = [b["key"] for b in list_bundles(cat, limit=1000)["items"]]
        assert len(keys) == len(set(keys)), keys
        seen.append(len(keys))
        if done:
            break
        time.sleep(0.05)
    print(json.dumps(seen))
    """
)


def test_two_writers_and_a_reader_on_one_postgres_catalog(tmp_path, pg_url, make_bundle):
    root = tmp_path / "store"
    Store.open(root).close()
    per_writer = 6
    runs = {
        "alpha": _bundles(make_bundle, per_writer),
        "beta": _bundles(make_bundle, per_writer, first_rollout=100),
    }
    with open_catalog(None, pg_url):
        pass  # migrate once up front, so the processes below only meet the rows
    stop = tmp_path / "stop"
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def spawn(*args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env,
        )  # fmt: skip

    reader = spawn(READER, pg_url, str(stop))
    writers = [
        spawn(WRITER, str(root), pg_url, run, *map(str, paths)) for run, paths in runs.items()
    ]
    outs = [w.communicate(timeout=300) for w in writers]
    stop.touch()
    seen_out, seen_err = reader.communicate(timeout=120)
    assert [w.returncode for w in writers] == [0, 0], outs
    assert reader.returncode == 0, seen_err
    seen = json.loads(seen_out)
    with open_catalog(None, pg_url) as cat:
        _, per_run = run_readonly_sql(
            cat, "SELECT run, count(*), count(DISTINCT key) FROM bundles GROUP BY run ORDER BY run"
        )
        _, synced = run_readonly_sql(
            cat, "SELECT count(*), count(DISTINCT name) FROM synced_documents"
        )
    assert per_run == [["alpha", per_writer, per_writer], ["beta", per_writer, per_writer]]
    assert synced == [[2 * per_writer, 2 * per_writer]]
    assert len(seen) >= 2  # the reader read while the writers wrote
    assert seen == sorted(seen) and seen[-1] == 2 * per_writer


# -- the REST server on a server catalog --------------------------------------------


@contextlib.contextmanager
def _serve(root: Path | str, catalog_url: str) -> Iterator[httpx.Client]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(root, poll_s=0.05, catalog_url=catalog_url)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            yield client
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_serve_on_a_postgres_catalog_answers_lookups_and_follows_writers(
    store_url, pg_url, make_bundle
):
    """On a directory and on an S3 store (SeaweedFS) alike."""
    with Store.open(store_url, catalog_url=pg_url) as store:
        store.ingest([EXAMPLE])
    with _serve(store_url, pg_url) as client:
        first = client.get("/v1/steps/120:0")
        with Store.open(store_url, catalog_url=pg_url) as store:
            store.ingest([make_bundle(rollout_id=121, step_id=0, seed=3)])
        deadline = time.monotonic() + 30
        while (later := client.get("/v1/steps/121:0")).status_code == 404:
            assert time.monotonic() < deadline, later.text
            time.sleep(0.05)
        payload = client.get("/v1/bundles/default/step-121-0/a1/payloads/log_probs")
        replayed = client.post("/v1/replay", json={"step": "120:0", "record": True})
        verdict = client.get("/v1/steps/120:0").json()
    assert first.status_code == 200, first.text
    assert [b["key"] for b in first.json()["bundles"]] == ["default/step-120-0/a1"]
    assert later.status_code == 200, later.text
    assert payload.status_code == 200, payload.text
    assert replayed.status_code == 200 and replayed.json()["recorded"], replayed.text
    assert verdict["latest_verdict"] is not None  # recorded through the API, read at once


# -- an S3 store (SeaweedFS on loopback) with a PostgreSQL catalog ------------------


def test_s3_store_with_postgres_catalog_lists_refs_from_the_mark(s3_env, pg_url, make_bundle):
    url = s3_env.fresh_url()
    with Store.open(url, catalog_url=pg_url) as store:
        for seed in range(3):
            store.ingest([make_bundle(rollout_id=seed, step_id=0, seed=seed)])
        names = store.space.list_after("refs/bundles", None)
        after_second = store.space.list_after("refs/bundles", names[1])
    with Store.open(url) as orphan:  # a writer that never reached the catalog
        orphan.ingest([make_bundle(rollout_id=9, step_id=0, seed=9)])
    with Store.open(url) as store, open_catalog(None, pg_url) as cat:
        again = sync_new(cat, store.space, store.load_document, margin_s=0)
        keys = [b["key"] for b in list_bundles(cat, limit=100)["items"]]
    assert len(names) == 3 and after_second == names[2:]
    assert (again.listed, again.new_refs) == (2, 1)  # the new ref and the mark
    assert len(keys) == 4


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (
            "sqlite:///{tmp}/side.db",  # {tmp} absolute: four slashes in all
            "catalog backend 'sqlite' is not supported (use postgresql+psycopg://",
        ),
        ("mysql://host/db", "catalog backend 'mysql' is not supported (use postgresql+psycopg://"),
        ("notaurl", "catalog URL 'notaurl' is not a database URL (e.g. postgresql+psycopg://"),
    ],
)
def test_a_catalog_url_of_another_database_is_refused_in_one_line(
    tmp_path: Path, url: str, message: str
) -> None:
    # sqlite used to get half-way through the first migration: an internal error, a file left
    Store.open(tmp_path / "store").close()
    out = _cli("ls", "--store", str(tmp_path / "store"), "--catalog", url.format(tmp=tmp_path))
    assert out.returncode == 2
    assert out.stderr.startswith(f"trajstore: error: {message}")
    assert len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "side.db").exists()


def test_sql_over_the_row_cap_is_refused_on_postgresql_too(tmp_path, pg_url):
    Store.open(tmp_path / "store", catalog_url=pg_url).close()
    with open_catalog(None, pg_url) as cat:
        assert (
            len(run_readonly_sql(cat, "SELECT * FROM generate_series(1, 10)", max_rows=10)[1]) == 10
        )
        with pytest.raises(UsageError, match="more than 10 rows, the most `sql` prints"):
            run_readonly_sql(cat, "SELECT * FROM generate_series(1, 11)", max_rows=10)
