"""Record and replay the experts a transformers MoE model routes each token to (R3).

Why hooks on the router modules: in transformers 5 every supported MoE block
calls one router module, ``(router_logits, scores, indices) = gate(hidden)``,
and hands ``indices``/``scores`` to its experts. A forward hook on that module
sees the top-k ids the model chose (recording) and may return other ids with
gates recomputed from the same logits (replay), without copying or patching
any model code. A forward pre-hook on the model itself tells which forward
call (prefill, each decode step, a training forward) the router calls belong
to and its ``[B, S]`` shape, so routes come back as ``[B, S, L, K]`` in the
layout of the model's input (L = MoE layers in module order, K = top-k).

Routes of a padded batch are packed into the bundle format's ``[T, L, K]``
(every real token of every sample, samples in order) by `pack_routes`.

    with record_routes(policy) as rec:
        out = policy(input_ids=seq, attention_mask=mask)
    train_routes = rec.routes()                       # [B, S, L, K] executed

    gen = generate_with_routes(engine, input_ids=ids, attention_mask=mask, max_new_tokens=8)
    with replay_routes(policy, gen.routes) as rec:    # R3: force the rollout's experts
        out = policy(input_ids=gen.sequences, attention_mask=gen.attention_mask)
    rec.routes(), rec.natural_routes()                # executed (= replayed), router's own

Only router classes whose selection math is known are touched (`SUPPORTED_ROUTERS`):
softmax over the router logits in float32, top-k, and renormalisation over the
top-k when the model does it. Any other model is refused with
`UnsupportedMoEModel`, never half-hooked. torch is imported lazily.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trajstore.errors import UsageError
from trajstore.integrations.adapter import FrameworkAdapter, pack, route_dtype

__all__ = [
    "SUPPORTED_ROUTERS",
    "Generation",
    "MoERouting",
    "HF_MOE",
    "UnsupportedMoEModel",
    "find_routers",
    "generate_with_routes",
    "pack_routes",
    "record_routes",
    "replay_routes",
    "route_dtype",
    "router_config",
    "unpack_routes",
]

#: router class name -> whether its top-k gates are renormalised: the name of the
#: router attribute that says so, or a constant (read from transformers 5.x sources;
#: each family is exercised by tests/test_hf_moe_r3.py)
SUPPORTED_ROUTERS: Mapping[str, str | bool] = {
    "Qwen3MoeTopKRouter": "norm_topk_prob",
    "Qwen2MoeTopKRouter": "norm_topk_prob",
    "OlmoeTopKRouter": "norm_topk_prob",
    "MixtralTopKRouter": True,
}


class UnsupportedMoEModel(UsageError):
    """The model has no router module whose top-k selection this integration knows."""


def find_routers(model: Any) -> list[Any]:
    """The model's router modules in module order (one per MoE layer).

    Raises `UnsupportedMoEModel` when it has none of `SUPPORTED_ROUTERS`, or
    when it mixes them with router-like modules of an unknown class (those
    could not be forced, so replay would be partial).
    """
    routers, unknown = [], set()
    for module in model.modules():
        name = type(module).__name__
        if name in SUPPORTED_ROUTERS:
            routers.append(module)
        elif "router" in name.lower():
            unknown.add(name)
    model_name = type(model).__name__
    if unknown:
        raise UnsupportedMoEModel(
            f"hf_moe: {model_name} has router module(s) {', '.join(sorted(unknown))} whose "
            f"top-k selection hf_moe does not know; supported: {', '.join(SUPPORTED_ROUTERS)}"
        )
    if not routers:
        raise UnsupportedMoEModel(
            f"hf_moe: {model_name} has no supported MoE router module "
            f"(supported: {', '.join(SUPPORTED_ROUTERS)})"
        )
    return routers


def router_config(model: Any) -> dict[str, int]:
    """Sizes for a bundle's ``config.router``: num_experts, num_layers (MoE layers), top_k."""
    routers = find_routers(model)
    return {
        "num_experts": int(routers[0].num_experts),
        "num_layers": len(routers),
        "top_k": int(routers[0].top_k),
    }


class HFMoEAdapter(FrameworkAdapter):
    """A transformers MoE model: its router settings as ``config.router``."""

    name = "transformers"
    module = "transformers"
    extra = "trl"

    def recompute_config(self, source: Any, **options: Any) -> dict[str, Any]:
        return {"router": {**router_config(source), **options}}


