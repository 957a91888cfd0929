"""`trajstore replay` end to end: text and JSON reports, exit codes, bad input.

Runs the real entry point (`trajstore.cli.main`) in-process; a couple of
tests start the installed console script to check what a user sees.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES
from trajstore.examples.replay_builders import Faults, consistent_contents, write_consistent

from trajstore.bundle.writer import write_bundle
from trajstore.cli import main

pytestmark = pytest.mark.integration

CAPTURE = FIXTURES / "example_capture_dir"
TRAJSTORE = Path(sys.executable).parent / "trajstore"
STAGE_KEYS = {
    "stage",
    "status",
    "reason",
    "requested",
    "max_abs_error",
    "mismatch_count",
    "divergences",
}


@pytest.fixture(autouse=True)
def _no_default_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests replay bundle directories;
    a TRAJSTORE_STORE in the environment must not apply."""
    monkeypatch.delenv("TRAJSTORE_STORE", raising=False)


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["replay", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    code, out, _ = run(capsys, *args, "--json")
    return code, json.loads(out)


def assert_one_line_error(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trajstore: error:"), err
    for n in needles:
        assert n in lines[0]


# --------------------------------------------------------------------------- fixtures


def test_example_bundle_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, FIXTURES / "example_bundle")
    assert code == 0
    assert "all requested stages pass" in out


def test_divergent_bundle_text_names_stage_and_three_tokens(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(capsys, FIXTURES / "example_bundle_divergent")
    assert code == 1
    assert "first divergent stage: advantage.estimate" in out
    for t in range(3):
        assert f"advantages s-0@{t}: expected=" in out
    assert "advantages s-0@3" not in out


def test_divergent_bundle_json_first_divergence(capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = run_json(capsys, FIXTURES / "example_bundle_divergent")
    assert code == 1
    assert doc["first_divergent_stage"] == "advantage.estimate"
    first = doc["first_divergence"]
    assert (first["sample_id"], first["token_offset"], first["mismatch_count"]) == ("s-0", 0, 3)


def test_capture_dir_step_replays_cohort(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, CAPTURE, "--step", "120:0")
    assert code == 0
    assert "rank 0" in out and "rank 1" in out
    assert "all requested stages pass on 2 rank(s)" in out


def test_capture_dir_rollout_replays(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, CAPTURE, "--rollout", "120")
    assert code == 0
    assert "all requested stages pass" in out


def test_capture_dir_without_selector_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, CAPTURE)
    assert code == 2
    assert_one_line_error(err, "--step R:S or --rollout R")


def test_capture_dir_unknown_step_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, CAPTURE, "--step", "121:0")
    assert code == 2
    assert_one_line_error(err, "no bundle for step 121:0")


def test_step_and_rollout_together_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(CAPTURE), "--step", "120:0", "--rollout", "120"])
    assert exc.value.code == 2
    assert "not allowed with" in capsys.readouterr().err


# --------------------------------------------------------------------------- reports


def test_streamed_fault_text_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = write_consistent(
        tmp_path / "b", interleave=True, faults=Faults(physical_batch_norm=12)
    )
    code, out, _ = run(capsys, path)
    assert code == 1
    assert "first divergent stage: reward.post_process" in out
    assert "[   fail] reward.post_process — normalized reward mismatch in" in out
    assert "          reward s-0: expected=" in out


def test_json_carries_every_stage_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = write_consistent(tmp_path / "b", faults=Faults(kl_type="k1"))
    code, doc = run_json(capsys, path)
    stages = doc["bundles"][0]["stages"]
    assert code == 1
    assert [s["stage"] for s in stages][:6] == [
        "sample",
        "reward.raw",
        "reward.post_process",
        "advantage.kl",
        "advantage.estimate",
        "loss.policy",
    ]
    assert all(set(s) >= STAGE_KEYS for s in stages)


def test_json_divergence_carries_location_and_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = write_consistent(tmp_path / "b", faults=Faults(kl_type="k1"))
    _, doc = run_json(capsys, path)
    kl = next(s for s in doc["bundles"][0]["stages"] if s["stage"] == "advantage.kl")
    d = kl["divergences"][0]
    assert (kl["status"], d["sample_id"], d["token_offset"], d["field"]) == ("fail", "s-0", 0, "kl")
    assert kl["max_abs_error"] > 0 and kl["mismatch_count"] > 0
    assert {"expected", "actual", "abs_err"} <= set(d)


def test_json_status_pass_on_consistent_bundle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = write_consistent(tmp_path / "b")
    code, doc = run_json(capsys, path)
    assert (code, doc["status"], doc["first_divergence"]) == (0, "pass", None)


