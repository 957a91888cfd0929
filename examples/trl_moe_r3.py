"""R3 through TRL's GRPOTrainer on a tiny transformers Qwen3-MoE: baseline vs r3, captured.

Why this shape: TRL generates with the policy itself; an RL stack with MoE
routing drift has a separate rollout engine in other numerics. TRL's own
extension point for that is ``rollout_func``: here it is a bfloat16 copy of
the policy generating with `generate_with_routes` (every prompt and response
token's experts recorded during generation). The trainer is
``trajstore.integrations.trl.GRPOTrainer`` (capture of what TRL's loss
consumed) with three additions, all through `trajstore.integrations.hf_moe`:

- each generation batch row keeps its rollout routes (a batch column,
  ``hf_moe_row``, follows the row through TRL's shuffling and splitting);
- TRL's loss forward runs under `record_routes` (``baseline``) or
  `replay_routes` of the rollout's routes (``r3``: the executed experts are
  the rollout's, gates from the training router's softmax at them);
- every captured step bundle gets the route payloads
  (``rollout_routed_experts``, ``train_routed_experts``, and in r3
  ``train_natural_routed_experts``), ``rollout_log_probs`` /
  ``train_log_probs`` and ``config.router``, added to the
  `StepCapture.add` call the TRL integration makes.

    python -m trajstore.examples.trl_moe_r3 --store /tmp/trl.store --steps 3 --seed 0
    trajstore router compare --store /tmp/trl.store --run trl-baseline --run trl-r3

torch, transformers and TRL are imported inside functions.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trajstore.examples.runs import (
    capture_run,
    check_store,
    mode_parser,
    run_main,
    selected_modes,
)

MODES = ("baseline", "r3")
RUN_PREFIX = "trl-"
#: the generation-batch column that carries each row's index to the loss
ROW_COLUMN = "hf_moe_row"
ROLLOUT_ENGINE = "transformers-generate-bf16 (TRL rollout_func)"
TRAIN_ENGINE = "trl-grpo-fp32"


@dataclass
class RowRoutes:
    """One generated row: its rollout routes and what the training forward did with them."""

    rollout: Any  # [T, L, K] int64, prompt then completion tokens
    rollout_log_probs: Any  # [C] float32 of the completion tokens (the bf16 engine's)
    prompt_len: int
    completion_len: int
    train: Any = None  # [T, L, K] executed in the loss forward
    natural: Any = None  # [T, L, K] the training router's own choice


def rollout_engine(policy: Any, dtype: Any) -> Any:
    """A copy of ``policy``'s weights in ``dtype``, built from its config.

    Why not ``copy.deepcopy``: accelerate (under the Trainer) replaces the
    model's ``forward`` with a bound method of the original, so a deep copy
    would run the original's float32 forward behind the copy's hooks.
    """
    engine = type(policy)(policy.config)
    engine.load_state_dict(policy.state_dict())
    engine.generation_config = policy.generation_config
    return engine.to(dtype).eval()


def bf16_rollout(prompts: list, trainer: Any) -> dict[str, Any]:
    """TRL ``rollout_func``: a bfloat16 copy of the policy generates, routes recorded.

    Text prompts only (a chat template would have to be applied here, as TRL
    documents for ``rollout_func``). The rows' routes wait on the trainer
    until `_generate_and_score_completions` gives them a row index.
    """
    import torch

    from trajstore.integrations.hf_moe import generate_with_routes

    if any(not isinstance(p, str) for p in prompts):
        raise ValueError("trl_moe_r3: bf16_rollout takes text prompts only")
    tok = trainer.processing_class
    encoded = tok(text=prompts)["input_ids"]
    width = max(len(ids) for ids in encoded)
    input_ids = torch.full((len(encoded), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(encoded):  # left padding, as TRL pads prompts
        input_ids[i, width - len(ids) :] = torch.as_tensor(ids)
        mask[i, width - len(ids) :] = 1
    engine = rollout_engine(
        trainer.accelerator.unwrap_model(trainer.model), trainer.r3_rollout_dtype
    )
    gen = generate_with_routes(
        engine,
        input_ids=input_ids,
        attention_mask=mask,
        generation_config=trainer.generation_config,
    )
    completions, rows = [], []
    logp = torch.log_softmax(gen.logits, dim=-1)
    for i in range(len(encoded)):
        keep = gen.attention_mask[i, width:].bool()
        completion = gen.sequences[i, width:][keep]
        completions.append(completion.tolist())
        picked = logp[i, : len(completion)].gather(-1, completion.unsqueeze(-1))[:, 0]
        rows.append(
            RowRoutes(
                rollout=gen.routes[i][gen.attention_mask[i].bool()],
                rollout_log_probs=picked.to(torch.float32),
                prompt_len=len(encoded[i]),
                completion_len=len(completion),
            )
        )
    trainer.r3_generated = rows
    # logprobs None: TRL's importance-sampling correction stays off, the loss is on-policy GRPO
    prompt_ids = [list(ids) for ids in encoded]
    return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}


@functools.cache
def trainer_class() -> type:
    """`R3GRPOTrainer`, built on first use (it subclasses the TRL integration's trainer)."""
    import torch

    from trajstore.integrations.hf_moe import (
        record_routes,
        replay_routes,
        router_config,
        unpack_routes,
    )
    from trajstore.integrations.trl import ROW_KEY, GRPOTrainer

    class R3GRPOTrainer(GRPOTrainer):
        """trajstore's TRL ``GRPOTrainer`` with a bf16 rollout engine and R3 in the loss forward.

        ``r3_mode``: ``baseline`` (record the training routes) or ``r3`` (replay the
        rollout's). ``capture``: a `CaptureManager` to use instead of the environment's.
        """

        def __init__(
            self,
            *args: Any,
            r3_mode: str = "baseline",
            rollout_dtype: Any = torch.bfloat16,
            capture: Any = None,
            **kwargs: Any,
        ) -> None:
            if r3_mode not in MODES:
                raise ValueError(f"r3_mode must be one of {MODES}, got {r3_mode!r}")
            kwargs.setdefault("rollout_func", bf16_rollout)
            super().__init__(*args, **kwargs)
            self.r3_mode, self.r3_rollout_dtype = r3_mode, rollout_dtype
            self.r3_generated: list[RowRoutes] | None = None
            self.r3_rows: dict[int, RowRoutes] = {}
            self.r3_capture_rows: dict[str, int] = {}  # the TRL capture's sample_id -> our row
            self._r3_next_row = 0
            self._r3_loss_inputs: dict[str, Any] | None = None
            self._r3_hooks: Any = None
            self._trajstore.manager = _RoutesCapture(capture or self._trajstore.manager, self)

        def r3_router_config(self) -> dict[str, Any]:
            return {
                **router_config(self.model),
                "mode": self.r3_mode,
                "rollout_engine": ROLLOUT_ENGINE,
                "train_engine": TRAIN_ENGINE,
            }

        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            output = super()._generate_and_score_completions(inputs)
            rows, self.r3_generated = self.r3_generated or [], None
            # a new generation batch: the earlier ones' steps have all been taken and written
            self.r3_rows.clear()
            self.r3_capture_rows.clear()
            first = self._r3_next_row
            self._r3_next_row += len(rows)
            device = output["advantages"].device
            output[ROW_COLUMN] = torch.arange(first, first + len(rows), device=device)
            for i, row in enumerate(rows):
                self.r3_rows[first + i] = row
            if ROW_KEY in output:  # the TRL capture names row r of generation g "g<g>-s<r>"
                for i, theirs in enumerate(output[ROW_KEY].tolist()):
                    generation, local = divmod(int(theirs), len(rows))
                    self.r3_capture_rows[f"g{generation}-s{local}"] = first + i
            return output

        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().training_step(*args, **kwargs)
            finally:
                self._r3_close_hooks()

        def prediction_step(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().prediction_step(*args, **kwargs)
            finally:
                self._r3_close_hooks()

        def _r3_close_hooks(self) -> None:
            if self._r3_hooks is not None:
                self._r3_hooks.__exit__(None, None, None)
                self._r3_hooks = None

        def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
            self._r3_loss_inputs = inputs
            try:
                return super()._compute_loss(model, inputs)
            finally:
                self._r3_loss_inputs = None

        def _get_per_token_logps_and_entropies(
            self, model: Any, input_ids: Any, *args: Any, **kwargs: Any
        ) -> Any:
            inputs = self._r3_loss_inputs
            if inputs is None or ROW_COLUMN not in inputs:  # not the loss forward
                return super()._get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)
            rows = [self.r3_rows[int(r)] for r in inputs[ROW_COLUMN].tolist()]
            present = self._present(inputs, rows)
            if present.shape != input_ids.shape:
                raise ValueError("trl_moe_r3: the loss forward's input is not prompt + completion")
            if self.r3_mode == "r3":
                packed = torch.cat([row.rollout for row in rows])
                hooks = replay_routes(model, unpack_routes(packed, present))
            else:
                hooks = record_routes(model)
            # open until training_step's backward has run: activation checkpointing (TRL's
            # default) recomputes the layers there, and they must execute the same experts
            self._r3_close_hooks()
            self._r3_hooks = rec = hooks.__enter__()
            result = super()._get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)
            executed, natural = rec.routes(), rec.natural_routes()
            for i, row in enumerate(rows):
                row.train = executed[i][present[i].cpu()]
                row.natural = natural[i][present[i].cpu()]
            return result

        @staticmethod
        def _present(inputs: dict[str, Any], rows: list[RowRoutes]) -> Any:
            """[b, P + C]: the tokens each row really has (prompt padding and completion
            padding excluded; a completion TRL masked as truncated still counts)."""
            prompt = inputs["prompt_mask"].bool()
            if prompt.sum(1).tolist() != [row.prompt_len for row in rows]:
                raise ValueError("trl_moe_r3: the loss batch's prompts are not the generated ones")
            width = inputs["completion_ids"].shape[1]
            lengths = torch.tensor([row.completion_len for row in rows], device=prompt.device)
            completion = torch.arange(width, device=prompt.device).unsqueeze(0) < lengths[:, None]
            return torch.cat([prompt, completion], dim=1)

    return R3GRPOTrainer


