"""Where batch work runs: processes on this host (the default) or a Ray cluster.

Replay-all and ingest hand an executor a module-level function and picklable
jobs; the executor yields each job's result as it finishes, in no particular
order. The local executor is a process pool: forked from the calling process
(fast) unless that process has loaded obstore, whose runtime (tokio threads,
started by an S3 request such as listing the store) a forked copy cannot use;
then from a fork server (a fresh interpreter that imports trajstore once and
forks the workers). The Ray
executor submits one Ray task per job with retries, so a job whose worker
process dies is run again elsewhere: the job functions are written to be
idempotent (their writes are create-if-absent under a deterministic name), so
a retry can never record twice. `ray` is imported only when a Ray executor is
entered, so `trajstore --help` and the local path never pay for it.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from trajstore.errors import StoreError, TrajstoreError, UsageError

J = TypeVar("J")
R = TypeVar("R")

EXECUTORS = ("local", "ray")
RAY_EXTRA_HINT = "pip install 'trajstore[ray]'"
#: how often a Ray task is retried after its worker process died
RAY_MAX_RETRIES = 3
#: test hook (docs/deployment.md): a directory; while `<dir>/hold` exists, every Ray task
#: writes `<dir>/pid-<pid>` after its work and waits, so a test can kill a worker that has
#: already written its results and before it reports back
TASK_GATE_ENV = "TRAJSTORE_TASK_GATE"
TASK_GATE_MAX_WAIT_S = 300.0


#: the local pool's most processes, unless the machine has more CPUs (as `serve`)
LOCAL_MAX_WORKERS = 64


@dataclass(frozen=True)
class ExecutorSpec:
    """What the user asked for: `--executor`, `--workers`, `--ray-address`."""

    kind: str = "local"
    workers: int | None = None
    ray_address: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in EXECUTORS:
            raise UsageError(f"--executor must be one of {', '.join(EXECUTORS)}, not {self.kind!r}")
        if self.workers is not None:
            self._check_workers(self.workers)
        if self.ray_address is not None and self.kind != "ray":
            raise UsageError("--ray-address needs --executor ray")

    def _check_workers(self, workers: int) -> None:
        """Below 1 is refused, and so is more than the local pool starts (a typo such
        as 100000 forked 100000 processes at once); Ray forks nothing: any count."""
        if workers < 1:
            raise UsageError("--workers must be >= 1")
        cap = max(LOCAL_MAX_WORKERS, os.cpu_count() or 1)
        if self.kind == "local" and workers > cap:
            raise UsageError(
                f"--workers {workers}: the local executor forks at most {cap} processes "
                f"({LOCAL_MAX_WORKERS}, or this machine's CPUs if more); use --executor ray "
                "for more"
            )


class LocalExecutor:
    """A pool of `workers` processes; one worker runs the jobs in this process.

    The workers are forked from this process, except after it loaded obstore (an
    `s3://` store): obstore's process-wide runtime has threads a forked child does not
    have, and the child's first request would wait on them forever. Then they come from
    a fork server (spawn where there is none), which imports `preload` once so a worker
    does not import trajstore again; it costs a command one interpreter start and those
    imports (scripts/bench/bench_local_pool.py). Either way each worker takes this
    process's environment and directory as of the pool's start.
    """

    def __init__(self, workers: int | None = None, preload: tuple[str, ...] = ()) -> None:
        self.workers = workers or 1
        self.preload = preload
        self._pool: Any = None

    def __enter__(self) -> LocalExecutor:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if self._pool is not None:
            self._pool.terminate() if exc_type else self._pool.close()
            self._pool.join()
            self._pool = None

    def map_unordered(self, fn: Callable[[J], R], jobs: Iterable[J]) -> Iterator[R]:
        if self.workers <= 1:
            return map(fn, jobs)
        ctx = worker_context(self.preload or (fn.__module__,))
        self._pool = ctx.Pool(
            self.workers, initializer=_adopt_parent, initargs=(dict(os.environ), os.getcwd())
        )
        return self._pool.imap_unordered(fn, jobs, chunksize=1)


def worker_context(preload: Iterable[str] = ()) -> Any:
    """The multiprocessing context a local pool's workers start from: a fork of this
    process where that works (Linux, obstore not loaded), else the fork server (its
    modules `preload`ed when it starts), else spawn."""
    methods = mp.get_all_start_methods()
    if sys.platform.startswith("linux") and "fork" in methods and not fork_unsafe():
        return mp.get_context("fork")
    if "forkserver" not in methods:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # Only a server started after this call imports them; one already running keeps its own.
    ctx.set_forkserver_preload(sorted(set(preload)))
    return ctx


def fork_unsafe() -> bool:
    """Whether a forked copy of this process could hang: obstore is loaded, so its runtime
    may be running (any S3 request starts it; loading alone is taken as enough)."""
    return "obstore" in sys.modules


def _adopt_parent(environ: dict[str, str], cwd: str) -> None:
    """In a worker: the environment and directory of the process that made the pool (a
    fork server's are those of its start, maybe another test's or command's)."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise UsageError(
            f"--executor ray needs Ray, which is not installed: {RAY_EXTRA_HINT}"
        ) from None
    return ray


