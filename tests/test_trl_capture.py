"""Real TRL GRPO training on the CPU, captured and replayed: every loss type, reward scaling,
sequence-level importance sampling, the IS-correction modes, MoE aux loss; injected faults
found at the right stage, sample and token; capture on vs off bit-identical.

Each configuration is one real 2-optimizer-step run of a tiny model built here (no hub),
shared by the tests through a module-scoped cache. The expectations are TRL's own numbers
(its logged loss and metrics), never this package's kernels.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import edit_json, patched_environ, read_json, resign_bundle
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from trajstore.examples.replay_builders import replay, stage, statuses
from transformers import (
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from trl import GRPOConfig

from trajstore.cli import main as cli
from trajstore.integrations.trl import GRPOTrainer

pytestmark = pytest.mark.integration

VOCAB = 16
STEPS = 2


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    vocab.update({f"w{i}": 4 + i for i in range(VOCAB - 4)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )


def _model(moe: bool, directory: Path) -> torch.nn.Module:
    """A tiny randomly initialised model, saved so TRL can reload it as the reference."""
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    if moe:
        config = Qwen3MoeConfig(
            num_hidden_layers=2,
            intermediate_size=64,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            output_router_logits=False,  # TRL asks for router logits in its loss forward
            router_aux_loss_coef=0.01,
            **common,
        )
        model = Qwen3MoeForCausalLM(config)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=1, intermediate_size=64, **common))
    model.save_pretrained(directory)
    return type(model).from_pretrained(directory)


def reward_length(completions: list[str], **_: Any) -> list[float]:
    return [len(completion.split()) / 8.0 for completion in completions]


def reward_token(completions: list[str], **_: Any) -> list[float]:
    return [float(completion.count("w1")) for completion in completions]


def reward_nearly_flat(completions: list[str], **_: Any) -> list[float]:
    """About 3, spread by hundredths: the last float32 bit of a group's mean, divided by the
    small std, moves every advantage of the group by ~2e-5 (issue 29, item 13)."""
    return [3.0 + len(completion.split()) / 300 for completion in completions]


def reward_token_thousandths(completions: list[str], **_: Any) -> list[float]:
    return [completion.count("w1") / 1000 for completion in completions]


class FakeEngineTrainer(GRPOTrainer):
    """Stands in for vLLM: TRL's own sampling, plus per-token sampler log-probs near the tiny
    model's (about uniform) in a fixed pattern, so TRL's IS correction has ratios inside and
    outside its clip range to correct."""

    def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
        self.use_vllm = False
        try:
            completion_ids, _ = super()._generate_single_turn(*args, **kwargs)
        finally:
            self.use_vllm = True
        logprobs = [
            [-math.log(VOCAB) + 0.08 * ((token * 7 + pos) % 5 - 2) for pos, token in enumerate(ids)]
            for ids in completion_ids
        ]
        return completion_ids, logprobs


#: name -> (GRPOConfig overrides, MoE model?, fake inference engine?)
RUNS: dict[str, tuple[dict[str, Any], bool, bool]] = {
    "grpo": ({"loss_type": "grpo", "beta": 0.04}, False, False),
    "bnpo": (
        {
            "loss_type": "bnpo",
            "scale_rewards": "batch",
            "beta": 0.04,
            "use_bias_correction_kl": False,
        },
        False,
        False,
    ),
    "dr_grpo": ({"loss_type": "dr_grpo", "scale_rewards": "none"}, False, False),
    "dapo": (
        {
            "loss_type": "dapo",
            "epsilon_high": 0.28,
            "mask_truncated_completions": True,
            "top_entropy_quantile": 0.5,
        },
        False,
        False,
    ),
    "cispo": ({"loss_type": "cispo", "epsilon_high": 3.0}, False, False),
    "sapo": ({"loss_type": "sapo"}, False, False),
    "luspo": ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, False, False),
    "gspo": (
        {"loss_type": "grpo", "importance_sampling_level": "sequence", "beta": 0.04},
        False,
        False,
    ),
    "delta": ({"loss_type": "grpo", "delta": 1.02, "entropy_coef": 0.01}, False, False),
    "moe": ({"loss_type": "grpo"}, True, False),
    **{
        f"is-{mode}": (
            {
                "loss_type": "grpo",
                "vllm_importance_sampling_mode": mode,
                "vllm_importance_sampling_clip_min": 0.9,
                "vllm_importance_sampling_clip_max": 1.1,
            },
            False,
            True,
        )
        for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    },
    "opsm": ({"loss_type": "grpo", "off_policy_mask_threshold": 0.002}, False, False),
    "vespo": ({"loss_type": "vespo"}, False, False),
    "normalize-then-sum": (
        {"loss_type": "grpo", "multi_objective_aggregation": "normalize_then_sum"},
        False,
        False,
    ),
    # issue 29, item 13: batch-scaled, weighted rewards whose group means TRL sums in float32
    "batch-cispo": (
        {
            "loss_type": "cispo",
            "scale_rewards": "batch",
            "reward_funcs": [reward_nearly_flat, reward_token_thousandths],
            "reward_weights": [1.0, 0.5],
            "beta": 0.04,
            "importance_sampling_level": "sequence",
            "num_iterations": 2,
        },
        False,
        False,
    ),
    # 3 micro-batches per optimizer step, 2 per generation batch: steps span generation batches
    "span": (
        {"loss_type": "dapo", "gradient_accumulation_steps": 3, "steps_per_generation": 2},
        False,
        False,
    ),
}
REPLAYABLE = [name for name in RUNS if name not in ("vespo", "span", "normalize-then-sum")]


def train(root: Path, name: str, *, capture: bool, store: bool = False) -> tuple[Path, GRPOTrainer]:
    """One real TRL run of ``RUNS[name]``: 2 optimizer steps of 2 micro-batches, one rollout;
    capture into ``root/capture`` (a directory, or a store with ``store``)."""
    overrides, moe, fake_engine = RUNS[name]
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    model = _model(moe, root / "model")
    prompts = [
        {"prompt": " ".join(f"w{(7 * i + j) % (VOCAB - 4)}" for j in range(3 + i % 3))}
        for i in range(8)
    ]
    settings = {"gradient_accumulation_steps": 2, "num_iterations": 2, **overrides}
    reward_funcs = settings.pop("reward_funcs", [reward_length, reward_token])
    args = GRPOConfig(
        output_dir=str(root / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=10,
        max_steps=STEPS,
        logging_steps=1,
        learning_rate=0.05,
        bf16=False,
        gradient_checkpointing=False,
        report_to=[],
        use_vllm=False,
        seed=0,
        save_strategy="no",
        disable_tqdm=True,
        **settings,
    )
    capture_dir = root / "capture"
    destination = "TRAJSTORE_CAPTURE_STORE" if store else "TRAJSTORE_CAPTURE_DIR"
    env = {"TRAJSTORE_CAPTURE": "1" if capture else "0", destination: str(capture_dir)}
    with patched_environ(env):
        trainer = (FakeEngineTrainer if fake_engine else GRPOTrainer)(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=Dataset.from_list(prompts),
            processing_class=tokenizer,
        )
    if fake_engine:
        trainer.use_vllm = True
    trainer.train()
    return capture_dir, trainer


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, GRPOTrainer]]:
    """Each configuration trained (capture on) once per module, on first use."""
    done: dict[str, tuple[Path, GRPOTrainer]] = {}

    def get(name: str) -> tuple[Path, GRPOTrainer]:
        if name not in done:
            done[name] = train(tmp_path_factory.mktemp(name.replace("_", "-")), name, capture=True)
        return done[name]

    return get


def _bundles(capture_dir: Path) -> list[Path]:
    return sorted(path for path in capture_dir.iterdir() if path.name.startswith("replay-"))


def _copy(bundle: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(bundle, dest)
    return dest


def _edit_payload(bundle: Path, name: str, edit: Callable[[torch.Tensor], None]) -> None:
    path = bundle / "payloads" / f"{name}.pt"
    tensor = torch.load(path, weights_only=True)
    edit(tensor)
    torch.save(tensor, path)
    resign_bundle(bundle)


# --------------------------------------------------------------------------- capture + replay


@pytest.mark.parametrize("name", REPLAYABLE)
def test_every_captured_bundle_replays_with_exit_0(run, name: str) -> None:
    capture_dir, _ = run(name)
    bundles = _bundles(capture_dir)
    assert [path.name for path in bundles] == ["replay-0-0", "replay-0-1", "replay-rollout-0"]
    assert [cli(["validate", str(path)]) for path in bundles] == [0, 0, 0]
    assert [cli(["replay", str(path)]) for path in bundles] == [0, 0, 0]


@pytest.mark.parametrize("name", REPLAYABLE)
def test_the_loss_and_the_rewards_are_recomputed_not_skipped(run, name: str) -> None:
    capture_dir, _ = run(name)
    steps = [statuses(replay(capture_dir / f"replay-0-{step}")) for step in range(STEPS)]
    rollout = statuses(replay(capture_dir / "replay-rollout-0"))
    assert [step["loss.policy"] for step in steps] == ["pass", "pass"]
    assert [step["advantage.estimate"] for step in steps] == ["pass", "pass"]
    assert (rollout["reward.raw"], rollout["reward.post_process"]) == ("pass", "pass")


#: the micro-batch record fields the loss reads as inputs (kept when TRL's logged loss is
#: made the expected value; the per-micro-batch losses and metrics are dropped)
INPUT_FIELDS = ("generation_loss_tokens", "token_normalizer", "aux_loss")


def _ulps_from_trls_logged_loss(bundle: Path, logged: float) -> float:
    """|replayed step loss - TRL's logged loss| in float32 ulps of max(|logged|, 1): the
    bundle's expected loss is replaced by the logged one, so the stage's error is that gap."""

    def logged_only(doc: dict[str, Any]) -> None:
        record = doc["loss.policy"]
        record["loss"] = logged
        record["micro_batches"] = {
            mb: {key: value for key, value in fields.items() if key in INPUT_FIELDS}
            for mb, fields in record["micro_batches"].items()
        }

    edit_json(bundle / "expected.json", logged_only)
    resign_bundle(bundle)
    outcome = stage(replay(bundle), "loss.policy")
    return outcome.max_abs_error / float(np.spacing(np.float32(max(abs(logged), 1.0))))


def test_the_replayed_loss_is_trls_logged_loss_within_4_ulps(run, tmp_path: Path) -> None:
    """Replay against the value TRL logs (``trainer.state.log_history``), every replayable
    configuration, every step. A step whose logged loss is exactly 0 (terms cancelling) is
    not counted: an ulp of 0 measures nothing there."""
    gaps: dict[str, float] = {}
    zero = []
    names = [*REPLAYABLE, "span"]
    for name in names:
        capture_dir, trainer = run(name)
        logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        assert len(logged) == STEPS
        for step, value in enumerate(logged):
            if value == 0.0:
                zero.append(f"{name}:{step}")
                continue
            bundle = _copy(capture_dir / f"replay-0-{step}", tmp_path / f"{name}-{step}")
            gaps[f"{name}:{step}"] = _ulps_from_trls_logged_loss(bundle, value)
    # 3 of the 34 steps log exactly 0 here (step 0 of grpo, gspo, opsm: on-policy, a
    # per-sample mean of group-normalized advantages that cancel); all others are compared
    assert len(gaps) + len(zero) == STEPS * len(names) and len(gaps) >= 31, zero
    worst = max(gaps, key=gaps.__getitem__)
    # TRL sums its float32 terms in other orders than replay (and SIMD paths differ by CPU)
    assert gaps[worst] <= 4.0, f"{worst}: {gaps[worst]:.2f} ulps; all: {gaps}"


@pytest.mark.parametrize("name", REPLAYABLE)
def test_the_captured_step_loss_is_trls_logged_loss(run, name: str) -> None:
    capture_dir, trainer = run(name)
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    captured = [
        read_json(capture_dir / f"replay-0-{step}" / "expected.json")["loss.policy"]["loss"]
        for step in range(STEPS)
    ]
    assert captured == pytest.approx(logged, rel=1e-6, abs=1e-7)


def test_the_step_bundle_records_what_the_loss_used(run) -> None:
    capture_dir, trainer = run("grpo")
    index = read_json(capture_dir / "replay-0-1" / "index.json")
    manifest = read_json(capture_dir / "replay-0-1" / "manifest.json")
    assert index["config"]["policy_loss"] == "grpo" and index["config"]["kl_loss_coef"] == 0.04
    assert {"log_probs", "old_log_probs", "ref_log_probs", "entropy", "kl", "advantages"} <= set(
        manifest["payloads"]
    )
    tokens = sum(sample["response_length"] for sample in index["samples"])
    assert manifest["payloads"]["log_probs"]["shape"] == [tokens]
    assert sorted({sample["micro_batch_id"] for sample in index["samples"]}) == [
        "mb-0000",
        "mb-0001",
    ]
    assert len(index["samples"]) == 2 * trainer.args.per_device_train_batch_size


def test_the_rollout_bundle_records_rewards_per_function_and_weights(run) -> None:
    capture_dir, _ = run("grpo")
    index = read_json(capture_dir / "replay-rollout-0" / "index.json")
    expected = read_json(capture_dir / "replay-rollout-0" / "expected.json")
    assert index["config"]["reward_weights"] == [1.0, 1.0]
    rows = expected["reward.raw"]["rewards_per_func"]
    assert len(rows) == len(index["samples"]) == 8 and {len(row) for row in rows} == {2}


def test_the_cli_replays_a_captured_bundle_in_a_fresh_process(run) -> None:
    capture_dir, _ = run("gspo")
    done = subprocess.run(
        [sys.executable, "-m", "trajstore", "replay", str(capture_dir / "replay-0-1")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "loss.policy" in done.stdout


def test_capture_into_a_store_replays_every_step_linked_to_its_rollout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, _ = train(tmp_path, "sapo", capture=True, store=True)
    assert cli(["replay", "--store", str(store), "--all"]) == 0
    capsys.readouterr()
    assert cli(["replay", "--store", str(store), "--step", "0:1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["linkage"]["status"] == "pass"


def test_steps_spanning_generation_batches_and_reusing_rows_replay_with_exit_0(run) -> None:
    capture_dir, trainer = run("span")
    bundles = _bundles(capture_dir)
    # num_iterations 2: generation 0 feeds micro-batches 0-3, generation 1 micro-batches 4-5
    assert [path.name for path in bundles] == [
        "replay-0-0",
        "replay-0-1",
        "replay-rollout-0",
        "replay-rollout-1",
    ]
    assert [cli(["replay", str(path)]) for path in bundles] == [0] * 4
    step = read_json(capture_dir / "replay-0-1" / "index.json")["samples"]
    assert {sample["sample_id"].split("-")[0] for sample in step} == {"g0", "g1"}
    first = read_json(capture_dir / "replay-0-0" / "index.json")["samples"]
    assert sum(sample["sample_id"].endswith("-it2") for sample in first) == 4  # reused rows
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    captured = [
        read_json(capture_dir / name / "expected.json")["loss.policy"]["loss"]
        for name in ("replay-0-0", "replay-0-1")
    ]
    assert captured == pytest.approx(logged, rel=1e-6, abs=1e-7)


# ------------------------------------------------------------- inputs: recomputed or named


def _json_stage(bundle: Path, name: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    cli(["replay", str(bundle), "--json"])
    report = json.loads(capsys.readouterr().out)
    return next(s for s in report["bundles"][0]["stages"] if s["stage"] == name)


@pytest.mark.parametrize("name", ["dapo", "cispo", "batch-cispo"])
def test_the_token_normalizer_is_recomputed_from_the_step_nothing_trusted(
    run, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    capture_dir, _ = run(name)
    for step in range(STEPS):
        bundle = capture_dir / f"replay-0-{step}"
        records = read_json(bundle / "expected.json")["loss.policy"]["micro_batches"]
        assert all("generation_loss_tokens" in record for record in records.values())
        outcome = _json_stage(bundle, "loss.policy", capsys)
        assert (outcome["status"], outcome["trusted"]) == ("pass", [])


def test_a_wrong_generation_token_count_is_found_not_used(run, tmp_path: Path) -> None:
    capture_dir, _ = run("dapo")
    bundle = _copy(capture_dir / "replay-0-1", tmp_path / "b")

    def one_more(doc: dict[str, Any]) -> None:
        doc["loss.policy"]["micro_batches"]["mb-0001"]["generation_loss_tokens"] += 1

    edit_json(bundle / "expected.json", one_more)
    resign_bundle(bundle)
    report = replay(bundle)
    outcome = stage(report, "loss.policy")
    assert report.first_divergence()["field"] == "mb-0001.generation_loss_tokens"
    assert [d.field for d in outcome.divergences] == ["mb-0001.generation_loss_tokens"]
    assert outcome.trusted == []


def test_a_generation_batch_split_across_steps_is_named_as_taken_on_trust(
    run, capsys: pytest.CaptureFixture[str]
) -> None:
    capture_dir, _ = run("span")
    # step 0 holds generation 0 whole (micro-batches 0-1) and half again; step 1 starts with
    # generation 0's other half (its count is in step 0 only), then generation 1 whole
    first = _json_stage(capture_dir / "replay-0-0", "loss.policy", capsys)
    second = _json_stage(capture_dir / "replay-0-1", "loss.policy", capsys)
    assert first["trusted"] == []
    assert second["trusted"] == ["mb-0000.generation_loss_tokens"]


def test_the_moe_aux_loss_is_named_as_taken_on_trust(
    run, capsys: pytest.CaptureFixture[str]
) -> None:
    capture_dir, _ = run("moe")
    bundle = capture_dir / "replay-0-1"
    assert _json_stage(bundle, "loss.policy", capsys)["trusted"] == [
        "mb-0000.aux_loss",
        "mb-0001.aux_loss",
    ]
    assert cli(["replay", str(bundle)]) == 0
    assert (
        "taken on trust (not recomputable from the bundle): mb-0000.aux_loss, mb-0001.aux_loss"
        in capsys.readouterr().out
    )


def test_a_recorded_divisor_without_its_count_is_named_as_taken_on_trust(
    run, tmp_path: Path
) -> None:
    """A bundle that records only TRL's divisor (as captures before issue 29 did)."""
    capture_dir, _ = run("dapo")
    bundle = _copy(capture_dir / "replay-0-1", tmp_path / "b")
    config = read_json(bundle / "index.json")["config"]
    scale = config["gradient_accumulation_steps"] / config["steps_per_generation"]

    def divisor_only(doc: dict[str, Any]) -> None:
        for record in doc["loss.policy"]["micro_batches"].values():
            record["token_normalizer"] = record.pop("generation_loss_tokens") * scale

    edit_json(bundle / "expected.json", divisor_only)
    edit_json(bundle / "index.json", lambda doc: doc["config"].pop("steps_per_generation"))
    resign_bundle(bundle)
    outcome = stage(replay(bundle), "loss.policy")
    assert outcome.status == "pass"
    assert outcome.trusted == ["mb-0000.token_normalizer", "mb-0001.token_normalizer"]


