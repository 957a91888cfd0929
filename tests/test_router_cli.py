"""`trajstore router metrics` on hand-built routed bundles and `router compare` on a store."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
from test_router_stage import routed_contents

from trajstore.bundle.writer import BundleContents, write_bundle
from trajstore.cli import main

pytestmark = pytest.mark.unit


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


# -- router compare against numbers worked out by hand -------------------------------------
#
# Two samples of 6 tokens (3 prompt, 3 response), 2 MoE layers, top-2 of 8 experts. Rollout
# token t at layer l takes experts {(t+l) % 8, (t+l+1) % 8}; a "flip" gives training 1 or 2
# other experts there. Sample s-1's last token is masked out. Valid tokens: 3, 4, 5, 9, 10
# (5 tokens, 10 token-layers). Rollout log-probs are all -1.0; training's are -1.0 + d, with
# every d exact in float32. The expected numbers below follow docs/router-metrics.md by hand.

HAND_E, HAND_L, HAND_K, HAND_TOTAL, HAND_RESP = 8, 2, 2, 6, 3
HAND_MASKS = ([1, 1, 1], [1, 1, 0])
#: run -> step -> (flips {(token, layer): experts changed}, d per response token)
HAND_STEPS = {
    "base": {
        1: ({(0, 0): 2, (3, 0): 2, (4, 0): 2, (9, 1): 1, (11, 1): 2}, [0, 0.5, -1, 0.25, 0.75, 3]),
        2: ({(5, 1): 2, (2, 1): 2}, [0, 0, 0, 0, -0.25, 0]),
    },
    "fix": {1: ({}, [0.125, 0, 0, 0, 0, 0]), 2: ({}, [0, 0, -0.5, 0, 0, 0])},
}
VALID = [0, 1, 2, 3, 4]  # response positions (of 6) that count: s-1's last one is masked
#: route metrics worked out from the flips above: only (3,0), (4,0) [both experts] and
#: (9,1) [one expert] count at step 1 (token 0 is a prompt token, token 11 is masked)
HAND_ROUTES = {
    ("base", 1): {"route_mismatch_rate": 3 / 10, "token_any_mismatch": 3 / 5},
    ("base", 2): {"route_mismatch_rate": 1 / 10, "token_any_mismatch": 1 / 5},
    ("fix", 1): {"route_mismatch_rate": 0.0, "token_any_mismatch": 0.0},
    ("fix", 2): {"route_mismatch_rate": 0.0, "token_any_mismatch": 0.0},
}


def _hand_logprob_metrics(d: list[float]) -> dict[str, float]:
    """router-metrics.md's log-prob metrics of the valid tokens, in plain Python."""
    valid = [d[i] for i in VALID]
    return {
        "f_tau_2": sum(abs(x) > math.log(2) for x in valid) / len(valid),
        "kl_k3": sum(math.exp(x) - 1 - x for x in valid) / len(valid),
        "logprob_abs_diff": sum(abs(x) for x in valid) / len(valid),
    }


def _hand_bundle(root: Path, run: str, rollout_id: int) -> Path:
    flips, d = HAND_STEPS[run][rollout_id]
    tokens = len(HAND_MASKS) * HAND_TOTAL
    rollout = np.array(
        [
            [[(t + layer) % HAND_E, (t + layer + 1) % HAND_E] for layer in range(HAND_L)]
            for t in range(tokens)
        ],
        dtype=np.uint8,
    )
    train = rollout.copy()
    for (t, layer), changed in flips.items():
        chosen = rollout[t, layer]
        others = [e for e in range(HAND_E) if e not in chosen]
        train[t, layer] = others[:2] if changed == 2 else [others[0], chosen[1]]
    lp_rollout = np.full(len(d), -1.0, dtype=np.float32)
    lp_train = (lp_rollout + np.array(d, dtype=np.float32)).astype(np.float32)
    assert (lp_train.astype(np.float64) - lp_rollout == np.array(d)).all()  # d is exact
    mode = "r3" if run == "fix" else "baseline"
    router = {"num_experts": HAND_E, "num_layers": HAND_L, "top_k": HAND_K, "mode": mode}
    contents = BundleContents(
        bundle_id=f"{run}-{rollout_id}",
        identity={"actor_step_id": {"rollout_id": rollout_id, "step_id": 0}, "rollout_id": None},
        samples=[
            {
                "sample_id": f"s-{i}",
                "group_index": 0,
                "response_length": HAND_RESP,
                "total_length": HAND_TOTAL,
                "loss_mask": mask,
                "reward": 0.0,
            }
            for i, mask in enumerate(HAND_MASKS)
        ],
        config={"advantage_estimator": "grpo", "router": router},
        payloads={
            "rollout_routed_experts": rollout,
            "train_routed_experts": train,
            "rollout_log_probs": lp_rollout,
            "train_log_probs": lp_train,
        },
        expected={},
        producer={"commit": "test", "dirty_patch_digest": "", "torch_version": "2"},
    )
    return write_bundle(root / run / f"replay-{rollout_id}-0", contents)


