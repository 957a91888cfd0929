"""The actor side of verl capture: a recording loss installed through ``set_loss_fn``.

Why the loss: verl's engine calls the worker's loss once per micro-batch with the model's
output (new log-probs, entropy) and the micro-batch (old log-probs, advantages, masks, the
global batch sizes its aggregation divides by). ``set_loss_fn`` is public and reaches every
worker, so wrapping the worker's own loss records what it consumed and produced without
patching verl. The wrapper calls verl's loss first and returns its result untouched; it
copies to the CPU, draws no random number and builds no graph, so parameters are
bit-identical with capture on or off.

Each process (every Ray worker) keeps its own records and writes its own shard of each
step bundle (``rank``/``producer_ranks`` of `trajstore.capture`; the cohort is published
when every data-parallel rank's shard is in). A step bundle is written as soon as its
mini-batch (one optimizer step) has been consumed, counted by rows:
``global_batch_size / dp_size`` rows per rank.

MoE models: ``routes="record"`` keeps `trajstore.integrations.hf_moe` hooks on the actor's
module and stores the experts each micro-batch's forward executed (``train_routed_experts``)
beside the rollout's (``rollout_routed_experts``, the batch's ``routed_experts``);
`RecordingLoss.forced_routes` forces given routes in the training forward (R3 for verl's
FSDP engine, which has no router replay of its own).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from trajstore.integrations.adapter import cpu, write_step
from trajstore.integrations.verl.records import (
    GROUP_KEY,
    ROW_KEY,
    MicroBatchRecord,
    step_records,
    step_settings,
)

logger = logging.getLogger("trajstore.capture")

#: the non-tensor field (from the driver's ``meta_info``) carrying verl's global step
STEP_KEY = "trajstore_step"

__all__ = ["STEP_KEY", "RecordingLoss", "capture_actor"]


def _field(data: Any, name: str, default: Any = None) -> Any:
    """A non-tensor field of a verl ``TensorDict`` (``NonTensorData`` unwrapped)."""
    from verl.utils import tensordict_utils as tu

    try:
        return tu.get_non_tensor_data(data=data, key=name, default=default)
    except (KeyError, AttributeError, TypeError):
        return default


def _dense(data: Any, name: str) -> torch.Tensor | None:
    if name not in data.keys():  # noqa: SIM118 - a TensorDict's keys
        return None
    value = data[name]
    if getattr(value, "is_nested", False):
        value = value.to_padded_tensor(0.0)
    return value


@dataclass
class _State:
    """One process's capture state (never pickled: each Ray worker makes its own)."""

    manager: Any
    step: int | None = None
    updates: int = 0
    optimizer_step: int = 0
    rows_in_step: int = 0
    #: rows consumed in this update_actor call (an untagged batch's row ids: no shuffle)
    rows_in_update: int = 0
    pending: list[MicroBatchRecord] = field(default_factory=list)
    pending_routes: list[dict[str, torch.Tensor]] = field(default_factory=list)
    routing: Any = None
    router: dict[str, Any] | None = None
    #: this update_actor call's `step_settings` (the config read at its first flush)
    settings: dict[str, Any] | None = None