def test_vespo_is_named_unsupported_by_the_capability_matrix(run) -> None:
    capture_dir, _ = run("vespo")
    report = replay(capture_dir / "replay-0-1", "loss.policy")
    outcome = stage(report, "loss.policy")
    assert (outcome.status, report.exit_code) == ("unsupported", 1)
    assert "vespo" in outcome.reason


def _float64_advantages(rewards_per_func: list[list[float]], weights: list[float]) -> np.ndarray:
    """TRL's batch-scaled advantages transcribed with float64 sums rounded once to float32: the
    math replay used before issue 29 (item 13), here only to show the run is sensitive to it."""
    per = np.array(rewards_per_func, dtype=np.float32) * np.array(weights, dtype=np.float32)
    rewards = per.astype(np.float64).sum(axis=1).astype(np.float32)
    means = np.repeat(rewards.reshape(-1, 4).astype(np.float64).mean(axis=1), 4)
    std = np.float32(rewards.astype(np.float64).std(ddof=1))
    return (rewards - means.astype(np.float32)) / (std + np.float32(1e-4))


def test_float32_group_means_are_replayed_as_trl_summed_them(run) -> None:
    capture_dir, _ = run("batch-cispo")
    bundle = capture_dir / "replay-rollout-0"
    expected = read_json(bundle / "expected.json")
    index = read_json(bundle / "index.json")
    trl_advantages = np.array([sample["reward"] for sample in index["samples"]])
    rounded_once = _float64_advantages(
        expected["reward.raw"]["rewards_per_func"], index["config"]["reward_weights"]
    )
    # the run is one where the group mean's float32 rounding shows (beyond atol 1e-6 +
    # rtol 1e-5), so replay passes only by summing as torch did
    assert (np.abs(rounded_once - trl_advantages) > 1e-6 + 1e-5 * np.abs(trl_advantages)).any()
    assert index["config"]["reward_sum_order"] in ("torch-cpu-8", "torch-cpu-16")
    report = replay(bundle)
    assert statuses(report)["reward.post_process"] == "pass" and report.exit_code == 0
    assert (
        stage(report, "reward.post_process").max_abs_error <= 2**-22 * np.abs(trl_advantages).max()
    )  # the std's square root: torch's vectorized float32 sqrt is 1 ulp off at times


