"""`trajstore inspect|validate` as a user runs them: a subprocess, exit codes, stderr."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CAPTURE_DIR, FIXTURE_BUNDLES, FIXTURES, copy_fixture, make_contents

from trajstore.bundle.writer import write_bundle

pytestmark = pytest.mark.integration


def run(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trajstore", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_clean_failure(proc: subprocess.CompletedProcess) -> list[str]:
    """Exit 2, no traceback, every stderr line a one-line `trajstore:` message."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines
    assert all(line.startswith(("trajstore: invalid: ", "trajstore: error: ")) for line in lines), (
        lines
    )
    return lines


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_help_works() -> None:
    proc = run("--help")
    assert proc.returncode == 0
    assert "inspect" in proc.stdout and "validate" in proc.stdout


def test_no_command_prints_help_and_exits_2() -> None:
    proc = run()
    assert proc.returncode == 2
    assert "usage:" in proc.stdout


@pytest.mark.parametrize("name", FIXTURE_BUNDLES)
def test_validate_fixture_bundle_exits_0(name: str) -> None:
    proc = run("validate", FIXTURES / name)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{FIXTURES / name}: valid\n"
    assert proc.stderr == ""


@pytest.mark.parametrize(
    ("selector", "target"),
    [(["--step", "120:0"], "replay-120-0"), (["--rollout", "120"], "replay-rollout-120")],
    ids=["step", "rollout"],
)
def test_validate_capture_dir_selector_exits_0(selector: list[str], target: str) -> None:
    proc = run("validate", CAPTURE_DIR, *selector, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["path"] == str(CAPTURE_DIR / target)
    assert report["valid"] is True


def test_validate_capture_dir_step_reports_both_ranks() -> None:
    report = json.loads(run("validate", CAPTURE_DIR, "--step", "120:0", "--json").stdout)
    assert report["bundles"] == ["replay-120-0[rank 0]", "replay-120-0[rank 1]"]


def test_validate_capture_dir_without_selector_validates_every_bundle() -> None:
    proc = run("validate", CAPTURE_DIR)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"{CAPTURE_DIR / 'replay-120-0'}: valid",
        f"{CAPTURE_DIR / 'replay-rollout-120'}: valid",
    ]


def test_validate_capture_dir_json_is_a_list_of_reports() -> None:
    reports = json.loads(run("validate", CAPTURE_DIR, "--json").stdout)
    assert [(Path(r["path"]).name, r["valid"]) for r in reports] == [
        ("replay-120-0", True),
        ("replay-rollout-120", True),
    ]


@pytest.mark.parametrize("name", FIXTURE_BUNDLES)
def test_inspect_fixture_bundle_exits_0(name: str) -> None:
    proc = run("inspect", FIXTURES / name)
    assert proc.returncode == 0, proc.stderr
    assert "status: complete" in proc.stdout
    assert "actor step 120:0" in proc.stdout


def test_inspect_json_parses() -> None:
    info = json.loads(run("inspect", FIXTURES / "example_bundle", "--json").stdout)
    assert info["complete"] is True
    assert info["members"][0]["format_version"] == "2.0.0"
    assert info["members"][0]["samples"]["count"] == 4


