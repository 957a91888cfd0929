"""scripts/bench/run.py (`make bench`), the one runner of every figure, on small scripts in
a temp dir.

The real benchmarks take minutes; what is checked here is the runner's own contract:
every script's figures reach the table, a script that is missing, fails or writes a bad
document is a row saying so (the others still run, the exit status says one failed),
`--doc` rewrites only its block, and the verdict is the rule of verdicts.py over the
runs, never a script's own `met`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
PERF = ROOT / "scripts" / "bench" / "run.py"

WRITES = """import json, sys
out = sys.argv[sys.argv.index("--json") + 1]
figures = {figures}
doc = {{"figures": figures, "command": "bench " + " ".join(sys.argv[1:]), "load": [0.5, 0.75]}}
open(out, "w").write(json.dumps(doc))
"""
SCRIPTS = {
    "bench_store.py": WRITES.format(
        figures=[
            {
                "name": "ingest ratio",
                "target": ">= 1.0x",
                "value": 1.25,
                "unit": "x",
                "met": True,
                "detail": "quick: 1.25x",
            },
            {
                "name": "small bundles",
                "target": ">= 0.7x",
                "value": 0.5,
                "unit": "x",
                "met": False,
                "detail": "0.5x",
            },
        ]
    ),
    "bench_dedup.py": "import sys\nprint('boom: no space left', file=sys.stderr)\nsys.exit(3)\n",
    "bench_cli.py": WRITES.format(
        figures=[{"name": "cli", "target": "<= 0.3 s", "value": 0.2, "unit": "s"}]
    ),
    # bench_store_replay.py: missing
    "bench_rest.py": WRITES.format(
        figures=[
            {
                "name": "lookups",
                "target": ">= 0.8x",
                "value": 0.9,
                "unit": "x",
                "met": True,
                "detail": "wrk",
            }
        ]
    ),
}
DOC = """# Benchmarks

Targets and how to reproduce.

## Another section

text
"""


@pytest.fixture
def bench(tmp_path: Path) -> Path:
    d = tmp_path / "bench"
    d.mkdir()
    for name, text in SCRIPTS.items():
        (d / name).write_text(text)
    return d


def perf(bench: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            str(PERF),
            "--quick",
            "--bench-dir",
            str(bench),
            "--workdir",
            str(tmp_path / "work"),
            "--reps",
            "3",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_each_script_gives_its_figures_or_a_row_saying_why_not(bench: Path, tmp_path: Path) -> None:
    out = perf(bench, tmp_path)
    assert out.returncode == 1, out.stderr
    table = out.stdout.split("\n\n")[-1]
    assert "ingest ratio" in table and "1.25x" in table
    assert "small bundles" in table and "**missed**" in table
    assert "lookups" in table and "0.9x" in table
    lines = table.splitlines()
    assert any("bench_dedup.py" in x and "exit 3" in x and "boom" in x for x in lines)
    assert any("bench_cli.py" in x and "'met'" in x for x in lines)
    assert any("bench_store_replay.py" in x and "missing" in x for x in lines)
    assert any("bench_scale.py" in x and "missing" in x for x in lines)  # every figure has a row


def test_doc_rewrites_only_its_block(bench: Path, tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    perf(bench, tmp_path, "--doc", "--doc-path", str(doc))
    first = doc.read_text()
    assert first.startswith(DOC)
    assert first.index("## Another section") < first.index("## Latest run")
    assert "| small bundles | >= 0.7x | 0.5x | **missed** |" in first
    first = first.replace("<!-- bench: end -->", "<!-- bench: end -->\n\n## After\n\nmore\n")
    doc.write_text(first)
    (bench / "bench_store.py").write_text(SCRIPTS["bench_store.py"].replace("1.25", "2.5"))
    perf(bench, tmp_path, "--doc", "--doc-path", str(doc))
    second = doc.read_text()
    assert second.count("<!-- bench: begin -->") == second.count("## Latest run") == 1
    assert "2.5x" in second and "1.25x" not in second
    outside = [t.split("<!-- bench: begin -->")[0] for t in (first, second)]
    assert outside[0] == outside[1]
    assert first.split("<!-- bench: end -->")[1] == second.split("<!-- bench: end -->")[1]


NOISY = """import json, sys
from pathlib import Path
out = sys.argv[sys.argv.index("--json") + 1]
count = Path(out).with_suffix(".count")
n = int(count.read_text()) if count.exists() else 0
count.write_text(str(n + 1))
value = [0.95, 1.30, 0.60][n % 3]
figure = {{"name": "lookups", "target": ">= 0.8x", "value": value, "unit": "x", "met": True}}
{extra}
open(out, "w").write(json.dumps({{"figures": [figure], "command": "bench"}}))
"""


@pytest.mark.parametrize(
    ("extra", "cell"),
    [
        ("", "inconclusive (spread 0.6-1.3 >= margin 0.15)"),
        ('figure.update(workload=120, target_workload=10000, unit="x")', "not measured"),
    ],
)
def test_the_verdict_is_the_rule_over_the_runs_not_the_scripts_met(
    tmp_path: Path, extra: str, cell: str
) -> None:
    """A script that calls each run met, while its runs spread over the margin (or ran
    on a smaller workload than the target names), is not met in the table."""
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "bench_rest.py").write_text(NOISY.format(extra=extra))
    out = perf(bench, tmp_path, "--only", "rest")
    assert out.returncode == 0, out.stderr
    row = next(x for x in out.stdout.splitlines() if x.startswith("lookups"))
    assert cell in row and " met " not in row