class RecordingLoss:
    """verl's loss, recording each training micro-batch it computes (picklable for Ray).

    ``inner``: the worker's own loss (``partial(ppo_loss, config=actor_config)``);
    ``config``: the trainer's whole config (or ``actor_rollout_ref``), for the bundle's
    ``config.verl``; ``routes``: ``"record"`` to store the actor's executed MoE routes.
    """

    def __init__(self, inner: Any, config: Any = None, *, routes: str | None = None):
        if routes not in (None, "record"):
            raise ValueError(f"routes must be None or 'record', not {routes!r}")
        self.inner = inner
        self.config = config
        self.routes = routes
        self._state: _State | None = None
        self._module: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_state"] = None
        state["_module"] = None
        return state

    # ---- the loss -------------------------------------------------------------

    def __call__(self, model_output: Any, data: Any, dp_group: Any = None) -> Any:
        loss, metrics = self.inner(model_output=model_output, data=data, dp_group=dp_group)
        if torch.is_grad_enabled():  # verl's forward-only passes (log-probs) are not steps
            state = self._state_or_none()
            if state is not None:
                try:
                    self._record(state, model_output, data, loss, metrics, dp_group)
                except Exception:  # noqa: BLE001 - capture never raises into training
                    state.pending.clear()
                    state.pending_routes.clear()
                    state.manager.stats.count_error("capturing a verl micro-batch")
        return loss, metrics

    def _state_or_none(self) -> _State | None:
        if self._state is None:
            from trajstore.integrations.verl import capture_manager

            self._state = _State(capture_manager(**rank_overrides()))
        return self._state if self._state.manager.enabled else None

    def _record(
        self, state: _State, model_output: Any, data: Any, loss: Any, metrics: Any, dp_group: Any
    ) -> None:
        from verl.workers.utils.padding import no_padding_2_padding

        step = _field(data, STEP_KEY)
        step = state.updates + 1 if step is None else int(step)
        if state.step is not None and step != state.step:
            self._flush(state)  # a new update_actor call: whatever is left was its own step
            state.optimizer_step, state.rows_in_step, state.rows_in_update = 0, 0, 0
            state.settings = None  # the config is read again, once, for the new call
        state.step = step
        log_probs = no_padding_2_padding(model_output["log_probs"], data)
        entropy = model_output.get("entropy") if hasattr(model_output, "get") else None
        if entropy is not None:
            entropy = no_padding_2_padding(entropy, data)
        response_mask = _dense(data, "response_mask")
        rows_in = int(response_mask.shape[0])
        rows = _dense(data, ROW_KEY)
        groups = _dense(data, GROUP_KEY)
        prompts = _dense(data, "prompts")
        attention = _dense(data, "attention_mask")
        lengths = None
        if prompts is not None and attention is not None:
            lengths = attention[:, prompts.shape[1] :].sum(-1).tolist()
        actor_config = getattr(self.inner, "keywords", {}).get("config")
        dp_size = int(_field(data, "dp_size", 1) or 1)
        global_batch = _field(data, "global_batch_size")
        optional = {  # each field read once: a TensorDict lookup is tens of microseconds
            name: _dense(data, key)
            for name, key in (
                ("ref_log_probs", "ref_log_prob"),
                ("rollout_log_probs", "rollout_log_probs"),
                ("rollout_is_weights", "rollout_is_weights"),
            )
        }
        row_ids = (
            cpu(rows).tolist()
            if rows is not None
            else list(range(state.rows_in_update, state.rows_in_update + rows_in))
        )
        record = MicroBatchRecord(
            rows=row_ids,
            log_probs=cpu(log_probs).float(),
            old_log_probs=cpu(_dense(data, "old_log_probs")).float(),
            advantages=cpu(_dense(data, "advantages")).float(),
            response_mask=cpu(response_mask),
            loss=float(cpu(loss)),
            metrics={name: _metric(value) for name, value in dict(metrics or {}).items()},
            entropy=None if entropy is None else cpu(entropy).float(),
            **{name: None if v is None else cpu(v).float() for name, v in optional.items()},
            groups=row_ids if groups is None else cpu(groups).tolist(),  # untagged: own group
            response_lengths=None if lengths is None else [int(x) for x in lengths],
            optimizer_step=state.optimizer_step,
            dp_size=dp_size,
            batch_num_tokens=_field(data, "batch_num_tokens"),
            global_batch_size=global_batch,
            loss_scale_factor=getattr(actor_config, "loss_scale_factor", None),
            dp_rank=_dp_rank(dp_group),
        )
        state.pending.append(record)
        routes = self._routes(state, data)
        if routes and prompts is not None and attention is not None:
            routes["_prompt_lengths"] = attention[:, : prompts.shape[1]].sum(-1)
        state.pending_routes.append(routes)
        state.rows_in_step += rows_in
        state.rows_in_update += rows_in
        per_rank = None if global_batch is None else int(global_batch) // dp_size
        if per_rank and state.rows_in_step >= per_rank:
            self._flush(state)
            state.optimizer_step += 1
            state.rows_in_step = 0
        if bool(_field(data, "update_lr_scheduler", False)) and not state.pending:
            state.updates += 1  # the last mini-batch of this update_actor call is done

    def _routes(self, state: _State, data: Any) -> dict[str, torch.Tensor]:
        """This micro-batch's routes as ``[T, L, K]`` over its samples' real tokens."""
        out: dict[str, torch.Tensor] = {}
        if state.routing is None:
            return out
        calls = state.routing._calls
        if not calls:
            return out
        executed = state.routing.routes()[:, -calls[-1].seq :]  # the last forward: this one
        natural = state.routing.natural_routes()[:, -calls[-1].seq :]
        if state.routing._replay is None:  # forced routes are consumed along the calls
            state.routing._calls.clear()  # keep memory flat (cleared when forcing ends)
        out["train_routed_experts"] = executed.reshape(-1, *executed.shape[2:]).to(torch.int32)
        if state.routing._replay is not None:
            out["train_natural_routed_experts"] = natural.reshape(-1, *natural.shape[2:]).to(
                torch.int32
            )
        rollout = data.get("routed_experts", None) if hasattr(data, "get") else None
        if rollout is not None:
            values = rollout.values() if getattr(rollout, "is_nested", False) else rollout
            out["rollout_routed_experts"] = cpu(values).to(torch.int32)
        return out

    def _flush(self, state: _State) -> None:
        records, routes = state.pending, state.pending_routes
        state.pending, state.pending_routes = [], []
        if not records or state.step is None:
            return
        manager = state.manager
        try:
            if state.settings is None:
                state.settings = step_settings(self.config)
            steps = step_records(records, self.config, step=state.step, settings=state.settings)
            by_record = iter(routes)
            for step in steps:
                recompute = dict(step.recompute)
                if state.router is not None:
                    recompute["router"] = dict(state.router)
                for mb in step.micro_batches:
                    mb_routes = dict(next(by_record, {}))
                    prompt_lengths = mb_routes.pop("_prompt_lengths", None)
                    if prompt_lengths is not None:
                        for sample, p in zip(mb["samples"], prompt_lengths.tolist(), strict=True):
                            sample["total_length"] = int(p) + sample["response_length"]
                    extra = {}
                    if "rollout_log_probs" not in mb["payloads"] and mb_routes:
                        extra["rollout_log_probs"] = mb["payloads"]["old_log_probs"]
                    if mb_routes:
                        extra["train_log_probs"] = mb["payloads"]["log_probs"]
                    mb["payloads"] = {**mb["payloads"], **extra}
                    mb["routes"] = mb_routes or None
                write_step(manager, step, recompute)
        except Exception:  # noqa: BLE001 - capture never raises into training
            manager.stats.count_error("writing a verl step")

    # ---- MoE routes -----------------------------------------------------------

    def attach_routes(self, module: Any) -> None:
        """Keep `hf_moe` hooks on ``module`` (the actor's model) for the recording's life."""
        from trajstore.integrations.hf_moe import MoERouting, router_config

        state = self._state_or_none()
        if state is None:
            return
        state.routing = MoERouting(module).__enter__()
        state.router = {**router_config(module), "mode": "baseline"}
        self._module = module

    @contextlib.contextmanager
    def forced_routes(self, routes: torch.Tensor) -> Iterator[None]:
        """Force ``routes`` ``[1, S, L, K]`` (every training forward's real tokens, in order)
        in the actor's forwards inside the block: R3 with the rollout's experts."""
        state = self._state_or_none()
        if state is None or state.routing is None:
            raise RuntimeError("forced_routes needs capture on and routes='record'")
        routing = state.routing
        routing._calls.clear()
        routing._replay = routing._check_replay(torch.as_tensor(routes))
        state.router = {**(state.router or {}), "mode": "r3"}
        try:
            yield
        finally:
            routing._replay = None
            routing._calls.clear()


