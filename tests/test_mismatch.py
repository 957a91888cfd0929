"""Training-inference mismatch computed when a bundle is stored, then queried per step.

Every expected number is computed here in plain NumPy / Python from the arrays the test
generated (never by trajstore.mismatch): identical sides give exactly 0, a shift of d in
log space the closed forms, one flipped expert in one layer the counted rate; masked
tokens are left out, an empty mask is null with a reason, and a cohort's ranks add up
to the numbers of their tokens taken together.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import make_contents

from trajstore.bundle.writer import write_bundle, write_rank
from trajstore.cli import main
from trajstore.cli._catalog import catalog_reader
from trajstore.mismatch.metrics import METRICS, PAIRS
from trajstore.mismatch.query import MismatchQuery
from trajstore.store import Store

pytestmark = pytest.mark.integration

E, L, K = 8, 3, 2
PROMPT = 3  # make_contents: total_length = response_length + 3
CLIP = 1.5
PAIR_PAYLOAD = dict(PAIRS)


def _routes(rng: np.random.Generator, tokens: int) -> np.ndarray:
    return np.stack([rng.permutation(E)[:K] for _ in range(tokens * L)]).reshape(tokens, L, K)


def contents(
    *,
    seed: int = 0,
    rollout_id: int = 1,
    rank: int | None = None,
    world: int = 1,
    lengths: list[int] | None = None,
    shift: float | None = None,
    identical: bool = False,
    flip: tuple[int, int] | None = None,
    masks: list[list[int]] | None = None,
    clip: float | None = CLIP,
    routes: bool = True,
):
    """A bundle's contents with rollout/old/current/train log-probs and routes.

    shift: every trainer side is rollout + shift; identical: every side equals rollout;
    flip (response token index, layer): that one (token, layer) gets another expert set.
    """
    c = make_contents(
        seed=seed,
        rollout_id=rollout_id,
        rank=rank,
        world=world,
        lengths=lengths or [4, 5, 3, 2],
    )
    if masks is not None:
        for s, m in zip(c.samples, masks, strict=True):
            s["loss_mask"] = m
    rng = np.random.default_rng(seed * 100 + (rank or 0))
    r_total = sum(s["response_length"] for s in c.samples)
    t_total = sum(s["total_length"] for s in c.samples)
    lp_r = -rng.uniform(0.05, 3.0, r_total)
    c.payloads["rollout_log_probs"] = lp_r.astype(np.float64)
    for i, (_, name) in enumerate(PAIRS):
        if identical:
            side = lp_r.copy()
        elif shift is not None:
            side = lp_r + shift
        else:
            side = lp_r + rng.normal(0, 0.3 * (i + 1), r_total)
        c.payloads[name] = side.astype(np.float64)
    if routes:
        a = _routes(rng, t_total).astype(np.int16)
        b = a.copy() if (identical or flip is not None) else _routes(rng, t_total).astype(np.int16)
        if flip is not None:
            token, layer = flip
            # response token `token` of the flat layout: sample 0's response starts at PROMPT
            t = PROMPT + token
            b[t, layer] = [e for e in range(E) if e not in a[t, layer]][:K]
        c.payloads["rollout_routed_experts"] = a
        c.payloads["train_routed_experts"] = b
        c.config["router"] = {"num_experts": E, "num_layers": L, "top_k": K, "mode": "baseline"}
    if clip is not None:
        c.config["is_clip_max"] = clip
    return c


# --------------------------------------------------------------------------- the oracle


def valid_index(samples: list[dict]) -> np.ndarray:
    mask = np.concatenate([np.asarray(s["loss_mask"]) for s in samples])
    return np.flatnonzero(mask == 1)


def oracle_logprob(parts: list, name: str, clip: float | None = CLIP) -> dict[str, float]:
    """The pair's metrics over the valid tokens of every part (rank) taken together."""
    r = np.concatenate([c.payloads["rollout_log_probs"][valid_index(c.samples)] for c in parts])
    t = np.concatenate([c.payloads[name][valid_index(c.samples)] for c in parts])
    d = t - r
    pr, pt = np.exp(r), np.exp(t)
    out = {
        "tokens": d.size,
        "abs_dlogp_mean": np.mean(np.abs(d)),
        "abs_dlogp_max": np.max(np.abs(d)),
        "abs_dp_mean": np.mean(np.abs(pt - pr)),
        "abs_dp_max": np.max(np.abs(pt - pr)),
        "kl_k1": np.mean(r - t),
        "kl_k3": np.mean(np.exp(d) - 1 - d),
        "ppl_ratio": np.exp(-np.mean(t)) / np.exp(-np.mean(r)),
        "mult_prob_error": np.mean(np.exp(np.abs(d))),
        "prob_pearson": np.corrcoef(pr, pt)[0, 1],
        "frac_dlogp_gt_0_1": np.mean(np.abs(d) > 0.1),
        "frac_dlogp_gt_0_5": np.mean(np.abs(d) > 0.5),
        "frac_dlogp_gt_ln2": np.mean(np.abs(d) > math.log(2)),
        "frac_dlogp_gt_1": np.mean(np.abs(d) > 1.0),
        "is_ratio_min": np.min(np.exp(d)),
        "is_ratio_max": np.max(np.exp(d)),
        "is_clip_frac": None if clip is None else np.mean(np.exp(d) > clip),
    }
    return {k: (None if v is None else float(v)) for k, v in out.items()}


