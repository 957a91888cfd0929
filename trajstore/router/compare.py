"""Compare runs (baseline / R2 / R3) step by step, from their stored payloads.

Numbers are recomputed from each step's route and log-prob payloads, never
copied from what the producer recorded: the producer's own numbers are what
this tool exists to check. What the producer recorded is used for two things
only: the stability counters it alone can know (``hang_count``,
``engine_error_count`` under expected.json ``router.consistency``), and a
per-run count of steps whose recorded metrics disagree with the payloads
(``recorded_disagreements``), so a run that "improved" by comparing the
replay target with itself is visible next to one that improved for real.

Ratios: for every metric, each run divided by the *last* run, per step,
reported as the min-max range over the steps where both are measured and the
last run's value is non-zero; steps where the last run is exactly 0 (as R3's
route mismatch is) are counted, not turned into infinities.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trajstore.replay.source import BundleSource
from trajstore.router.metrics import ERROR_CODES, RouterMetrics, aggregate, compute_router_metrics
from trajstore.router.stage import (
    ROLLOUT_LOGPROBS,
    STABILITY_COUNTERS,
    STAGE,
    TRAIN_LOGPROBS,
    compare_recorded,
    payload_logprobs,
    recompute_router_metrics,
)

#: metrics whose run-to-last-run ratio is reported
RATIO_METRICS: tuple[str, ...] = (
    "route_mismatch_rate",
    "token_any_mismatch",
    "f_tau_2",
    "kl_k3",
    "logprob_abs_diff",
)
#: per-step columns, in display order (one name per number: router-metrics.md)
STEP_COLUMNS: tuple[str, ...] = (*RATIO_METRICS, "valid_token_layers")


@dataclass
class StepMetrics:
    """One run's metrics at one actor step (every rank aggregated)."""

    run: str
    rollout_id: int
    step_id: int
    metrics: RouterMetrics
    mode: str | None = None
    stability: dict[str, int] = field(default_factory=dict)
    recorded_disagrees: bool = False

    @property
    def step(self) -> str:
        return f"{self.rollout_id}:{self.step_id}"

    def row(self) -> dict[str, Any]:
        d = self.metrics.to_dict()
        return {
            "run": self.run,
            "rollout_id": self.rollout_id,
            "step_id": self.step_id,
            "mode": self.mode,
            **{c: d[c] for c in STEP_COLUMNS},
            "valid_tokens": d["valid_tokens"],
            "metric_error": d["metric_error"],
        }


def _metrics_or_missing(source: BundleSource) -> RouterMetrics:
    """A step without config.router has no measurable routes (missing_route, nulls); its
    log-prob drift is measured all the same (the two families fail independently), so a
    dense model's runs compare on it."""
    if not isinstance(source.index.config.get("router"), dict):
        samples = source.index.samples
        return compute_router_metrics(
            None,
            None,
            total_lengths=[s.total_length for s in samples],
            response_lengths=[s.response_length for s in samples],
            loss_masks=[s.loss_mask for s in samples],
            num_experts=1,
            num_layers=1,
            top_k=1,
            rollout_log_probs=payload_logprobs(source, ROLLOUT_LOGPROBS),
            train_log_probs=payload_logprobs(source, TRAIN_LOGPROBS),
        )
    return recompute_router_metrics(source)


def _add_recorded(
    recorded: Any,
    metrics: RouterMetrics,
    manifest: Callable[[], Any],
    stability: dict[str, int],
) -> bool:
    """Add one bundle's producer-recorded stability counters (its expected.json
    ``router.consistency``, `recorded`) to `stability`; return whether the metrics it
    recorded disagree with `metrics` within its manifest's tolerance (`manifest()` is
    read only when it recorded some)."""
    if not isinstance(recorded, dict):
        return False
    for key in STABILITY_COUNTERS:
        v = recorded.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            stability[key] = stability.get(key, 0) + v
    atol, rtol = manifest().tolerance(STAGE)
    return bool(compare_recorded(recorded, metrics, atol=atol, rtol=rtol))


