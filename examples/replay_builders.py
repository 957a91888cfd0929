"""Mathematically consistent major-1 replay bundles, with knobs to inject faults.

`consistent_contents` plays the producer: it draws raw rewards and log-probs,
then derives everything else the way docs/replay-math.md says a correct
producer does, with the independent torch oracle (`oracle`), never with
`trajstore.replay.kernels`, so a wrong kernel makes these bundles fail replay:

    raw rewards -> group_normalize (semantic groups) -> rewards
    rewards     -> grpo_advantages                   -> advantages (payload)
    old/ref lp  -> approx_kl(kl_loss_type)           -> kl (payload; zeros when kl_coef == 0)
    everything  -> policy_loss                       -> expected["loss.policy"]

So a bundle built without faults replays clean, and each `Faults` knob makes
the *producer* do one thing differently while the recorded config says what
it should have done. Replay must then name the stage the fault lives in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from trajstore.examples import oracle

from trajstore.bundle.reader import open_target
from trajstore.bundle.writer import (
    BundleContents,
    default_stage_contracts,
    write_bundle,
    write_rank,
)
from trajstore.replay.runner import ReplayReport, StageRequest, replay_sources
from trajstore.replay.selection import SelectionRequest
from trajstore.replay.stages import StageOutcome

PER_TOKEN = ("old_log_probs", "log_probs", "ref_log_probs", "entropy", "kl", "advantages")


@dataclass
class Faults:
    """What the producer did wrong (all off by default: a correct producer)."""

    #: the faulty streaming producer: normalize each physical transfer batch of
    #: this many samples (in bundle/arrival order) as if it were one group
    physical_batch_norm: int | None = None
    #: kl_loss_type the producer really used for the ``kl`` payload (config says another)
    kl_type: str | None = None
    #: eps_clip_high the producer really used in its loss (config says another)
    eps_clip_high: float | None = None
    #: the producer's loss used every sample's loss mask shifted right by this many tokens
    loss_mask_shift: int = 0
    #: recorded ``loss_mask`` of this sample has one entry too many
    loss_mask_extra_entry: str | None = None
    #: the producer's per-token payloads lack this sample's tokens (its record stays)
    dropped_sample: str | None = None
    #: (payload, sample_id, token offset) that holds NaN
    nan_at: tuple[str, str, int] | None = None


@dataclass
class Built:
    """A built bundle's contents plus the producer's intermediate values."""

    contents: BundleContents
    raw_rewards: np.ndarray
    rewards: np.ndarray  # what the producer recorded
    correct_rewards: np.ndarray  # what a correct producer records
    lengths: np.ndarray
    sample_ids: list[str]
    extra: dict[str, Any] = field(default_factory=dict)

    def offset_of(self, sample_id: str) -> int:
        """Flat index of ``sample_id``'s first response token."""
        pos = self.sample_ids.index(sample_id)
        return int(self.lengths[:pos].sum())


def _arrival_order(groups: int, n: int, interleave: bool) -> list[int]:
    """Group index of each sample, in the order samples arrive (= bundle order)."""
    if not interleave:
        return [g for g in range(groups) for _ in range(n)]
    # Streamed: prompts' samples finish interleaved (round robin over groups).
    return [g for _ in range(n) for g in range(groups)]


