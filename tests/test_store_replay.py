"""Replay straight from the store, record results, query them, diff bundles."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES, copy_fixture, make_contents, resign_bundle
from inprocess_cli import cli as run_main
from trajstore.examples.replay_builders import Faults, consistent_contents, write_consistent

from trajstore.bundle.writer import write_bundle
from trajstore.replay.from_store import Target, replay_stored
from trajstore.store import Store

pytestmark = pytest.mark.integration


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`trajstore ARGS` in this process: what these tests pin is the output and the exit
    code, not the process around them (tests/inprocess_cli.py)."""
    return run_main(*args)


def _verdict(report: dict) -> list[tuple]:
    """What must match between store and directory replays (labels aside)."""
    return [
        (
            b["rank"],
            s["stage"],
            s["status"],
            s["mismatch_count"],
            [(d["sample_id"], d["token_offset"]) for d in s["divergences"]],
        )
        for b in report["bundles"]
        for s in b["stages"]
    ]


@pytest.fixture
def fixture_store(store_url: str) -> str:
    """The fixtures ingested into a fresh store on each backend (directory, s3://)."""
    with Store.open(store_url) as store:
        store.ingest([FIXTURES / "example_capture_dir"], run="r1")
        store.ingest([FIXTURES / "example_bundle_divergent"], run="r2")
    return store_url


@pytest.mark.parametrize(
    ("directory", "selector", "run"),
    [
        ("example_capture_dir", ["--step", "120:0"], "r1"),
        ("example_capture_dir", ["--rollout", "120"], "r1"),
        ("example_bundle_divergent", ["--step", "120:0"], "r2"),
    ],
)
def test_store_replay_gives_the_directory_report(
    fixture_store: str, directory: str, selector: list[str], run: str
) -> None:
    dir_args = [str(FIXTURES / directory)] + (
        selector if directory == "example_capture_dir" else []
    )
    from_dir = run_cli("replay", *dir_args, "--json")
    from_store = run_cli(
        "replay", "--store", str(fixture_store), "--run", run, *selector, "--json", "--no-link"
    )
    assert from_dir.returncode == from_store.returncode
    assert _verdict(json.loads(from_dir.stdout)) == _verdict(json.loads(from_store.stdout))


def test_recorded_results_are_queryable_by_first_divergent_stage(fixture_store: str) -> None:
    assert run_cli("replay", "--store", str(fixture_store), "--all", "--record").returncode == 1
    out = run_cli(
        "query",
        "steps",
        "--store",
        str(fixture_store),
        "--first-divergent-stage",
        "advantage.estimate",
        "--format",
        "json",
    )
    rows = json.loads(out.stdout)
    assert [(r["run"], r["rollout_id"], r["step_id"]) for r in rows] == [("r2", 120, 0)]


def test_replay_all_resumes_without_redoing_recorded_work(fixture_store: str) -> None:
    run_cli("replay", "--store", str(fixture_store), "--all", "--record")
    again = run_cli("replay", "--store", str(fixture_store), "--all", "--record", "--json")
    summary = json.loads(again.stdout)
    assert summary["skipped_already_recorded"] == summary["total"] == 3


def test_replay_all_of_an_unknown_run_exits_2_naming_the_runs(fixture_store: str) -> None:
    out = run_cli("replay", "--store", str(fixture_store), "--run", "ex-typo", "--all")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("trajstore: error: run 'ex-typo' is not in the store (runs: ")


def test_replay_of_a_step_of_an_unknown_run_names_the_runs(fixture_store: str) -> None:
    out = run_cli("replay", "--store", str(fixture_store), "--run", "r-typo", "--step", "120:0")
    assert out.returncode == 2
    assert out.stderr.strip() == "trajstore: error: run 'r-typo' is not in the store (runs: r1, r2)"
    missing = run_cli("replay", "--store", str(fixture_store), "--run", "r1", "--step", "9:0")
    assert missing.stderr.strip() == "trajstore: error: run 'r1' has no step 9:0"


