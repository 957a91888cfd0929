#!/usr/bin/env python
"""Huge inputs (issue 18 item 5): peak RSS and wall time of ingest, replay and REST download.

    .venv/bin/python scripts/bench/bench_huge.py [--payload-mib 2048] [--samples 1000000]
        [--work DIR] [--keep] [--only payload|samples]

Two bundles, each generated in this process (not measured):

- **payload**: one `rollout_routed_experts` payload of --payload-mib MiB (int32 routes
  `[T, 64, 8]`, 2 KiB per token, samples of 4,096 tokens with 2,048 response tokens),
  nothing else; replay's stages read no route payload without its train routes, so the
  replay row shows what a replay of such a step costs, not the payload's read.
- **samples**: --samples samples of one response token each (groups of 8), the six
  per-token payloads and expected values computed with trajstore's kernels, so replay
  recomputes every stage (sample, rewards, advantages, loss) over all of them.

Each stage runs in its own process, its peak RSS taken from `wait4` (ru_maxrss):
`trajstore ingest`, `trajstore replay --store ... --step` of the stored step, and
`trajstore serve` while a client here streams the biggest payload (`format=raw`) to
disk in 1 MiB pieces (the server's peak RSS; the body is checked byte for byte
against the payload file's tensor bytes). Prints one row per stage; the
documented bounds are in docs/reliability.md and docs/store.md.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trajstore.bundle.writer import BundleContents, default_stage_contracts, write_bundle
from trajstore.replay import kernels

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # the serve helper the tests use
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_replay import CONFIG  # noqa: E402  (the GRPO config of the synthetic bundles)

PY = sys.executable
#: route payload geometry: int32 [T, LAYERS, TOP_K], 2 KiB per token
LAYERS, TOP_K = 64, 8
TOTAL_LEN, RESPONSE_LEN = 4096, 2048
PER_TOKEN = ("old_log_probs", "log_probs", "ref_log_probs", "entropy", "kl", "advantages")


def _identity(rollout_id: int, step_id: int, groups: int) -> dict:
    return {
        "actor_step_id": {"rollout_id": rollout_id, "step_id": step_id},
        "consumer_batch_ids": ["cb-0"],
        "micro_batch_ids": [],
        "normalization_cohort_ids": ["nc-0"],
        "rank": {"cp": 1, "dp": 1, "pp": 1, "tp": 1},
        "rollout_id": None,
        "rollout_partition_ids": [f"rollout-{rollout_id}"],
        "semantic_group_ids": [f"g-{g}" for g in range(groups)],
        "weight_lineage": {"actor_weight": "w-1", "rollout_weight": "w-0"},
    }


def payload_contents(
    payload_bytes: int, *, rollout_id: int = 1, step_id: int = 0
) -> BundleContents:
    """A step whose only payload is `rollout_routed_experts` of `payload_bytes` (rounded down
    to whole 4,096-token samples)."""
    token_bytes = LAYERS * TOP_K * 4
    n = max(1, payload_bytes // (token_bytes * TOTAL_LEN))
    n -= n % 8 if n >= 8 else 0
    groups = max(1, n // 8)
    n = groups * 8 if n >= 8 else n
    rng = np.random.default_rng(0)
    routes = rng.integers(0, 64, size=(n * TOTAL_LEN, LAYERS, TOP_K), dtype=np.int32)
    samples = [
        {
            "group_index": i // 8,
            "label_hash": None,
            "loss_mask": [1] * RESPONSE_LEN,
            "micro_batch_id": None,
            "raw_reward": float(i % 5) / 4,
            "response_length": RESPONSE_LEN,
            "reward": 0.0,
            "sample_id": f"s-{i}",
            "total_length": TOTAL_LEN,
        }
        for i in range(n)
    ]
    cfg = dict(CONFIG, n_samples_per_prompt=min(8, n))
    return BundleContents(
        bundle_id=f"huge-payload-{rollout_id}-{step_id}",
        identity=_identity(rollout_id, step_id, groups),
        samples=samples,
        config=cfg,
        payloads={"rollout_routed_experts": routes},
        expected={},
        producer={"commit": "bench_huge", "dirty_patch_digest": "", "torch_version": "n/a"},
    )


def samples_contents(n: int, *, rollout_id: int = 2, step_id: int = 0) -> BundleContents:
    """`n` samples (a multiple of 8) of one response token, every v1 stage consistent."""
    if n % 8:
        raise ValueError("samples must be a multiple of 8 (groups of 8)")
    groups = n // 8
    rng = np.random.default_rng(1)
    gidx = np.repeat(np.arange(groups), 8)
    raw = rng.integers(0, 5, size=n).astype(np.float32) / np.float32(4)
    rewards = kernels.grpo_normalize(raw, gidx, 8)
    lens = np.ones(n, dtype=np.int64)
    old = (-rng.uniform(0.05, 3.0, n)).astype(np.float32)
    new = (old + rng.normal(0.0, 0.3, n)).astype(np.float32)
    ref = (old + rng.normal(0.0, 0.1, n)).astype(np.float32)
    entropy = rng.uniform(0.0, 2.0, n).astype(np.float32)
    kl = kernels.approx_kl(old, ref, "k3")
    advantages = np.asarray(rewards, dtype=np.float32)
    mask = np.ones(n, dtype=np.int64)
    loss = kernels.loss_policy(
        old,
        new,
        advantages,
        entropy,
        mask,
        lens,
        eps_clip=0.2,
        eps_clip_high=0.28,
        entropy_coef=0.01,
    )
    samples = [
        {
            "group_index": int(g),
            "label_hash": None,
            "loss_mask": [1],
            "micro_batch_id": f"mb-{i // 4096:04d}",
            "raw_reward": float(r),
            "response_length": 1,
            "reward": float(w),
            "sample_id": f"s-{i}",
            "total_length": 2,
        }
        for i, (g, r, w) in enumerate(
            zip(gidx.tolist(), raw.tolist(), rewards.tolist(), strict=True)
        )
    ]
    expected = {
        "loss.policy": loss,
        "reward.post_process": {"rewards": [float(x) for x in rewards]},
        "reward.raw": {"raw_rewards": [float(x) for x in raw]},
    }
    payloads = dict(zip(PER_TOKEN, (old, new, ref, entropy, kl, advantages), strict=True))
    identity = _identity(rollout_id, step_id, groups)
    identity["micro_batch_ids"] = sorted({s["micro_batch_id"] for s in samples})
    return BundleContents(
        bundle_id=f"huge-samples-{rollout_id}-{step_id}",
        identity=identity,
        samples=samples,
        config=dict(CONFIG),
        payloads=payloads,
        expected=expected,
        stage_contracts=default_stage_contracts(set(PER_TOKEN), expected, samples),
        producer={"commit": "bench_huge", "dirty_patch_digest": "", "torch_version": "n/a"},
    )


@dataclass
class Measured:
    """One process: exit code, wall seconds, peak RSS (bytes), last stderr line."""

    rc: int
    wall: float
    peak_rss: int
    stderr: str


#: address-space cap of every measured process (so a regression fails instead of swapping)
MEM_LIMIT = [16 << 30]


def _limit_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEM_LIMIT[0], MEM_LIMIT[0]))


def run_measured(args: list[str], *, env: dict[str, str] | None = None) -> Measured:
    """Run a command to completion under GNU time: its own peak RSS.

    Not wait4's ru_maxrss: Linux carries the parent's high-water mark into a
    forked child's, so a child of this (large) process would report our size.
    """
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        rss_file = Path(tmp) / "rss"
        err = Path(tmp) / "err"
        with err.open("wb") as f:
            rc = subprocess.call(
                ["/usr/bin/time", "-f", "%M", "-o", str(rss_file), *args],
                stdout=subprocess.DEVNULL,
                stderr=f,
                env=env,
                preexec_fn=_limit_memory,
            )
        wall = time.monotonic() - start
        lines = err.read_text(errors="replace").strip().splitlines()
        rss_lines = rss_file.read_text().strip().splitlines()
    return Measured(rc, wall, int(rss_lines[-1]) * 1024, lines[-1] if lines else "")


def vm_hwm(pid: int) -> int:
    """Peak RSS so far of a live process (VmHWM, reset at exec), bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return -1