def step_metrics(
    sources: Sequence[BundleSource], run: str, rollout_id: int, step_id: int
) -> StepMetrics:
    """Recompute one step's metrics over all its ranks, and read the producer's counters."""
    per_rank = [_metrics_or_missing(s) for s in sources]
    stability: dict[str, int] = {}
    disagrees = False
    for src, metrics in zip(sources, per_rank, strict=True):
        recorded = src.expected.get(STAGE)
        disagrees |= _add_recorded(recorded, metrics, lambda src=src: src.manifest, stability)
    mode = None
    router = sources[0].index.config.get("router") if sources else None
    if isinstance(router, dict):
        mode = router.get("mode")
    return StepMetrics(run, rollout_id, step_id, aggregate(per_rank), mode, stability, disagrees)


def _ratio_range(values: Iterable[tuple[float | None, float | None]]) -> dict[str, Any]:
    ratios: list[float] = []
    zero_last = both_zero = unmeasured = 0
    for v, last in values:
        if v is None or last is None:
            unmeasured += 1
        elif last == 0.0 and v == 0.0:
            both_zero += 1
        elif last == 0.0:
            zero_last += 1
        else:
            ratios.append(v / last)
    return {
        "min": min(ratios) if ratios else None,
        "max": max(ratios) if ratios else None,
        "steps": len(ratios),
        "last_zero_steps": zero_last,
        "both_zero_steps": both_zero,
        "unmeasured_steps": unmeasured,
    }


@dataclass
class RunComparison:
    """Per-step metrics of several runs, side by side, over the union of their steps."""

    runs: list[str]
    cells: dict[tuple[str, tuple[int, int]], StepMetrics]

    @property
    def steps(self) -> list[tuple[int, int]]:
        return sorted({step for _, step in self.cells})

    def value(self, run: str, step: tuple[int, int], metric: str) -> Any:
        cell = self.cells.get((run, step))
        return None if cell is None else getattr(cell.metrics, metric)

    def ratios(self) -> dict[str, dict[str, dict[str, Any]]]:
        """{metric: {run: {min, max, steps, *_steps counts}}}: run / last run per step."""
        last = self.runs[-1]
        return {
            metric: {
                run: _ratio_range(
                    (self.value(run, s, metric), self.value(last, s, metric)) for s in self.steps
                )
                for run in self.runs[:-1]
            }
            for metric in RATIO_METRICS
        }

    def stability(self) -> dict[str, dict[str, Any]]:
        """Per run: steps, missing steps, metric-error counts, producer-recorded counters."""
        out: dict[str, dict[str, Any]] = {}
        for run in self.runs:
            cells = [cell for (cell_run, _), cell in self.cells.items() if cell_run == run]
            errors = {code: 0 for code in ERROR_CODES}
            for c in cells:
                for code in c.metrics.metric_error:
                    errors[code] += 1
            counters: dict[str, int | None] = {}
            for key in STABILITY_COUNTERS:
                seen = [c.stability[key] for c in cells if key in c.stability]
                counters[key] = sum(seen) if seen else None  # null: the producer never said
            out[run] = {
                "steps": len(cells),
                "missing_steps": len(self.steps) - len(cells),
                "metric_error_steps": sum(1 for c in cells if c.metrics.metric_error),
                "metric_errors": {k: v for k, v in errors.items() if v},
                **counters,
                "recorded_disagreements": sum(1 for c in cells if c.recorded_disagrees),
                "modes": sorted({c.mode for c in cells if c.mode is not None}),
            }
        return out

    def rows(self) -> list[dict[str, Any]]:
        """One row per (step, run): the CSV/JSON shape."""
        return [
            self.cells[(run, s)].row()
            for s in self.steps
            for run in self.runs
            if (run, s) in self.cells
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "runs": list(self.runs),
            "baseline_of_ratios": self.runs[-1],
            "columns": list(STEP_COLUMNS),
            "steps": [
                {
                    "rollout_id": s[0],
                    "step_id": s[1],
                    "runs": {
                        run: (self.cells[(run, s)].row() if (run, s) in self.cells else None)
                        for run in self.runs
                    },
                }
                for s in self.steps
            ],
            "ratios": self.ratios(),
            "stability": self.stability(),
        }

    def to_csv(self) -> str:
        buf = io.StringIO()
        cols = [
            "run",
            "rollout_id",
            "step_id",
            "mode",
            *STEP_COLUMNS,
            "valid_tokens",
            "metric_error",
        ]
        writer = csv.DictWriter(buf, fieldnames=cols, lineterminator="\n")
        writer.writeheader()
        for row in self.rows():
            row = dict(row)
            row["metric_error"] = ";".join(row["metric_error"])
            writer.writerow({k: ("null" if v is None else v) for k, v in row.items()})
        return buf.getvalue()

    def format_table(self) -> str:
        return format_comparison(self)


