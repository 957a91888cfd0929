#!/usr/bin/env python
"""REST benchmark (issue 15): step lookup throughput vs a bare FastAPI endpoint,
and the first (cold) payload download vs `torch.load`, in one run.

    .venv/bin/python scripts/bench/bench_rest.py [--quick] [--json OUT] [--steps 2000]
        [--workers 1,2] [--duration 10] [--keep DIR] [--only lookup|cold]

Needs `wrk` (Debian: `apt-get install -y wrk`) and root (the cold part drops the
page cache with `sync; echo 3 > /proc/sys/vm/drop_caches`).

1. Builds a store of distinct bundles (make_big_store.py --distinct) plus one
   bundle with a large `log_probs` payload (--tokens float32 values).
2. For each N in --workers: starts a bare FastAPI app (one sync endpoint at the
   same path returning a small JSON) under uvicorn with the same settings as
   `trajstore serve --workers N` (127.0.0.1, log level warning, N workers), and
   `trajstore serve --workers N` on the store, side by side; drives them in turn
   (--rounds times: bare, then trajstore) with `wrk -t2 -c16 -d<duration>s` and a
   Lua script cycling random step ids. Prints requests/s, p50/p99 and the ratio
   trajstore / bare (medians over rounds; round 1 is every step's first lookup).
3. Cold (first) download, --repeats times: drop the page cache and
   `torch.load` the payload's .pt file; then for format npy and raw, start a
   fresh `trajstore serve` (nothing of the bundle open or cached in it), drop
   the page cache and GET the payload (httpx, whole body read). Ratio =
   torch.load time / download time (medians), with the CPU seconds of the server
   process (all threads) and of the client during each GET. The HTTP ceiling: the
   bare app returning as many bytes from memory (warm), as one body and streamed in
   2 MiB pieces (as the download streams its decode batches), same ratio.

`--json OUT` writes the issue-15 contract document: {"figures": [{name, target,
value, unit, met, detail}], "command", "load": [1-min load before, after]}, with
the lookup ratio and p99 per worker count, the scaling of `serve --workers`
(req/s with the most workers / with 1) and the first-download ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))  # the free-port helper the tests use
from harness import drop_caches, emit, load1, machine_line  # noqa: E402
from serving import free_port  # noqa: E402

RUN = "bench"
BIG_ROLLOUT = 999999

#: the bare baseline: same path shape and a sync endpoint (FastAPI's thread pool), as ours
bare_app = FastAPI()


@bare_app.get("/v1/runs/{run}/steps/{rollout_id}:{step_id}")
def bare_step(run: str, rollout_id: int, step_id: int) -> dict:
    return {"run": run, "kind": "step", "rollout_id": rollout_id, "step_id": step_id}


#: the bare app started exactly as `trajstore serve --workers N` starts its app
BARE = """
import uvicorn
from trajstore.cli.serve_cmd import run_workers
port, workers = %d, %d
if workers == 1:
    from bench_rest import bare_app
    uvicorn.run(bare_app, host="127.0.0.1", port=port, log_level="warning")
else:
    run_workers(
        "bench_rest:bare_app", host="127.0.0.1", port=port, workers=workers, log_level="warning"
    )
"""

_BLOBS: dict[int, bytes] = {}


def _blob(size: int) -> bytes:
    """`size` random bytes, made once per size (not per request: `os.urandom` of 64 MB
    takes longer than sending it)."""
    blob = _BLOBS.get(size)
    if blob is None:
        blob = _BLOBS[size] = os.urandom(size)
    return blob


@bare_app.get("/blob/{size}")
def bare_blob(size: int) -> Response:
    """`size` bytes from memory: the HTTP ceiling of a download on this machine."""
    blob = _blob(size)
    return Response(content=blob, media_type="application/octet-stream")


@bare_app.get("/blob/{size}/streamed")
def bare_blob_streamed(size: int) -> StreamingResponse:
    """The same bytes as `bare_blob`, sent in 2 MiB pieces (as the streamed download sends
    its decode batches): one large write costs asyncio two copies of what the socket did
    not take at once."""
    blob = _blob(size)
    pieces = [blob[i : i + (2 << 20)] for i in range(0, size, 2 << 20)]
    return StreamingResponse(
        iter(pieces),
        media_type="application/octet-stream",
        headers={"Content-Length": str(size)},
    )


LUA = """
math.randomseed(%(seed)d)
request = function()
  local n = math.random(0, %(last)d)
  local rollout, step = math.floor(n / %(per)d), n %% %(per)d
  return wrk.format("GET", string.format("/v1/runs/%(run)s/steps/%%d:%%d", rollout, step))