def _metric(value: Any) -> Any:
    """A logged value of verl's loss as a number (a ``Metric`` holds this micro-batch's)."""
    values = getattr(value, "values", None)
    if isinstance(values, list):
        return float(values[-1]) if len(values) == 1 else float(value.aggregate())
    return float(cpu(value)) if isinstance(value, torch.Tensor) else value


def rank_overrides() -> dict[str, Any]:
    """This process's rank among the actor's ranks, for its manager's first (only) creation:
    with several ranks each writes its own shard (``rank-<r>/``) of every step bundle."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return {"rank": dist.get_rank(), "producer_ranks": range(dist.get_world_size())}
    return {}


def _dp_rank(dp_group: Any) -> int:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return int(dist.get_rank(group=dp_group)) if dp_group is not None else int(dist.get_rank())


def _own_loss(worker: Any, config: Any) -> Any:
    """The loss the worker uses now: a local ``ActorRolloutRefWorker``'s actor's, a local
    ``TrainingWorker``'s, or (a Ray worker group, whose workers are elsewhere) verl's
    ``ppo_loss`` on the actor config, as ``init_model`` builds it."""
    actor = getattr(worker, "actor", None)
    if actor is not None and hasattr(actor, "loss_fn") and actor.loss_fn is not None:
        return actor.loss_fn
    if hasattr(worker, "engine") and getattr(worker, "loss_fn", None) is not None:
        return worker.loss_fn
    if config is None:
        raise ValueError("capture_actor on a worker group needs the trainer config")
    from verl.trainer.distillation import is_distillation_enabled

    if is_distillation_enabled(config.get("distillation")):  # its loss is not ppo_loss
        raise ValueError("capture_actor on a worker group does not support distillation")
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss

    node = config.actor_rollout_ref.actor if "actor_rollout_ref" in config else config.actor
    return partial(ppo_loss, config=omega_conf_to_dataclass(node))


def capture_actor(
    worker: Any, config: Any = None, *, routes: str | None = None
) -> RecordingLoss | None:
    """Install a `RecordingLoss` on ``worker`` through verl's public ``set_loss_fn``.

    ``worker``: an ``ActorRolloutRefWorker`` or ``TrainingWorker`` (in this process, after
    ``init_model``) or the trainer's ``actor_rollout_wg`` (Ray: every worker gets a copy
    and writes its own shard). ``config``: the trainer's whole config (needed for a worker
    group; otherwise used for the bundle's ``config.verl``). Does nothing and returns None
    unless capture is on (``TRAJSTORE_CAPTURE=1``); installing twice is a no-op.
    """
    from trajstore.integrations.verl import capture_manager, require_verl

    require_verl()
    if not capture_manager(**rank_overrides()).enabled:
        return None
    inner = _own_loss(worker, config)
    if isinstance(inner, RecordingLoss):
        return inner
    if config is None:
        config = {"actor_rollout_ref": getattr(worker, "config", None)}
    loss = RecordingLoss(inner, config, routes=routes)
    if routes == "record":
        module = _local_module(worker)
        if module is None:
            raise ValueError("routes='record' needs a worker in this process")
        loss.attach_routes(module)
    worker.set_loss_fn(loss)
    return loss


def _local_module(worker: Any) -> Any:
    actor = getattr(worker, "actor", worker)
    engine = getattr(actor, "engine", None)
    return getattr(engine, "module", None)
