#!/usr/bin/env python
"""Web view benchmark: what a page fetches on a long run, against fetching the whole run.

    .venv/bin/python scripts/bench/bench_web.py STORE [--run long] [--repeats 15]

Serves STORE with `trajstore serve` (a subprocess on 127.0.0.1) and times, one
client with keep-alive, the repetitions interleaved so load drifts hit all alike:

- baseline "whole run": every step of the run through GET /v1/runs/{run}/steps
  (limit 1000, all pages): what a page that loaded everything would fetch;
- "steps page": what /runs/{run} fetches when it opens (docs/web.md): the run
  summary, the strip (400 bins) and the first 50 steps;
- "deep page": page 100 of 50 steps sorted by -status, against page 1 of the
  same sort (the cursor found beforehand): keyset paging should cost the same;
- "step page": one step's detail and its recorded result.

Prints medians (ms) and bytes, and the ratios whole run / steps page (time,
bytes) and deep page / first page (time). docs/web.md explains what the
pages fetch; docs/benchmarks.md keeps a run of this script.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx


def serve(store: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "TRAJSTORE_API_TOKEN"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "trajstore", "serve", "--store", str(store), "--port", str(port)]
        + ["--log-level", "warning"],
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/v1/health", timeout=5).status_code == 200:
                return proc, base
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("trajstore serve did not come up")


def timed(fetch: Callable[[], int]) -> tuple[float, int]:
    start = time.perf_counter()
    size = fetch()
    return time.perf_counter() - start, size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("store", type=Path)
    ap.add_argument("--run", default="long")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = ap.parse_args()
    proc, base = serve(args.store)
    run = args.run
    try:
        with httpx.Client(base_url=base, timeout=600) as http:

            def get(path: str, **params: object) -> httpx.Response:
                resp = http.get(path, params=params)
                resp.raise_for_status()
                return resp

            def whole_run() -> int:
                size, cursor, steps = 0, None, 0
                while True:
                    extra = {"cursor": cursor} if cursor else {}
                    resp = get(f"/v1/runs/{run}/steps", limit=1000, **extra)
                    size += len(resp.content)
                    page = resp.json()
                    steps += len(page["items"])
                    cursor = page["next_cursor"]
                    if cursor is None:
                        whole_run.steps = steps  # type: ignore[attr-defined]
                        return size

            def steps_page() -> int:
                return sum(
                    len(get(path, **params).content)
                    for path, params in (
                        (f"/v1/runs/{run}/summary", {}),
                        (f"/v1/runs/{run}/strip", {"bins": 400}),
                        (f"/v1/runs/{run}/steps", {"limit": 50}),
                    )
                )

            cursor = None
            for _ in range(99):  # the cursor of page 100
                cursor = get(
                    f"/v1/runs/{run}/steps",
                    limit=50,
                    sort="-status",
                    **({"cursor": cursor} if cursor else {}),
                ).json()["next_cursor"]
                assert cursor is not None, "the run has fewer than 100 pages of 50 steps"
            deep_cursor = cursor
            first = get(f"/v1/runs/{run}/steps", limit=1).json()["items"][0]
            ref = f"{first['rollout_id']}:{first['step_id']}"

            def first_page() -> int:
                return len(get(f"/v1/runs/{run}/steps", limit=50, sort="-status").content)

            def deep_page() -> int:
                params = {"limit": 50, "sort": "-status", "cursor": deep_cursor}
                return len(get(f"/v1/runs/{run}/steps", **params).content)

            def step_page() -> int:
                size = len(get(f"/v1/runs/{run}/steps/{ref}").content)
                resp = http.get(f"/v1/runs/{run}/steps/{ref}/result")
                assert resp.status_code in (200, 404)
                return size + len(resp.content)

            cases = {
                "whole_run": whole_run,
                "steps_page": steps_page,
                "first_page": first_page,
                "deep_page": deep_page,
                "step_page": step_page,
            }
            for fetch in cases.values():  # warm-up
                fetch()
            times: dict[str, list[float]] = {name: [] for name in cases}
            sizes: dict[str, int] = {}
            for _ in range(args.repeats):
                for name, fetch in cases.items():
                    seconds, sizes[name] = timed(fetch)
                    times[name].append(seconds)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    median = {name: statistics.median(values) for name, values in times.items()}
    out = {
        "store": str(args.store),
        "run": run,
        "steps": whole_run.steps,  # type: ignore[attr-defined]
        "repeats": args.repeats,
        "median_ms": {name: round(value * 1000, 2) for name, value in median.items()},
        "bytes": sizes,
        "whole_run_over_steps_page_time": round(median["whole_run"] / median["steps_page"], 2),
        "whole_run_over_steps_page_bytes": round(sizes["whole_run"] / sizes["steps_page"], 1),
        "deep_over_first_page_time": round(median["deep_page"] / median["first_page"], 2),
    }
    print(f"run {run}: {out['steps']} steps, {args.repeats} repetitions, medians")
    for name in cases:
        print(f"  {name:<11} {out['median_ms'][name]:>9.2f} ms {sizes[name]:>11} bytes")
    print(
        f"whole run / steps page: {out['whole_run_over_steps_page_time']}x time, "
        f"{out['whole_run_over_steps_page_bytes']}x bytes; "
        f"page 100 / page 1 (sort -status): {out['deep_over_first_page_time']}x time"
    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