end
"""


def wait_ready(port: int, proc: subprocess.Popen, path: str) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server on port {port} exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"server on port {port} not ready in 300 s")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def build(root: Path, steps: int, samples: int, tokens: int, per_rollout: int) -> Path:
    """The store (distinct bundles) and the big bundle's directory (kept for torch.load)."""
    from trajstore.examples.replay_builders import consistent_contents

    from trajstore.bundle.writer import write_bundle
    from trajstore.store import Store

    t0 = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            str(HERE / "make_big_store.py"),
            str(root / "store"),
            "--steps",
            str(steps),
            "--samples",
            str(samples),
            "--steps-per-rollout",
            str(per_rollout),
            "--distinct",
            "--run",
            RUN,
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    big = root / "big" / f"replay-{BIG_ROLLOUT}-0"
    contents = consistent_contents(groups=1, n=2, lengths=tokens // 2, rollout_id=BIG_ROLLOUT)
    write_bundle(big, contents.contents)
    with Store.open(root / "store", create=False) as store:
        store.ingest([big.parent], run=RUN)
    took = time.perf_counter() - t0
    print(f"built {steps} distinct steps + a {tokens}-token bundle in {took:.0f} s")
    return big


def wrk(port: int, lua: Path, duration: int) -> dict[str, float]:
    out = subprocess.run(
        [
            "wrk",
            "-t2",
            "-c16",
            f"-d{duration}s",
            "--latency",
            "-s",
            str(lua),
            f"http://127.0.0.1:{port}",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))

    def ms(pct: str) -> float:
        value, unit = re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M).groups()
        return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]

    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if bad or (errors and any(int(n) for n in errors.groups()[:3])):
        raise SystemExit(f"wrk saw failed requests on port {port}:\n{out}")
    # a request slower than wrk's 2 s timeout is not in its latency figures: counted apart
    timeouts = int(errors.group(4)) if errors else 0
    return {"rps": rps, "p50": ms("50"), "p99": ms("99"), "timeouts": timeouts}


def serve(
    store: Path, port: int, workers: int, env: dict[str, str] | None = None
) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "trajstore", "serve", "--store", str(store), "--port", str(port)]
    cmd += ["--log-level", "warning", "--workers", str(workers)]
    return subprocess.Popen(cmd, env={**os.environ, **(env or {})})


def lookups(root: Path, args: argparse.Namespace) -> dict[int, dict[str, dict[str, float]]]:
    """wrk figures per worker count: {"bare": ..., "ours": ..., "first": ...}.

    Both servers run side by side and are driven in turn, --rounds times (bare, then
    ours): on a shared loaded box the load moves within seconds, so each round's ratio
    compares neighbours in time and the figures are medians over rounds. "first" is
    round 1 of ours, where each step is looked up for the first time in that server.
    """
    results: dict[int, dict[str, dict[str, float]]] = {}
    lua = root / "steps.lua"
    lua.write_text(
        LUA % {"seed": 1, "last": args.steps - 1, "run": RUN, "per": args.steps_per_rollout}
    )
    for workers in args.workers:
        bare_port, port = free_port(), free_port()
        bare = subprocess.Popen([sys.executable, "-c", BARE % (bare_port, workers)], cwd=HERE)
        t0 = time.perf_counter()
        server = serve(root / "store", port, workers)
        rounds: list[tuple[dict[str, float], dict[str, float]]] = []
        try:
            wait_ready(port, server, f"/v1/runs/{RUN}/steps/0:0")
            ready = time.perf_counter() - t0
            wait_ready(bare_port, bare, f"/v1/runs/{RUN}/steps/0:0")
            for _ in range(args.rounds):
                rounds.append((wrk(bare_port, lua, args.duration), wrk(port, lua, args.duration)))
        finally:
            stop(bare)
            stop(server)

        got = {
            side: {
                field: statistics.median(r[i][field] for r in rounds)
                for field in ("rps", "p50", "p99", "timeouts")
            }
            for i, side in enumerate(("bare", "ours"))
        }
        each = ", ".join(f"{o['rps'] / b['rps']:.2f}" for b, o in rounds)
        got["ours"]["ratio"] = statistics.median(o["rps"] / b["rps"] for b, o in rounds)
        got["ours"]["max_p99"] = max(o["p99"] for _, o in rounds)
        got["first"] = {**rounds[0][1], "ratio": rounds[0][1]["rps"] / rounds[0][0]["rps"]}
        base, ours = got["bare"], got["ours"]
        print(
            f"lookup --workers {workers} (medians of {args.rounds} rounds): bare FastAPI "
            f"{base['rps']:.0f} req/s (p50 {base['p50']:.1f} ms, p99 {base['p99']:.1f} ms); "
            f"trajstore serve {ours['rps']:.0f} req/s (p50 {ours['p50']:.1f} ms, p99 "
            f"{ours['p99']:.1f} ms, ready in {ready:.1f} s); ratio {ours['ratio']:.2f}x "
            f"(rounds: {each}); "
            f"over 2 s: {ours['timeouts']:.0f} (bare {base['timeouts']:.0f})"
        )
        results[workers] = got
    return results


