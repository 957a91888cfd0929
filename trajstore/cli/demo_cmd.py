"""`trajstore demo [DIR]`: the main job end to end (scripts/demo.py, as `make demo` runs it)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the whole job end to end on a local store (needs a source checkout)")
    p.add_argument("dir", nargs="?", help="store to (re)create (default: ./demo-store in the checkout)")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from trajstore.errors import UsageError

    script = Path(__file__).resolve().parents[2] / "scripts" / "demo.py"
    if not script.is_file():
        raise UsageError(f"the demo needs a source checkout of trajstore ({script} not found); run `make demo` there")
    cmd = [sys.executable, str(script)] + (["--store", args.dir] if args.dir else [])
    return subprocess.call(cmd)
