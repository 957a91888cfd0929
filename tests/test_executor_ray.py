"""replay --all and ingest on a Ray cluster: one result per bundle even when a worker dies.

A real Ray head (`ray start --head --block`, 2 CPUs) is started once for the
module on this machine. Its workers inherit TRAJSTORE_TASK_GATE: while the
gate's `hold` file exists, every task writes `pid-<pid>` after its work and
waits, so a test can SIGKILL a worker that has already written its results
and before it reported back; Ray runs that task again on another worker and
the store must still hold each result or ref exactly once.

The cluster is closed twice over: it runs in a network namespace of its own
(tests/netns.py: Ray binds every interface whatever --node-ip-address says), with
only a loopback interface, which the commands that use it enter; and it requires
Ray's token authentication (RAY_AUTH_MODE=token, a token made for the session).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from trajstore.examples.replay_builders import Faults, consistent_contents, write_consistent

from trajstore.bundle.writer import write_bundle
from trajstore.catalog import tables
from trajstore.store import Store

pytestmark = pytest.mark.integration

ROLLOUTS, STEPS, FAULTY = 4, 2, 2
RAY_TOKEN = secrets.token_hex(32)  # this session's cluster token
RAY_ENV = {
    "RAY_DISABLE_USAGE_STATS": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN": RAY_TOKEN,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RayHead:
    """A running test cluster: its address, the task gate, the namespace it runs in."""

    address: str
    gate: Path
    netns: Any  # netns.NetNamespace
    pid: int

    def enter(self) -> Callable[[], None]:
        """A `preexec_fn` that puts a command where it can reach the cluster."""
        return self.netns.enter()


def _private_namespace() -> Any:
    """A new network namespace (tests/netns.py), or a skip (a fail under CI) without the
    rights to make one."""
    from netns import NetNamespace

    try:
        return NetNamespace()
    except (OSError, subprocess.SubprocessError) as e:
        why = f"cannot make a network namespace for the Ray cluster (needs root): {e}"
        if os.environ.get("CI"):
            pytest.fail(f"{why} (CI is set: the Ray tests must run)")
        pytest.skip(why)


def _forward_into(netns: Any, s3_server: Any) -> None:
    """The S3 server and PostgreSQL, on their loopback ports inside the namespace."""
    from pg_server import server_url

    netns.forward(int(s3_server.endpoint.rsplit(":", 1)[1]))
    pg = sa.engine.make_url(server_url())
    if pg.host in ("127.0.0.1", "localhost", None):
        netns.forward(pg.port or 5432)


@pytest.fixture(scope="session")
def ray_head(s3_server: Any) -> Iterator[RayHead]:
    """A 2-CPU Ray head in a private network namespace with token authentication,
    stopped at the end.

    Its workers get the S3 server's AWS variables, as a cluster's nodes get them from the
    environment `ray start` runs in (docs/deployment.md)."""
    ray_bin = Path(sys.executable).with_name("ray")
    assert ray_bin.is_file(), "the ray extra is part of the dev install: pip install -e '.[dev]'"
    netns = _private_namespace()
    # short: Ray's unix socket paths under --temp-dir must stay under 108 bytes
    tmp = Path(tempfile.mkdtemp(prefix="tsray-"))
    gate = tmp / "gate"
    gate.mkdir()
    port = _free_port()
    env = {
        **os.environ,
        **s3_server.env(),
        **RAY_ENV,
        "TRAJSTORE_TASK_GATE": str(gate),
        "HOME": str(tmp),  # no ~/.ray/auth_token of the machine's user is read or made
    }
    log = (tmp / "head.log").open("wb")
    try:
        _forward_into(netns, s3_server)
        head = subprocess.Popen(
            [
                str(ray_bin),
                "start",
                "--head",
                "--block",
                f"--port={port}",
                "--node-ip-address=127.0.0.1",
                "--num-cpus=2",
                "--include-dashboard=false",
                "--disable-usage-stats",
                "--object-store-memory=100000000",
                f"--temp-dir={tmp / 'r'}",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=netns.enter(),
        )
        try:
            deadline = time.monotonic() + 180
            while b"Ray runtime started" not in (tmp / "head.log").read_bytes():
                assert head.poll() is None, (tmp / "head.log").read_text(errors="replace")[-2000:]
                assert time.monotonic() < deadline, "ray start --head did not come up in 180 s"
                time.sleep(0.2)
            yield RayHead(f"127.0.0.1:{port}", gate, netns, head.pid)
        finally:
            head.send_signal(signal.SIGTERM)
            try:
                head.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(head.pid, signal.SIGKILL)
                head.wait()
    finally:
        log.close()
        netns.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _write_capture(cap: Path) -> None:
    """ROLLOUTS rollouts with STEPS steps each; rollout FAULTY normalised rewards wrongly."""
    for r in range(ROLLOUTS):
        faults = Faults(physical_batch_norm=3) if r == FAULTY else None
        write_consistent(cap / f"replay-rollout-{r}", kind="rollout", rollout_id=r, faults=faults)
        for s in range(STEPS):
            step = consistent_contents(
                kind="step",
                rollout_id=r,
                step_id=s,
                faults=faults,
                drop_expected=("reward.raw", "reward.post_process"),
            ).contents
            for stage in ("reward.raw", "reward.post_process"):
                step.stage_contracts.pop(stage)
            write_bundle(cap / f"replay-{r}-{s}", step)


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cap = tmp_path_factory.mktemp("ray-cap") / "capture"
    _write_capture(cap)
    return cap


@pytest.fixture(scope="module")
def stored(capture: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ray-store") / "store"
    with Store.open(root) as store:
        assert {o.status for o in store.ingest([capture], run="r")} == {"published"}
    return root


def run_cli(
    *args: str | Path, head: RayHead | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """A trajstore command; with `head`, run where it reaches that cluster."""
    return subprocess.run(
        [sys.executable, "-m", "trajstore", *map(str, args)],
        capture_output=True,
        text=True,
        env=env or {**os.environ, **RAY_ENV},
        timeout=300,
        preexec_fn=head.enter() if head is not None else None,
    )


def _kill_one_held_worker(proc: subprocess.Popen, gate: Path) -> int:
    """Wait for a task to reach the gate, SIGKILL its worker, open the gate; the pid."""
    deadline = time.monotonic() + 180
    while not (held := sorted(gate.glob("pid-*"))):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no Ray task reached the gate in 180 s"
        time.sleep(0.05)
    # the name, not the content: the file exists before its pid is written into it
    pid = int(held[0].name.removeprefix("pid-"))
    os.kill(pid, signal.SIGKILL)
    (gate / "hold").unlink()
    return pid


def _run_with_a_killed_worker(head: RayHead, *args: str | Path) -> tuple[int, str, str]:
    gate = head.gate
    for old in gate.glob("pid-*"):
        old.unlink()
    (gate / "hold").touch()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trajstore", *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **RAY_ENV},
            preexec_fn=head.enter(),
        )
        pid = _kill_one_held_worker(proc, gate)
        out, err = proc.communicate(timeout=300)
    finally:
        (gate / "hold").unlink(missing_ok=True)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the worker really died
    return proc.returncode, out, err


def _recorded(root: Path, catalog: str | None = None) -> list[tuple[str, str, str | None]]:
    """(bundle key, status, first divergent stage) of every recorded result, sorted."""
    results = tables.replay_results
    with (
        Store.open(root, create=False, catalog_url=catalog) as store,
        store.catalog() as cat,
        cat.connect() as conn,
    ):
        rows = conn.execute(
            sa.select(results.c.bundle_key, results.c.status, results.c.first_divergent_stage)
        ).all()
    return sorted(tuple(row) for row in rows)


def test_a_killed_ray_worker_leaves_one_result_per_bundle_equal_to_the_local_run(
    stored: Path, ray_head: RayHead, tmp_path: Path
) -> None:
    local, on_ray = tmp_path / "local", tmp_path / "ray"
    shutil.copytree(stored, local)
    shutil.copytree(stored, on_ray)
    assert run_cli("replay", "--store", local, "--all", "--record").returncode == 1
    code, out, err = _run_with_a_killed_worker(
        ray_head, "replay", "--store", on_ray, "--all", "--record", "--json",
        "--executor", "ray", "--ray-address", ray_head.address,
    )  # fmt: skip
    assert code == 1, err
    summary = json.loads(out)
    assert (summary["total"], summary["refused"]) == (ROLLOUTS * (STEPS + 1), 0)
    recorded = _recorded(on_ray)
    assert Counter(key for key, _, _ in recorded) == Counter(
        {key: 1 for key, _, _ in recorded}
    ) and len(recorded) == ROLLOUTS * (STEPS + 1)
    assert recorded == _recorded(local)
    assert {stage for _, _, stage in recorded} == {None, "reward.post_process"}


def test_a_killed_ray_worker_during_ingest_publishes_each_bundle_once(
    capture: Path, ray_head: RayHead, tmp_path: Path
) -> None:
    code, out, err = _run_with_a_killed_worker(
        ray_head, "ingest", capture, "--store", tmp_path / "ray", "--run", "r", "--json",
        "--executor", "ray", "--ray-address", ray_head.address,
    )  # fmt: skip
    assert code == 0, err
    assert len(json.loads(out)) == ROLLOUTS * (STEPS + 1)
    with Store.open(tmp_path / "ray", create=False) as store:
        refs = Counter(entry.key for entry in store.refs.all())
    with Store.open(tmp_path / "local") as store:
        store.ingest([capture], run="r")
        local = Counter(entry.key for entry in store.refs.all())
    assert refs == local == Counter({key: 1 for key in local})


def test_ray_on_s3_with_a_postgres_catalog_finds_exactly_the_faulty_rollouts_steps(
    capture: Path, ray_head: RayHead, s3_env: Any
) -> None:
    from pg_server import fresh_schema

    url = s3_env.fresh_url("ray")
    on_ray = ("--executor", "ray", "--ray-address", ray_head.address)
    with fresh_schema() as catalog:
        where = ("--store", url, "--catalog", catalog)
        ingest = run_cli("ingest", capture, *where, "--run", "r", *on_ray, head=ray_head)
        assert ingest.returncode == 0, ingest.stderr
        replay = run_cli("replay", *where, "--all", "--record", "--json", *on_ray, head=ray_head)
        assert replay.returncode == 1, replay.stderr
        assert json.loads(replay.stdout)["total"] == ROLLOUTS * (STEPS + 1)
        out = run_cli(
            "query", "steps", *where, "--first-divergent-stage", "reward.post_process",
            "--format", "json",
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
    steps = sorted((row["rollout_id"], row["step_id"]) for row in json.loads(out.stdout))
    assert steps == [(FAULTY, s) for s in range(STEPS)]


def _descendants(pid: int) -> dict[int, str]:
    """pid -> command name of `pid` and every process below it (from /proc)."""
    parents: dict[int, tuple[int, str]] = {}
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text() if d.name.isdigit() else ""
        except OSError:
            continue  # gone meanwhile
        if stat:
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            parents[int(d.name)] = (int(stat[stat.rindex(")") + 2 :].split()[1]), name)
    out = {pid: parents[pid][1]}
    while True:
        more = {c: n for c, (pp, n) in parents.items() if pp in out and c not in out}
        if not more:
            return out
        out.update(more)


def test_the_cluster_runs_where_only_a_loopback_interface_reaches_it(ray_head: RayHead) -> None:
    """Ray binds every interface; its every process is in the test's namespace, whose only
    interface is lo, so nothing it opens is reachable from the network (nor from this
    host's own loopback: the head's port is closed here)."""
    procs = _descendants(ray_head.pid)
    assert {"gcs_server", "raylet"} <= set(procs.values()), procs
    spaces = set()
    for pid in procs:
        try:
            spaces.add(os.readlink(f"/proc/{pid}/ns/net"))
        except FileNotFoundError:
            continue  # a worker that ended meanwhile
    assert spaces == {ray_head.netns.inode}
    assert ray_head.netns.interfaces() == ["lo"]
    port = int(ray_head.address.rsplit(":", 1)[1])
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=10).close()


@pytest.mark.parametrize("mode", ["token", None])
def test_a_command_without_the_clusters_token_is_refused_in_one_line(
    stored: Path, ray_head: RayHead, tmp_path: Path, mode: str | None
) -> None:
    """No token (none in the environment, none under its HOME), with RAY_AUTH_MODE=token
    or unset: exit 2 and one line saying what to set, not Ray's retry log."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
    env.update(HOME=str(tmp_path), RAY_USAGE_STATS_ENABLED="0", RAY_NUM_REDIS_GET_RETRIES="3")
    if mode is not None:
        env["RAY_AUTH_MODE"] = mode
    out = run_cli(
        "replay", "--store", stored, "--all", "--executor", "ray",
        "--ray-address", ray_head.address, head=ray_head, env=env,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [
        f"trajstore: error: the Ray cluster at {ray_head.address} uses token authentication "
        "and refused this process: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or "
        "RAY_AUTH_TOKEN_PATH) to the cluster's token (docs/deployment.md)"
    ]


def test_replay_all_indexes_its_results_when_a_server_catalog_mark_is_ahead(
    stored: Path, tmp_path: Path
) -> None:
    from pg_server import fresh_schema

    from trajstore.replay.batch import replay_all
    from trajstore.replay.from_store import refusal_document, write_result

    root = tmp_path / "store"
    shutil.copytree(stored, root)
    with fresh_schema() as catalog:
        with Store.open(root, create=False, catalog_url=catalog) as store:
            key = sorted(store.refs.live())[0]
            # a writer whose clock is an hour ahead: the catalog's results mark jumps there
            ahead = f"{time.time_ns() + 3600 * 10**9:020d}-1-ahead"
            write_result(store, refusal_document(key, "r", 0, None, "clock ahead"), name=ahead)
            store.index_new()
        summary = replay_all(root, record=True, force=True, catalog_url=catalog)
        recorded = _recorded(root, catalog)
    assert summary.total == ROLLOUTS * (STEPS + 1)
    assert len(recorded) == summary.total + 1


def test_ray_address_without_ray_names_the_extra_to_install(stored: Path) -> None:
    # `ray` made unimportable in this interpreter only, as on an install without the extra
    probe = "import sys; sys.modules['ray'] = None; from trajstore.cli import main; "
    probe += "sys.exit(main(sys.argv[1:]))"
    out = subprocess.run(
        [sys.executable, "-c", probe, "replay", "--store", str(stored), "--all",
         "--executor", "ray", "--ray-address", "127.0.0.1:1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stdout == ""
    (line,) = out.stderr.splitlines()
    assert line.startswith("trajstore: error: ") and "pip install 'trajstore[ray]'" in line


def test_an_unreachable_ray_address_is_one_line_and_exit_2(stored: Path) -> None:
    address = f"127.0.0.1:{_free_port()}"  # nothing listens there
    out = run_cli(
        "replay", "--store", stored, "--all", "--executor", "ray", "--ray-address", address
    )
    assert out.returncode == 2
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"trajstore: error: cannot reach the Ray cluster at {address}: ")


@pytest.mark.parametrize("args", [["--help"], ["replay", "--help"], ["ingest", "--help"]])
def test_help_does_not_import_ray(args: list[str]) -> None:
    probe = "import sys; from trajstore.cli import main\ntry:\n    main(sys.argv[1:])\n"
    probe += "except SystemExit:\n    pass\nprint('RAY', 'ray' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=300
    )
    assert out.stdout.splitlines()[-1] == "RAY False", out.stderr
