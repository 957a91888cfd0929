#!/usr/bin/env python
"""REST benchmark: step lookup latency and payload download throughput.

    python scripts/bench/bench_api.py [--steps 10000] [--requests 2000] [--tokens 4000000]

Builds a store of N small step bundles (one run) plus one bundle with a large
payload, starts `trajstore serve` in a subprocess, and measures
- p50/p99 of GET /v1/runs/{run}/steps/{r}:{s} over random steps (one client,
  keep-alive, after one warm-up pass over 200 steps);
- payload download (.npy and raw, whole body read) vs torch.load of the same
  payload from the bundle directory: ratio = torch.load time / download time.
"""

from __future__ import annotations

import argparse
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch
from trajstore.examples.replay_builders import consistent_contents

from trajstore.bundle.writer import write_bundle
from trajstore.store import Store


def time_downloads(
    client: httpx.Client, url: str, pt: Path, repeats: int
) -> tuple[list[float], dict[str, list[float]], int]:
    """Interleaved timings of torch.load(pt) and GET url (npy, raw); and the payload's bytes."""
    loads: list[float] = []
    gets: dict[str, list[float]] = {"npy": [], "raw": []}
    for _ in range(repeats):
        t = time.perf_counter()
        tensor = torch.load(pt, weights_only=True)
        loads.append(time.perf_counter() - t)
        for fmt, times in gets.items():
            t = time.perf_counter()
            body = client.get(url, params={"format": fmt}).content
            times.append(time.perf_counter() - t)
            assert len(body) >= tensor.numel() * tensor.element_size()
    return loads, gets, tensor.numel() * tensor.element_size()


def build(root: Path, steps: int, tokens: int) -> Path:
    cap = root / "capture"
    cap.mkdir()
    t0 = time.perf_counter()
    for index in range(steps):
        rollout_id, step_id = divmod(index, 4)
        small = consistent_contents(
            groups=2, n=2, lengths=8, rollout_id=rollout_id, step_id=step_id, seed=index
        )
        write_bundle(cap / f"replay-{rollout_id}-{step_id}", small.contents)
    big = root / "big" / "replay-999999-0"
    write_bundle(
        big,
        consistent_contents(groups=1, n=2, lengths=tokens // 2, rollout_id=999999, seed=1).contents,
    )
    t1 = time.perf_counter()
    with Store.open(root / "store", durable=False) as st:
        st.ingest([cap, big.parent], run="bench")
    print(f"built {steps} steps in {t1 - t0:.1f} s, ingested in {time.perf_counter() - t1:.1f} s")
    return big


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10000)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=4_000_000)
    ap.add_argument("--keep", help="build into (and keep) this directory")
    args = ap.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="bench-api-"))
    root.mkdir(parents=True, exist_ok=True)
    big = build(root, args.steps, args.tokens)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trajstore",
            "serve",
            "--store",
            str(root / "store"),
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
    )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as c:
            for _ in range(1200):
                try:
                    if c.get("/v1/health").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.1)
            print(f"server ready in {time.perf_counter() - t0:.1f} s")
            rng = random.Random(0)
            ids = [divmod(rng.randrange(args.steps), 4) for _ in range(args.requests)]
            for r, s in ids[:200]:
                c.get(f"/v1/runs/bench/steps/{r}:{s}")
            lat = []
            for r, s in ids:
                t = time.perf_counter()
                resp = c.get(f"/v1/runs/bench/steps/{r}:{s}")
                lat.append(time.perf_counter() - t)
                assert resp.status_code == 200, resp.text
            ms = np.array(lat) * 1e3
            print(
                f"GET /v1/runs/bench/steps/R:S on {args.steps} steps, {args.requests} requests: "
                f"p50 {np.percentile(ms, 50):.2f} ms, p99 {np.percentile(ms, 99):.2f} ms"
            )

            pt = big / "payloads" / "log_probs.pt"
            url = "/v1/bundles/bench/step-999999-0/a1/payloads/log_probs"
            cold = {}
            for fmt in (
                "npy",
                "raw",
            ):  # first download: decoded from the store (not yet in the body cache)
                t = time.perf_counter()
                c.get(url, params={"format": fmt}).raise_for_status()
                cold[fmt] = time.perf_counter() - t
            loads, gets, nbytes = time_downloads(c, url, pt, 5)
            mb = nbytes / 1e6
            tl = float(np.median(loads))
            print(f"payload {mb:.1f} MB: torch.load {mb / tl:.0f} MB/s")
            for fmt, ts in gets.items():
                tg = float(np.median(ts))
                print(
                    f"  GET format={fmt}: cold {mb / cold[fmt]:.0f} MB/s ({tl / cold[fmt]:.2f}x "
                    f"torch.load), warm {mb / tg:.0f} MB/s ({tl / tg:.2f}x torch.load, from the "
                    "server's body cache)"
                )
    finally:
        server.terminate()
        server.wait(timeout=30)
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
