"""A tiny real MoE GRPO run on the CPU: rollout in bfloat16, training in float32.

Why: route mismatch between a rollout engine and a trainer is a property of
real numerics, not something to fake. Here the "rollout engine" is a
bfloat16 copy of the policy (the same weights, a different numeric path) and
the trainer runs float32, so top-k boundaries flip exactly as they do between
vLLM/SGLang and Megatron, only smaller. Modes:

- ``baseline``: training routes with its own router (observe only);
- ``r3``: training executes the rollout's routes (rollout routing replay);
  gate weights are the training router's softmax at the replayed experts,
  renormalised over top-k, so the router still gets a gradient.

``train_routed_experts`` is what the MoE layers actually dispatched to (read
inside the layer, never copied from the replay target), and in r3 mode
``train_natural_routed_experts`` records what the training router would have
chosen. Every step is written as a step-level bundle with route and log-prob
payloads, ``config.router`` lineage and the producer's own metrics under
expected.json ``router.consistency``.

torch is imported inside functions, so importing this module stays cheap.

    python -m trajstore.examples.moe_grpo --store /tmp/moe.store --mode both --steps 20 --seed 0
    trajstore router compare --store /tmp/moe.store --run baseline --run r3 --plot compare.png
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from trajstore.examples.runs import capture_run, mode_parser, selected_modes

from trajstore.router.metrics import compute_router_metrics

MODES = ("baseline", "r3")
ROLLOUT_ENGINE = "moe_toy-bf16"
TRAIN_ENGINE = "moe_toy-fp32"


@dataclass
class ToyConfig:
    """Model, task and GRPO settings (defaults: a 2-layer, 8-expert, top-2 model)."""

    vocab: int = 16
    d_model: int = 32
    n_heads: int = 2
    n_layers: int = 2
    n_experts: int = 8
    top_k: int = 2
    d_expert: int = 64
    prompt_len: int = 4
    response_len: int = 8
    prompts_per_step: int = 4
    samples_per_prompt: int = 8
    lr: float = 1e-2
    eps_clip: float = 0.2


@dataclass
class StepRecord:
    """What one GRPO step produced (numpy, ready for a bundle)."""

    step: int
    tokens: np.ndarray  # [N, P + R] int64
    rewards: np.ndarray  # [N]
    rollout_routes: np.ndarray  # [T, L, K] uint8
    train_routes: np.ndarray  # [T, L, K] uint8, executed
    natural_routes: np.ndarray  # [T, L, K] uint8, what the training router chose
    rollout_log_probs: np.ndarray  # [R_total] float32
    train_log_probs: np.ndarray  # [R_total] float32
    advantages: np.ndarray  # [N] float32, group-normalised reward (GRPO)
    loss: float
    metrics: dict[str, Any] = field(default_factory=dict)


@functools.cache
def _modules() -> Any:
    """Build the torch module classes once, on first use."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class MoE(nn.Module):
        def __init__(self, cfg: ToyConfig):
            super().__init__()
            self.k = cfg.top_k
            self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
            self.w1 = nn.Parameter(torch.randn(cfg.n_experts, cfg.d_model, cfg.d_expert) * 0.2)
            self.w2 = nn.Parameter(torch.randn(cfg.n_experts, cfg.d_expert, cfg.d_model) * 0.2)

        def forward(self, x, replay=None):  # noqa: ANN001, ANN201
            logits = self.router(x)  # [B, S, E]
            natural = torch.topk(logits, self.k, dim=-1).indices
            idx = natural if replay is None else replay.to(torch.long)
            probs = torch.softmax(logits, dim=-1)
            gates = probs.gather(-1, idx)
            gates = gates / gates.sum(-1, keepdim=True)
            # Every expert on every token (8 tiny experts): simpler than dispatch, same math.
            h = F.gelu(torch.einsum("bsd,edh->bseh", x, self.w1))
            out = torch.einsum("bseh,ehd->bsed", h, self.w2)  # [B, S, E, D]
            picked = out.gather(2, idx.unsqueeze(-1).expand(*idx.shape, out.shape[-1]))
            y = (gates.unsqueeze(-1) * picked).sum(2)
            return y, idx, natural

    class Block(nn.Module):
        def __init__(self, cfg: ToyConfig):
            super().__init__()
            self.h = cfg.n_heads
            self.ln1 = nn.LayerNorm(cfg.d_model)
            self.ln2 = nn.LayerNorm(cfg.d_model)
            self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
            self.proj = nn.Linear(cfg.d_model, cfg.d_model)
            self.moe = MoE(cfg)

        def forward(self, x, replay=None):  # noqa: ANN001, ANN201
            b, s, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k, v = (t.view(b, s, self.h, d // self.h).transpose(1, 2) for t in (q, k, v))
            att = (q @ k.transpose(-1, -2)) / (d // self.h) ** 0.5
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            att = att.masked_fill(causal, float("-inf")).softmax(-1)
            x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, d))
            y, idx, natural = self.moe(self.ln2(x), replay)
            return x + y, idx, natural

    class TinyMoE(nn.Module):
        """Decoder-only transformer whose every feed-forward is a top-k MoE."""

        def __init__(self, cfg: ToyConfig):
            super().__init__()
            self.cfg = cfg
            self.emb = nn.Embedding(cfg.vocab, cfg.d_model)
            self.pos = nn.Parameter(
                torch.randn(cfg.prompt_len + cfg.response_len, cfg.d_model) * 0.1
            )
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
            self.ln = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab)

        def forward(self, tokens, replay=None):  # noqa: ANN001, ANN201
            """Logits [B, S, V], executed routes and natural routes [B, S, L, K]."""
            x = self.emb(tokens) + self.pos[: tokens.shape[1]]
            executed, natural = [], []
            for i, blk in enumerate(self.blocks):
                x, idx, nat = blk(x, None if replay is None else replay[:, :, i])
                executed.append(idx)
                natural.append(nat)
            return self.head(self.ln(x)), torch.stack(executed, 2), torch.stack(natural, 2)

    return TinyMoE


