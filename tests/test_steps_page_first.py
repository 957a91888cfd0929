"""The steps listing's page-first plan (statements.Steps, issue 33).

A listing whose steps and order need no replay verdict (`Steps.verdict_free`: no status
or stage filter, sorted by step or tokens) picks a page's steps first and ranks the
results of those steps only; its count ranks none. Any other listing ranks the latest
result of every step, then filters and sorts on it. Here both plans answer what a plain
Python model of the store says (latest attempt, its newest whole result else its newest
partial one), row for row and in order, whole and page by page, and the counts count
steps (one per rank cohort, latest attempt), on DuckDB (the CLI's direct reader and
SQLAlchemy's pages) and PostgreSQL (pages and the driver's whole listing).

The store is written the cheap way of scripts/bench/bench_catalog.py (refs and result
documents, then synced): multi-rank steps, re-captured attempts, several results per
step on different ranks, partial replays, every status.
"""

from __future__ import annotations

import datetime as dt
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from trajstore.catalog import open_catalog, queries, sync_catalog
from trajstore.catalog.direct import DirectCatalog
from trajstore.catalog.listings import count as count_listing
from trajstore.catalog.statements import STEP_IDENTITY, STEP_SORTS, Steps
from trajstore.cli._catalog import PagedReader

pytestmark = pytest.mark.integration  # PostgreSQL, as the other catalog-server tests

STAGES = ("reward.raw", "advantage.estimate", "loss.policy")
STATUSES = ("pass", "diverged", "unsupported", "refused")
RECORDED = dt.datetime(2026, 11, 30, 2)
MANIFEST = {"format_version": "2.0.0", "producer": {"commit": "abc"}}


@dataclass
class Result:
    rank: int | None  # the rank bundle it was recorded for
    status: str
    stage: str | None
    recorded: int | None  # seconds after RECORDED; None: not recorded (sorts last)
    partial: bool = False


@dataclass
class Attempt:
    ranks: list[int | None]
    tokens: dict[int | None, int] = field(default_factory=dict)  # per rank bundle
    results: list[Result] = field(default_factory=list)


#: (run, rollout_id, step_id) -> its attempts (1, 2, ...)
Model = dict[tuple[str, int, int], list[Attempt]]


def special_steps() -> Model:
    """The cases each rule is pinned by, whatever the random ones draw."""
    diverged = Result(None, "diverged", "loss.policy", 10)
    return {
        # latest attempt wins: attempt 1 diverged, attempt 2 was never replayed
        ("t", 0, 0): [Attempt([None], results=[diverged]), Attempt([None])],
        # ... and attempt 2's own verdict, on another rank layout
        ("t", 0, 1): [
            Attempt([0, 1], results=[Result(0, "pass", None, 50)]),
            Attempt([0, 1, 2], results=[Result(2, "refused", None, 20)]),
        ],
        # a whole result before a later partial one
        ("t", 1, 0): [
            Attempt(
                [None],
                results=[
                    Result(None, "diverged", "advantage.estimate", 5),
                    Result(None, "pass", None, 90, partial=True),
                ],
            )
        ],
        # the newest result of the cohort, whichever rank it was recorded for
        ("t", 1, 1): [
            Attempt(
                [0, 1],
                results=[
                    Result(1, "pass", None, 40),
                    Result(0, "diverged", "reward.raw", 30),
                    Result(0, "unsupported", None, None),
                ],
            )
        ],
    }


def random_steps(seed: int = 7) -> Model:
    rng = random.Random(seed)
    clock = iter(rng.sample(range(100, 100_000), 2000))  # distinct, not in file order
    model: Model = {}
    for run, rollouts in (("t", range(2, 40)), ("u", range(0, 12))):
        for rollout in rollouts:
            for step in range(3):
                attempts = []
                for _ in range(1 if rng.random() < 0.8 else 2):
                    layout = rng.choices([[None], [0, 1], [0, 1, 2]], [6, 3, 1])[0]
                    attempt = Attempt(list(layout))
                    recorded_null = False
                    for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
                        status = rng.choice(STATUSES)
                        null = not recorded_null and rng.random() < 0.1
                        recorded_null |= null
                        attempt.results.append(
                            Result(
                                rng.choice(layout),
                                status,
                                rng.choice(STAGES) if status == "diverged" else None,
                                None if null else next(clock),
                                partial=rng.random() < 0.25,
                            )
                        )
                    attempts.append(attempt)
                model[(run, rollout, step)] = attempts
    return model


def key_of(run: str, rollout: int, step: int, rank: int | None, attempt: int) -> str:
    return f"{run}/step-{rollout}-{step}/rank-{rank}/a{attempt}"


