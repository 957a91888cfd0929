"""R3 on a real transformers MoE model: GRPO on a tiny Qwen3-MoE, bf16 rollout, fp32 training.

Why a plain loop: this example shows trajstore.integrations.hf_moe on the
model family real MoE RL runs use (Qwen3-MoE, built from a config, nothing
downloaded), with the route capture at both ends: the "rollout engine" is a
bfloat16 copy of the policy that generates with `generate_with_routes` (every
prompt and response token's experts, recorded during generation), and the
trainer runs float32. Modes, from the same seed and data:

- ``baseline``: the training forward routes with its own router (recorded);
- ``r3``: the training forward executes the rollout's experts (`replay_routes`),
  gates from the training router's softmax at those experts, renormalised as
  Qwen3-MoE does; what its router would have chosen is stored as
  ``train_natural_routed_experts``.

Each step goes through `CaptureManager` into a store, as runs
``<prefix>baseline`` and ``<prefix>r3``, with the loss metrics the replay
engine recomputes (loss.policy) and the producer's own router.consistency.
torch and transformers are imported inside functions.

    python -m trajstore.examples.hf_moe_r3 --store /tmp/hf.store --steps 4 --seed 0
    trajstore router compare --store /tmp/hf.store --run hf-baseline --run hf-r3
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from trajstore.examples.runs import (
    capture_run,
    check_store,
    mode_parser,
    run_main,
    selected_modes,
)

from trajstore.router.metrics import compute_router_metrics

MODES = ("baseline", "r3")
RUN_PREFIX = "hf-"
DIGITS = [str(d) for d in range(10)]
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
ROLLOUT_ENGINE = "transformers-generate-bf16"
TRAIN_ENGINE = "transformers-fp32"


@dataclass
class HFMoEConfig:
    """Model (a tiny Qwen3-MoE: 2 layers, hidden 64, 8 experts, top-2), task and GRPO settings."""

    hidden_size: int = 64
    n_layers: int = 2
    n_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 32
    prompt_len: int = 6
    response_len: int = 8
    prompts_per_step: int = 4
    samples_per_prompt: int = 4
    lr: float = 3e-3
    eps_clip: float = 0.2


@dataclass
class StepRecord:
    """One GRPO step, as numpy in the bundle's flat layouts."""

    step: int
    rewards: np.ndarray  # [N] raw task reward
    advantages: np.ndarray  # [N] group-normalised reward
    rollout_routes: np.ndarray  # [T, L, K] experts the bf16 generation chose
    train_routes: np.ndarray  # [T, L, K] experts the fp32 training forward executed
    natural_routes: np.ndarray  # [T, L, K] what the training router chose
    rollout_log_probs: np.ndarray  # [R_total] float32
    train_log_probs: np.ndarray  # [R_total] float32
    entropy: np.ndarray  # [R_total] float32
    loss_metrics: dict[str, float]
    metrics: dict[str, Any] = field(default_factory=dict)


def build_tokenizer() -> Any:
    """An offline WordLevel tokenizer over digits and four specials (no hub)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + DIGITS)}
    core = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
    )


def build_model(cfg: HFMoEConfig, tokenizer: Any, seed: int) -> Any:
    """A freshly initialised float32 Qwen3MoeForCausalLM, deterministic in ``seed``."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=2 * cfg.hidden_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=cfg.hidden_size // 4,
        num_experts=cfg.n_experts,
        num_experts_per_tok=cfg.top_k,
        norm_topk_prob=True,
        max_position_embeddings=2 * (cfg.prompt_len + cfg.response_len),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config)


def task_reward(prompts: np.ndarray, responses: list[list[str]]) -> np.ndarray:
    """Verifiable toy task: response token j should be the digit (sum(prompt) + j) mod 10."""
    out = []
    for digits, resp in zip(prompts, responses, strict=True):
        target = [str((int(digits.sum()) + j) % 10) for j in range(len(resp))]
        out.append(np.mean([a == b for a, b in zip(resp, target, strict=True)]))
    return np.asarray(out, dtype=np.float32)


def _sum_of_sample_mean(x: Any) -> Any:
    """docs/replay-math.md: per-sample means over the (all-valid) response, summed."""
    return x.mean(dim=1).sum()