def test_each_divergent_sample_is_listed_once(
    run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capture_dir, _ = run("grpo")
    bundle = _copy(capture_dir / "replay-rollout-0", tmp_path / "b")
    edit_json(bundle / "index.json", lambda doc: doc["config"].__setitem__("reward_std_eps", 0.1))
    resign_bundle(bundle)
    capsys.readouterr()
    assert cli(["replay", str(bundle), "--stage", "reward.post_process"]) == 1
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if "] reward.post_process" in line)
    listed = [
        line.split()[1].rstrip(":") for line in lines[head + 1 :] if line.startswith(" " * 10)
    ]
    samples = [sample["sample_id"] for sample in read_json(bundle / "index.json")["samples"]]
    assert "mismatch in 8 sample(s)" in lines[head]
    assert sorted(listed) == sorted(samples)  # all 8, each once


def test_normalize_then_sum_rewards_are_named_unsupported_and_the_loss_still_replays(
    run,
) -> None:
    capture_dir, _ = run("normalize-then-sum")
    report = replay(capture_dir / "replay-rollout-0", "reward.post_process")
    outcome = stage(report, "reward.post_process")
    assert (outcome.status, report.exit_code) == ("unsupported", 1)
    assert "normalize_then_sum" in outcome.reason
    assert [cli(["replay", str(path)]) for path in _bundles(capture_dir)] == [0, 0, 0]
    assert statuses(replay(capture_dir / "replay-0-1"))["loss.policy"] == "pass"