def write_store(root: Path, model: Model, seed: int = 3) -> dict[str, dict]:
    """Refs and result documents under `root` for `model`; returns the documents."""
    rng = random.Random(seed)
    docs: dict[str, dict] = {"manifest": MANIFEST, "expected": {}}
    (root / "refs" / "bundles").mkdir(parents=True)
    (root / "results").mkdir()
    (root / "TRAJSTORE_STORE").write_bytes(b"trajstore store, layout 1\n")
    clock = 1_800_000_000_000_000_000
    for (run, rollout, step), attempts in model.items():
        for number, attempt in enumerate(attempts, start=1):
            cohort = [r for r in attempt.ranks if r is not None]
            for rank in attempt.ranks:
                lengths = [rng.randint(10, 400) for _ in range(rng.randint(1, 4))]
                attempt.tokens[rank] = sum(lengths)
                index = f"idx-{run}-{rollout}-{step}-{rank}-{number}"
                docs[index] = {
                    "bundle_id": f"replay-{rollout}-{step}",
                    "identity": {
                        "actor_step_id": {"rollout_id": rollout, "step_id": step},
                        "rank": {"dp": len(attempt.ranks), "tp": 1, "pp": 1, "cp": 1},
                    },
                    "samples": [
                        {"sample_id": f"s-{i}", "group_index": 0, "total_length": n}
                        for i, n in enumerate(lengths)
                    ],
                    "config": {},
                }
                ref = {
                    "ref_version": 1, "key": key_of(run, rollout, step, rank, number),
                    "run": run, "kind": "step", "rollout_id": rollout, "step_id": step,
                    "rank": rank, "cohort_ranks": cohort, "attempt": number,
                    "bundle_id": f"replay-{rollout}-{step}", "format_version": "2.0.0",
                    "content_digest": "0" * 64, "published_at": "2026-11-30T01:02:03Z",
                    "documents": {"manifest": "manifest", "index": index,
                                  "expected": "expected"},
                    "payloads": {}, "physical_bytes": 0,
                }  # fmt: skip
                clock += 1000
                (root / "refs" / "bundles" / f"{clock:020d}-1-00.json").write_text(json.dumps(ref))
            for result in attempt.results:
                at = result.recorded
                doc = {
                    "result_version": 1,
                    "bundle_key": key_of(run, rollout, step, result.rank, number),
                    "run": run, "rollout_id": rollout, "step_id": step,
                    "trajstore_version": "0.1.0",
                    "recorded_at": None if at is None
                    else (RECORDED + dt.timedelta(seconds=at)).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "status": result.status, "first_divergent_stage": result.stage,
                    "first_divergent_rank": None, "root_bundle_key": None,
                    "selection": {"groups": ["g-0"]} if result.partial else None,
                    "stages": [], "divergences": [],
                }  # fmt: skip
                clock += 1000
                (root / "results" / f"{clock:020d}-1-00.json").write_text(json.dumps(doc))
    return docs


def expected_steps(model: Model, **filters: Any) -> list[dict]:
    """The listing as the model says: each step's latest attempt, its latest result
    (whole before partial, then the newest; results here never tie)."""
    sort = filters.get("sort", "step")
    rows = []
    for (run, rollout, step), attempts in model.items():
        number, attempt = len(attempts), attempts[-1]
        latest = min(
            attempt.results,
            key=lambda r: (r.partial, r.recorded is None, -(r.recorded or 0)),
            default=None,
        )
        ranked = sorted(attempt.ranks, key=lambda r: -1 if r is None else r)
        rows.append(
            {
                "run": run,
                "rollout_id": rollout,
                "step_id": step,
                "attempt": number,
                "ranks": [r for r in ranked if r is not None],
                "bundle_keys": [key_of(run, rollout, step, r, number) for r in ranked],
                "num_tokens": sum(attempt.tokens.values()),
                "status": latest and latest.status,
                "first_divergent_stage": latest and latest.stage,
                "result_bundle_key": latest and key_of(run, rollout, step, latest.rank, number),
            }
        )

    def kept(row: dict) -> bool:
        status = filters.get("status")
        return (
            filters.get("run") in (None, row["run"])
            and filters.get("attempt") in (None, row["attempt"])
            and filters.get("rollout_from", -1) <= row["rollout_id"]
            and row["rollout_id"] <= filters.get("rollout_to", 2**62)
            and filters.get("first_divergent_stage") in (None, row["first_divergent_stage"])
            and (status is None or (row["status"] or "unreplayed") == status)
        )

    leads = {
        "step": lambda row: (),
        "status": lambda row: (row["status"] or "unreplayed",),
        "stage": lambda row: (row["first_divergent_stage"] or "",),
        "tokens": lambda row: (row["num_tokens"],),
    }
    lead = leads[sort.removeprefix("-")]
    identity = [*STEP_IDENTITY]
    return sorted(
        filter(kept, rows),
        key=lambda row: (*lead(row), *(row[name] for name in identity)),
        reverse=sort.startswith("-"),
    )


