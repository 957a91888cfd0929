"""`trajstore ARGS` through the CLI's entry point (`trajstore.cli.main`) in the test's own
process, for tests that read only a command's exit code, stdout and stderr: no interpreter
start and no `import torch` per command. Tests about the process itself (signals, exit at
interpreter shutdown, crashes, import budgets, separate ranks or hosts) start a real one.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
from pathlib import Path

from conftest import patched_environ

from trajstore.cli import main as trajstore_main


def cli(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `trajstore ARGS` here, with `env` added to the environment for it; its exit code,
    stdout and stderr as a CompletedProcess (as `subprocess.run(..., text=True)` gives)."""
    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    captured = contextlib.redirect_stdout(out), contextlib.redirect_stderr(err)
    with patched_environ(env or {}), captured[0], captured[1]:
        try:
            code = trajstore_main(argv)
        except SystemExit as exc:  # argparse's own refusals (--help, a bad choice)
            code = exc.code if isinstance(exc.code, int) else 2
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())
