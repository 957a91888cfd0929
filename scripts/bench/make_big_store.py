#!/usr/bin/env python
"""Build a large generated store fast: N actor steps (plus their rollout bundles)
with injected faults.

    .venv/bin/python scripts/bench/make_big_store.py OUT --steps 10000 [--samples 256]
        [--mean-tokens 64] [--steps-per-rollout 8] [--jobs 2] [--run long] [--small | --distinct]

Writing 10,000 distinct bundles with torch.save costs 50-150 ms each here, so
the store is built from a few *template* bundles (trajstore.examples.replay_builders
`consistent_contents`: mathematically consistent, so a clean one replays
clean), each written once; a clone is a new directory whose payload files are
hard links to the template's and whose index.json / COMPLETE files carry the
new identity (rollout id, actor step id, partition, weight lineage). Payload
dedup in the store makes the clones cheap to ingest.

Templates (same seed and sample ids for rollout and step, so linkage works):
- rollout ok / rollout bad: the bad one normalized rewards over physical
  batches (streamed-group fault) -> `reward.post_process` diverges there;
- step ok / step bad-reward: the step consumed those bad rewards (its reward
  stages are not recorded, so only linkage to the rollout roots it);
- step clip: the producer's loss used a wrong eps_clip_high -> `loss.policy`.

(A NaN payload is not among them: ingest refuses non-finite payloads, fail
closed, so a NaN step never reaches a store.)

Faulty rollouts are every `--fault-every`-th rollout id starting at 17; wrong
clip steps are (r, 3) for every `--clip-every`-th rollout id starting at 5
(skipping faulty rollouts). The ground truth is written to OUT/../<OUT name>.truth.json.

`--distinct` writes every bundle with its own seeded content instead of
cloning templates (no hard links, no whole-bundle dedup): rollout r is drawn
from seed r with response lengths in [mean/2, 3*mean/2]; its steps consume the
same samples (rewards, old/ref log-probs, KL and advantages: linkage holds,
and those payloads dedup against the rollout bundle as in a real run), and
each step draws its own `log_probs` and `entropy` (the policy moved) and
recomputes its expected loss from them. Slower to build (every payload is
serialized and ingested), but the store holds honest bytes.

`--small` is the fast variant (8 samples of 2-7 tokens). Bundle directories
are generated and ingested in batches (bounded scratch space), by `--jobs`
processes in parallel (ingest needs no lock). Objects are written with
durable=False (no fsync): this is a benchmark fixture, not a capture.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from trajstore.examples.replay_builders import Faults, consistent_contents

from trajstore.bundle.writer import write_bundle
from trajstore.jsonio import canonical_bytes, sha256_bytes
from trajstore.replay import kernels


def _lengths(samples: int, mean_tokens: int, small: bool) -> list[int]:
    if small:
        return [3, 5, 4, 6, 2, 7, 3, 4][:samples] * (samples // 8 or 1)
    rng = np.random.default_rng(12345)
    lo, hi = max(2, mean_tokens // 2), mean_tokens * 3 // 2
    return [int(x) for x in rng.integers(lo, hi + 1, size=samples)]


def build_templates(tmp: Path, samples: int, mean_tokens: int, small: bool) -> dict[str, Path]:
    """Write each template bundle once; returns name -> directory."""
    n = 4 if small else 8
    groups = max(1, samples // n)
    lengths = _lengths(groups * n, mean_tokens, small)
    pbn = 3 if small else 12  # physical batch size of the streaming fault (not a multiple of n)
    specs: dict[str, tuple[str, Faults | None]] = {
        "rollout-ok": ("rollout", None),
        "rollout-bad": ("rollout", Faults(physical_batch_norm=pbn)),
        "step-ok": ("step", None),
        "step-bad": ("step", Faults(physical_batch_norm=pbn)),
        "step-clip": ("step", Faults(eps_clip_high=0.35)),
    }
    out = {}
    for name, (kind, faults) in specs.items():
        built = consistent_contents(
            kind=kind,
            groups=groups,
            n=n,
            lengths=lengths,
            rollout_id=0,
            step_id=0,
            seed=3,
            faults=faults,
            drop_expected=("reward.raw", "reward.post_process") if kind == "step" else (),
            bundle_id=f"big-{name}",
        )
        c = built.contents
        if kind == "step":
            c.stage_contracts = {
                k: v for k, v in c.stage_contracts.items() if not k.startswith("reward.")
            }
        out[name] = write_bundle(tmp / f"tmpl-{name}", dataclasses.replace(c))
    return out


class Cloner:
    """Clones a template directory under a new identity without re-serializing payloads."""

    def __init__(self, tmpl: Path) -> None:
        self.tmpl = tmpl
        self.manifest = (tmpl / "manifest.json").read_bytes()
        self.expected = (tmpl / "expected.json").read_bytes()
        raw = (tmpl / "index.json").read_bytes()
        self.index = json.loads(raw)
        text = raw.decode()
        start = text.index('\n  "identity": {')
        end = text.index('\n  "samples": [', start)
        self.head, self.tail = text[:start], text[end:]
        self.payloads = sorted((tmpl / "payloads").iterdir())
        self.complete0 = json.loads((tmpl / "COMPLETE.0").read_bytes())
        self.checked = False

    def _index_bytes(self, ident: dict) -> bytes:
        block = (
            '\n  "identity": '
            + json.dumps(ident, indent=2, sort_keys=True, ensure_ascii=False).replace("\n", "\n  ")
            + ","
        )
        data = (self.head + block + self.tail).encode()
        if not self.checked:  # the splice must equal the writer's canonical bytes
            assert data == canonical_bytes({**self.index, "identity": ident}), (
                "index splice mismatch"
            )
            self.checked = True
        return data

    def clone(self, dest: Path, rollout_id: int, step_id: int | None) -> None:
        ident = dict(self.index["identity"])
        if step_id is None:
            ident["rollout_id"] = rollout_id
        else:
            ident["actor_step_id"] = {"rollout_id": rollout_id, "step_id": step_id}
        ident["rollout_partition_ids"] = [f"rollout-{rollout_id}"]
        ident["weight_lineage"] = {
            "actor_weight": f"w-{rollout_id}",
            "rollout_weight": f"w-{rollout_id - 1}",
        }
        index = self._index_bytes(ident)
        (dest / "payloads").mkdir(parents=True)
        for p in self.payloads:
            os.link(p, dest / "payloads" / p.name)
        docs = {"manifest.json": self.manifest, "index.json": index, "expected.json": self.expected}
        for fname, data in docs.items():
            (dest / fname).write_bytes(data)
        metadata = {fname: sha256_bytes(data) for fname, data in docs.items()}
        shard = dict(self.complete0)
        shard.update(
            metadata=metadata,
            actor_step_id=ident.get("actor_step_id"),
            rollout_id=ident.get("rollout_id"),
        )
        (dest / "COMPLETE.0").write_bytes(canonical_bytes(shard))
        (dest / "COMPLETE").write_bytes(
            canonical_bytes({"expected_ranks": [0], "metadata": metadata, "ranks": [0]})
        )


@dataclasses.dataclass
class _DistinctWriter:
    """A Cloner look-alike for `_work`: `clone` writes a fresh bundle instead."""

    maker: DistinctMaker
    name: str

    def clone(self, dest: Path, rollout_id: int, step_id: int | None) -> None:
        self.maker.write(dest, self.name, rollout_id, step_id)


def plan(steps: int, per_rollout: int, fault_every: int, clip_every: int) -> dict[str, Any]:
    rollouts = -(-steps // per_rollout)
    faulty = set(range(17, rollouts, fault_every)) if fault_every else set()
    clip = (
        {(r, min(3, per_rollout - 1)) for r in range(5, rollouts, clip_every) if r not in faulty}
        if clip_every
        else set()
    )
    return {
        "rollouts": rollouts,
        "steps": steps,
        "steps_per_rollout": per_rollout,
        "faulty_rollouts": sorted(faulty),
        "clip_steps": sorted(clip),
    }


def _steps_of(r: int, p: dict) -> range:
    return range(min(p["steps_per_rollout"], p["steps"] - r * p["steps_per_rollout"]))


PBN_LARGE = 12  # physical batch of the streaming fault (not a multiple of 8 samples per group)
FAULTS = {
    "rollout-ok": None,
    "rollout-bad": Faults(physical_batch_norm=PBN_LARGE),
    "step-ok": None,
    "step-bad": Faults(physical_batch_norm=PBN_LARGE),
    "step-clip": Faults(eps_clip_high=0.35),
}


@dataclasses.dataclass
class DistinctMaker:
    """Writes each bundle with its own seeded content (see the module docstring, `--distinct`)."""

    samples: int
    mean_tokens: int

    def write(self, dest: Path, name: str, rollout_id: int, step_id: int | None) -> None:
        kind = "rollout" if step_id is None else "step"
        n = 8
        groups = max(1, self.samples // n)
        rng = np.random.default_rng(rollout_id)
        lo, hi = max(2, self.mean_tokens // 2), self.mean_tokens * 3 // 2
        lengths = [int(x) for x in rng.integers(lo, hi + 1, size=groups * n)]
        faults = FAULTS[name]
        built = consistent_contents(
            kind=kind,
            groups=groups,
            n=n,
            lengths=lengths,
            rollout_id=rollout_id,
            step_id=step_id or 0,
            seed=rollout_id,
            faults=faults,
            drop_expected=("reward.raw", "reward.post_process") if kind == "step" else (),
            bundle_id=f"big-{kind}-{rollout_id}-{step_id}",
        )
        c = built.contents
        if kind == "step":
            c.stage_contracts = {
                k: v for k, v in c.stage_contracts.items() if not k.startswith("reward.")
            }
            self._own_policy(c, rollout_id, step_id or 0, faults)
        write_bundle(dest, c)

    @staticmethod
    def _own_policy(c: Any, rollout_id: int, step_id: int, faults: Faults | None) -> None:
        """This step's own log_probs and entropy.

        And the loss a correct (or faulty) producer derives.
        """
        rng = np.random.default_rng([rollout_id, step_id, 1])
        p = c.payloads
        old = p["old_log_probs"]
        p["log_probs"] = (old + rng.normal(0.0, 0.3, old.shape[0])).astype(np.float32)
        p["entropy"] = rng.uniform(0.0, 2.0, old.shape[0]).astype(np.float32)
        cfg = c.config
        lens = np.asarray([s["response_length"] for s in c.samples], dtype=np.int64)
        mask = np.concatenate([np.asarray(s["loss_mask"], dtype=np.float32) for s in c.samples])
        eps_high = (
            faults.eps_clip_high
            if faults and faults.eps_clip_high is not None
            else cfg.get("eps_clip_high")
        )
        c.expected["loss.policy"] = kernels.loss_policy(
            old,
            p["log_probs"],
            p["advantages"],
            p["entropy"],
            mask,
            lens,
            eps_clip=float(cfg["eps_clip"]),
            eps_clip_high=eps_high,
            eps_clip_c=cfg.get("eps_clip_c"),
            entropy_coef=float(cfg["entropy_coef"]),
            use_kl_loss=bool(cfg.get("use_kl_loss", False)),
            kl_loss_coef=float(cfg.get("kl_loss_coef", 0.0)),
            kl_loss_type=cfg["kl_loss_type"],
            ref_log_probs=p["ref_log_probs"],
            use_unbiased_kl=bool(cfg.get("use_unbiased_kl", False)),
        )


def _work(args: tuple) -> tuple[int, int, float]:
    """Generate and ingest rollouts [lo, hi): returns (bundles, refused, seconds)."""
    from trajstore.store import Store

    out, run, tmpls, p, lo, hi, scratch = args
    t0 = time.perf_counter()
    if "distinct" in tmpls:
        maker = DistinctMaker(**tmpls["distinct"])
        cloners = {k: _DistinctWriter(maker, k) for k in FAULTS}
    else:
        cloners = {k: Cloner(Path(v)) for k, v in tmpls.items()}
    faulty, clip = set(p["faulty_rollouts"]), {tuple(x) for x in p["clip_steps"]}
    cap = Path(tempfile.mkdtemp(prefix=f"cap-{lo}-", dir=scratch))
    try:
        n = 0
        for r in range(lo, hi):
            bad = r in faulty
            cloners["rollout-bad" if bad else "rollout-ok"].clone(
                cap / f"replay-rollout-{r}", r, None
            )
            n += 1
            for s in _steps_of(r, p):
                name = "step-bad" if bad else "step-clip" if (r, s) in clip else "step-ok"
                cloners[name].clone(cap / f"replay-{r}-{s}", r, s)
                n += 1
        with Store.open(out, durable=False) as store:
            outcomes = store.ingest([cap], run=run)
        refused = [o for o in outcomes if o.status == "refused"]
        if refused:
            print(f"refused: {refused[0].path}: {refused[0].reason}", file=sys.stderr)
        return n, len(refused), time.perf_counter() - t0
    finally:
        shutil.rmtree(cap, ignore_errors=True)


def make_store(
    out: Path,
    *,
    steps: int,
    samples: int = 256,
    mean_tokens: int = 64,
    per_rollout: int = 8,
    small: bool = False,
    distinct: bool = False,
    jobs: int = 2,
    batch_rollouts: int = 25,
    run: str = "long",
    fault_every: int = 97,
    clip_every: int = 89,
    progress: bool = True,
    scratch_dir: Path | None = None,
) -> dict[str, Any]:
    """Build the store at `out` (a directory that must not exist, or an empty s3:// prefix,
    with its endpoint and credentials in the environment); returns the plan (ground truth)
    plus timings. Bundles are generated under `scratch_dir` (default: beside a directory
    `out`, the temporary directory for a URL)."""
    from trajstore.store import Store

    remote = "://" in str(out)
    if not remote:
        out = Path(out)
        if out.exists():
            raise SystemExit(f"{out}: already exists")
    if small:
        samples = 8
    p = plan(steps, per_rollout, fault_every, clip_every)
    t0 = time.perf_counter()
    where = scratch_dir or (None if remote else Path(out).parent)
    if where is not None:
        Path(where).mkdir(parents=True, exist_ok=True)  # e.g. --build /tmp/bench/NEW
    scratch = Path(tempfile.mkdtemp(prefix="bigstore-", dir=where))
    try:
        if distinct:
            tmpls: dict[str, Any] = {"distinct": {"samples": samples, "mean_tokens": mean_tokens}}
            tokens = None  # varies per rollout; mean below
        else:
            tmpls = {
                k: str(v) for k, v in build_templates(scratch, samples, mean_tokens, small).items()
            }
            lens = json.loads((Path(tmpls["step-ok"]) / "index.json").read_bytes())["samples"]
            tokens = sum(s["response_length"] for s in lens)
        Store.open(out, durable=False).close()
        chunks = [
            (lo, min(lo + batch_rollouts, p["rollouts"]))
            for lo in range(0, p["rollouts"], batch_rollouts)
        ]
        jobs_args = [(str(out), run, tmpls, p, lo, hi, str(scratch)) for lo, hi in chunks]
        done = refused = 0
        if jobs <= 1:
            results = map(_work, jobs_args)
            pool = None
        else:
            # a child forked after an S3 request cannot make its own: spawn for a URL
            pool = mp.get_context("spawn" if remote else "fork").Pool(jobs)
            results = pool.imap_unordered(_work, jobs_args)
        try:
            for n, bad, _ in results:
                done += n
                refused += bad
                if progress:
                    el = time.perf_counter() - t0
                    sys.stderr.write(f"\rbuilt {done} bundles in {el:.0f} s ({done / el:.0f}/s)")
                    sys.stderr.flush()
        finally:
            if pool is not None:
                pool.close()
                pool.join()
        if progress:
            sys.stderr.write("\n")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if refused:
        raise SystemExit(f"{refused} bundles were refused by ingest")
    if tokens is None:  # distinct: mean response tokens per bundle over the rollouts' own lengths
        per = [
            sum(
                int(x)
                for x in np.random.default_rng(r).integers(
                    max(2, mean_tokens // 2),
                    mean_tokens * 3 // 2 + 1,
                    size=max(1, samples // 8) * 8,
                )
            )
            for r in range(p["rollouts"])
        ]
        tokens = round(float(np.mean(per)))
    p.update(
        distinct=distinct,
        mean_tokens=mean_tokens,
        run=run,
        samples_per_bundle=samples,
        response_tokens_per_bundle=tokens,
        bundles=done,
        build_seconds=round(time.perf_counter() - t0, 1),
        store=str(out),
    )
    return p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=10000)
    ap.add_argument(
        "--samples", type=int, default=256, help="samples per bundle (8 per prompt group)"
    )
    ap.add_argument("--mean-tokens", type=int, default=64, help="mean response length per sample")
    ap.add_argument("--steps-per-rollout", type=int, default=8)
    ap.add_argument("--small", action="store_true", help="8 samples of 2-7 tokens (fast)")
    ap.add_argument(
        "--distinct", action="store_true", help="every bundle its own seeded content (no templates)"
    )
    ap.add_argument("--jobs", type=int, default=2, help="parallel ingest processes")
    ap.add_argument(
        "--batch-rollouts", type=int, default=25, help="rollouts per generate+ingest batch"
    )
    ap.add_argument("--fault-every", type=int, default=97)
    ap.add_argument("--clip-every", type=int, default=89)
    ap.add_argument("--run", default="long")
    args = ap.parse_args()
    p = make_store(
        args.out,
        steps=args.steps,
        samples=args.samples,
        mean_tokens=args.mean_tokens,
        per_rollout=args.steps_per_rollout,
        small=args.small,
        distinct=args.distinct,
        jobs=args.jobs,
        batch_rollouts=args.batch_rollouts,
        run=args.run,
        fault_every=args.fault_every,
        clip_every=args.clip_every,
    )
    truth = args.out.parent / f"{args.out.name}.truth.json"
    truth.write_text(json.dumps(p, indent=1) + "\n")
    print(
        f"{p['bundles']} bundles ({p['steps']} steps, {p['rollouts']} rollouts, "
        f"{p['samples_per_bundle']} samples, {p['response_tokens_per_bundle']} response tokens "
        f"each) in {p['build_seconds']} s -> {args.out}; truth {truth}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
