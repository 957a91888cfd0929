"""CI smoke run of the parser fuzzers (tests/fuzz/): a bounded number of inputs each.

Each harness runs in its own process (atheris owns the process: libFuzzer's
driver, signal handlers), starting from the committed seed corpus; new inputs
go to a temp dir so the committed corpus never changes. Exit 0 means no input
raised anything but trajstore's own one-line errors, within the memory cap.
The long runs and their numbers are in docs/reliability.md.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

FUZZ = Path(__file__).resolve().parent / "fuzz"

#: harness -> inputs; sized so the four together stay well under the 40 s test budget
#: (`expected` replays a bundle per input: tens of milliseconds each, not microseconds)
RUNS = {"ptfile": 20000, "documents": 4000, "pack_index": 8000, "expected": 300}


@pytest.mark.parametrize("harness", sorted(RUNS))
def test_fuzz_harness_smoke_run_finds_nothing(harness: str, tmp_path: Path) -> None:
    import atheris  # noqa: F401  (a dev dependency: missing, the test fails here)

    seeds = FUZZ / "corpus" / harness
    assert sorted(seeds.iterdir()), f"empty seed corpus {seeds}"
    work = tmp_path / "corpus"
    work.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            str(FUZZ / f"fuzz_{harness}.py"),
            str(work),
            str(seeds),
            f"-atheris_runs={RUNS[harness]}",
            "-rss_limit_mb=2048",
            "-timeout=20",
            "-seed=1",
            f"-artifact_prefix={tmp_path}/",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, f"fuzz_{harness} found a crash:\n{tail}"
    assert "Done" in proc.stderr, tail
