"""Store commands: ingest, export, ls, stats, fsck, rm, gc, reindex (each takes --store DIR)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from trajstore.cli._catalog import TABLE_ROWS
from trajstore.cli._common import print_json


def _store_arg(p: argparse.ArgumentParser) -> None:
    from trajstore.cli._common import add_catalog_arg, default_store

    p.add_argument(
        "--store",
        default=default_store(),
        metavar="DIR",
        help="store directory (default: $TRAJSTORE_STORE)",
    )
    add_catalog_arg(p)


def _open(args: argparse.Namespace, *, create: bool = False):  # noqa: ANN202
    from trajstore.errors import UsageError
    from trajstore.store import Store

    if not args.store:
        raise UsageError("no store: pass --store DIR or set TRAJSTORE_STORE")
    return Store.open(args.store, create=create, catalog_url=args.catalog)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ingest", help="store bundles/cohorts/capture dirs (deduplicated, idempotent)"
    )
    p.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="bundle, cohort or capture directory; with --from, the framework's dump files, "
        "directories of them, or its path template",
    )
    _store_arg(p)
    p.add_argument("--run", default="default", help="run name (default: default)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--from",
        dest="from_format",
        metavar="FORMAT",
        help="read a framework's own dumps instead of bundles (formats: slime)",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="with --from: the framework's training arguments (slime: a JSON object or its "
        "command-line flags), for replaying its math",
    )
    from trajstore.cli._common import add_executor_args

    add_executor_args(p)
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser("export", help="write a stored bundle back as a bundle directory")
    _store_arg(p)
    sel = p.add_mutually_exclusive_group()
    sel.add_argument("--step", metavar="R:S", help="actor step id")
    sel.add_argument("--rollout", metavar="R", help="rollout id")
    sel.add_argument("--bundle", metavar="KEY", help="bundle key (see trajstore ls)")
    p.add_argument("--run", help="run name (default: default; with --bundle, the key's)")
    p.add_argument("--attempt", type=int, help="attempt number (default: the latest)")
    p.add_argument("--format", type=int, choices=(1, 2), help="format major of the export")
    p.add_argument(
        "--to",
        dest="to_format",
        metavar="FORMAT",
        help="write the framework's own dumps instead of a bundle (formats: slime)",
    )
    p.add_argument("--rollout-from", metavar="R", help="with --to: first rollout of a range")
    p.add_argument("--rollout-to", metavar="R", help="with --to: last rollout of a range")
    p.add_argument(
        "out", metavar="OUT", help="directory to create (with --to: directory to write into)"
    )
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("ls", help="list runs and bundles of a store")
    _store_arg(p)
    p.add_argument("--run", help="only this run")
    p.add_argument("--kind", choices=("step", "rollout"), help="only this kind")
    p.add_argument(
        "--all-attempts", action="store_true", help="list every attempt, not only the latest"
    )
    p.add_argument(
        "--limit",
        type=int,
        metavar="N",
        help="at most N bundles; 0: every bundle (default: the text listing shows the "
        f"first {TABLE_ROWS}, --json every bundle)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("stats", help="logical/physical bytes, dedup ratio, objects, per run")
    _store_arg(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("fsck", help="re-hash every object and check every ref's closure")
    _store_arg(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_fsck)

    p = sub.add_parser("rm", help="remove bundles or a run (tombstones; gc deletes data)")
    _store_arg(p)
    p.add_argument("keys", nargs="*", metavar="KEY", help="bundle keys")
    p.add_argument("--run", help="remove every bundle of this run")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("gc", help="delete unreachable objects older than the grace period")
    _store_arg(p)
    p.add_argument(
        "--grace", default="1h", metavar="DURATION", help="e.g. 30m, 1h, 2d (default 1h)"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("reindex", help="rebuild the catalog from the refs alone")
    _store_arg(p)
    p.set_defaults(func=cmd_reindex)


def _human(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def cmd_ingest(args: argparse.Namespace) -> int:
    from trajstore.errors import UsageError
    from trajstore.store.ingest import IngestOutcome

    done: list[IngestOutcome] = []

    def report(o: IngestOutcome) -> None:
        """Each target's line as soon as it is stored, so an interruption loses none."""
        done.append(o)
        if args.json:
            return
        if o.status == "refused":
            print(f"trajstore: refused: {o.path}: {o.reason}", file=sys.stderr, flush=True)
        else:
            print(f"{o.status:9} {o.path}: {', '.join(o.keys)}", flush=True)

    staged = None
    if args.from_format is not None:
        from trajstore.integrations import formats

        if args.executor == "ray":
            raise UsageError("--from reads the dumps on this host; --executor ray is not for it")
        if not args.store:
            raise UsageError("no store: pass --store DIR or set TRAJSTORE_STORE")
        # every dump read and checked before the store is opened (or made): a refused one
        # leaves nothing behind
        staged = formats.stage(args.from_format, args.paths, run=args.run, config=args.config)
    elif args.config is not None:
        raise UsageError("--config is read with --from FORMAT only")
    else:
        _check_before_opening(args)
    try:
        if args.executor == "ray":
            _ingest_on_ray(args, report)
        else:
            new = _new_local_store(args.store)
            with _open(args, create=True) as store:
                if new:  # a misspelt --store would otherwise fill a fresh store unnoticed
                    print(f"trajstore: created a new store at {args.store}", file=sys.stderr)
                if staged is not None:
                    formats.ingest_staged(store, staged, on_outcome=report)
                else:
                    store.ingest(
                        args.paths,
                        run=args.run,
                        progress=None if not args.json else False,
                        on_outcome=report,
                    )
    except KeyboardInterrupt:
        stored = sum(o.status != "refused" for o in done)
        print(
            f"trajstore: interrupted after {stored} target(s) were stored; "
            "run the same ingest again to store the rest (stored ones are skipped)",
            file=sys.stderr,
        )
        return 130
    finally:
        if staged is not None:
            staged.cleanup()  # the bundles staged from the framework's files
    refused = [o for o in done if o.status == "refused"]
    if args.json:
        print_json([o.to_dict() for o in done])
        for o in refused:
            print(f"trajstore: refused: {o.path}: {o.reason}", file=sys.stderr)
    return 2 if refused else 0


