"""Rollout -> step linkage when the step's producer declared only `sample` and `loss.policy`.

The run: rollout 7 holds 8 prompts x 8 samples; step 7:0 consumed the first 4
prompts (samples s-0-*), step 7:1 the other 4 (s-1-*). The step bundles declare
no reward or advantage stage, yet each consumed advantages derived from the
rollout's rewards; replaying a stored step must check them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from trajstore.examples.replay_builders import Faults, consistent_contents

from trajstore.bundle.reader import open_target
from trajstore.bundle.writer import BundleContents, write_bundle
from trajstore.replay.from_store import Target, replay_linked, replay_stored
from trajstore.replay.runner import replay_sources
from trajstore.store import Store
from trajstore.vocab import StageStatus

pytestmark = pytest.mark.integration

RUN = "x"
ROLLOUT = 7
SEED = 3
#: the rollout sample whose raw reward is tampered (consumed by step 7:1)
TAMPERED = "s-1-5"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trajstore", *args], capture_output=True, text=True
    )


def _part(step_id: int, kind: str, faults: Faults | None = None) -> BundleContents:
    """The samples of step ``step_id`` (prompts 4*step_id .. +3), as a step or rollout part."""
    return consistent_contents(
        kind=kind,
        rollout_id=ROLLOUT,
        step_id=step_id,
        rank=step_id,
        world=1,
        seed=SEED,
        micro_batch_size=4 if kind == "step" else None,
        faults=faults,
        bundle_id=f"st-{ROLLOUT}-{step_id}" if kind == "step" else f"ro-{ROLLOUT}",
    ).contents


def step_contents(step_id: int, faults: Faults | None = None) -> BundleContents:
    """A step bundle whose producer declares only the `sample` and `loss.policy` stages."""
    c = _part(step_id, "step", faults)
    c.identity["rank"]["dp"] = 1
    c.stage_contracts = {
        k: v for k, v in c.stage_contracts.items() if k in ("sample", "loss.policy")
    }
    for stage in ("reward.raw", "reward.post_process"):
        c.expected.pop(stage)
    return c


def rollout_contents(tamper: bool = False) -> BundleContents:
    """The rollout bundle holding both steps' samples (no loss: a rollout trains nothing)."""
    parts = [_part(0, "rollout"), _part(1, "rollout")]
    ro = parts[0]
    ro.samples = [s for p in parts for s in p.samples]
    ro.payloads = {k: np.concatenate([p.payloads[k] for p in parts]) for k in ro.payloads}
    for stage, key in (("reward.raw", "raw_rewards"), ("reward.post_process", "rewards")):
        ro.expected[stage][key] = [v for p in parts for v in p.expected[stage][key]]
    ro.expected.pop("loss.policy")
    ro.stage_contracts.pop("loss.policy")
    ro.identity["semantic_group_ids"] = [g for p in parts for g in p.identity["semantic_group_ids"]]
    ro.identity["rank"]["dp"] = 1
    if tamper:
        # Someone changed one raw reward after the steps consumed the rollout's rewards.
        pos = next(i for i, s in enumerate(ro.samples) if s["sample_id"] == TAMPERED)
        ro.samples[pos]["raw_reward"] += 0.5
        ro.expected["reward.raw"]["raw_rewards"][pos] += 0.5
    return ro


def make_store(
    tmp_path: Path,
    *,
    rollout: BundleContents | None,
    steps: dict[int, BundleContents],
) -> Path:
    cap = tmp_path / "cap"
    if rollout is not None:
        write_bundle(cap / f"replay-rollout-{ROLLOUT}", rollout)
    for step_id, contents in steps.items():
        write_bundle(cap / f"replay-{ROLLOUT}-{step_id}", contents)
    root = tmp_path / "store"
    with Store.open(root) as store:
        store.ingest([cap], run=RUN)
    return root


def replay_json(root: Path, step: str) -> tuple[int, dict[str, Any]]:
    out = run_cli("replay", "--store", str(root), "--run", RUN, "--step", step, "--json")
    assert out.returncode in (0, 1), out.stderr
    return out.returncode, json.loads(out.stdout)


def steps_diverged_at(root: Path, stage: str) -> list[tuple[int, int, str | None]]:
    out = run_cli(
        "query", "steps", "--store", str(root), "--first-divergent-stage", stage, "--format", "json"
    )
    assert out.returncode == 0, out.stderr
    return [(r["rollout_id"], r["step_id"], r["root_bundle_key"]) for r in json.loads(out.stdout)]


@pytest.fixture
def consistent_store(tmp_path: Path) -> Path:
    return make_store(
        tmp_path, rollout=rollout_contents(), steps={0: step_contents(0), 1: step_contents(1)}
    )


@pytest.fixture
def tampered_store(tmp_path: Path) -> Path:
    return make_store(
        tmp_path,
        rollout=rollout_contents(tamper=True),
        steps={0: step_contents(0), 1: step_contents(1)},
    )


def test_consistent_step_passes_and_says_the_linkage_check_ran(consistent_store: Path) -> None:
    code, report = replay_json(consistent_store, f"{ROLLOUT}:1")
    assert (code, report["status"]) == (0, "pass")
    link = report["linkage"]
    assert (link["status"], link["samples_checked"], link["rollout_bundle_key"]) == (
        "pass",
        32,
        f"{RUN}/rollout-{ROLLOUT}/a1",
    )
    stage = next(s for s in report["bundles"][0]["stages"] if s["stage"] == "advantage.estimate")
    assert (stage["status"], stage["mismatch_count"]) == ("pass", 0)
    assert stage["reason"].startswith("rollout linkage:")


