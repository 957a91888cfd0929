"""`make demo`: the main job end to end, as a check.

Each step runs the real `trajstore` CLI in a subprocess and asserts what it
must print or return; the demo exits non-zero if any expectation fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(os.environ.get("TRAJSTORE_FIXTURES", ROOT.parent / "shared" / "fixtures" / "relax-v2"))


def trajstore(*args: str, expect: int = 0) -> str:
    cmd = [sys.executable, "-m", "trajstore", *args]
    print(f"\n$ trajstore {' '.join(args)}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    if proc.returncode != expect:
        raise SystemExit(f"demo: expected exit {expect} from `trajstore {' '.join(args)}`, got {proc.returncode}")
    return proc.stdout


def check(cond: bool, what: str) -> None:
    if not cond:
        raise SystemExit(f"demo: expectation failed: {what}")
    print(f"  ok: {what}")


def main() -> int:
    if not FIXTURES.is_dir():
        raise SystemExit(f"demo: fixtures not found at {FIXTURES} (set TRAJSTORE_FIXTURES)")
    capture = FIXTURES / "example_capture_dir"
    trajstore("inspect", str(capture), "--step", "120:0")
    trajstore("validate", str(capture))
    out = trajstore("replay", str(FIXTURES / "example_bundle"))
    check("all requested stages pass" in out, "the clean Relax bundle replays clean")
    out = trajstore("replay", str(FIXTURES / "example_bundle_divergent"), expect=1)
    check("first divergent stage: advantage.estimate" in out, "the divergent bundle is caught at advantage.estimate")
    check("s-0@0" in out, "the first divergent token is s-0@0")
    out = trajstore("replay", str(capture), "--step", "120:0")
    check("all requested stages pass on 2 rank(s)" in out, "the 2-rank cohort replays clean")
    print("\ndemo: all expectations met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