def _check_before_opening(args: argparse.Namespace) -> None:
    """Refuse what no target could get past before the store is opened (and made, when
    new) or Ray started: an invalid --run, paths none of which exist (a typo in the only
    path), executor options that do not go together (ExecutorSpec's checks)."""
    from trajstore.errors import UsageError
    from trajstore.executors import ExecutorSpec
    from trajstore.store.ingest import check_run_name

    check_run_name(args.run)
    if not any(os.path.lexists(p) for p in args.paths):
        missing = ", ".join(str(p) for p in args.paths)
        raise UsageError(f"nothing to ingest: no such file or directory: {missing}")
    ExecutorSpec(args.executor, None, args.ray_address)


def _new_local_store(path: str | None) -> bool:
    """Whether ingest is about to create the store at `path`: the test `Store.open` makes
    before it creates one (a directory, not yet a store)."""
    from trajstore.store.api import is_remote
    from trajstore.store.layout import StoreLayout

    return bool(path) and not is_remote(path) and not StoreLayout(Path(path)).is_store()


def _ingest_on_ray(args: argparse.Namespace, report: Any) -> None:
    """Each target is one Ray task that reads its directory and writes straight to the store."""
    from trajstore.errors import UsageError
    from trajstore.executors import ExecutorSpec
    from trajstore.store.ingest_batch import ingest_on_executor

    if not args.store:
        raise UsageError("no store: pass --store DIR or set TRAJSTORE_STORE")
    ingest_on_executor(
        args.store,
        args.paths,
        args.run,
        ExecutorSpec("ray", None, args.ray_address),
        catalog_url=getattr(args, "catalog", None),
        on_outcome=report,
    )