def trajstore(*args: str) -> list[str]:
    return [PY, "-m", "trajstore", *args]


def tensor_sha256(pt_file: Path) -> tuple[str, int]:
    """sha256 and size of the tensor bytes inside a torch.save file (read in pieces)."""
    from trajstore.bundle.ptfile import read_pt_bytes

    t = read_pt_bytes(pt_file.read_bytes(), label=pt_file.name)
    h = hashlib.sha256()
    flat = t.array.reshape(-1).view(np.uint8)
    for start in range(0, flat.size, 64 << 20):
        h.update(flat[start : start + (64 << 20)])
    return h.hexdigest(), int(flat.size)


#: seconds `trajstore serve` may take to answer /v1/health (its catalog grows with samples)
SERVE_START_S = [900.0]


def serve_download(store: Path, key: str, name: str, out: Path) -> tuple[Measured, int, str]:
    """Start `trajstore serve`, stream one payload (format=raw) to `out`; the server's peak RSS.

    Returns (the server's Measured, bytes received, sha256 of the body); the Measured's
    stderr names how long the server took to answer its first health check.
    """
    import httpx
    from serving import ServeError, served

    h = hashlib.sha256()
    got = 0
    with tempfile.TemporaryFile() as err:  # read after the server stops
        started = time.monotonic()
        try:
            with (
                served(
                    store,
                    start_timeout_s=SERVE_START_S[0],
                    stderr=err,
                    preexec_fn=_limit_memory,
                ) as (pid, port),
                httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client,
            ):
                start = time.monotonic()
                up = start - started
                url = f"/v1/bundles/{key}/payloads/{name}"
                with (
                    client.stream("GET", url, params={"format": "raw"}) as resp,
                    out.open("wb") as f,
                ):
                    if resp.status_code != 200:
                        resp.read()
                        raise SystemExit(f"download: HTTP {resp.status_code} {resp.text[:200]}")
                    for piece in resp.iter_bytes(1 << 20):
                        f.write(piece)
                        h.update(piece)
                        got += len(piece)
                wall = time.monotonic() - start
                rss = vm_hwm(pid)
        except ServeError as e:
            raise SystemExit(str(e)) from None
        err.seek(0)
        text = err.read().decode(errors="replace").strip()
    return Measured(0, wall, rss, f"up in {up:.0f} s; {text[-200:]}"), got, h.hexdigest()


