"""The demo's runs, built small and once per test session, and a real server on them.

The same builders `trajstore demo` runs (examples/demo.py), called in-process
with smaller sizes so the store costs seconds, not a minute: the MoE toy's
`baseline` and `r3` runs through CaptureManager, the synthetic long run with
the demo's injected faults (streamed-group normalization in FAULT_ROLLOUTS, a
wrong clip at FAULT_CLIP_STEPS, some resumed steps), the Relax fixture bundles,
then every bundle replayed with --record.

Two servers, both real HTTP on a free loopback port: `serve`, the `trajstore serve`
command in a subprocess, and `serve_here`, the same app and protocol the command runs
with one worker (`create_app` under uvicorn with GuardedH11Protocol) in a thread of the
test's process, for tests about what the server answers rather than about the command
(no interpreter start and `import torch` per server).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import uvicorn
from trajstore.api.app import create_app
from trajstore.api.limits import TOKEN_ENV, GuardedH11Protocol
from trajstore.examples import gen_long_run, moe_grpo
from trajstore.examples.demo import FAULT_CLIP_STEPS, FAULT_ROLLOUTS, FIXTURES

from trajstore.cli import main as trajstore_main
from trajstore.store import Store

ROLLOUTS, STEPS_PER_ROLLOUT, MOE_STEPS = 9, 2, 3
RUNS = ("baseline", "r3", "relax", "synthetic")

_built: dict[str, Path] = {}


def cli(*args: str) -> tuple[int, str]:
    """`trajstore ARGS` in-process: (exit code, stdout)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = trajstore_main(list(args))
    return code, out.getvalue()


def build(root: Path) -> Path:
    """Build the store under ``root`` (see the module docstring); returns the store path."""
    store = root / "store"
    moe_grpo.run_into_store(store, moe_grpo.MODES, steps=MOE_STEPS, seed=0)
    capture = root / "capture"
    argv = [str(capture), "--rollouts", str(ROLLOUTS), "--steps", str(STEPS_PER_ROLLOUT)]
    argv += ["--samples", "16", "--max-len", "64", "--min-len", "8", "--resumed", "0.2"]
    argv += ["--seed", "7"]
    for rollout in FAULT_ROLLOUTS:
        argv += ["--fault-reward-norm", str(rollout)]
    for step in FAULT_CLIP_STEPS:
        if int(step.split(":")[0]) < ROLLOUTS:
            argv += ["--fault-eps", step]
    with contextlib.redirect_stderr(io.StringIO()):
        assert gen_long_run.main(argv) == 0
    with Store.open(store, durable=False) as st:
        assert all(o.status == "published" for o in st.ingest([capture], run="synthetic"))
        relax = [FIXTURES / "example_capture_dir", FIXTURES / "example_bundle"]
        assert all(o.status == "published" for o in st.ingest(relax, run="relax"))
    code, out = cli("replay", "--store", str(store), "--all", "--record", "--json")
    assert code == 1 and json.loads(out)["refused"] == 0, out[-2000:]
    return store


def demo_store(root_factory: object) -> Path:
    """The session's store (``root_factory`` is pytest's tmp_path_factory)."""
    if "store" not in _built:
        _built["store"] = build(root_factory.mktemp("web-demo"))  # type: ignore[attr-defined]
    return _built["store"]


@contextlib.contextmanager
def serve(store: Path, token: str | None = None) -> Iterator[str]:
    """`trajstore serve` in a subprocess on a free loopback port; yields its base URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "TRAJSTORE_API_TOKEN"}
    if token is not None:
        env["TRAJSTORE_API_TOKEN"] = token
    argv = [sys.executable, "-m", "trajstore", "serve", "--store", str(store)]
    argv += ["--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {token}"} if token else {}

    def alive() -> None:
        assert proc.poll() is None, proc.stdout.read().decode()[-2000:]  # type: ignore[union-attr]

    try:
        _wait_healthy(base, headers, alive)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_healthy(base: str, headers: dict[str, str], alive: Callable[[], None]) -> None:
    """Until GET /v1/health answers 200 (`alive` asserts the server has not died)."""
    deadline = time.monotonic() + 120
    while True:
        alive()
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(f"{base}/v1/health", headers=headers, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.02)


@contextlib.contextmanager
def serve_here(store: Path, token: str | None = None) -> Iterator[str]:
    """The app `trajstore serve` runs (one worker: `create_app`, uvicorn, GuardedH11Protocol)
    in a thread on a free loopback port, the token taken from TRAJSTORE_API_TOKEN as the
    command takes it; yields its base URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    saved = os.environ.pop(TOKEN_ENV, None)
    try:
        if token is not None:
            os.environ[TOKEN_ENV] = token
        app = create_app(store)
    finally:
        os.environ.pop(TOKEN_ENV, None)
        if saved is not None:
            os.environ[TOKEN_ENV] = saved
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", http=GuardedH11Protocol
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {token}"} if token else {}

    def alive() -> None:
        assert thread.is_alive(), "the server's thread ended"

    try:
        _wait_healthy(base, headers, alive)
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=30)
