"""The README's short tour runs as written, in order, on what `trajstore demo` leaves.

Apart from tests/test_docs.py (the tutorial) so the two slowest doc checks, each a
minute or more of commands, can run on different xdist workers.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import serving
from conftest import DemoRun, user_env

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[1] / "README.md"
#: where `trajstore serve` listens when given no --host/--port (the README says so)
DEFAULT_SERVE = "http://127.0.0.1:8000"
_TOUR_EXIT = re.compile(r"\bexit (\d+)\s*$")


def tour_lines(markdown: str) -> list[tuple[list[str], int]]:
    """The README tour's commands: (words, expected exit code, 0 unless the trailing
    comment ends with "exit N")."""
    tour = markdown.split("## A short tour", 1)[1].split("\n## ", 1)[0]
    block = tour.split("```sh\n", 1)[1].split("```", 1)[0]
    out = []
    for raw in block.splitlines():
        code, _, comment = raw.partition("#")
        if code.strip():
            match = _TOUR_EXIT.search(comment)
            out.append((shlex.split(code), int(match.group(1)) if match else 0))
    return out


def _serve_as_written(argv: list[str], cwd: Path, env: dict[str, str]) -> None:
    """Start the serve line, see the API, the web view and /docs answer, stop it (Ctrl-C)."""
    server = subprocess.Popen(argv, cwd=cwd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, (
                f"serve exited {server.returncode}: {server.stderr.read()}"
            )
            try:
                if httpx.get(f"{DEFAULT_SERVE}/v1/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the README's `trajstore serve` never answered"
            time.sleep(0.2)
        runs = httpx.get(f"{DEFAULT_SERVE}/v1/runs", timeout=60).json()["items"]
        assert {"baseline", "r3", "synthetic"} <= {r["run"] for r in runs}
        for page in ("/", "/docs"):
            got = httpx.get(DEFAULT_SERVE + page, timeout=60)
            assert got.status_code == 200 and got.headers["content-type"].startswith("text/html")
    finally:
        serving.stop(server)


def test_the_readme_tour_runs_as_written_on_what_make_demo_leaves(demo_run: DemoRun) -> None:
    """Every line of the README's tour, in order, from where `trajstore demo demo-store`
    ran (as `make demo` runs it from the repository root), with its stated exit code."""
    assert demo_run.returncode == 0, demo_run.output[-3000:]
    lines = tour_lines(README.read_text(encoding="utf-8"))
    assert len(lines) >= 9 and all(words[0] == "trajstore" for words, _ in lines)
    commands = {words[1] for words, _ in lines}
    assert {"validate", "replay", "ingest", "query", "diff", "router", "serve"} <= commands
    assert {code for _, code in lines} == {0, 1}
    env = user_env()
    for words, expect in lines:
        argv = [sys.executable, "-m", "trajstore", *words[1:]]
        if words[1] == "serve":
            _serve_as_written(argv, demo_run.cwd, env)
            continue
        proc = subprocess.run(
            argv, cwd=demo_run.cwd, env=env, capture_output=True, text=True, timeout=600
        )
        assert (proc.returncode, "Traceback" in proc.stderr) == (expect, False), (
            f"README tour: {' '.join(words)!r} exited {proc.returncode}, the README says "
            f"{expect}\n--- stdout\n{proc.stdout[-2000:]}\n--- stderr\n{proc.stderr[-2000:]}"
        )


def test_the_tour_parser_reads_exit_codes_from_the_trailing_comment() -> None:
    md = "\n".join(
        [
            "## A short tour",
            "```sh",
            "trajstore validate d/            # every bundle valid",
            "trajstore replay d/ --step 3:0   # first divergence: exit 1",
            "trajstore query steps --store s",
            "```",
            "## Next",
            "```sh",
            "trajstore not-in-the-tour",
            "```",
        ]
    )
    assert tour_lines(md) == [
        (["trajstore", "validate", "d/"], 0),
        (["trajstore", "replay", "d/", "--step", "3:0"], 1),
        (["trajstore", "query", "steps", "--store", "s"], 0),
    ]
