#!/usr/bin/env python
"""A slime stand-in: writes the debug dumps slime's ``--dump-details DIR`` writes.

    python -m trajstore.examples.slime_dumps OUT --rollouts 2 --prompts 4 --n 4

slime needs GPUs, SGLang and Megatron; its dumps do not. This writes, per rollout R,
``OUT/rollout_data/R.pt`` (``torch.save({"rollout_id": R, "samples": [Sample.to_dict()]})``,
every field of slime's ``Sample`` in its order, routes ``[len(tokens) - 1, L, K]`` int32 as
slime decodes them from SGLang, a group's prompt routed identically, as SGLang's prefix
cache makes it) and ``OUT/train_data/R.pt`` (format_version 2: per-sample tensors,
``dp_shards`` layout of ``--dp`` data-parallel ranks and ``--steps`` optimizer steps,
whole-batch ``raw_reward``), plus ``OUT/rollout_data/eval_R.pt`` with ``--eval``, and
``OUT/args.txt``: the slime flags of the run (what ``trajstore ingest --from slime
--config`` reads).

The trainer's numbers follow slime's own math, transcribed in torch
(slime/ray/rollout.py ``_post_process_rewards``, slime/utils/ppo_utils.py
``compute_approx_kl``, ``get_grpo_returns``, ``get_reinforce_plus_plus_returns``,
``get_reinforce_plus_plus_baseline_advantages``, slime/backends/megatron_utils/loss.py
``compute_advantages_and_returns``, slime/utils/distributed_utils.py
``distributed_masked_whiten``), so a replay of a clean run passes; ``--fault-reward R``
writes rollout R's post-processed rewards normalized over the whole batch (slime's
fallback when a rollout's sample count is not ``n * rollout_batch_size``) instead of per
group. The train dump's layout follows slime/observability/train_data_utils.py
``_build_dump_payload``. Nothing of trajstore is imported.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


def sample_dict(**fields: Any) -> dict[str, Any]:
    """slime's ``Sample.to_dict()``: every dataclass field in order, status as its value."""
    out = {
        "group_index": None,
        "index": None,
        "rollout_id": None,
        "prompt": "",
        "tokens": [],
        "multimodal_inputs": None,
        "multimodal_train_inputs": None,
        "multimodal_train_input_id": None,
        "apply_chat_template_kwargs": {},
        "response": "",
        "response_length": 0,
        "label": None,
        "reward": None,
        "loss_mask": None,
        "weight_versions": [],
        "rollout_log_probs": None,
        "rollout_top_p_token_ids": None,
        "rollout_top_p_token_offsets": None,
        "rollout_routed_experts": None,
        "remove_sample": False,
        "teacher_log_probs": None,
        "status": "pending",
        "metadata": {},
        "generate_function_path": None,
        "custom_rm_path": None,
        "train_metadata": None,
        "session_id": None,
        "non_generation_time": 0.0,
        "spec_info": {
            "spec_accept_token_num": 0,
            "spec_draft_token_num": 0,
            "spec_verify_ct": 0,
            "completion_token_num": 0,
        },
        "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": 0},
    }
    unknown = set(fields) - set(out)
    if unknown:
        raise ValueError(f"not a Sample field: {sorted(unknown)}")
    out.update(fields)
    return out


def routes(rng: np.random.Generator, rows: int, layers: int, topk: int, experts: int) -> np.ndarray:
    """[rows, layers, topk] int32: per (row, layer) ``topk`` distinct expert ids drawn at
    random, in random order (as a router's top-k by score is)."""
    ids = rng.integers(0, experts - topk + 1, size=(rows, layers, topk), dtype=np.int32)
    ids.sort(axis=-1)
    ids += np.arange(topk, dtype=np.int32)  # sorted draws + 0..K-1: K distinct ids
    order = rng.random((rows, layers, topk)).argsort(axis=-1)
    return np.take_along_axis(ids, order, axis=-1)


def post_process(raw: list[float], args: argparse.Namespace, whole_batch: bool) -> list[float]:
    """slime/ray/rollout.py ``_post_process_rewards`` (positional groups, as slime does)."""
    if not (
        args.estimator in ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")
        and not args.disable_rewards_normalization
    ):
        return list(raw)
    rewards = torch.tensor(raw, dtype=torch.float)
    if not whole_batch and rewards.shape[-1] == args.n * args.prompts:
        rewards = rewards.reshape(-1, args.n)
    else:
        rewards = rewards.view(-1, rewards.shape[-1])
    rewards = rewards - rewards.mean(dim=-1, keepdim=True)
    if args.estimator in ("grpo", "gspo", "cispo") and not args.disable_grpo_std_normalization:
        rewards = rewards / (rewards.std(dim=-1, keepdim=True) + 1e-6)
    return rewards.flatten().tolist()


