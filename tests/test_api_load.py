"""A few seconds of scripts/bench/bench_load.py's mix, checked answer by answer (issue 18, 6).

`trajstore serve` (a subprocess) answers 6 client threads doing 7 step
lookups to 3 payload downloads (npy, raw, a suffix Range) while `trajstore
ingest` publishes 12 bundles into the same store in another process. Every
answer must be a 2xx with the right body (built from the fixture's own `.pt`
files, not asked of the server); afterwards the ingest exited 0 and everything
it published is served. The 60 s wrk run with 64 connections and
its p99 are the benchmark's (docs/benchmarks.md), not this test's.
"""

from __future__ import annotations

import io
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from conftest import CAPTURE_DIR, make_contents
from test_api_hostile import KEY, served, store  # noqa: F401  (the module's store fixture)

from trajstore.bundle.writer import write_bundle

pytestmark = pytest.mark.integration

LIVE_BUNDLES = 12
THREADS = 6
#: how long the clients keep going after the ingest started (at least until it ends)
MIN_SECONDS = 3.0


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("live")
    for i in range(LIVE_BUNDLES):
        contents = make_contents(rollout_id=1000 + i, step_id=0, seed=i, lengths=32)
        write_bundle(root / f"replay-{1000 + i}-0", contents)
    return root


def fixture_bodies(detail: dict) -> dict[tuple[str, str], bytes]:
    """(payload URL, format) -> the body it must be, built from the fixture's own `.pt`
    files (torch.load), never from the server: `raw` is the tensor's little-endian C-order
    bytes, `npy` what `np.save` writes for it (docs/rest.md)."""
    bodies = {}
    assert sorted(b["rank"] for b in detail["bundles"]) == [0, 1]
    for bundle in detail["bundles"]:
        folder = CAPTURE_DIR / "replay-120-0" / f"rank-{bundle['rank']}" / "payloads"
        assert {p["name"] for p in bundle["payloads"]} == {f.stem for f in folder.glob("*.pt")}
        for payload in bundle["payloads"]:
            tensor = torch.load(folder / f"{payload['name']}.pt", weights_only=True)
            values = tensor.contiguous().numpy()
            values = values.astype(values.dtype.newbyteorder("<"))
            npy = io.BytesIO()
            np.save(npy, values)
            bodies[(payload["url"], "raw")] = values.tobytes()
            bodies[(payload["url"], "npy")] = npy.getvalue()
    return bodies


def test_lookups_and_downloads_stay_correct_while_an_ingest_runs(
    store: Path,  # noqa: F811
    capture: Path,
) -> None:
    with served(store) as (_, port):
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=60) as client:
            detail = client.get("/v1/runs/cap/steps/120:0").json()
        expected = fixture_bodies(detail)
        urls = sorted({url for url, _ in expected})
        failures: list[str] = []
        counts = [0] * THREADS
        stop = threading.Event()

        def one_client(t: int) -> None:
            try:
                mix(t)
            except Exception as e:  # reported with the wrong answers, not as a thread warning
                failures.append(f"client {t}: {type(e).__name__}: {e}")

        def mix(t: int) -> None:
            with httpx.Client(base_url=base, timeout=60) as c:
                n = 0
                while not stop.is_set():
                    n += 1
                    if n % 10 < 7:
                        run = ("cap", "ex")[n % 2]
                        got = c.get(f"/v1/runs/{run}/steps/120:0")
                        ok = got.status_code == 200 and got.json().get("run") == run
                    else:
                        url, fmt = urls[n % len(urls)], ("npy", "raw")[n % 2]
                        body = expected[(url, fmt)]
                        if n % 4 == 0:
                            got = c.get(url, params={"format": fmt}, headers={"Range": "bytes=-7"})
                            ok = got.status_code == 206 and got.content == body[-7:]
                        else:
                            got = c.get(url, params={"format": fmt})
                            ok = got.status_code == 200 and got.content == body
                    if not ok:
                        failures.append(f"{got.request.url}: {got.status_code} {got.text[:200]}")
                counts[t] = n

        threads = [threading.Thread(target=one_client, args=(t,)) for t in range(THREADS)]
        for thread in threads:
            thread.start()
        started = time.monotonic()
        try:
            ingest = subprocess.run(
                [sys.executable, "-m", "trajstore", "ingest", str(capture)]
                + ["--store", str(store), "--run", "live"],
                capture_output=True,
                text=True,
                timeout=300,
            )
            time.sleep(max(0.0, MIN_SECONDS - (time.monotonic() - started)))
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=120)
        assert ingest.returncode == 0, ingest.stderr[-2000:]
        assert not failures, f"{len(failures)} of {sum(counts)}: {failures[:5]}"
        assert sum(counts) >= THREADS * 10
        # what the ingest published is served (the snapshot resyncs within about a second;
        # /v1/runs reads the snapshot's catalog, a step lookup its View rebuilt right after:
        # under load the listing was seen a moment ahead of the lookup, so both are polled)
        last_step = f"/v1/runs/live/steps/{1000 + LIVE_BUNDLES - 1}:0"
        with httpx.Client(base_url=base, timeout=60) as client:
            deadline = time.monotonic() + 60
            while True:
                runs = {r["run"]: r for r in client.get("/v1/runs").json()["items"]}
                listed = runs.get("live", {}).get("num_bundles")
                looked_up = client.get(last_step).status_code
                if (listed, looked_up) == (LIVE_BUNDLES, 200):
                    break
                assert time.monotonic() < deadline, (listed, looked_up)
                time.sleep(0.2)
