"""`trajstore query mismatch`: training-inference mismatch over a run's steps.

Reads the sums the store computed when each bundle was stored (docs/mismatch.md); no
payload is read, so a 10,000-step run answers from the catalog alone. Exit codes: 0
listed (or nothing above the --fail-above bound), 1 a selected step is above
--fail-above, 2 bad arguments or an unknown run/metric.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any


def number(text: str) -> float:
    """argparse type of the thresholds: any finite number (a metric can be negative)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def add_args(p: argparse.ArgumentParser) -> None:
    """The mismatch options of `trajstore query` (see docs/cli.md)."""
    p.add_argument(
        "--metric",
        metavar="NAME",
        help="mismatch: the metric (default route_mismatch_rate; docs/mismatch.md lists them)",
    )
    p.add_argument("--above", type=number, metavar="X", help="mismatch: steps whose value > X")
    p.add_argument("--top", type=int, metavar="N", help="mismatch: the N largest values")
    p.add_argument("--layer", type=int, metavar="L", help="mismatch: route mismatch at layer L")
    p.add_argument(
        "--first-above",
        type=number,
        metavar="X",
        help="mismatch: the first step (in step order) whose value > X: since when",
    )
    p.add_argument(
        "--fail-above",
        type=number,
        metavar="X",
        help="mismatch: exit 1 when any selected step's value is > X (an alert)",
    )
    p.add_argument("--plot", metavar="FILE.png", help="mismatch: draw the values over steps")
    p.add_argument("--json", action="store_true", help="same as --format json")
    # (refused with any other `query` listing: cmd_query)


def _worst_cell(w: dict[str, Any] | None) -> str:
    if not w:
        return ""
    return f"{w['sample_id']}@{w['offset']} {w['pair']} {w['rollout']:.4g}->{w['trainer']:.4g}"


def _step(row: dict[str, Any]) -> str:
    if row["kind"] == "rollout":
        return f"rollout-{row['rollout_id']}"
    return f"{row['rollout_id']}:{row['step_id']}"


def cmd_mismatch(args: argparse.Namespace, cat: Any, emit_rows: Any) -> int:
    """`query mismatch` over an open catalog reader; `emit_rows` is query's table/csv
    writer (passed in: query_cmds imports this module)."""
    from trajstore.errors import UsageError
    from trajstore.mismatch.metrics import DEFAULT_METRIC
    from trajstore.mismatch.query import MismatchQuery

    if args.run is None:
        raise UsageError("query mismatch needs --run RUN")
    filters = ("above", "top", "layer", "rollout_from", "rollout_to", "first_above")
    q = MismatchQuery(
        run=args.run,
        metric=args.metric or DEFAULT_METRIC,
        **{name: getattr(args, name) for name in filters},
    )
    plot = None
    if args.plot:
        from trajstore.router.plot import plot_path

        plot = plot_path(args.plot)
    rows = cat.mismatch(q, limit=args.limit or None)  # --limit 0: every row
    failed = args.fail_above is not None and any(
        r["value"] is not None and r["value"] > args.fail_above for r in rows
    )
    if args.format == "json":
        from trajstore.cli._common import print_json

        print_json(rows)
    elif args.first_above is not None and not rows:
        print(f"no step of run {args.run} has {q.metric} > {args.first_above:g}")
    else:
        _table(rows, q.metric, args.format, emit_rows)
    if plot is not None:
        _plot(rows, q, plot)
    if failed:
        over = [r for r in rows if r["value"] is not None and r["value"] > args.fail_above]
        sys.stderr.write(
            f"trajstore: {len(over)} step(s) of run {args.run} have {q.metric} > "
            f"{args.fail_above:g} (first {_step(over[0])}: {over[0]['value']:.6g})\n"
        )
        return 1
    return 0


def _table(rows: list[dict[str, Any]], metric: str, fmt: str, emit_rows: Any) -> None:
    shown = [
        {
            "step": _step(r),
            "attempt": r["attempt"],
            "ranks": r["ranks"],
            metric: r["value"],
            "tokens": r["tokens"],
            "worst_token": _worst_cell(r["worst"]),
            "worst_bundle": (r["worst"] or {}).get("bundle_key"),
            "reason": r["reason"],
        }
        for r in rows
    ]
    columns = [
        "step",
        "attempt",
        "ranks",
        metric,
        "tokens",
        "worst_token",
        "worst_bundle",
        "reason",
    ]
    emit_rows(shown, columns, fmt)


def _plot(rows: list[dict[str, Any]], q: Any, path: Any) -> None:
    """The values over steps (a null step is a gap, never 0); matplotlib, imported here."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ordered = sorted(rows, key=lambda r: (r["rollout_id"], r["step_id"] or -1, r["kind"]))
    xs = list(range(len(ordered)))
    ys = [float("nan") if r["value"] is None else r["value"] for r in ordered]
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.plot(xs, ys, marker="o", markersize=2)
    ax.set_ylabel(q.metric + (f" (layer {q.layer})" if q.layer is not None else ""))
    every = max(1, len(xs) // 12)
    ax.set_xticks(xs[::every])
    ax.set_xticklabels([_step(r) for r in ordered][::every], fontsize=7, rotation=45)
    ax.set_xlabel("step (rollout_id:step_id)")
    ax.grid(True, alpha=0.3)
    ax.set_title(f"run {q.run}: {q.metric}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