def test_replay_of_a_reversed_rollout_range_exits_2(fixture_store: str) -> None:
    out = run_cli(
        "replay", "--store", str(fixture_store), "--rollout-from", "121", "--rollout-to", "120"
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == "trajstore: error: --rollout-from 121 is after --rollout-to 120"


def test_replay_of_a_rollout_range_holding_no_bundle_exits_2(fixture_store: str) -> None:
    """A range past the run's rollouts selects nothing: "replayed 0 of 0" was exit 0."""
    out = run_cli("replay", "--store", str(fixture_store), "--run", "r1", "--rollout-from", "500")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == (
        "trajstore: error: no bundle of run 'r1' in rollouts 500.. (it holds rollouts 120..120)"
    )


def test_replay_of_a_step_with_a_rollout_range_exits_2(fixture_store: str) -> None:
    """--step beside --rollout-to was dropped: the range was replayed and its exit code
    answered for steps the user did not ask about."""
    out = run_cli(
        "replay", "--store", str(fixture_store), "--run", "r1", "--step", "120:0", "--rollout-to",
        "119",
    )  # fmt: skip
    assert out.returncode == 2 and out.stdout == ""
    assert "no --step/--rollout/--bundle/--attempt" in out.stderr


@pytest.mark.parametrize(
    ("given", "error"),
    [
        (["--run", "r2"], "bundle 'r1/step-120-0/rank-0/a1' is of run 'r1', not of run 'r2': "),
        (["--attempt", "2"], "bundle 'r1/step-120-0/rank-0/a1' is attempt 1, not attempt 2: "),
    ],
)
def test_replay_of_a_bundle_key_refuses_a_run_or_attempt_it_contradicts(
    fixture_store: str, given: list[str], error: str
) -> None:
    key = "r1/step-120-0/rank-0/a1"
    out = run_cli("replay", "--store", str(fixture_store), "--bundle", key, *given)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith(f"trajstore: error: {error}")
    agreed = run_cli("replay", "--store", str(fixture_store), "--bundle", key, "--run", "r1")
    assert agreed.returncode == 0, agreed.stderr


@pytest.mark.parametrize(
    ("given", "error"),
    [
        (["--step", "120:0", "--workers", "4"], "--workers: only with --all"),
        (["--step", "120:0", "--force"], "--force: only with --all"),
        (["--all", "--no-link"], "no --no-link"),
        (["--all", "--force"], "--force redoes recorded bundles: only with --all --record"),
    ],
)
def test_a_replay_option_this_replay_would_ignore_exits_2(
    fixture_store: str, given: list[str], error: str
) -> None:
    out = run_cli("replay", "--store", str(fixture_store), "--run", "r1", *given)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("trajstore: error: ") and error in out.stderr


def test_divergences_query_names_sample_and_token(fixture_store: str) -> None:
    run_cli("replay", "--store", str(fixture_store), "--all", "--record")
    out = run_cli(
        "query",
        "divergences",
        "--store",
        str(fixture_store),
        "--stage",
        "advantage.estimate",
        "--format",
        "json",
    )
    rows = json.loads(out.stdout)
    assert {(r["sample_id"], r["token_offset"]) for r in rows} == {
        ("s-0", 0),
        ("s-0", 1),
        ("s-0", 2),
    }


def test_rollout_fault_is_rooted_in_the_rollout_bundle(tmp_path: Path) -> None:
    faulty = Faults(physical_batch_norm=12)
    write_consistent(
        tmp_path / "cap" / "replay-rollout-7",
        kind="rollout",
        rollout_id=7,
        faults=faulty,
        bundle_id="ro-7",
    )
    # The step consumed the faulty rewards; on its own it is self-consistent (no reward stages).
    step = consistent_contents(
        kind="step",
        rollout_id=7,
        step_id=0,
        faults=faulty,
        drop_expected=("reward.raw", "reward.post_process"),
        bundle_id="st-7-0",
    ).contents
    for stage in ("reward.raw", "reward.post_process"):
        step.stage_contracts.pop(stage)
    write_bundle(tmp_path / "cap" / "replay-7-0", step)
    assert run_cli("replay", str(tmp_path / "cap"), "--step", "7:0").returncode == 0
    with Store.open(tmp_path / "s") as store:
        store.ingest([tmp_path / "cap"], run="x")
        report = replay_stored(store, Target(run="x", step=(7, 0)))
    assert report.first_divergent_stage == "reward.post_process"
    assert report.root_bundle_key == "x/rollout-7/a1"
    assert report.first.first_divergent_stage == "advantage.estimate"


def test_diff_of_two_attempts_names_the_changed_token(tmp_path: Path) -> None:
    b = copy_fixture("example_bundle", tmp_path)
    with Store.open(tmp_path / "s") as store:
        store.ingest([b], run="r")
        import torch

        lp = torch.load(b / "payloads" / "log_probs.pt", weights_only=True)
        lp[5] += 0.5  # s-2's first token
        (b / "payloads" / "log_probs.pt").chmod(0o644)
        torch.save(lp, b / "payloads" / "log_probs.pt")
        resign_bundle(b)
        store.ingest([b], run="r")
        assert store.attempts("r", "step", 120, 0) == [1, 2]
    out = run_cli("diff", "--store", str(tmp_path / "s"), "r/120:0@1", "r/120:0@2", "--json")
    assert out.returncode == 1
    first = json.loads(out.stdout)["first_payload_difference"]
    assert (first["what"], first["sample_id"], first["token_offset"]) == ("log_probs", "s-2", 0)
    assert np.isclose(first["b"] - first["a"], 0.5)


CHANGED_SAMPLE, CHANGED_OFFSET = "s-2", 1  # lengths 3, 4, 5, 2: s-2 starts at token 7


def _two_bundles_one_token_apart(root: Path) -> tuple[Path, Path, float, float]:
    """Bundles a and b written by the bundle writer from the same contents, except
    that b's log_probs differ at one token: (a, b, a's value, b's value) there."""
    contents = make_contents(lengths=[3, 4, 5, 2], seed=3)
    a = write_bundle(root / "a" / "replay-7-0", contents)
    log_probs = contents.payloads["log_probs"].clone()
    at = 3 + 4 + CHANGED_OFFSET
    log_probs[at] -= 0.25
    b = write_bundle(
        root / "b" / "replay-7-0",
        dataclasses.replace(contents, payloads={**contents.payloads, "log_probs": log_probs}),
    )
    return a, b, float(contents.payloads["log_probs"][at]), float(log_probs[at])


def _only_difference(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    assert not report["same"] and len(report["differences"]) == 1, report["differences"]
    assert report["first_payload_difference"] in (None, report["differences"][0])
    return report["differences"][0]


def test_diff_names_the_one_changed_token_and_nothing_else(tmp_path: Path) -> None:
    a, b, va, vb = _two_bundles_one_token_apart(tmp_path)
    assert all(run_cli("validate", str(x)).returncode == 0 for x in (a, b))  # both pass the gate
    only = _only_difference(run_cli("diff", str(a), str(b), "--json"))
    assert only == {
        "kind": "payload",
        "what": "log_probs",
        "detail": "values differ",
        "sample_id": CHANGED_SAMPLE,
        "token_offset": CHANGED_OFFSET,
        "a": va,
        "b": vb,
    }


def test_diff_of_two_stored_bundles_names_the_one_changed_token(tmp_path: Path) -> None:
    a, b, va, vb = _two_bundles_one_token_apart(tmp_path)
    with Store.open(tmp_path / "s") as store:
        store.ingest([a.parent], run="a")
        store.ingest([b.parent], run="b")
    only = _only_difference(
        run_cli("diff", "--store", str(tmp_path / "s"), "a/7:0", "b/7:0", "--json")
    )
    assert (only["what"], only["sample_id"], only["token_offset"], only["a"], only["b"]) == (
        "log_probs",
        CHANGED_SAMPLE,
        CHANGED_OFFSET,
        va,
        vb,
    )


def test_diff_of_a_directory_and_the_stored_divergent_twin(fixture_store: str) -> None:
    # the fixtures differ in one recorded value: sample s-0's reward
    out = run_cli(
        "diff",
        str(FIXTURES / "example_bundle"),
        "--store",
        str(fixture_store),
        "r2/120:0",
        "--json",
    )
    only = _only_difference(out)
    assert (only["kind"], only["what"], only["sample_id"]) == ("samples", "reward", "s-0")


def test_diff_of_two_bundles_written_alike_exits_0(tmp_path: Path) -> None:
    contents = make_contents(lengths=[3, 4, 5, 2], seed=3)
    a = write_bundle(tmp_path / "a" / "replay-7-0", contents)
    b = write_bundle(tmp_path / "b" / "replay-7-0", contents)
    same = run_cli("diff", str(a), str(b), "--json")
    assert same.returncode == 0, same.stderr
    assert json.loads(same.stdout)["differences"] == []


def test_diff_of_two_sample_sets_says_how_many_it_did_not_list(tmp_path: Path) -> None:
    a = write_bundle(tmp_path / "a" / "replay-7-0", make_contents(groups=4, samples_per_group=4))
    # rank 1's samples are s-1-<i>: none shared with a's
    b = write_bundle(
        tmp_path / "b" / "replay-7-0", make_contents(groups=4, samples_per_group=4, rank=1)
    )
    out = run_cli("diff", str(a), str(b), "--json")
    assert out.returncode == 1, out.stderr
    (sample_set,) = [d for d in json.loads(out.stdout)["differences"] if d["what"] == "sample set"]
    assert sample_set["detail"].count("and 6 more") == 2  # 16 samples each side, 10 listed


def test_sql_refuses_a_write_statement(fixture_store: str) -> None:
    out = run_cli("sql", "--store", str(fixture_store), "DELETE FROM bundles")
    assert out.returncode == 2
    assert "read-only" in out.stderr
    ok = run_cli(
        "sql",
        "--store",
        str(fixture_store),
        "SELECT count(*) AS n FROM bundles",
        "--format",
        "json",
    )
    assert json.loads(ok.stdout) == [{"n": 4}]


def test_replay_all_records_a_refused_bundle_as_refused(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with Store.open(root) as store:
        store.ingest([FIXTURES / "example_bundle"], run="r")
        (b,) = store.step("r", 120, 0)
        victim = store.objs.get(b.ref["payloads"]["log_probs"]["record"])
    pack = max((root / "packs").glob("*.pack"), key=lambda p: p.stat().st_size)
    data = bytearray(pack.read_bytes())
    at = data.find(victim)
    assert at >= 0
    data[at + len(victim) // 2] ^= 0xFF  # corrupt an object replay reads (a payload's record)
    pack.write_bytes(bytes(data))
    out = run_cli("replay", "--store", str(root), "--all", "--record", "--json")
    assert out.returncode == 2
    assert json.loads(out.stdout)["refused"] == 1
    rows = json.loads(
        run_cli(
            "query", "steps", "--store", str(root), "--status", "refused", "--format", "json"
        ).stdout
    )
    assert [(r["rollout_id"], r["step_id"], r["status"]) for r in rows] == [(120, 0, "refused")]


def test_diff_summary_of_a_payload_on_one_side_says_so(tmp_path: Path) -> None:
    # it printed "first differing payload: entropy at None@None: a=None b=None"
    contents = make_contents(lengths=[3, 4, 5, 2], seed=3)
    a = write_bundle(tmp_path / "a" / "replay-7-0", contents)
    without = {k: v for k, v in contents.payloads.items() if k != "entropy"}
    b = write_bundle(tmp_path / "b" / "replay-7-0", dataclasses.replace(contents, payloads=without))
    out = run_cli("diff", str(a), str(b))
    assert out.returncode == 1, out.stderr
    assert out.stdout.splitlines()[-1] == (
        "first differing payload: entropy: present on one side only (a)"
    )
