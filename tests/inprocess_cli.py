"""`trajstore ARGS` through the CLI's entry point (`trajstore.cli.main`) in the test's own
process, for tests that read only a command's exit code, stdout and stderr: no interpreter
start and no `import torch` per command. Tests about the process itself (signals, exit at
interpreter shutdown, crashes, import budgets, separate ranks or hosts) start a real one.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

from trajstore.cli import main as trajstore_main


@contextlib.contextmanager
def _environment(env: dict[str, str] | None) -> Iterator[None]:
    """`env` set in os.environ while the command runs, then put back as it was."""
    saved = {name: os.environ.get(name) for name in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def cli(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `trajstore ARGS` here, with `env` added to the environment for it; its exit code,
    stdout and stderr as a CompletedProcess (as `subprocess.run(..., text=True)` gives)."""
    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    with _environment(env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = trajstore_main(argv)
        except SystemExit as exc:  # argparse's own refusals (--help, a bad choice)
            code = exc.code if isinstance(exc.code, int) else 2
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())
