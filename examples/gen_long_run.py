#!/usr/bin/env python
"""Synthetic long-run generator: capture directories shaped like a real async GRPO run.

    python -m trajstore.examples.gen_long_run OUT \\
        --rollouts 6 --steps 4 --samples 128 --routes --resumed 0.1

Writes, per rollout R: `replay-rollout-R/` (every sample: rewards, KL, advantages,
routes) and k step bundles `replay-R-S/` that each consume a subset of R's
semantic groups (shuffled order, same per-sample values, so they dedup),
optionally as multi-rank cohorts (`--ranks`). Response lengths are long-tailed
in [50, 4000]; routes are [T, 48, 8] uint8 with ~18% of train-route
token-layers differing from the rollout routes (`--shared-prompt-routes`: a
group's prompt tokens route identically, rollout and train). `--resumed F` re-captures a
fraction F of steps (after a "resume": log_probs recomputed) under
`OUT/resumed/`, which ingest stores as attempt 2.

Values are consistent with replay-math.md (computed with trajstore.replay.kernels),
so replay passes on clean bundles. Fault hooks make chosen bundles diverge:
`--fault-reward-norm R` (rewards normalised over physical batches of 16, not
semantic groups), `--fault-eps S` (`R:S`: expected loss computed with eps_clip_high
0.2 while the config says 0.28), `--fault-nan R:S` (a NaN in log_probs: refused at ingest).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from trajstore.bundle.writer import BundleContents, write_bundle, write_rank
from trajstore.replay import kernels

CONFIG = {
    "advantage_estimator": "grpo",
    "entropy_coef": 0.0,
    "eps_clip": 0.2,
    "eps_clip_high": 0.28,
    "grpo_std_normalization": True,
    "kl_coef": 0.0,
    "kl_loss_type": "k3",
    "rewards_normalization": True,
}
PRODUCER = {"commit": "gen_long_run", "dirty_patch_digest": "", "torch_version": "synthetic"}


def _step_arg(text: str) -> tuple[int, int]:
    r, s = text.split(":")
    return int(r), int(s)


class Rollout:
    """All samples of one rollout, with every per-token array, in rollout order."""

    def __init__(self, rid: int, args: argparse.Namespace, rng: np.random.Generator) -> None:
        n, per = args.samples, args.per_prompt
        self.rid = rid
        self.n_prompts = n // per
        lens = np.exp(rng.normal(np.log(400), 0.9, n))
        self.resp = np.clip(lens, args.min_len, args.max_len).astype(np.int64)
        self.prompt = np.repeat(rng.integers(32, 256, self.n_prompts), per)
        self.total = self.resp + self.prompt
        self.groups = np.repeat(np.arange(self.n_prompts) + rid * self.n_prompts, per)
        self.raw = rng.integers(0, 2, n).astype(np.float32) * 1.0
        self.rewards = kernels.grpo_normalize(self.raw, self.groups.tolist(), per).astype(
            np.float32
        )
        if rid in args.fault_reward_norm:  # the historical bug: physical batches, not groups
            self.rewards = kernels.grpo_normalize(
                self.raw, (np.arange(n) // 16).tolist(), 16
            ).astype(np.float32)
        t = int(self.resp.sum())
        self.old = (-np.abs(rng.lognormal(-1.5, 1.0, t))).astype(np.float32)
        self.new = (self.old + rng.normal(0, 0.15, t)).astype(np.float32)
        self.ref = (self.old + rng.normal(0, 0.02, t)).astype(np.float32)
        self.entropy = np.abs(rng.normal(1.0, 0.3, t)).astype(np.float32)
        self.masks = [np.ones(int(r), np.int64) for r in self.resp]
        for m in self.masks:
            m[-max(1, len(m) // 50) :] = rng.integers(0, 2)
        self.routes = self.train_routes = None
        if args.routes:
            tt = int(self.total.sum())
            self.routes = rng.integers(
                0, args.experts, (tt, args.layers, args.topk), dtype=np.uint8
            )
            diff = rng.random((tt, args.layers)) < args.route_diff
            self.train_routes = self.routes.copy()
            self.train_routes[diff] = rng.integers(
                0, args.experts, (int(diff.sum()), args.topk), dtype=np.uint8
            )
            if args.shared_prompt_routes:  # prefill of one prompt routes alike (no rng drawn)
                off = np.concatenate([[0], np.cumsum(self.total)])
                for first in range(0, n, per):
                    a, p = int(off[first]), int(self.prompt[first])
                    for i in range(first + 1, first + per):
                        b = int(off[i])
                        self.routes[b : b + p] = self.routes[a : a + p]
                        self.train_routes[b : b + p] = self.train_routes[a : a + p]
        self.resp_off = np.concatenate([[0], np.cumsum(self.resp)])
        self.tot_off = np.concatenate([[0], np.cumsum(self.total)])

    def take(self, arr: np.ndarray, idx: list[int], off: np.ndarray) -> np.ndarray:
        return np.concatenate([arr[off[i] : off[i + 1]] for i in idx]) if idx else arr[:0]

    def samples(self, idx: list[int]) -> list[dict]:
        return [
            {
                "group_index": int(self.groups[i]),
                "label_hash": None,
                "loss_mask": self.masks[i].tolist(),
                "micro_batch_id": f"mb-{int(self.groups[i]) % 64:04d}",
                "raw_reward": float(self.raw[i]),
                "response_length": int(self.resp[i]),
                "reward": float(self.rewards[i]),
                "sample_id": f"r{self.rid}-s{i}",
                "total_length": int(self.total[i]),
            }
            for i in idx
        ]

    def contents(
        self,
        idx: list[int],
        *,
        step: int | None,
        args: argparse.Namespace,
        world: int,
        new: np.ndarray | None = None,
        eps_fault: bool = False,
    ) -> BundleContents:
        resp = self.resp[idx]
        kl = np.zeros(int(resp.sum()), np.float32)  # kl_coef 0: all-zero KL, as in real runs
        adv = kernels.grpo_returns(self.rewards[idx], resp).astype(np.float32)
        payloads: dict[str, np.ndarray] = {
            "old_log_probs": self.take(self.old, idx, self.resp_off),
            "ref_log_probs": self.take(self.ref, idx, self.resp_off),
            "kl": kl,
            "advantages": adv,
        }
        expected: dict = {
            "reward.raw": {"raw_rewards": [float(self.raw[i]) for i in idx]},
            "reward.post_process": {"rewards": [float(self.rewards[i]) for i in idx]},
        }
        if step is not None:
            lp = new if new is not None else self.take(self.new, idx, self.resp_off)
            payloads["log_probs"] = lp
            payloads["entropy"] = self.take(self.entropy, idx, self.resp_off)
            mask = np.concatenate([self.masks[i] for i in idx])
            expected["loss.policy"] = kernels.loss_policy(
                payloads["old_log_probs"],
                lp,
                adv,
                payloads["entropy"],
                mask,
                resp,
                eps_clip=CONFIG["eps_clip"],
                eps_clip_high=0.2 if eps_fault else CONFIG["eps_clip_high"],
            )
        if self.routes is not None:
            payloads["rollout_routed_experts"] = self.take(self.routes, idx, self.tot_off)
            payloads["train_routed_experts"] = self.take(self.train_routes, idx, self.tot_off)
        groups = sorted({int(self.groups[i]) for i in idx})
        samples = self.samples(idx)
        identity = {
            "actor_step_id": {"rollout_id": self.rid, "step_id": step}
            if step is not None
            else None,
            "consumer_batch_ids": [f"cb-{self.rid}-{step if step is not None else 'all'}"],
            "micro_batch_ids": sorted({s["micro_batch_id"] for s in samples}),
            "normalization_cohort_ids": [f"nc-{self.rid}"],
            "rank": {"cp": 1, "dp": world, "pp": 1, "tp": 1},
            "rollout_id": self.rid if step is None else None,
            "rollout_partition_ids": [f"rollout-{self.rid}"],
            "semantic_group_ids": [f"g-{g}" for g in groups],
            "weight_lineage": {
                "actor_weight": f"w-{self.rid + 1}",
                "rollout_weight": f"w-{self.rid}",
            },
        }
        config = {**CONFIG, "n_samples_per_prompt": args.per_prompt}
        if self.routes is not None:
            config["router"] = {
                "num_layers": args.layers,
                "top_k": args.topk,
                "num_experts": args.experts,
                "mode": "R3",
                "rollout_engine": "sglang",
                "train_engine": "megatron",
            }
        anchor = f"{self.rid}-{step}" if step is not None else f"rollout-{self.rid}"
        return BundleContents(
            bundle_id=f"replay-{anchor}",
            identity=identity,
            samples=samples,
            config=config,
            payloads=payloads,
            expected=expected,
            producer=PRODUCER,
        )


def write_step(
    dest: Path,
    ro: Rollout,
    groups: list[int],
    step: int,
    args: argparse.Namespace,
    rng: np.random.Generator,
    *,
    perturb: bool = False,
) -> None:
    eps_fault = (ro.rid, step) in args.fault_eps
    per_rank = np.array_split(np.array(groups), args.ranks)
    for r, gs in enumerate(per_rank):
        idx = [
            int(g - ro.rid * ro.n_prompts) * args.per_prompt + j
            for g in gs
            for j in range(args.per_prompt)
        ]
        new = None
        if perturb or (ro.rid, step) in args.fault_nan:
            new = ro.take(ro.new, idx, ro.resp_off).copy()
            if perturb:
                new += rng.normal(0, 1e-3, new.shape).astype(np.float32)
            if (ro.rid, step) in args.fault_nan and r == 0:
                new[len(new) // 2] = np.nan
        c = ro.contents(idx, step=step, args=args, world=args.ranks, new=new, eps_fault=eps_fault)
        # a generated workload, made again at will: not fsynced (hundreds of MB to wait for)
        if args.ranks == 1:
            write_bundle(dest, c, durable=False)
        else:
            write_rank(dest, c, rank=r, expected_ranks=list(range(args.ranks)), durable=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--rollouts", type=int, default=6)
    ap.add_argument("--first-rollout", type=int, default=0)
    ap.add_argument("--steps", type=int, default=4, help="step bundles per rollout")
    ap.add_argument("--samples", type=int, default=128, help="samples per rollout")
    ap.add_argument("--per-prompt", type=int, default=8)
    ap.add_argument("--min-len", type=int, default=50)
    ap.add_argument("--max-len", type=int, default=4000)
    ap.add_argument("--routes", action="store_true", help="MoE routes [T, layers, topk] uint8")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument(
        "--route-diff",
        type=float,
        default=0.18,
        help="fraction of train-route token-layers differing",
    )
    ap.add_argument(
        "--shared-prompt-routes",
        action="store_true",
        help="a group's prompt tokens get the same routes (as one prompt's prefill does)",
    )
    ap.add_argument(
        "--resumed",
        type=float,
        default=0.0,
        help="fraction of steps re-captured under OUT/resumed/",
    )
    ap.add_argument("--ranks", type=int, default=1, help="ranks per step bundle (cohorts when > 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fault-reward-norm", type=int, action="append", default=[], metavar="R")
    ap.add_argument("--fault-eps", type=_step_arg, action="append", default=[], metavar="R:S")
    ap.add_argument("--fault-nan", type=_step_arg, action="append", default=[], metavar="R:S")
    args = ap.parse_args(argv)
    if args.samples % args.per_prompt:
        ap.error("--samples must be a multiple of --per-prompt")
    rng = np.random.default_rng(args.seed)
    t0 = time.monotonic()
    n = 0
    for rid in range(args.first_rollout, args.first_rollout + args.rollouts):
        ro = Rollout(rid, args, rng)
        write_bundle(
            args.out / f"replay-rollout-{rid}",
            ro.contents(list(range(args.samples)), step=None, args=args, world=1),
            durable=False,
        )
        n += 1
        prompts = np.arange(ro.n_prompts) + rid * ro.n_prompts
        for s in range(args.steps):
            # each step consumes a random half of the rollout's groups, in shuffled order
            groups = [
                int(g) for g in rng.permutation(prompts)[: max(args.ranks, ro.n_prompts // 2)]
            ]
            write_step(args.out / f"replay-{rid}-{s}", ro, groups, s, args, rng)
            n += 1
            if rng.random() < args.resumed:
                write_step(
                    args.out / "resumed" / f"replay-{rid}-{s}",
                    ro,
                    groups,
                    s,
                    args,
                    rng,
                    perturb=True,
                )
                n += 1
        del ro
    print(f"wrote {n} bundles to {args.out} in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