# --------------------------------------------------------------------------- faults


def test_a_flipped_advantage_is_found_at_advantage_estimate_sample_and_token(
    run, tmp_path: Path
) -> None:
    capture_dir, _ = run("grpo")
    bundle = _copy(capture_dir / "replay-0-1", tmp_path / "b")
    samples = read_json(bundle / "index.json")["samples"]
    start = samples[0]["response_length"] + 2  # token 2 of the second sample

    def flip(values: torch.Tensor) -> None:
        values[start] = -values[start] + 1.0

    _edit_payload(bundle, "advantages", flip)
    first = replay(bundle).first_divergence()
    assert (first["stage"], first["sample_id"], first["token_offset"]) == (
        "advantage.estimate",
        samples[1]["sample_id"],
        2,
    )


def test_a_flipped_reward_is_found_at_reward_raw_and_its_sample(run, tmp_path: Path) -> None:
    capture_dir, _ = run("grpo")
    bundle = _copy(capture_dir / "replay-rollout-0", tmp_path / "b")
    edit_json(
        bundle / "expected.json",
        lambda doc: doc["reward.raw"]["rewards_per_func"][5].__setitem__(1, 7.0),
    )
    resign_bundle(bundle)
    first = replay(bundle).first_divergence()
    sample_id = read_json(bundle / "index.json")["samples"][5]["sample_id"]
    assert (first["stage"], first["sample_id"], first["field"]) == (
        "reward.raw",
        sample_id,
        "raw_reward",
    )