class RayExecutor:
    """Jobs as Ray tasks on a cluster (`address`) or on a Ray instance started for this run.

    Without an address (and without RAY_ADDRESS) a local Ray instance with
    `workers` CPUs is started and shut down again; a process that already
    called `ray.init` keeps its connection. `workers` caps the tasks running
    at once (default: the cluster's CPUs).
    """

    def __init__(self, address: str | None = None, workers: int | None = None) -> None:
        self.address = address
        self.workers = workers
        self._ray: Any = None
        self._owns = False
        self._cluster_cpus = 1

    def __enter__(self) -> RayExecutor:
        ray = self._ray = _import_ray()
        if not ray.is_initialized():
            address = self.address or os.environ.get("RAY_ADDRESS") or "local"
            options: dict[str, Any] = {
                "address": address,
                "log_to_driver": False,
                "logging_level": logging.WARNING,
            }
            if address == "local":
                options.update(num_cpus=self.workers or os.cpu_count() or 1)
                options.update(include_dashboard=False)
                os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            _ray_messages_to_stderr(ray)
            _check_reachable(address)
            refused = (ConnectionError, RuntimeError, ValueError, ray.exceptions.RayError)
            try:
                # Ray's C++ client logs each failed try to connect on fd 2: held back, so a
                # refusal is one line (shown again when the connection succeeds)
                with _stderr_held(address != "local") as said:
                    ray.init(**options)
            except refused as exc:
                raise _ray_init_error(address, exc, "".join(said)) from None
            self._owns = True
        self._cluster_cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        if self.workers is None:
            self.workers = self._cluster_cpus
        return self

    def __exit__(self, *exc: object) -> None:
        if self._owns:
            self._ray.shutdown()
            self._owns = False

    def map_unordered(self, fn: Callable[[J], R], jobs: Iterable[J]) -> Iterator[R]:
        ray = self._ray
        if ray is None:
            raise UsageError("RayExecutor used outside its `with` block")
        task = ray.remote(num_cpus=1, max_retries=RAY_MAX_RETRIES)(_ray_task)
        workers = max(1, int(self.workers or 1))
        # Two tasks a worker keep every slot busy while the next one is scheduled; Ray runs
        # no more than the cluster's CPUs. A cap below the cluster's size is kept exactly:
        # then only `workers` tasks are submitted at a time.
        window = 2 * workers if workers >= self._cluster_cpus else workers
        pending: list[Any] = []
        for job in jobs:
            pending.append(task.remote(fn, job))
            while len(pending) >= window:
                done, pending = ray.wait(pending, num_returns=1)
                yield self._get(done[0])
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            yield self._get(done[0])

    def _get(self, ref: Any) -> Any:
        ray = self._ray
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, TrajstoreError):
                raise cause from None
            what = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)
            first = what.strip().splitlines()[0] if what.strip() else type(exc).__name__
            raise StoreError(f"a Ray task failed: {first}") from None
        except ray.exceptions.WorkerCrashedError:
            raise StoreError(
                f"a Ray worker died {RAY_MAX_RETRIES + 1} times on one task; what was "
                "recorded is kept, run the same command again to finish"
            ) from None