def test_json_is_strict_when_values_are_not_finite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = write_consistent(tmp_path / "b", faults=Faults(nan_at=("log_probs", "s-4", 2)))
    code, out, _ = run(capsys, path, "--json")

    def refuse(name: str) -> None:
        raise AssertionError(f"non-standard JSON constant {name}")

    doc = json.loads(out, parse_constant=refuse)
    loss = next(s for s in doc["bundles"][0]["stages"] if s["stage"] == "loss.policy")
    assert (code, loss["status"]) == (1, "fail")


def test_partial_selection_text_shows_closure_and_skip(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = write_consistent(tmp_path / "b", groups=4, n=4)
    code, out, _ = run(capsys, path, "--sample", "s-5")
    assert code == 0
    assert "selection: 4 sample(s) (group closure added s-4, s-6, s-7)" in out
    assert (
        "[skipped] loss.policy — cohort-level stage is not replayable under a partial selection"
        in out
    )


def test_requested_stage_reported_with_inputs_marked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = write_consistent(tmp_path / "b", faults=Faults(kl_type="k1"))
    code, out, _ = run(capsys, path, "--stage", "advantage.estimate")
    assert code == 0
    assert "(input only)" in out
    assert "loss.policy" not in out


# --------------------------------------------------------------------------- exit codes


def test_loss_value_stage_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = write_consistent(tmp_path / "b")
    code, out, _ = run(capsys, path, "--stage", "loss.value")
    assert code == 1
    assert "[unsupported] loss.value" in out


def test_unsupported_requested_stage_exits_1_with_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = write_consistent(tmp_path / "b", cp=2)
    code, out, _ = run(capsys, path, "--stage", "loss.policy")
    assert code == 1
    assert "cp=2" in out


def test_unknown_stage_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = write_consistent(tmp_path / "b")
    code, _, err = run(capsys, path, "--stage", "advantage.bogus")
    assert code == 2
    assert_one_line_error(err, "unknown stage(s) advantage.bogus")


def test_a_stage_list_naming_no_stage_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = write_consistent(tmp_path / "b")
    code, _, err = run(capsys, path, "--stage", " , ")
    assert code == 2
    assert_one_line_error(err, "no stage named in ' , '; stages: all, ")


@pytest.mark.parametrize(
    "given",
    [
        ["--run", "r"],
        ["--attempt", "2"],
        ["--rollout-from", "3"],
        ["--no-link"],
        ["--workers", "4"],
    ],
)
def test_a_store_option_beside_a_directory_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], given: list[str]
) -> None:
    """A directory replay ignored them: --attempt 2 replayed the directory's own attempt."""
    path, _ = write_consistent(tmp_path / "b")
    code, out, err = run(capsys, path, *given)
    assert code == 2 and out == ""
    assert_one_line_error(err, f"{given[0]}: only with --store DIR")


@pytest.mark.parametrize("stage", ["reward.raw", "router.consistency"])
def test_a_named_stage_the_bundle_cannot_run_is_unsupported_not_a_pass(
    capsys: pytest.CaptureFixture[str], stage: str
) -> None:
    """A major-2 bundle has no reward stages and this one no producer route metrics: asked
    for by name, each was skipped and the replay said "all requested stages pass"."""
    code, out, _ = run(capsys, FIXTURES / "example_bundle", "--stage", stage)
    assert code == 1
    assert f"requested stage {stage} is unsupported" in out
    assert f"[unsupported] {stage} — not replayable on this bundle: " in out


@pytest.mark.parametrize(
    ("flag", "written", "error"),
    [
        ("--step", "１２０:0", "is not ROLLOUT:STEP"),
        ("--rollout", "１２０", "is not a non-negative integer"),
        ("--group", "g-０", "not of the form g-N"),
        ("--group", "g-0\n", "not of the form g-N"),
    ],
)
def test_an_id_in_other_digits_or_with_a_newline_exits_2(
    capsys: pytest.CaptureFixture[str], flag: str, written: str, error: str
) -> None:
    """\\d and $ let fullwidth digits and a final newline through: step 120:0, group 0."""
    target = CAPTURE if flag != "--group" else FIXTURES / "example_bundle"
    code, out, err = run(capsys, target, flag, written)
    assert code == 2 and out == ""
    assert_one_line_error(err, error)


def test_unknown_sample_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = write_consistent(tmp_path / "b")
    code, _, err = run(capsys, path, "--sample", "s-404")
    assert code == 2
    assert_one_line_error(err, "sample s-404 not found")


