"""The web view over plain HTTP (no browser): page routes, assets, the token, and the /v1
data the pages fetch, checked against the CLI on a store holding the demo's runs
(tests/web_demo.py) served on 127.0.0.1 by the app `trajstore serve` runs (web_demo.serve_here)."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import web_demo
from trajstore.api import web

from trajstore.vocab import STEP_STATUSES

pytestmark = pytest.mark.integration

PAGES = ("/", "/runs/synthetic", "/runs/synthetic/steps/3:0", "/routes", "/diff?a=x&b=y")
TOKEN = "web-s3cret-token"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return web_demo.demo_store(tmp_path_factory)


@pytest.fixture(scope="module")
def client(store: Path) -> Iterator[httpx.Client]:
    with web_demo.serve_here(store) as base, httpx.Client(base_url=base, timeout=120) as http:
        yield http


def _steps(store: Path, *args: str) -> list[dict]:
    code, out = web_demo.cli("query", "steps", "--store", str(store), *args, "--format", "json")
    assert code == 0
    return json.loads(out)


def _all_pages(client: httpx.Client, path: str, **params: object) -> list[dict]:
    items: list[dict] = []
    cursor = None
    while True:
        query = {**params, **({"cursor": cursor} if cursor else {})}
        page = client.get(path, params=query).json()
        items += page["items"]
        cursor = page["next_cursor"]
        if cursor is None:
            return items


# -- pages and assets -------------------------------------------------------------


@pytest.mark.parametrize("path", PAGES)
def test_every_page_is_the_shell_holding_no_store_data(client: httpx.Client, path: str) -> None:
    resp = client.get(path)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/html")
    assert resp.content == (web.STATIC / "index.html").read_bytes()
    assert b"synthetic" not in resp.content and b"reward.post_process" not in resp.content


def test_the_shell_loads_only_packaged_assets(client: httpx.Client) -> None:
    html = client.get("/").text
    refs = re.findall(r'(?:src|href)="([^"]+)"', html)
    assets = [ref for ref in refs if ref.startswith("/static/")]
    assert sorted(name.removeprefix("/static/") for name in assets) == sorted(web.ASSETS)
    assert all(ref.startswith("/") for ref in refs), refs  # no CDN, no other host
    for ref in assets:
        resp = client.get(ref)
        assert resp.status_code == 200
        assert resp.content == (web.STATIC / ref.removeprefix("/static/")).read_bytes()
        assert resp.headers["content-type"] == web.ASSETS[ref.removeprefix("/static/")]
        assert not re.search(rb"https?://(?!www\.w3\.org/2000/svg)", resp.content), ref


@pytest.mark.parametrize(
    "path", ["/static/nope.js", "/static/..%2Findex.html", "/static/index.html", "/runs/a/b/c/d"]
)
def test_anything_else_under_the_pages_is_a_json_404(client: httpx.Client, path: str) -> None:
    resp = client.get(path)
    assert resp.status_code == 404
    assert resp.json()["error"] == "not_found"


def test_with_a_token_pages_are_open_and_data_needs_the_header(store: Path) -> None:
    with web_demo.serve_here(store, token=TOKEN) as base, httpx.Client(base_url=base) as http:
        for path in (*PAGES, *(f"/static/{name}" for name in web.ASSETS)):
            assert http.get(path).status_code == 200, path
            assert http.head(path).status_code == 200, path
        for path in ("/v1/runs", "/v1/runs/synthetic/summary", "/docs", "/openapi.json"):
            assert http.get(path).status_code == 401, path
            assert http.get(path, params={"token": TOKEN}).status_code == 401, path
        assert http.post("/", json={}).status_code == 401  # only GET/HEAD of a page is open
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert http.get("/v1/runs/synthetic/summary", headers=bearer).status_code == 200


# -- the data the pages fetch -------------------------------------------------------------


def test_run_summary_counts_are_the_cli_step_listing(client: httpx.Client, store: Path) -> None:
    for run in web_demo.RUNS:
        rows = _steps(store, "--run", run)
        summary = client.get(f"/v1/runs/{run}/summary").json()
        want = Counter(row["status"] or "unreplayed" for row in rows)
        assert summary["steps"] == len(rows)
        assert summary["by_status"] == {status: want.get(status, 0) for status in STEP_STATUSES}
        stages = Counter(row["first_divergent_stage"] for row in rows)
        stages.pop(None, None)
        assert summary["first_divergent_stage_histogram"] == dict(stages)


def test_strip_bins_hold_every_step_once_and_name_the_first_bad_rollout(
    client: httpx.Client, store: Path
) -> None:
    rows = _steps(store, "--run", "synthetic")
    for bins in (1, 4, 400):
        strip = client.get("/v1/runs/synthetic/strip", params={"bins": bins}).json()
        assert len(strip["bins"]) <= bins
        assert sum(cell["steps"] for cell in strip["bins"]) == len(rows)
        for cell in strip["bins"]:
            inside = [
                r for r in rows if cell["rollout_from"] <= r["rollout_id"] <= cell["rollout_to"]
            ]
            assert cell["steps"] == len(inside)
            assert cell["diverged"] == sum(r["status"] == "diverged" for r in inside)
        bad = [r["rollout_id"] for r in rows if r["status"] in ("diverged", "refused")]
        assert strip["first_bad_rollout"] == min(bad)


def test_a_strip_over_a_rollout_range_counts_only_the_steps_in_it(
    client: httpx.Client, store: Path
) -> None:
    rows = _steps(store, "--run", "synthetic")
    rollouts = sorted({r["rollout_id"] for r in rows})
    low, high = rollouts[1], rollouts[-2]
    strip = client.get(
        "/v1/runs/synthetic/strip", params={"rollout_from": low, "rollout_to": high, "bins": 400}
    ).json()
    inside = [r for r in rows if low <= r["rollout_id"] <= high]
    assert (strip["rollout_from"], strip["rollout_to"]) == (low, high)
    assert sum(cell["steps"] for cell in strip["bins"]) == len(inside) < len(rows)
    for cell in strip["bins"]:
        held = [r for r in inside if cell["rollout_from"] <= r["rollout_id"] <= cell["rollout_to"]]
        assert (cell["steps"], cell["diverged"]) == (
            len(held),
            sum(r["status"] == "diverged" for r in held),
        )


@pytest.mark.parametrize("sort", ["-step", "status", "-stage", "tokens"])
def test_sorted_steps_walk_every_step_once_in_order(
    client: httpx.Client, store: Path, sort: str
) -> None:
    items = _all_pages(client, "/v1/runs/synthetic/steps", sort=sort, limit=4)
    rows = _steps(store, "--run", "synthetic")
    assert sorted((i["rollout_id"], i["step_id"]) for i in items) == sorted(
        (r["rollout_id"], r["step_id"]) for r in rows
    )
    key = {
        "step": lambda i: (i["rollout_id"], i["step_id"]),
        "status": lambda i: (i["status"] or "unreplayed", i["rollout_id"], i["step_id"]),
        "stage": lambda i: (i["first_divergent_stage"] or "", i["rollout_id"], i["step_id"]),
        "tokens": lambda i: (i["num_tokens"], i["rollout_id"], i["step_id"]),
    }[sort.removeprefix("-")]
    assert [key(i) for i in items] == sorted(map(key, items), reverse=sort.startswith("-"))


def test_attempt_filter_keeps_the_steps_whose_latest_attempt_it_is(
    client: httpx.Client, store: Path
) -> None:
    resumed = [r for r in _steps(store, "--run", "synthetic") if r["attempt"] == 2]
    assert resumed, "the demo store has resumed steps"
    items = client.get("/v1/runs/synthetic/steps", params={"attempt": 2}).json()["items"]
    assert [(i["rollout_id"], i["step_id"]) for i in items] == [
        (r["rollout_id"], r["step_id"]) for r in resumed
    ]


def test_step_result_is_the_recorded_divergences(client: httpx.Client, store: Path) -> None:
    step = _steps(store, "--run", "synthetic", "--first-divergent-stage", "reward.post_process")[0]
    ref = f"{step['rollout_id']}:{step['step_id']}"
    found = client.get(f"/v1/runs/synthetic/steps/{ref}/result").json()
    assert found["result"]["status"] == step["status"]
    assert found["result"]["first_divergent_stage"] == "reward.post_process"
    failed = [s["stage"] for s in found["stages"] if s["status"] == "fail"]
    assert failed[0] == "reward.post_process"
    code, out = web_demo.cli(
        "query", "divergences", "--store", str(store), "--run", "synthetic", "--format", "json"
    )
    assert code == 0
    recorded = [d for d in json.loads(out) if d["result_id"] == found["result"]["id"]]
    assert [
        (d["stage"], d["sample_id"], d["field"], d["token_offset"]) for d in found["divergences"]
    ] == [(d["stage"], d["sample_id"], d["field"], d["token_offset"]) for d in recorded]


def test_router_compare_is_the_cli_json_page_by_page(client: httpx.Client, store: Path) -> None:
    code, out = web_demo.cli(
        "router", "compare", "--store", str(store), "--run", "baseline", "--run", "r3", "--json"
    )
    assert code == 0
    cli = json.loads(out)
    whole = client.get("/v1/router/compare", params={"run": ["baseline", "r3"]}).json()
    assert whole.pop("next_cursor") is None
    assert whole == cli
    paged = _all_pages_of_steps(client)
    assert paged == cli["steps"]


def _all_pages_of_steps(client: httpx.Client) -> list[dict]:
    steps: list[dict] = []
    cursor = None
    while True:
        params: dict = {"run": ["baseline", "r3"], "limit": 2}
        if cursor:
            params["cursor"] = cursor
        page = client.get("/v1/router/compare", params=params).json()
        steps += page["steps"]
        cursor = page["next_cursor"]
        if cursor is None:
            return steps


def test_diff_is_the_cli_json(client: httpx.Client, store: Path) -> None:
    resumed = next(r for r in _steps(store, "--run", "synthetic") if r["attempt"] == 2)
    ref = f"synthetic/{resumed['rollout_id']}:{resumed['step_id']}"
    code, out = web_demo.cli("diff", "--store", str(store), f"{ref}@1", f"{ref}@2", "--json")
    assert code == 1
    got = client.get("/v1/diff", params={"a": f"{ref}@1", "b": f"{ref}@2"}).json()
    assert got == {"same": False, "reports": [json.loads(out)]}


@pytest.mark.parametrize(
    ("path", "params", "status"),
    [
        ("/v1/runs/nope/summary", {}, 404),
        ("/v1/runs/nope/strip", {}, 404),
        ("/v1/runs/synthetic/strip", {"bins": 0}, 422),
        ("/v1/runs/synthetic/strip", {"rollout_from": 5, "rollout_to": 1}, 400),
        ("/v1/runs/synthetic/steps", {"sort": "size"}, 422),
        ("/v1/runs/synthetic/steps", {"sort": "-status", "cursor": "bm9wZQ"}, 400),
        ("/v1/runs/synthetic/steps/999:0/result", {}, 404),
        ("/v1/router/compare", {"run": ["baseline"]}, 422),
        ("/v1/router/compare", {"run": ["baseline", "nope"]}, 404),
        ("/v1/router/compare", {"run": ["baseline", "r3"], "cursor": "x"}, 400),
        ("/v1/diff", {"a": "synthetic/3:0", "b": "nope/3:0"}, 404),
        ("/v1/diff", {"a": "synthetic/3:0", "b": "synthetic/999:0"}, 404),
        ("/v1/diff", {"a": "synthetic/3:0"}, 422),
    ],
)
def test_bad_requests_get_the_documented_error(
    client: httpx.Client, path: str, params: dict, status: int
) -> None:
    resp = client.get(path, params=params)
    assert resp.status_code == status, resp.text
    assert set(resp.json()) == {"error", "detail"}