def grpo_step(
    policy: Any,
    opt: Any,
    tokenizer: Any,
    cfg: HFMoEConfig,
    mode: str,
    step: int,
    data_rng: np.random.Generator,
) -> StepRecord:
    """One bf16 rollout (routes recorded during generation) and one fp32 GRPO update."""
    import copy

    import torch

    from trajstore.integrations.hf_moe import (
        generate_with_routes,
        pack_routes,
        record_routes,
        replay_routes,
    )

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    g, p_len, r_len = cfg.samples_per_prompt, cfg.prompt_len, cfg.response_len
    prompts = data_rng.integers(0, 10, size=(cfg.prompts_per_step, p_len))
    enc = tokenizer([" ".join(map(str, row)) for row in prompts], return_tensors="pt")
    input_ids = enc["input_ids"].repeat_interleave(g, dim=0)
    prompt_mask = enc["attention_mask"].repeat_interleave(g, dim=0)

    engine = copy.deepcopy(policy).to(torch.bfloat16).eval()
    gen = generate_with_routes(
        engine,
        input_ids=input_ids,
        attention_mask=prompt_mask,
        max_new_tokens=r_len,
        min_new_tokens=r_len,
        do_sample=True,
        top_k=0,
        top_p=1.0,
        temperature=1.0,
    )
    seq, mask = gen.sequences, gen.attention_mask
    response = seq[:, p_len:]
    rollout_lp = torch.log_softmax(gen.logits, dim=-1).gather(-1, response.unsqueeze(-1))[..., 0]
    words = [tokenizer.convert_ids_to_tokens(row) for row in response.tolist()]
    rewards = task_reward(np.repeat(prompts, g, axis=0), words)
    grouped = torch.as_tensor(rewards).view(-1, g)
    centred = grouped - grouped.mean(1, keepdim=True)
    adv = (centred / (centred.std(1, keepdim=True) + 1e-6)).view(-1, 1)

    policy.train()
    hooks = replay_routes(policy, gen.routes) if mode == "r3" else record_routes(policy)
    with hooks as rec:
        logits = policy(input_ids=seq, attention_mask=mask).logits
    lp_all = torch.log_softmax(logits[:, p_len - 1 : -1].float(), dim=-1)
    logp = lp_all.gather(-1, response.unsqueeze(-1))[..., 0]  # [N, R]
    entropy = -(lp_all.exp() * lp_all).sum(-1)
    old = logp.detach()  # on-policy: one update per rollout
    ratio = torch.exp(logp - old)
    pg1, pg2 = -ratio * adv, -ratio.clamp(1 - cfg.eps_clip, 1 + cfg.eps_clip) * adv
    pg = torch.maximum(pg1, pg2)
    loss = _sum_of_sample_mean(pg)
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        loss_metrics = {
            "loss": float(loss),
            "pg_loss": float(loss),
            "entropy_loss": float(_sum_of_sample_mean(entropy)),
            "pg_clipfrac": float(_sum_of_sample_mean((pg2 > pg1).float())),
            "ppo_kl": float(_sum_of_sample_mean(old - logp)),
        }
    e = cfg.n_experts
    return StepRecord(
        step=step,
        rewards=rewards,
        advantages=adv.view(-1).numpy().astype(np.float32),
        rollout_routes=pack_routes(gen.routes, mask, e),
        train_routes=pack_routes(rec.routes(), mask, e),
        natural_routes=pack_routes(rec.natural_routes(), mask, e),
        rollout_log_probs=rollout_lp.reshape(-1).numpy().astype(np.float32),
        train_log_probs=old.reshape(-1).numpy().astype(np.float32),
        entropy=entropy.detach().reshape(-1).numpy().astype(np.float32),
        loss_metrics=loss_metrics,
    )


def sample_records(rec: StepRecord, cfg: HFMoEConfig) -> list[dict[str, Any]]:
    """index.json sample records (the GRPO advantage is the post-processed reward)."""
    r_len = cfg.response_len
    return [
        {
            "sample_id": f"s-{i}",
            "group_index": i // cfg.samples_per_prompt,
            "response_length": r_len,
            "total_length": cfg.prompt_len + r_len,
            "loss_mask": [1] * r_len,
            "reward": float(rec.advantages[i]),
            "raw_reward": float(rec.rewards[i]),
        }
        for i in range(len(rec.rewards))
    ]


def producer_metrics(rec: StepRecord, cfg: HFMoEConfig) -> dict[str, Any]:
    """The producer's own router.consistency: rollout vs the experts training executed."""
    n, r_len = len(rec.rewards), cfg.response_len
    m = compute_router_metrics(
        rec.rollout_routes,
        rec.train_routes,
        total_lengths=[cfg.prompt_len + r_len] * n,
        response_lengths=[r_len] * n,
        loss_masks=[[1] * r_len] * n,
        num_experts=cfg.n_experts,
        num_layers=cfg.n_layers,
        top_k=cfg.top_k,
        rollout_log_probs=rec.rollout_log_probs,
        train_log_probs=rec.train_log_probs,
    )
    # no hang_count / engine_error_count: generation runs in this process, with no engine
    # that could hang or fail, so neither is measured (compare shows null, not a 0)
    return m.to_dict()


