"""Capture for Hugging Face TRL: a drop-in ``GRPOTrainer`` that records what its loss consumed.

Why a subclass and not a ``TrainerCallback``: a callback never sees the batch,
the advantages or the log-probs. The subclass wraps five methods of TRL 1.16's
``GRPOTrainer`` (``_generate``, ``_calculate_rewards``,
``_generate_and_score_completions``, ``_get_per_token_logps_and_entropies``,
``_compute_loss``), calls TRL's own code unchanged and copies to the CPU what
it returned; it draws no random number, touches no parameter and builds no
graph, so training is bit-identical with capture on or off.

Usage (docs/integrations.md)::

    from trajstore.integrations.trl import GRPOTrainer   # instead of: from trl import GRPOTrainer
    TRAJSTORE_CAPTURE=1 TRAJSTORE_CAPTURE_DIR=capture/ python train.py

Per generation batch one rollout bundle (rewards per function, weights,
advantages; ``replay-rollout-<g>``), per optimizer step one step bundle
(``replay-<g>-<step>``: log-probs, entropies, masks, the loss of every
micro-batch and TRL's logged metrics), TRL's padded [B, L] tensors packed per
sample. The config that determines the math is written with the loss-family
keys of replay-math.md, so ``trajstore replay DIR`` recomputes TRL's loss.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from trajstore.capture import CaptureManager
from trajstore.integrations.adapter import (
    FrameworkAdapter,
    SampleIds,
    StepRecord,
    cpu,
    group_of_position,
    keep_mask,
    micro_batch_id,
    pack,
    per_token,
    write_step,
)
from trajstore.replay.losses import CPU_SUM_ORDERS, METRIC_FIELDS
from trajstore.vocab import Stage

logger = logging.getLogger("trajstore.capture")

#: the TRL release whose GRPOTrainer internals this module wraps (others: a warning)
TESTED_TRL = "1.16"
#: the key the capture adds to TRL's generation batch: each row's global index
ROW_KEY = "trajstore_row"
#: the metrics TRL logs per micro-batch that replay recomputes (and the MoE aux loss)
LOGGED_METRICS: tuple[str, ...] = (*METRIC_FIELDS, "aux_loss")

__all__ = ["GRPOTrainer", "ROW_KEY", "TRL", "trl_recompute_config"]


class TrlAdapter(FrameworkAdapter):
    """TRL (``pip install 'trajstore[trl]'``): its ``GRPOTrainer``'s settings as the
    loss-family keys of replay-math.md."""

    name = "TRL"
    module = "trl"
    extra = "trl"
    tested = TESTED_TRL

    def recompute_config(self, source: Any, **options: Any) -> dict[str, Any]:
        return trl_recompute_config(source)


TRL = TrlAdapter()
trl = TRL.require()


def reward_sum_order(device: torch.device) -> str | None:
    """How torch summed the rewards' group means and stds on ``device``: the CPU kernel's
    SIMD width, which fixes its order of additions; None where the order is not replayed
    (CUDA, or a CPU capability not listed in `CPU_SUM_ORDERS`)."""
    if device.type != "cpu":
        return None
    return CPU_SUM_ORDERS.get(torch.backends.cpu.get_cpu_capability())


def _trl_loss_frame() -> Any:
    """The frame of TRL's own ``GRPOTrainer._compute_loss`` that called the loss forward.

    Why a frame: TRL keeps the per-token KL its loss adds in a local variable and logs only
    its mean; reading that local after the call returns records the KL the loss used, as TRL
    computed it (bias-corrected or not), instead of a formula of ours. Subclasses may sit
    between (the R3 example), so the stack is searched a few frames up.
    """
    code = trl.GRPOTrainer._compute_loss.__code__
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None or frame.f_code is code:
            return frame
        frame = frame.f_back
    return None


def _trl_local(frame: Any, name: str) -> torch.Tensor:
    """A tensor local of TRL's finished ``_compute_loss`` frame (an error if it is not there)."""
    value = None if frame is None else frame.f_locals.get(name)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"TRL's _compute_loss has no tensor {name!r} (TRL {trl.__version__}?)")
    return value


