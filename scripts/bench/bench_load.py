#!/usr/bin/env python
"""Load on `trajstore serve` while an ingest runs (issue 18, item 6).

    .venv/bin/python scripts/bench/bench_load.py [--steps 400] [--duration 60]
        [--connections 64] [--threads 2] [--workers 1] [--json OUT] [--keep DIR]

Needs `wrk` (Debian: `apt-get install -y wrk`).

1. Builds a store of `--steps` actor steps (plus their rollout bundles) with
   distinct payload bytes (make_big_store.py --distinct, run "bench"), unless
   `--keep DIR` already holds one, and writes the ingest batches: clones of a
   template bundle for a second run "live" (make_big_store.py's Cloner),
   `--batch` bundles per capture directory.
2. Starts `trajstore serve --store ... --workers N` on a free loopback port and
   lists every payload URL of run "bench" (one GET per step).
3. Runs wrk (`-t<threads> -c<connections> -d<duration>s --timeout 30s`) with
   a Lua script mixing, per 10 requests: 7 step lookups (random step id of
   run "bench") and 3 payload downloads (a random payload URL; .npy or raw; one
   download in twelve with a suffix `Range: bytes=-n` header). Meanwhile
   `trajstore ingest <batch> --store ... --run live` runs batch after batch in
   a subprocess until wrk ends (so the server's catalog snapshot resyncs
   under load).
   Before that, unless --no-baseline, the same wrk run without the ingest:
   the p99 during the ingest is reported as a ratio to it (same machine,
   same load, a minute apart).
4. Reports wrk's requests, requests/s, non-2xx responses, socket errors
   (connect/read/write/timeout), latency p50/p90/p99/max; the ingest's
   bundles and exit codes; the server's peak RSS (VmHWM of each serve
   process, from /proc) and whether run "live" is served with every ingested
   bundle afterwards.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "tests"))  # the serve helper the tests use
from harness import emit, figure, load1  # noqa: E402
from serving import served  # noqa: E402

RUN = "bench"
LIVE = "live"

LUA = r"""
math.randomseed(%(seed)d)
local paths = {%(paths)s}
local n = 0
request = function()
  n = n + 1
  if n %% 10 < 7 then
    local s = math.random(0, %(last)d)
    local r, k = math.floor(s / %(per)d), s %% %(per)d
    return wrk.format("GET", string.format("/v1/runs/%(run)s/steps/%%d:%%d", r, k))
  end
  local path = paths[math.random(1, #paths)]
  if n %% 2 == 0 then path = path .. "?format=raw" end
  if n %% 40 == 7 then
    local range = string.format("bytes=-%%d", math.random(1, 4096))  -- any body: 206
    return wrk.format("GET", path, {["Range"] = range})
  end
  return wrk.format("GET", path)
end

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests": %%d, "duration_us": %%d, "bytes": %%d, "connect": %%d, ' ..
    '"read": %%d, "write": %%d, "status": %%d, "timeout": %%d, "p50_ms": %%.2f, ' ..
    '"p90_ms": %%.2f, "p99_ms": %%.2f, "max_ms": %%.2f, "mean_ms": %%.2f}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status,
    e.timeout, latency:percentile(50) / 1000, latency:percentile(90) / 1000,
    latency:percentile(99) / 1000, latency.max / 1000, latency.mean / 1000))
end
"""


def serve_processes(pid: int) -> list[int]:
    """`pid` and its children (the workers of `serve --workers N`)."""
    pids = [pid]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                pids.append(int(entry.name))
    return pids


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def build(root: Path, steps: int, per_rollout: int, batches: int, batch: int) -> dict:
    """The served store (if missing) and the ingest batches; returns the store's plan."""
    from make_big_store import Cloner, build_templates, make_store

    store = root / "store"
    plan_file = root / "plan.json"
    if not store.exists():
        plan = make_store(
            store,
            steps=steps,
            samples=64,
            mean_tokens=64,
            per_rollout=per_rollout,
            distinct=True,
            run=RUN,
        )
        plan_file.write_text(json.dumps(plan))
    plan = json.loads(plan_file.read_text())
    live = root / "live"
    shutil.rmtree(live, ignore_errors=True)
    shutil.rmtree(root / "tmpl-scratch", ignore_errors=True)
    tmpl = build_templates(root / "tmpl-scratch", 64, 64, small=False)["step-ok"]
    cloner = Cloner(tmpl)
    # live rollout ids start past any earlier --keep run's (rollout ids are unique per run)
    first = int(time.time()) % 1_000_000 * 1000
    for b in range(batches):
        cap = live / f"batch-{b:03d}"
        for i in range(batch):
            rollout = first + b * batch + i
            cloner.clone(cap / f"replay-{rollout}-0", rollout, 0)
    return plan


def ingest_loop(store: Path, live: Path, stop: threading.Event, out: dict) -> None:
    """`trajstore ingest` one batch after another until `stop` (or batches run out)."""
    out.update(batches=0, bundles=0, exit_codes=[], seconds=[])
    for cap in sorted(live.iterdir()):
        if stop.is_set():
            break
        t0 = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "trajstore", "ingest", str(cap), "--store", str(store)]
            + ["--run", LIVE],
            capture_output=True,
            text=True,
        )
        out["seconds"].append(round(time.perf_counter() - t0, 2))
        out["exit_codes"].append(done.returncode)
        if done.returncode != 0:
            out["stderr"] = done.stderr[-500:]
        out["batches"] += 1
        out["bundles"] += sum(1 for _ in cap.iterdir())
    out["ran_out"] = not stop.is_set()


def live_bundles(base: str) -> int:
    """Bundles of run "live" the server serves now."""
    runs = httpx.get(f"{base}/v1/runs", timeout=60).json()["items"]
    return sum(r["num_bundles"] for r in runs if r["run"] == LIVE)


