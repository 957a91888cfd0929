"""verl 0.9.1's real actor worker, in this process, on the CPU (test harness).

Why a harness and not a stand-in: the tests' oracle is verl itself (its
``ActorRolloutRefWorker.update_actor``, its loss, its logged ``actor/pg_loss``), so the
worker must be verl's own class, built from verl's own generated trainer config. verl only
runs on CUDA/NPU; the workarounds below are all test-side and touch no verl file:

- a CPU platform given to verl's ``set_platform`` before ``verl.workers.engine`` is
  imported (verl has no CPU platform; its device module must answer the memory queries its
  worker logs);
- a single-process gloo group (MASTER_ADDR/PORT, RANK=0, WORLD_SIZE=1, or the ranks the
  environment gives) opened here, since verl's own initialiser would ask for
  ``cpu:gloo,cpu:gloo``; the variables are set only while a worker is built;
- verl's FSDP engines registered for device ``cpu`` in its ``EngineRegistry`` (it lists
  only cuda/npu);
- ``attn_implementation: sdpa`` (verl defaults to flash-attention), fp32 parameters;
- TRL >= 1 installed beside verl (the dev extra has both) breaks verl's ``init_model``
  (it imports a TRL class TRL 1 removed): `check_trl_coexists` is the one-line workaround.

`build_worker` returns an initialised worker; `make_batch` a driver-style ``DataProto``
with every field ``update_actor`` reads; `update_actor` runs verl's own driver conversion
(``RayPPOTrainer._update_actor``'s steps) and the worker's ``update_actor``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from conftest import patched_environ

VOCAB = 32
PROMPT = 6
RESPONSE = 8
_READY = False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_device_module() -> types.ModuleType:
    """``torch.cpu`` plus the CUDA-only queries verl's worker calls on its device module."""
    mod = types.ModuleType("verl_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("_"):
            setattr(mod, name, getattr(torch.cpu, name))
    for name in (
        "max_memory_allocated",
        "max_memory_reserved",
        "memory_allocated",
        "memory_reserved",
    ):
        setattr(mod, name, lambda *a, **k: 0)
    mod.empty_cache = lambda: None
    mod.manual_seed = torch.manual_seed
    mod.manual_seed_all = torch.manual_seed
    mod.is_available = lambda: True
    mod.current_device = lambda: "cpu"
    mod.device_count = lambda: 1
    mod.set_device = lambda *a: None
    mod.synchronize = lambda *a: None
    mod.mem_get_info = lambda *a: (1 << 34, 1 << 34)
    mod.reset_peak_memory_stats = lambda *a: None
    mod.memory_stats = lambda *a: {}
    mod.get_device_name = lambda *a: "CPU"  # verl's flops table: unknown device, inf flops
    return mod


#: the rendezvous verl's ``Worker`` reads from the environment; set only while a worker is
#: built (`build_worker`): left in ``os.environ`` it would reach every later subprocess of the
#: test session (accelerate would then join this process's group and find its port taken)
_DIST_ENV: dict[str, str] = {}


def setup_cpu() -> None:
    """Register the CPU platform, the gloo group and the CPU engines (once a process)."""
    global _READY
    if _READY:
        return
    _DIST_ENV.update(
        MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        MASTER_PORT=os.environ.get("MASTER_PORT") or str(_free_port()),
        RANK=os.environ.get("RANK", "0"),
        WORLD_SIZE=os.environ.get("WORLD_SIZE", "1"),
        LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"),
        LOCAL_WORLD_SIZE=os.environ.get("LOCAL_WORLD_SIZE", "1"),
    )

    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import set_platform

    device = _cpu_device_module()

    class CPUPlatform(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = device

        def is_available(self) -> bool:
            return True

        def current_device(self) -> str:  # verl moves tensors with .to(current_device())
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str) -> Any:
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    set_platform(CPUPlatform())

    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{_DIST_ENV['MASTER_ADDR']}:{_DIST_ENV['MASTER_PORT']}",
            rank=int(_DIST_ENV["RANK"]),
            world_size=int(_DIST_ENV["WORLD_SIZE"]),
        )

    import verl.workers.engine  # noqa: F401 - registers the engines (after set_platform)
    from verl.workers.engine.base import EngineRegistry

    check_trl_coexists()
    for backends in EngineRegistry._engines.values():
        for backend in ("fsdp", "fsdp2"):
            registry = backends.get(backend)
            if registry is not None and "cuda" in registry and "cpu" not in registry:
                registry["cpu"] = registry["cuda"]
    _READY = True


# --------------------------------------------------------------------------- model + config