def valid_tokens(c) -> Iterator[int]:
    """The flat route rows of `c`'s masked-in response tokens, in order."""
    start = 0
    for s in c.samples:
        head = s["total_length"] - s["response_length"]
        for j, m in enumerate(s["loss_mask"]):
            if m == 1:
                yield start + head + j
        start += s["total_length"]


def oracle_routes(parts: list) -> dict[str, float]:
    """router-metrics.md's route numbers, by sets, token by token, in plain Python."""
    observed = mismatched = missing = tokens = any_tokens = 0
    for c in parts:
        a, b = c.payloads["rollout_routed_experts"], c.payloads["train_routed_experts"]
        for t in valid_tokens(c):
            tokens += 1
            differs = False
            for layer in range(L):
                x, y = set(a[t, layer].tolist()), set(b[t, layer].tolist())
                observed += 1
                missing += K - len(x & y)
                if x != y:
                    mismatched += 1
                    differs = True
            any_tokens += differs
    return {
        "route_mismatch_rate": mismatched / observed,
        "expert_slot_mismatch": missing / (K * observed),
        "topk_overlap": 1 - missing / (K * observed),
        "token_any_mismatch": any_tokens / tokens,
    }


# --------------------------------------------------------------------------- helpers


def stored(tmp_path: Path, run: str, *bundles) -> Path:
    """A store holding `bundles` (contents, or lists of rank contents: a cohort) of `run`."""
    store_dir = tmp_path / "store"
    with Store.open(store_dir) as store:
        for i, b in enumerate(bundles):
            where = tmp_path / "in" / f"b{i}"
            if isinstance(b, list):
                for r, part in enumerate(b):
                    write_rank(where, part, rank=r, expected_ranks=list(range(len(b))))
            else:
                write_bundle(where, b)
            outcomes = store.ingest([where], run=run)
            assert [o.status for o in outcomes] == ["published"], outcomes
    return store_dir


def step_values(store_dir: Path, run: str, metrics=None) -> dict[str, dict]:
    """metric -> the first step's row, through the direct reader."""
    out = {}
    with catalog_reader(store_dir) as cat:
        for name in metrics or METRICS:
            (row,) = cat.mismatch(MismatchQuery(run=run, metric=name, rollout_from=1, rollout_to=1))
            out[name] = row
    return out


def assert_close(got: float | None, want: float | None, what: str) -> None:
    if want is None:
        assert got is None, what
        return
    assert got is not None, what
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12), what


# --------------------------------------------------------------------------- tests


def test_identical_sides_are_exactly_zero(tmp_path):
    store_dir = stored(tmp_path, "same", contents(identical=True))
    rows = step_values(store_dir, "same")
    for pair, _ in PAIRS:
        for name in ("abs_dlogp_mean", "abs_dlogp_max", "abs_dp_mean", "abs_dp_max"):
            assert rows[f"{pair}_{name}"]["value"] == 0.0, (pair, name)
        for name in ("kl_k1", "kl_k3", "frac_dlogp_gt_0_1", "is_clip_frac"):
            assert rows[f"{pair}_{name}"]["value"] == 0.0, (pair, name)
        for name in ("ppl_ratio", "is_ratio_min", "is_ratio_max", "mult_prob_error"):
            assert rows[f"{pair}_{name}"]["value"] == 1.0, (pair, name)
        assert rows[f"{pair}_prob_pearson"]["value"] == pytest.approx(1.0, abs=1e-12)
    for name in ("route_mismatch_rate", "token_any_mismatch", "expert_slot_mismatch"):
        assert rows[name]["value"] == 0.0
    assert rows["topk_overlap"]["value"] == 1.0


