"""verl's real actor worker on the CPU, captured through ``capture_actor`` (issue 30).

The worker is verl 0.9.1's own ``ActorRolloutRefWorker`` (tests/verl_cpu.py), its loss
verl's ``ppo_loss``, the expectations verl's own logged metrics. One module-scoped pair of
runs (capture off, capture on; two ``update_actor`` calls each, two optimizer steps of two
micro-batches per call) is shared by the tests; the MoE pair (baseline, R3) likewise.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import read_json
from trajstore.examples.replay_builders import replay, statuses

import trajstore.integrations.verl as tv
from trajstore.cli import main as cli

pytestmark = pytest.mark.integration

try:
    import verl  # noqa: F401
except ImportError as exc:  # never under CI: make test installs trajstore[verl]
    if os.environ.get("CI"):
        raise
    pytest.skip(f"verl is not installed ({tv.INSTALL_HINT}): {exc}", allow_module_level=True)

import forked  # noqa: E402
import verl_cpu as h  # noqa: E402

from trajstore.integrations.verl.actor import STEP_KEY, RecordingLoss, capture_actor  # noqa: E402
from trajstore.integrations.verl.trainer import capturing  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS = (1, 2)
#: the rendezvous variables as the session had them: the harness must leave them so
RENDEZVOUS = {n: os.environ.get(n) for n in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}


def _capture_env(monkeypatch: pytest.MonkeyPatch, **env: str) -> None:
    """Capture configured from the environment, with a fresh process-wide manager."""
    tv.close()
    for name in ("TRAJSTORE_CAPTURE", "TRAJSTORE_CAPTURE_DIR", "TRAJSTORE_CAPTURE_STORE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TRAJSTORE_RUN", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def _train(worker: Any, cfg: Any, trainer_cls: type) -> list[dict]:
    """Two driver steps: verl's log-probs and advantages, then verl's own
    ``RayPPOTrainer._update_actor`` (``trainer_cls``: it, or its capturing subclass) on a
    trainer whose actor worker group is the in-process worker."""
    trainer = trainer_cls.__new__(trainer_cls)  # no Ray: only the fields _update_actor reads
    trainer.config, trainer.actor_rollout_wg = cfg, worker
    logged = []
    for step in STEPS:
        trainer.global_steps = step
        batch = h.prepare(h.make_batch(seed=step), worker, cfg)
        output = trainer._update_actor(batch)
        logged.append(output.meta_info["metrics"])
    return logged


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("verl-dense")
    cfg = h.trainer_config(h.save_tiny_model(root / "model"))
    try:
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer

        _capture_env(mp)
        off = h.build_worker(cfg)
        off_logged = _train(off, cfg, RayPPOTrainer)
        off_params = h.parameters(off)
        out = root / "capture"
        _capture_env(mp, TRAJSTORE_CAPTURE="1", TRAJSTORE_CAPTURE_DIR=str(out))
        on = h.build_worker(cfg)
        on_logged = _train(on, cfg, capturing(RayPPOTrainer))  # installs capture_actor
        loss = on.actor.loss_fn
        stats = tv.close()
        return {
            "cfg": cfg,
            "out": out,
            "off": (off_params, off_logged),
            "on": (h.parameters(on), on_logged),
            "loss": loss,
            "stats": stats,
        }
    finally:
        mp.undo()
        tv.close()


def test_capture_actor_is_off_by_default(dense, monkeypatch):
    _capture_env(monkeypatch)
    assert capture_actor(object()) is None  # nothing installed, nothing touched


def test_capture_leaves_parameters_bit_identical(dense):
    (off, off_logged), (on, on_logged) = dense["off"], dense["on"]
    assert isinstance(dense["loss"], RecordingLoss) and dense["stats"].errors == 0
    assert off.keys() == on.keys()
    assert all(torch.equal(off[name], on[name]) for name in off)
    assert [m["actor/pg_loss"] for m in off_logged] == [m["actor/pg_loss"] for m in on_logged]


def test_workers_leave_no_rendezvous_in_the_environment(dense):
    """Later subprocesses of the session (the demo's accelerate) would join this group."""
    assert {n: os.environ.get(n) for n in RENDEZVOUS} == RENDEZVOUS


def test_the_v1_trainer_gets_the_v1_mixin():
    """The default trainer of verl 0.9.1 (``trainer.use_v1``): its capturing subclass hooks
    ``_update_actor(batch, metrics)`` (its run needs TransferQueue's servers: not here)."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.v1 import get_trainer_cls

    from trajstore.integrations.verl.trainer import (
        PPOTrainerCaptureMixin,
        RayPPOTrainerCaptureMixin,
    )

    v1 = get_trainer_cls("sync")
    assert issubclass(capturing(v1), PPOTrainerCaptureMixin) and issubclass(capturing(v1), v1)
    assert issubclass(capturing(RayPPOTrainer), RayPPOTrainerCaptureMixin)
    made = capturing(v1)
    assert capturing(made) is made


def test_main_ppo_composes_verls_config_with_the_users_overrides(capsys, monkeypatch):
    """``python -m trajstore.integrations.verl.main_ppo`` takes verl's own Hydra overrides
    on verl's own config (``--cfg job`` prints it without training; a full run needs a
    rollout server, which the CPU has not)."""
    from trajstore.integrations.verl import main_ppo

    monkeypatch.setenv("TRAJSTORE_RUN", "grpo-tiny")
    main_ppo.main(["--cfg", "job", "algorithm.adv_estimator=rloo", "trainer.use_v1=false"])
    out = capsys.readouterr().out
    assert "adv_estimator: rloo" in out and "use_v1: false" in out
    with pytest.raises(SystemExit) as exc:
        main_ppo.main(["algorithm.no_such_key=1"])
    assert exc.value.code != 0
    assert main_ppo.capture_env({"TRAJSTORE_RUN": "r", "HOME": "/x"}) == {"TRAJSTORE_RUN": "r"}


def test_every_micro_batch_is_recorded(dense):
    out = dense["out"]
    names = sorted(p.name for p in out.iterdir())
    assert names == ["replay-1-0", "replay-1-1", "replay-2-0", "replay-2-1"] + [
        "replay-rollout-1",
        "replay-rollout-2",
    ]
    for step in STEPS:
        for k in (0, 1):  # mini-batch k: rows 4k..4k+3, two micro-batches of two (no shuffle)
            index = read_json(out / f"replay-{step}-{k}" / "index.json")
            rows = [s["sample_id"] for s in index["samples"]]
            assert rows == [f"s{r}" for r in range(4 * k, 4 * k + 4)]
            assert [s["micro_batch_id"] for s in index["samples"]] == ["mb-0000"] * 2 + [
                "mb-0001"
            ] * 2


def test_replayed_loss_is_verls_logged_pg_loss(dense):
    """Replay recomputes each micro-batch's loss from the stored payloads (loss.policy
    passes at float32 round-off); the stored per-step pg_loss is verl's logged one."""
    out, (_, logged) = dense["out"], dense["on"]
    for step, metrics in zip(STEPS, logged, strict=True):
        for k, pg_loss in enumerate(metrics["actor/pg_loss"]):
            path = out / f"replay-{step}-{k}"
            got = statuses(replay(path))
            assert got["loss.policy"] == "pass", replay(path).bundles[0].stages
            expected = read_json(path / "expected.json")["loss.policy"]
            assert expected["pg_loss"] == pytest.approx(float(pg_loss), rel=2**-22, abs=1e-7)
    assert cli(["replay", str(out / "replay-2-1")]) == 0