def consistent_contents(
    *,
    groups: int = 4,
    n: int = 8,
    lengths: int | list[int] | None = None,
    seed: int = 0,
    interleave: bool = False,
    kind: str = "step",
    rollout_id: int = 120,
    step_id: int = 0,
    rank: int | None = None,
    world: int = 1,
    cp: int = 1,
    micro_batch_size: int | None = 4,
    config: dict[str, Any] | None = None,
    faults: Faults | None = None,
    bundle_id: str | None = None,
    drop_expected: tuple[str, ...] = (),
) -> Built:
    """A consistent major-1 bundle of ``groups`` prompts x ``n`` samples.

    - ``lengths``: response length per sample (int, list, or None: 3..9 at random).
    - ``interleave``: samples arrive round robin over groups (streamed generation).
    - ``micro_batch_size``: consecutive samples share ``mb-NNNN``; None: no micro_batch_id.
    - ``config``: overrides/extra keys of index.json config; ``cp``: identity.rank.cp.
    - ``drop_expected``: stages whose expected.json entry is removed (the stage
      contracts still declare them recompute: an incomplete bundle).
    """
    faults = faults or Faults()
    rng = np.random.default_rng(seed * 7919 + (rank or 0))
    gidx = _arrival_order(groups, n, interleave)
    g0 = (rank or 0) * groups
    gidx = [g0 + g for g in gidx]
    total_n = len(gidx)
    if lengths is None:
        lens = rng.integers(3, 10, size=total_n)
    elif isinstance(lengths, int):
        lens = np.full(total_n, lengths)
    else:
        lens = np.asarray(lengths)
    lens = lens.astype(np.int64)
    prefix = "s" if rank is None else f"s-{rank}"
    sample_ids = [f"{prefix}-{i}" for i in range(total_n)]

    cfg: dict[str, Any] = {
        "advantage_estimator": "grpo",
        "entropy_coef": 0.01,
        "eps_clip": 0.2,
        "eps_clip_high": 0.28,
        "grpo_std_normalization": True,
        "kl_coef": 0.05,
        "kl_loss_type": "k3",
        "n_samples_per_prompt": n,
        "rewards_normalization": True,
    }
    cfg.update(config or {})

    # --- rewards: float32-exact raw values, semantic-group normalization
    raw = rng.integers(0, 5, size=total_n).astype(np.float32) / np.float32(4)
    correct = oracle.group_normalize(
        raw,
        gidx,
        n,
        rewards_normalization=cfg["rewards_normalization"],
        std_normalization=cfg["grpo_std_normalization"],
        estimator=cfg["advantage_estimator"],
    )
    rewards = correct
    if faults.physical_batch_norm:
        b = faults.physical_batch_norm
        rewards = np.empty_like(raw)
        for start in range(0, total_n, b):
            part = raw[start : start + b]
            rewards[start : start + b] = oracle.group_normalize(part, [0] * len(part), len(part))

    # --- per-token tensors
    tokens = int(lens.sum())
    old = (-rng.uniform(0.05, 3.0, tokens)).astype(np.float32)
    new = (old + rng.normal(0.0, 0.3, tokens)).astype(np.float32)
    ref = (old + rng.normal(0.0, 0.1, tokens)).astype(np.float32)
    entropy = rng.uniform(0.0, 2.0, tokens).astype(np.float32)
    kl_type = faults.kl_type or cfg["kl_loss_type"]
    if float(cfg["kl_coef"]) == 0.0:
        kl = np.zeros(tokens, dtype=np.float32)
    else:
        kl = oracle.approx_kl(old, ref, kl_type)
    advantages = oracle.grpo_advantages(rewards, lens)

    # --- loss masks: a masked tail on every third sample
    masks = []
    for i, length in enumerate(lens):
        tail = min(2, int(length) - 1) if i % 3 == 0 else 0
        masks.append([1] * (int(length) - tail) + [0] * tail)
    producer_masks = masks
    if faults.loss_mask_shift:
        k = faults.loss_mask_shift
        producer_masks = [[0] * k + m[:-k] for m in masks]
    flat_mask = np.concatenate([np.asarray(m, dtype=np.float32) for m in producer_masks])
    loss = oracle.policy_loss(
        old,
        new,
        advantages,
        entropy,
        flat_mask,
        lens,
        eps_clip=float(cfg["eps_clip"]),
        eps_clip_high=faults.eps_clip_high
        if faults.eps_clip_high is not None
        else cfg.get("eps_clip_high"),
        eps_clip_c=cfg.get("eps_clip_c"),
        entropy_coef=float(cfg["entropy_coef"]),
        use_kl_loss=bool(cfg.get("use_kl_loss", False)),
        kl_loss_coef=float(cfg.get("kl_loss_coef", 0.0)),
        kl_loss_type=cfg["kl_loss_type"],
        ref_log_probs=ref,
        use_unbiased_kl=bool(cfg.get("use_unbiased_kl", False)),
    )

    payloads = {
        "old_log_probs": old,
        "log_probs": new,
        "ref_log_probs": ref,
        "entropy": entropy,
        "kl": kl,
        "advantages": advantages,
    }
    offsets = np.concatenate([[0], np.cumsum(lens)])
    if faults.nan_at is not None:
        name, sid, off = faults.nan_at
        payloads[name] = payloads[name].copy()
        payloads[name][offsets[sample_ids.index(sid)] + off] = np.nan
    if faults.dropped_sample is not None:
        pos = sample_ids.index(faults.dropped_sample)
        keep = np.ones(tokens, dtype=bool)
        keep[offsets[pos] : offsets[pos + 1]] = False
        payloads = {k: v[keep] for k, v in payloads.items()}

    samples = []
    for i, sid in enumerate(sample_ids):
        mask = list(masks[i])
        if faults.loss_mask_extra_entry == sid:
            mask.append(1)
        samples.append(
            {
                "group_index": gidx[i],
                "label_hash": None,
                "loss_mask": mask,
                "micro_batch_id": None
                if micro_batch_size is None
                else f"mb-{i // micro_batch_size:04d}",
                "raw_reward": float(raw[i]),
                "response_length": int(lens[i]),
                "reward": float(rewards[i]),
                "sample_id": sid,
                "total_length": int(lens[i]) + 5,
            }
        )
    expected: dict[str, Any] = {
        "loss.policy": loss,
        "reward.post_process": {"rewards": [float(x) for x in rewards]},
        "reward.raw": {"raw_rewards": [float(x) for x in raw]},
    }
    contracts = default_stage_contracts(set(PER_TOKEN), expected, samples)
    for stage in drop_expected:
        expected.pop(stage, None)
    identity = {
        "actor_step_id": {"rollout_id": rollout_id, "step_id": step_id} if kind == "step" else None,
        "consumer_batch_ids": ["cb-0"],
        "micro_batch_ids": sorted({s["micro_batch_id"] for s in samples if s["micro_batch_id"]}),
        "normalization_cohort_ids": ["nc-0"],
        "rank": {"cp": cp, "dp": world, "pp": 1, "tp": 1},
        "rollout_id": rollout_id if kind == "rollout" else None,
        "rollout_partition_ids": [f"rollout-{rollout_id}"],
        "semantic_group_ids": [f"g-{g}" for g in sorted(set(gidx))],
        "weight_lineage": {
            "actor_weight": f"w-{rollout_id}",
            "rollout_weight": f"w-{rollout_id - 1}",
        },
    }
    anchor = f"{rollout_id}-{step_id}" if kind == "step" else f"rollout-{rollout_id}"
    contents = BundleContents(
        bundle_id=bundle_id or f"b-{anchor}",
        identity=identity,
        samples=samples,
        config=cfg,
        payloads=payloads,
        expected=expected,
        stage_contracts=contracts,
        producer={"commit": "builder", "dirty_patch_digest": "", "torch_version": "n/a"},
    )
    return Built(contents, raw, rewards, correct, lens, sample_ids)