def cmd_export(args: argparse.Namespace) -> int:
    from trajstore.bundle.capture_dir import parse_rollout, parse_step
    from trajstore.errors import UsageError
    from trajstore.store.export import export_bundles

    if args.to_format is not None:
        return _export_to(args)
    if args.rollout_from is not None or args.rollout_to is not None:
        raise UsageError("--rollout-from / --rollout-to go with --to FORMAT")
    if not (args.step or args.rollout or args.bundle):
        raise UsageError("one of the arguments --step --rollout --bundle is required")
    run = args.run or "default"  # None: not given, which --bundle must know
    with _open(args) as store:
        if args.bundle:
            b = store.bundle(args.bundle, args.run, args.attempt)
            if b.ref.get("cohort_ranks") is None:
                bundles = [b]
            else:
                kind, r, s = b.ref["kind"], b.ref["rollout_id"], b.ref["step_id"]
                bundles = store._group(b.ref["run"], kind, r, s, b.attempt)
        elif args.step:
            bundles = store.step(run, *parse_step(args.step), attempt=args.attempt)
        else:
            bundles = store.rollout(run, parse_rollout(args.rollout), attempt=args.attempt)
        out = export_bundles(bundles, args.out, format_major=args.format)
    print(f"exported {', '.join(b.bundle_key for b in bundles)} -> {out}")
    return 0


def _export_to(args: argparse.Namespace) -> int:
    """`export --to FORMAT OUT_DIR`: stored rollouts written as the framework's own files."""
    from trajstore.bundle.capture_dir import parse_rollout
    from trajstore.errors import UsageError
    from trajstore.integrations import formats

    if args.step or args.bundle or args.format is not None or args.attempt is not None:
        raise UsageError(
            "--to writes whole rollouts (their latest attempts): use --rollout R or "
            "--rollout-from R --rollout-to R, without --step, --bundle, --format, --attempt"
        )
    if args.rollout is not None:
        if args.rollout_from is not None or args.rollout_to is not None:
            raise UsageError("--rollout and --rollout-from/--rollout-to: give one of them")
        first = last = parse_rollout(args.rollout)
    elif args.rollout_from is not None and args.rollout_to is not None:
        first, last = parse_rollout(args.rollout_from), parse_rollout(args.rollout_to)
        if first > last:
            raise UsageError(f"--rollout-from {first} is after --rollout-to {last}")
    else:
        raise UsageError("--to needs --rollout R, or --rollout-from R and --rollout-to R")
    formats.load_format(args.to_format)  # an unknown format before the store is opened
    with _open(args, create=False) as store:
        written = formats.export_to(
            args.to_format, store, run=args.run or "default", rollouts=(first, last), out=args.out
        )
    for path in written:
        print(f"wrote {path}")
    return 0


#: what the text listing of `ls` prints (its JSON has every column)
LS_COLUMNS = ("key", "bundle_id", "num_samples", "logical_bytes", "is_latest")