def build_model(cfg: ToyConfig, seed: int) -> Any:
    """A freshly initialised TinyMoE (float32), deterministic in ``seed``."""
    import torch

    torch.manual_seed(seed)
    return _modules()(cfg)


def task_reward(tokens: np.ndarray, cfg: ToyConfig) -> np.ndarray:
    """Verifiable toy task: response token j should be (sum(prompt) + j) mod vocab."""
    p = tokens[:, : cfg.prompt_len]
    r = tokens[:, cfg.prompt_len :]
    target = (p.sum(1, keepdims=True) + np.arange(cfg.response_len)) % cfg.vocab
    return (r == target).mean(1).astype(np.float32)


def _selected_log_probs(logits: Any, tokens: Any, prompt_len: int) -> Any:
    """log p(token_t | < t) of the response tokens: [B, R] float32."""
    import torch

    lp = torch.log_softmax(logits[:, prompt_len - 1 : -1].float(), dim=-1)
    return lp.gather(-1, tokens[:, prompt_len:].unsqueeze(-1)).squeeze(-1)


def rollout(policy: Any, prompts: Any, cfg: ToyConfig, gen: Any) -> tuple[Any, Any, Any]:
    """The "rollout engine": a bfloat16 copy of the weights samples responses.

    Returns tokens [B, P+R], its routes [B, P+R, L, K] and response log-probs
    [B, R] from one final forward over the finished sequences (what a
    capture of prefill + decode records, in this engine's numerics).
    """
    import copy

    import torch

    engine = copy.deepcopy(policy).to(torch.bfloat16)
    with torch.no_grad():
        seq = prompts
        for _ in range(cfg.response_len):
            logits, _, _ = engine(seq)
            probs = torch.softmax(logits[:, -1].float(), dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen)
            seq = torch.cat([seq, nxt], dim=1)
        logits, routes, _ = engine(seq)
        logp = _selected_log_probs(logits, seq, cfg.prompt_len)
    return seq, routes, logp