#: what Ray says (as an exception or in its logs) when a cluster refuses a driver's token
_AUTH_REFUSED = ("AuthenticationError", "InvalidAuthToken", "Unauthenticated")


def _ray_init_error(address: str, exc: BaseException, said: str) -> StoreError:
    """One line for a failed `ray.init`: a cluster with token authentication that refused
    this process (no token, or another one) says what to set."""
    if any(word in f"{type(exc).__name__} {exc} {said}" for word in _AUTH_REFUSED):
        return StoreError(
            f"the Ray cluster at {address} uses token authentication and refused this "
            "process: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) "
            "to the cluster's token (docs/deployment.md)"
        )
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return StoreError(f"cannot start or reach Ray at {address}: {first}")


@contextlib.contextmanager
def _stderr_held(hold: bool) -> Iterator[list[str]]:
    """While the block runs, what is written to file descriptor 2 (by C++ code as by
    Python) goes to a temporary file; afterwards its text is in the yielded list, and is
    written to stderr if the block succeeded. Not for a block that starts processes
    (they would keep the temporary file as their stderr)."""
    said: list[str] = []
    if not hold:
        yield said
        return
    sys.stderr.flush()
    saved = os.dup(2)
    ok = False
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield said
            ok = True
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            said.append(held.read().decode(errors="replace"))
    if ok and said[0]:
        sys.stderr.write(said[0])
        sys.stderr.flush()


def _check_reachable(address: str) -> None:
    """Fail in seconds on a `host:port` nobody listens on: Ray's own connect retries for
    minutes. (`local`, `auto` and other forms are left to Ray.)"""
    import socket

    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
    except OSError as exc:
        raise StoreError(f"cannot reach the Ray cluster at {address}: {exc}") from None


def _ray_messages_to_stderr(ray: Any) -> None:
    """Ray's driver prints raylet messages ("a worker died ...") on stdout, which is the
    command's output (`--json`): send them to stderr (a no-op if Ray's internals moved)."""
    module = getattr(getattr(ray, "_private", None), "worker", None)
    original = getattr(module, "print_to_stdstream", None)
    if original is None or getattr(original, "trajstore_stderr", False):
        return

    def to_stderr(data: dict, ignore_prefix: bool) -> None:
        original({**data, "is_err": True}, ignore_prefix)

    to_stderr.trajstore_stderr = True  # type: ignore[attr-defined]
    module.print_to_stdstream = to_stderr


def _ray_task(fn: Callable[[Any], Any], job: Any) -> Any:
    """One job on a Ray worker, then the test gate (a no-op unless TRAJSTORE_TASK_GATE is set)."""
    out = fn(job)
    task_gate()
    return out


def task_gate() -> None:
    """Hold here while `$TRAJSTORE_TASK_GATE/hold` exists (see TASK_GATE_ENV)."""
    gate = os.environ.get(TASK_GATE_ENV)
    if not gate:
        return
    hold = Path(gate) / "hold"
    if not hold.exists():
        return
    (Path(gate) / f"pid-{os.getpid()}").write_text(str(os.getpid()))
    deadline = time.monotonic() + TASK_GATE_MAX_WAIT_S
    while hold.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def make_executor(spec: ExecutorSpec, preload: tuple[str, ...] = ()) -> LocalExecutor | RayExecutor:
    """The executor `spec` names; `preload`: modules a local worker needs (imported once by
    the fork server, not by every worker)."""
    if spec.kind == "ray":
        return RayExecutor(spec.ray_address, spec.workers)
    return LocalExecutor(spec.workers, preload)
