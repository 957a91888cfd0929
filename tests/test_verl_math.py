"""verl's driver math and policy losses, captured and replayed; verl's own code is the oracle.

A tiny seeded ``DataProto`` goes through verl's ``apply_kl_penalty`` and
``compute_advantage`` (``verl.trainer.ppo.ray_trainer``), then mini-batch by micro-batch
through ``core_algos.get_policy_loss_fn(mode)``, ``agg_loss`` and ``kl_penalty`` composed as
``verl.workers.utils.losses.ppo_loss`` composes them. What verl produced is captured with
``capture_batch`` and the micro-batch records, written as bundles, and replayed by
``trajstore.replay.verl_math`` (which never imports verl): every estimator, KL in reward of
every type (fixed and adaptive controller), every loss mode x aggregation mode, KL loss,
entropy, dual-clip and rollout IS weights pass; injected faults are named by stage, sample
and token.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import edit_json, read_json, resign_bundle
from trajstore.examples.replay_builders import replay, statuses

from trajstore.capture import CaptureManager
from trajstore.capture.config import CaptureConfig
from trajstore.cli import main as cli
from trajstore.integrations import verl as tv

try:
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.config import AlgoConfig, KLControlConfig
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.ray_trainer import apply_kl_penalty, compute_advantage
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
    from verl.workers.config import ActorConfig, PolicyLossConfig
except ImportError as exc:  # never under CI: make test installs trajstore[verl]
    if os.environ.get("CI"):
        raise
    pytest.skip(f"verl is not installed ({tv.INSTALL_HINT}): {exc}", allow_module_level=True)

B, P, R = 8, 3, 6  # samples, prompt width, response width
GROUP = 4  # samples per uid
MINI = 4  # rows per mini-batch (one optimizer step)
MICRO = 2  # rows per micro-batch


# --------------------------------------------------------------------------- verl's side


def make_batch(seed: int = 0) -> DataProto:
    """A padded driver batch as verl's rollout leaves it: left-padded prompts, right-padded
    responses, one masked (tool) token inside a response, a score on each last token."""
    g = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(1, P + 1, (B,), generator=g)
    response_lengths = torch.randint(2, R + 1, (B,), generator=g)
    prompt_attention = (torch.arange(P).unsqueeze(0) >= (P - prompt_lengths).unsqueeze(1)).long()
    response_attention = (torch.arange(R).unsqueeze(0) < response_lengths.unsqueeze(1)).long()
    response_mask = response_attention.clone()
    response_mask[1, 0] = 0  # an observation token the loss skips
    scores = torch.zeros(B, R)
    last = response_lengths - 1
    scores[torch.arange(B), last] = torch.rand(B, generator=g).round(decimals=2) * 2 - 0.5
    scores[3, last[3]] = 0.0  # a zero score (gpg counts the non-zero ones)
    old = -torch.rand(B, R, generator=g) * 2
    data = {
        "prompts": torch.randint(0, 50, (B, P), generator=g),
        "responses": torch.randint(0, 50, (B, R), generator=g),
        "attention_mask": torch.cat([prompt_attention, response_attention], dim=1),
        "response_mask": response_mask,
        "token_level_scores": scores,
        "old_log_probs": old,
        "ref_log_prob": old + torch.randn(B, R, generator=g) * 0.1,
        "rollout_log_probs": old + torch.randn(B, R, generator=g) * 0.05,
        "values": torch.randn(B, R, generator=g) * 0.5,
        "reward_baselines": torch.rand(B, generator=g) * 0.5,
    }
    uids = np.array([f"uid-{row // GROUP}" for row in range(B)], dtype=object)
    return DataProto.from_dict(tensors=data, non_tensors={"uid": uids})


def trainer_config(**over: Any) -> Any:
    """The trainer's whole config (the OmegaConf ``RayPPOTrainer`` holds), the parts read."""
    algorithm = {
        "adv_estimator": "grpo",
        "gamma": 0.95,
        "lam": 0.9,
        "norm_adv_by_std_in_grpo": True,
        "use_kl_in_reward": False,
        "kl_penalty": "kl",
        "kl_ctrl": {"type": "fixed", "kl_coef": 0.05, "horizon": 100, "target_kl": 0.01},
        "use_pf_ppo": False,
    }
    actor = {
        "strategy": "fsdp2",
        "rollout_n": GROUP,
        "ppo_mini_batch_size": MINI,
        "ppo_micro_batch_size_per_gpu": MICRO,
        "clip_ratio": 0.2,
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.28,
        "clip_ratio_c": 3.0,
        "loss_agg_mode": "token-mean",
        "entropy_coeff": 0.01,
        "use_kl_loss": True,
        "kl_loss_coef": 0.1,
        "kl_loss_type": "low_var_kl",
        "tau_pos": 1.0,
        "tau_neg": 1.05,
        "policy_loss": {"loss_mode": "vanilla", "kl_cov_ratio": 0.2, "dro_beta": 0.5},
    }
    for key, value in over.items():
        section, name = key.split("__", 1)
        target = algorithm if section == "algo" else actor
        if name == "loss_mode" or name in ("kl_cov_ratio", "dro_beta"):
            target["policy_loss"][name] = value
        else:
            target[name] = value
    return OmegaConf.create(
        {"algorithm": algorithm, "actor_rollout_ref": {"actor": actor, "rollout": {"n": GROUP}}}
    )