def process_cpu_s(pid: int) -> float:
    """CPU seconds of every live thread of `pid` so far (/proc/PID/task/*/schedstat, ns)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def cold_download(root: Path, big: Path, repeats: int) -> dict[str, float]:
    """Medians in seconds: "torch.load" (cold), "ceiling" (bare app, warm, one body),
    "ceiling_streamed" (the same bytes streamed in 2 MiB pieces), "npy", "raw" (a fresh
    server, cold page cache), "<fmt>_server_cpu" / "<fmt>_client_cpu" (CPU seconds of the
    server process and of this client during the GET); "mb" the payload's size."""
    import torch

    pt = big / "payloads" / "log_probs.pt"
    url = f"/v1/bundles/{RUN}/step-{BIG_ROLLOUT}-0/a1/payloads/log_probs"
    loads: list[float] = []
    gets: dict[str, list[float]] = {"npy": [], "raw": []}
    cpu: dict[str, list[float]] = {}
    for _ in range(repeats):
        drop_caches()
        t = time.perf_counter()
        tensor = torch.load(pt, weights_only=True)
        loads.append(time.perf_counter() - t)
        nbytes = tensor.numel() * tensor.element_size()
        for fmt, times in gets.items():
            # a fresh server each time: nothing of the bundle is open or cached in it
            port = free_port()
            server = serve(root / "store", port, 1)
            try:
                wait_ready(port, server, "/v1/health")
                with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as client:
                    drop_caches()
                    server_cpu, client_cpu = process_cpu_s(server.pid), time.process_time()
                    t = time.perf_counter()
                    response = client.get(url, params={"format": fmt})
                    times.append(time.perf_counter() - t)
                    client_cpu = time.process_time() - client_cpu
                    server_cpu = process_cpu_s(server.pid) - server_cpu
                cpu.setdefault(f"{fmt}_server_cpu", []).append(server_cpu)
                cpu.setdefault(f"{fmt}_client_cpu", []).append(client_cpu)
                response.raise_for_status()
                if len(response.content) < nbytes:
                    raise SystemExit(f"format={fmt}: short body {len(response.content)}")
            finally:
                stop(server)
    port = free_port()
    bare = subprocess.Popen([sys.executable, "-c", BARE % (port, 1)], cwd=HERE)
    ceilings: dict[str, list[float]] = {"ceiling": [], "ceiling_streamed": []}
    paths = {"ceiling": f"/blob/{nbytes}", "ceiling_streamed": f"/blob/{nbytes}/streamed"}
    try:
        wait_ready(port, bare, "/blob/1")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as client:
            for path in paths.values():
                client.get(path).raise_for_status()
            for _ in range(repeats):
                for name, path in paths.items():
                    t = time.perf_counter()
                    client.get(path).raise_for_status()
                    ceilings[name].append(time.perf_counter() - t)
    finally:
        stop(bare)
    mb = nbytes / 1e6
    load = statistics.median(loads)
    out = {"torch.load": load, "mb": mb}
    out.update({name: statistics.median(times) for name, times in ceilings.items()})
    out.update({name: statistics.median(values) for name, values in cpu.items()})
    print(
        f"HTTP ceiling: bare FastAPI returning {mb:.1f} MB from memory {out['ceiling'] * 1e3:.0f}"
        f" ms (one body), {out['ceiling_streamed'] * 1e3:.0f} ms (streamed in 2 MiB pieces); "
        f"ratio {load / out['ceiling']:.2f}x / {load / out['ceiling_streamed']:.2f}x "
        f"torch.load (cold)"
    )
    print(f"cold payload {mb:.1f} MB: torch.load {load * 1e3:.0f} ms ({mb / load:.0f} MB/s)")
    for fmt, times in gets.items():
        got = statistics.median(times)
        out[fmt] = got
        print(
            f"  cold GET format={fmt}: {got * 1e3:.0f} ms ({mb / got:.0f} MB/s); "
            f"ratio {load / got:.2f}x torch.load; CPU: server "
            f"{out[f'{fmt}_server_cpu'] * 1e3:.0f} ms, client {out[f'{fmt}_client_cpu'] * 1e3:.0f}"
            f" ms (medians of {repeats})"
        )
    return out