HF_MOE = HFMoEAdapter()


@dataclass
class _Call:
    """One forward call of the model: its [B, S] and each layer's [B*S, K] ids."""

    batch: int
    seq: int
    offset: int  # position of this call's first token along S of the concatenated routes
    executed: dict[int, Any] = field(default_factory=dict)
    natural: dict[int, Any] = field(default_factory=dict)


class MoERouting:
    """Hooks on a model's routers that record, and optionally replay, top-k expert ids.

    A context manager: hooks are installed on enter and removed on exit, even
    on error. ``replay`` is ``[B, S, L, K]`` integer ids in the layout of the
    model's input (several forward calls, e.g. prefill and decode steps,
    consume it along S in order); a row of ``-1`` leaves that (token, layer)
    to the model's own router (padding). Under replay the gates are the
    training router's softmax at the replayed experts, renormalised when the
    model renormalises, so the router keeps its gradient.

    A router call outside the model's own forward (activation checkpointing
    recomputes a layer during backward) reuses the routes of the last call and
    is not recorded again.
    """

    def __init__(self, model: Any, replay: Any = None):
        import torch

        self.model = model
        self.routers = find_routers(model)
        self._layer = {id(r): i for i, r in enumerate(self.routers)}
        self._top_k = int(self.routers[0].top_k)
        self._num_experts = int(self.routers[0].num_experts)
        self._replay = None
        if replay is not None:
            self._replay = self._check_replay(torch.as_tensor(replay))
        self._calls: list[_Call] = []
        self._open: _Call | None = None
        self._handles: list[Any] = []

    def _check_replay(self, routes: Any) -> Any:
        import torch

        n_layers = len(self.routers)
        if routes.dim() != 4 or routes.shape[2:] != (n_layers, self._top_k):
            raise ValueError(
                f"hf_moe: replay routes must be [B, S, {n_layers}, {self._top_k}], "
                f"got {list(routes.shape)}"
            )
        if routes.dtype.is_floating_point or routes.dtype == torch.bool:
            raise ValueError(f"hf_moe: replay routes must be integer ids, got {routes.dtype}")
        routes = routes.to(torch.long)
        pad = (routes == -1).all(-1)
        real = routes[~pad]
        if real.numel() and (real.min() < 0 or real.max() >= self._num_experts):
            raise ValueError(
                f"hf_moe: replay expert ids must lie in [0, {self._num_experts}) or be a "
                "whole row of -1 (not replayed)"
            )
        if real.numel() and (real.sort(-1).values.diff(dim=-1) == 0).any():
            raise ValueError("hf_moe: a replayed top-k row repeats an expert id")
        return routes

    # ---- hooks ----------------------------------------------------------------

    def _model_pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        x = kwargs.get("input_ids")
        if x is None and args:
            x = args[0]
        if x is None:
            x = kwargs.get("inputs_embeds")
        if x is None:
            raise ValueError("hf_moe: the model was called without input_ids or inputs_embeds")
        batch, seq = int(x.shape[0]), int(x.shape[1])
        offset = self._calls[-1].offset + self._calls[-1].seq if self._calls else 0
        replay = self._replay
        if replay is not None and (batch != replay.shape[0] or offset + seq > replay.shape[1]):
            raise ValueError(
                f"hf_moe: replay routes {list(replay.shape[:2])} do not cover a "
                f"forward of [{batch}, {seq}] at position {offset}"
            )
        self._open = _Call(batch, seq, offset)
        self._calls.append(self._open)

    def _model_post(self, *_: Any) -> None:
        self._open = None

    def _router_post(self, module: Any, args: tuple, output: Any) -> Any:
        import torch

        if not (isinstance(output, tuple) and len(output) == 3):
            raise RuntimeError(
                f"hf_moe: {type(module).__name__} returned {type(output).__name__}, expected "
                "(router_logits, scores, indices); this transformers version is not supported"
            )
        logits, scores, natural = output
        layer = self._layer[id(module)]
        call = self._open
        recompute = call is None
        if recompute:  # activation checkpointing: the same routes as the last forward
            if not self._calls:
                raise RuntimeError("hf_moe: a router ran outside any forward of the model")
            call = self._calls[-1]
        if natural.shape[0] != call.batch * call.seq:
            raise RuntimeError(
                f"hf_moe: router of layer {layer} saw {natural.shape[0]} tokens, the forward "
                f"has {call.batch}x{call.seq}"
            )
        executed = natural
        if self._replay is not None:
            forced = self._replay[:, call.offset : call.offset + call.seq, layer]
            forced = forced.reshape(-1, self._top_k).to(natural.device)
            keep = (forced == -1).all(-1, keepdim=True)
            executed = torch.where(keep, natural, forced)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            gates = probs.gather(-1, executed)
            if self._renormalise(module):
                gates = gates / gates.sum(-1, keepdim=True)
            output = (logits, gates.to(scores.dtype), executed)
        if not recompute:
            call.executed[layer] = executed.detach().to("cpu", copy=True)
            call.natural[layer] = natural.detach().to("cpu", copy=True)
        return output if self._replay is not None else None

    @staticmethod
    def _renormalise(router: Any) -> bool:
        rule = SUPPORTED_ROUTERS[type(router).__name__]
        return bool(getattr(router, rule)) if isinstance(rule, str) else rule

    # ---- context --------------------------------------------------------------

    def __enter__(self) -> MoERouting:
        try:
            self._handles.append(
                self.model.register_forward_pre_hook(self._model_pre, with_kwargs=True)
            )
            self._handles.append(self.model.register_forward_hook(self._model_post))
            for router in self.routers:
                self._handles.append(router.register_forward_hook(self._router_post))
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *_: Any) -> None:
        self._remove()

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._open = None

    # ---- results --------------------------------------------------------------

    def _stack(self, which: str) -> Any:
        import torch

        if not self._calls:
            raise ValueError("hf_moe: no forward of the model ran under these hooks")
        batch = self._calls[0].batch
        parts = []
        for i, call in enumerate(self._calls):
            layers = getattr(call, which)
            if call.batch != batch or sorted(layers) != list(range(len(self.routers))):
                raise ValueError(
                    f"hf_moe: forward call {i} ran {len(layers)} of {len(self.routers)} MoE "
                    f"layers on batch {call.batch} (first call: {batch})"
                )
            per_layer = [layers[j].view(call.batch, call.seq, self._top_k) for j in sorted(layers)]
            parts.append(torch.stack(per_layer, dim=2))
        return torch.cat(parts, dim=1)

    def routes(self) -> Any:
        """Executed top-k ids ``[B, S, L, K]`` (int64) over every recorded forward call."""
        return self._stack("executed")

    def natural_routes(self) -> Any:
        """What the model's own routers chose ``[B, S, L, K]`` (equals `routes` without replay)."""
        return self._stack("natural")

    @property
    def calls(self) -> list[tuple[int, int]]:
        """``(B, S)`` of each recorded forward call, in order."""
        return [(c.batch, c.seq) for c in self._calls]