@pytest.mark.parametrize("d", [0.25, -0.7])
def test_a_shift_in_log_space_gives_the_closed_form(tmp_path, d):
    c = contents(shift=d)
    store_dir = stored(tmp_path, "shift", c)
    rows = step_values(
        store_dir,
        "shift",
        [
            f"old_{m}"
            for m in (
                "abs_dlogp_mean",
                "abs_dlogp_max",
                "kl_k1",
                "kl_k3",
                "ppl_ratio",
                "mult_prob_error",
                "is_ratio_min",
                "is_ratio_max",
                "is_clip_frac",
                "frac_dlogp_gt_0_5",
                "tokens",
            )
        ],
    )
    n = len(valid_index(c.samples))
    want = {
        "abs_dlogp_mean": abs(d),
        "abs_dlogp_max": abs(d),
        "kl_k1": -d,
        "kl_k3": math.exp(d) - 1 - d,
        "ppl_ratio": math.exp(-d),
        "mult_prob_error": math.exp(abs(d)),
        "is_ratio_min": math.exp(d),
        "is_ratio_max": math.exp(d),
        "is_clip_frac": 1.0 if math.exp(d) > CLIP else 0.0,
        "frac_dlogp_gt_0_5": 1.0 if abs(d) > 0.5 else 0.0,
        "tokens": n,
    }
    for name, value in want.items():
        row = rows[f"old_{name}"]
        assert row["value"] == pytest.approx(value, rel=1e-12), name
        assert row["tokens"] == n and row["reason"] is None


def test_metrics_equal_numpy_on_masked_tokens(tmp_path):
    masks = [[1, 0, 1, 1], [0, 0, 1, 1, 0], [1, 1, 1], [0, 1]]
    c = contents(seed=3, masks=masks)
    store_dir = stored(tmp_path, "rand", c)
    rows = step_values(store_dir, "rand")
    for pair, name in PAIRS:
        for metric, want in oracle_logprob([c], name).items():
            assert_close(rows[f"{pair}_{metric}"]["value"], want, f"{pair}_{metric}")
    for metric, want in oracle_routes([c]).items():
        assert_close(rows[metric]["value"], want, metric)
    # router-metrics.md's names are the rollout vs train_log_probs pair
    train = oracle_logprob([c], "train_log_probs")
    assert_close(rows["kl_k3"]["value"], train["kl_k3"], "kl_k3")
    assert_close(rows["f_tau_2"]["value"], train["frac_dlogp_gt_ln2"], "f_tau_2")


def test_one_flipped_expert_in_one_layer_is_counted(tmp_path):
    c = contents(identical=True, flip=(1, 2))
    store_dir = stored(tmp_path, "flip", c)
    n = len(valid_index(c.samples))
    rows = step_values(store_dir, "flip", ["route_mismatch_rate", "token_any_mismatch"])
    assert rows["route_mismatch_rate"]["value"] == pytest.approx(1 / (n * L), rel=1e-15)
    assert rows["route_mismatch_rate"]["tokens"] == n * L
    assert rows["token_any_mismatch"]["value"] == pytest.approx(1 / n, rel=1e-15)
    with catalog_reader(store_dir) as cat:
        by_layer = {
            layer: cat.mismatch(MismatchQuery(run="flip", layer=layer))[0]["value"]
            for layer in range(L)
        }
        heat = cat.mismatch_layers(MismatchQuery(run="flip"))
    assert by_layer == {0: 0.0, 1: 0.0, 2: pytest.approx(1 / n, rel=1e-15)}
    assert [(h["layer"], h["mismatches"], h["observations"]) for h in heat] == [
        (0, 0, n),
        (1, 0, n),
        (2, 1, n),
    ]