def _flat(x: Any) -> np.ndarray:
    """[B, S, ...] -> [B*S, ...] numpy, sample-major (the bundle's flat token order)."""
    a = x.detach().cpu().numpy()
    return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def grpo_step(
    policy: Any,
    opt: Any,
    cfg: ToyConfig,
    mode: str,
    step: int,
    gen: Any,
    data_rng: np.random.Generator,
) -> StepRecord:
    """One rollout + one GRPO update; the record holds what a capture needs."""
    import torch

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    n = cfg.prompts_per_step * cfg.samples_per_prompt
    prompts_np = data_rng.integers(0, cfg.vocab, size=(cfg.prompts_per_step, cfg.prompt_len))
    prompts = torch.as_tensor(
        np.repeat(prompts_np, cfg.samples_per_prompt, axis=0), dtype=torch.long
    )
    tokens, r_routes, r_logp = rollout(policy, prompts, cfg, gen)
    rewards = task_reward(tokens.numpy(), cfg)

    logits, executed, natural = policy(tokens, replay=r_routes if mode == "r3" else None)
    logp = _selected_log_probs(logits, tokens, cfg.prompt_len)  # [N, R]
    grouped = torch.as_tensor(rewards).view(cfg.prompts_per_step, cfg.samples_per_prompt)
    adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(
        n, 1
    )
    ratio = torch.exp(logp - logp.detach())
    clipped = ratio.clamp(1 - cfg.eps_clip, 1 + cfg.eps_clip)
    loss = -torch.minimum(ratio * adv, clipped * adv).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return StepRecord(
        step=step,
        tokens=tokens.numpy(),
        rewards=rewards,
        rollout_routes=_flat(r_routes).astype(np.uint8),
        train_routes=_flat(executed).astype(np.uint8),
        natural_routes=_flat(natural).astype(np.uint8),
        rollout_log_probs=r_logp.detach().numpy().reshape(-1).astype(np.float32),
        train_log_probs=logp.detach().numpy().reshape(-1).astype(np.float32),
        advantages=adv.reshape(-1).numpy().astype(np.float32),
        loss=float(loss.detach()),
    )


def producer_metrics(rec: StepRecord, cfg: ToyConfig) -> dict[str, Any]:
    """The producer's own router.consistency record: rollout vs *executed* routes."""
    n = rec.tokens.shape[0]
    m = compute_router_metrics(
        rec.rollout_routes,
        rec.train_routes,
        total_lengths=[cfg.prompt_len + cfg.response_len] * n,
        response_lengths=[cfg.response_len] * n,
        loss_masks=[[1] * cfg.response_len] * n,
        num_experts=cfg.n_experts,
        num_layers=cfg.n_layers,
        top_k=cfg.top_k,
        rollout_log_probs=rec.rollout_log_probs,
        train_log_probs=rec.train_log_probs,
    )
    # No hang_count / engine_error_count: the toy runs no rollout engine that could hang or
    # fail, so it measures neither; compare shows them as null (not recorded), not as a 0.
    return m.to_dict()


def sample_records(rec: StepRecord, cfg: ToyConfig) -> list[dict[str, Any]]:
    """index.json sample records of one step (the GRPO advantage is the post-processed reward)."""
    total, resp = cfg.prompt_len + cfg.response_len, cfg.response_len
    return [
        {
            "sample_id": f"s-{i}",
            "group_index": i // cfg.samples_per_prompt,
            "response_length": resp,
            "total_length": total,
            "loss_mask": [1] * resp,
            "reward": float(rec.advantages[i]),
            "raw_reward": float(rec.rewards[i]),
        }
        for i in range(rec.tokens.shape[0])
    ]


