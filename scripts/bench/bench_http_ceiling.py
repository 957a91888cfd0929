"""The ceiling for REST payload downloads on this machine.

Serves a 16 MiB in-memory blob from a bare FastAPI endpoint under uvicorn on
127.0.0.1 and fetches it with httpx, next to `torch.load` of the same bytes
from a .pt file. No trajstore code is involved: the ratio printed is the best
any HTTP download of a payload can reach here, to read the REST benchmark's
download/torch.load ratio against.

    .venv/bin/python scripts/bench/bench_http_ceiling.py
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import Response

SIZE = 16 << 20
PORT = 8769


def main() -> None:
    data = os.urandom(SIZE)
    app = FastAPI()

    @app.get("/blob")
    def blob() -> Response:
        return Response(content=data, media_type="application/octet-stream")

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=PORT, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    pt = Path(tempfile.mkdtemp()) / "blob.pt"
    torch.save(torch.from_numpy(np.frombuffer(data, dtype=np.float32).copy()), pt)
    http, load = [], []
    with httpx.Client() as client:
        client.get(f"http://127.0.0.1:{PORT}/blob")
        for _ in range(7):
            t = time.perf_counter()
            client.get(f"http://127.0.0.1:{PORT}/blob").raise_for_status()
            http.append(time.perf_counter() - t)
            t = time.perf_counter()
            torch.load(pt, weights_only=True)
            load.append(time.perf_counter() - t)
    server.should_exit = True
    mb = SIZE / 1e6
    h, ld = min(http), min(load)
    print(f"machine: nproc {os.cpu_count()}, load {os.getloadavg()[0]:.2f}")
    print(f"static HTTP download, 16 MiB: {h * 1e3:.1f} ms ({mb / h:.0f} MB/s)")
    print(f"torch.load of the same bytes: {ld * 1e3:.1f} ms ({mb / ld:.0f} MB/s)")
    print(f"ceiling ratio HTTP / torch.load: {ld / h:.3f}x")


if __name__ == "__main__":
    main()
