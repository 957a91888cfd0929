"""NumPy kernels of the GRPO replay stage chain (contract: docs/replay-math.md).

Why NumPy: importing torch costs more than a whole replay may take, so this
module never imports it. Element-wise math follows torch's dtype behaviour
exactly (float32 stays float32; NumPy 2's weak Python scalars mirror torch's
scalar handling), so per-token outputs match the producer bit for bit.
Reductions accumulate in float64 and round once to the working dtype: that is
the correctly rounded value of the float32 sum the producer computes, so the
residual difference is only the producer's own summation error (far below the
comparison tolerance).

Dtype rule: a NumPy float64 array keeps float64 math; anything else (float32
arrays, other dtypes, Python lists from JSON) is computed in float32, as the
producer's `torch.tensor(..., dtype=torch.float)` / `.float()` do.
`approx_kl` always computes in float32, because the contract's formula casts with
`.float()`.

Per-token arrays are flat: sample 0's response tokens, then sample 1's, ...
Everything is vectorised over tokens and samples (no Python loop over
tokens), so a 512-sample x 1k-token step takes a few milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from trajstore.errors import TrajstoreError

KL_TYPES: tuple[str, ...] = ("k1", "k2", "k3", "low_var_kl")
GRPO_STD_EPS = 1e-6
LOW_VAR_KL_CLAMP = 10.0

__all__ = [
    "GRPO_STD_EPS",
    "KL_TYPES",
    "KernelInputError",
    "approx_kl",
    "grpo_normalize",
    "grpo_returns",
    "locate_token",
    "loss_policy",
    "policy_loss_terms",
    "segment_ids",
    "segment_offsets",
    "sum_of_sample_mean",
]


class KernelInputError(TrajstoreError, ValueError):
    """Kernel inputs violate the contract; the stage refuses instead of guessing.

    A TrajstoreError so the CLI prints it as one line with exit code 2, and a
    ValueError so plain-Python callers can catch it idiomatically.
    """


# --------------------------------------------------------------------------- helpers


def _float_array(x: Any, name: str) -> np.ndarray:
    """1-D float array under the module's dtype rule (float64 kept, else float32)."""
    if isinstance(x, np.ndarray) and x.dtype == np.float64:
        arr = x
    else:
        try:
            arr = np.asarray(x, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise KernelInputError(f"{name}: not a numeric 1-D array ({exc})") from None
    if arr.ndim != 1:
        raise KernelInputError(f"{name}: expected a 1-D array, got shape {arr.shape}")
    return arr


def _lengths(response_lengths: Any) -> np.ndarray:
    """Validated int64 response lengths (zero allowed: it contributes nothing)."""
    try:
        lengths = np.asarray(response_lengths, dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise KernelInputError(f"response_lengths: not integers ({exc})") from None
    if lengths.ndim != 1:
        raise KernelInputError(f"response_lengths: expected 1-D, got shape {lengths.shape}")
    if lengths.size and int(lengths.min()) < 0:
        pos = int(np.argmax(lengths < 0))
        raise KernelInputError(f"response_lengths[{pos}] is negative ({int(lengths[pos])})")
    return lengths


def _check_len(arr: np.ndarray, total: int, name: str) -> None:
    if arr.shape[0] != total:
        raise KernelInputError(
            f"{name} has {arr.shape[0]} tokens, expected sum(response_length) = {total}"
        )


def _mask_array(mask: Any, total: int) -> np.ndarray:
    """Validated flat 0/1 loss mask, in its own numeric dtype (cast where used)."""
    mask_values = np.asarray(mask)
    if mask_values.ndim != 1:
        raise KernelInputError(f"mask: expected a flat 1-D array, got shape {mask_values.shape}")
    if mask_values.dtype.kind not in "biuf":
        raise KernelInputError(f"mask: expected numeric 0/1 values, got dtype {mask_values.dtype}")
    _check_len(mask_values, total, "mask")
    if (
        mask_values.dtype.kind != "b"
        and np.count_nonzero(mask_values == 0) + np.count_nonzero(mask_values == 1)
        != mask_values.size
    ):
        bad = int(np.argmax((mask_values != 0) & (mask_values != 1)))
        raise KernelInputError(f"mask token {bad} is not 0/1 ({mask_values[bad]!r})")
    return mask_values


def segment_offsets(response_lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """Start of each sample in the flat token layout, plus the total at the end.

    Length N+1 (int64): sample i spans ``offsets[i]:offsets[i+1]``, and
    ``offsets[-1]`` bounds-checks token indices in `locate_token`.
    """
    lengths = _lengths(response_lengths)
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def segment_ids(response_lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """Sample position of every flat token (for bincount-style per-sample reductions)."""
    lengths = _lengths(response_lengths)
    return np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)


def locate_token(
    flat_index: int | Sequence[int] | np.ndarray, offsets: np.ndarray
) -> tuple[Any, Any]:
    """Map flat token index(es) to (sample position, offset inside that response).

    Used to report a per-token divergence as ``<sample_id>@<offset>``. Scalars
    in give Python ints out; arrays give int64 arrays. Empty samples are never
    chosen (the searchsorted 'right' side skips zero-length segments).
    """
    offs = np.asarray(offsets, dtype=np.int64)
    if offs.ndim != 1 or offs.size == 0:
        raise KernelInputError("offsets: expected segment_offsets(...) output (1-D, N+1 long)")
    idx = np.asarray(flat_index, dtype=np.int64)
    total = int(offs[-1])
    out_of_range = (idx < 0) | (idx >= total)
    if np.any(out_of_range):
        first = int(idx.reshape(-1)[np.argmax(out_of_range.reshape(-1))])
        raise KernelInputError(f"token index {first} outside [0, {total})")
    pos = np.searchsorted(offs, idx, side="right") - 1
    off = idx - offs[pos]
    if idx.ndim == 0:
        return int(pos), int(off)
    return pos, off


def _segment_sums(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per-sample float64 sums of a flat (T,) array; empty samples sum to 0."""
    out = np.zeros(lengths.size, dtype=np.float64)
    nonempty = lengths > 0
    if values.shape[0] == 0 or not nonempty.any():
        return out
    starts = (np.cumsum(lengths) - lengths)[nonempty]
    out[nonempty] = np.add.reduceat(values, starts, dtype=np.float64)
    return out


def _sums_of_sample_means(
    columns: Sequence[np.ndarray], mask: np.ndarray, lengths: np.ndarray
) -> list[np.floating]:
    """`sum_of_sample_mean` of several per-token columns sharing one mask.

    Each column keeps its own dtype: ``x * mask`` in that dtype (torch builds
    the mask with ``x.dtype``), per-sample sums rounded to it, divided by
    ``max(sum(mask), 1)`` in it, then summed over samples.
    """
    counts = np.maximum(_segment_sums(mask, lengths), 1.0)
    masks: dict[np.dtype, np.ndarray] = {}
    buffers: dict[np.dtype, np.ndarray] = {}
    results: list[np.floating] = []
    for c in columns:
        dt = c.dtype
        if dt not in masks:
            masks[dt] = mask.astype(dt)
            buffers[dt] = np.empty_like(masks[dt])
        sums = _segment_sums(np.multiply(c, masks[dt], out=buffers[dt]), lengths)
        means = sums.astype(dt) / counts.astype(dt)
        results.append(dt.type(means.sum(dtype=np.float64)))
    return results


# --------------------------------------------------------------------------- kernels


def sum_of_sample_mean(
    x: Sequence[float] | np.ndarray,
    mask: Sequence[int] | np.ndarray,
    response_lengths: Sequence[int] | np.ndarray,
) -> np.floating:
    """``sum_i sum(x_i * mask_i) / max(sum(mask_i), 1)``: the loss-side reduction.

    Per-sample means summed (not a token mean), so every sample weighs the
    same regardless of its length; a fully masked sample contributes 0.
    Returns a NumPy scalar of x's working dtype.
    """
    lengths = _lengths(response_lengths)
    total = int(lengths.sum())
    xa = _float_array(x, "x")
    _check_len(xa, total, "x")
    mask_values = _mask_array(mask, total)
    return _sums_of_sample_means([xa], mask_values, lengths)[0]


def approx_kl(
    lp: Sequence[float] | np.ndarray,
    lp_base: Sequence[float] | np.ndarray,
    kl_type: str,
    importance_ratio: Sequence[float] | np.ndarray | None = None,
) -> np.ndarray:
    """Per-token approximate KL of lp against lp_base (Schulman's k1/k2/k3).

    Computed in float32 (the spec casts with ``.float()``); ``low_var_kl`` is
    k3 clamped to [-10, 10] *after* the importance ratio, as the producer does.
    """
    if kl_type not in KL_TYPES:
        raise KernelInputError(f"unknown kl_loss_type {kl_type!r} (expected one of {KL_TYPES})")
    a = np.asarray(_float_array(lp, "lp"), dtype=np.float32)
    b = np.asarray(_float_array(lp_base, "lp_base"), dtype=np.float32)
    if a.shape != b.shape:
        raise KernelInputError(f"lp has {a.shape[0]} tokens but lp_base has {b.shape[0]}")
    log_ratio = a - b
    if kl_type == "k1":
        kl = log_ratio
    elif kl_type == "k2":
        kl = log_ratio**2 / 2.0
    else:
        neg = -log_ratio
        kl = np.exp(neg) - 1 - neg
    if importance_ratio is not None:
        ratio = _float_array(importance_ratio, "importance_ratio")
        if ratio.shape != kl.shape:
            raise KernelInputError(
                f"importance_ratio has {ratio.shape[0]} tokens, expected {kl.shape[0]}"
            )
        kl = ratio * kl
    if kl_type == "low_var_kl":
        kl = np.clip(kl, -LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
    return kl


def grpo_normalize(
    raw_rewards: Sequence[float] | np.ndarray,
    group_index: Sequence[int | None] | np.ndarray,
    n_samples_per_prompt: int,
    rewards_normalization: bool = True,
    std_normalization: bool = True,
    estimator: str = "grpo",
    sample_ids: Sequence[str] | None = None,
) -> np.ndarray:
    """GRPO reward post-process over *semantic* groups, in original sample order.

    Groups are the samples sharing a ``group_index`` wherever they sit in the
    array; a group is never inferred from position or batch size (that was the
    historical streaming bug). A missing index or a group whose size is not
    ``n_samples_per_prompt`` refuses with KernelInputError naming the sample or
    group (``sample_ids`` make the message name samples, else positions).

    ``reward - mean``, then ``/ (std + 1e-6)`` with the unbiased std of the centred
    rewards, only for estimator "grpo" with std normalization and n > 1. As in
    the producer, std division is nested under ``rewards_normalization``: with
    it off, rewards pass through unchanged.
    """
    rewards_array = _float_array(raw_rewards, "raw_rewards")
    n_total = rewards_array.shape[0]
    groups = list(group_index)
    if len(groups) != n_total:
        raise KernelInputError(f"group_index has {len(groups)} entries for {n_total} rewards")
    if sample_ids is not None and len(sample_ids) != n_total:
        raise KernelInputError(f"sample_ids has {len(sample_ids)} entries for {n_total} rewards")
    if isinstance(n_samples_per_prompt, bool) or not isinstance(
        n_samples_per_prompt, (int, np.integer)
    ):
        raise KernelInputError(f"n_samples_per_prompt must be an int, got {n_samples_per_prompt!r}")
    n = int(n_samples_per_prompt)
    if n < 1:
        raise KernelInputError(f"n_samples_per_prompt must be >= 1, got {n}")

    def who(pos: int) -> str:
        return f"sample {sample_ids[pos]!r}" if sample_ids is not None else f"sample #{pos}"

    for pos, g in enumerate(groups):
        if g is None:
            raise KernelInputError(f"{who(pos)} has no group_index; refusing to infer its group")
        if isinstance(g, bool) or not isinstance(g, (int, np.integer)):
            raise KernelInputError(f"{who(pos)} has a non-integer group_index {g!r}")
    gi = np.asarray(groups, dtype=np.int64).reshape(n_total)

    if n_total:
        uniq, first_pos, counts = np.unique(gi, return_index=True, return_counts=True)
        bad = np.flatnonzero(counts != n)
        if bad.size:
            k = bad[np.argmin(first_pos[bad])]  # first offending group in bundle order
            members = np.flatnonzero(gi == uniq[k])
            names = ", ".join(
                repr(sample_ids[p]) if sample_ids is not None else f"#{p}" for p in members[:8]
            )
            more = ", ..." if members.size > 8 else ""
            raise KernelInputError(
                f"group g-{int(uniq[k])} has {int(counts[k])} sample(s) [{names}{more}], "
                f"expected n_samples_per_prompt={n}"
            )

    if not rewards_normalization:
        return rewards_array.copy()
    order = np.argsort(gi, kind="stable")
    grouped = rewards_array[order].reshape(-1, n)
    centred = grouped - grouped.mean(axis=1, keepdims=True)
    if estimator == "grpo" and std_normalization and n > 1:
        std = centred.std(axis=1, ddof=1, keepdims=True)
        centred = centred / (std + GRPO_STD_EPS)
    out = np.empty_like(rewards_array)
    out[order] = centred.reshape(-1)
    return out


def grpo_returns(
    rewards: Sequence[float | Sequence[float]] | np.ndarray,
    response_lengths: Sequence[int] | np.ndarray,
) -> np.ndarray:
    """GRPO advantages: each sample's post-processed reward on every response token.

    Flat, in sample order. KL does not enter GRPO returns. A per-token reward
    (major-2 bundles: a list as long as the response) is used as is.
    """
    lengths = _lengths(response_lengths)
    if isinstance(rewards, np.ndarray) or not any(
        isinstance(x, (list, tuple, np.ndarray)) for x in rewards
    ):
        rewards_array = _float_array(rewards, "rewards")
        if rewards_array.shape[0] != lengths.size:
            raise KernelInputError(f"{rewards_array.shape[0]} rewards for {lengths.size} samples")
        return np.repeat(rewards_array, lengths)
    if len(rewards) != lengths.size:
        raise KernelInputError(f"{len(rewards)} rewards for {lengths.size} samples")
    parts = []
    for pos, (rew, length) in enumerate(zip(rewards, lengths, strict=True)):
        if isinstance(rew, (list, tuple, np.ndarray)):
            part = _float_array(rew, f"rewards[{pos}]")
            if part.shape[0] != length:
                raise KernelInputError(
                    f"rewards[{pos}] has {part.shape[0]} per-token values, "
                    f"response_length is {int(length)}"
                )
        else:
            part = np.full(int(length), rew, dtype=np.float32)
        parts.append(part)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


def policy_loss_terms(
    old_log_probs: Sequence[float] | np.ndarray,
    log_probs: Sequence[float] | np.ndarray,
    advantages: Sequence[float] | np.ndarray,
    eps_clip: float,
    eps_clip_high: float | None,
    eps_clip_c: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-token PPO clipped surrogate: (pg, clipfrac, ppo_kl).

    Asymmetric clip [1 - eps_clip, 1 + eps_clip_high]; with ``eps_clip_c`` the
    dual clip bounds the loss of negative-advantage tokens by ``-c * A``.
    """
    old = _float_array(old_log_probs, "old_log_probs")
    new = _float_array(log_probs, "log_probs")
    adv = _float_array(advantages, "advantages")
    if not (old.shape == new.shape == adv.shape):
        raise KernelInputError(
            f"token counts differ: old_log_probs {old.shape[0]}, log_probs {new.shape[0]}, "
            f"advantages {adv.shape[0]}"
        )
    if eps_clip_high is None:
        eps_clip_high = eps_clip
    if eps_clip_c is not None and not eps_clip_c > 1.0:
        raise KernelInputError(f"eps_clip_c must be > 1 for dual-clip PPO, got {eps_clip_c}")
    # In-place steps keep the values identical to the plain expressions while
    # allocating fewer token-sized temporaries (page faults dominate otherwise).
    ppo_kl = old - new
    ratio = np.negative(ppo_kl)
    np.exp(ratio, out=ratio)
    pg1 = np.negative(ratio)
    pg1 *= adv
    pg2 = np.clip(ratio, 1 - eps_clip, 1 + eps_clip_high, out=ratio)
    np.negative(pg2, out=pg2)
    pg2 *= adv
    clipfrac = np.greater(pg2, pg1).astype(pg1.dtype)
    pg = np.maximum(pg1, pg2, out=pg1)
    if eps_clip_c is not None:
        pg3 = np.multiply(adv, -eps_clip_c, out=pg2)
        np.minimum(pg3, pg, out=pg3)
        np.copyto(pg, pg3, where=adv < 0)
    return pg, clipfrac, ppo_kl


def loss_policy(
    old_log_probs: Sequence[float] | np.ndarray,
    log_probs: Sequence[float] | np.ndarray,
    advantages: Sequence[float] | np.ndarray,
    entropy: Sequence[float] | np.ndarray,
    mask: Sequence[int] | np.ndarray,
    response_lengths: Sequence[int] | np.ndarray,
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
    """Cohort-level `loss.policy` scalars: loss, pg_loss, entropy_loss, pg_clipfrac,
    ppo_kl, and kl_loss when ``use_kl_loss``.

    ``mask`` is the flat concatenation of the samples' loss masks. Scalars are
    combined in the working dtype before conversion to Python floats, as the
    producer combines 0-dim tensors.
    """
    lengths = _lengths(response_lengths)
    total = int(lengths.sum())
    pg, clipfrac, ppo_kl = policy_loss_terms(
        old_log_probs, log_probs, advantages, eps_clip, eps_clip_high, eps_clip_c
    )
    _check_len(pg, total, "old_log_probs/log_probs/advantages")
    ent = _float_array(entropy, "entropy")
    _check_len(ent, total, "entropy")
    mask_values = _mask_array(mask, total)
    columns = [pg, clipfrac, ppo_kl, ent]
    if use_kl_loss:
        if ref_log_probs is None:
            raise KernelInputError("use_kl_loss needs ref_log_probs")
        lp = _float_array(log_probs, "log_probs")
        ratio = (
            np.exp(lp - _float_array(old_log_probs, "old_log_probs")) if use_unbiased_kl else None
        )
        columns.append(approx_kl(lp, ref_log_probs, kl_loss_type, importance_ratio=ratio))
    reduced = _sums_of_sample_means(columns, mask_values, lengths)
    pg_loss, pg_clipfrac, ppo_kl_s, entropy_loss = reduced[:4]
    loss = pg_loss - entropy_coef * entropy_loss
    out = {
        "pg_loss": float(pg_loss),
        "pg_clipfrac": float(pg_clipfrac),
        "ppo_kl": float(ppo_kl_s),
        "entropy_loss": float(entropy_loss),
    }
    if use_kl_loss:
        kl_loss = reduced[4]
        loss = loss + kl_loss_coef * kl_loss
        out["kl_loss"] = float(kl_loss)
    out["loss"] = float(loss)
    return out