def fmt(value: Any) -> str:
    """Numbers as %.4g, integers as-is, null as 'null' (never a blank that reads as 0)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isinf(value) or math.isnan(value):
            return str(value)
        return "0" if value == 0 else f"{value:.4g}"
    if isinstance(value, list):
        return ",".join(map(str, value)) or "-"
    return str(value)


def _ratio_text(r: dict[str, Any], last: str) -> str:
    if r["steps"]:
        lo, hi = r["min"], r["max"]
        text = f"{lo:.3g}x-{hi:.3g}x over {r['steps']} step(s)"
    else:
        text = "no finite ratio"
    if r["last_zero_steps"]:
        text += f"; {last} = 0 < run on {r['last_zero_steps']} step(s)"
    if r["both_zero_steps"]:
        text += f"; both 0 on {r['both_zero_steps']} step(s)"
    if r["unmeasured_steps"]:
        text += f"; {r['unmeasured_steps']} step(s) unmeasured"
    return text


def format_comparison(cmp: RunComparison) -> str:
    """The text report: per-step table, ratio ranges, stability counters."""
    head = ["step", "run", *STEP_COLUMNS, "metric_error"]
    body: list[list[str]] = []
    for s in cmp.steps:
        for i, run in enumerate(cmp.runs):
            cell = cmp.cells.get((run, s))
            label = f"{s[0]}:{s[1]}" if i == 0 else ""
            if cell is None:
                body.append([label, run, *["missing"] * len(STEP_COLUMNS), "-"])
                continue
            d = cell.metrics.to_dict()
            body.append([label, run, *(fmt(d[c]) for c in STEP_COLUMNS), fmt(d["metric_error"])])
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [head, *body]
    ]
    last = cmp.runs[-1]
    lines += ["", f"ratio of each run to {last} (min-max over steps):"]
    ratios = cmp.ratios()
    for metric in RATIO_METRICS:
        for run in cmp.runs[:-1]:
            lines.append(f"  {metric:<20} {run}/{last}: {_ratio_text(ratios[metric][run], last)}")
    lines += ["", "stability:"]
    for run, st in cmp.stability().items():
        errs = ", ".join(f"{k}={v}" for k, v in st["metric_errors"].items()) or "none"
        lines.append(
            f"  {run}: steps={st['steps']} missing_steps={st['missing_steps']} "
            f"metric_error_steps={st['metric_error_steps']} ({errs}) "
            f"hang_count={fmt(st['hang_count'])} "
            f"engine_error_count={fmt(st['engine_error_count'])} "
            f"recorded_disagreements={st['recorded_disagreements']} modes={fmt(st['modes'])}"
        )
    return "\n".join(lines)


def compare_sources(
    runs: Sequence[str], steps: dict[str, dict[tuple[int, int], Sequence[BundleSource]]]
) -> RunComparison:
    """Compare runs given, per run, each actor step's bundle sources (all ranks)."""
    cells = {
        (run, step): step_metrics(srcs, run, *step)
        for run in runs
        for step, srcs in sorted(steps.get(run, {}).items())
    }
    return RunComparison(list(runs), cells)