def test_step_bundles_link_to_the_driver_batch(dense):
    """Each step's samples are found in its rollout bundle (same ids), and their stored
    advantages are the driver's, so replay can follow reward -> advantage -> loss."""
    out = dense["out"]
    rollout = read_json(out / "replay-rollout-1" / "index.json")
    ids = {s["sample_id"] for s in rollout["samples"]}
    step = read_json(out / "replay-1-0" / "index.json")
    assert {s["sample_id"] for s in step["samples"]} <= ids
    assert step["config"]["verl"]["loss_mode"] == "vanilla"


# --------------------------------------------------------------------------- exit


EXIT_CODE = """
import sys, torch
import trajstore.integrations.verl as tv
records = torch.load(sys.argv[1], weights_only=False)
tv.capture_micro_batches(records, {"actor_rollout_ref": {"actor": {}}}, step=3)
# no close(): the exit hook must flush
"""


def test_capture_is_complete_on_disk_at_normal_exit(tmp_path):
    """A worker process that exits normally without ``close()``: its step bundles are
    published in the store (the records are a real worker's, saved by the parent)."""
    from trajstore.integrations.verl.records import MicroBatchRecord
    from trajstore.store.api import Store

    records = [
        MicroBatchRecord(
            rows=[2 * i, 2 * i + 1],
            log_probs=torch.full((2, 4), -1.0 - i),
            old_log_probs=torch.full((2, 4), -1.0),
            advantages=torch.tensor([[1.0] * 4, [-1.0] * 4]),
            response_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]),
            loss=0.0,
            groups=[i, i],
            optimizer_step=i,
        )
        for i in range(3)
    ]
    saved = tmp_path / "records.pt"
    torch.save(records, saved)
    store_dir = tmp_path / "store"
    Store.open(store_dir).close()
    env = {
        **os.environ,
        "TRAJSTORE_CAPTURE": "1",
        "TRAJSTORE_CAPTURE_STORE": str(store_dir),
        "TRAJSTORE_RUN": "verl-exit",
    }
    env.pop("TRAJSTORE_CAPTURE_DIR", None)
    r = subprocess.run(
        [sys.executable, "-c", EXIT_CODE, str(saved)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    with Store.open(store_dir) as store:
        steps = sorted((b["rollout_id"], b["step_id"]) for b in store.bundles(run="verl-exit"))
    assert steps == [(3, 0), (3, 1), (3, 2)], r.stderr[-2000:]


# --------------------------------------------------------------------------- two ranks


@pytest.fixture
def fork_server() -> Iterator[Any]:
    """multiprocessing's fork server, `h.RANK_PRELOAD` imported once for both ranks
    (tests/forked.py)."""
    with forked.fork_server(h.RANK_PRELOAD):
        yield multiprocessing.get_context("forkserver")


def test_two_data_parallel_ranks_write_one_cohort(tmp_path, fork_server):
    """Two processes, one verl worker each, fsdp2 over a two-rank gloo group: each writes
    its own shard of every step bundle and the cohort is published when both are in."""
    model = h.save_tiny_model(tmp_path / "model")
    out = tmp_path / "capture"
    env = {**os.environ, "TRAJSTORE_CAPTURE": "1", "TRAJSTORE_CAPTURE_DIR": str(out)}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(h._free_port()), WORLD_SIZE="2")
    for name in ("TRAJSTORE_CAPTURE_STORE", "TRAJSTORE_RUN"):
        env.pop(name, None)
    results = [tmp_path / f"rank-{rank}.json" for rank in (0, 1)]
    procs = [
        fork_server.Process(
            target=h.dp_rank,
            args=(
                str(model),
                str(results[rank]),
                {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                str(ROOT),
            ),
        )
        for rank in (0, 1)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    for p, result in zip(procs, results, strict=True):
        assert p.exitcode == 0  # its traceback is on stderr
        assert json.loads(result.read_text()) == {"written": 2, "errors": 0}
    for k in (0, 1):  # 4 rows a rank, 2 rows a rank per optimizer step
        cohort = out / f"replay-1-{k}"
        assert (cohort / "COMPLETE").exists()
        assert sorted(p.name for p in cohort.glob("rank-*")) == ["rank-0", "rank-1"]
        report = replay(cohort)
        assert len(report.bundles) == 2
        assert all(s["loss.policy"] == "pass" for s in map(_stages, report.bundles))


def _stages(bundle: Any) -> dict[str, str]:
    return {s.stage: s.status for s in bundle.stages}


# --------------------------------------------------------------------------- R3 on a MoE


def _rollout_routes(model_dir: Path, batch: Any) -> torch.Tensor:
    """The experts a bfloat16 copy of the initial policy (the rollout engine, one step
    stale at step 2) routes each token to: ``routed_experts`` [B, P+R, L, K] as verl's
    rollout returns them."""
    from transformers import AutoModelForCausalLM

    from trajstore.integrations.hf_moe import record_routes

    engine = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    with torch.no_grad(), record_routes(engine) as rec:
        engine(input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"])
    return rec.routes()


def _moe_run(root: Path, model_dir: Path, run: str, mp: pytest.MonkeyPatch) -> list[dict]:
    _capture_env(mp, TRAJSTORE_CAPTURE="1", TRAJSTORE_CAPTURE_STORE=str(root / "store"))
    mp.setenv("TRAJSTORE_RUN", run)
    cfg = h.trainer_config(model_dir)
    worker = h.build_worker(cfg)
    loss = capture_actor(worker, cfg, routes="record")
    logged = []
    for step in STEPS:
        batch = h.prepare(h.make_batch(seed=step), worker, cfg)
        batch.batch["routed_experts"] = _rollout_routes(model_dir, batch)
        tv.tag_batch(batch)
        batch.meta_info[STEP_KEY] = step
        if run.endswith("r3"):  # every forward's real tokens in order (no shuffle)
            real = batch.batch["attention_mask"].bool()
            with loss.forced_routes(batch.batch["routed_experts"][real].unsqueeze(0)):
                logged.append(h.update_actor(worker, batch, cfg))
        else:
            logged.append(h.update_actor(worker, batch, cfg))
        tv.capture_batch(batch, cfg, step=step)
    stats = tv.close()
    assert stats.errors == 0 and stats.ingested == 2 * len(STEPS) + len(STEPS), stats
    return logged


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("verl-moe")
    model_dir = h.save_tiny_model(root / "model", moe=True)
    from trajstore.store.api import Store

    Store.open(root / "store").close()
    try:
        for run in ("verl-baseline", "verl-r3"):
            _moe_run(root, model_dir, run, mp)
    finally:
        mp.undo()
        tv.close()
    return root / "store"


def test_r3_from_verls_rollout_routes_compares_to_zero_mismatch(moe, capsys):
    assert cli(["router", "compare", "--store", str(moe), "--run", "verl-baseline",
                "--run", "verl-r3", "--json"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    by_run: dict[str, list[float]] = {}
    for step in report["steps"]:
        for run, row in step["runs"].items():
            by_run.setdefault(run, []).append(row["route_mismatch_rate"])
    assert len(by_run["verl-baseline"]) == len(by_run["verl-r3"]) == 2 * len(STEPS)
    assert sum(by_run["verl-baseline"]) > 0
    assert by_run["verl-r3"] == [0] * len(by_run["verl-r3"])
    assert cli(["replay", "--store", str(moe), "--run", "verl-r3", "--all"]) == 0


def test_a_skipped_step_leaves_the_next_steps_routes_its_own(tmp_path, monkeypatch):
    """``TRAJSTORE_CAPTURE_STEPS=1:1,2:1``: optimizer step 0 of each verl step (two
    micro-batches with routes) is not captured, step 1 is. Each captured sample's stored
    rollout routes are the ``routed_experts`` rows this test fed verl for that sample, and
    each micro-batch holds the rows verl's loader gave it (no shuffle: step 1 is rows 4..7);
    a skipped step's routes must not be handed to the next step's micro-batches (they were,
    before 91f348b, whenever one flush held several optimizer steps: two update_actor calls
    here, so a flush per call would hold both steps of call 1)."""
    from trajstore.bundle.reader import open_target

    model_dir = h.save_tiny_model(tmp_path / "model", moe=True)
    out = tmp_path / "capture"
    _capture_env(
        monkeypatch,
        TRAJSTORE_CAPTURE="1",
        TRAJSTORE_CAPTURE_DIR=str(out),
        TRAJSTORE_CAPTURE_STEPS="1:1,2:1",
    )
    cfg = h.trainer_config(model_dir)
    worker = h.build_worker(cfg)
    capture_actor(worker, cfg, routes="record")
    fed, real = {}, {}
    for step in STEPS:
        batch = h.prepare(h.make_batch(seed=step), worker, cfg)
        rows, seq = batch.batch["attention_mask"].shape
        g = torch.Generator().manual_seed(step)  # per token and layer: 2 distinct experts of 8
        fed[step] = torch.rand(rows, seq, 2, 8, generator=g).argsort(-1)[..., :2].int()
        real[step] = batch.batch["attention_mask"].bool()
        batch.batch["routed_experts"] = fed[step].clone()
        tv.tag_batch(batch)
        batch.meta_info[STEP_KEY] = step
        h.update_actor(worker, batch, cfg)
    stats = tv.close()
    assert stats.errors == 0, stats
    for step in STEPS:
        (bundle,) = open_target(out / f"replay-{step}-1", verify_payloads=True).bundles
        samples = bundle.index.samples
        assert [(s.sample_id, s.micro_batch_id) for s in samples] == [
            ("s4", "mb-0000"), ("s5", "mb-0000"), ("s6", "mb-0001"), ("s7", "mb-0001"),
        ]  # fmt: skip
        stored = torch.from_numpy(bundle.payload("rollout_routed_experts").copy())
        offset = 0
        for s in samples:
            row = int(s.sample_id[1:])
            expected = fed[step][row][real[step][row]]  # fed for this sample's real tokens
            assert s.total_length == expected.shape[0], (step, s.sample_id)
            got = stored[offset : offset + s.total_length]
            assert torch.equal(got, expected), (step, s.sample_id)
            offset += s.total_length
        assert offset == stored.shape[0]
    assert sorted(p.name for p in out.iterdir()) == ["replay-1-1", "replay-2-1"]