def save_tiny_model(directory: Path, *, moe: bool = False, seed: int = 0) -> Path:
    """A tiny Qwen2 (or Qwen3-MoE) and a word-level tokenizer saved where verl loads them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=False,
    )
    if moe:
        config = Qwen3MoeConfig(
            num_hidden_layers=2,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_experts=8,
            num_experts_per_tok=2,
            head_dim=16,
            output_router_logits=False,
            **common,
        )
        model = Qwen3MoeForCausalLM(config)
    else:
        config = Qwen2Config(num_hidden_layers=2, intermediate_size=64, **common)
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(directory)
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    vocab.update({f"w{i}": 4 + i for i in range(VOCAB - 4)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    ).save_pretrained(directory)
    return directory


def trainer_config(model_dir: Path, **actor: Any) -> Any:
    """verl's own generated PPO trainer config with the tiny model and CPU settings.

    ``actor``: overrides of ``actor_rollout_ref.actor`` (loss mode, aggregation, ...).
    """
    import verl
    from omegaconf import OmegaConf

    path = Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"
    cfg = OmegaConf.load(path)
    overrides = {
        "data": {"max_prompt_length": PROMPT, "max_response_length": RESPONSE},
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"n_gpus_per_node": 1, "nnodes": 1},
        "actor_rollout_ref": {
            "model": {
                "path": str(model_dir),
                "override_config": {"attn_implementation": "sdpa"},
                "enable_gradient_checkpointing": False,
                "use_remove_padding": True,
            },
            "actor": {
                "strategy": "fsdp2",
                "ppo_mini_batch_size": 4,
                "ppo_micro_batch_size_per_gpu": 2,
                "use_torch_compile": False,
                "shuffle": False,
                "optim": {"lr": 1e-2},
                "fsdp_config": {
                    "model_dtype": "fp32",
                    "use_torch_compile": False,
                    "strategy": "fsdp2",
                },
                **actor,
            },
            "rollout": {
                "name": "hf",
                "n": 1,
                "log_prob_micro_batch_size_per_gpu": 4,
                "tensor_model_parallel_size": 1,
            },
            "ref": {"fsdp_config": {"model_dtype": "fp32"}},
        },
    }
    cfg = OmegaConf.merge(cfg, OmegaConf.create(_nested(overrides)))
    return cfg


def _nested(tree: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys of ``actor`` overrides (``policy_loss.loss_mode``) as nested dicts."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        value = _nested(value) if isinstance(value, dict) else value
        node = out
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        if isinstance(value, dict) and isinstance(node.get(last), dict):
            node[last].update(value)
        else:
            node[last] = value
    return out


def build_worker(cfg: Any) -> Any:
    """verl's ``ActorRolloutRefWorker(role="actor")`` from ``cfg``, ``init_model()`` run."""
    setup_cpu()
    from verl.workers.engine_workers import ActorRolloutRefWorker

    with patched_environ(_DIST_ENV):
        worker = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")
        worker.init_model()
    return worker


# --------------------------------------------------------------------------- batches


@dataclass
class Lengths:
    prompts: list[int]
    responses: list[int]


def make_batch(rows: int = 8, *, group: int = 4, seed: int = 0) -> Any:
    """A driver batch as verl's trainer has it before the actor update (no log-probs yet):
    left-padded prompts, right-padded responses, masks, positions, ``uid`` groups, scores."""
    from verl import DataProto

    g = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(2, PROMPT + 1, (rows,), generator=g)
    response_lengths = torch.randint(2, RESPONSE + 1, (rows,), generator=g)
    prompts = torch.zeros(rows, PROMPT, dtype=torch.long)
    responses = torch.zeros(rows, RESPONSE, dtype=torch.long)
    attention = torch.zeros(rows, PROMPT + RESPONSE, dtype=torch.long)
    for i in range(rows):
        p, r = int(prompt_lengths[i]), int(response_lengths[i])
        prompts[i, PROMPT - p :] = torch.randint(4, VOCAB, (p,), generator=g)
        responses[i, :r] = torch.randint(4, VOCAB, (r,), generator=g)
        attention[i, PROMPT - p : PROMPT + r] = 1
    input_ids = torch.cat([prompts, responses], dim=1)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    response_mask = attention[:, PROMPT:].clone()
    scores = torch.zeros(rows, RESPONSE)
    rewards = torch.rand(rows, generator=g)
    for i in range(rows):
        scores[i, int(response_lengths[i]) - 1] = rewards[i]
    uid = np.array([f"q{i // group}" for i in range(rows)], dtype=object)
    return DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "input_ids": input_ids,
            "attention_mask": attention,
            "position_ids": position_ids,
            "response_mask": response_mask,
            "token_level_scores": scores,
        },
        non_tensors={"uid": uid},
    )