class _RoutesCapture:
    """The TRL integration's CaptureManager, whose step bundles also get routes and
    ``config.router`` (every other attribute is the manager's own)."""

    def __init__(self, manager: Any, trainer: Any):
        self._manager, self._trainer = manager, trainer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def step(self, rollout_id: int, step_id: int, *, recompute: Any = None, **kwargs: Any) -> Any:
        recompute = {**(recompute or {}), "router": self._trainer.r3_router_config()}
        inner = self._manager.step(rollout_id, step_id, recompute=recompute, **kwargs)
        return _StepWithRoutes(inner, self._trainer)


class _StepWithRoutes:
    """A `StepCapture` whose ``add`` also hands over each sample's routes and log-probs."""

    def __init__(self, inner: Any, trainer: Any):
        self._inner, self._trainer = inner, trainer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __enter__(self) -> _StepWithRoutes:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._inner.__exit__(*exc)

    def add(self, micro_batch_id: Any = None, *, samples: list, **payloads: Any) -> None:
        import torch

        from trajstore.integrations.hf_moe import route_dtype

        trainer = self._trainer
        rows = [trainer.r3_rows[trainer.r3_capture_rows[s["sample_id"]]] for s in samples]
        dtype = route_dtype(trainer.r3_router_config()["num_experts"])

        def cat(name: str) -> Any:
            return torch.from_numpy(
                torch.cat([getattr(r, name) for r in rows]).numpy().astype(dtype)
            )

        routes = {"rollout_routed_experts": cat("rollout"), "train_routed_experts": cat("train")}
        if trainer.r3_mode == "r3":
            routes["train_natural_routed_experts"] = cat("natural")
        payloads.setdefault(
            "rollout_log_probs", torch.cat([r.rollout_log_probs for r in rows]).float()
        )
        payloads.setdefault("train_log_probs", payloads["log_probs"])
        self._inner.add(micro_batch_id, samples=samples, routes=routes, **payloads)


