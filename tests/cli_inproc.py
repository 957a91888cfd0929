"""`trajstore ARGS...` run in this process: `trajstore.cli.main` with stdout and stderr
captured, answered as the CompletedProcess a subprocess run would give.

For tests whose subject is what a command prints and exits with, not the process
around it (a fresh interpreter costs seconds of CPU: `import torch` alone is ~4 s).
Keep a real subprocess where the process boundary is the point: signals, crashes,
exit at interpreter shutdown, import budgets, separate ranks or hosts.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

from trajstore.cli import main


def run_main(*args: object) -> subprocess.CompletedProcess:
    """`trajstore *args` in this process, its output captured as text."""
    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return subprocess.CompletedProcess(
        [sys.executable, "-m", "trajstore", *argv], code, out.getvalue(), err.getvalue()
    )