def test_consistent_step_text_report_names_the_rollout_bundle(consistent_store: Path) -> None:
    out = run_cli(
        "replay", "--store", str(consistent_store), "--run", RUN, "--step", f"{ROLLOUT}:0"
    )
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("rollout linkage:"))
    assert line.startswith("rollout linkage: pass — ")
    assert f"rollout bundle ro-{ROLLOUT} ({RUN}/rollout-{ROLLOUT}/a1)" in line


def test_tampered_rollout_is_the_root_of_the_step_that_consumed_it(tampered_store: Path) -> None:
    code, report = replay_json(tampered_store, f"{ROLLOUT}:1")
    assert (code, report["status"]) == (1, "diverged")
    assert report["first_divergent_stage"] == "reward.post_process"
    assert report["root_bundle_key"] == f"{RUN}/rollout-{ROLLOUT}/a1"
    first = report["first_divergence"]
    assert (first["stage"], first["bundle_key"], first["downstream_stage"]) == (
        "reward.post_process",
        f"{RUN}/rollout-{ROLLOUT}/a1",
        "advantage.estimate",
    )
    link = report["linkage"]
    assert (link["status"], link["rollout_bundle_id"], link["rollout_first_divergent_stage"]) == (
        "fail",
        f"ro-{ROLLOUT}",
        "reward.post_process",
    )
    # Only the tampered sample's prompt (g-4: s-1-0 .. s-1-7) changes after normalization.
    stage = next(s for s in report["bundles"][0]["stages"] if s["stage"] == "advantage.estimate")
    assert stage["divergences"]
    assert {d["sample_id"] for d in stage["divergences"]} <= {f"s-1-{i}" for i in range(8)}


def test_tampered_rollout_text_report_names_the_rollout_bundle(tampered_store: Path) -> None:
    out = run_cli("replay", "--store", str(tampered_store), "--run", RUN, "--step", f"{ROLLOUT}:1")
    assert out.returncode == 1
    assert (
        f"first divergent stage: reward.post_process in upstream bundle {RUN}/rollout-{ROLLOUT}/a1"
        in out.stdout
    )
    assert "rollout linkage: fail — " in out.stdout


def test_step_that_consumed_none_of_the_tampered_samples_passes(tampered_store: Path) -> None:
    code, report = replay_json(tampered_store, f"{ROLLOUT}:0")
    assert (code, report["linkage"]["status"], report["root_bundle_key"]) == (0, "pass", None)


def test_query_lists_the_steps_rooted_in_the_tampered_rollout(tampered_store: Path) -> None:
    out = run_cli("replay", "--store", str(tampered_store), "--all", "--record")
    assert out.returncode == 1, out.stderr
    assert steps_diverged_at(tampered_store, "reward.post_process") == [
        (ROLLOUT, 1, f"{RUN}/rollout-{ROLLOUT}/a1")
    ]


def test_rollout_not_stored_reports_the_check_as_skipped(tmp_path: Path) -> None:
    root = make_store(tmp_path, rollout=None, steps={1: step_contents(1)})
    code, report = replay_json(root, f"{ROLLOUT}:1")
    assert code == 0
    link = report["linkage"]
    assert (link["status"], link["samples_checked"]) == ("skipped", 0)
    assert f"rollout {ROLLOUT} of run {RUN} is not in the store" in link["reason"]
    out = run_cli("replay", "--store", str(root), "--run", RUN, "--step", f"{ROLLOUT}:1")
    assert (
        f"rollout linkage: skipped — rollout {ROLLOUT} of run {RUN} is not in the store"
        in out.stdout
    )


def test_step_advantages_off_a_clean_rollout_are_the_steps_own_fault(tmp_path: Path) -> None:
    # The step's producer normalized each physical batch of 12 samples, not each prompt.
    faulty = step_contents(1, Faults(physical_batch_norm=12))
    root = make_store(tmp_path, rollout=rollout_contents(), steps={1: faulty})
    code, report = replay_json(root, f"{ROLLOUT}:1")
    assert (code, report["first_divergent_stage"], report["root_bundle_key"]) == (
        1,
        "advantage.estimate",
        None,
    )
    assert report["linkage"]["status"] == "fail"
    assert report["linkage"]["rollout_first_divergent_stage"] is None


def test_no_link_reports_the_check_as_skipped(consistent_store: Path) -> None:
    out = run_cli(
        "replay",
        "--store",
        str(consistent_store),
        "--run",
        RUN,
        "--step",
        f"{ROLLOUT}:1",
        "--json",
        "--no-link",
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["linkage"]["status"] == "skipped"


def test_replay_linked_of_exported_directories_finds_the_same_root(tmp_path: Path) -> None:
    # The linked replay needs no store: the capture's own directories give the verdict the
    # stored step gives (the fault rooted in the rollout's rewards, the check failed).
    root = make_store(tmp_path, rollout=rollout_contents(tamper=True), steps={1: step_contents(1)})
    ro = open_target(tmp_path / "cap" / f"replay-rollout-{ROLLOUT}")
    step = open_target(tmp_path / "cap" / f"replay-{ROLLOUT}-1")
    ro_report = replay_sources(ro.bundles, label=ro.first.bundle_id)
    report = replay_linked(step.bundles, ro_report, label=step.first.bundle_id)
    with Store.open(root, create=False) as store:
        stored = replay_stored(store, Target(run=RUN, step=(ROLLOUT, 1)))
    got = [
        (r.linkage.status, r.linkage.mismatch_count, r.first_divergent_stage, r.root_stage)
        for r in (report, stored)
    ]
    assert got[0] == got[1]
    assert got[0][0] == StageStatus.FAIL and got[0][3] == "reward.post_process"
    assert report.linkage.rollout_bundle_id == f"ro-{ROLLOUT}"
