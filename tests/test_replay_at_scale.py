"""Replay-all over a 2,000-step store: divergence queries and resumption.

The store is generated from four templates (clean and faulty rollout bundles,
clean and faulty step bundles) cloned under 250 rollout ids x 8 steps; the
faulty rollouts normalized rewards over physical batches, and their steps
consumed those rewards, so only linkage to the rollout can root them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from inprocess_cli import cli as run_main
from trajstore.examples.replay_builders import Faults, consistent_contents

from trajstore.bundle.writer import BundleContents, write_bundle
from trajstore.store import Store

pytestmark = pytest.mark.integration

ROLLOUTS, STEPS = 250, 8
FAULTY = {17, 120, 201}


def _template(kind: str, faulty: bool, tmp: Path) -> BundleContents:
    built = consistent_contents(
        kind=kind,
        groups=2,
        n=4,
        lengths=[3, 5, 4, 6, 2, 7, 3, 4],
        rollout_id=0,
        step_id=0,
        faults=Faults(physical_batch_norm=3) if faulty else None,
        drop_expected=("reward.raw", "reward.post_process") if kind == "step" else (),
        bundle_id=f"{kind}-{'bad' if faulty else 'ok'}",
    )
    contents = built.contents
    if kind == "step":
        contents.stage_contracts = {
            k: v for k, v in contents.stage_contracts.items() if not k.startswith("reward.")
        }
    # serialize payloads once; clones write the same .pt bytes verbatim
    d = write_bundle(tmp / f"tmpl-{contents.bundle_id}", contents)
    contents.payloads = {n: (d / "payloads" / f"{n}.pt").read_bytes() for n in contents.payloads}
    return contents


def _clone(contents: BundleContents, dest: Path, rollout_id: int, step_id: int | None) -> None:
    identity = dict(contents.identity)
    if step_id is None:
        identity["rollout_id"] = rollout_id
    else:
        identity["actor_step_id"] = {"rollout_id": rollout_id, "step_id": step_id}
    write_bundle(dest, dataclasses.replace(contents, identity=identity))


@pytest.fixture(scope="module")
def big_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("scale")
    tmpl = {(k, f): _template(k, f, tmp) for k in ("rollout", "step") for f in (False, True)}
    cap = tmp / "capture"
    # The capture directory is this test's input, not under test: written without the
    # writer's fsyncs (11,000 of them, most of this fixture's time; the store is not
    # durable either), like a capture on a machine that never crashes.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fsync", lambda fd: None)
        for r in range(ROLLOUTS):
            bad = r in FAULTY
            _clone(tmpl["rollout", bad], cap / f"replay-rollout-{r}", r, None)
            for s in range(STEPS):
                _clone(tmpl["step", bad], cap / f"replay-{r}-{s}", r, s)
    root = tmp / "store"
    with Store.open(root, durable=False) as store:
        outcomes = store.ingest([cap], run="long")
    assert {o.status for o in outcomes} == {"published"}
    return root


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`trajstore ARGS` in this process (tests/inprocess_cli.py): the rerun and the query
    pin output and exit codes; the interrupted first run below is a real process."""
    return run_main(*args)


def _result_files(root: Path) -> list[Path]:
    return sorted((root / "results").glob("*.json"))


def test_replay_all_then_query_names_exactly_the_injected_rollouts(big_store: Path) -> None:
    # Interrupt a first replay-all once some results are recorded ...
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trajstore",
            "replay",
            "--store",
            str(big_store),
            "--all",
            "--record",
            "--workers",
            "2",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while (
        len(_result_files(big_store)) < 200 and proc.poll() is None and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    recorded_before = len(_result_files(big_store))
    assert 0 < recorded_before < ROLLOUTS * (STEPS + 1)

    # ... then rerun: it finishes without redoing what was recorded.
    again = run_cli(
        "replay", "--store", str(big_store), "--all", "--record", "--workers", "2", "--json"
    )
    assert again.returncode == 1, again.stderr
    summary = json.loads(again.stdout)
    assert summary["total"] == ROLLOUTS * (STEPS + 1)
    assert (
        summary["skipped_already_recorded"] >= recorded_before - 2
    )  # a bundle in flight may lack a rank doc
    keys = [json.loads(p.read_text())["bundle_key"] for p in _result_files(big_store)]
    assert len(keys) == len(set(keys)) == ROLLOUTS * (STEPS + 1)

    out = run_cli(
        "query",
        "steps",
        "--store",
        str(big_store),
        "--first-divergent-stage",
        "reward.post_process",
        "--format",
        "json",
    )
    rows = json.loads(out.stdout)
    assert {(r["rollout_id"], r["step_id"]) for r in rows} == {
        (r, s) for r in FAULTY for s in range(STEPS)
    }
    assert {r["root_bundle_key"] for r in rows} == {f"long/rollout-{r}/a1" for r in FAULTY}


def test_lookup_by_actor_step_id_in_a_large_store(big_store: Path) -> None:
    with Store.open(big_store, create=False) as store:
        (b,) = store.step("long", 249, 7)
    assert b.index.identity.anchor == "249:7"