def write_consistent(dest: Path, **kwargs: Any) -> tuple[Path, Built]:
    """Build and write one bundle at ``dest``."""
    built = consistent_contents(**kwargs)
    return write_bundle(dest, built.contents), built


def write_consistent_cohort(
    dest: Path, ranks: int = 2, faults_by_rank: dict[int, Faults] | None = None, **kwargs: Any
) -> Path:
    """A multi-rank cohort: each rank a consistent bundle with its own samples/groups."""
    expected_ranks = list(range(ranks))
    kwargs.setdefault("bundle_id", "b-cohort")
    for r in expected_ranks:
        faults = (faults_by_rank or {}).get(r)
        built = consistent_contents(rank=r, world=ranks, faults=faults, **kwargs)
        write_rank(dest, built.contents, rank=r, expected_ranks=expected_ranks)
    return dest


# --------------------------------------------------------------------------- replay helpers


def replay(
    path: Path,
    stages: str | None = None,
    *,
    samples: tuple[str, ...] = (),
    groups: tuple[str, ...] = (),
    batches: tuple[str, ...] = (),
) -> ReplayReport:
    bset = open_target(path)
    return replay_sources(
        bset.bundles,
        label=path.name,
        request=StageRequest.parse(stages),
        selection=SelectionRequest(samples, groups, batches),
    )


def stage(report: ReplayReport, name: str, rank_pos: int = 0) -> StageOutcome:
    return next(s for s in report.bundles[rank_pos].stages if s.stage == name)


def statuses(report: ReplayReport, rank_pos: int = 0) -> dict[str, str]:
    return {s.stage: s.status for s in report.bundles[rank_pos].stages}