def oracle_layer_counts(c) -> list[tuple[int, int]]:
    """(mismatched, observed) token-layers per layer, by sets, in plain Python."""
    a, b = c.payloads["rollout_routed_experts"], c.payloads["train_routed_experts"]
    counts = [[0, 0] for _ in range(L)]
    for t in valid_tokens(c):
        for layer in range(L):
            counts[layer][0] += set(a[t, layer].tolist()) != set(b[t, layer].tolist())
            counts[layer][1] += 1
    return [(m, o) for m, o in counts]


@pytest.fixture(params=["duckdb", "postgresql"])
def catalog_url(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """None: the store's own DuckDB catalog; else a fresh PostgreSQL schema."""
    if request.param == "duckdb":
        yield None
        return
    from pg_server import fresh_schema

    with fresh_schema() as url:
        yield url


def test_a_binned_heat_map_sums_consecutive_steps(tmp_path, catalog_url):
    """7 steps in 3 columns: 3 + 3 + 1 steps, each (column, layer) the plain sums of its
    steps' counts and their ratio, on either catalog."""
    from trajstore.catalog.queries import query_mismatch_heat

    steps = [contents(seed=r, rollout_id=r) for r in range(1, 8)]
    with Store.open(tmp_path / "store", catalog_url=catalog_url) as store:
        for i, c in enumerate(steps):
            write_bundle(tmp_path / "in" / f"b{i}", c)
            assert [o.status for o in store.ingest([tmp_path / "in" / f"b{i}"], run="h")] == [
                "published"
            ]
        with store.catalog() as cat:
            binned = query_mismatch_heat(cat, "h", bins=3)
            fits = query_mismatch_heat(cat, "h", bins=7)
            plain = query_mismatch_heat(cat, "h")
    want = []
    for first, last in ((1, 3), (4, 6), (7, 7)):
        per_step = [oracle_layer_counts(steps[r - 1]) for r in range(first, last + 1)]
        for layer in range(L):
            m = sum(counts[layer][0] for counts in per_step)
            o = sum(counts[layer][1] for counts in per_step)
            want.append((first, last, last - first + 1, layer, m, o, m / o))
    columns = binned["columns"]
    got = [
        (
            columns[c["column"]]["first"]["rollout_id"],
            columns[c["column"]]["last"]["rollout_id"],
            columns[c["column"]]["steps"],
            c["layer"],
            c["mismatches"],
            c["observations"],
            c["rate"],
        )
        for c in binned["items"]
    ]
    assert (binned["steps"], binned["bin_steps"]) == (7, 3)
    assert got == [w[:6] + (pytest.approx(w[6], rel=1e-15),) for w in want]
    # routes drawn apart: every column counts some mismatches, and not every token-layer
    assert all(w[4] > 0 for w in want) and any(w[4] < w[5] for w in want)
    assert fits == plain and (plain["steps"], plain["bin_steps"]) == (7, 1)
    assert [
        (c["rollout_id"], c["layer"], c["mismatches"], c["observations"]) for c in plain["items"]
    ] == [
        (r, layer, *oracle_layer_counts(steps[r - 1])[layer])
        for r in range(1, 8)
        for layer in range(L)
    ]


def test_empty_mask_is_null_with_a_reason(tmp_path):
    c = contents(masks=[[0] * 4, [0] * 5, [0] * 3, [0] * 2])
    store_dir = stored(tmp_path, "empty", c)
    rows = step_values(store_dir, "empty")
    for name, row in rows.items():
        if name.endswith("_tokens"):
            continue
        assert row["value"] is None, name
        assert row["reason"].startswith("empty_response_mask"), (name, row["reason"])


def test_unmeasurable_pairs_are_null_with_their_reason(tmp_path):
    c = contents(clip=None, routes=False)
    del c.payloads["log_probs"]
    store_dir = stored(tmp_path, "partial", c)
    rows = step_values(
        store_dir,
        "partial",
        ["current_kl_k3", "old_is_clip_frac", "old_kl_k3", "route_mismatch_rate"],
    )
    assert rows["current_kl_k3"]["value"] is None
    assert rows["current_kl_k3"]["reason"] == "missing_logprob: the bundle has no log_probs"
    assert rows["old_is_clip_frac"]["value"] is None
    assert rows["old_is_clip_frac"]["reason"].startswith("no_clip_cap")
    assert rows["old_kl_k3"]["value"] is not None
    assert rows["route_mismatch_rate"]["value"] is None
    assert rows["route_mismatch_rate"]["reason"].startswith("no_router_config")


def test_a_cohort_adds_up_across_ranks(tmp_path):
    parts = [
        contents(seed=5, rank=r, world=2, lengths=lens)
        for r, lens in enumerate([[4, 5, 3, 2], [2, 6, 1, 3]])
    ]
    store_dir = stored(tmp_path, "cohort", parts)
    rows = step_values(store_dir, "cohort")
    assert rows["old_kl_k3"]["ranks"] == 2
    for pair, name in PAIRS:
        for metric, want in oracle_logprob(parts, name).items():
            assert_close(rows[f"{pair}_{metric}"]["value"], want, f"{pair}_{metric}")
    for metric, want in oracle_routes(parts).items():
        assert_close(rows[metric]["value"], want, metric)


def test_worst_token_names_sample_offset_and_both_values(tmp_path):
    c = contents(seed=2, identical=True)
    c.payloads["old_log_probs"][7] += 2.0  # sample 1 (lengths 4, 5, ...), offset 3
    store_dir = stored(tmp_path, "worst", c)
    with catalog_reader(store_dir) as cat:
        (row,) = cat.mismatch(MismatchQuery(run="worst", metric="old_abs_dlogp_max"))
    w = row["worst"]
    assert (w["sample_id"], w["offset"], w["pair"]) == ("s-1", 3, "old")
    assert w["rollout"] == c.payloads["rollout_log_probs"][7]
    assert w["trainer"] == c.payloads["old_log_probs"][7]
    assert row["value"] == pytest.approx(2.0, rel=1e-12)


def test_both_catalog_readers_answer_the_same(tmp_path):
    from trajstore.catalog.queries import query_mismatch

    store_dir = stored(tmp_path, "two", contents(seed=1), contents(seed=2, rollout_id=2))
    with Store.open(store_dir, create=False) as store, store.catalog() as cat:
        paged = {name: query_mismatch(cat, "two", metric=name, limit=1) for name in sorted(METRICS)}
    with catalog_reader(store_dir) as direct:
        for name, page in paged.items():
            rows = direct.mismatch(MismatchQuery(run="two", metric=name))
            assert page["items"] == rows[:1], name
            assert page["next_cursor"] is not None


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_filters_first_above_and_fail_above(tmp_path, capsys):
    steps = [contents(seed=s, rollout_id=s, shift=0.1 * s) for s in range(1, 6)]
    store_dir = stored(tmp_path, "drift", *steps)
    base = ("query", "mismatch", "--store", str(store_dir), "--run", "drift", "--json")
    code, out, _ = cli(capsys, *base, "--metric", "old_abs_dlogp_mean")
    assert code == 0
    assert [r["rollout_id"] for r in json.loads(out)] == [1, 2, 3, 4, 5]
    code, out, _ = cli(capsys, *base, "--metric", "old_kl_k1", "--top", "2")
    assert [r["rollout_id"] for r in json.loads(out)] == [1, 2]  # kl_k1 = -d: largest first
    code, out, _ = cli(capsys, *base, "--metric", "old_abs_dlogp_mean", "--above", "0.25")
    assert [r["rollout_id"] for r in json.loads(out)] == [3, 4, 5]
    code, out, _ = cli(capsys, *base, "--metric", "old_abs_dlogp_mean", "--first-above", "0.25")
    assert [r["rollout_id"] for r in json.loads(out)] == [3]
    code, out, _ = cli(capsys, *base, "--metric", "old_abs_dlogp_mean", "--from", "2", "--to", "3")
    assert [r["rollout_id"] for r in json.loads(out)] == [2, 3]
    code, _, err = cli(capsys, *base, "--metric", "old_abs_dlogp_mean", "--fail-above", "0.45")
    assert code == 1 and "1 step(s) of run drift" in err and "5:0" in err
    code, _, _ = cli(capsys, *base, "--metric", "old_abs_dlogp_mean", "--fail-above", "0.55")
    assert code == 0


def test_cli_bad_input_is_one_line_exit_2(tmp_path, capsys):
    store_dir = stored(tmp_path, "bad", contents())
    base = ("query", "mismatch", "--store", str(store_dir))
    for argv, words in [
        ((), "needs --run"),
        (("--run", "bad", "--metric", "nope"), "unknown metric 'nope'"),
        (("--run", "bad", "--metric", "old_kl_k3", "--layer", "0"), "--layer applies"),
        (("--run", "nobody"), "nobody"),
        (("--run", "bad", "--top", "0"), "--top must be >= 1"),
    ]:
        code, _, err = cli(capsys, *base, *argv)
        assert code == 2, argv
        assert words in err and len(err.strip().splitlines()) == 1, err


def test_mismatch_options_are_refused_by_the_other_listings(tmp_path, capsys):
    store_dir = stored(tmp_path, "other", contents())
    code, _, err = cli(capsys, "query", "steps", "--store", str(store_dir), "--metric", "kl_k3")
    assert code == 2 and "--metric applies to query mismatch only" in err


def test_cli_table_and_plot(tmp_path, capsys):
    store_dir = stored(tmp_path, "t", contents(seed=1), contents(seed=2, rollout_id=2))
    png = tmp_path / "m.png"
    code, out, _ = cli(
        capsys, "query", "mismatch", "--store", str(store_dir), "--run", "t", "--plot", str(png)
    )
    assert code == 0
    assert out.splitlines()[0].split()[:4] == ["step", "attempt", "ranks", "route_mismatch_rate"]
    assert out.splitlines()[1].startswith("1:0")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reindex_recomputes_a_ref_stored_without_sums(tmp_path):
    c = contents(seed=4)
    store_dir = stored(tmp_path, "old", c)
    # a ref written by a trajstore before the sums existed: drop its "mismatch" entry
    (ref,) = (store_dir / "refs" / "bundles").glob("*.json")
    doc = json.loads(ref.read_text())
    del doc["mismatch"]
    ref.write_text(json.dumps(doc))
    (store_dir / "catalog.duckdb").unlink(missing_ok=True)
    rows = step_values(store_dir, "old", ["old_kl_k3"])
    assert rows["old_kl_k3"]["value"] is None
    assert rows["old_kl_k3"]["reason"].startswith("not_computed")
    with Store.open(store_dir, create=False) as store:
        store.reindex()
    rows = step_values(store_dir, "old", ["old_kl_k3"])
    assert_close(rows["old_kl_k3"]["value"], oracle_logprob([c], "old_log_probs")["kl_k3"], "k3")


def test_the_demo_runs_baseline_drifts_and_r3_is_exactly_zero(demo_run):
    """The demo's MoE runs: baseline routes disagree on some steps, R3's never; the
    alert exits 1 on the baseline and 0 on R3 (docs/tutorial.md's drift section)."""
    import subprocess
    import sys

    from conftest import user_env

    assert demo_run.returncode == 0, demo_run.output[-3000:]
    store = str(demo_run.cwd / "demo-store")

    def query(run: str, *more: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "trajstore", "query", "mismatch", "--store", store,
             "--run", run, *more],
            capture_output=True, text=True, env=user_env(), timeout=120,
        )  # fmt: skip

    base = json.loads(query("baseline", "--json").stdout)
    r3 = json.loads(query("r3", "--json").stdout)
    assert base and len(base) == len(r3)
    assert sum(row["value"] for row in base) > 0
    assert all(row["value"] == 0.0 and row["reason"] is None for row in r3)
    assert query("baseline", "--fail-above", "0").returncode == 1
    assert query("r3", "--fail-above", "0").returncode == 0