def compare_store(
    store: Any, runs: Sequence[str], steps: Collection[tuple[int, int]] | None = None
) -> RunComparison:
    """Compare runs of a `trajstore.store.Store`, step by step (latest attempts).

    Streams one step at a time: only one step's payloads are in memory.
    ``steps`` (actor step ids) limits the comparison to those steps, so a
    caller showing a window of a long run recomputes only that window.
    """
    from trajstore.errors import UsageError, check_known_run

    if len(runs) < 2:
        raise UsageError("router compare needs at least two --run")
    twice = sorted({run for run in runs if runs.count(run) > 1})
    if twice:
        raise UsageError(f"router compare: run {twice[0]!r} given more than once")
    cells: dict[tuple[str, tuple[int, int]], StepMetrics] = {}
    known = {r["run"] for r in store.runs()}
    for run in runs:
        check_known_run(run, known)
        ids = sorted(
            {(int(b["rollout_id"]), int(b["step_id"])) for b in store.bundles(run=run, kind="step")}
        )
        if steps is not None:
            wanted = set(steps)
            ids = [step for step in ids if step in wanted]
        for rid, sid in ids:
            cells[(run, (rid, sid))] = step_metrics(store.step(run, rid, sid), run, rid, sid)
    return RunComparison(list(runs), cells)


# --------------------------------------------------------------------------- from stored sums

_STORED_SQL = (
    "SELECT m.*, b.rank, b.expected_hash, b.manifest_hash, lineage.mode, "
    "(SELECT sum(s.response_length - s.masked_tokens) FROM samples AS s "
    "WHERE s.bundle_key = m.bundle_key) AS mask_tokens, "
    "(SELECT count(*) FROM router_metrics AS r WHERE r.bundle_key = m.bundle_key "
    "AND r.source = 'producer') AS recorded "
    "FROM mismatch_metrics AS m JOIN bundles AS b ON b.key = m.bundle_key "
    "LEFT OUTER JOIN router_lineage AS lineage ON lineage.bundle_key = m.bundle_key "
    "WHERE b.is_latest AND m.run = :run AND m.kind = 'step' "
    "ORDER BY m.rollout_id, m.step_id, b.rank"
)
_LAYERS_SQL = (
    "SELECT l.bundle_key, l.layer, l.mismatches, l.observations FROM mismatch_layers AS l "
    "JOIN bundles AS b ON b.key = l.bundle_key JOIN mismatch_metrics AS m "
    "ON m.bundle_key = l.bundle_key WHERE b.is_latest AND m.run = :run "
    "ORDER BY l.bundle_key, l.layer"
)
#: stored reasons that mean "compute it from the payloads" (a ref stored without sums)
_UNSTORED = ("not_computed", "compute_failed")


def _code(reason: str | None) -> str | None:
    return None if reason is None else reason.split(":", 1)[0]


def stored_router_metrics(row: dict[str, Any], layers: list[tuple[int, int]]) -> RouterMetrics:
    """A bundle's `RouterMetrics` from its stored mismatch sums (catalog row of
    ``mismatch_metrics``, its ``mismatch_layers``), as `compute_router_metrics` would
    give on the payloads: the same counts, codes and nulls (router-metrics.md)."""
    from trajstore.router.metrics import RouterCounts, _finish

    counts = RouterCounts(valid_tokens=int(row["mask_tokens"] or 0))
    codes: set[str] = set()
    route = _code(row["route_error"])
    if route in ("no_router_config", "missing_route"):
        codes.add("missing_route")
    elif route is not None:
        codes.add(route)
    else:
        counts.routes_measured = True
        counts.top_k = int(row["route_top_k"])
        counts.valid_token_layers = int(row["route_valid_token_layers"])
        counts.route_mismatches = int(row["route_mismatches"])
        counts.missing_slots = int(row["route_missing_slots"])
        counts.mismatched_tokens = int(row["route_mismatched_tokens"])
        counts.per_layer_mismatches = [m for m, _ in layers]
        counts.per_layer_valid_token_layers = [o for _, o in layers]
    lp = _code(row["train_error"])
    if lp == "missing_logprob":
        if "neither" not in row["train_error"]:
            codes.add("logprob_length_mismatch")  # one side only has no length R
    elif lp in ("logprob_length_mismatch", "non_finite_logprob"):
        codes.add(lp)
    elif lp in (None, "empty_response_mask"):
        counts.logprob_measured = True
        counts.f_tau_2_count = int(row["train_gt_ln2"] or 0)
        counts.kl_k1_sum = -float(row["train_d_sum"] or 0.0) + 0.0
        counts.kl_k3_sum = float(row["train_k3_sum"] or 0.0)
        counts.logprob_abs_diff_sum = float(row["train_abs_dlogp_sum"] or 0.0)
    return _finish(counts, codes, None)


