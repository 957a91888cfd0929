"""Capture from many hosts into an S3 store (TRAJSTORE_CAPTURE_STORE=s3://...).

Each rank is a separate process with its own temp dir, home and cache (no path
is shared, as on different hosts); they meet only in the S3 server. (The ranks are
forked from a fork server that imported torch, tests/forked.py; each takes its own
environment before it imports trajstore.) The last
rank to finish publishes the cohort; a rank killed while it uploads its shard
leaves nothing published, and its re-capture publishes the cohort.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from forked import Forked, fork_server

from trajstore.cli import main
from trajstore.errors import StoreError
from trajstore.store import Store
from trajstore.store.maintenance import fsck

pytestmark = pytest.mark.integration

RANKS = [0, 1]

#: one DP rank of a real tiny GRPO step, captured from the environment's variables;
#: it trains only once the file argv[2] exists (argv[1] is its rank)
RANK_SCRIPT = """
import sys, time
from pathlib import Path
from trajstore.capture import CaptureManager
from trajstore.examples import tiny_grpo

rank, go = int(sys.argv[1]), Path(sys.argv[2])
loop = tiny_grpo.TinyGRPO(seed=rank, tag=f"k{rank}-", group_offset=1000 * rank)
cap = CaptureManager.from_env(recompute=loop.recompute_config(), rank=rank,
                              producer_ranks=[0, 1], rollout_ranks=[0],
                              parallel={"dp": 2, "tp": 1, "pp": 1, "cp": 1})
loop.capture = cap
ro = loop.rollout(0)
while not go.exists():
    time.sleep(0.01)
loop.train_step(ro, 0)
stats = cap.close()
print(stats.written, stats.errors, stats.ingested)
sys.exit(0 if (stats.written, stats.errors) == (2 if rank == 0 else 1, 0) else 3)
"""


def _host(tmp: Path, name: str, s3: Any, url: str) -> tuple[Path, dict[str, str]]:
    """A private directory and environment for one rank ("a host")."""
    home = tmp / name
    (home / "tmp").mkdir(parents=True)
    env = {
        **os.environ,
        **s3.env(),
        "HOME": str(home),
        "TMPDIR": str(home / "tmp"),
        "TRAJSTORE_CACHE_DIR": str(home / "cache"),
        "TRAJSTORE_CAPTURE": "1",
        "TRAJSTORE_CAPTURE_STORE": url,
        "TRAJSTORE_RUN": "mr",
        "TRAJSTORE_CAPTURE_STEPS": "0:0",
    }
    env.pop("TRAJSTORE_CAPTURE_DIR", None)
    return home, env


@pytest.fixture(scope="module", autouse=True)
def _fork_server() -> Iterator[None]:
    """The ranks are forked from a fork server that imports torch once for all of them
    (tests/forked.py); each still takes its host's environment before it imports trajstore."""
    with fork_server(["torch", "torch._dynamo"]):
        yield


def _start(rank: int, home: Path, env: dict[str, str], go: str = "go") -> Forked:
    """Rank `rank` on its "host": it trains its step once `home/go` exists."""
    return Forked(RANK_SCRIPT, [str(rank), str(home / go)], cwd=home, env=env)