def test_a_flipped_reference_log_prob_is_found_at_its_token(run, tmp_path: Path) -> None:
    capture_dir, _ = run("grpo")
    bundle = _copy(capture_dir / "replay-0-0", tmp_path / "b")
    samples = read_json(bundle / "index.json")["samples"]
    start = samples[0]["response_length"] + samples[1]["response_length"] + 1

    def flip(values: torch.Tensor) -> None:
        values[start] -= 0.5

    _edit_payload(bundle, "ref_log_probs", flip)
    report = replay(bundle)
    first = report.first_divergence()
    assert (first["stage"], first["sample_id"], first["field"], first["token_offset"]) == (
        "advantage.kl",
        samples[2]["sample_id"],
        "kl",
        1,
    )
    assert statuses(report)["loss.policy"] == "fail"


#: the runs with a reference KL in the loss, by how TRL weighs it: (IS level, bias correction)
KL_RUNS = {
    "grpo": ("token", True),
    "gspo": ("sequence", True),
    "batch-cispo": ("sequence", True),
    "bnpo": ("token", False),
}


def _payload(bundle: Path, name: str) -> torch.Tensor:
    return torch.load(bundle / "payloads" / f"{name}.pt", weights_only=True)


def _k3(bundle: Path) -> torch.Tensor:
    """Plain k3 of the captured log-probs, transcribed here: ``exp(ref - lp) - (ref - lp) - 1``."""
    diff = _payload(bundle, "ref_log_probs") - _payload(bundle, "log_probs")
    return torch.exp(diff) - diff - 1