def approx_kl(log_probs: torch.Tensor, base: torch.Tensor, kind: str) -> torch.Tensor:
    """slime/utils/ppo_utils.py ``compute_approx_kl`` (without the importance ratio)."""
    log_ratio = log_probs.float() - base.float()
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = log_ratio**2 / 2.0
    else:
        log_ratio = -log_ratio
        kl = log_ratio.exp() - 1 - log_ratio
    if kind == "low_var_kl":
        kl = torch.clamp(kl, min=-10, max=10)
    return kl


def discounted(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1}, backwards over one sequence."""
    out = torch.zeros_like(rewards)
    running = torch.zeros((), dtype=rewards.dtype)
    for t in range(rewards.shape[0] - 1, -1, -1):
        running = rewards[t] + gamma * running
        out[t] = running
    return out


def advantages(
    args: argparse.Namespace,
    rewards: list[float],
    kl: list[torch.Tensor],
    masks: list[torch.Tensor],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """slime/backends/megatron_utils/loss.py ``compute_advantages_and_returns`` (cp = 1)."""
    r = torch.tensor(rewards, dtype=torch.float32)
    if args.estimator in ("grpo", "gspo", "cispo"):
        returns = [torch.ones_like(kl[i]) * r[i] for i in range(len(r))]
        adv = list(returns)
    elif args.estimator == "reinforce_plus_plus":
        returns = []
        for i in range(len(r)):
            token = -args.kl_coef * (kl[i] * masks[i])
            last = masks[i].nonzero(as_tuple=True)[0][-1]
            token[last] += r[i]
            returns.append(discounted(token, args.gamma))
        adv = list(returns)
    else:  # reinforce_plus_plus_baseline
        adv = [torch.ones_like(k) * v - args.kl_coef * k for k, v in zip(kl, r, strict=True)]
        returns = adv
    if args.normalize_advantages:
        values, mask = torch.cat(adv), torch.cat(masks).float()
        total, squares, count = (values * mask).sum(), (values**2 * mask).sum(), mask.sum()
        mean = total / count
        var = squares / count - mean**2
        if count >= 2:
            var = var * (count / (count - 1))
        flat = (values - mean) * torch.rsqrt(var + 1e-8)
        adv = list(torch.split(flat, [a.shape[0] for a in adv]))
    return adv, returns


def schedule(count: int, args: argparse.Namespace) -> tuple[list, list, list]:
    """A fixed-size micro-batch schedule as slime/utils/dp_schedule.py ``build_dp_schedule``
    lays it out: per step, mbs of ``--micro-batch`` samples dealt round-robin to the ranks."""
    per_step = count // args.steps
    partitions: list[list[int]] = [[] for _ in range(args.dp)]
    batches: list[list[list[int]]] = [[] for _ in range(args.dp)]
    num_microbatches = []
    for s in range(args.steps):
        ids = list(range(s * per_step, (s + 1) * per_step))
        mbs = [ids[i : i + args.micro_batch] for i in range(0, len(ids), args.micro_batch)]
        if len(mbs) % args.dp:
            raise SystemExit(f"step {s}: {len(mbs)} micro-batches for {args.dp} ranks")
        num_microbatches.append(len(mbs) // args.dp)
        for r in range(args.dp):
            for mb in mbs[r :: args.dp]:
                start = len(partitions[r])
                partitions[r].extend(mb)
                batches[r].append(list(range(start, start + len(mb))))
    return partitions, batches, num_microbatches


def build_rollout(rollout_id: int, args: argparse.Namespace, rng: np.random.Generator) -> list:
    samples = []
    for g in range(args.prompts):
        group = rollout_id * args.prompts + g
        prompt_len = int(rng.integers(args.prompt_len // 2, args.prompt_len + 1))
        prompt = rng.integers(100, 30000, size=prompt_len).tolist()
        prompt_routes = routes(rng, prompt_len, args.layers, args.topk, args.experts)
        for j in range(args.n):
            resp_len = int(rng.integers(max(1, args.response_len // 4), args.response_len + 1))
            response = rng.integers(100, 30000, size=resp_len).tolist()
            tokens = prompt + response
            rows = np.concatenate(
                [prompt_routes, routes(rng, resp_len - 1, args.layers, args.topk, args.experts)]
            )
            mask = [1] * resp_len
            if resp_len > 4 and j % 3 == 1:  # a tool reply in the middle: not trained on
                mask[resp_len // 2 : resp_len // 2 + 2] = [0, 0]
            lps = (-rng.exponential(0.5, size=resp_len)).astype(np.float32)
            reward = float(rng.integers(0, 2)) if args.binary_rewards else float(rng.random())
            samples.append(
                sample_dict(
                    group_index=group,
                    index=group * args.n + j,
                    prompt=f"question {group}",
                    tokens=tokens,
                    response=f"answer {group}.{j}",
                    response_length=resp_len,
                    label=str(group % 7),
                    reward=reward,
                    loss_mask=mask,
                    weight_versions=[str(rollout_id)],
                    rollout_log_probs=[float(x) for x in lps],
                    rollout_routed_experts=torch.from_numpy(rows) if args.layers else None,
                    status="truncated" if resp_len == args.response_len else "completed",
                    metadata={"source_name": "synthetic", "difficulty": int(group % 3)},
                    prefix_cache_info={
                        "cached_tokens": prompt_len if j else 0,
                        "total_prompt_tokens": prompt_len,
                    },
                )
            )
    return samples


def build_train(
    rollout_id: int, samples: list, args: argparse.Namespace, rng: np.random.Generator
) -> dict[str, Any]:
    """What slime's actor has after ``compute_advantages_and_returns``, laid out by
    ``_build_dump_payload``."""
    raw = [s["reward"] for s in samples]
    rewards = post_process(raw, args, whole_batch=rollout_id in args.fault_reward)
    masks = [torch.tensor(s["loss_mask"], dtype=torch.int) for s in samples]
    rollout_lp = [torch.tensor(s["rollout_log_probs"], dtype=torch.float32) for s in samples]
    log_probs = [
        lp + torch.from_numpy(rng.normal(0, 0.02, lp.shape[0]).astype(np.float32))
        for lp in rollout_lp
    ]
    ref = [
        lp + torch.from_numpy(rng.normal(0, 0.05, lp.shape[0]).astype(np.float32))
        for lp in log_probs
    ]
    if args.kl_coef == 0:
        kl = [torch.zeros_like(lp, dtype=torch.float32) for lp in log_probs]
    else:
        kl = [approx_kl(lp, rf, args.kl_loss_type) for lp, rf in zip(log_probs, ref, strict=True)]
    adv, ret = advantages(args, rewards, kl, [m.float() for m in masks])
    partitions, batches, num_mbs = schedule(len(samples), args)
    columns: dict[str, list[Any]] = {
        "tokens": [torch.tensor(s["tokens"], dtype=torch.long) for s in samples],
        "response_lengths": [s["response_length"] for s in samples],
        "rewards": rewards,
        "truncated": [1 if s["status"] == "truncated" else 0 for s in samples],
        "loss_masks": masks,
        "rollout_ids": [s["index"] for s in samples],
        "rollout_mask_sums": [torch.tensor(float(m.sum())) for m in masks],
        "rollout_log_probs": rollout_lp,
        "total_lengths": [len(s["tokens"]) for s in samples],
        "local_raw_reward": raw,
        "ref_log_probs": ref,
        "log_probs": log_probs,
        "entropy": [
            torch.from_numpy(rng.random(lp.shape[0]).astype(np.float32)) for lp in log_probs
        ],
        "kl": kl,
        "advantages": adv,
        "returns": ret,
    }
    if args.layers and args.mode != "r3":  # under R3 slime drops them once replay is filled
        columns["rollout_routed_experts"] = [
            s["rollout_routed_experts"][:, :, :].clone() for s in samples
        ]
    if args.train_routes:  # a fork that dumps the routes Megatron executed
        flipped = []
        for s in samples:
            t = s["rollout_routed_experts"].clone()
            if args.mode != "r3":
                change = torch.from_numpy(rng.random(t.shape[:2]) < 0.1)
                t[change] = (t[change] + 1) % args.experts
            flipped.append(t)
        columns["train_routed_experts"] = flipped
    out_samples = []
    shards = []
    for d in range(args.dp):
        part = partitions[d]
        for pos in part:
            sample = {"data_parallel_rank": d, "sample_index": samples[pos]["index"]}
            sample["rollout_position"] = pos
            for key, values in columns.items():
                value = values[pos]
                sample[key] = value.clone() if isinstance(value, torch.Tensor) else value
            out_samples.append(sample)
        shards.append(
            {
                "rank": d,
                "data_parallel_rank": d,
                "sample_indices": [samples[p]["index"] for p in part],
                "partition": list(part),
                "global_batch_sizes": [len(samples) // args.steps] * args.steps,
                "num_microbatches": num_mbs,
                "micro_batch_indices": batches[d],
            }
        )
    out_samples.sort(key=lambda s: s["rollout_position"])
    return {
        "format_version": 2,
        "rollout_id": rollout_id,
        "rank": 0,
        "samples": out_samples,
        "dp_shards": shards,
        "raw_reward": raw,
    }


def build_eval(rollout_id: int, args: argparse.Namespace, rng: np.random.Generator) -> list:
    """An evaluation rollout: no group_index (eval prompts are not grouped for training)."""
    out = []
    for i in range(args.prompts):
        resp_len = int(rng.integers(1, args.response_len + 1))
        tokens = rng.integers(100, 30000, size=args.prompt_len + resp_len).tolist()
        out.append(
            sample_dict(
                index=i,
                prompt=f"eval question {i}",
                tokens=tokens,
                response="42",
                response_length=resp_len,
                label="42",
                reward={"acc": float(rng.integers(0, 2)), "format": 1.0},
                status="completed",
                metadata={"dataset": "eval-set"},
            )
        )
    return out


def flags(args: argparse.Namespace) -> str:
    """The run's slime flags (what a launch script passes), for ``--config``."""
    words = [
        f"--advantage-estimator {args.estimator}",
        f"--n-samples-per-prompt {args.n}",
        f"--rollout-batch-size {args.prompts}",
        f"--global-batch-size {args.n * args.prompts // args.steps}",
        f"--kl-coef {args.kl_coef}",
        f"--kl-loss-type {args.kl_loss_type}",
        f"--gamma {args.gamma}",
        "--eps-clip 0.2",
    ]
    if args.layers:
        words.append(f"--num-experts {args.experts}")
    if args.normalize_advantages:
        words.append("--normalize-advantages")
    if args.disable_rewards_normalization:
        words.append("--disable-rewards-normalization")
    if args.disable_grpo_std_normalization:
        words.append("--disable-grpo-std-normalization")
    if args.mode == "r3":
        words += ["--use-routing-replay", "--use-rollout-routing-replay"]
    elif args.mode == "r2":
        words.append("--use-routing-replay")
    return "# the slime flags of this run (trajstore ingest --from slime --config)\n" + (
        " \\\n".join(words) + "\n"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the --dump-details directory to write")
    p.add_argument("--rollouts", type=int, default=2)
    p.add_argument("--first-rollout", type=int, default=0)
    p.add_argument("--prompts", type=int, default=4, help="rollout_batch_size")
    p.add_argument("--n", type=int, default=4, help="n_samples_per_prompt")
    p.add_argument("--prompt-len", type=int, default=12)
    p.add_argument("--response-len", type=int, default=10)
    p.add_argument("--layers", type=int, default=4, help="MoE layers (0: a dense model)")
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--estimator", choices=ESTIMATORS, default="grpo")
    p.add_argument("--kl-coef", type=float, default=0.0)
    p.add_argument("--kl-loss-type", default="k1", choices=("k1", "k2", "k3", "low_var_kl"))
    p.add_argument("--gamma", type=float, default=1.0)
    p.add_argument("--normalize-advantages", action="store_true")
    p.add_argument("--disable-rewards-normalization", action="store_true")
    p.add_argument("--disable-grpo-std-normalization", action="store_true")
    p.add_argument("--binary-rewards", action="store_true")
    p.add_argument("--dp", type=int, default=2, help="data-parallel ranks")
    p.add_argument("--steps", type=int, default=1, help="optimizer steps per rollout")
    p.add_argument("--micro-batch", type=int, default=2, help="samples per micro-batch")
    p.add_argument("--mode", choices=("baseline", "r2", "r3"), default="baseline")
    p.add_argument("--train-routes", action="store_true", help="add train_routed_experts")
    p.add_argument("--eval", action="store_true", help="also write eval_R.pt dumps")
    p.add_argument("--no-train", action="store_true", help="rollout dumps only")
    p.add_argument("--fault-reward", type=int, action="append", default=[], metavar="R")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    (args.out / "rollout_data").mkdir(parents=True, exist_ok=True)
    if not args.no_train:
        (args.out / "train_data").mkdir(parents=True, exist_ok=True)
    for r in range(args.first_rollout, args.first_rollout + args.rollouts):
        samples = build_rollout(r, args, rng)
        torch.save({"rollout_id": r, "samples": samples}, args.out / "rollout_data" / f"{r}.pt")
        if not args.no_train:
            train = build_train(r, samples, args, rng)
            torch.save(train, args.out / "train_data" / f"{r}.pt")
        if args.eval:
            evaluation = build_eval(r, args, rng)
            torch.save(
                {"rollout_id": r, "samples": evaluation},
                args.out / "rollout_data" / f"eval_{r}.pt",
            )
    (args.out / "args.txt").write_text(flags(args), encoding="utf-8")
    print(f"wrote {args.rollouts} rollout(s) of {args.prompts * args.n} samples to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