def record_routes(model: Any) -> MoERouting:
    """Context manager recording the experts ``model`` routes each token to."""
    return MoERouting(model)


def replay_routes(model: Any, routes: Any) -> MoERouting:
    """Context manager forcing ``routes`` ``[B, S, L, K]`` in the forward (recording too)."""
    return MoERouting(model, replay=routes)


@dataclass
class Generation:
    """What `generate_with_routes` returns; every tensor is in ``sequences``' layout."""

    sequences: Any  # [B, S] prompt + generated tokens
    attention_mask: Any  # [B, S] 1 on real tokens (prompt padding and post-EOS padding are 0)
    routes: Any  # [B, S, L, K] the experts the generating model chose for every position
    logits: Any  # [B, S - P, V] float32 logits that produced each generated token
    prompt_length: int  # P (the padded prompt width)


def generate_with_routes(
    model: Any, *, input_ids: Any, attention_mask: Any, **generate_kwargs: Any
) -> Generation:
    """``model.generate`` with its routes recorded for every token, prompt and response.

    Why one more forward: generation never feeds its last token back, so that
    token has no route yet; the routes a training forward needs cover it. One
    cached decode step (what the engine runs when it appends the token to its
    KV cache) routes it in the generating model's own numerics.
    """
    import torch

    config = generate_kwargs.get("generation_config") or model.generation_config
    beams = generate_kwargs.get("num_beams", config.num_beams) or 1
    assisted = generate_kwargs.get("assistant_model") is not None or generate_kwargs.get(
        "prompt_lookup_num_tokens"
    )
    if beams > 1 or assisted:
        raise ValueError(
            "hf_moe: generate_with_routes needs one route per token of each row; beam search "
            "and assisted decoding reorder or discard tokens and are not supported"
        )
    pad_id = generate_kwargs.pop("pad_token_id", None)
    if pad_id is None:
        pad_id = model.generation_config.pad_token_id
    with torch.no_grad(), MoERouting(model) as rec:
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            return_dict_in_generate=True,
            output_logits=True,
            use_cache=True,
            pad_token_id=pad_id,
            **generate_kwargs,
        )
        seq = out.sequences
        prompt_len = int(input_ids.shape[1])
        # num_return_sequences > 1: generate repeats each prompt row that many times
        copies = seq.shape[0] // input_ids.shape[0]
        prompt_mask = attention_mask.to(seq.device).repeat_interleave(copies, dim=0)
        eos = _eos_ids(model, generate_kwargs)
        mask = torch.cat([prompt_mask, _generated_mask(seq[:, prompt_len:], eos)], dim=1)
        # the mask generate itself attends with: prompt padding 0, every generated column 1
        seen = torch.cat([prompt_mask, torch.ones_like(seq[:, prompt_len:])], dim=1)
        position = (seen.cumsum(-1) - 1).clamp(min=0)[:, -1:]
        model(
            input_ids=seq[:, -1:],
            attention_mask=seen,
            position_ids=position,
            cache=_cache_of(out),
            use_cache=True,
        )
    routes = rec.routes()
    if routes.shape[:2] != seq.shape:
        raise ValueError(
            f"hf_moe: generate routed {list(routes.shape[:2])} tokens for sequences "
            f"{list(seq.shape)}; this generation mode is not supported"
        )
    logits = torch.stack([step.float() for step in out.logits], dim=1)
    return Generation(seq, mask, routes, logits, prompt_len)


