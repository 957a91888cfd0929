"""A `python -c` script run as a process of its own, forked from multiprocessing's fork
server instead of started afresh: the server imports the heavy modules (`preload`, no
trajstore module among them) once for every such process.

Each process takes its environment, directory and argv before the script runs (and
before the script imports trajstore), so a per-process environment (HOME, TMPDIR, the
capture's variables) is the process's own, as with a fresh interpreter. Its stdout and
stderr go to files (`Forked.communicate` reads them). Unlike a fresh interpreter the
process ends without running atexit handlers: scripts close what they opened.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver as forkserver
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def fork_server(preload: list[str]) -> Iterator[None]:
    """A fork server of the caller's own, `preload` imported when it starts (one already
    running is stopped first: it keeps its own preload); stopped and waited for (its
    processes' CPU counted) at the end."""
    forkserver._forkserver._stop()
    multiprocessing.get_context("forkserver").set_forkserver_preload(["forked", *preload])
    try:
        yield
    finally:
        forkserver._forkserver._stop()


def _run(code: str, argv: list[str], environ: dict[str, str], cwd: str, out: str) -> None:
    for fd, name in ((1, f"{out}.stdout"), (2, f"{out}.stderr")):
        os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    tempfile.tempdir = None  # $TMPDIR read afresh
    sys.argv = ["-c", *argv]
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})


class Forked:
    """`python -c code *argv` in `cwd` with exactly `env`: the parts of `subprocess.Popen`
    the tests use (pid, poll, kill, communicate, returncode)."""

    def __init__(self, code: str, argv: list[str], *, cwd: Path, env: dict[str, str]) -> None:
        self._out = tempfile.mktemp(prefix="forked-", dir=cwd)
        self._proc = multiprocessing.get_context("forkserver").Process(
            target=_run, args=(code, argv, dict(env), str(cwd), self._out)
        )
        self._proc.start()
        self.pid = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def kill(self) -> None:
        self._proc.kill()

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(["forked"], timeout or 0)
        return tuple(  # type: ignore[return-value]
            Path(f"{self._out}.{name}").read_text() for name in ("stdout", "stderr")
        )
