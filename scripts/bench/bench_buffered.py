#!/usr/bin/env python
"""Concurrent Range requests on a huge payload: the server's peak RSS (issue 18, item 5).

    .venv/bin/python scripts/bench/bench_buffered.py [--payload-mib 256] [--requests 8]
        [--work DIR]

One step whose only payload is a --payload-mib MiB route payload (bench_huge's
generator) is ingested once; then `trajstore serve` is started twice on it and
--requests concurrent `Range: bytes=0-1048575` requests (format=raw) are sent,
each answer checked against the payload's first MiB:

- **unbounded**: `TRAJSTORE_API_SERIAL_BUILD_BYTES` set past any body, which is the
  behaviour before the fix (every request builds its own copy of the body);
- **bounded**: the defaults (bodies over 64 MiB built one at a time, shared by ETag).

The payload is larger than a quarter of the default body cache (512 MiB), so it is
never cached: the worst case. Prints the server's RSS before the requests and its
peak (VmHWM) after, wall time, and the statuses.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the serve helper

import httpx  # noqa: E402
from bench_huge import payload_contents, trajstore, vm_hwm  # noqa: E402
from serving import served  # noqa: E402

from trajstore.bundle.ptfile import read_pt_bytes  # noqa: E402
from trajstore.bundle.writer import write_bundle  # noqa: E402

NAME = "rollout_routed_experts"
KEY = "huge/step-1-0/a1"
RANGE_END = (1 << 20) - 1


def vm_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return -1


def measure(store: Path, env: dict[str, str], requests: int, want: bytes) -> str:
    """Serve `store` with `env`, send the concurrent ranges; one result line."""
    with served(store, "--log-level", "error", start_timeout_s=300, **env) as (pid, port):
        url = f"http://127.0.0.1:{port}/v1/bundles/{KEY}/payloads/{NAME}?format=raw"
        before = vm_rss(pid)

        def fetch(_: int) -> tuple[int, bool]:
            got = httpx.get(url, headers={"Range": f"bytes=0-{RANGE_END}"}, timeout=600)
            return got.status_code, got.content == want

        start = time.monotonic()
        with ThreadPoolExecutor(requests) as pool:
            answers = list(pool.map(fetch, range(requests)))
        wall = time.monotonic() - start
        peak = vm_hwm(pid)
    statuses = sorted({status for status, _ in answers})
    right = sum(ok for status, ok in answers if status == 206)
    return (
        f"RSS before {before / 2**20:,.0f} MiB, peak {peak / 2**20:,.0f} MiB "
        f"(+{(peak - before) / 2**20:,.0f} MiB), {wall:.1f} s, statuses {statuses}, "
        f"{right}/{requests} bodies right"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--payload-mib", type=int, default=256)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_buffered-"))
    capture, store = work / "capture", work / "store"
    if not store.exists():
        dest = capture / "replay-1-0"
        write_bundle(dest, payload_contents(args.payload_mib << 20))
        subprocess.run(
            trajstore("ingest", str(capture), "--store", str(store), "--run", "huge"),
            check=True,
            stdout=subprocess.DEVNULL,
        )
    pt = capture / "replay-1-0" / "payloads" / f"{NAME}.pt"
    tensor = read_pt_bytes(pt.read_bytes(), label=pt.name).array
    size = tensor.nbytes
    want = tensor.reshape(-1).view("u1")[: RANGE_END + 1].tobytes()
    del tensor
    print(f"payload {size / 2**20:,.0f} MiB, {args.requests} concurrent 1 MiB ranges", flush=True)
    unbounded = {"TRAJSTORE_API_SERIAL_BUILD_BYTES": str(1 << 62)}
    print(
        "unbounded (each request builds its copy):", measure(store, unbounded, args.requests, want)
    )
    print("bounded (defaults):", measure(store, {}, args.requests, want), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