def run_driver(batch: DataProto, cfg: Any) -> tuple[DataProto, dict[str, float]]:
    """verl's driver math on the batch: KL in reward (or not), then the advantages."""
    algo = cfg.algorithm
    metrics: dict[str, float] = {}
    if algo.use_kl_in_reward:
        ctrl = core_algos.get_kl_controller(algo.kl_ctrl)
        if algo.kl_ctrl.type == "adaptive":  # a controller some steps in: value != kl_coef
            for _ in range(3):
                ctrl.update(current_kl=0.5, n_steps=B)
        batch, metrics = apply_kl_penalty(batch, ctrl, kl_penalty=algo.kl_penalty)
    else:
        batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
    config = AlgoConfig(
        gamma=algo.gamma,
        lam=algo.lam,
        adv_estimator=algo.adv_estimator,
        norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
        use_kl_in_reward=algo.use_kl_in_reward,
        kl_penalty=algo.kl_penalty,
        kl_ctrl=KLControlConfig(**algo.kl_ctrl),
    )
    batch = compute_advantage(
        batch,
        adv_estimator=algo.adv_estimator,
        gamma=algo.gamma,
        lam=algo.lam,
        num_repeat=GROUP,
        norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
        config=config,
    )
    return batch, metrics


def actor_config(cfg: Any) -> ActorConfig:
    fields = OmegaConf.to_container(cfg.actor_rollout_ref.actor, resolve=True)
    fields["policy_loss"] = PolicyLossConfig(**fields["policy_loss"])
    return ActorConfig(**fields)


