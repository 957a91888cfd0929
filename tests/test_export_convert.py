"""`trajstore export --format 1|2`: the other format major, same tensors, same verdicts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CAPTURE_DIR, FIXTURES
from trajstore.examples.replay_builders import write_consistent

from trajstore.bundle.reader import open_target
from trajstore.store import Store

pytestmark = pytest.mark.integration


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trajstore", *map(str, args)], capture_output=True, text=True
    )


def _stages(path: Path) -> dict[str, str]:
    out = cli("replay", path, "--json")
    report = json.loads(out.stdout)
    return {s["stage"]: s["status"] for b in report["bundles"] for s in b["stages"]}


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "s"
    with Store.open(root) as s:
        s.ingest([FIXTURES / "example_bundle"], run="relax")
        s.ingest([CAPTURE_DIR], run="cap")
        s.ingest([write_consistent(tmp_path / "m1", kind="step")[0]], run="mine")
    return root


def test_major_2_exported_as_major_1_validates_and_replays_the_same(
    store: Path, tmp_path: Path
) -> None:
    out = tmp_path / "as1"
    assert (
        cli(
            "export", "--store", store, "--run", "relax", "--step", "120:0", "--format", "1", out
        ).returncode
        == 0
    )
    bundle = open_target(out).first
    assert bundle.manifest.format_version.startswith("1.")
    assert "loss.value" not in bundle.manifest.stage_contracts
    assert cli("validate", out).returncode == 0
    assert _stages(out) == {**_stages(FIXTURES / "example_bundle"), "loss.value": "skipped"}


def test_major_1_exported_as_major_2_drops_what_major_2_cannot_carry(
    store: Path, tmp_path: Path
) -> None:
    out = tmp_path / "as2"
    assert (
        cli(
            "export", "--store", store, "--run", "mine", "--step", "120:0", "--format", "2", out
        ).returncode
        == 0
    )
    bundle = open_target(out).first
    assert bundle.manifest.format_version.startswith("2.")
    assert all("raw_reward" not in s.raw for s in bundle.index.samples)
    assert "reward.post_process" not in bundle.expected
    stages = _stages(out)
    assert stages["reward.post_process"] == "skipped"
    assert stages["advantage.estimate"] == stages["loss.policy"] == "pass"


def test_converted_payload_files_are_byte_identical(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "as1"
    cli("export", "--store", store, "--run", "relax", "--step", "120:0", "--format", "1", out)
    for pt in (FIXTURES / "example_bundle" / "payloads").glob("*.pt"):
        assert (out / "payloads" / pt.name).read_bytes() == pt.read_bytes()


def test_a_cohort_converts_rank_by_rank(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "cohort1"
    assert (
        cli(
            "export", "--store", store, "--run", "cap", "--step", "120:0", "--format", "1", out
        ).returncode
        == 0
    )
    bset = open_target(out)
    assert [b.rank for b in bset.bundles] == [0, 1]
    assert cli("replay", out).returncode == 0