def test_unknown_group_exits_2_naming_the_groups_there_are(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = write_consistent(tmp_path / "b", groups=3)
    code, _, err = run(capsys, path, "--group", "g-77")
    assert code == 2
    assert_one_line_error(err, "group g-77 not found in bundle ", " (groups: g-0, g-1, g-2)")


def test_unknown_group_of_many_lists_the_first_and_the_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = write_consistent(tmp_path / "b", groups=12, n=2, micro_batch_size=2)
    code, _, err = run(capsys, path, "--group", "g-12", "--batch", "mb-0099")
    assert code == 2
    assert_one_line_error(
        err,
        "group g-12, micro-batch mb-0099 not found in bundle ",
        " (groups: g-0, g-1, g-2, g-3, g-4, g-5, g-6, g-7, ... (12 in all); micro-batches: "
        "mb-0000, mb-0001, mb-0002, mb-0003, mb-0004, mb-0005, mb-0006, mb-0007, ... (12 in all))",
    )


def test_unknown_group_of_a_cohort_names_the_groups_of_every_rank(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run(capsys, CAPTURE, "--step", "120:0", "--group", "g-9")
    assert code == 2
    assert_one_line_error(err, "group g-9 not found in ", " (groups: g-0, g-1)")


def test_malformed_group_id_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = write_consistent(tmp_path / "b")
    code, _, err = run(capsys, path, "--group", "group1")
    assert code == 2
    assert_one_line_error(err, "not of the form g-N")


def test_unknown_batch_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = write_consistent(tmp_path / "b")
    code, _, err = run(capsys, path, "--batch", "mb-9999")
    assert code == 2
    assert_one_line_error(err, "micro-batch mb-9999 not found")


def test_batch_without_micro_batch_ids_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = write_consistent(tmp_path / "b", micro_batch_size=None)
    code, _, err = run(capsys, path, "--batch", "mb-0000")
    assert code == 2
    assert_one_line_error(err, "no micro_batch_id")


def test_combined_selection_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = write_consistent(tmp_path / "b", groups=4, n=4, micro_batch_size=4)
    code, doc = run_json(capsys, path, "--sample", "s-0", "--group", "g-2", "--batch", "mb-0003")
    assert code == 0
    assert doc["bundles"][0]["selected_samples"] == 12


@pytest.mark.parametrize("step", ["120", "a:b", "-1:0", "1:2:3"])
def test_malformed_step_exits_2(capsys: pytest.CaptureFixture[str], step: str) -> None:
    code, _, err = run(capsys, CAPTURE, f"--step={step}")
    assert code == 2
    assert_one_line_error(err, "ROLLOUT:STEP")


def test_missing_target_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, tmp_path / "nope")
    assert code == 2
    assert_one_line_error(err, "no such file or directory")


def test_file_target_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "f.txt"
    f.write_text("x")
    code, _, err = run(capsys, f)
    assert code == 2
    assert_one_line_error(err)


def test_tampered_payload_exits_2_before_any_stage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = write_consistent(tmp_path / "b")
    pt = path / "payloads" / "advantages.pt"
    data = bytearray(pt.read_bytes())
    data[-40] ^= 0xFF
    pt.write_bytes(bytes(data))
    code, out, err = run(capsys, path)
    assert code == 2
    assert out == ""
    assert_one_line_error(err, "sha256 mismatch")


def test_incomplete_bundle_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = write_consistent(tmp_path / "b")
    (path / "COMPLETE").unlink()
    code, _, err = run(capsys, path)
    assert code == 2
    assert_one_line_error(err, "COMPLETE is missing")


@pytest.mark.parametrize(
    "where, value",
    [
        (("loss.policy", "loss"), "x"),
        (("reward.raw", "raw_rewards", 0), None),
        (("reward.post_process", "rewards", 0), [1, 2]),
    ],
    ids=["loss-str", "raw-null", "rewards-nested"],
)
def test_non_numeric_expectation_fails_stage_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: tuple, value: object
) -> None:
    built = consistent_contents()
    doc = built.contents.expected
    for k in where[:-1]:
        doc = doc[k]
    doc[where[-1]] = value
    path = write_bundle(tmp_path / "b", built.contents)
    code, out, _ = run(capsys, path)
    assert code == 1
    assert "not a number" in out


def test_console_script_reports_divergence_without_traceback(tmp_path: Path) -> None:
    path, _ = write_consistent(tmp_path / "b", faults=Faults(eps_clip_high=0.2))
    r = subprocess.run([str(TRAJSTORE), "replay", str(path)], capture_output=True, text=True)
    assert r.returncode == 1
    assert "first divergent stage: loss.policy" in r.stdout
    assert "Traceback" not in r.stderr


def test_module_spelling_refuses_bad_selection_without_traceback(tmp_path: Path) -> None:
    path, _ = write_consistent(tmp_path / "b")
    r = subprocess.run(
        [sys.executable, "-m", "trajstore", "replay", str(path), "--batch", "batch7"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert r.stderr.strip().startswith("trajstore: error:")
    assert "Traceback" not in r.stderr
