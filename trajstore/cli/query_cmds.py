"""`trajstore query`, `trajstore sql`, `trajstore diff`: asking across steps."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from trajstore.cli._catalog import TABLE_ROWS
from trajstore.cli._common import (
    add_catalog_arg,
    default_store,
    error_bound,
    print_json,
    rollout_id,
)
from trajstore.cli.mismatch_cmd import add_args as add_mismatch_args
from trajstore.vocab import STEP_STATUSES

FORMATS = ("table", "json", "csv")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "query", help="steps, bundles, divergences, routes or mismatch across a store"
    )
    p.add_argument("what", choices=["steps", "bundles", "divergences", "routes", "mismatch"])
    p.add_argument(
        "--store",
        metavar="DIR",
        default=default_store(),
        help="store directory (env TRAJSTORE_STORE)",
    )
    add_catalog_arg(p)
    p.add_argument("--run", help="only this run")
    p.add_argument("--rollout-from", type=rollout_id, metavar="R")
    p.add_argument("--rollout-to", type=rollout_id, metavar="R")
    p.add_argument(
        "--from", dest="rollout_from", type=rollout_id, metavar="R", help="= --rollout-from"
    )
    p.add_argument("--to", dest="rollout_to", type=rollout_id, metavar="R", help="= --rollout-to")
    p.add_argument(
        "--first-divergent-stage",
        metavar="S",
        help="steps: whose latest verdict diverged first at S",
    )
    p.add_argument(
        "--status",
        choices=STEP_STATUSES,
        help="steps: latest verdict, or unreplayed (no result recorded)",
    )
    p.add_argument("--stage", metavar="S", help="divergences: at this stage")
    p.add_argument("--min-abs-err", type=error_bound, metavar="X", help="divergences: abs_err >= X")
    p.add_argument("--sample", metavar="ID", help="divergences: of this sample")
    p.add_argument("--kind", choices=["step", "rollout"], help="bundles: only this kind")
    p.add_argument(
        "--source",
        choices=["producer", "replay"],
        help="routes: metrics the producer recorded, or those replay --record recomputed",
    )
    p.add_argument(
        "--all-attempts", action="store_true", help="bundles: every attempt, not only the latest"
    )
    p.add_argument(
        "--limit",
        type=int,
        metavar="N",
        help=f"at most N rows; 0: every row (default: a table shows the first {TABLE_ROWS}, "
        "csv and json every row)",
    )
    p.add_argument("--format", choices=FORMATS, default="table")
    add_mismatch_args(p)
    p.set_defaults(func=cmd_query)

    p = sub.add_parser(
        "sql", help="read-only SQL over the catalog (docs/catalog.md lists the tables)"
    )
    p.add_argument(
        "sql", help="one read-only statement (SELECT, WITH, EXPLAIN, DESCRIBE, SHOW, ...)"
    )
    p.add_argument("--store", metavar="DIR", default=default_store())
    add_catalog_arg(p)
    p.add_argument("--format", choices=FORMATS, default="table")
    p.set_defaults(func=cmd_sql)

    p = sub.add_parser(
        "diff",
        help="first differing payload, sample and token between two bundles",
        description=(
            "Each side is a bundle/cohort directory, or with --store a stored step: "
            "RUN/R:S[@ATTEMPT], RUN/rollout-R[@ATTEMPT] or a bundle key."
        ),
    )
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--store", metavar="DIR", default=default_store())
    add_catalog_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_diff)


def _need_store(args: argparse.Namespace):  # noqa: ANN202
    from trajstore.errors import UsageError
    from trajstore.store import Store

    if not args.store:
        raise UsageError("--store DIR is required (or set TRAJSTORE_STORE)")
    return Store.open(args.store, create=False, catalog_url=args.catalog)


def _catalog_reader(args: argparse.Namespace):  # noqa: ANN202
    """The store's synced catalog, without importing the store's object layer."""
    from trajstore.cli._catalog import catalog_reader
    from trajstore.errors import UsageError

    if not args.store:
        raise UsageError("--store DIR is required (or set TRAJSTORE_STORE)")
    return catalog_reader(args.store, args.catalog)


def emit_rows(rows: list[dict[str, Any]], columns: list[str], fmt: str) -> None:
    if fmt == "json":
        print_json(rows)
        return
    if fmt == "csv":
        import csv

        w = csv.writer(sys.stdout)
        w.writerow(columns)
        for r in rows:
            w.writerow(["" if r.get(c) is None else _cell(r.get(c), c) for c in columns])
        return
    if not rows:
        print("(no rows)")
        return
    # column by column, then one write: the same bytes as a print of each ljust-ed row,
    # at a fraction of the cost for 10,000 rows
    # a table is read by a person: nothing there (null, no ranks, no error codes) is a blank
    by_column = [
        [
            v if type(v) is str else "" if v is None or v == [] else _cell(v, c)
            for v in [r.get(c) for r in rows]
        ]
        for c in columns
    ]
    widths = [max(len(c), *map(len, cells)) for c, cells in zip(columns, by_column, strict=True)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [line.format(*columns), *(line.format(*row) for row in zip(*by_column, strict=True))]
    sys.stdout.write("\n".join(out) + "\n")


#: columns of compared values: printed to round-trip (two different values never print the same)
EXACT_COLUMNS = frozenset({"expected", "actual"})


def _cell(v: Any, column: str = "") -> str:
    t = type(v)
    if t is str:  # the common cases first: 10,000 rows make 100,000 cells
        return v
    if t is int:
        return str(v)
    if t is list and all(type(x) is int for x in v):  # ranks: json.dumps' own spelling
        return "[" + ", ".join(map(str, v)) + "]"
    if v is None:
        return "null"
    if isinstance(v, float):
        return repr(v) if column in EXACT_COLUMNS else f"{v:.6g}"
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return str(v)


STEP_COLUMNS = [
    "run",
    "rollout_id",
    "step_id",
    "attempt",
    "ranks",
    "status",
    "first_divergent_stage",
    "first_divergent_rank",
    "root_bundle_key",
    "recorded_at",
]
BUNDLE_COLUMNS = [
    "key",
    "run",
    "kind",
    "rollout_id",
    "step_id",
    "rank",
    "attempt",
    "num_samples",
    "logical_bytes",
    "published_at",
]
DIVERGENCE_COLUMNS = [
    "run",
    "rollout_id",
    "step_id",
    "bundle_key",
    "stage",
    "sample_id",
    "field",
    "token_offset",
    "expected",
    "actual",
    "abs_err",
]
ROUTE_COLUMNS = [
    "run",
    "rollout_id",
    "step_id",
    "source",
    "route_mismatch_rate",
    "token_any_mismatch",
    "f_tau_2",
    "kl_k3",
    "logprob_abs_diff",
    "valid_token_layers",
    "metric_error",
]


def cmd_query(args: argparse.Namespace) -> int:
    from trajstore.cli._catalog import check_run, left_out_line, listed
    from trajstore.errors import UsageError

    if args.limit is not None and args.limit < 0:
        raise UsageError("--limit must be >= 0 (0: every row)")
    if (
        args.rollout_from is not None
        and args.rollout_to is not None
        and args.rollout_from > args.rollout_to
    ):
        raise UsageError("--rollout-from is after --rollout-to")
    if args.json:
        args.format = "json"
    if args.what != "mismatch":
        for name in ("metric", "above", "top", "layer", "first_above", "fail_above", "plot"):
            if getattr(args, name) is not None:
                flag = "--" + name.replace("_", "-")
                raise UsageError(f"{flag} applies to query mismatch only")
    rng = {"rollout_from": args.rollout_from, "rollout_to": args.rollout_to}
    # table and csv print only their columns; json prints whole rows
    projected = args.format != "json"
    with _catalog_reader(args) as cat:
        check_run(cat, args.run)
        if args.what == "mismatch":
            from trajstore.cli.mismatch_cmd import cmd_mismatch

            return cmd_mismatch(args, cat, emit_rows)
        if args.what == "steps":
            what, cols = "steps", STEP_COLUMNS
            kw: dict[str, Any] = {
                "columns": tuple(STEP_COLUMNS) if projected else None,
                "first_divergent_stage": args.first_divergent_stage,
                "status": args.status,
            }
        elif args.what == "bundles":
            what, cols = "bundles", BUNDLE_COLUMNS
            kw = {
                "columns": tuple(BUNDLE_COLUMNS) if projected else None,
                "kind": args.kind,
                "include_all_attempts": args.all_attempts,
            }
        elif args.what == "divergences":
            what, cols = "divergences", DIVERGENCE_COLUMNS
            kw = {"stage": args.stage, "min_abs_err": args.min_abs_err, "sample_id": args.sample}
        else:
            what, cols = "router_metrics", ROUTE_COLUMNS
            kw = {"source": args.source}
        table = args.format == "table"
        rows, more = listed(cat, what, args.limit, table, run=args.run, **kw, **rng)
    emit_rows(rows, [c for c in cols if not rows or c in rows[0]] or cols, args.format)
    if more:
        print(left_out_line(more, args.limit is not None, "--format csv or json"), file=sys.stderr)
    return 0


def cmd_sql(args: argparse.Namespace) -> int:
    with _catalog_reader(args) as cat:
        columns, rows = cat.readonly_sql(args.sql)
    emit_rows([dict(zip(columns, r, strict=True)) for r in rows], columns, args.format)
    return 0


def _side(spec: str, args: argparse.Namespace) -> tuple[list[Any], str]:
    """Sources of one diff side and its label."""
    import re

    from trajstore.bundle.reader import open_target
    from trajstore.errors import UsageError

    path = Path(spec)
    if path.exists():
        bset = open_target(path)
        return bset.bundles, spec
    if not args.store:
        raise UsageError(f"{spec!r} is not a directory; a stored side needs --store DIR")
    store = _need_store(args)
    m = re.match(r"^([A-Za-z0-9._-]+)/(?:(\d+):(\d+)|rollout-(\d+))(?:@(\d+))?$", spec)
    if m:
        run, r, s, rollout, attempt = m.groups()
        att = int(attempt) if attempt else None
        if r is not None:
            return store.step(run, int(r), int(s), attempt=att), spec
        return store.rollout(run, int(rollout), attempt=att), spec
    return [store.bundle(spec)], spec


def cmd_diff(args: argparse.Namespace) -> int:
    from trajstore.diff import DiffReport, diff_sources
    from trajstore.errors import UsageError

    a, la = _side(args.a, args)
    b, lb = _side(args.b, args)
    if len(a) != len(b):
        raise UsageError(f"{la} has {len(a)} rank(s), {lb} has {len(b)}; cannot pair them")
    reports: list[DiffReport] = [
        diff_sources(
            x,
            y,
            a_label=f"{la}" + (f"[rank {x.rank}]" if len(a) > 1 else ""),
            b_label=f"{lb}" + (f"[rank {y.rank}]" if len(b) > 1 else ""),
        )
        for x, y in zip(a, b, strict=True)
    ]
    if args.json:
        print_json(reports[0].to_dict() if len(reports) == 1 else [r.to_dict() for r in reports])
    else:
        print("\n".join(r.format() for r in reports))
    return 0 if all(r.same for r in reports) else 1