def digit_reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """The toy task of hf_moe_r3: completion token j should be (sum(prompt) + j) mod 10."""
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        total = sum(int(d) for d in prompt.split() if d.isdigit())
        words = completion.split()
        hits = [w == str((total + j) % 10) for j, w in enumerate(words)]
        out.append(sum(hits) / 8.0)
    return out


def train_mode(mode: str, steps: int, seed: int, capture: Any, workdir: Path | str) -> Any:
    """``steps`` optimizer steps of TRL GRPO in ``mode`` (same seed, same data in both modes)."""
    import numpy as np
    from datasets import Dataset
    from trajstore.examples.hf_moe_r3 import HFMoEConfig, build_model, build_tokenizer
    from transformers import PrinterCallback
    from trl import GRPOConfig

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is "experimental"
    cfg = HFMoEConfig()
    tokenizer = build_tokenizer()
    model = build_model(cfg, tokenizer, seed)
    rng = np.random.default_rng(seed + 2)
    prompts = [{"prompt": " ".join(map(str, rng.integers(0, 10, 6)))} for _ in range(8 * steps)]
    args = GRPOConfig(
        output_dir=str(Path(workdir) / f"trl-{mode}"),
        per_device_train_batch_size=32,
        num_generations=4,
        gradient_accumulation_steps=1,
        max_completion_length=cfg.response_len,
        max_steps=steps,
        learning_rate=cfg.lr,
        logging_steps=1,
        bf16=False,
        report_to=[],
        use_vllm=False,
        seed=seed,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_pin_memory=False,
    )
    trainer = trainer_class()(
        model=model,
        reward_funcs=[digit_reward],
        args=args,
        train_dataset=Dataset.from_list(prompts),
        processing_class=tokenizer,
        r3_mode=mode,
        capture=capture,
    )
    trainer.remove_callback(PrinterCallback)  # the summary main prints is enough
    trainer.train()
    return trainer