def _cache_of(out: Any) -> Any:
    """generate's KV cache (``cache`` in transformers 5; ``past_key_values`` is its deprecated
    name, read only when the new one is absent)."""
    cache = out.get("cache")
    return out.past_key_values if cache is None else cache


def _eos_ids(model: Any, generate_kwargs: Mapping[str, Any]) -> list[int]:
    """The EOS ids generate stopped on: its ``eos_token_id`` argument, else the generation
    config it was given, else the model's."""
    eos = generate_kwargs.get("eos_token_id")
    if eos is None:
        config = generate_kwargs.get("generation_config") or model.generation_config
        eos = config.eos_token_id
    return [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


def _generated_mask(generated: Any, eos_ids: list[int]) -> Any:
    """1 up to and including each row's first EOS, 0 after it (HF pads finished rows)."""
    import torch

    if not eos_ids:
        return torch.ones_like(generated)
    is_eos = torch.isin(generated, torch.as_tensor(eos_ids, device=generated.device))
    after = (is_eos.cumsum(-1) - is_eos.long()) > 0  # strictly after the first EOS
    return (~after).to(generated.dtype)


def pack_routes(routes: Any, mask: Any, num_experts: int) -> np.ndarray:
    """``[B, S, L, K]`` -> the bundle's ``[T, L, K]``: the real tokens (mask 1) of each
    sample in order, as `route_dtype` of ``num_experts``."""
    import torch

    r = torch.as_tensor(routes).detach().cpu()
    m = torch.as_tensor(mask).detach().cpu().bool()
    if r.shape[:2] != m.shape:
        raise ValueError(f"hf_moe: routes {list(r.shape)} and mask {list(m.shape)} differ")
    packed = pack(r, m).numpy()
    if packed.size and packed.min() < 0:
        raise ValueError("hf_moe: a real token has no route (-1) to pack")
    if packed.size and packed.max() >= num_experts:
        raise ValueError(f"hf_moe: an expert id is >= num_experts ({num_experts})")
    return packed.astype(route_dtype(num_experts))


def unpack_routes(packed: Any, mask: Any) -> Any:
    """The bundle's ``[T, L, K]`` -> ``[B, S, L, K]`` int64 in ``mask``'s layout, ``-1`` on padding
    (a replay leaves those to the model's router)."""
    import torch

    m = torch.as_tensor(mask).detach().cpu().bool()
    p = torch.as_tensor(np.asarray(packed).astype(np.int64))
    if p.shape[0] != int(m.sum()):
        raise ValueError(f"hf_moe: {p.shape[0]} packed tokens, the mask has {int(m.sum())}")
    out = torch.full((*m.shape, *p.shape[1:]), -1, dtype=torch.long)
    out[m] = p
    return out