def trl_recompute_config(trainer: trl.GRPOTrainer) -> dict[str, Any]:
    """TRL's settings that determine the math, as loss-family config keys (replay-math.md)."""
    args = trainer.args
    use_is = bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction)
    beta = float(trainer.beta)
    return {
        "advantage_estimator": "grpo",
        "n_samples_per_prompt": int(trainer.num_generations),
        "reward_scale": str(trainer.scale_rewards),
        "reward_std_eps": 1e-4,
        "reward_sum_order": reward_sum_order(trainer.accelerator.device),
        "reward_aggregation": str(trainer.multi_objective_aggregation),
        "reward_weights": [float(w) for w in trainer.reward_weights.tolist()],
        "policy_loss": str(trainer.loss_type),
        "importance_sampling_level": str(trainer.importance_sampling_level),
        "eps_clip": float(trainer.epsilon_low),
        "eps_clip_high": float(trainer.epsilon_high),
        "delta": None if args.delta is None else float(args.delta),
        "use_kl_loss": beta != 0.0,
        "kl_loss_coef": beta,
        "kl_loss_type": "k3",
        "use_unbiased_kl": bool(args.use_bias_correction_kl),
        "entropy_coef": float(trainer.entropy_coef) if trainer._entropy_bonus_enabled else 0.0,
        "top_entropy_quantile": float(trainer.top_entropy_quantile),
        "mask_truncated_completions": bool(trainer.mask_truncated_completions),
        "max_response_length": int(trainer.max_completion_length),
        "gradient_accumulation_steps": int(trainer.current_gradient_accumulation_steps),
        "steps_per_generation": int(args.steps_per_generation),
        "sapo_temperature_pos": float(args.sapo_temperature_pos),
        "sapo_temperature_neg": float(args.sapo_temperature_neg),
        "off_policy_mask_threshold": None
        if trainer.off_policy_mask_threshold is None
        else float(trainer.off_policy_mask_threshold),
        "is_correction": str(trainer.vllm_importance_sampling_mode) if use_is else None,
        "is_clip_min": None
        if not use_is or trainer.vllm_importance_sampling_clip_min is None
        else float(trainer.vllm_importance_sampling_clip_min),
        "is_clip_max": None
        if not use_is or trainer.vllm_importance_sampling_clip_max is None
        else float(trainer.vllm_importance_sampling_clip_max),
        "aux_loss_coef": float(trainer.router_aux_loss_coef) if trainer.aux_loss_enabled else None,
    }


@dataclass
class _Generation:
    """What one generation batch produced, kept until its rows are consumed."""

    index: int
    prompt_lengths: list[int]
    completion_lengths: list[int]
    group_size: int
    rewards_per_func: torch.Tensor | None = None
    raw_rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None


@dataclass
class _PendingStep:
    """The micro-batches of the optimizer step being captured."""

    rollout_id: int
    step_id: int
    recompute: dict[str, Any]
    micro_batches: list[dict[str, Any]] = field(default_factory=list)


class _TrlCapture:
    """The capture state of one trainer: the manager and what is pending."""

    def __init__(self) -> None:
        self.manager = CaptureManager.from_env()
        self.generations: dict[int, _Generation] = {}
        self.next_generation = 0
        self.pending_generation: _Generation | None = None
        self.step: _PendingStep | None = None
        self.in_loss = False
        self.forward: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None
        #: the frame of TRL's own ``_compute_loss`` running now (its locals are read on return)
        self.loss_frame: Any = None

    @property
    def enabled(self) -> bool:
        return self.manager.enabled