def run_wrk(cmd: list[str]) -> dict:
    """One wrk run: the numbers its Lua `done` printed, plus its non-2xx count."""
    wrk = subprocess.run(cmd, capture_output=True, text=True)
    line = next((x for x in wrk.stdout.splitlines() if x.startswith("WRKJSON ")), None)
    if wrk.returncode != 0 or line is None:
        raise SystemExit(f"wrk failed: {wrk.stdout[-2000:]} {wrk.stderr[-2000:]}")
    result = json.loads(line.removeprefix("WRKJSON "))
    result["non_2xx"] = 0
    for x in wrk.stdout.splitlines():
        if "Non-2xx or 3xx responses:" in x:
            result["non_2xx"] = int(x.split(":")[1])
    return result


def summary(result: dict) -> dict:
    seconds = result["duration_us"] / 1e6
    return {
        "requests": result["requests"],
        "requests_per_s": round(result["requests"] / seconds, 1),
        "non_2xx": result["non_2xx"],
        "socket_errors": {k: result[k] for k in ("connect", "read", "write", "timeout")},
        "latency_ms": {k: result[f"{k}_ms"] for k in ("p50", "p90", "p99", "max", "mean")},
        "mb_received": round(result["bytes"] / 1e6, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--steps-per-rollout", type=int, default=8)
    ap.add_argument("--duration", type=int, default=60)
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--batch", type=int, default=20, help="bundles per ingest batch")
    ap.add_argument("--batches", type=int, default=60, help="ingest batches prepared")
    ap.add_argument(
        "--no-baseline",
        dest="baseline",
        action="store_false",
        help="skip the first wrk run (same mix, no ingest) that the p99 is compared with",
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep", type=Path, help="reuse (or build and keep) the store here")
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found (apt-get install -y wrk)")
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-load-"))
    root.mkdir(parents=True, exist_ok=True)
    load_before = load1()
    try:
        t0 = time.perf_counter()
        plan = build(root, args.steps, args.steps_per_rollout, args.batches, args.batch)
        print(
            f"store: {plan['bundles']} bundles; ingest batches ready in "
            f"{time.perf_counter() - t0:.0f} s",
            file=sys.stderr,
        )
        store = root / "store"
        with served(store, "--workers", str(args.workers), start_timeout_s=300) as (pid, port):
            base = f"http://127.0.0.1:{port}"
            per = args.steps_per_rollout
            last = plan["steps"] - 1
            with httpx.Client(base_url=base, timeout=60) as client:
                paths = []
                for s in range(0, plan["steps"]):
                    detail = client.get(f"/v1/runs/{RUN}/steps/{s // per}:{s % per}")
                    detail.raise_for_status()
                    for bundle in detail.json()["bundles"]:
                        paths += [p["url"] for p in bundle["payloads"]]
            lua = root / "mix.lua"
            lua.write_text(
                LUA
                % {
                    "seed": 7,
                    "paths": ",".join(json.dumps(p) for p in paths),
                    "last": last,
                    "per": per,
                    "run": RUN,
                }
            )
            cmd = ["wrk", f"-t{args.threads}", f"-c{args.connections}", f"-d{args.duration}s"]
            cmd += ["--timeout", "30s", "--latency", "-s", str(lua), base]
            quiet = run_wrk(cmd) if args.baseline else None
            live_before = live_bundles(base)  # a --keep store holds earlier runs' batches
            stop = threading.Event()
            ingest: dict = {}
            loop = threading.Thread(
                target=ingest_loop, args=(store, root / "live", stop, ingest), daemon=True
            )
            loop.start()
            result = run_wrk(cmd)
            stop.set()
            loop.join()
            rss = {p: round(peak_rss_mb(p), 1) for p in serve_processes(pid)}
            # what the ingest published is served (the snapshot resyncs within ~1 s)
            deadline = time.monotonic() + 30
            served_live = 0
            while time.monotonic() < deadline:
                served_live = live_bundles(base) - live_before
                if served_live >= ingest["bundles"]:
                    break
                time.sleep(0.5)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    during = summary(result)
    errors = during["non_2xx"] + sum(during["socket_errors"].values())
    doc = {
        "wrk": " ".join(cmd[:-1] + ["URL"]),
        "store": {"bundles": plan["bundles"], "steps": plan["steps"], "payload_urls": len(paths)},
        "during_ingest": during,
        "without_ingest": summary(quiet) if quiet else None,
        "p99_ratio_during_vs_without": (
            round(during["latency_ms"]["p99"] / quiet["p99_ms"], 2) if quiet else None
        ),
        "ingest": {
            "bundles": ingest["bundles"],
            "batches": ingest["batches"],
            "exit_codes_nonzero": sum(1 for c in ingest["exit_codes"] if c != 0),
            "batch_seconds_median": sorted(ingest["seconds"])[len(ingest["seconds"]) // 2]
            if ingest["seconds"]
            else None,
            "ran_out_of_batches": ingest["ran_out"],
            "new_bundles_served_afterwards": served_live,
        },
        "server_peak_rss_mb": rss,
        "errors": errors,
    }
    print(json.dumps(doc, indent=2))
    fig = figure(
        "requests failed during an ingest (non-2xx + socket errors)",
        "<= 0",
        errors,
        "",
        exact=True,  # a count
        detail=f"wrk {' '.join(cmd[1:-1])}, while `trajstore ingest` published "
        f"{ingest['bundles']} bundles; p99 {during['latency_ms']['p99']:.0f} ms",
    )
    emit(args.json, [fig], load_before, **doc)
    return 0 if doc["errors"] == 0 and doc["ingest"]["exit_codes_nonzero"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
