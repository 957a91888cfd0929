"""A tiny, real GRPO-style training loop on the CPU, with optional capture.

Why it exists: capture must be shown not to change a single number and to
record exactly what the loss saw. This loop is small enough for a test yet
has every moving part of an async GRPO trainer: sampled rollouts from the
current policy, a frozen reference model, semantic prompt groups, group
reward normalization, one rollout feeding several actor steps (so later
steps see ratio != 1 and clipping), micro-batches with gradient
accumulation, masked tool tokens, a reused advantage buffer, and the loss
written with the replay-math formulas (``sum_of_sample_mean`` etc.).

    python -m trajstore.examples.tiny_grpo --seed 0 --rollouts 3 --capture-dir /tmp/cap
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

EOS, TOOL = 0, 1


@dataclass
class TinyConfig:
    """Model, data and GRPO settings (the recompute keys use replay-math names)."""

    vocab: int = 24
    hidden: int = 64
    prompt_len: int = 4
    max_response: int = 10
    prompts_per_rollout: int = 4
    n_samples_per_prompt: int = 4
    steps_per_rollout: int = 2
    groups_per_micro_batch: int = 1
    lr: float = 0.05
    # recompute config (replay-math.md)
    advantage_estimator: str = "grpo"
    rewards_normalization: bool = True
    grpo_std_normalization: bool = True
    kl_coef: float = 0.05
    kl_loss_type: str = "low_var_kl"
    use_kl_loss: bool = True
    kl_loss_coef: float = 0.01
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    entropy_coef: float = 0.01
    use_unbiased_kl: bool = False


class TinyPolicy(nn.Module):
    """Next-token logits from the previous token plus the mean prompt embedding."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, vocab))

    def forward(self, prompts: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """prompts [B, P], prev [B, L] -> logits [B, L, V]."""
        ctx = self.emb(prompts).mean(dim=1, keepdim=True)
        return self.mlp(self.emb(prev) + ctx)


def token_logps(
    model: nn.Module, prompts: torch.Tensor, resp: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position log-prob of the response token and the policy entropy, [B, L]."""
    prev = torch.cat([prompts[:, -1:], resp[:, :-1]], dim=1)
    logp_all = torch.log_softmax(model(prompts, prev), dim=-1)
    logp = logp_all.gather(-1, resp.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def flat(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, L] padded -> flat response tokens in sample order."""
    return x[valid]


def sum_of_sample_mean(
    x: torch.Tensor, mask: torch.Tensor, seg: torch.Tensor, n: int
) -> torch.Tensor:
    sums = torch.zeros(n, dtype=x.dtype).index_add(0, seg, x * mask)
    counts = torch.zeros(n, dtype=x.dtype).index_add(0, seg, mask).clamp(min=1)
    return (sums / counts).sum()


def approx_kl(lp: torch.Tensor, base: torch.Tensor, kind: str) -> torch.Tensor:
    log_ratio = lp.float() - base.float()
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return log_ratio**2 / 2
    kl = torch.exp(-log_ratio) - 1 + log_ratio
    return kl.clamp(-10, 10) if kind == "low_var_kl" else kl


@dataclass
class Rollout:
    rollout_id: int
    prompts: torch.Tensor  # [N, P]
    resp: torch.Tensor  # [N, L] padded with EOS
    valid: torch.Tensor  # [N, L] bool
    lengths: list[int]
    groups: list[int]
    old_logp: torch.Tensor  # flat
    ref_logp: torch.Tensor
    kl: torch.Tensor
    mask: torch.Tensor  # flat float
    raw_rewards: torch.Tensor  # [N]
    rewards: torch.Tensor  # [N]
    advantages: torch.Tensor  # flat


class TinyGRPO:
    """The training loop; ``capture`` is a `CaptureManager` or None."""

    def __init__(
        self,
        seed: int,
        cfg: TinyConfig | None = None,
        capture: Any = None,
        tag: str = "",
        group_offset: int = 0,
    ):
        self.cfg = cfg or TinyConfig()
        self.tag = tag  # sample-id prefix and group offset: distinct samples per DP rank
        self.group_offset = group_offset
        torch.manual_seed(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.model = TinyPolicy(self.cfg.vocab, self.cfg.hidden)
        self.ref = copy.deepcopy(self.model).requires_grad_(False)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=self.cfg.lr)
        self.capture = capture
        self.version = 0
        self._adv_buf = torch.zeros(0)  # reused across micro-batches, as trainers do

    def recompute_config(self) -> dict[str, Any]:
        return asdict(self.cfg)  # capture keeps only the recompute keys

    def rollout(self, rollout_id: int) -> Rollout:
        c = self.cfg
        n = c.prompts_per_rollout * c.n_samples_per_prompt
        with torch.no_grad():
            prompts = torch.randint(
                2, c.vocab, (c.prompts_per_rollout, c.prompt_len), generator=self.gen
            )
            prompts = prompts.repeat_interleave(c.n_samples_per_prompt, dim=0)
            prev = prompts[:, -1]
            toks = []
            for _ in range(c.max_response):
                logits = self.model(prompts, prev.unsqueeze(1))[:, 0]
                prev = torch.multinomial(torch.softmax(logits, -1), 1, generator=self.gen).squeeze(
                    1
                )
                toks.append(prev)
            resp = torch.stack(toks, 1)
            is_eos = resp == EOS
            first = torch.where(
                is_eos.any(1), is_eos.float().argmax(1), torch.full((n,), c.max_response - 1)
            )
            lengths = (first + 1).tolist()
            valid = torch.arange(c.max_response).unsqueeze(0) < (first + 1).unsqueeze(1)
            resp = torch.where(valid, resp, torch.full_like(resp, EOS))
            old_logp, _ = token_logps(self.model, prompts, resp)
            ref_logp, _ = token_logps(self.ref, prompts, resp)
            old_logp, ref_logp = flat(old_logp, valid), flat(ref_logp, valid)
            mask = flat((resp != TOOL).float(), valid)
            target = (prompts[:, 0] % (c.vocab - 2)) + 2
            hits = ((resp == target.unsqueeze(1)) & valid).sum(1).float()
            raw = hits / torch.tensor(lengths, dtype=torch.float32)
            grouped = raw.view(-1, c.n_samples_per_prompt)
            rewards = grouped - grouped.mean(dim=1, keepdim=True)
            if c.grpo_std_normalization and c.n_samples_per_prompt > 1:
                rewards = rewards / (grouped.std(dim=1, keepdim=True) + 1e-6)
            rewards = rewards.reshape(-1)
            advantages = rewards.repeat_interleave(torch.tensor(lengths))
            kl = (
                approx_kl(old_logp, ref_logp, c.kl_loss_type)
                if c.kl_coef
                else torch.zeros_like(old_logp)
            )
        groups = [i // c.n_samples_per_prompt for i in range(n)]
        ro = Rollout(
            rollout_id,
            prompts,
            resp,
            valid,
            lengths,
            groups,
            old_logp,
            ref_logp,
            kl,
            mask,
            raw,
            rewards,
            advantages,
        )
        if self.capture is not None:
            self.capture.rollout(
                rollout_id,
                [self._sample(ro, i, text=True) for i in range(n)],
                raw_rewards=raw,
                rewards=rewards,
                advantages=advantages,
                old_log_probs=old_logp,
                ref_log_probs=ref_logp,
                kl=kl,
                loss_mask=mask,
                weight_lineage={
                    "rollout_weight": f"w-{self.version}",
                    "actor_weight": f"w-{self.version}",
                },
            )
        return ro

    def _sample(self, ro: Rollout, i: int, text: bool = False) -> dict[str, Any]:
        s: dict[str, Any] = {
            "sample_id": f"{self.tag}r{ro.rollout_id}-s{i}",
            "group_index": self.group_offset
            + ro.rollout_id * self.cfg.prompts_per_rollout
            + ro.groups[i],
            "response_length": ro.lengths[i],
            "total_length": self.cfg.prompt_len + ro.lengths[i],
        }
        if text:
            s["prompt"] = " ".join(f"t{t}" for t in ro.prompts[i].tolist())
            s["response"] = " ".join(f"t{t}" for t in ro.resp[i, : ro.lengths[i]].tolist())
        return s

    def train_step(
        self, ro: Rollout, step_id: int, on_metrics: Callable | None = None
    ) -> dict[str, float]:
        c = self.cfg
        gpm = c.groups_per_micro_batch
        groups_per_step = c.prompts_per_rollout // c.steps_per_rollout
        g0 = step_id * groups_per_step
        offsets = [0]
        for n in ro.lengths:
            offsets.append(offsets[-1] + n)
        cap = (
            self.capture.step(
                ro.rollout_id,
                step_id,
                weight_lineage={
                    "rollout_weight": f"w-{ro.rollout_id}",
                    "actor_weight": f"w-{self.version}",
                },
            )
            if self.capture is not None
            else None
        )
        totals: dict[str, float] = {}
        self.opt.zero_grad(set_to_none=True)
        for mb_index, g in enumerate(range(g0, g0 + groups_per_step, gpm)):
            idx = [i for i in range(len(ro.groups)) if g <= ro.groups[i] < g + gpm]
            sl = [slice(offsets[i], offsets[i + 1]) for i in idx]
            lengths = [ro.lengths[i] for i in idx]
            old = torch.cat([ro.old_logp[s] for s in sl])
            ref = torch.cat([ro.ref_logp[s] for s in sl])
            mask = torch.cat([ro.mask[s] for s in sl])
            total = sum(lengths)
            if self._adv_buf.numel() < total:
                self._adv_buf = torch.zeros(total)
            adv = self._adv_buf[:total]
            adv.copy_(torch.cat([ro.advantages[s] for s in sl]))
            logp, ent = token_logps(self.model, ro.prompts[idx], ro.resp[idx])
            valid = ro.valid[idx]
            logp, ent = flat(logp, valid), flat(ent, valid)
            seg = torch.repeat_interleave(torch.arange(len(idx)), torch.tensor(lengths))
            n = len(idx)
            ppo_kl = old - logp
            ratio = torch.exp(-ppo_kl)
            pg1 = -ratio * adv
            pg2 = -ratio.clamp(1 - c.eps_clip, 1 + c.eps_clip_high) * adv
            pg = torch.maximum(pg1, pg2)
            clipfrac = (pg2 > pg1).float()
            metrics = {
                "pg_loss": sum_of_sample_mean(pg, mask, seg, n),
                "pg_clipfrac": sum_of_sample_mean(clipfrac, mask, seg, n),
                "ppo_kl": sum_of_sample_mean(ppo_kl, mask, seg, n),
                "entropy_loss": sum_of_sample_mean(ent, mask, seg, n),
            }
            loss = metrics["pg_loss"] - c.entropy_coef * metrics["entropy_loss"]
            if c.use_kl_loss:
                metrics["kl_loss"] = sum_of_sample_mean(
                    approx_kl(logp, ref, c.kl_loss_type), mask, seg, n
                )
                loss = loss + c.kl_loss_coef * metrics["kl_loss"]
            metrics["loss"] = loss
            loss.backward()
            if cap is not None:
                cap.add(
                    mb_index,
                    samples=[self._sample(ro, i) for i in idx],
                    rewards=ro.rewards[idx],
                    log_probs=logp,
                    old_log_probs=old,
                    ref_log_probs=ref,
                    entropy=ent,
                    advantages=adv,
                    loss_mask=mask,
                    metrics=metrics,
                )
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + float(v.detach())
            adv.zero_()  # the trainer reuses its buffer: capture must have copied it
        self.opt.step()
        self.version += 1
        if cap is not None:
            cap.end()
        return totals

    def train(self, rollouts: int, on_step: Callable[[float], None] | None = None) -> None:
        for r in range(rollouts):
            ro = self.rollout(r)
            for s in range(self.cfg.steps_per_rollout):
                t0 = time.perf_counter()
                self.train_step(ro, s)
                if on_step is not None:
                    on_step(time.perf_counter() - t0)


def params_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rollouts", type=int, default=3)
    p.add_argument("--capture-dir", help="capture every step/rollout into this directory")
    p.add_argument(
        "--from-env", action="store_true", help="configure capture from TRAJSTORE_CAPTURE*"
    )
    a = p.parse_args(argv)
    capture = None
    loop = TinyGRPO(a.seed)
    if a.capture_dir or a.from_env:
        from trajstore.capture import CaptureConfig, CaptureManager

        if a.from_env:
            capture = CaptureManager.from_env(recompute=loop.recompute_config())
        else:
            capture = CaptureManager(
                CaptureConfig(enabled=True, output_dir=a.capture_dir, run="tiny"),
                recompute=loop.recompute_config(),
            )
        loop.capture = capture
    loop.train(a.rollouts)
    if capture is not None:
        stats = capture.close()
        print(f"capture: written={stats.written} dropped={stats.dropped} errors={stats.errors}")
    print(f"params sha256 {params_digest(loop.model)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
