"""Schemathesis (4.x CLI, in a subprocess) against the live server's /openapi.json.

A bounded number of examples per operation, a fixed seed, and only the checks
the contract promises: no 5xx, every status code documented, every response
body valid against its schema, content types as declared.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CAPTURE_DIR, FIXTURES
from test_api import serve

from trajstore.store import Store

pytestmark = pytest.mark.integration

CHECKS = (
    "not_a_server_error,status_code_conformance,"
    "response_schema_conformance,content_type_conformance"
)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("schema") / "store"
    with Store.open(root, durable=False) as st:
        st.ingest([CAPTURE_DIR], run="cap")
        st.ingest([FIXTURES / "example_bundle"], run="ex")
    return root


def test_schemathesis_finds_no_5xx_and_no_schema_violation(store: Path, tmp_path: Path) -> None:
    os.environ.pop("TRAJSTORE_API_TOKEN", None)
    with serve(store) as client:
        url = f"{client.base_url}/openapi.json".replace("//openapi", "/openapi")
        cmd = [
            sys.executable,
            "-m",
            "schemathesis.cli",
            "run",
            url,
            "--checks",
            CHECKS,
            "--max-examples",
            "15",
            "--seed",
            "42",
            "--phases",
            "examples,coverage,fuzzing",
            "--generation-deterministic",
            "--suppress-health-check",
            "all",
            "--workers",
            "1",
        ]
        env = {**os.environ, "SCHEMATHESIS_HOOKS": ""}
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
        )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "No issues found" in done.stdout or "passed" in done.stdout, done.stdout[-3000:]
    print(done.stdout[-1500:])


def test_schemathesis_stateful_walks_the_openapi_links_to_payload_bytes(
    store: Path, tmp_path: Path
) -> None:
    """The stateful phase follows the links of api/links.py (runs -> steps -> a step ->
    its bundles -> samples and payloads): bundle keys cannot be guessed, so a 200 on a
    payload URL shows the links were followed. Bounded: 60 scenarios of at most 12 steps
    (about 25 s alone on 2 cores)."""
    os.environ.pop("TRAJSTORE_API_TOKEN", None)
    (tmp_path / "schemathesis.toml").write_text("[phases.stateful]\nmax-steps = 12\n")
    with serve(store) as client:
        url = f"{client.base_url}/openapi.json".replace("//openapi", "/openapi")
        links = client.get("/openapi.json").json()["paths"]["/v1/runs"]["get"]["responses"]
        assert "RunSteps" in links["200"]["links"]
        cmd = [sys.executable, "-m", "schemathesis.cli", "run", url, "--checks", CHECKS]
        cmd += ["--max-examples", "60", "--seed", "42", "--phases", "stateful"]
        # the mismatch listings lead nowhere new (their links reach a step and a bundle,
        # as the steps listing's do) and would spend the walk's bounded budget; the
        # other test fuzzes them (and tests/test_web_mismatch.py checks their answers)
        cmd += ["--exclude-path-regex", "/mismatch"]
        cmd += ["--suppress-health-check", "all", "--workers", "1"]
        cmd += ["--report", "har", "--report-har-path", str(tmp_path / "walk.har")]
        env = {**os.environ, "SCHEMATHESIS_HOOKS": ""}
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
        )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    covered = re.search(r"API Links:\s+(\d+) covered", done.stdout)
    assert covered and int(covered.group(1)) >= 8, done.stdout[-3000:]
    entries = json.loads((tmp_path / "walk.har").read_text())["log"]["entries"]
    reached = {
        (entry["request"]["url"].split("?")[0].rsplit("/", 2)[-2], entry["response"]["status"])
        for entry in entries
    }
    assert ("payloads", 200) in reached, sorted(reached)[:40]
    print(done.stdout[-800:])