def figures(
    args: argparse.Namespace,
    looked: dict[int, dict[str, dict[str, float]]],
    cold: dict[str, float] | None,
) -> list[dict]:
    """The issue-15 figures, each with its target and whether this run met it."""
    size = f"{args.steps} steps x {args.samples} samples, wrk -t2 -c16 -d{args.duration}s"
    out = []
    size += f", medians of {args.rounds} rounds"
    for workers, got in looked.items():
        base, ours, first = got["bare"], got["ours"], got["first"]
        ratio = ours["ratio"]
        out.append(
            {
                "name": f"REST step lookup throughput, --workers {workers}, vs bare FastAPI",
                "target": ">= 0.8x",
                "value": round(ratio, 3),
                "unit": "x",
                "met": ratio >= 0.8,
                "detail": f"trajstore serve {ours['rps']:.0f} req/s vs a bare FastAPI endpoint "
                f"{base['rps']:.0f} req/s, same launch and {workers} worker(s); round 1 (every "
                f"step's first lookup in the server) {first['ratio']:.2f}x; {size}",
            }
        )
        out.append(
            {
                "name": f"REST step lookup p99, --workers {workers}",
                "target": "<= 50 ms",
                "value": round(ours["p99"], 1),
                "unit": "ms",
                "met": ours["p99"] <= 50 and not ours["timeouts"],
                "detail": f"p50 {ours['p50']:.1f} ms, worst round's p99 {ours['max_p99']:.1f} "
                f"ms, round 1's {first['p99']:.1f} ms, {ours['timeouts']:.0f} requests over "
                f"wrk's 2 s timeout; bare FastAPI p99 {base['p99']:.1f} ms, "
                f"{base['timeouts']:.0f} over 2 s; {size}",
            }
        )
    if len(looked) > 1:
        low, high = min(looked), max(looked)
        scaling = looked[high]["ours"]["rps"] / looked[low]["ours"]["rps"]
        bare = looked[high]["bare"]["rps"] / looked[low]["bare"]["rps"]
        out.append(
            {
                "name": f"serve --workers scaling, {high} vs {low}",
                "target": ">= 1.2x",
                "value": round(scaling, 3),
                "unit": "x",
                "met": scaling >= 1.2,
                "detail": f"trajstore serve req/s with {high} workers / with {low}; the bare "
                f"FastAPI app scales {bare:.2f}x on the same machine; {size}",
            }
        )
    for fmt in ("npy", "raw") if cold else ():
        ratio = cold["torch.load"] / cold[fmt]
        out.append(
            {
                "name": f"first (cold) payload download over REST, format={fmt}, vs torch.load",
                "target": ">= 0.35x",
                "value": round(ratio, 3),
                "unit": "x",
                "met": ratio >= 0.35,
                "detail": f"{cold['mb']:.1f} MB float32: torch.load {cold['torch.load'] * 1e3:.0f}"
                f" ms, GET {cold[fmt] * 1e3:.0f} ms (fresh server, page cache dropped, httpx, "
                f"median of {args.repeats}; CPU: server {cold[f'{fmt}_server_cpu'] * 1e3:.0f} ms, "
                f"client {cold[f'{fmt}_client_cpu'] * 1e3:.0f} ms); HTTP ceiling (bare app "
                f"from memory) {cold['torch.load'] / cold['ceiling']:.2f}x one body, "
                f"{cold['torch.load'] / cold['ceiling_streamed']:.2f}x in 2 MiB pieces",
            }
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="200 steps, 16 samples, 4 M tokens, 5 s, 3 repeats"
    )
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--steps-per-rollout", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16_000_000, help="big payload's values")
    ap.add_argument("--duration", type=int, default=10, help="wrk seconds per server")
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    ap.add_argument("--repeats", type=int, default=3, help="cold downloads (median)")
    ap.add_argument("--rounds", type=int, default=3, help="wrk runs per server, in turn (median)")
    ap.add_argument(
        "--keep", type=Path, help="build into (and keep) this directory; reused when built"
    )
    ap.add_argument("--json", type=Path, metavar="OUT", help="write the issue-15 figures here")
    ap.add_argument(
        "--only",
        choices=("lookup", "cold"),
        help="run only the wrk lookups or only the first (cold) download (default: both)",
    )
    args = ap.parse_args()
    if args.quick:
        args.steps, args.samples, args.tokens, args.duration = 200, 16, 4_000_000, 5
        args.repeats = min(args.repeats, 3)
    args.workers = [int(w) for w in args.workers.split(",")]
    if shutil.which("wrk") is None and args.only != "cold":
        raise SystemExit("wrk not found: apt-get install -y wrk")
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-rest-"))
    root.mkdir(parents=True, exist_ok=True)
    before = load1()
    print(f"machine: {machine_line()}, load {before:.2f}")
    try:
        big = root / "big" / f"replay-{BIG_ROLLOUT}-0"
        if not (args.keep and (root / "store").is_dir() and big.is_dir()):
            big = build(root, args.steps, args.samples, args.tokens, args.steps_per_rollout)
        else:
            print(f"reusing the store built earlier in {root} (same --steps expected)")
        looked = lookups(root, args) if args.only != "cold" else {}
        cold = cold_download(root, big, args.repeats) if args.only != "lookup" else None
        emit(args.json, figures(args, looked, cold), before)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
