"""Independent oracle for the GRPO replay math (docs/replay-math.md), in plain PyTorch.

Why it exists: tests that build "consistent" bundles need the values a
correct producer would record. If those came from `trajstore.replay.kernels`,
a wrong kernel would produce wrong expectations and still agree with itself,
and the suite would stay green. So the expectations come from here: a
straightforward transcription of the formulas with torch tensors and Python
loops over samples and groups, written without looking at the kernels'
vectorised NumPy code and sharing none of it. It never imports
`trajstore.replay`.

Inputs are NumPy arrays or lists; outputs are float32 NumPy arrays (per-token
and per-sample values) or Python floats (loss scalars), ready to be written
into a bundle. Math is float32, as the producer's `.float()` tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

STD_EPS = 1e-6
LOW_VAR_KL_BOUND = 10.0


def _t(x: Any) -> torch.Tensor:
    """A float32 torch tensor of ``x`` (a NumPy array, list or tensor)."""
    return torch.as_tensor(np.asarray(x, dtype=np.float32))


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).numpy().copy()


def group_normalize(
    raw_rewards: Sequence[float] | np.ndarray,
    group_index: Sequence[int],
    n_samples_per_prompt: int,
    *,
    rewards_normalization: bool = True,
    std_normalization: bool = True,
    estimator: str = "grpo",
) -> np.ndarray:
    """Reward post-process: per semantic group, ``r - mean(r)``, then ``/ (std + 1e-6)``.

    std is the unbiased (n-1) std of the group's centred rewards, applied only
    for estimator "grpo" with std normalization and groups larger than one.
    Groups are the samples sharing ``group_index``, wherever they sit.
    """
    r = _t(raw_rewards)
    if not rewards_normalization:
        return _np(r)
    out = r.clone()
    for g in sorted(set(int(x) for x in group_index)):
        members = torch.tensor([i for i, x in enumerate(group_index) if int(x) == g])
        vals = r[members]
        assert vals.numel() == n_samples_per_prompt, f"group {g} has {vals.numel()} samples"
        centred = vals - vals.mean()
        if estimator == "grpo" and std_normalization and n_samples_per_prompt > 1:
            centred = centred / (torch.std(centred) + STD_EPS)
        out[members] = centred
    return _np(out)


def approx_kl(
    lp: Sequence[float] | np.ndarray,
    lp_base: Sequence[float] | np.ndarray,
    kl_type: str,
    importance_ratio: Sequence[float] | np.ndarray | None = None,
) -> np.ndarray:
    """Per-token approximate KL (Schulman's k1/k2/k3; low_var_kl = k3 clamped after the ratio)."""
    log_ratio = _t(lp) - _t(lp_base)
    if kl_type == "k1":
        kl = log_ratio
    elif kl_type == "k2":
        kl = log_ratio**2 / 2.0
    elif kl_type in ("k3", "low_var_kl"):
        kl = torch.exp(-log_ratio) - 1 + log_ratio
    else:
        raise ValueError(f"unknown kl type {kl_type!r}")
    if importance_ratio is not None:
        kl = _t(importance_ratio) * kl
    if kl_type == "low_var_kl":
        kl = torch.clamp(kl, -LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)
    return _np(kl)


def grpo_advantages(rewards: Sequence[float] | np.ndarray, lengths: Sequence[int]) -> np.ndarray:
    """Each sample's post-processed reward repeated over its response tokens, concatenated."""
    r = _t(rewards)
    parts = [torch.ones(int(n)) * r[i] for i, n in enumerate(lengths)]
    return _np(torch.cat(parts)) if parts else np.zeros(0, dtype=np.float32)


def sum_of_sample_mean(x: torch.Tensor, mask: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """``sum_i sum(x_i * mask_i) / max(sum(mask_i), 1)`` with a loop over samples."""
    total = torch.zeros((), dtype=x.dtype)
    start = 0
    for n in lengths:
        xi = x[start : start + int(n)]
        mi = mask[start : start + int(n)].to(x.dtype)
        total = total + (xi * mi).sum() / torch.clamp(mi.sum(), min=1)
        start += int(n)
    return total


def policy_loss(
    old_log_probs: Sequence[float] | np.ndarray,
    log_probs: Sequence[float] | np.ndarray,
    advantages: Sequence[float] | np.ndarray,
    entropy: Sequence[float] | np.ndarray,
    mask: Sequence[float] | np.ndarray,
    lengths: Sequence[int],
    *,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
    entropy_coef: float = 0.0,
    use_kl_loss: bool = False,
    kl_loss_coef: float = 0.0,
    kl_loss_type: str = "k1",
    ref_log_probs: Sequence[float] | np.ndarray | None = None,
    use_unbiased_kl: bool = False,
) -> dict[str, float]:
    """The `loss.policy` scalars of a PPO-clipped (optionally dual-clip) GRPO loss."""
    old, new, adv, ent, m = (_t(a) for a in (old_log_probs, log_probs, advantages, entropy, mask))
    high = eps_clip if eps_clip_high is None else eps_clip_high
    ppo_kl = old - new
    ratio = torch.exp(-ppo_kl)
    pg1 = -ratio * adv
    pg2 = -torch.clamp(ratio, 1 - eps_clip, 1 + high) * adv
    pg = torch.maximum(pg1, pg2)
    clipfrac = (pg2 > pg1).float()
    if eps_clip_c is not None:
        pg = torch.where(adv < 0, torch.minimum(-eps_clip_c * adv, pg), pg)

    pg_loss = sum_of_sample_mean(pg, m, lengths)
    entropy_loss = sum_of_sample_mean(ent, m, lengths)
    loss = pg_loss - entropy_coef * entropy_loss
    out = {
        "pg_loss": float(pg_loss),
        "pg_clipfrac": float(sum_of_sample_mean(clipfrac, m, lengths)),
        "ppo_kl": float(sum_of_sample_mean(ppo_kl, m, lengths)),
        "entropy_loss": float(entropy_loss),
    }
    if use_kl_loss:
        assert ref_log_probs is not None, "use_kl_loss needs ref_log_probs"
        weight = torch.exp(new - old) if use_unbiased_kl else None
        kl_t = _t(approx_kl(new, ref_log_probs, kl_loss_type, weight))
        kl_loss = sum_of_sample_mean(kl_t, m, lengths)
        loss = loss + kl_loss_coef * kl_loss
        out["kl_loss"] = float(kl_loss)
    out["loss"] = float(loss)
    return out


def loss_from_config(
    config: dict[str, Any],
    payloads: dict[str, np.ndarray],
    mask: np.ndarray,
    lengths: Sequence[int],
    **overrides: Any,
) -> dict[str, float]:
    """`policy_loss` with its knobs read from a bundle config (defaults as the spec's table)."""
    kw: dict[str, Any] = {
        "eps_clip": float(config.get("eps_clip", 0.2)),
        "eps_clip_high": config.get("eps_clip_high"),
        "eps_clip_c": config.get("eps_clip_c"),
        "entropy_coef": float(config.get("entropy_coef", 0.0)),
        "use_kl_loss": bool(config.get("use_kl_loss", False)),
        "kl_loss_coef": float(config.get("kl_loss_coef", 0.0)),
        "kl_loss_type": config.get("kl_loss_type", "k1"),
        "use_unbiased_kl": bool(config.get("use_unbiased_kl", False)),
    }
    kw.update(overrides)
    return policy_loss(
        payloads["old_log_probs"],
        payloads["log_probs"],
        payloads["advantages"],
        payloads["entropy"],
        mask,
        lengths,
        ref_log_probs=payloads.get("ref_log_probs"),
        **kw,
    )