SHOWN = ("ranks", "bundle_keys", "num_tokens", "status", "first_divergent_stage")


def shown(rows: list[dict]) -> list[dict]:
    """What the model knows of each listed step."""
    names = (*STEP_IDENTITY, *SHOWN, "result_bundle_key")
    return [{name: row[name] for name in names} for row in rows]


# -- the store, on each database, and its readers -----------------------------------


@dataclass
class Stored:
    root: Path
    url: str | None  # None: the store's DuckDB file
    model: Model


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, Model]:
    root = tmp_path_factory.mktemp("page-first") / "store"
    model = {**special_steps(), **random_steps()}
    docs = write_store(root, model)
    with open_catalog(root) as cat:
        sync_catalog(cat, root, docs.__getitem__)
    return root, docs, model


@pytest.fixture(scope="module", params=["duckdb", "postgresql"])
def stored(request: pytest.FixtureRequest, built: tuple[Path, dict, Model]) -> Iterator[Stored]:
    root, docs, model = built
    if request.param == "duckdb":
        yield Stored(root, None, model)
        return
    from pg_server import fresh_schema

    with fresh_schema() as url:
        with open_catalog(None, url) as cat:
            sync_catalog(cat, root, docs.__getitem__)
        yield Stored(root, url, model)


class SmallPages:
    """The REST reader: queries.query_steps a few steps a page, cursor after cursor."""

    PAGE = 7

    def __init__(self, catalog: Any) -> None:
        self.catalog = catalog

    def steps(self, limit: int | None = None, columns: Any = None, **filters: Any) -> list:
        out: list[dict] = []
        cursor = None
        while limit is None or len(out) < limit:
            page = queries.query_steps(self.catalog, limit=self.PAGE, cursor=cursor, **filters)
            out += page["items"]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        return out if limit is None else out[:limit]

    def count(self, what: str, **filters: Any) -> int:
        dialect = "duckdb" if self.catalog.is_duckdb else "postgresql"
        return count_listing(queries.executor(self.catalog), what, filters, dialect)


def each_reader(stored: Stored, ask: Callable[[Any], Any]) -> list:
    """`ask(reader)` of every reader of the stored catalog, in turn."""
    answers = []
    if stored.url is None:
        with DirectCatalog.open(stored.root) as direct:
            answers.append(ask(direct))
        with open_catalog(stored.root) as cat:
            answers += [ask(PagedReader(cat)), ask(SmallPages(cat))]
        return answers
    from test_catalog_direct_pg import DriverListings

    with open_catalog(None, stored.url) as cat:
        answers += [ask(PagedReader(cat)), ask(SmallPages(cat))]
        raw = cat.engine.raw_connection()
        try:
            answers.append(ask(DriverListings(raw.driver_connection)))
        finally:
            raw.close()
    return answers


VERDICT_FREE = [
    {},
    {"run": "t"},
    {"run": "u", "rollout_from": 3, "rollout_to": 9},
    {"rollout_from": 1},
    {"attempt": 2},
    {"attempt": 1, "run": "t"},
    *({"sort": sort} for sort in STEP_SORTS if sort.removeprefix("-") in ("step", "tokens")),
    {"sort": "-tokens", "run": "t", "rollout_to": 20},
]
WITH_VERDICTS = [
    *({"status": status} for status in (*STATUSES, "unreplayed")),
    {"first_divergent_stage": "loss.policy"},
    {"first_divergent_stage": "reward.raw", "status": "diverged", "run": "t"},
    {"status": "pass", "attempt": 2},
    *({"sort": sort} for sort in STEP_SORTS if sort.removeprefix("-") in ("status", "stage")),
    {"sort": "-status", "status": "refused"},
    {"sort": "stage", "run": "u", "rollout_from": 4},
]
LIMITS = (1, 2, 5, 17, 100, 10_000)


def test_the_store_has_what_the_plans_must_agree_on(built: tuple[Path, dict, Model]) -> None:
    _, _, model = built
    rows = expected_steps(model)
    assert len(rows) > 2 * SmallPages.PAGE
    assert {row["status"] for row in rows} == {*STATUSES, None}
    assert {len(row["ranks"]) for row in rows} == {0, 2, 3}
    assert {row["attempt"] for row in rows} == {1, 2}
    for filters in VERDICT_FREE:
        assert Steps(**filters).verdict_free, filters
        assert expected_steps(model, **filters), filters
    for filters in WITH_VERDICTS:
        assert not Steps(**filters).verdict_free, filters
        assert expected_steps(model, **filters), filters