@pytest.fixture(scope="module")
def hand_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trajstore.store import Store

    root = tmp_path_factory.mktemp("hand-routes")
    for run, steps in HAND_STEPS.items():
        for rollout_id in steps:
            _hand_bundle(root, run, rollout_id)
    with Store.open(root / "store") as store:
        for run in HAND_STEPS:
            assert all(o.status == "published" for o in store.ingest([root / run], run=run))
    return root / "store"


def _assert_hand_numbers(doc: dict) -> None:
    """A `router compare --json` document (or the REST body) against the hand numbers."""
    assert doc["runs"] == ["base", "fix"]
    assert [(s["rollout_id"], s["step_id"]) for s in doc["steps"]] == [(1, 0), (2, 0)]
    for step in doc["steps"]:
        for run, row in step["runs"].items():
            key = (run, step["rollout_id"])
            want = {
                **HAND_ROUTES[key],
                **_hand_logprob_metrics(HAND_STEPS[run][step["rollout_id"]][1]),
            }
            assert {k: row[k] for k in want} == pytest.approx(want, rel=1e-12, abs=1e-15), key
            assert (row["valid_tokens"], row["valid_token_layers"]) == (5, 10), key
            assert row["metric_error"] == [] and row["mode"] == (
                "r3" if run == "fix" else "baseline"
            )
    # each run over the last one (fix), step by step, as a min-max range
    kl = [
        _hand_logprob_metrics(HAND_STEPS["base"][r][1])["kl_k3"]
        / _hand_logprob_metrics(HAND_STEPS["fix"][r][1])["kl_k3"]
        for r in (1, 2)
    ]
    ratio = doc["ratios"]["kl_k3"]["base"]
    assert (ratio["min"], ratio["max"]) == pytest.approx((min(kl), max(kl)), rel=1e-12)
    assert ratio["steps"] == 2
    route = doc["ratios"]["route_mismatch_rate"]["base"]
    assert (route["min"], route["steps"], route["last_zero_steps"]) == (None, 0, 2)
    f_tau = doc["ratios"]["f_tau_2"]["base"]  # base 0.4 then 0 over fix's 0 then 0
    assert (f_tau["last_zero_steps"], f_tau["both_zero_steps"]) == (1, 1)
    for run in ("base", "fix"):
        stability = doc["stability"][run]
        assert (stability["steps"], stability["missing_steps"], stability["hang_count"]) == (
            2,
            0,
            None,
        )


def test_compare_cli_gives_the_numbers_worked_out_by_hand(hand_store: Path, capsys) -> None:
    code, doc = run_json(
        capsys, "router", "compare", "--store", str(hand_store), "--run", "base", "--run", "fix"
    )
    assert code == 0
    _assert_hand_numbers(doc)


def test_compare_rest_gives_the_numbers_worked_out_by_hand(hand_store: Path) -> None:
    from test_api import serve

    with serve(hand_store) as client:
        got = client.get("/v1/router/compare", params={"run": ["base", "fix"]})
    assert got.status_code == 200, got.text
    doc = got.json()
    assert doc.pop("next_cursor") is None
    _assert_hand_numbers(doc)