def run_actor(batch: DataProto, cfg: Any, seed: int = 1) -> list[tv.MicroBatchRecord]:
    """verl's actor loss on every micro-batch of one ``update_actor`` (ppo_loss's terms)."""
    actor = actor_config(cfg)
    g = torch.Generator().manual_seed(seed)
    t = batch.batch
    fn = core_algos.get_policy_loss_fn(actor.policy_loss.loss_mode)
    records = []
    for step, start in enumerate(range(0, B, MINI)):
        mini = slice(start, start + MINI)
        info = {
            "dp_size": 1,
            "batch_num_tokens": t["response_mask"][mini].sum().item(),
            "global_batch_size": MINI,
            "loss_scale_factor": actor.loss_scale_factor,
        }
        for first in range(start, start + MINI, MICRO):
            rows = list(range(first, first + MICRO))
            mask = t["response_mask"][rows]
            old = t["old_log_probs"][rows]
            log_prob = old + torch.randn(old.shape, generator=g) * 0.3
            entropy = torch.rand(old.shape, generator=g) * 2
            weights = t["rollout_is_weights"][rows] if "rollout_is_weights" in t else None
            actor.global_batch_info.update(info)
            pg_loss, pg_metrics = fn(
                old_log_prob=old,
                log_prob=log_prob,
                advantages=t["advantages"][rows],
                response_mask=mask.bool(),
                loss_agg_mode=actor.loss_agg_mode,
                config=actor,
                rollout_is_weights=weights,
            )
            entropy_loss = core_algos.agg_loss(
                entropy, mask.bool(), actor.loss_agg_mode, **actor.global_batch_info
            )
            kld = core_algos.kl_penalty(log_prob, t["ref_log_prob"][rows], actor.kl_loss_type)
            kl_loss = core_algos.agg_loss(
                kld, mask.bool(), actor.loss_agg_mode, **actor.global_batch_info
            )
            loss = pg_loss - actor.entropy_coeff * entropy_loss + kl_loss * actor.kl_loss_coef
            records.append(
                tv.MicroBatchRecord(
                    rows=rows,
                    log_probs=log_prob,
                    old_log_probs=old,
                    advantages=t["advantages"][rows],
                    response_mask=mask,
                    loss=float(loss),
                    metrics={
                        "actor/pg_loss": pg_loss,
                        **pg_metrics,
                        "actor/entropy_loss": entropy_loss,
                        "kl_loss": kl_loss,
                    },
                    entropy=entropy,
                    ref_log_probs=t["ref_log_prob"][rows],
                    rollout_log_probs=t["rollout_log_probs"][rows],
                    rollout_is_weights=weights,
                    groups=[row // GROUP for row in rows],
                    optimizer_step=step,
                    **{k: v for k, v in info.items()},
                )
            )
    return records


# --------------------------------------------------------------------------- capture


def capture(tmp: Path, batch: DataProto, cfg: Any, metrics: dict, records: list) -> Path:
    """The rollout bundle and the step bundles of global step 1, written to ``tmp/cap``."""
    out = tmp / "cap"
    manager = CaptureManager(CaptureConfig(enabled=True, output_dir=out, run="verl"))
    tv.write_rollout(manager, tv.rollout_record(batch, cfg, step=1, metrics=metrics))
    tv.write_steps(manager, tv.step_records(records, cfg, step=1))
    stats = manager.close()
    assert stats.errors == 0 and stats.dropped == 0
    return out


def run_case(tmp: Path, seed: int = 0, **over: Any) -> tuple[Path, list]:
    cfg = trainer_config(**over)
    batch, metrics = run_driver(make_batch(seed), cfg)
    records = run_actor(batch, cfg)
    return capture(tmp, batch, cfg, metrics, records), records


def all_pass(path: Path) -> dict[str, str]:
    report = replay(path)
    for bundle in report.bundles:
        got = {s.stage: (s.status, s.reason) for s in bundle.stages}
        failing = {k: v for k, v in got.items() if v[0] in ("fail", "unsupported")}
        assert not failing, f"{bundle.bundle_id}: {failing}"
    return statuses(report)


# --------------------------------------------------------------------------- tests


ESTIMATORS = [
    "gae",
    "grpo",
    "grpo_passk",
    "rloo",
    "opo",
    "gpg",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
]


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_every_estimator_replays_verls_advantages(tmp_path, estimator):
    out, _ = run_case(tmp_path, algo__adv_estimator=estimator)
    rollout = out / "replay-rollout-1"
    got = statuses(replay(rollout))
    assert got["advantage.estimate"] == "pass", replay(rollout).bundles[0].stages
    assert got["advantage.kl"] == "pass"


def test_grpo_without_std_normalization_replays(tmp_path):
    out, _ = run_case(tmp_path, algo__norm_adv_by_std_in_grpo=False)
    assert statuses(replay(out / "replay-rollout-1"))["advantage.estimate"] == "pass"


@pytest.mark.parametrize("kind", ["kl", "abs", "mse", "low_var_kl", "k3+"])
@pytest.mark.parametrize("ctrl", ["fixed", "adaptive"])
def test_kl_in_reward_replays_with_the_applied_coefficient(tmp_path, kind, ctrl):
    out, _ = run_case(
        tmp_path,
        algo__use_kl_in_reward=True,
        algo__kl_penalty=kind,
        algo__kl_ctrl={"type": ctrl, "kl_coef": 0.05, "horizon": 100, "target_kl": 0.01},
    )
    report = replay(out / "replay-rollout-1")
    kl = next(s for s in report.bundles[0].stages if s.stage == "advantage.kl")
    assert kl.status == "pass", kl.reason
    config = read_json(out / "replay-rollout-1" / "index.json")["config"]["verl"]
    if ctrl == "adaptive":  # the value apply_kl_penalty used, not the configured start
        assert config["kl_coef_applied"] != pytest.approx(0.05)


MODES = ["vanilla", "gspo", "gpg", "kl_cov", "geo_mean", "sapo", "cispo", "dppo_tv", "dppo_kl"]
MODES += ["dro"]
AGGS = [
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
]


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("mode", MODES)
def test_every_loss_mode_and_aggregation_replays_verls_loss(tmp_path, mode, agg):
    out, records = run_case(tmp_path, actor__loss_mode=mode, actor__loss_agg_mode=agg)
    for step in (0, 1):
        path = out / f"replay-1-{step}"
        report = replay(path)
        stage = next(s for s in report.bundles[0].stages if s.stage == "loss.policy")
        assert stage.status == "pass", (stage.reason, stage.divergences[:3])
    # the recorded pg_loss is verl's own, to float32 round-off
    expected = read_json(out / "replay-1-0" / "expected.json")["loss.policy"]
    first = expected["micro_batches"]["mb-0000"]
    assert first["pg_loss"] == pytest.approx(float(records[0].metrics["actor/pg_loss"]), rel=1e-6)


def test_dual_clip_replays(tmp_path):
    """clip_ratio_c just above 1: verl's dual-clip bound binds on some negative advantages."""
    out, records = run_case(tmp_path, actor__clip_ratio_c=1.05)
    assert any(float(r.metrics["actor/pg_clipfrac_lower"]) > 0 for r in records)
    for step in (0, 1):
        assert statuses(replay(out / f"replay-1-{step}"))["loss.policy"] == "pass"


def test_clip_cov_is_unsupported_by_name(tmp_path):
    out, _ = run_case(tmp_path, actor__loss_mode="clip_cov")
    report = replay(out / "replay-1-0", "loss.policy")  # requested: unsupported, not skipped
    stage = next(s for s in report.bundles[0].stages if s.stage == "loss.policy")
    assert stage.status == "unsupported"
    assert "clip_cov" in stage.reason and "randperm" in stage.reason


def test_rollout_is_weights_are_recomputed(tmp_path):
    cfg = trainer_config()
    batch, metrics = run_driver(make_batch(), cfg)
    correction = {"rollout_is": "sequence", "rollout_is_threshold": 1.02}
    batch, _ = compute_rollout_correction_and_add_to_batch(batch, OmegaConf.create(correction))
    cfg.algorithm.rollout_correction = correction
    out = capture(tmp_path, batch, cfg, metrics, run_actor(batch, cfg))
    stage = next(
        s for s in replay(out / "replay-1-0").bundles[0].stages if s.stage == "loss.policy"
    )
    assert stage.status == "pass" and not stage.trusted, stage.reason
    # the weights are truncated somewhere: the threshold is exercised
    weights = batch.batch["rollout_is_weights"]
    assert (weights == 1.02).any() and ((weights < 1.02) & (weights > 0)).any()


# ---- faults: named by stage, sample and token ---------------------------------------


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("verl-clean")
    out, _ = run_case(
        tmp,
        algo__adv_estimator="grpo",
        algo__use_kl_in_reward=True,
        algo__kl_penalty="low_var_kl",
    )
    return out


def _tamper(src: Path, dest: Path, bundle: str, payload: str, sample: int, token: int) -> Path:
    """A copy of the capture with one token of one payload changed (and re-signed)."""
    import shutil

    shutil.copytree(src, dest)
    path = dest / bundle
    samples = read_json(path / "index.json")["samples"]
    offset = sum(s["response_length"] for s in samples[:sample]) + token
    file = path / "payloads" / f"{payload}.pt"
    values = torch.load(file, weights_only=True).clone()
    values[offset] = -values[offset] + 0.75
    torch.save(values, file)
    resign_bundle(path)
    return path


def _first(path: Path, stage: str) -> Any:
    report = replay(path)
    outcome = next(s for s in report.bundles[0].stages if s.stage == stage)
    assert outcome.status == "fail", outcome.reason
    return outcome.divergences[0]


def test_flipped_advantage_is_named_at_advantage_estimate(clean, tmp_path):
    path = _tamper(clean, tmp_path / "c", "replay-rollout-1", "advantages", 5, 1)
    d = _first(path, "advantage.estimate")
    assert (d.sample_id, d.field, d.token_offset) == ("s5", "advantages", 1)
    assert statuses(replay(path))["advantage.kl"] == "pass"


def test_flipped_score_is_named_at_advantage_kl(clean, tmp_path):
    samples = read_json(clean / "replay-rollout-1" / "index.json")["samples"]
    last = samples[2]["response_length"] - 1
    path = _tamper(clean, tmp_path / "c", "replay-rollout-1", "token_level_scores", 2, last)
    d = _first(path, "advantage.kl")
    assert (d.sample_id, d.field, d.token_offset) == ("s2", "token_level_rewards", last)


def test_flipped_reference_log_prob_is_named_at_advantage_kl(clean, tmp_path):
    path = _tamper(clean, tmp_path / "c", "replay-rollout-1", "ref_log_probs", 6, 0)
    d = _first(path, "advantage.kl")
    assert (d.sample_id, d.field, d.token_offset) == ("s6", "token_level_rewards", 0)


def test_flipped_reference_log_prob_in_a_step_fails_its_kl_loss(clean, tmp_path):
    path = _tamper(clean, tmp_path / "c", "replay-1-1", "ref_log_probs", 3, 0)
    report = replay(path)
    stage = next(s for s in report.bundles[0].stages if s.stage == "loss.policy")
    assert stage.status == "fail"
    fields = {d.field for d in stage.divergences}
    assert "mb-0001.kl_loss" in fields and "mb-0000.kl_loss" not in fields


def test_changed_clip_ratio_is_named_at_loss_policy(clean, tmp_path):
    import shutil

    shutil.copytree(clean, tmp_path / "c")
    path = tmp_path / "c" / "replay-1-0"

    def edit(index: dict) -> None:
        index["config"]["verl"]["clip_ratio_high"] = 0.01

    edit_json(path / "index.json", edit)
    resign_bundle(path)
    d = _first(path, "loss.policy")
    assert d.field.startswith("mb-") and d.field.endswith(("pg_loss", "loss", "pg_clipfrac"))


# ---- the public API and the CLI, end to end -----------------------------------------


def test_capture_batch_is_off_by_default(monkeypatch):
    for name in ("TRAJSTORE_CAPTURE", "TRAJSTORE_CAPTURE_DIR", "TRAJSTORE_CAPTURE_STORE"):
        monkeypatch.delenv(name, raising=False)
    tv.close()
    cfg = trainer_config()
    batch, _ = run_driver(make_batch(), cfg)
    assert tv.capture_batch(batch, cfg, step=1) is False
    tv.close()


def test_capture_batch_from_the_environment_validates_and_replays_through_the_cli(
    tmp_path, monkeypatch, capsys
):
    out = tmp_path / "cap"
    monkeypatch.setenv("TRAJSTORE_CAPTURE", "1")
    monkeypatch.setenv("TRAJSTORE_CAPTURE_DIR", str(out))
    monkeypatch.setenv("TRAJSTORE_RUN", "verl-run")
    tv.close()
    cfg = trainer_config(algo__use_kl_in_reward=True, algo__adv_estimator="gae")
    batch, metrics = run_driver(make_batch(3), cfg)
    records = run_actor(batch, cfg)
    assert tv.capture_batch(batch, cfg, step=7, metrics=metrics) is True
    assert tv.capture_micro_batches(records, cfg, step=7) == 2
    tv.close()
    names = sorted(p.name for p in out.iterdir())
    assert names == ["replay-7-0", "replay-7-1", "replay-rollout-7"]
    assert cli(["validate", str(out / "replay-rollout-7")]) == 0
    assert cli(["replay", str(out / "replay-rollout-7")]) == 0
    assert cli(["replay", str(out / "replay-7-1")]) == 0
    store = tmp_path / "store"
    assert cli(["ingest", str(out), "--store", str(store), "--run", "verl-run"]) == 0
    assert cli(["replay", "--store", str(store), "--run", "verl-run", "--step", "7:0"]) == 0
    capsys.readouterr()


def test_driver_batch_layout(tmp_path):
    """Padding removed per sample, groups from uid, the config's applied coefficient."""
    cfg = trainer_config(algo__use_kl_in_reward=True)
    batch, metrics = run_driver(make_batch(), cfg)
    batch.batch["routed_experts"] = torch.arange(B * (P + R) * 2 * 2).reshape(B, P + R, 2, 2)
    rec = tv.rollout_record(batch, cfg, step=1, metrics=metrics)
    attention = batch.batch["attention_mask"]
    assert [s["response_length"] for s in rec.samples] == attention[:, P:].sum(-1).tolist()
    assert [s["total_length"] for s in rec.samples] == attention.sum(-1).tolist()
    assert [s["group_index"] for s in rec.samples] == [row // GROUP for row in range(B)]
    assert rec.payloads["advantages"].shape == (int(attention[:, P:].sum()),)
    routes = rec.routes["rollout_routed_experts"]
    assert routes.shape == (int(attention.sum()), 2, 2)
    assert torch.equal(routes[0], batch.batch["routed_experts"][0][attention[0].bool()][0])
    verl = rec.recompute["verl"]
    assert verl["kl_coef_applied"] == pytest.approx(metrics["actor/reward_kl_penalty_coeff"])
    assert verl["clip_ratio_high"] == 0.28 and verl["loss_mode"] == "vanilla"
    assert copy.deepcopy(verl) == verl  # plain JSON values


def test_capture_is_complete_at_exit_without_importing_verl(tmp_path):
    """A v1-trainer-style mapping of fields, no close(): the interpreter's exit flushes the
    bundle, and neither verl nor Ray was imported to write it."""
    import subprocess
    import sys

    code = (
        "import sys, numpy as np, torch;"
        "from trajstore.integrations.verl import capture_batch;"
        "m = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]]);"
        "batch = {'responses': torch.zeros(2, 2, dtype=torch.long), 'attention_mask': m,"
        " 'response_mask': m[:, 2:], 'token_level_scores': torch.tensor([[0., 1.], [2., 0.]]),"
        " 'token_level_rewards': torch.tensor([[0., 1.], [2., 0.]]),"
        " 'old_log_probs': -torch.ones(2, 2), 'advantages': torch.ones(2, 2),"
        " 'returns': torch.ones(2, 2), 'uid': np.array(['a', 'a'], dtype=object)};"
        "cfg = {'algorithm': {'adv_estimator': 'grpo'}, 'actor_rollout_ref': {'actor': {}}};"
        "assert capture_batch(batch, cfg, step=3);"
        "assert 'verl' not in sys.modules and 'ray' not in sys.modules, 'imported a framework'"
    )
    env = {
        **os.environ,
        "TRAJSTORE_CAPTURE": "1",
        "TRAJSTORE_CAPTURE_DIR": str(tmp_path),
        "TRAJSTORE_RUN": "exit",
    }
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    bundle = tmp_path / "replay-rollout-3"
    assert (bundle / "COMPLETE").exists()
    samples = read_json(bundle / "index.json")["samples"]
    assert [s["response_length"] for s in samples] == [2, 1]
    assert [s["total_length"] for s in samples] == [3, 3]
    assert cli(["validate", str(bundle)]) == 0


def test_a_micro_batch_without_groups_is_refused_not_written(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAJSTORE_CAPTURE", "1")
    monkeypatch.setenv("TRAJSTORE_CAPTURE_DIR", str(tmp_path / "cap"))
    tv.close()
    cfg = trainer_config()
    batch, _ = run_driver(make_batch(), cfg)
    records = run_actor(batch, cfg)
    records[0].groups = None
    assert tv.capture_micro_batches(records, cfg, step=1) == 0
    assert tv.close().errors == 1
    assert not (tmp_path / "cap").exists() or not any((tmp_path / "cap").iterdir())


def test_a_set_loss_scale_factor_replaces_the_horizon(tmp_path):
    out, _ = run_case(
        tmp_path, actor__loss_agg_mode="seq-mean-token-sum-norm", actor__loss_scale_factor=7
    )
    recorded = read_json(out / "replay-1-0" / "expected.json")["loss.policy"]["micro_batches"]
    assert recorded["mb-0000"]["loss_scale_factor"] == 7
    assert statuses(replay(out / "replay-1-0"))["loss.policy"] == "pass"