class GRPOTrainer(trl.GRPOTrainer):
    """TRL's ``GRPOTrainer``, same constructor, capturing replay bundles when capture is on.

    Capture is configured like `CaptureManager.from_env` (``TRAJSTORE_CAPTURE=1`` and
    ``TRAJSTORE_CAPTURE_DIR`` or ``TRAJSTORE_CAPTURE_STORE``); off, every wrapper is a
    pass-through. ``trajstore_capture.close()`` flushes (it also runs at interpreter exit
    and at the end of ``train()``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._trajstore = _TrlCapture()
        if self._trajstore.enabled:
            TRL.warn_untested(str(trl.__version__))
        if self._trajstore.enabled and self.accelerator.num_processes > 1:
            # rewards are gathered over processes, advantages are not: not captured yet
            logger.warning("trajstore: TRL capture supports one process; capture is off")
            self._trajstore.manager.close()

    @property
    def trajstore_capture(self) -> CaptureManager:
        """The capture manager (``close()`` returns its counters)."""
        return self._trajstore.manager

    def _capturing(self) -> bool:
        return self._trajstore.enabled and self.model.training

    # ---- generation -----------------------------------------------------------

    def _generate(self, prompts: list) -> Any:
        output = super()._generate(prompts)
        if self._capturing():
            state = self._trajstore
            state.pending_generation = _Generation(
                index=state.next_generation,
                prompt_lengths=[len(ids) for ids in output[0]],
                completion_lengths=[len(ids) for ids in output[1]],
                group_size=int(self.num_generations),
            )
            state.next_generation += 1
        return output

    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any, ids: Any) -> Any:
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, ids)
        generation = self._trajstore.pending_generation
        if self._capturing() and generation is not None:
            generation.rewards_per_func = cpu(rewards_per_func)
        return rewards_per_func

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        output = super()._generate_and_score_completions(inputs)
        generation = self._trajstore.pending_generation
        self._trajstore.pending_generation = None
        if not self._capturing() or generation is None:
            return output
        try:
            self._capture_rollout(generation, output)
            rows = len(generation.completion_lengths)
            output[ROW_KEY] = torch.arange(rows, device=output["advantages"].device) + (
                generation.index * rows
            )
        except Exception:  # noqa: BLE001 - capture never raises into training
            self.trajstore_capture.stats.count_error("capturing a TRL generation batch")
        return output

    def _capture_rollout(self, generation: _Generation, output: dict[str, Any]) -> None:
        weights = cpu(self.reward_weights).to(torch.float32)
        per_func = generation.rewards_per_func
        if per_func is None:
            raise ValueError("no rewards were captured for this generation batch")
        raw = (per_func * weights.unsqueeze(0)).nansum(dim=1)
        raw[torch.isnan(per_func).all(dim=1)] = torch.nan
        generation.raw_rewards = raw
        generation.advantages = cpu(output["advantages"])
        state = self._trajstore
        state.generations[generation.index] = generation
        # a step's rows come from the newest buffer (or, across a boundary, the one before)
        keep_from = generation.index - 1
        if state.step is not None:
            keep_from = min(keep_from, state.step.rollout_id)
        for index in [index for index in state.generations if index < keep_from]:
            del state.generations[index]
        lengths = torch.tensor(generation.completion_lengths)
        keep = keep_mask(lengths, output["completion_ids"].shape[1])
        mask = output["completion_mask"]
        if "tool_mask" in output:
            mask = mask * output["tool_mask"]
        samples = [
            self._sample_record(generation, row)
            for row in range(len(generation.completion_lengths))
        ]
        payloads: dict[str, Any] = {
            "advantages": per_token(generation.advantages, lengths),
            "loss_mask": pack(mask, keep),
        }
        if output.get("old_per_token_logps") is not None:
            payloads["old_log_probs"] = pack(output["old_per_token_logps"], keep)
        if output.get("ref_per_token_logps") is not None:
            payloads["ref_log_probs"] = pack(output["ref_per_token_logps"], keep)
        self.trajstore_capture.rollout(
            generation.index,
            samples,
            raw_rewards=raw,
            rewards=generation.advantages,
            recompute=trl_recompute_config(self),
            expected={
                Stage.REWARD_RAW: {
                    "rewards_per_func": [
                        [None if value != value else value for value in row]
                        for row in per_func.tolist()
                    ]
                }
            },
            **payloads,
        )

    def _sample_record(self, generation: _Generation, row: int) -> dict[str, Any]:
        rows = len(generation.completion_lengths)
        return {
            "sample_id": f"g{generation.index}-s{row}",
            "group_index": group_of_position(generation.index, row, rows, generation.group_size),
            "response_length": generation.completion_lengths[row],
            "total_length": generation.prompt_lengths[row] + generation.completion_lengths[row],
        }

    # ---- the loss -------------------------------------------------------------

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
        result = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self._trajstore.in_loss:
            self._trajstore.loss_frame = _trl_loss_frame()
            logps, entropies, aux_loss = result
            self._trajstore.forward = (
                cpu(logps),
                None if entropies is None else cpu(entropies),
                None if aux_loss is None else cpu(aux_loss),
            )
        return result

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        if not self._capturing() or ROW_KEY not in inputs:
            return super()._compute_loss(model, inputs)
        state = self._trajstore
        metrics = self._metrics["train"]
        before = {name: len(metrics[name]) for name in LOGGED_METRICS if name in metrics}
        recompute = trl_recompute_config(self) if state.step is None else None
        if recompute is not None and self.use_adaptive_entropy:
            applied = (
                self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0
            )
            recompute["entropy_coef"] = float(applied)
        state.in_loss, state.forward, state.loss_frame = True, None, None
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            state.in_loss = False
        try:
            self._capture_micro_batch(inputs, loss, metrics, before, recompute)
        except Exception:  # noqa: BLE001 - capture never raises into training
            state.step = None
            self.trajstore_capture.stats.count_error("capturing a TRL micro-batch")
        finally:
            state.loss_frame = None  # it holds the loss's locals: let them go now
        if self.accelerator.sync_gradients and state.step is not None:
            step, state.step = state.step, None
            try:
                self._write_step(step)
            except Exception:  # noqa: BLE001 - capture never raises into training
                self.trajstore_capture.stats.count_error("writing a TRL step")
        return loss

    def _capture_micro_batch(
        self,
        inputs: dict[str, Any],
        loss: torch.Tensor,
        metrics: dict[str, list],
        before: dict[str, int],
        recompute: dict[str, Any] | None,
    ) -> None:
        state = self._trajstore
        if state.forward is None:
            raise ValueError("the loss's forward pass was not observed")
        logps, entropies, aux_loss = state.forward
        rows = cpu(inputs[ROW_KEY]).tolist()
        if state.step is None:
            if recompute is None:
                raise ValueError("a micro-batch arrived without an open step")
            first = self._generation_of(rows[0])
            state.step = _PendingStep(first, int(self.state.global_step), recompute)
        old = inputs.get("old_per_token_logps")
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        logged = {
            name: float(metrics[name][-1])
            for name in LOGGED_METRICS
            if name in metrics and len(metrics[name]) > before.get(name, 0)
        }
        per_token_kl = None
        if self.beta != 0.0:
            per_token_kl = _trl_local(state.loss_frame, "per_token_kl")
        generation_tokens = None
        if self.loss_type in ("cispo", "dapo", "vespo"):
            # TRL's divisor is this count * accumulation / steps_per_generation (one process);
            # replay recomputes the count when the step holds the generation batch whole
            generation_tokens = float(cpu(inputs["num_items_in_batch"]))
        state.step.micro_batches.append(
            {
                "rows": rows,
                "log_probs": logps,
                "old_log_probs": logps if old is None else cpu(old),
                "entropy": entropies,
                "ref_log_probs": None
                if inputs.get("ref_per_token_logps") is None
                else cpu(inputs["ref_per_token_logps"]),
                "kl": None if per_token_kl is None else cpu(per_token_kl),
                "rollout_log_probs": None
                if inputs.get("sampling_per_token_logps") is None
                else cpu(inputs["sampling_per_token_logps"]),
                "mask": cpu(mask),
                "loss": float(cpu(loss)),
                "aux_loss": None if aux_loss is None else float(aux_loss),
                "generation_loss_tokens": generation_tokens,
                "logged": logged,
            }
        )

    def _generation_of(self, row: int) -> int:
        for index, generation in self._trajstore.generations.items():
            size = len(generation.completion_lengths)
            if index * size <= row < (index + 1) * size:
                return index
        raise KeyError(f"row {row} belongs to no captured generation batch")

    def _write_step(self, step: _PendingStep) -> None:
        generations = self._trajstore.generations
        records: dict[str, dict[str, Any]] = {}
        micro_batches = []
        ids = SampleIds()
        for number, mb in enumerate(step.micro_batches):
            mb_id = micro_batch_id(number)
            samples, lengths = [], []
            for row in mb["rows"]:
                generation = generations[self._generation_of(row)]
                local = row - generation.index * len(generation.completion_lengths)
                sample = self._sample_record(generation, local)
                # num_iterations > 1: one step consumes a row again
                sample["sample_id"] = ids(sample["sample_id"], row)
                sample["reward"] = float(generation.advantages[local])
                raw = float(generation.raw_rewards[local])
                if raw == raw:
                    sample["raw_reward"] = raw
                samples.append(sample)
                lengths.append(generation.completion_lengths[local])
            length = torch.tensor(lengths)
            keep = keep_mask(length, mb["log_probs"].shape[1])
            advantages = torch.tensor([sample["reward"] for sample in samples])
            payloads = {
                "log_probs": mb["log_probs"][keep],
                "old_log_probs": mb["old_log_probs"][keep],
                "entropy": mb["entropy"][keep],
                "advantages": per_token(advantages, length),
                "loss_mask": mb["mask"][keep],
            }
            if mb["ref_log_probs"] is not None:
                payloads["ref_log_probs"] = mb["ref_log_probs"][keep]
            if mb["kl"] is not None:  # TRL's own per-token KL, bias-corrected or not
                payloads["kl"] = mb["kl"].expand_as(mb["log_probs"])[keep]
            if mb["rollout_log_probs"] is not None:
                payloads["rollout_log_probs"] = mb["rollout_log_probs"][keep]
            micro_batches.append({"mb_id": mb_id, "samples": samples, "payloads": payloads})
            record = {"loss": mb["loss"], **mb["logged"]}
            if mb["aux_loss"] is not None:
                record["aux_loss"] = mb["aux_loss"]
            if mb["generation_loss_tokens"] is not None:
                record["generation_loss_tokens"] = mb["generation_loss_tokens"]
            records[mb_id] = record
        expected = {
            "loss": sum(record["loss"] for record in records.values()),
            "micro_batches": records,
        }
        record = StepRecord(step.rollout_id, step.step_id, micro_batches, expected, step.recompute)
        write_step(self.trajstore_capture, record)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's ``train``; afterwards every captured bundle is flushed to its destination."""
        try:
            return super().train(*args, **kwargs)
        finally:
            if self._trajstore.enabled:
                self._trajstore.manager.close()
