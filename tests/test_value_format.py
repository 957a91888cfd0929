"""Divergence reports print expected/actual so that different values never print the same.

Text prints the shortest decimal that round-trips the value's dtype (at most 9
significant digits for float32, 17 for float64); JSON carries the exact value.
"""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from trajstore.examples.replay_builders import consistent_contents

from trajstore.bundle.writer import write_bundle
from trajstore.replay.compare import Divergence, compare_arrays
from trajstore.replay.report import divergence_line
from trajstore.store import Store

pytestmark = pytest.mark.integration


def one_divergence(expected: np.ndarray, actual: np.ndarray) -> Divergence:
    comp = compare_arrays("advantage.estimate", "advantages", expected, actual, atol=0.0, rtol=0.0)
    assert comp.mismatch_count == 1
    return comp.divergences[0]


def printed(line: str, key: str) -> str:
    return next(w for w in line.split() if w.startswith(f"{key}=")).split("=", 1)[1]


def test_float32_one_ulp_apart_print_differently_in_text() -> None:
    x = np.float32(0.1234567)
    d = one_divergence(np.array([x]), np.array([np.nextafter(x, np.float32(1))]))
    line = divergence_line(d)
    assert printed(line, "expected") != printed(line, "actual")
    assert np.float32(printed(line, "expected")) == x  # round-trips float32


def test_float32_one_ulp_apart_differ_in_json() -> None:
    x = np.float32(0.1234567)
    y = np.nextafter(x, np.float32(1))
    doc = json.loads(json.dumps(one_divergence(np.array([x]), np.array([y])).to_dict()))
    assert (np.float32(doc["expected"]), np.float32(doc["actual"])) == (x, y)
    assert (doc["expected_dtype"], doc["actual_dtype"]) == ("float32", "float32")


def test_float32_text_uses_at_most_9_significant_digits() -> None:
    x = np.float32(1) / np.float32(3)
    line = divergence_line(
        one_divergence(np.array([x]), np.array([np.nextafter(x, np.float32(1))]))
    )
    digits = printed(line, "actual").lstrip("0.").replace(".", "")
    assert len(digits) <= 9


def test_float64_one_ulp_apart_print_differently_in_text() -> None:
    x = 1 / 3
    d = one_divergence(np.array([x]), np.array([np.nextafter(x, 1.0)]))
    line = divergence_line(d)
    assert printed(line, "expected") != printed(line, "actual")
    assert float(printed(line, "actual")) == np.nextafter(x, 1.0)  # round-trips float64


def test_float64_one_ulp_apart_differ_in_json() -> None:
    x = 1 / 3
    y = float(np.nextafter(x, 1.0))
    doc = json.loads(json.dumps(one_divergence(np.array([x]), np.array([y])).to_dict()))
    assert (doc["expected"], doc["actual"]) == (x, y)


def nudged_bundle(tmp_path: Path) -> tuple[Path, np.float32, np.float32]:
    """A bundle whose recorded advantage at s-3@0 is one float32 ulp above the correct one,
    compared with zero tolerance: (path, recorded, correct)."""
    built = consistent_contents(seed=5)
    c = built.contents
    c.comparison_policy = {"tolerances": {"advantage.estimate": {"atol": 0.0, "rtol": 0.0}}}
    adv = np.array(c.payloads["advantages"], dtype=np.float32)
    k = built.offset_of("s-3")
    original = adv[k]
    adv[k] = np.nextafter(original, np.float32(np.inf))
    c.payloads["advantages"] = adv
    return write_bundle(tmp_path / "b", c), adv[k], original


def test_replay_report_tells_a_one_ulp_payload_change_apart(tmp_path: Path) -> None:
    """End to end: text and JSON of `trajstore replay` name both values exactly."""
    path, recorded, original = nudged_bundle(tmp_path)
    cmd = [sys.executable, "-m", "trajstore", "replay", str(path), "--stage", "advantage.estimate"]
    text = subprocess.run(cmd, capture_output=True, text=True)
    assert text.returncode == 1, text.stderr
    line = next(ln for ln in text.stdout.splitlines() if "advantages s-3@0:" in ln)
    assert np.float32(printed(line, "expected")) == recorded
    assert np.float32(printed(line, "actual")) == original
    as_json = subprocess.run([*cmd, "--json"], capture_output=True, text=True)
    stage = next(
        s
        for s in json.loads(as_json.stdout)["bundles"][0]["stages"]
        if s["stage"] == "advantage.estimate"
    )
    d = stage["divergences"][0]
    assert (np.float32(d["expected"]), np.float32(d["actual"])) == (recorded, original)


def test_query_divergences_tells_a_one_ulp_change_apart(tmp_path: Path) -> None:
    """The recorded divergence, read back from the catalog as a table and as CSV."""
    path, recorded, original = nudged_bundle(tmp_path)
    root = tmp_path / "store"
    with Store.open(root) as store:
        store.ingest([path], run="r")
    cli = [sys.executable, "-m", "trajstore"]
    out = subprocess.run(
        [*cli, "replay", "--store", str(root), "--step", "120:0", "--record"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1, out.stderr
    query = [
        *cli,
        "query",
        "divergences",
        "--store",
        str(root),
        "--stage",
        "advantage.estimate",
        "--sample",
        "s-3",
    ]
    table = subprocess.run(
        [*query, "--format", "table"], capture_output=True, text=True
    ).stdout.splitlines()
    header = table[0].split()
    row = dict(zip(header, table[1].split(), strict=True))
    assert (np.float32(float(row["expected"])), np.float32(float(row["actual"]))) == (
        recorded,
        original,
    )
    as_csv = subprocess.run([*query, "--format", "csv"], capture_output=True, text=True).stdout
    first = next(csv.DictReader(io.StringIO(as_csv)))
    assert (np.float32(float(first["expected"])), np.float32(float(first["actual"]))) == (
        recorded,
        original,
    )