@contextlib.contextmanager
def _reaped(*procs: Forked) -> Any:
    """Kill whichever of `procs` still runs when the block ends: a failed assertion must
    not leave a rank polling for its `go` file forever."""
    try:
        yield
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def _kinds_once(url: str, want: list[str], timeout_s: float = 120) -> list[str]:
    """The kinds of the published refs once they are `want` (or whatever they are at the
    timeout): a capture publishes from its writer thread, a while after the step."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with Store.open(url, create=False) as store:
                kinds = [e.kind for e in store.refs.all()]
        except StoreError:  # the capture has not created the store yet
            kinds = []
        if kinds == want or time.monotonic() > deadline:
            return kinds
        time.sleep(0.1)


def test_two_ranks_on_two_hosts_publish_one_cohort(
    s3_env: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = s3_env.fresh_url("capture")
    hosts = {r: _host(tmp_path, f"host-{r}", s3_env, url) for r in RANKS}
    procs = {r: _start(r, *hosts[r]) for r in RANKS}
    with _reaped(*procs.values()):
        # rank 0's rollout bundle is published by its capture writer, in the background
        assert _kinds_once(url, ["rollout"]) == ["rollout"]
        (hosts[1][0] / "go").touch()  # rank 1 first: it stores its shard, publishes nothing
        out1, err1 = procs[1].communicate(timeout=180)
        assert procs[1].returncode == 0, err1
        with Store.open(url, create=False) as store:
            assert [e.kind for e in store.refs.all()] == ["rollout"]  # rank 0's rollout only
        (hosts[0][0] / "go").touch()
        out0, err0 = procs[0].communicate(timeout=180)
        assert procs[0].returncode == 0, err0
        assert out0.split()[2] == "2" and out1.split()[2] == "0"  # rank 0 published the cohort
        with Store.open(url, create=False) as store:
            ranks = store.step("mr", 0, 0)
            assert [b.rank for b in ranks] == RANKS and {b.attempt for b in ranks} == {1}
            assert store.attempts("mr", "step", 0, 0) == [1]
        for r in RANKS:  # nothing stayed in either host's private staging
            assert not any((hosts[r][0] / "tmp").rglob("COMPLETE*"))
        capsys.readouterr()  # the reader's command, in this process
        code = main(["replay", "--store", url, "--run", "mr", "--step", "0:0", "--json"])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert len(json.loads(out)["bundles"]) == len(RANKS)


class HoldingProxy:
    """A TCP proxy on loopback in front of the S3 server that forwards every request,
    except that it holds (never forwards, never answers) the first one whose start
    matches `hold`: a write that is provably in flight, and stays so."""

    def __init__(self, upstream: str, hold: bytes) -> None:
        host, port = upstream.removeprefix("http://").rsplit(":", 1)
        self.upstream = (host, int(port))
        self.hold = re.compile(hold)
        self.held = threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with client, socket.create_connection(self.upstream) as up:
            # HTTP/1.1 without pipelining: the client's bytes after an answer start a request
            answered = threading.Event()
            answered.set()
            threading.Thread(target=self._pump, args=(up, client, answered), daemon=True).start()
            head = b""
            while data := client.recv(1 << 16):
                if answered.is_set():
                    answered.clear()
                    head = b""
                head = (head + data)[:4096]
                if not self.held.is_set() and self.hold.match(head):
                    self.held.set()
                    while client.recv(1 << 16):  # swallowed until the client is gone
                        pass
                    return
                up.sendall(data)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, answered: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                answered.set()  # before the client can see the answer and send again
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.server.close()


def test_a_rank_killed_while_its_shard_uploads_publishes_nothing_and_a_recapture_does(
    s3_env: Any, tmp_path: Path
) -> None:
    """Rank 1 talks to the store through a proxy that holds its first pack upload (the
    objects of its shard); it is killed there. Rank 0 then stores its shard: nothing is
    published, as no shard of rank 1 exists. A re-capture of rank 1 publishes the one
    whole cohort (attempt 1, both ranks), and fsck passes."""
    url = s3_env.fresh_url("killed")
    Store.open(url).close()
    hosts = {r: _host(tmp_path, f"host-{r}", s3_env, url) for r in RANKS}
    (home0, env0), (home1, env1) = hosts[0], hosts[1]
    prefix = url.removeprefix("s3://")
    proxy = HoldingProxy(s3_env.endpoint, rb"PUT /" + re.escape(prefix.encode()) + rb"/packs/")
    # all three start now (their imports and rollouts overlap); each trains on its `go`
    rank1 = _start(1, home1, {**env1, "AWS_ENDPOINT_URL": proxy.endpoint})
    rank0 = _start(0, home0, env0)
    again = _start(1, home1, env1, go="go-again")  # the re-capture, straight to the server
    with _reaped(rank1, rank0, again):
        try:
            (home1 / "go").touch()
            held = proxy.held.wait(180)
            os.kill(rank1.pid, signal.SIGKILL)
            _, err1 = rank1.communicate(timeout=60)
        finally:
            proxy.close()
        assert held, err1  # rank 1 was killed with its shard's pack upload in flight
        assert rank1.returncode == -signal.SIGKILL
        with Store.open(url, create=False) as store:
            assert store.space.walk("capture") == []  # no shard of rank 1
        (home0 / "go").touch()
        out0, err0 = rank0.communicate(timeout=180)
        assert rank0.returncode == 0, err0
        assert out0.split()[2] == "1"  # its rollout only: the cohort waits for rank 1
        with Store.open(url, create=False) as store:
            assert [e.kind for e in store.refs.all()] == ["rollout"]
            assert store.attempts("mr", "step", 0, 0) == []
            assert [d.name for d in store.space.walk("capture")] == ["mr/step-0-0/g1/rank-0.json"]
        (home1 / "go-again").touch()
        out1, err1 = again.communicate(timeout=180)
        assert again.returncode == 0, err1
        assert out1.split()[2] == "1"  # it published the cohort
        with Store.open(url, create=False) as store:
            assert [b.rank for b in store.step("mr", 0, 0)] == RANKS
            assert store.attempts("mr", "step", 0, 0) == [1]
            assert store.space.walk("capture") == []
            report = fsck(store)
        assert report.ok, report.problems