def compare_stored(
    store: Any,
    runs: Sequence[str],
    steps: Collection[tuple[int, int]] | None = None,
) -> RunComparison:
    """`compare_store` from the sums the store computed when it stored each bundle (no
    payload is read; a bundle stored without sums is recomputed from its payloads).

    The producer's stability counters and recorded metrics still come from each
    bundle's expected.json (a document, read only for bundles that recorded some)."""
    import sqlalchemy as sa

    from trajstore.errors import UsageError, check_known_run
    from trajstore.schema import Manifest

    if len(runs) < 2:
        raise UsageError("router compare needs at least two --run")
    twice = sorted({run for run in runs if runs.count(run) > 1})
    if twice:
        raise UsageError(f"router compare: run {twice[0]!r} given more than once")
    known = {r["run"] for r in store.runs()}
    cells: dict[tuple[str, tuple[int, int]], StepMetrics] = {}
    wanted = None if steps is None else set(steps)
    for run in runs:
        check_known_run(run, known)
        with store.catalog() as cat, cat.connect() as conn:
            rows = [dict(r._mapping) for r in conn.execute(sa.text(_STORED_SQL), {"run": run})]
            layers: dict[str, list[tuple[int, int]]] = {}
            for r in conn.execute(sa.text(_LAYERS_SQL), {"run": run}):
                layers.setdefault(r.bundle_key, []).append((int(r.mismatches), int(r.observations)))
        by_step: dict[tuple[int, int], list[dict[str, Any]]] = {}
        for row in rows:
            step = (int(row["rollout_id"]), int(row["step_id"]))
            if wanted is None or step in wanted:
                by_step.setdefault(step, []).append(row)
        for (rid, sid), members in sorted(by_step.items()):
            if any(_code(m["route_error"]) in _UNSTORED for m in members):
                cells[(run, (rid, sid))] = step_metrics(store.step(run, rid, sid), run, rid, sid)
                continue
            per_rank = [stored_router_metrics(m, layers.get(m["bundle_key"], [])) for m in members]
            stability: dict[str, int] = {}
            disagrees = False
            for m, metrics in zip(members, per_rank, strict=True):
                if not m["recorded"]:
                    continue
                recorded = store.load_document(m["expected_hash"]).get(STAGE)
                disagrees |= _add_recorded(
                    recorded,
                    metrics,
                    lambda m=m: Manifest.from_dict(store.load_document(m["manifest_hash"])),
                    stability,
                )
            mode = members[0]["mode"]
            cells[(run, (rid, sid))] = StepMetrics(
                run, rid, sid, aggregate(per_rank), mode, stability, disagrees
            )
    return RunComparison(list(runs), cells)


def disagreements(a: RunComparison, b: RunComparison) -> list[str]:
    """Where two comparisons of the same runs differ (stored vs recomputed): one line each.
    Counts compare exactly, rates within 1e-9 relative (sums added in another order)."""
    out: list[str] = []
    for key in sorted(set(a.cells) | set(b.cells)):
        x, y = a.cells.get(key), b.cells.get(key)
        where = f"run {key[0]} step {key[1][0]}:{key[1][1]}"
        if x is None or y is None:
            out.append(f"{where}: only in the {'recomputed' if x is None else 'stored'} metrics")
            continue
        dx, dy = x.metrics.to_dict(), y.metrics.to_dict()
        for name in dx:
            u, v = dx[name], dy[name]
            if isinstance(u, list) and isinstance(v, list) and name == "per_layer_mismatch":
                same = len(u) == len(v) and all(_close(p, q) for p, q in zip(u, v, strict=True))
            elif isinstance(u, list) or isinstance(v, list):
                same = sorted(u or []) == sorted(v or [])
            else:
                same = _close(u, v)
            if not same:
                out.append(f"{where}: {name} stored {u!r}, recomputed {v!r}")
        if (x.stability, x.recorded_disagrees) != (y.stability, y.recorded_disagrees):
            out.append(f"{where}: producer counters differ")
    return out


def _close(u: Any, v: Any) -> bool:
    if u is None or v is None:
        return u is None and v is None
    return math.isclose(u, v, rel_tol=1e-9, abs_tol=1e-12)
