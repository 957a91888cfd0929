"""`trajstore router metrics` and `trajstore router compare` (router-metrics.md).

Metrics are always printed with their denominators, and a null metric prints
as ``null`` (text) / ``null`` (JSON): an empty mask or a bad route tensor
must never read as a perfect 0. Exit codes: 0 when the metrics were computed
(metric_error codes are data, reported in the output), 2 when a target is
invalid (integrity gate, missing config.router) or the usage is wrong.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from trajstore.cli._common import add_catalog_arg, print_json, target_selector


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="MoE route consistency: per-bundle metrics, run comparison")
    rsub = p.add_subparsers(dest="router_command", metavar="SUBCOMMAND")
    p.set_defaults(func=lambda args: _usage(p))

    m = rsub.add_parser(
        "metrics",
        help="route mismatch and log-prob drift of a bundle, cohort or capture directory",
        description="Per bundle and per layer, on masked response tokens, with denominators. "
        "A capture directory without --step/--rollout reports every bundle in it; "
        "--store DIR --run NAME --step R:S reads a step from a store instead.",
    )
    m.add_argument("target", nargs="?", default=None, help="bundle, cohort or capture directory")
    sel = m.add_mutually_exclusive_group()
    sel.add_argument("--step", metavar="R:S", help="actor step id (capture directory or store)")
    sel.add_argument("--rollout", metavar="R", help="rollout id (capture directory or store)")
    m.add_argument("--store", default=None, help="read from a store instead of a directory")
    add_catalog_arg(m)
    m.add_argument("--run", default=None, help="run name in the store (with --store)")
    m.add_argument("--json", action="store_true", help="machine-readable output")
    m.set_defaults(func=cmd_metrics)

    c = rsub.add_parser(
        "compare",
        help="runs side by side per step, ratio ranges, stability counters",
        description="Compare every step's metrics of each run, read from the sums the store "
        "computed when it stored the bundles (docs/mismatch.md); ratios are each run divided "
        "by the LAST --run. --recompute also recomputes them from the payloads and exits 1 "
        "unless both agree.",
    )
    c.add_argument("--store", default=None, help="store directory (or TRAJSTORE_STORE)")
    add_catalog_arg(c)
    c.add_argument("--run", action="append", required=True, help="a run; give two or more")
    c.add_argument("--format", choices=("table", "json", "csv"), default="table")
    c.add_argument("--json", action="store_true", help="same as --format json")
    c.add_argument("--plot", metavar="FILE.png", default=None, help="write per-step curves")
    c.add_argument(
        "--recompute",
        action="store_true",
        help="also recompute every step from its payloads; exit 1 unless both agree",
    )
    c.set_defaults(func=cmd_compare)


def _usage(p: argparse.ArgumentParser) -> int:
    p.print_help(sys.stderr)
    return 2


def _store_path(args: argparse.Namespace) -> str:
    from trajstore.cli._common import default_store
    from trajstore.errors import UsageError

    path = args.store or default_store()
    if not path:
        raise UsageError("--store DIR is required (or set TRAJSTORE_STORE)")
    return path


# --------------------------------------------------------------------------- metrics


def bundle_report(source: Any) -> dict[str, Any]:
    """One bundle's metrics with numerators and denominators (the --json shape)."""
    from trajstore.router.stage import STAGE, recompute_router_metrics

    m = recompute_router_metrics(source)
    return _report(
        m,
        label=source.label,
        bundle_id=source.manifest.bundle_id,
        rank=source.rank,
        anchor=source.index.identity.anchor,
        router=source.index.config.get("router"),
        recorded=source.expected.get(STAGE),
    )


def _report(m: Any, **ident: Any) -> dict[str, Any]:
    c = m.counts
    routes_ok = m.valid_token_layers is not None
    lp_ok = m.f_tau_2 is not None
    return {
        **ident,
        "metrics": m.to_dict(),
        "denominators": {
            "valid_tokens": m.valid_tokens,
            "valid_token_layers": m.valid_token_layers,
            "valid_slots": c.top_k * m.valid_token_layers if routes_ok else None,
            "per_layer_valid_token_layers": list(c.per_layer_valid_token_layers)
            if routes_ok
            else None,
        },
        "numerators": {
            "route_mismatches": c.route_mismatches if routes_ok else None,
            "missing_slots": c.missing_slots if routes_ok else None,
            "mismatched_tokens": c.mismatched_tokens if routes_ok else None,
            "per_layer_mismatches": list(c.per_layer_mismatches) if routes_ok else None,
            "f_tau_2_count": c.f_tau_2_count if lp_ok else None,
        },
    }


def _fraction(value: Any, num: Any, den: Any, unit: str) -> str:
    from trajstore.router.compare import fmt

    return f"{fmt(value):<12} ({fmt(num)} / {fmt(den)} {unit})"


