"""REST API against a real uvicorn server on 127.0.0.1, spoken to with httpx.

Stores: the Relax v2 fixtures (capture dir as run "cap", the single bundle as
run "ex", its divergent twin as run "div"), a 500-step store with one run, a
store written to by other processes while the server runs, and stores whose
catalog sync fails on a damaged ref.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import sqlalchemy as sa
import torch
import uvicorn
import web_demo
from conftest import (
    CAPTURE_DIR,
    FIXTURES,
    copy_fixture,
    edit_json,
    make_contents,
    resign_bundle,
)
from trajstore.api.app import create_app

from trajstore.bundle.writer import write_bundle
from trajstore.store import Store

pytestmark = pytest.mark.integration

STEP_DIR = CAPTURE_DIR / "replay-120-0"
EXAMPLE = FIXTURES / "example_bundle"
DIVERGENT = FIXTURES / "example_bundle_divergent"


@contextlib.contextmanager
def serve(store_dir: Path, token: str | None = None) -> Iterator[httpx.Client]:
    """A uvicorn server in a thread on a free loopback port; an httpx client for it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(store_dir, token=token, poll_s=0.1)
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


@pytest.fixture(scope="module")
def fixture_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("api") / "store"
    with Store.open(root, durable=False) as st:
        assert all(o.status == "published" for o in st.ingest([CAPTURE_DIR], run="cap"))
        assert all(o.status == "published" for o in st.ingest([EXAMPLE], run="ex"))
        assert all(o.status == "published" for o in st.ingest([DIVERGENT], run="div"))
    return root


@pytest.fixture(scope="module")
def client(fixture_store: Path) -> Iterator[httpx.Client]:
    os.environ.pop("TRAJSTORE_API_TOKEN", None)
    with serve(fixture_store) as c:
        yield c


