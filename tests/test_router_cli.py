"""`trajstore router metrics` on hand-built routed bundles and `router compare` on a store."""

from __future__ import annotations

import csv
import io
import json

import pytest
from test_router_stage import routed_contents

from trajstore.bundle.writer import write_bundle
from trajstore.cli import main


def _write_step(root, name, rollout_id, *, same_routes=False, run_mode="baseline"):
    c = routed_contents()
    c.identity = {"actor_step_id": {"rollout_id": rollout_id, "step_id": 0}, "rollout_id": None}
    c.bundle_id = f"{name}-{rollout_id}"
    c.config["router"] = {**c.config["router"], "mode": run_mode}
    if same_routes:
        c.payloads["train_routed_experts"] = c.payloads["rollout_routed_experts"].copy()
        c.payloads["train_log_probs"] = c.payloads["rollout_log_probs"] * 1.001
        c.expected = {}
    return write_bundle(root / f"replay-{rollout_id}-0", c)


def run_json(capsys, *argv):
    code = main([*argv, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_metrics_json_values_and_denominators(tmp_path, capsys):
    path = write_bundle(tmp_path / "b", routed_contents())
    code, doc = run_json(capsys, "router", "metrics", str(path))
    assert code == 0
    (b,) = doc["bundles"]
    assert b["metrics"]["route_mismatch_rate"] == pytest.approx(3 / 12)
    assert b["metrics"]["per_layer_mismatch"] == [pytest.approx(3 / 6), 0.0]
    assert b["denominators"]["valid_token_layers"] == 12
    assert b["denominators"]["per_layer_valid_token_layers"] == [6, 6]
    assert b["numerators"]["route_mismatches"] == 3
    assert b["metrics"]["metric_error"] == []


def test_metrics_text_prints_null_for_unmeasured(tmp_path, capsys):
    c = routed_contents(recorded=None, train_routes=False)
    path = write_bundle(tmp_path / "b", c)
    assert main(["router", "metrics", str(path)]) == 0
    out = capsys.readouterr().out
    assert "route_mismatch_rate   null" in out
    assert "missing_route" in out


def test_metrics_capture_dir_reports_every_bundle(tmp_path, capsys):
    _write_step(tmp_path, "a", 1)
    _write_step(tmp_path, "a", 2, same_routes=True)
    code, doc = run_json(capsys, "router", "metrics", str(tmp_path))
    assert code == 0
    rates = [e["bundles"][0]["metrics"]["route_mismatch_rate"] for e in doc]
    assert rates == [pytest.approx(0.25), 0.0]


def test_metrics_capture_dir_step_selects_one(tmp_path, capsys):
    _write_step(tmp_path, "a", 1)
    _write_step(tmp_path, "a", 2, same_routes=True)
    code, doc = run_json(capsys, "router", "metrics", str(tmp_path), "--step", "2:0")
    assert doc["bundles"][0]["metrics"]["route_mismatch_rate"] == 0.0


def test_metrics_without_router_config_exits_2(tmp_path, capsys):
    path = write_bundle(tmp_path / "b", routed_contents(router=None))
    assert main(["router", "metrics", str(path)]) == 2
    assert "config.router" in capsys.readouterr().err


@pytest.fixture
def two_run_store(tmp_path):
    from trajstore.store import Store

    for run, same in (("base", False), ("fix", True)):
        for r in (1, 2):
            _write_step(
                tmp_path / run, run, r, same_routes=same, run_mode="r3" if same else "baseline"
            )
    store_dir = tmp_path / "store"
    with Store.open(store_dir) as store:
        for run in ("base", "fix"):
            store.ingest([tmp_path / run], run=run)
    return store_dir


def test_compare_json_side_by_side_ratios_and_stability(two_run_store, capsys):
    code, doc = run_json(
        capsys, "router", "compare", "--store", str(two_run_store), "--run", "base", "--run", "fix"
    )
    assert code == 0
    assert [(s["rollout_id"], s["step_id"]) for s in doc["steps"]] == [(1, 0), (2, 0)]
    step = doc["steps"][0]["runs"]
    assert step["base"]["route_mismatch_rate"] == pytest.approx(0.25)
    assert step["fix"]["route_mismatch_rate"] == 0.0
    r = doc["ratios"]["route_mismatch_rate"]["base"]
    assert r["last_zero_steps"] == 2 and r["min"] is None
    kl = doc["ratios"]["kl_k3"]["base"]
    assert kl["steps"] == 2 and kl["min"] > 1
    st = doc["stability"]
    assert st["base"]["hang_count"] == 0 and st["fix"]["hang_count"] is None
    assert st["base"]["recorded_disagreements"] == 0


def test_compare_csv_one_row_per_step_and_run(two_run_store, capsys):
    args = ["router", "compare", "--store", str(two_run_store), "--run", "base", "--run", "fix"]
    assert main([*args, "--format", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [(r["run"], r["rollout_id"]) for r in rows] == [
        ("base", "1"),
        ("fix", "1"),
        ("base", "2"),
        ("fix", "2"),
    ]
    assert rows[1]["route_mismatch_rate"] == "0.0"


def test_compare_plot_writes_png(two_run_store, tmp_path, capsys):
    png = tmp_path / "cmp.png"
    args = ["router", "compare", "--store", str(two_run_store), "--run", "base", "--run", "fix"]
    assert main([*args, "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_plot_with_a_tilde_is_written_under_home(
    two_run_store, tmp_path, capsys, monkeypatch
):
    # --plot=~/cmp.png reaches trajstore unexpanded: it was written to ./~/cmp.png (the
    # directory made for it) and reported as "plot written to ~/cmp.png"
    monkeypatch.setenv("HOME", str(tmp_path))
    args = ["router", "compare", "--store", str(two_run_store), "--run", "base", "--run", "fix"]
    assert main([*args, "--plot=~/cmp.png"]) == 0
    assert (tmp_path / "cmp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("plot", "message"),
    [
        ("cmp", "must end in .png"),
        ("cmp.svg", "must end in .png"),
        ("a-file/cmp.png", "a-file: exists and is not a directory"),
        ("a-dir.png", "is a directory"),
    ],
)
def test_compare_refuses_an_unwritable_plot_before_comparing(
    two_run_store, tmp_path, capsys, plot, message
):
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-dir.png").mkdir()
    args = ["router", "compare", "--store", str(two_run_store), "--run", "base", "--run", "fix"]
    assert main([*args, "--plot", str(tmp_path / plot)]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # refused up front: no table printed, then a failure
    assert err.startswith("trajstore: error: ") and message in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "cmp.png").exists() and not (tmp_path.parent / "cmp.png").exists()


def test_compare_the_same_run_twice_exits_2(two_run_store, capsys):
    args = ["router", "compare", "--store", str(two_run_store), "--run", "base", "--run", "base"]
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip() == "trajstore: error: router compare: run 'base' given more than once"


def test_compare_unknown_run_exits_2(two_run_store, capsys):
    args = ["router", "compare", "--store", str(two_run_store), "--run", "base", "--run", "nope"]
    assert main(args) == 2
    assert "nope" in capsys.readouterr().err
