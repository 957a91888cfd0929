"""`trajstore demo` read from a file: stdout and stderr redirected to one place come out in
the order they were written (stdout is block-buffered when redirected, stderr is not: the
child's stderr and the demo's own lines overtook the lines printed before them)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import DemoRun, user_env

pytestmark = pytest.mark.integration

#: a demo's command, a check and a failing command, through the demo's own printing
SCRIPT = """
import sys
from trajstore.examples import demo
demo.say("one")
child = "import sys; print('child out'); print('child err', file=sys.stderr)"
demo.run([sys.executable, "-c", child])
demo.check(True, "checked")
demo.run([sys.executable, "-c", "import sys; print('last', file=sys.stderr); sys.exit(3)"])
"""


def test_the_demos_lines_redirected_to_one_file_keep_their_order(tmp_path) -> None:
    out = tmp_path / "out.txt"
    with out.open("w") as sink:
        rc = subprocess.run(
            [sys.executable, "-c", SCRIPT], stdout=sink, stderr=subprocess.STDOUT, env=user_env()
        ).returncode
    lines = [line for line in out.read_text().splitlines() if line]
    assert rc == 1
    assert [re.sub(r"^\[ *[\d.]+s\] ", "", line) for line in lines] == [
        "one",
        lines[1],
        "child out",
        "child err",
        "  ok: checked",
        lines[5],
        "last",
        lines[-1],
    ], lines
    assert lines[1].startswith("$ python -c") and lines[5].startswith("$ python -c")
    assert lines[-1].startswith("demo: `") and lines[-1].endswith("exited 3, expected (0,)")


def test_the_real_demo_in_one_stream_prints_each_commands_output_after_it(
    demo_run: DemoRun,
) -> None:
    """The router comparison's table (its stdout), then "plot written to" (its stderr),
    then the next command; the sections 1/6 to 6/6 in order."""
    assert demo_run.returncode == 0, demo_run.output[-4000:]
    lines = demo_run.output.splitlines()
    sections = [m.group(1) for line in lines if (m := re.match(r"^\[ *[\d.]+s\] (\S+)", line))]
    assert sections == ["1/6", "2/6", "3/6", "4/6", "5/6", "6/6", "done:"]
    at = next(
        i
        for i, line in enumerate(lines)
        if line.startswith("$ trajstore router compare --store demo-store --run baseline")
        and "--plot" in line
    )
    end = next(i for i in range(at + 1, len(lines)) if lines[i].startswith("$ "))
    block = lines[at + 1 : end]
    assert block[0].startswith("step "), block
    assert block[-1] == "plot written to demo-store-work/router_compare.png", block
    assert "stability:" in block and any(line.startswith("  baseline: steps=") for line in block)
