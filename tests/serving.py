"""`trajstore serve` in a subprocess on a free loopback port, for the tests and benchmarks
that need a real server.

One helper for every such test (hostile clients, races, huge payloads, multiple workers) and
benchmark (scripts/bench: load, huge inputs): start the command, wait until it
answers HTTP, hand out (pid, port), and stop it with SIGINT (kill after 30 s).
TRAJSTORE_API_TOKEN is dropped from the environment unless `token` is given.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import httpx

#: how long a server may take to answer its first request (a loaded CI machine, 2 workers)
START_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def memory_kb(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process, in kB."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    return {name: int(fields[name].split()[0]) for name in ("VmRSS", "VmHWM")}


def stop(server: subprocess.Popen) -> None:
    """Stop a server as a user does, with Ctrl-C (SIGINT); killed if it is not gone in 30 s."""
    server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


class ServeError(RuntimeError):
    """The server exited, or did not answer in time."""


@contextlib.contextmanager
def served(
    store: Path,
    *args: str,
    token: str | None = None,
    start_timeout_s: float = START_TIMEOUT_S,
    stderr: IO[bytes] | None = None,
    preexec_fn: Callable[[], object] | None = None,
    **env: str,
) -> Iterator[tuple[int, int]]:
    """Serve `store` (extra `serve` arguments in `args`, extra environment in `env`): (pid, port).

    Ready once /v1/health answers at all (with a token it answers 401); raises ServeError with
    the server's stderr (a temp file unless `stderr` is given) if it exits first, does not
    answer within `start_timeout_s`, or died while the caller used it. `preexec_fn` runs in the
    child before exec (a benchmark's memory limit)."""
    port = free_port()
    environ = {k: v for k, v in os.environ.items() if k != "TRAJSTORE_API_TOKEN"}
    if token is not None:
        environ["TRAJSTORE_API_TOKEN"] = token
    environ.update(env)
    argv = [sys.executable, "-m", "trajstore", "serve", "--store", str(store), "--port", str(port)]
    if "--log-level" not in args:
        args = (*args, "--log-level", "warning")
    with contextlib.ExitStack() as stack:
        err = stderr if stderr is not None else stack.enter_context(tempfile.TemporaryFile())

        def died() -> str:
            err.seek(0)
            return f"serve exited with {server.returncode}: {err.read().decode()[-2000:]}"

        server = subprocess.Popen([*argv, *args], env=environ, stderr=err, preexec_fn=preexec_fn)
        try:
            deadline = time.monotonic() + start_timeout_s
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                while True:
                    if server.poll() is not None:
                        raise ServeError(died())
                    if time.monotonic() >= deadline:
                        raise ServeError(f"serve did not answer in {start_timeout_s:.0f} s")
                    try:
                        client.get("/v1/health")
                        break
                    except httpx.TransportError:
                        time.sleep(0.1)
            yield server.pid, port
            if server.poll() is not None:
                raise ServeError(died())
        finally:
            stop(server)