def _error(resp: httpx.Response, status: int, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error", "detail"}
    if code is not None:
        assert body["error"] == code
    return body


# -- fetch by actor step id ---------------------------------------------------


def _bundle_dir(brief: dict) -> Path:
    return EXAMPLE if brief["rank"] is None else STEP_DIR / f"rank-{brief['rank']}"


@pytest.mark.parametrize("run", ["cap", "ex"])
def test_step_payloads_match_the_ingested_bundle(client: httpx.Client, run: str) -> None:
    resp = client.get(f"/v1/runs/{run}/steps/120:0")
    assert resp.status_code == 200, resp.text
    step = resp.json()
    assert (step["run"], step["rollout_id"], step["step_id"], step["attempt"]) == (run, 120, 0, 1)
    assert step["ranks"] == ([0, 1] if run == "cap" else [])
    assert step["rollout_bundle_keys"] == (["cap/rollout-120/a1"] if run == "cap" else [])
    compared = 0
    for brief in step["bundles"]:
        bdir = _bundle_dir(brief)
        manifest = json.loads((bdir / "manifest.json").read_text())
        assert brief["capabilities"] == {
            k: v["capability"] for k, v in manifest["stage_contracts"].items()
        }
        assert sorted(p["name"] for p in brief["payloads"]) == sorted(manifest["payloads"])
        for p in brief["payloads"]:
            pt = (bdir / "payloads" / f"{p['name']}.pt").read_bytes()
            tensor = torch.load(io.BytesIO(pt), weights_only=True)
            assert p["dtype"] == str(tensor.dtype) and p["shape"] == list(tensor.shape)
            # the original file, byte for byte
            got = client.get(p["url"], params={"format": "pt"})
            assert got.status_code == 200 and got.content == pt
            # raw tensor bytes, with dtype and shape headers
            raw = client.get(p["url"], params={"format": "raw"})
            assert raw.content == tensor.numpy().tobytes()
            assert raw.headers["x-dtype"] == str(tensor.dtype)
            assert raw.headers["x-shape"] == ",".join(map(str, tensor.shape))
            # .npy (the default), as an array
            arr = np.load(io.BytesIO(client.get(p["url"]).content), allow_pickle=False)
            np.testing.assert_array_equal(arr, tensor.numpy())
            assert arr.dtype == tensor.numpy().dtype
            compared += 1
    assert compared == (12 if run == "cap" else 6)


def test_step_samples_summary_and_verdict_shape(client: httpx.Client) -> None:
    step = client.get("/v1/runs/cap/steps/120:0").json()
    samples = [
        s
        for r in (0, 1)
        for s in json.loads((STEP_DIR / f"rank-{r}" / "index.json").read_text())["samples"]
    ]
    summ = step["samples"]
    assert summ["num_samples"] == len(samples)
    assert summ["num_response_tokens"] == sum(s["response_length"] for s in samples)
    assert sum(g["num_samples"] for g in summ["groups"]) == len(samples)
    assert sorted(i for g in summ["groups"] for i in g["sample_ids"]) == sorted(
        s["sample_id"] for s in samples
    )
    assert {mb["micro_batch_id"] for mb in summ["micro_batches"]} == {
        s.get("micro_batch_id") for s in samples
    }
    key = step["bundles"][0]["key"]
    one_group = summ["groups"][0]["semantic_group"]
    items = client.get(f"/v1/bundles/{key}/samples", params={"group": one_group}).json()["items"]
    assert items and all(i["semantic_group"] == one_group for i in items)
    detail = client.get(f"/v1/bundles/{key}").json()
    assert detail["bundle"]["key"] == key and detail["payloads"]
    rollout = client.get("/v1/runs/cap/rollouts/120").json()
    assert rollout["kind"] == "rollout" and rollout["step_ids"] == [0]


def test_a_samples_filter_naming_nothing_in_the_bundle_is_404(client: httpx.Client) -> None:
    key = client.get("/v1/runs/cap/steps/120:0").json()["bundles"][0]["key"]
    samples = client.get(f"/v1/bundles/{key}/samples").json()["items"]
    groups = sorted({s["semantic_group"] for s in samples})
    for params, what in (
        ({"group": "g-999"}, "group 'g-999'"),
        ({"micro_batch": "mb-x"}, "micro-batch 'mb-x'"),
    ):
        resp = client.get(f"/v1/bundles/{key}/samples", params=params)
        body = _error(resp, 404, "not_found")
        assert f"no {what}" in body["detail"]
    assert (
        ", ".join(groups)
        in client.get(f"/v1/bundles/{key}/samples", params={"group": "g-999"}).json()["detail"]
    )


def test_a_group_and_micro_batch_that_share_no_sample_list_nothing(client: httpx.Client) -> None:
    key = client.get("/v1/runs/cap/steps/120:0").json()["bundles"][0]["key"]
    samples = client.get(f"/v1/bundles/{key}/samples").json()["items"]
    pairs = {(s["semantic_group"], s["micro_batch_id"]) for s in samples}
    apart = [
        (g, mb)
        for g in {s["semantic_group"] for s in samples}
        for mb in {s["micro_batch_id"] for s in samples}
        if (g, mb) not in pairs
    ]
    assert apart, "the fixture has a group and a micro-batch that share no sample"
    g, mb = apart[0]
    resp = client.get(f"/v1/bundles/{key}/samples", params={"group": g, "micro_batch": mb})
    assert resp.status_code == 200 and resp.json() == {"items": []}


def test_a_misspelt_query_parameter_is_400_not_ignored(client: httpx.Client) -> None:
    # ignored, it would list every step as if they had all diverged first at loss.policy
    resp = client.get("/v1/runs/cap/steps", params={"first_divergent_stag": "loss.policy"})
    body = _error(resp, 400, "bad_request")
    assert body["detail"].startswith("unknown query parameter 'first_divergent_stag' (")
    assert "first_divergent_stage" in body["detail"]


def _operations(spec: dict) -> Iterator[tuple[str, str, str, list[dict]]]:
    """(method, path, a URL for it, its query parameters) of every OpenAPI operation."""
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            url = path.replace("{rollout_id}:{step_id}", "1:1")
            for name in ("run", "key", "rollout_id", "name"):
                url = url.replace("{" + name + "}", "x")
            yield method, path, url, [p for p in op.get("parameters", []) if p["in"] == "query"]


def _is_list(schema: dict) -> bool:
    return schema.get("type") == "array" or any(_is_list(s) for s in schema.get("anyOf", []))


def test_every_endpoint_takes_exactly_its_documented_query_parameters(
    client: httpx.Client,
) -> None:
    checked = 0
    for method, path, url, params in _operations(client.get("/openapi.json").json()):
        resp = client.request(method.upper(), url, params={"zz_not_a_parameter": "1"})
        assert resp.status_code == 400, (method, path, resp.text)
        takes = ", ".join(sorted(p["name"] for p in params)) or "none"
        assert resp.json()["detail"] == (
            f"unknown query parameter 'zz_not_a_parameter' (this endpoint takes: {takes})"
        ), (method, path)
        checked += 1
    assert checked >= 15  # every /v1 operation (18 when written)


def test_every_single_valued_query_parameter_given_twice_is_400(client: httpx.Client) -> None:
    """Frameworks keep the last of a repeated parameter: ?run=a&run=b answered for b
    alone. Only a parameter documented as a list (router/compare's run) repeats."""
    singles, lists = 0, 0
    for method, path, url, params in _operations(client.get("/openapi.json").json()):
        for param in params:
            name = param["name"]
            resp = client.request(method.upper(), url, params=[(name, "1"), (name, "1")])
            twice = f"query parameter {name!r} given more than once (it takes one value)"
            if _is_list(param["schema"]):
                assert twice not in resp.text, (method, path, name)
                lists += 1
            else:
                assert _error(resp, 400, "bad_request")["detail"] == twice, (method, path)
                singles += 1
    assert singles >= 30 and lists >= 1  # 44 and 1 when written


@pytest.mark.parametrize(
    "query",
    [
        "run=cap&run=ex",
        "sample=s-0&sample=s-1",
        "group=g-0&group=g-1",
        "a=ex/120:0&b=div/120:0&a=cap/120:0",
        "status=pass&status=diverged",
        "limit=1&limit=2",
        "attempt=1&attempt=1",  # even one value twice
    ],
)
def test_a_repeated_filter_is_400_naming_it_not_the_last_one_silently(
    client: httpx.Client, query: str
) -> None:
    name = query.split("=")[0]
    path = {
        "run": "/v1/divergences",
        "sample": "/v1/bundles/ex/step-120-0/a1/payloads/log_probs",
        "group": "/v1/bundles/ex/step-120-0/a1/samples",
        "a": "/v1/diff",
        "status": "/v1/runs/cap/steps",
        "limit": "/v1/runs/cap/steps",
        "attempt": "/v1/runs/cap/steps/120:0",
    }[name]
    body = _error(client.get(f"{path}?{query}"), 400, "bad_request")
    assert body["detail"] == f"query parameter {name!r} given more than once (it takes one value)"


def test_one_sample_slice(client: httpx.Client) -> None:
    key = "ex/step-120-0/a1"
    index = json.loads((EXAMPLE / "index.json").read_text())["samples"]
    lp = torch.load(EXAMPLE / "payloads" / "log_probs.pt", weights_only=True).numpy()
    offsets = np.cumsum([0] + [s["response_length"] for s in index])
    for pos, s in enumerate(index):
        resp = client.get(
            f"/v1/bundles/{key}/payloads/log_probs", params={"sample": s["sample_id"]}
        )
        assert resp.status_code == 200, resp.text
        np.testing.assert_array_equal(
            np.load(io.BytesIO(resp.content)), lp[offsets[pos] : offsets[pos + 1]]
        )
    _error(client.get(f"/v1/bundles/{key}/payloads/log_probs", params={"sample": "s-99"}), 404)
    _error(
        client.get(
            f"/v1/bundles/{key}/payloads/log_probs", params={"sample": "s-0", "format": "pt"}
        ),
        400,
    )


def test_one_sample_of_two_bundles_sharing_a_payload_is_each_bundles_own_row(
    tmp_path: Path,
) -> None:
    """Two bundles with the same log_probs record, s-0 and s-1 swapped in the second: each
    answers its own row, under its own ETag (the body cache once served the first one's
    row for both, and If-None-Match answered 304 across them)."""
    swapped = copy_fixture("example_bundle", tmp_path)

    def swap(doc: dict) -> None:
        first, second = doc["samples"][0], doc["samples"][1]
        first["sample_id"], second["sample_id"] = second["sample_id"], first["sample_id"]

    edit_json(swapped / "index.json", swap)
    resign_bundle(swapped)
    root = tmp_path / "store"
    with Store.open(root, durable=False) as st:
        assert all(o.status == "published" for o in st.ingest([EXAMPLE], run="ex"))
        assert all(o.status == "published" for o in st.ingest([swapped], run="sw"))
    lp = torch.load(EXAMPLE / "payloads" / "log_probs.pt", weights_only=True).numpy()
    rows = {"ex": {"s-0": lp[0:3], "s-1": lp[3:5]}, "sw": {"s-1": lp[0:3], "s-0": lp[3:5]}}
    os.environ.pop("TRAJSTORE_API_TOKEN", None)
    with serve(root) as client:
        etags = {}
        for run in ("ex", "sw"):  # ex first: its bodies are cached when sw is asked
            url = f"/v1/bundles/{run}/step-120-0/a1/payloads/log_probs"
            for sample, want in rows[run].items():
                resp = client.get(url, params={"sample": sample})
                assert resp.status_code == 200, resp.text
                np.testing.assert_array_equal(np.load(io.BytesIO(resp.content)), want)
                etags[run, sample] = resp.headers["etag"]
        assert etags["ex", "s-0"] != etags["sw", "s-0"]
        assert etags["ex", "s-0"] == etags["sw", "s-1"]  # the same row of the same record
        url = "/v1/bundles/sw/step-120-0/a1/payloads/log_probs"
        again = client.get(
            url, params={"sample": "s-0"}, headers={"If-None-Match": etags["ex", "s-0"]}
        )
        assert again.status_code == 200
        np.testing.assert_array_equal(np.load(io.BytesIO(again.content)), lp[3:5])


@pytest.mark.parametrize("written", ["12_0", "+120", "120.0", "１２０", " 120"])
def test_an_id_not_written_in_ascii_digits_is_422_not_another_step(
    client: httpx.Client, written: str
) -> None:
    """pydantic's lax int read 1_0 as 10 (another step, 200) and fullwidth digits alike."""
    _error(client.get(f"/v1/runs/cap/steps/{written}:0"), 422, "invalid_request")
    _error(client.get("/v1/runs/cap/steps", params={"rollout_from": written}), 422)
    _error(client.get("/v1/runs/cap/steps/120:0", params={"attempt": written}), 422)
    assert client.get("/v1/runs/cap/steps/0120:0").status_code == 200  # digits, leading 0


def test_a_group_index_in_other_digits_is_no_group(client: httpx.Client) -> None:
    key = "ex/step-120-0/a1"
    assert client.get(f"/v1/bundles/{key}/samples", params={"group": "0"}).status_code == 200
    _error(client.get(f"/v1/bundles/{key}/samples", params={"group": "０"}), 404)


# -- ETag / Range --------------------------------------------------------------


def test_etag_and_range(client: httpx.Client) -> None:
    url = "/v1/bundles/ex/step-120-0/a1/payloads/log_probs"
    full = client.get(url, params={"format": "raw"})
    etag = full.headers["etag"]
    assert full.headers["accept-ranges"] == "bytes"
    again = client.get(url, params={"format": "raw"}, headers={"If-None-Match": etag})
    assert again.status_code == 304 and again.content == b""
    assert client.get(url, headers={"If-None-Match": etag}).status_code == 200  # npy differs
    assert client.get(url, params={"format": "raw", "sample": "s-0"}).headers["etag"] != etag

    part = client.get(url, params={"format": "raw"}, headers={"Range": "bytes=4-11"})
    assert part.status_code == 206
    assert part.content == full.content[4:12]
    assert part.headers["content-range"] == f"bytes 4-11/{len(full.content)}"
    tail = client.get(url, params={"format": "raw"}, headers={"Range": "bytes=-5"})
    assert tail.status_code == 206 and tail.content == full.content[-5:]
    opened = client.get(url, params={"format": "raw"}, headers={"Range": "bytes=30-"})
    assert opened.content == full.content[30:]
    bad = client.get(url, params={"format": "raw"}, headers={"Range": "bytes=9999-"})
    _error(bad, 416)
    assert bad.headers["content-range"] == f"bytes */{len(full.content)}"


# -- errors --------------------------------------------------------------------


def test_errors_are_json_with_the_right_status(client: httpx.Client) -> None:
    _error(client.get("/v1/runs/cap/steps/120:x"), 422, "invalid_request")
    _error(client.get("/v1/runs/cap/steps/-1:0"), 422)
    _error(client.get("/v1/runs/cap/steps/120"), 422)
    _error(client.get("/v1/runs/cap/steps/99999999999999999999999:0"), 422)
    _error(client.get("/v1/runs/cap/steps/121:0"), 404, "not_found")
    _error(client.get("/v1/runs/cap/steps/120:0", params={"attempt": 7}), 404)
    _error(client.get("/v1/runs/nope/steps/120:0"), 404)
    _error(client.get("/v1/runs/nope/steps"), 404)
    _error(client.get("/v1/bundles/cap/step-120-0/a9"), 404)
    _error(client.get("/v1/bundles/../../etc/passwd"), 404)
    _error(client.get("/v1/bundles/%2e%2e/%2e%2e/catalog.duckdb"), 404)
    _error(client.get("/v1/bundles/ex/step-120-0/a1/payloads/nope"), 404)
    _error(
        client.get("/v1/runs/cap/steps", params={"rollout_from": 5, "rollout_to": 1}),
        400,
        "bad_filter",
    )
    _error(client.get("/v1/divergences", params={"rollout_from": 5, "rollout_to": 1}), 400)
    _error(client.get("/v1/runs/cap/steps", params={"cursor": "garbage"}), 400)
    _error(client.get("/v1/runs/cap/steps", params={"limit": 0}), 422)
    _error(client.get("/v1/runs/cap/steps", params={"limit": 100000}), 422)
    _error(client.get("/v1/steps/120:0"), 409, "ambiguous_run")  # two runs
    _error(client.post("/v1/replay", json={"run": "cap", "step": "120:x"}), 400)
    _error(client.post("/v1/replay", json={"run": "cap", "step": "120:0", "rollout": 120}), 400)
    _error(client.post("/v1/replay", json={"run": "cap", "step": "120:0", "stage": "nope"}), 400)
    _error(client.post("/v1/replay", json={"run": "cap", "step": "120:0", "stage": ","}), 400)
    _error(client.post("/v1/replay", json={"run": "cap", "step": "120:0", "samples": ["zz"]}), 400)
    _error(client.post("/v1/replay", json={"bundle": "../x"}), 404)
    _error(client.post("/v1/replay", json={"step": "120:0"}), 400)  # two runs: name one


def _verdict(report: dict) -> dict:
    """What a replay decided: verdict, first divergence, each stage's outcome."""
    first = report["first_divergence"]
    return {
        "status": report["status"],
        "first_divergent_stage": report["first_divergent_stage"],
        "root_bundle_key": report["root_bundle_key"],
        "first": None
        if first is None
        else (
            first["stage"],
            first["sample_id"],
            first["field"],
            first["token_offset"],
            first["mismatch_count"],
        ),
        "stages": [
            (
                b["rank"],
                s["stage"],
                s["status"],
                s["mismatch_count"],
                [(d["sample_id"], d["field"], d["token_offset"]) for d in s["divergences"]],
            )
            for b in report["bundles"]
            for s in b["stages"]
        ],
    }


@pytest.mark.parametrize(
    ("run", "exit_code", "status", "first"),
    [
        ("ex", 0, "pass", None),
        # the fixture's known fault: s-0's reward, so its advantages from token 0 on
        ("div", 1, "diverged", ("advantage.estimate", "s-0", "advantages", 0, 3)),
    ],
)
def test_replay_endpoint_gives_the_cli_verdict(
    client: httpx.Client,
    fixture_store: Path,
    run: str,
    exit_code: int,
    status: str,
    first: tuple | None,
) -> None:
    cli = _trajstore(
        "replay", "--store", str(fixture_store), "--run", run, "--step", "120:0", "--json"
    )
    resp = client.post("/v1/replay", json={"run": run, "step": "120:0"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert cli.returncode == body["exit_code"] == exit_code, cli.stderr
    assert body["recorded"] == []
    from_cli, from_api = _verdict(json.loads(cli.stdout)), _verdict(body["report"])
    assert from_api == from_cli
    assert (from_api["status"], from_api["first"]) == (status, first)
    assert from_api["first_divergent_stage"] == (None if first is None else first[0])


def test_replay_endpoint_selection_gives_the_cli_verdict(
    client: httpx.Client, fixture_store: Path
) -> None:
    cli = _trajstore(
        "replay",
        "--store",
        str(fixture_store),
        "--run",
        "cap",
        "--step",
        "120:0",
        "--group",
        "g-0",
        "--json",
    )
    resp = client.post("/v1/replay", json={"run": "cap", "step": "120:0", "groups": ["g-0"]})
    assert resp.status_code == 200, resp.text
    assert resp.json()["exit_code"] == cli.returncode, cli.stderr
    assert _verdict(resp.json()["report"]) == _verdict(json.loads(cli.stdout))
    assert resp.json()["report"]["selection"]["groups"] == ["g-0"]


def test_a_bundle_is_replayed_only_with_its_own_run_and_attempt(client: httpx.Client) -> None:
    """A bundle key names its run and attempt: a `run` or `attempt` given with it that
    disagrees was ignored, so a script replayed (and with record, recorded) another run's
    bundle than it named."""
    key = "ex/step-120-0/a1"
    results = client.get("/v1/stats").json()["results"]
    other_run = client.post("/v1/replay", json={"run": "cap", "bundle": key, "record": True})
    assert _error(other_run, 400, "bad_request")["detail"] == (
        "bundle 'ex/step-120-0/a1' is of run 'ex', not of run 'cap': "
        "name the bundle alone or with its own run"
    )
    other_attempt = client.post("/v1/replay", json={"bundle": key, "attempt": 2})
    assert _error(other_attempt, 400, "bad_request")["detail"] == (
        "bundle 'ex/step-120-0/a1' is attempt 1, not attempt 2: "
        "name the bundle alone or with its own attempt"
    )
    assert client.get("/v1/stats").json()["results"] == results  # nothing recorded
    own = client.post("/v1/replay", json={"run": "ex", "bundle": key, "attempt": 1})
    assert own.status_code == 200, own.text
    assert [b["bundle_key"] for b in own.json()["report"]["bundles"]] == [key]


# -- pagination -----------------------------------------------------------------


@pytest.fixture(scope="module")
def big_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("big")
    cap = base / "capture"
    cap.mkdir()
    # the payloads (4 tokens each) serialized once and written verbatim by every bundle,
    # as tests/test_replay_at_scale.py's clones do: torch.save 3,000 times was most of
    # this fixture's cost, and nothing here reads a payload's values
    tmpl = write_bundle(base / "tmpl", make_contents(groups=1, samples_per_group=2, lengths=2))
    pt = {p.stem: p.read_bytes() for p in (tmpl / "payloads").glob("*.pt")}
    for i in range(500):
        r, s = divmod(i, 4)
        contents = make_contents(
            groups=1, samples_per_group=2, lengths=2, rollout_id=r, step_id=s, seed=i
        )
        assert set(contents.payloads) == set(pt)
        contents.payloads = dict(pt)
        write_bundle(cap / f"replay-{r}-{s}", contents)
    with Store.open(base / "store", durable=False) as st:
        assert len(st.ingest([cap], run="big")) == 500
    return base / "store"


def test_pagination_walks_500_steps_exactly_once(big_store: Path) -> None:
    with serve(big_store) as c:
        seen: list[tuple[int, int]] = []
        cursor = None
        pages = 0
        while True:
            params: dict = {"limit": 37}
            if cursor:
                params["cursor"] = cursor
            page = c.get("/v1/runs/big/steps", params=params).json()
            seen += [(i["rollout_id"], i["step_id"]) for i in page["items"]]
            pages += 1
            cursor = page["next_cursor"]
            if not cursor:
                break
        assert pages == 14
        assert len(seen) == 500 and len(set(seen)) == 500 and seen == sorted(seen)
        assert set(seen) == {divmod(i, 4) for i in range(500)}
        ranged = c.get("/v1/runs/big/steps", params={"rollout_from": 10, "rollout_to": 12}).json()
        assert [i["rollout_id"] for i in ranged["items"]] == [10] * 4 + [11] * 4 + [12] * 4
        one = c.get("/v1/steps/124:3")  # the only run
        assert one.status_code == 200 and one.json()["run"] == "big"


@pytest.fixture(scope="module")
def demo_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """The demo's runs (tests/web_demo.py): synthetic's 20 steps and recorded divergences,
    the MoE runs' (baseline, r3) router metrics."""
    os.environ.pop("TRAJSTORE_API_TOKEN", None)
    with serve(web_demo.demo_store(tmp_path_factory)) as c:
        yield c


def _rows(page: dict) -> list:
    return page["steps"] if "steps" in page else page["items"]  # router/compare: steps


def _walk(client: httpx.Client, path: str, params: dict) -> tuple[list, int]:
    """Every row of a listing and the number of pages, page sizes 2, 3, 2, 3, ..."""
    rows: list = []
    cursor, pages = None, 0
    while pages == 0 or cursor is not None:
        pages += 1
        limit = 3 if pages % 2 == 0 else 2
        query = {**params, "limit": limit, **({"cursor": cursor} if cursor else {})}
        resp = client.get(path, params=query)
        assert resp.status_code == 200, resp.text
        rows += _rows(resp.json())
        cursor = resp.json()["next_cursor"]
    return rows, pages


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("/v1/divergences", {"run": "synthetic"}),
        ("/v1/divergences", {"run": "synthetic", "stage": "advantage.estimate"}),
        ("/v1/runs/synthetic/steps", {}),
        ("/v1/runs/synthetic/steps", {"sort": "-status", "rollout_from": 2}),
        ("/v1/router/metrics", {"run": "r3"}),
        ("/v1/router/compare", {"run": ["baseline", "r3"]}),
    ],
)
def test_a_cursor_walks_its_own_query_to_the_rows_of_one_big_page(
    demo_client: httpx.Client, path: str, params: dict
) -> None:
    whole = demo_client.get(path, params={**params, "limit": 1000}).json()
    assert whole["next_cursor"] is None
    rows, pages = _walk(demo_client, path, params)
    assert pages > 1 and rows == _rows(whole)


@pytest.mark.parametrize(
    ("path", "params", "other_path", "other_params", "code"),
    [
        ("/v1/divergences", {"run": "synthetic"}, "/v1/divergences", {"run": "baseline"}, None),
        (
            "/v1/divergences",
            {"run": "synthetic"},
            "/v1/divergences",
            {"run": "synthetic", "stage": "loss.policy"},
            None,
        ),
        ("/v1/divergences", {"run": "synthetic"}, "/v1/divergences", {}, None),
        ("/v1/runs/synthetic/steps", {}, "/v1/runs/baseline/steps", {}, None),
        (
            "/v1/runs/synthetic/steps",
            {"status": "diverged"},
            "/v1/runs/synthetic/steps",
            {"status": "pass"},
            None,
        ),
        ("/v1/router/metrics", {"run": "r3"}, "/v1/router/metrics", {"run": "baseline"}, None),
        (
            "/v1/router/compare",
            {"run": ["baseline", "r3"]},
            "/v1/router/compare",
            {"run": ["baseline", "synthetic"]},
            "bad_filter",
        ),
    ],
)
def test_a_cursor_of_another_query_is_400_not_an_empty_or_wrong_page(
    demo_client: httpx.Client,
    path: str,
    params: dict,
    other_path: str,
    other_params: dict,
    code: str | None,
) -> None:
    cursor = demo_client.get(path, params={**params, "limit": 1}).json()["next_cursor"]
    assert cursor is not None
    mine = demo_client.get(path, params={**params, "cursor": cursor})
    assert mine.status_code == 200, mine.text
    other = demo_client.get(other_path, params={**other_params, "cursor": cursor})
    body = _error(other, 400, code or "bad_request")
    assert body["detail"].startswith("cursor belongs to another query: ")


# -- auth ------------------------------------------------------------------------


def test_auth_on(fixture_store: Path) -> None:
    with serve(fixture_store, token="s3cret-token") as c:
        for url in ("/v1/health", "/v1/runs/cap/steps/120:0", "/openapi.json"):
            _error(c.get(url), 401, "unauthorized")
            _error(c.get(url, headers={"Authorization": "Bearer wrong"}), 401)
            assert c.get(url, headers={"Authorization": "Bearer s3cret-token"}).status_code == 200
        _error(c.post("/v1/replay", json={"run": "ex", "step": "120:0", "record": True}), 401)


def test_auth_off(client: httpx.Client) -> None:
    assert client.get("/v1/health").status_code == 200
    assert client.get("/openapi.json").status_code == 200
    assert client.get("/docs").status_code == 200


# -- health: a catalog sync that fails ---------------------------------------------


def _publish_damaged_ref(store: Path) -> Path:
    """A ref the store wrote, published again under a new name cut in half.

    Written as a dot-file and renamed, as the store publishes, so the sync
    reads the damaged bytes and nothing else.
    """
    refs = store / "refs" / "bundles"
    data = min(refs.glob("*.json")).read_bytes()
    damaged = refs / f"{time.time_ns():020d}-{os.getpid()}-deadbeef.json"
    tmp = refs / f".{damaged.name}.tmp"
    tmp.write_bytes(data[: len(data) // 2])
    tmp.rename(damaged)
    return damaged


def test_health_is_ok_while_the_catalog_syncs(client: httpx.Client) -> None:
    resp = client.get("/v1/health")
    assert resp.status_code == 200
    body = resp.json()
    assert (body["status"], body["sync_error"], body["runs"]) == ("ok", None, 3)


def test_health_reports_a_failing_sync_and_its_recovery(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with Store.open(store, durable=False) as st:
        st.ingest([EXAMPLE], run="ex")
    with serve(store) as c:
        assert c.get("/v1/health").json()["status"] == "ok"
        damaged = _publish_damaged_ref(store)
        resp = _poll(lambda: (r := c.get("/v1/health")).status_code == 503 and r)
        body = resp.json()
        assert body["status"] == "degraded"
        assert damaged.name in body["sync_error"] and "unreadable" in body["sync_error"]
        # the last good snapshot is still served
        assert c.get("/v1/runs/ex/steps/120:0").status_code == 200
        damaged.unlink()  # what `trajstore fsck` would point at
        healed = _poll(lambda: (r := c.get("/v1/health")).status_code == 200 and r)
        assert (healed.json()["status"], healed.json()["sync_error"]) == ("ok", None)


def test_server_starts_degraded_on_a_store_whose_sync_fails(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with Store.open(store, durable=False) as st:
        st.ingest([EXAMPLE], run="ex")
        assert [r["run"] for r in st.runs()] == ["ex"]  # the file catalog now holds it
    damaged = _publish_damaged_ref(store)
    with serve(store) as c:
        resp = c.get("/v1/health")
        assert resp.status_code == 503
        assert resp.json()["status"] == "degraded" and damaged.name in resp.json()["sync_error"]
        assert resp.json()["runs"] == 1  # what the catalog held before the damaged ref
        assert c.get("/v1/runs/ex/steps/120:0").status_code == 200


# -- other processes write while the server runs ---------------------------------


def _trajstore(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trajstore", *args], capture_output=True, text=True, timeout=120
    )


def _poll(fetch, *, tries: int = 300, every: float = 0.1):  # noqa: ANN001, ANN202
    for _ in range(tries):
        got = fetch()
        if got:
            return got
        time.sleep(every)
    raise AssertionError("not visible through the API in time")


def test_ingest_and_record_from_other_processes(tmp_path: Path) -> None:
    store = tmp_path / "store"
    Store.open(store).ingest([EXAMPLE], run="ex")
    with serve(store) as c:
        assert c.get("/v1/runs").json()["items"][0]["run"] == "ex"
        done = _trajstore("ingest", str(CAPTURE_DIR), "--store", str(store), "--run", "cap")
        assert done.returncode == 0, done.stderr
        # a sync may land mid-ingest (the step's refs before the rollout's): poll both
        _poll(
            lambda: (
                c.get("/v1/runs/cap/steps/120:0").status_code == 200
                and c.get("/v1/runs/cap/rollouts/120").status_code == 200
            )
        )
        assert c.get("/v1/runs/cap/steps/120:0").json()["latest_verdict"] is None

        done = _trajstore(
            "replay", "--store", str(store), "--run", "cap", "--step", "120:0", "--record", "--json"
        )
        assert done.returncode in (0, 1), done.stderr
        status = json.loads(done.stdout)["status"]
        verdict = _poll(lambda: c.get("/v1/runs/cap/steps/120:0").json()["latest_verdict"])
        assert verdict["status"] == status
        listed = c.get("/v1/runs/cap/steps").json()["items"][0]
        assert listed["status"] == status
        # one result per rank bundle: a sync may land between their refs, as above
        _poll(lambda: c.get("/v1/stats").json()["results"] >= 2)

        # a record through the API (loopback, no token) is visible at once
        rec = c.post("/v1/replay", json={"run": "ex", "step": "120:0", "record": True})
        assert rec.status_code == 200 and len(rec.json()["recorded"]) == 1
        assert c.get("/v1/runs/ex/steps/120:0").json()["latest_verdict"] is not None
        # and the CLI can still open the catalog (the server does not hold the file)
        done = _trajstore("stats", "--store", str(store))
        assert done.returncode == 0, done.stderr


def test_run_pages_built_once_per_generation_follow_a_recorded_result(tmp_path: Path) -> None:
    """The summary, strip and steps page are cached per catalog generation: a result
    recorded afterwards shows on all three (the cache is dropped when the catalog moves)."""
    store = tmp_path / "store"
    with Store.open(store, durable=False) as st:
        st.ingest([EXAMPLE], run="ex")
    with serve(store) as c:
        pages = ("/v1/runs/ex/summary", "/v1/runs/ex/strip", "/v1/runs/ex/steps")
        summary, strip, steps = (c.get(path).json() for path in pages)
        assert summary["by_status"]["unreplayed"] == 1
        assert [b["unreplayed"] for b in strip["bins"]] == [1]
        assert steps["items"][0]["status"] is None  # never replayed
        assert [c.get(path).json() for path in pages] == [summary, strip, steps]  # cached
        rec = c.post("/v1/replay", json={"run": "ex", "step": "120:0", "record": True})
        assert rec.status_code == 200 and len(rec.json()["recorded"]) == 1
        status = c.get("/v1/runs/ex/steps/120:0").json()["latest_verdict"]["status"]
        summary, strip, steps = (c.get(path).json() for path in pages)
        assert (summary["by_status"]["unreplayed"], summary["by_status"][status]) == (0, 1)
        assert [(b["unreplayed"], b[status]) for b in strip["bins"]] == [(0, 1)]
        assert steps["items"][0]["status"] == status


def test_a_generations_summary_and_strips_read_the_run_verdicts_once(tmp_path: Path) -> None:
    """The steps page's first load after a sync asks for the summary and the strip: both
    come from one read of the run's verdict rows (the statement that grows with the run),
    as does a strip over a range or with other bins; a new generation reads them again."""
    store = tmp_path / "store"
    with Store.open(store, durable=False) as st:
        st.ingest([EXAMPLE], run="ex")
    reads: list[str] = []

    def count(conn, cursor, statement, *args) -> None:  # noqa: ANN001 (SQLAlchemy's hook)
        if "GROUP BY steps.rollout_id" in statement:
            reads.append(statement)

    sa.event.listen(sa.engine.Engine, "before_cursor_execute", count)
    try:
        with serve(store) as c:
            assert c.get("/v1/runs/ex/summary").json()["steps"] == 1
            for params in ({}, {"bins": 4}, {"rollout_from": 120, "rollout_to": 120}):
                bins = c.get("/v1/runs/ex/strip", params=params).json()["bins"]
                assert [b["steps"] for b in bins] == [1]
            assert c.get("/v1/runs/ex/strip", params={"rollout_from": 121}).json()["bins"] == []
            assert len(reads) == 1
            rec = c.post("/v1/replay", json={"run": "ex", "step": "120:0", "record": True})
            assert rec.status_code == 200
            assert c.get("/v1/runs/ex/summary").json()["by_status"]["unreplayed"] == 0
            assert len(reads) == 2
    finally:
        sa.event.remove(sa.engine.Engine, "before_cursor_execute", count)


def test_body_cache_stays_within_its_byte_bound() -> None:
    from trajstore.api.payloads import Body, BodyCache

    cache = BodyCache(max_bytes=400)
    for i in range(5):
        cache.put(f"e{i}", Body.of(bytes(100)))
    assert cache.get("e0") is None  # least recently used went first
    assert all(cache.get(f"e{i}") is not None for i in (1, 2, 3, 4))
    cache.put("huge", Body.of(bytes(200)))  # over a quarter of the bound: never cached
    assert cache.get("huge") is None and cache.get("e4") is not None


def test_a_step_recaptured_on_another_rank_layout_is_one_step_of_its_latest_attempt(
    tmp_path: Path,
) -> None:
    """120:0 captured on ranks 0 and 1, then re-captured by one producer: attempt 2, as
    `Store.step` (and so replay, export, diff) has it, on every endpoint."""
    store = tmp_path / "store"
    with Store.open(store, durable=False) as st:
        assert all(o.status == "published" for o in st.ingest([CAPTURE_DIR], run="r"))
        assert all(o.status == "published" for o in st.ingest([DIVERGENT], run="r"))
        assert [b.rank for b in st.step("r", 120, 0)] == [None]
    with serve(store) as c:
        steps = c.get("/v1/runs/r/steps").json()["items"]
        assert [(s["attempt"], s["num_bundles"], s["bundle_keys"]) for s in steps] == [
            (2, 1, ["r/step-120-0/a2"])
        ]
        assert c.get("/v1/runs/r/steps", params={"attempt": 1}).json()["items"] == []
        summary = c.get("/v1/runs/r/summary").json()
        assert (summary["steps"], summary["by_status"]["unreplayed"]) == (1, 1)
        step = c.get("/v1/runs/r/steps/120:0").json()
        assert (step["attempt"], step["attempts"], step["ranks"]) == (2, [1, 2], [])
        assert [b["key"] for b in step["bundles"]] == ["r/step-120-0/a2"]
        old = c.get("/v1/runs/r/steps/120:0", params={"attempt": 1}).json()
        assert (old["attempt"], old["ranks"]) == (1, [0, 1])