def compute_log_prob(worker: Any, batch: Any, cfg: Any) -> torch.Tensor:
    """The worker's ``compute_log_prob`` through verl's driver conversion; [B, R] float32."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    batch_td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(
        batch_td,
        calculate_entropy=True,
        compute_loss=False,
        temperature=cfg.actor_rollout_ref.rollout.temperature,
    )
    output = worker.compute_log_prob(batch_td)
    return no_padding_2_padding(tu.get(output, "log_probs"), batch_td).float()


def prepare(batch: Any, worker: Any, cfg: Any, *, ref: bool = False) -> Any:
    """Old log-probs from the worker and advantages from verl's own ``compute_advantage``:
    the driver's steps between rollout and ``update_actor``."""
    from verl.trainer.ppo.ray_trainer import compute_advantage

    old = compute_log_prob(worker, batch, cfg)
    batch.batch["old_log_probs"] = old
    if ref:
        g = torch.Generator().manual_seed(7)
        batch.batch["ref_log_prob"] = old + 0.05 * torch.randn(old.shape, generator=g)
    batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
    return compute_advantage(
        batch,
        adv_estimator=cfg.algorithm.adv_estimator,
        gamma=cfg.algorithm.gamma,
        lam=cfg.algorithm.lam,
        num_repeat=cfg.actor_rollout_ref.rollout.n,
        norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo,
        config=cfg.algorithm,
    )


def update_actor(worker: Any, batch: Any, cfg: Any) -> dict[str, Any]:
    """``RayPPOTrainer._update_actor``'s conversion of the driver batch, then the worker's
    ``update_actor``; verl's metrics (``actor/`` prefix added as the trainer does)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    actor = cfg.actor_rollout_ref.actor
    batch.meta_info["temperature"] = cfg.actor_rollout_ref.rollout.temperature
    batch.meta_info["multi_turn"] = False
    batch_td = left_right_2_no_padding(batch.to_tensordict())
    mini = actor.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n
    tu.assign_non_tensor(
        batch_td,
        calculate_entropy=bool(actor.calculate_entropy or actor.entropy_coeff != 0.0),
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=mini,
        mini_batch_size=mini,
        epochs=actor.ppo_epochs,
        seed=actor.data_loader_seed,
        dataloader_kwargs={"shuffle": actor.shuffle},
        compute_loss=True,
    )
    from verl.utils.py_functional import rename_dict

    output = worker.update_actor(batch_td)
    return rename_dict(tu.get(output, "metrics"), "actor/")


def parameters(worker: Any) -> dict[str, torch.Tensor]:
    """The actor's full parameters (fsdp2 DTensors gathered), copied."""
    out = {}
    for name, p in worker.actor.engine.module.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone()
    return out


def check_trl_coexists() -> bool:
    """verl 0.9.1 + TRL >= 1 in one environment (the dev extra installs both): verl's
    ``apply_monkey_patch`` (run by every FSDP ``init_model``) does ``if is_trl_available():
    from trl(.experimental.ppo) import AutoModelForCausalLMWithValueHead``, a class TRL 1
    removed, so init_model raises ImportError (a verl bug). The minimal workaround: that
    module's ``is_trl_available`` answers False when TRL has no such class (verl only
    patches that class's ``state_dict``; the actor never uses it). True when applied."""
    import importlib

    import verl.models.transformers.monkey_patch as monkey_patch

    for name in ("trl.experimental.ppo", "trl"):
        try:
            if hasattr(importlib.import_module(name), "AutoModelForCausalLMWithValueHead"):
                return False
        except ImportError:
            continue
    monkey_patch.is_trl_available = lambda: False
    return True


# --------------------------------------------------------------------------- ranks

#: what a fork server imports once for every data-parallel rank (`dp_rank`): the imports a
#: rank makes before `setup_cpu` (the parent test process makes them too; none of them
#: imports ``verl.workers.engine``, which must come after ``set_platform``)
RANK_PRELOAD = [
    "torch",
    "torch._dynamo",
    "transformers",
    "verl",
    "verl.protocol",
    "verl_cpu",
    "ray",
    "pandas",
    "datasets",
    "peft",
    "trl",
    "transformers.models.qwen2.modeling_qwen2",
    "torch.distributed.fsdp",
    "fastapi",
    "uvicorn",
    "hydra",
]


def dp_rank(model: str, result: str, environ: dict[str, str], cwd: str) -> None:
    """One data-parallel rank, a process of its own (a fork server's child): verl's worker
    on this rank's rows of the driver batch, captured through ``capture_actor``; the
    capture's (written, errors) go to the file `result`. Its environment (RANK,
    MASTER_PORT, the capture's variables) and directory are the test's, set first."""
    import json

    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    import trajstore.integrations.verl as tv
    from trajstore.integrations.verl.actor import STEP_KEY, capture_actor

    rank = int(os.environ["RANK"])
    cfg = trainer_config(Path(model))
    worker = build_worker(cfg)
    capture_actor(worker, cfg)
    batch = prepare(make_batch(8, seed=1), worker, cfg)
    tv.tag_batch(batch)
    batch.meta_info[STEP_KEY] = 1
    # the rows verl's worker-group dispatch hands this data-parallel rank
    update_actor(worker, batch[rank * 4 : (rank + 1) * 4], cfg)
    stats = tv.close()
    Path(result).write_text(json.dumps({"written": stats.written, "errors": stats.errors}))
