"""Trainer mixins: capture a verl run from its driver (legacy ``RayPPOTrainer``, v1 ``PPOTrainer``).

Why mixins on ``_update_actor``: it is the one driver method that holds the whole step's
batch (scores, rewards, old/ref/rollout log-probs, advantages, returns) and that every
``update_actor`` goes through. The mixin tags the batch before verl's method runs (each
row's index and ``uid`` group, and the global step, which the actor's recording loss reads)
and hands the batch to `capture_batch` after it. The worker side is `capture_actor`,
installed on the actor worker group once the workers exist. Off (``TRAJSTORE_CAPTURE``
unset) both mixins are pass-throughs.

    class MyTrainer(RayPPOTrainerCaptureMixin, RayPPOTrainer): ...
    class MyV1Trainer(PPOTrainerCaptureMixin, PPOTrainerSync): ...

or `capturing` (a subclass made on the fly), which ``python -m
trajstore.integrations.verl.main_ppo`` uses.
"""

from __future__ import annotations

from typing import Any

import torch

from trajstore.integrations.verl import capture_batch, capture_manager, tag_batch
from trajstore.integrations.verl.actor import STEP_KEY, capture_actor

__all__ = ["PPOTrainerCaptureMixin", "RayPPOTrainerCaptureMixin", "capturing"]

#: fields the v1 trainer's TransferQueue holds that the rollout bundle reads
V1_FIELDS: tuple[str, ...] = (
    "prompts",
    "responses",
    "response_mask",
    "token_level_scores",
    "token_level_rewards",
    "old_log_probs",
    "ref_log_prob",
    "rollout_log_probs",
    "advantages",
    "returns",
    "values",
    "rollout_is_weights",
    "routed_experts",
    "uid",
)


class _CaptureMixin:
    """What both trainers share: the capture switch, the actor hook, the applied KL coef."""

    _trajstore_kl_applied: float | None = None

    def _trajstore_on(self) -> bool:
        return bool(capture_manager().enabled)

    def _trajstore_install(self) -> None:
        """Install the recording loss on the actor workers and watch the KL controller."""
        if not self._trajstore_on() or getattr(self, "_trajstore_installed", False):
            return
        self._trajstore_installed = True
        try:
            capture_actor(self.actor_rollout_wg, self.config)
        except ValueError as exc:  # e.g. distillation: the driver's bundles are still written
            capture_manager().stats.count_error(f"installing the actor capture: {exc}")
        ctrl = getattr(self, "kl_ctrl_in_reward", None)
        if ctrl is not None and hasattr(ctrl, "update"):
            original = ctrl.update

            def update(current_kl: Any, n_steps: Any) -> Any:
                # apply_kl_penalty reads ctrl.value, then updates it: the value before
                # this call is the coefficient applied to this step's rewards
                self._trajstore_kl_applied = float(ctrl.value)
                return original(current_kl, n_steps)

            ctrl.update = update


class RayPPOTrainerCaptureMixin(_CaptureMixin):
    """For verl's legacy ``verl.trainer.ppo.ray_trainer.RayPPOTrainer``."""

    def init_workers(self) -> None:
        super().init_workers()  # type: ignore[misc]
        self._trajstore_install()

    def _update_actor(self, batch: Any) -> Any:
        if not self._trajstore_on():
            return super()._update_actor(batch)  # type: ignore[misc]
        self._trajstore_install()
        step = int(self.global_steps)
        try:
            tag_batch(batch)
            batch.meta_info[STEP_KEY] = step
        except Exception:  # noqa: BLE001 - capture never raises into training
            capture_manager().stats.count_error("tagging a verl batch")
        output = super()._update_actor(batch)  # type: ignore[misc]
        capture_batch(batch, self.config, step=step, kl_coef=self._trajstore_kl_applied)
        return output


class PPOTrainerCaptureMixin(_CaptureMixin):
    """For verl's v1 ``verl.trainer.ppo.v1.PPOTrainer`` (tensors in TransferQueue)."""

    def init(self) -> None:
        super().init()  # type: ignore[misc]
        self._trajstore_install()

    def _update_actor(self, batch: Any, metrics: dict) -> Any:
        if not self._trajstore_on():
            return super()._update_actor(batch, metrics)  # type: ignore[misc]
        self._trajstore_install()
        step = int(self.global_steps)
        if batch.extra_info is None:
            batch.extra_info = {}
        batch.extra_info[STEP_KEY] = step
        output = super()._update_actor(batch, metrics)  # type: ignore[misc]
        try:
            fields = v1_fields(batch)
        except Exception:  # noqa: BLE001 - capture never raises into training
            capture_manager().stats.count_error("reading a verl v1 batch from TransferQueue")
            return output
        capture_batch(
            fields, self.config, step=step, kl_coef=self._trajstore_kl_applied, metrics=metrics
        )
        return output


def v1_fields(batch: Any) -> dict[str, Any]:
    """The v1 trainer's fields of ``batch`` from TransferQueue, padded as a ``DataProto``:
    prompts left-padded, responses and per-token fields right-padded, an attention mask."""
    import transfer_queue as tq

    names = [f for f in V1_FIELDS if batch.fields is None or f in batch.fields]
    data = tq.kv_batch_get_by_meta(batch, select_fields=names)
    out: dict[str, Any] = {}
    prompts = data["prompts"]
    responses = data["responses"]
    p_len = prompts.offsets().diff() if prompts.is_nested else None
    r_len = responses.offsets().diff() if responses.is_nested else None
    padded_prompts = _left_pad(prompts) if prompts.is_nested else prompts
    padded_responses = responses.to_padded_tensor(0) if responses.is_nested else responses
    out["prompts"], out["responses"] = padded_prompts, padded_responses
    if p_len is not None and r_len is not None:
        width_p, width_r = padded_prompts.shape[1], padded_responses.shape[1]
        cols_p, cols_r = torch.arange(width_p), torch.arange(width_r)
        out["attention_mask"] = torch.cat(
            [
                (cols_p.unsqueeze(0) >= (width_p - p_len).unsqueeze(1)).long(),
                (cols_r.unsqueeze(0) < r_len.unsqueeze(1)).long(),
            ],
            dim=1,
        )
    for name in names:
        if name in ("prompts", "responses") or name not in data.keys():  # noqa: SIM118
            continue
        value = data[name]
        if isinstance(value, torch.Tensor):
            out[name] = value.to_padded_tensor(0) if value.is_nested else value
        else:
            out[name] = list(value) if not hasattr(value, "tolist") else value.tolist()
    return out


def _left_pad(nested: torch.Tensor) -> torch.Tensor:
    rows = nested.unbind()
    width = max(int(r.shape[0]) for r in rows)
    out = torch.zeros(len(rows), width, dtype=nested.dtype)
    for i, row in enumerate(rows):
        out[i, width - row.shape[0] :] = row
    return out


def capturing(trainer_cls: type) -> type:
    """``trainer_cls`` with the matching capture mixin in front (legacy or v1)."""
    mixin = RayPPOTrainerCaptureMixin
    if any(base.__name__ == "PPOTrainer" for base in trainer_cls.__mro__):
        mixin = PPOTrainerCaptureMixin
    if issubclass(trainer_cls, mixin):
        return trainer_cls
    return type(f"Capturing{trainer_cls.__name__}", (mixin, trainer_cls), {})