def step_contents(rec: StepRecord, cfg: ToyConfig, mode: str, run: str) -> Any:
    """A step-level BundleContents for one GRPO step (rollout_id = step, step_id = 0)."""
    from trajstore.bundle.writer import BundleContents, default_stage_contracts

    samples = [{**s, "micro_batch_id": "mb-0000"} for s in sample_records(rec, cfg)]
    weight = f"w-{rec.step}"
    payloads: dict[str, Any] = {
        "rollout_routed_experts": rec.rollout_routes,
        "train_routed_experts": rec.train_routes,
        "rollout_log_probs": rec.rollout_log_probs,
        "train_log_probs": rec.train_log_probs,
    }
    if mode == "r3":
        payloads["train_natural_routed_experts"] = rec.natural_routes
    expected = {"router.consistency": rec.metrics or producer_metrics(rec, cfg)}
    contracts = default_stage_contracts(set(payloads), expected, samples)
    return BundleContents(
        bundle_id=f"{run}-{rec.step}-0",
        identity={
            "actor_step_id": {"rollout_id": rec.step, "step_id": 0},
            "rollout_id": None,
            "micro_batch_ids": ["mb-0000"],
            "semantic_group_ids": sorted({f"g-{s['group_index']}" for s in samples}),
            "weight_lineage": {"rollout_weight": weight, "actor_weight": weight},
            "rank": {"dp": 1, "tp": 1, "pp": 1, "cp": 1},
        },
        samples=samples,
        config=recompute_config(cfg, mode, rec.step),
        payloads=payloads,
        expected=expected,
        stage_contracts=contracts,
        producer={"commit": "moe_toy", "dirty_patch_digest": "", "torch_version": _torch_version()},
    )


def recompute_config(cfg: ToyConfig, mode: str, step: int) -> dict[str, Any]:
    """index.json config: GRPO settings plus config.router (router lineage)."""
    weight = f"w-{step}"
    return {
        "advantage_estimator": "grpo",
        "n_samples_per_prompt": cfg.samples_per_prompt,
        "eps_clip": cfg.eps_clip,
        "router": {
            "num_experts": cfg.n_experts,
            "num_layers": cfg.n_layers,
            "top_k": cfg.top_k,
            "mode": mode,
            "rollout_engine": ROLLOUT_ENGINE,
            "train_engine": TRAIN_ENGINE,
            "rollout_weight": weight,
            "train_weight": weight,
        },
    }


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


#: called once per step with (record, config, mode, run)
StepSink = Callable[[StepRecord, ToyConfig, str, str], None]


def run_toy(
    mode: str,
    steps: int,
    seed: int,
    sink: StepSink | None = None,
    cfg: ToyConfig | None = None,
    run: str | None = None,
) -> list[StepRecord]:
    """Train ``steps`` GRPO steps in ``mode``; hand every step's bundle to ``sink``.

    The same ``seed`` gives the same initial weights, prompts and sampling
    stream in every mode, so baseline and r3 differ only in routing.
    """
    import torch

    cfg = cfg or ToyConfig()
    policy = build_model(cfg, seed)
    opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(seed + 1)
    data_rng = np.random.default_rng(seed + 2)
    records = []
    for step in range(steps):
        rec = grpo_step(policy, opt, cfg, mode, step, gen, data_rng)
        rec.metrics = producer_metrics(rec, cfg)
        if sink is not None:
            sink(rec, cfg, mode, run or mode)
        records.append(rec)
    return records


def dir_sink(capture_dir: Path | str) -> StepSink:
    """Write each step as ``<capture_dir>/replay-<R>-0/`` with the producer's own
    router.consistency metrics in expected.json."""
    from trajstore.bundle.capture_dir import step_dir_name
    from trajstore.bundle.writer import write_bundle

    root = Path(capture_dir)

    def write(rec: StepRecord, cfg: ToyConfig, mode: str, run: str) -> None:
        write_bundle(root / step_dir_name(rec.step, 0), step_contents(rec, cfg, mode, run))

    return write