@pytest.mark.parametrize(
    ("selector", "ranks"),
    [(["--step", "120:0"], [0, 1]), (["--rollout", "120"], None)],
    ids=["step", "rollout"],
)
def test_inspect_capture_dir_selector(selector: list[str], ranks) -> None:
    proc = run("inspect", CAPTURE_DIR, *selector, "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["complete"] is True
    assert info["cohort_ranks"] == ranks


def test_inspect_capture_dir_without_selector_covers_every_bundle() -> None:
    proc = run("inspect", CAPTURE_DIR, "--json")
    assert proc.returncode == 0, proc.stderr
    assert [Path(i["path"]).name for i in json.loads(proc.stdout)] == [
        "replay-120-0",
        "replay-rollout-120",
    ]


def test_inspect_incomplete_bundle_says_so_and_exits_0(tmp_path: Path) -> None:
    bundle = copy_fixture("example_bundle", tmp_path)
    (bundle / "COMPLETE").unlink()
    proc = run("inspect", bundle)
    assert proc.returncode == 0, proc.stderr
    assert "INCOMPLETE" in proc.stdout
    assert "COMPLETE is missing" in proc.stdout
    assert "bundle b-example" in proc.stdout


def test_validate_incomplete_bundle_exits_2(tmp_path: Path) -> None:
    bundle = copy_fixture("example_bundle", tmp_path)
    (bundle / "COMPLETE").unlink()
    lines = assert_clean_failure(run("validate", bundle))
    assert lines == [
        f"trajstore: invalid: {bundle}: {bundle}: COMPLETE is missing "
        "(bundle incomplete or still being written)"
    ]


def test_validate_corrupt_payload_exits_2_naming_it(tmp_path: Path) -> None:
    bundle = copy_fixture("example_bundle", tmp_path)
    _flip_byte(bundle / "payloads" / "log_probs.pt")
    proc = run("validate", bundle)
    lines = assert_clean_failure(proc)
    assert len(lines) == 1
    assert "payload 'log_probs': sha256 mismatch" in lines[0]
    assert proc.stdout == f"{bundle}: INVALID\n"


def test_validate_nan_payload_exits_2_naming_it_and_inspect_still_works(tmp_path: Path) -> None:
    contents = make_contents()
    contents.payloads["ref_log_probs"][0] = math.nan
    bundle = write_bundle(tmp_path / "b", contents)
    lines = assert_clean_failure(run("validate", bundle))
    assert lines == [
        f"trajstore: invalid: {bundle}: payload 'ref_log_probs': 1 non-finite value(s) (NaN/Inf), "
        "first at flat index 0"
    ]
    assert run("inspect", bundle).returncode == 0


def test_validate_capture_dir_with_one_bad_bundle_exits_2(tmp_path: Path) -> None:
    capture = copy_fixture("example_capture_dir", tmp_path)
    _flip_byte(capture / "replay-rollout-120" / "payloads" / "kl.pt")
    proc = run("validate", capture)
    lines = assert_clean_failure(proc)
    assert len(lines) == 1 and "replay-rollout-120: payload 'kl': sha256 mismatch" in lines[0]
    assert proc.stdout.splitlines() == [
        f"{capture / 'replay-120-0'}: valid",
        f"{capture / 'replay-rollout-120'}: INVALID",
    ]


def test_validate_capture_dir_with_a_broken_bundle_dir_is_not_silently_valid(
    tmp_path: Path,
) -> None:
    capture = copy_fixture("example_capture_dir", tmp_path)
    (capture / "replay-121-0" / "payloads").mkdir(parents=True)  # no manifest, no rank-*/
    proc = run("validate", capture, "--json")
    assert_clean_failure(proc)
    reports = json.loads(proc.stdout)
    assert [(Path(r["path"]).name, r["valid"]) for r in reports] == [
        ("replay-120-0", True),
        ("replay-121-0", False),
        ("replay-rollout-120", True),
    ]


def _linked_capture(tmp_path: Path, *children: str) -> Path:
    """A capture directory whose `children` are links to the example capture's bundles."""
    source = copy_fixture("example_capture_dir", tmp_path / "source")
    capture = tmp_path / "linked"
    capture.mkdir()
    for child in children:
        (capture / child).symlink_to(source / child, target_is_directory=True)
    return capture


def _both_valid(capture: Path) -> list[str]:
    return [f"{capture / 'replay-120-0'}: valid", f"{capture / 'replay-rollout-120'}: valid"]


def test_a_capture_dir_of_linked_bundles_uses_them(tmp_path: Path) -> None:
    # a capture assembled from links to bundles elsewhere: each link was skipped without a
    # word (validate said nothing of it, ingest stored nothing), though a linked bundle
    # given directly was used
    capture = _linked_capture(tmp_path, "replay-120-0", "replay-rollout-120")
    proc = run("validate", capture)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == _both_valid(capture)


def test_ingest_of_a_capture_dir_of_linked_bundles_stores_them(tmp_path: Path) -> None:
    capture = _linked_capture(tmp_path, "replay-120-0")
    proc = run("ingest", capture, "--store", tmp_path / "store")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"published {capture / 'replay-120-0'}: ")