@pytest.fixture
def compared_store(tmp_path):
    from test_router_cli import _write_step

    for run, same in (("base", False), ("fix", True)):
        for r in (1, 2):
            _write_step(tmp_path / run, run, r, same_routes=same)
    store_dir = tmp_path / "store"
    with Store.open(store_dir) as store:
        for run in ("base", "fix"):
            store.ingest([tmp_path / run], run=run)
    return store_dir


def test_router_compare_reads_the_stored_sums_and_recompute_agrees(compared_store, capsys):
    argv = ["router", "compare", "--store", str(compared_store), "--run", "base", "--run", "fix"]
    code, out, _ = cli(capsys, *argv, "--json")
    assert code == 0
    stored = json.loads(out)
    code, out, err = cli(capsys, *argv, "--json", "--recompute")
    assert code == 0, err
    assert json.loads(out) == stored
    # the stored sums are what compare reads: change one ref's count, rebuild the catalog
    _tamper_base_step_1(compared_store)
    code, out, _ = cli(capsys, *argv, "--json")
    step = json.loads(out)["steps"][0]["runs"]["base"]
    assert step["route_mismatch_rate"] == pytest.approx(4 / 12)  # 3 of 12 differ in truth
    code, _, err = cli(capsys, *argv, "--recompute")
    assert code == 1
    assert "run base step 1:0: route_mismatch_rate stored" in err