def run_into_store(
    store_dir: Path | str,
    modes: tuple[str, ...] = MODES,
    *,
    steps: int,
    seed: int,
    prefix: str = RUN_PREFIX,
) -> dict[str, Any]:
    """Each mode from the same seed, captured into the store as run ``<prefix><mode>``."""
    import tempfile

    check_store(store_dir)
    with tempfile.TemporaryDirectory(prefix="trl-moe-r3-") as work:
        return {
            mode: capture_run(
                store_dir,
                f"{prefix}{mode}",
                functools.partial(train_mode, mode, steps, seed, workdir=work),
                require_written=True,
            )
            for mode in modes
        }


def main(argv: list[str] | None = None) -> int:
    """`python -m trajstore.examples.trl_moe_r3`: baseline and/or r3 into a store."""
    p = mode_parser(
        "TRL GRPO on a tiny transformers Qwen3-MoE with a bf16 rollout engine, baseline vs R3 "
        "(trajstore.integrations.hf_moe), captured into a store.",
        MODES,
        steps=3,
        prefix=RUN_PREFIX,
    )
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    modes = selected_modes(args, MODES)
    import warnings

    from transformers.utils import logging as hf_logging

    # transformers/TRL deprecation chatter about their own defaults, not about this run
    warnings.filterwarnings("ignore", category=FutureWarning)
    hf_logging.set_verbosity_error()

    def body() -> int:
        trainers = run_into_store(
            args.store, modes, steps=args.steps, seed=args.seed, prefix=args.prefix
        )
        for mode, trainer in trainers.items():
            losses = [f"{e['loss']:.4g}" for e in trainer.state.log_history if "loss" in e]
            print(
                f"{mode}: {args.steps} TRL GRPO steps captured into run {args.prefix + mode!r}; "
                f"TRL's logged loss per step: {', '.join(losses)}"
            )
        return 0

    return run_main("trl_moe_r3", body)


if __name__ == "__main__":
    raise SystemExit(main())