def cmd_ls(args: argparse.Namespace) -> int:
    # the catalog alone: the object layer (numpy, zstandard, ...) is not imported
    from trajstore.cli._catalog import catalog_reader, check_run, left_out_line, listed
    from trajstore.errors import UsageError

    if not args.store:
        raise UsageError("no store: pass --store DIR or set TRAJSTORE_STORE")
    if args.limit is not None and args.limit < 0:
        raise UsageError("--limit must be >= 0 (0: every bundle)")
    with catalog_reader(args.store, args.catalog) as reader:
        check_run(reader, args.run)
        rows, more = listed(
            reader,
            "bundles",
            args.limit,
            not args.json,
            run=args.run,
            kind=args.kind,
            include_all_attempts=args.all_attempts,
            columns=None if args.json else LS_COLUMNS,
        )
    if args.json:
        print_json(rows)
        return 0
    lines = [f"{'key':48} {'bundle_id':20} {'samples':>7} {'logical':>10} latest"]
    lines += [
        f"{r['key']:48} {str(r['bundle_id']):20} {r['num_samples']:>7} "
        f"{_human(r['logical_bytes']):>10} {'yes' if r['is_latest'] else 'no'}"
        for r in rows
    ]
    sys.stdout.write("\n".join(lines) + "\n")  # one write: 10,000 prints cost ~30 ms
    if more:
        print(left_out_line(more, args.limit is not None, "--json"), file=sys.stderr)
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from trajstore.store.maintenance import stats

    with _open(args) as store:
        s = stats(store)
    if args.json:
        print_json(s)
        return 0
    print(
        f"{'run':20} {'bundles':>7} {'logical':>11} {'physical':>12} {'dedup':>6} "
        f"{'route B/tok-layer':>17}"
    )
    for r in s["runs"]:
        rb = r.get("route_bytes_per_token_layer")
        # physical: what the run's bundles added at ingest; unknown for older refs
        unknown = r["physical_bytes"] is None
        phys = "not recorded" if unknown else _human(r["physical_bytes"])
        dedup = "-" if unknown else f"{r['dedup_ratio'] or 0:.2f}"
        print(
            f"{r['run']:20} {r['bundles']:>7} {_human(r['logical_bytes']):>11} "
            f"{phys:>12} {dedup:>6} {'-' if rb is None else f'{rb:.3f}':>17}"
        )
    print(
        f"{'(store)':20} {s['bundles']:>7} {_human(s['logical_bytes']):>11} "
        f"{_human(s['physical_bytes']):>12} "
        f"{s['dedup_ratio'] or 0:>6.2f}   objects {s['objects']}, stored "
        f"{_human(s['stored_bytes'])}, "
        f"garbage {_human(s['garbage_bytes'])}"
    )
    return 0


def cmd_fsck(args: argparse.Namespace) -> int:
    from trajstore.store.maintenance import fsck

    with _open(args) as store:
        rep = fsck(store)
    if args.json:
        print_json(rep.to_dict())
    else:
        print(
            f"checked {rep.objects_checked} objects, {rep.refs_checked} refs: "
            f"{'ok' if rep.ok else 'PROBLEMS'}"
        )
        for w in rep.warnings:
            print(f"  warning: {w}")
    for p in rep.problems:
        print(f"trajstore: fsck: {p}", file=sys.stderr)
    return 0 if rep.ok else 2


def cmd_rm(args: argparse.Namespace) -> int:
    from trajstore.errors import UsageError

    if not args.keys and not args.run:
        raise UsageError("rm needs bundle KEYs or --run NAME")
    with _open(args) as store:
        removed = store.remove(args.keys, run=args.run)
    for k in removed:
        print(f"removed {k}")
    print(f"{len(removed)} bundle(s) removed; run `trajstore gc` to free their space")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from trajstore.store.maintenance import check_cli_grace, gc, parse_duration

    grace = parse_duration(args.grace)
    with _open(args) as store:
        check_cli_grace(store, grace)  # S3: no lock against writers, so no grace under 10m
        res = gc(store, grace)
    if args.json:
        print_json(res)
    else:
        print(
            f"gc: dropped {res['objects_dropped']} objects, freed {_human(res['bytes_freed'])} "
            f"({res['live_objects']} live objects kept, grace {args.grace})"
        )
    return 0


def cmd_reindex(args: argparse.Namespace) -> int:
    with _open(args) as store:
        s = store.reindex()
    if s["moved_aside"]:
        print(
            f"trajstore: the catalog could not be read ({s['reason']}): moved aside to "
            f"{s['moved_aside']} and rebuilt from the refs",
            file=sys.stderr,
        )
    print(
        f"reindexed: {s['new_refs']} refs, {s['new_tombstones']} tombstones, "
        f"{s['new_results']} results"
    )
    return 0