def recompute_config(cfg: HFMoEConfig, mode: str, step: int) -> dict[str, Any]:
    """index.json config: the GRPO settings the loss used, plus config.router."""
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


def capture_step(manager: Any, rec: StepRecord, cfg: HFMoEConfig, mode: str) -> None:
    """Hand one rollout and its step to a `trajstore.capture.CaptureManager` (asynchronous)."""
    import torch

    routes = {
        "rollout_routed_experts": torch.from_numpy(rec.rollout_routes),
        "train_routed_experts": torch.from_numpy(rec.train_routes),
    }
    if mode == "r3":
        routes["train_natural_routed_experts"] = torch.from_numpy(rec.natural_routes)
    train_lp = torch.from_numpy(rec.train_log_probs)
    weight = f"w-{rec.step}"
    advantages = torch.from_numpy(np.repeat(rec.advantages, cfg.response_len))
    manager.rollout(  # reward -> advantage, so replay links the step to its rollout
        rec.step,
        sample_records(rec, cfg),
        raw_rewards=torch.from_numpy(rec.rewards),
        rewards=torch.from_numpy(rec.advantages),
        advantages=advantages,
        recompute=recompute_config(cfg, mode, rec.step),
        weight_lineage={"rollout_weight": weight},
    )
    with manager.step(
        rec.step,
        0,
        recompute=recompute_config(cfg, mode, rec.step),
        weight_lineage={"rollout_weight": weight, "actor_weight": weight},
    ) as step:
        step.add(
            0,
            samples=sample_records(rec, cfg),
            log_probs=train_lp,
            old_log_probs=train_lp,
            advantages=advantages,
            entropy=torch.from_numpy(rec.entropy),
            routes=routes,
            rollout_log_probs=torch.from_numpy(rec.rollout_log_probs),
            train_log_probs=train_lp,
            metrics=rec.loss_metrics,
        )
        step.router_consistency(rec.metrics or producer_metrics(rec, cfg))


def run_mode(
    mode: str,
    steps: int,
    seed: int,
    manager: Any = None,
    cfg: HFMoEConfig | None = None,
) -> list[StepRecord]:
    """Train ``steps`` GRPO steps in ``mode``; capture each when ``manager`` is given.

    The same ``seed`` gives the same weights, prompts and sampling stream in
    both modes, so baseline and r3 start from the same rollout.
    """
    import torch

    cfg = cfg or HFMoEConfig()
    tokenizer = build_tokenizer()
    policy = build_model(cfg, tokenizer, seed)
    opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    torch.manual_seed(seed + 1)  # generate() samples from the global generator
    data_rng = np.random.default_rng(seed + 2)
    records = []
    for step in range(steps):
        rec = grpo_step(policy, opt, tokenizer, cfg, mode, step, data_rng)
        rec.metrics = producer_metrics(rec, cfg)
        if manager is not None:
            capture_step(manager, rec, cfg, mode)
        records.append(rec)
    return records


def run_into_store(
    store_dir: Path | str,
    modes: tuple[str, ...] = MODES,
    *,
    steps: int,
    seed: int,
    prefix: str = RUN_PREFIX,
    cfg: HFMoEConfig | None = None,
) -> dict[str, list[StepRecord]]:
    """Run each mode from the same seed, captured into the store as run ``<prefix><mode>``."""
    check_store(store_dir)
    return {
        mode: capture_run(
            store_dir, f"{prefix}{mode}", functools.partial(run_mode, mode, steps, seed, cfg=cfg)
        )
        for mode in modes
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m trajstore.examples.hf_moe_r3`: baseline and/or r3 into a store."""
    p = mode_parser(
        "GRPO on a tiny transformers Qwen3-MoE (bf16 rollout, fp32 training), routes recorded "
        "and replayed by trajstore.integrations.hf_moe, captured into a store.",
        MODES,
        steps=4,
        prefix=RUN_PREFIX,
    )
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    modes = selected_modes(args, MODES)

    def body() -> int:
        records = run_into_store(
            args.store, modes, steps=args.steps, seed=args.seed, prefix=args.prefix
        )
        for mode, recs in records.items():
            mis = [r.metrics["route_mismatch_rate"] for r in recs]
            print(
                f"{mode}: {len(recs)} steps into run {args.prefix + mode!r}; producer "
                f"route_mismatch_rate {min(mis):.4g}-{max(mis):.4g}; mean task reward "
                f"{float(np.mean([r.rewards.mean() for r in recs])):.3f}"
            )
        return 0

    return run_main("hf_moe_r3", body)


if __name__ == "__main__":
    raise SystemExit(main())