def format_report(r: dict[str, Any]) -> str:
    """Text form of `bundle_report`: one metric a line, with its denominator."""
    from trajstore.router.compare import fmt

    m, d, n = r["metrics"], r["denominators"], r["numerators"]
    router = r.get("router") or {}
    head = (
        f"{r['label']}  {r['anchor']}  mode={fmt(router.get('mode'))}  "
        f"E={fmt(router.get('num_experts'))} L={fmt(router.get('num_layers'))} "
        f"K={fmt(router.get('top_k'))}"
    )
    lines = [
        head,
        f"  {'valid_tokens':<22}{m['valid_tokens']}",
        f"  {'valid_token_layers':<22}{fmt(m['valid_token_layers'])}",
        f"  {'route_mismatch_rate':<22}"
        + _fraction(
            m["route_mismatch_rate"], n["route_mismatches"], d["valid_token_layers"], "token-layers"
        ),
        f"  {'expert_slot_mismatch':<22}"
        + _fraction(m["expert_slot_mismatch"], n["missing_slots"], d["valid_slots"], "slots"),
        f"  {'token_any_mismatch':<22}"
        + _fraction(m["token_any_mismatch"], n["mismatched_tokens"], d["valid_tokens"], "tokens"),
        f"  {'f_tau_2':<22}"
        + _fraction(m["f_tau_2"], n["f_tau_2_count"], d["valid_tokens"], "tokens"),
    ]
    for name in ("kl_k1", "kl_k3", "logprob_abs_diff"):
        lines.append(f"  {name:<22}{fmt(m[name]):<12} (mean over {d['valid_tokens']} tokens)")
    per_layer = m["per_layer_mismatch"]
    if per_layer is None:
        lines.append(f"  {'per_layer_mismatch':<22}null")
    else:
        lines.append("  per_layer_mismatch (route_mismatch_rate of each layer):")
        for i, v in enumerate(per_layer):
            lines.append(
                f"    layer {i:<4}"
                + _fraction(
                    v,
                    n["per_layer_mismatches"][i],
                    d["per_layer_valid_token_layers"][i],
                    "token-layers",
                )
            )
    lines.append(f"  {'metric_error':<22}{', '.join(m['metric_error']) or 'none'}")
    return "\n".join(lines)


def _directory_sources(args: argparse.Namespace) -> list[tuple[str, list[Any]]]:
    from trajstore.bundle.capture_dir import list_capture, resolve_target
    from trajstore.bundle.reader import open_target
    from trajstore.errors import UsageError

    if args.target is None:
        raise UsageError("router metrics needs a bundle, cohort or capture directory (or --store)")
    sel = target_selector(args)
    path = Path(args.target)
    if sel["step"] is None and sel["rollout"] is None and path.is_dir() and list_capture(path):
        targets = list_capture(path)
    else:
        targets = [resolve_target(path, **sel)]
    return [(str(t), open_target(t).bundles) for t in targets]


def _store_sources(args: argparse.Namespace) -> list[tuple[str, list[Any]]]:
    from trajstore.errors import UsageError
    from trajstore.store import Store

    sel = target_selector(args)
    if args.run is None or (sel["step"] is None and sel["rollout"] is None):
        raise UsageError("with --store, give --run NAME and --step R:S or --rollout R")
    store = Store.open(_store_path(args), create=False, catalog_url=args.catalog)
    if sel["step"] is not None:
        rid, sid = sel["step"]
        return [(f"{args.run} step {rid}:{sid}", store.step(args.run, rid, sid))]
    return [(f"{args.run} rollout {sel['rollout']}", store.rollout(args.run, sel["rollout"]))]


def cmd_metrics(args: argparse.Namespace) -> int:
    from trajstore.router.metrics import aggregate
    from trajstore.router.stage import recompute_router_metrics

    groups = _store_sources(args) if args.store else _directory_sources(args)
    out: list[dict[str, Any]] = []
    for label, sources in groups:
        reports = [bundle_report(s) for s in sources]
        entry: dict[str, Any] = {"target": label, "bundles": reports}
        if len(sources) > 1:
            agg = aggregate([recompute_router_metrics(s) for s in sources])
            entry["aggregate"] = _report(
                agg,
                label=f"{label} (all ranks)",
                anchor=reports[0]["anchor"],
                router=reports[0]["router"],
            )
        out.append(entry)
    if args.json:
        print_json(out[0] if len(out) == 1 else out)
        return 0
    blocks = []
    for entry in out:
        blocks += [format_report(r) for r in entry["bundles"]]
        if "aggregate" in entry:
            blocks.append(format_report(entry["aggregate"]))
    print("\n\n".join(blocks))
    return 0


# --------------------------------------------------------------------------- compare


def cmd_compare(args: argparse.Namespace) -> int:
    from trajstore.router.compare import compare_store, compare_stored, disagreements
    from trajstore.store import Store

    if args.plot:  # refused before the comparison is computed, not after
        from trajstore.router.plot import plot_path

        plot_path(args.plot)
    store = Store.open(_store_path(args), create=False, catalog_url=args.catalog)
    cmp = compare_stored(store, args.run)
    if args.recompute:  # every step again from its payloads: both must agree
        differ = disagreements(cmp, compare_store(store, args.run))
        if differ:
            more = f" (+{len(differ) - 1} more)" if len(differ) > 1 else ""
            print(
                f"trajstore: stored and recomputed metrics disagree: {differ[0]}{more}",
                file=sys.stderr,
            )
            return 1
    fmt = "json" if args.json else args.format
    if fmt == "json":
        print_json(cmp.to_dict())
    elif fmt == "csv":
        sys.stdout.write(cmp.to_csv())
    else:
        print(cmp.format_table())
    if args.plot:
        from trajstore.router.plot import plot_comparison

        plot_comparison(cmp, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0