def capture_sink(manager: Any) -> StepSink:
    """Hand each step to a `trajstore.capture.CaptureManager` (asynchronous).

    CaptureManager records routes, log-probs, config.router, the GRPO inputs
    (log-probs, advantages) and the producer's own router.consistency metrics.
    """
    import torch

    def write(rec: StepRecord, cfg: ToyConfig, mode: str, run: str) -> None:
        resp = cfg.response_len
        samples = sample_records(rec, cfg)
        routes = {
            "rollout_routed_experts": torch.from_numpy(rec.rollout_routes),
            "train_routed_experts": torch.from_numpy(rec.train_routes),
        }
        if mode == "r3":
            routes["train_natural_routed_experts"] = torch.from_numpy(rec.natural_routes)
        train_lp = torch.from_numpy(rec.train_log_probs)
        weight = f"w-{rec.step}"
        with manager.step(
            rec.step,
            0,
            recompute=recompute_config(cfg, mode, rec.step),
            weight_lineage={"rollout_weight": weight, "actor_weight": weight},
        ) as step:
            step.add(
                0,
                samples=samples,
                log_probs=train_lp,
                old_log_probs=train_lp,  # on-policy: one update per rollout
                advantages=torch.from_numpy(np.repeat(rec.advantages, resp)),
                routes=routes,
                rollout_log_probs=torch.from_numpy(rec.rollout_log_probs),
                train_log_probs=train_lp,
            )
            step.router_consistency(rec.metrics or producer_metrics(rec, cfg))

    return write


def config_dict(cfg: ToyConfig) -> dict[str, Any]:
    return asdict(cfg)


def run_into_store(
    store_dir: Path | str,
    modes: tuple[str, ...] = MODES,
    *,
    steps: int,
    seed: int,
    via: str = "capture",
    cfg: ToyConfig | None = None,
) -> dict[str, list[StepRecord]]:
    """Run each mode from the same seed and put every step into the store as run ``<mode>``.

    ``via="capture"``: through CaptureManager straight into the store (its
    writer thread publishes each step). ``via="dir"``: bundle directories with
    the producer's own router.consistency metrics, then `Store.ingest`.
    """
    out: dict[str, list[StepRecord]] = {}
    store_dir = Path(store_dir)
    for mode in modes:
        if via == "capture":

            def train(manager: Any, mode: str = mode) -> list[StepRecord]:
                return run_toy(mode, steps, seed, capture_sink(manager), cfg, run=mode)

            out[mode] = capture_run(store_dir, mode, train)
        elif via == "dir":
            import tempfile

            from trajstore.store import Store

            with tempfile.TemporaryDirectory(prefix=f"moe-{mode}-") as tmp:
                out[mode] = run_toy(mode, steps, seed, dir_sink(tmp), cfg, run=mode)
                with Store.open(store_dir) as store:
                    refused = [o for o in store.ingest([tmp], run=mode) if o.status == "refused"]
                if refused:
                    raise RuntimeError(f"ingest refused: {refused[0].reason}")
        else:
            raise ValueError(f"via must be 'capture' or 'dir', got {via!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m trajstore.examples.moe_grpo`: run the modes into a store."""
    p = mode_parser(
        "Tiny MoE GRPO run (bf16 rollout, fp32 training) captured into a trajstore store.",
        MODES,
        steps=20,
    )
    p.add_argument(
        "--via",
        choices=("capture", "dir"),
        default="capture",
        help=(
            "capture: CaptureManager into the store; "
            "dir: bundle dirs with producer metrics + ingest"
        ),
    )
    args = p.parse_args(argv)
    modes = selected_modes(args, MODES)
    records = run_into_store(args.store, modes, steps=args.steps, seed=args.seed, via=args.via)
    for mode, recs in records.items():
        mis = [r.metrics["route_mismatch_rate"] for r in recs]
        reward = float(np.mean([r.rewards.mean() for r in recs]))
        print(
            f"{mode}: {len(recs)} steps into run {mode!r}; producer route_mismatch_rate "
            f"{min(mis):.4g}-{max(mis):.4g}; mean task reward {reward:.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