@pytest.mark.parametrize("filters", VERDICT_FREE, ids=map(str, VERDICT_FREE))
def test_a_verdict_free_page_is_the_whole_rankings_page(stored: Stored, filters: dict) -> None:
    """(a) the steps chosen first, then ranked: the rows, order and count of ranking the
    results of every step first (the statement without a limit: the whole path)."""
    listing = Steps(**filters)
    assert "chosen_steps" in listing.statement(limit=5)[0]
    assert "chosen_steps" not in listing.statement()[0]
    expected = shown(expected_steps(stored.model, **filters))

    def ask(reader: Any) -> tuple:
        whole = reader.steps(**filters)
        pages = {limit: reader.steps(limit=limit, **filters) for limit in LIMITS}
        return whole, pages, reader.count("steps", **filters)

    for whole, pages, count in each_reader(stored, ask):
        assert shown(whole) == expected
        for limit, rows in pages.items():
            assert rows == whole[:limit]
        assert count == len(expected)


@pytest.mark.parametrize("filters", VERDICT_FREE[:3], ids=map(str, VERDICT_FREE[:3]))
def test_the_printed_columns_alone_read_the_same(stored: Stored, filters: dict) -> None:
    """What `query steps` asks for a table (STEP_COLUMNS), page-first as whole."""
    from trajstore.cli.query_cmds import STEP_COLUMNS

    columns = tuple(STEP_COLUMNS)

    def ask(reader: Any) -> tuple:
        return reader.steps(columns=columns, **filters), reader.steps(
            limit=11, columns=columns, **filters
        )

    known = (*STEP_IDENTITY, "ranks", "status", "first_divergent_stage")
    expected = [{n: row[n] for n in known} for row in expected_steps(stored.model, **filters)]
    for whole, page in each_reader(stored, ask):
        assert page == whole[:11]
        assert [{n: row[n] for n in known} for row in whole] == expected


@pytest.mark.parametrize("filters", WITH_VERDICTS, ids=map(str, WITH_VERDICTS))
def test_a_verdict_filter_or_sort_ranks_every_step_first(stored: Stored, filters: dict) -> None:
    """(b) a filter or sort on the verdict: the whole ranking, then filtered and sorted,
    whatever the limit; the model's rows and count."""
    assert "chosen_steps" not in Steps(**filters).statement(limit=5)[0]
    expected = shown(expected_steps(stored.model, **filters))

    def ask(reader: Any) -> tuple:
        pages = {limit: reader.steps(limit=limit, **filters) for limit in LIMITS}
        return reader.steps(**filters), pages, reader.count("steps", **filters)

    for whole, pages, count in each_reader(stored, ask):
        assert shown(whole) == expected
        for limit, rows in pages.items():
            assert shown(rows) == expected[:limit]
        assert count == len(expected)


def test_the_count_counts_steps_not_their_rank_bundles(stored: Stored) -> None:
    """(c) a step on two or three ranks is one step, in the count as in the listing."""
    steps = expected_steps(stored.model)
    bundles = sum(len(row["bundle_keys"]) for row in steps)
    assert bundles > len(steps)
    for filters in ({}, {"run": "t"}, {"attempt": 2}, {"sort": "-tokens"}):
        counts = each_reader(stored, lambda reader: reader.count("steps", **filters))  # noqa: B023
        assert counts == [len(expected_steps(stored.model, **filters))] * len(counts)


def test_the_latest_attempt_and_its_own_results_win(stored: Stored) -> None:
    """(d) a re-captured step is listed and counted once, as its latest attempt, with that
    attempt's verdict (none, for 0:0), never the superseded attempt's; `attempt` keeps
    the steps whose latest attempt is that number."""

    def ask(reader: Any) -> tuple:
        return (
            reader.steps(limit=3, run="t"),
            [reader.count("steps", attempt=n) for n in (None, 1, 2, 3)],
        )

    by_attempt = [len(expected_steps(stored.model, attempt=n)) for n in (None, 1, 2, 3)]
    assert by_attempt[0] == by_attempt[1] + by_attempt[2] and by_attempt[3] == 0
    for first, counts in each_reader(stored, ask):
        assert [(row["step_id"], row["attempt"], row["status"]) for row in first] == [
            (0, 2, None),
            (1, 2, "refused"),
            (0, 1, "diverged"),  # 1:0, whole before partial
        ]
        assert first[1]["ranks"] == [0, 1, 2]
        assert first[1]["result_bundle_key"] == "t/step-0-1/rank-2/a2"
        assert counts == by_attempt