def test_a_dangling_bundle_link_in_a_capture_dir_is_reported(tmp_path: Path) -> None:
    capture = copy_fixture("example_capture_dir", tmp_path)
    (capture / "replay-121-0").symlink_to(tmp_path / "moved-away", target_is_directory=True)
    proc = run("validate", capture)
    lines = assert_clean_failure(proc)
    assert len(lines) == 1 and f"{capture / 'replay-121-0'}: " in lines[0]
    assert f"{capture / 'replay-121-0'}: INVALID" in proc.stdout.splitlines()


def test_other_links_in_a_capture_dir_are_not_entered(tmp_path: Path) -> None:
    # a link to / (or to a whole dataset) would be walked
    capture = copy_fixture("example_capture_dir", tmp_path)
    (capture / "everything").symlink_to("/", target_is_directory=True)
    (capture / "again").symlink_to(capture, target_is_directory=True)
    proc = run("validate", capture)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == _both_valid(capture)


def test_validate_unknown_major_exits_2(tmp_path: Path) -> None:
    bundle = copy_fixture("example_bundle", tmp_path)
    manifest = bundle / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"2.0.0"', '"3.0.0"'))
    lines = assert_clean_failure(run("validate", bundle))
    assert "unsupported format major 3" in lines[0]


def test_step_and_rollout_together_is_a_usage_error() -> None:
    proc = run("validate", CAPTURE_DIR, "--step", "120:0", "--rollout", "120")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "not allowed with argument" in proc.stderr


def test_malformed_step_is_a_usage_error() -> None:
    lines = assert_clean_failure(run("validate", CAPTURE_DIR, "--step", "120"))
    assert lines == [
        "trajstore: error: step id '120' is not ROLLOUT:STEP "
        "with non-negative integers (e.g. 120:0)"
    ]


def test_absent_step_exits_2_naming_it() -> None:
    lines = assert_clean_failure(run("inspect", CAPTURE_DIR, "--step", "999:0"))
    assert "no bundle for step 999:0" in lines[0]


@pytest.mark.parametrize("command", ["replay", "inspect", "validate"])
def test_a_bundle_of_another_step_than_the_one_asked_for_exits_2(command: str) -> None:
    step = CAPTURE_DIR / "replay-120-0"
    lines = assert_clean_failure(run(command, step, "--step", "121:0"))
    assert lines == [
        f"trajstore: error: {step} is the bundle of step 120:0, not step 121:0; drop "
        "--step/--rollout or give the capture directory that holds it"
    ]


def test_a_step_bundle_given_with_rollout_exits_2() -> None:
    lines = assert_clean_failure(run("replay", CAPTURE_DIR / "replay-120-0", "--rollout", "120"))
    assert "is the bundle of step 120:0, not rollout 120" in lines[0]


def test_a_bundle_given_with_its_own_step_is_replayed() -> None:
    step = CAPTURE_DIR / "replay-120-0"
    direct, selected = (
        run("replay", step, "--json"),
        run("replay", step, "--step", "120:0", "--json"),
    )
    assert selected.returncode == direct.returncode and selected.stdout == direct.stdout


def test_missing_path_exits_2(tmp_path: Path) -> None:
    lines = assert_clean_failure(run("validate", tmp_path / "nope"))
    assert "no such file or directory" in lines[0]