def _tamper_base_step_1(store_dir) -> None:
    """Add one route mismatch to the stored sums of run base, step 1 (not to its payloads)."""
    ref = next(
        p
        for p in (store_dir / "refs" / "bundles").glob("*.json")
        if json.loads(p.read_text())["run"] == "base"
        and json.loads(p.read_text())["rollout_id"] == 1
    )
    doc = json.loads(ref.read_text())
    doc["mismatch"]["routes"]["mismatches"] += 1
    ref.write_text(json.dumps(doc))
    with Store.open(store_dir, create=False) as store:
        store.reindex()


def test_rest_router_compare_reads_the_stored_sums_and_recompute_checks_them(
    compared_store, capsys
):
    """GET /v1/router/compare is `router compare --json` (the stored sums, no payload);
    ``recompute=true`` checks them against the payloads as ``--recompute`` does (409)."""
    from test_api import serve

    argv = ["router", "compare", "--store", str(compared_store), "--run", "base", "--run", "fix"]
    params = {"run": ["base", "fix"]}
    with serve(compared_store) as client:
        page = client.get("/v1/router/compare", params=params).json()
        checked = client.get("/v1/router/compare", params={**params, "recompute": True})
    assert checked.status_code == 200, checked.text
    assert page.pop("next_cursor") is None
    assert page == json.loads(cli(capsys, *argv, "--json")[1])
    _tamper_base_step_1(compared_store)
    with serve(compared_store) as client:
        page = client.get("/v1/router/compare", params=params).json()
        checked = client.get("/v1/router/compare", params={**params, "recompute": True})
    step = page["steps"][0]["runs"]["base"]
    assert step["route_mismatch_rate"] == pytest.approx(4 / 12)  # the stored sum; 3 in truth
    assert checked.status_code == 409
    assert checked.json()["error"] == "recompute_disagrees"
    assert "run base step 1:0: route_mismatch_rate stored" in checked.json()["detail"]