def _mb(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def bench_one(kind: str, contents: BundleContents, work: Path, big: str) -> list[tuple]:
    """Generate, then ingest / replay / download; one row per stage."""
    capture = work / f"capture-{kind}"
    store = work / f"store-{kind}"
    shutil.rmtree(capture, ignore_errors=True)
    shutil.rmtree(store, ignore_errors=True)
    t0 = time.monotonic()
    step = contents.identity["actor_step_id"]
    dest = capture / f"replay-{step['rollout_id']}-{step['step_id']}"
    write_bundle(dest, contents)
    del contents
    gen = time.monotonic() - t0
    pt = dest / "payloads" / f"{big}.pt"
    size = pt.stat().st_size
    index_size = (dest / "index.json").stat().st_size
    print(
        f"[{kind}] generated in {gen:.0f} s: {big}.pt {_mb(size)}, index.json {_mb(index_size)}",
        flush=True,
    )
    rows = []
    m = run_measured(trajstore("ingest", str(capture), "--store", str(store), "--run", "huge"))
    rows.append((kind, "ingest", m))
    _print_rows(rows)
    if m.rc != 0:
        return rows
    spec = f"{step['rollout_id']}:{step['step_id']}"
    m = run_measured(trajstore("replay", "--store", str(store), "--run", "huge", "--step", spec))
    rows.append((kind, "replay", m))
    _print_rows(rows[-1:])
    key = f"huge/step-{step['rollout_id']}-{step['step_id']}/a1"
    want_sha, want_len = tensor_sha256(pt)
    out = work / f"download-{kind}.raw"
    m, got, sha = serve_download(store, key, big, out)
    ok = got == want_len and sha == want_sha
    m.rc = 0 if ok else 1
    m.stderr = f"{m.stderr.split(';')[0]}; {got} bytes, {'identical' if ok else 'DIFFERENT'}"
    out.unlink(missing_ok=True)
    rows.append((kind, f"serve + download {big}", m))
    _print_rows(rows[-1:])
    return rows


def _print_rows(rows: list[tuple]) -> None:
    for kind, stage, m in rows:
        print(
            f"[{kind}] {stage}: rc {m.rc}, {m.wall:.1f} s, peak RSS {_mb(m.peak_rss)}"
            f"  {m.stderr[:160]}",
            flush=True,
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--payload-mib", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--work", type=Path, default=None, help="scratch dir (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch dir")
    ap.add_argument("--only", choices=("payload", "samples"), default=None)
    ap.add_argument("--mem-limit-gib", type=int, default=16, help="RLIMIT_AS of each stage")
    ap.add_argument("--serve-start-s", type=float, default=900.0, help="serve's start-up limit")
    a = ap.parse_args()
    MEM_LIMIT[0] = a.mem_limit_gib << 30
    SERVE_START_S[0] = a.serve_start_s
    work = a.work or Path(tempfile.mkdtemp(prefix="bench-huge-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"machine: {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}; work {work}", flush=True)
    rows: list[tuple] = []
    try:
        if a.only in (None, "payload"):
            rows += bench_one(
                "payload", payload_contents(a.payload_mib << 20), work, "rollout_routed_experts"
            )
        if a.only in (None, "samples"):
            rows += bench_one("samples", samples_contents(a.samples), work, "log_probs")
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    print("\n| bundle | stage | exit | wall | peak RSS |\n|---|---|---|---|---|")
    for kind, stage, m in rows:
        print(f"| {kind} | {stage} | {m.rc} | {m.wall:.1f} s | {_mb(m.peak_rss)} |")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0 if all(m.rc == 0 for _, _, m in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