@pytest.mark.parametrize("name", sorted(KL_RUNS))
def test_the_captured_kl_is_the_kl_trls_loss_used(run, name: str) -> None:
    capture_dir, _ = run(name)
    bundle = capture_dir / "replay-0-1"  # the second pass: the policy moved, ratios are not 1
    samples = read_json(bundle / "index.json")["samples"]
    logged = read_json(bundle / "expected.json")["loss.policy"]["micro_batches"]
    kl, mask = _payload(bundle, "kl"), torch.tensor([m for s in samples for m in s["loss_mask"]])
    owner = [s["micro_batch_id"] for s in samples for _ in range(s["response_length"])]
    for mb_id, record in logged.items():
        rows = torch.tensor([mb == mb_id for mb in owner]) & (mask > 0)
        # TRL's logged kl is global_masked_mean(per_token_kl) of the micro-batch
        assert kl[rows].double().mean().item() == pytest.approx(record["kl"], rel=1e-5)
    gap = (kl - _k3(bundle)).abs().max().item()
    _, bias_corrected = KL_RUNS[name]
    assert gap > 1e-5 if bias_corrected else gap == 0.0


@pytest.mark.parametrize("name", sorted(KL_RUNS))
def test_a_kl_weighed_otherwise_than_trl_is_found_at_advantage_kl(
    run, tmp_path: Path, name: str
) -> None:
    """The captured KL swapped for the other weighting (plain k3 where TRL bias-corrects, k3
    times the token ratio where it does not) diverges at advantage.kl, not later."""
    capture_dir, _ = run(name)
    bundle = _copy(capture_dir / "replay-0-1", tmp_path / "b")
    _, bias_corrected = KL_RUNS[name]
    ratio = torch.exp(_payload(bundle, "log_probs") - _payload(bundle, "old_log_probs"))
    other = _k3(bundle) if bias_corrected else _k3(bundle) * ratio

    def swap(values: torch.Tensor) -> None:
        values.copy_(other)

    _edit_payload(bundle, "kl", swap)
    report = replay(bundle)
    assert report.first_divergent_stage == "advantage.kl"
    assert statuses(report)["loss.policy"] == "pass"  # the loss recomputes TRL's KL itself