def test_ranks_storing_their_own_shards_carry_the_sums(tmp_path):
    """Capture from hosts without a shared file system (trajstore.store.shards): each rank
    stores its own bundle; the published cohort's step adds up like an ingested one."""
    from trajstore.store.shards import store_rank_shard

    parts = [contents(seed=6, rank=r, world=2) for r in range(2)]
    cohort = tmp_path / "cohort"
    for r, part in enumerate(parts):
        write_rank(cohort, part, rank=r, expected_ranks=[0, 1])
    store_dir = tmp_path / "store"
    with Store.open(store_dir) as store:
        assert not store_rank_shard(store, cohort / "rank-1", "shards").published
        assert store_rank_shard(store, cohort / "rank-0", "shards").published
    rows = step_values(store_dir, "shards", ["old_kl_k3", "route_mismatch_rate"])
    assert rows["old_kl_k3"]["ranks"] == 2
    assert_close(rows["old_kl_k3"]["value"], oracle_logprob(parts, "old_log_probs")["kl_k3"], "k3")
    assert_close(
        rows["route_mismatch_rate"]["value"],
        oracle_routes(parts)["route_mismatch_rate"],
        "route_mismatch_rate",
    )


def test_every_sample_worst_token_document_is_in_the_store(tmp_path):
    """The per-sample document a ref names is an object of the store (the sums are
    computed beside the payload writes; the document is put by the writer after them)."""
    from trajstore.cas.blobs import get_blob

    c = contents(seed=3, identical=True)
    c.payloads["old_log_probs"][7] += 2.0  # sample 1, offset 3
    store_dir = stored(tmp_path, "doc", c)
    (ref_file,) = (store_dir / "refs" / "bundles").glob("*.json")
    entry = json.loads(ref_file.read_text())["mismatch"]
    with Store.open(store_dir) as store:
        document = json.loads(get_blob(store.objs, entry["document"]))
    worst = document["worst_per_sample"]["old"]
    assert [w["sample_id"] for w in worst] == [s["sample_id"] for s in c.samples]
    assert (worst[1]["offset"], worst[1]["trainer"]) == (3, c.payloads["old_log_probs"][7])