def test_a_changed_clip_is_found_at_loss_policy_with_every_input_passing(
    run, tmp_path: Path
) -> None:
    capture_dir, _ = run("grpo")
    bundle = _copy(capture_dir / "replay-0-1", tmp_path / "b")
    edit_json(bundle / "index.json", lambda doc: doc["config"].__setitem__("eps_clip", 1e-4))
    resign_bundle(bundle)
    report = replay(bundle)
    first = report.first_divergence()
    assert first["stage"] == "loss.policy"
    assert first["field"] in ("loss", "mb-0000.loss", "mb-0001.loss")
    assert statuses(report)["advantage.kl"] == statuses(report)["advantage.estimate"] == "pass"


# --------------------------------------------------------------------------- numerics


def test_capture_on_and_off_train_bit_identical_parameters(run, tmp_path: Path) -> None:
    _, captured = run("grpo")
    _, plain = train(tmp_path, "grpo", capture=False)
    assert not any(tmp_path.joinpath("capture").glob("replay-*"))
    on = dict(captured.model.named_parameters())
    off = dict(plain.model.named_parameters())
    assert on.keys() == off.keys()
    assert [name for name in on if not torch.equal(on[name], off[name])] == []


# --------------------------------------------------------------------------- every setting counts

#: (run, bundle, config key, a wrong value): replay must diverge at the stage when it is changed
SETTINGS = [
    ("grpo", "replay-0-1", "kl_loss_coef", 0.08, "loss.policy"),
    ("grpo", "replay-0-1", "use_unbiased_kl", False, "advantage.kl"),
    ("bnpo", "replay-0-1", "use_unbiased_kl", True, "advantage.kl"),
    ("bnpo", "replay-0-1", "policy_loss", "grpo", "loss.policy"),
    ("bnpo", "replay-rollout-0", "reward_scale", "group", "reward.post_process"),
    ("dr_grpo", "replay-0-1", "max_response_length", 12, "loss.policy"),
    ("dr_grpo", "replay-rollout-0", "reward_scale", "group", "reward.post_process"),
    ("dapo", "replay-0-1", "top_entropy_quantile", 1.0, "loss.policy"),
    ("dapo", "replay-0-1", "eps_clip", 0.5, "loss.policy"),
    ("cispo", "replay-0-1", "policy_loss", "dapo", "loss.policy"),
    ("sapo", "replay-0-1", "sapo_temperature_neg", 2.0, "loss.policy"),
    ("luspo", "replay-0-1", "policy_loss", "grpo", "loss.policy"),
    # under use_bias_correction_kl the KL is weighed by the sequence ratio: advantage.kl sees it
    ("gspo", "replay-0-1", "importance_sampling_level", "token", "advantage.kl"),
    ("batch-cispo", "replay-0-1", "importance_sampling_level", "token", "advantage.kl"),
    ("batch-cispo", "replay-rollout-0", "reward_scale", "group", "reward.post_process"),
    ("batch-cispo", "replay-rollout-0", "reward_sum_order", None, "reward.post_process"),
    ("delta", "replay-0-1", "delta", None, "loss.policy"),
    ("delta", "replay-0-1", "entropy_coef", 0.0, "loss.policy"),
    ("moe", "replay-0-1", "aux_loss_coef", None, "loss.policy"),
    ("opsm", "replay-0-1", "off_policy_mask_threshold", None, "loss.policy"),
    ("is-token_truncate", "replay-0-1", "is_correction", None, "loss.policy"),
    ("is-token_mask", "replay-0-1", "is_correction", "token_truncate", "loss.policy"),
    ("is-sequence_truncate", "replay-0-1", "is_correction", "token_truncate", "loss.policy"),
    ("is-sequence_mask", "replay-0-1", "is_correction", "sequence_truncate", "loss.policy"),
]


@pytest.mark.parametrize(("name", "bundle", "key", "wrong", "where"), SETTINGS)
def test_a_wrong_setting_in_the_config_diverges_at_its_stage(
    run, tmp_path: Path, name: str, bundle: str, key: str, wrong: Any, where: str
) -> None:
    capture_dir, _ = run(name)
    path = _copy(capture_dir / bundle, tmp_path / "b")
    edit_json(path / "index.json", lambda doc: doc["config"].__setitem__(key, wrong))
    resign_bundle(path)
    assert replay(path).first_divergent_stage == where
