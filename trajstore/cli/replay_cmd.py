"""`trajstore replay`: recompute the stage chain and name the first divergence."""

from __future__ import annotations

import argparse
from pathlib import Path

from trajstore.cli._common import (
    add_catalog_arg,
    default_store,
    print_json,
    rollout_id,
    target_selector,
)


def add_selection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stage", default="all", help="all, or a comma list of stages that count")
    p.add_argument(
        "--sample", action="append", default=[], metavar="ID", help="select a sample (repeatable)"
    )
    p.add_argument(
        "--group", action="append", default=[], metavar="g-N", help="select a semantic group"
    )
    p.add_argument(
        "--batch", action="append", default=[], metavar="mb-NNNN", help="select a micro-batch"
    )
    p.add_argument("--json", action="store_true", help="machine-readable report")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay",
        help="recompute reward -> advantage -> loss and name the first divergent stage",
        description=(
            "Replay a bundle, cohort or capture directory (or a step in a store with --store)."
        ),
    )
    p.add_argument("target", nargs="?", help="bundle, cohort or capture directory")
    sel = p.add_mutually_exclusive_group()
    sel.add_argument("--step", metavar="R:S", help="actor step id")
    sel.add_argument("--rollout", metavar="R", help="rollout id")
    sel.add_argument("--bundle", metavar="KEY", help="a stored bundle key (with --store)")
    sel.add_argument("--all", action="store_true", help="every bundle in the store (with --store)")
    add_selection_args(p)
    st = p.add_argument_group("store")
    st.add_argument(
        "--store",
        metavar="DIR",
        default=default_store(),
        help="replay from a store (env TRAJSTORE_STORE)",
    )
    add_catalog_arg(st)
    st.add_argument("--run", help="run name (default: the store's only run)")
    st.add_argument("--attempt", type=int, help="attempt of a re-captured step (default: latest)")
    for flag, which in (("--rollout-from", "first"), ("--rollout-to", "last")):
        st.add_argument(flag, type=rollout_id, metavar="R", help=f"with --all: {which} rollout id")
    st.add_argument(
        "--workers",
        type=int,
        help="with --all: workers at once (default: 1 local, every CPU of the Ray cluster)",
    )
    from trajstore.cli._common import add_executor_args

    add_executor_args(st, "with --all: ")
    st.add_argument("--record", action="store_true", help="store the results in the catalog")
    st.add_argument(
        "--force", action="store_true", help="with --all --record: redo recorded bundles"
    )
    st.add_argument(
        "--no-link", action="store_true", help="do not link a step to its stored rollout bundle"
    )
    p.set_defaults(func=cmd_replay)


#: options of a replay from a store (dest, flag); a directory replay has no use for them
STORE_ONLY = (
    ("run", "--run"),
    ("attempt", "--attempt"),
    ("rollout_from", "--rollout-from"),
    ("rollout_to", "--rollout-to"),
    ("no_link", "--no-link"),
)
#: options of `--all` alone; a one-step replay has no use for them
ALL_ONLY = (("workers", "--workers"), ("force", "--force"), ("ray_address", "--ray-address"))


def refuse_unused(args: argparse.Namespace, options: tuple[tuple[str, str], ...], why: str) -> None:
    """Refuse options this kind of replay would ignore (a silently ignored --run or
    --attempt replays something else than the user asked for)."""
    from trajstore.errors import UsageError

    given = [flag for dest, flag in options if getattr(args, dest) not in (None, False)]
    if given:
        raise UsageError(f"{', '.join(given)}: {why}")


def selection_request(args: argparse.Namespace):  # noqa: ANN201
    from trajstore.replay.selection import SelectionRequest

    return SelectionRequest(tuple(args.sample), tuple(args.group), tuple(args.batch))


def emit(report, as_json: bool) -> int:  # noqa: ANN001
    from trajstore.replay.report import format_report

    if as_json:
        print_json(report.to_dict())
    else:
        print(format_report(report))
    return report.exit_code


def cmd_replay(args: argparse.Namespace) -> int:
    from trajstore.bundle.capture_dir import resolve_target
    from trajstore.bundle.reader import open_target
    from trajstore.errors import UsageError
    from trajstore.replay.runner import StageRequest, replay_sources

    if args.store is not None and args.target is None:
        return _replay_store(args)
    if args.target is None:
        raise UsageError("replay needs a bundle/capture directory (or --store DIR with a selector)")
    if args.bundle or args.all or args.record:
        raise UsageError(
            "--bundle, --all and --record need --store DIR (and no directory argument)"
        )
    refuse_unused(args, STORE_ONLY + ALL_ONLY, "only with --store DIR (and no directory argument)")
    request = StageRequest.parse(args.stage)
    path = resolve_target(Path(args.target), **target_selector(args))
    bset = open_target(path)
    report = replay_sources(
        bset.bundles,
        label=bset.first.bundle_id if not bset.is_cohort else path.name,
        request=request,
        selection=selection_request(args),
    )
    return emit(report, args.json)


def _replay_store(args: argparse.Namespace) -> int:
    from trajstore.bundle.capture_dir import parse_rollout, parse_step
    from trajstore.errors import UsageError
    from trajstore.executors import ExecutorSpec
    from trajstore.replay.runner import StageRequest
    from trajstore.store import Store

    ExecutorSpec(args.executor, args.workers, args.ray_address)  # its checks, before the store
    store = Store.open(args.store, create=False, catalog_url=args.catalog)
    if args.all or args.rollout_from is not None or args.rollout_to is not None:
        if args.sample or args.group or args.batch or args.stage != "all":
            raise UsageError("--all replays whole bundles: no --sample/--group/--batch/--stage")
        if args.step or args.rollout or args.bundle or args.attempt is not None:
            raise UsageError(
                "--all/--rollout-from/--rollout-to replay the latest attempt of every step in "
                "the range: no --step/--rollout/--bundle/--attempt"
            )
        if args.no_link:
            raise UsageError("--all links each step to its stored rollout bundle: no --no-link")
        if args.force and not args.record:
            raise UsageError("--force redoes recorded bundles: only with --all --record")
        if args.record:
            store.index_new()  # results of an interrupted run count as recorded
        code = _replay_all(args)
        if args.record:
            store.index_new()
        return code
    if args.executor != "local":
        raise UsageError("--executor ray spreads --all over a cluster; one step replays here")
    refuse_unused(args, ALL_ONLY, "only with --all (one step replays here)")
    from trajstore.replay.from_store import Target, record_report, replay_stored, stored_sources

    target = Target(
        run=args.run,
        step=parse_step(args.step) if args.step else None,
        rollout=parse_rollout(args.rollout) if args.rollout else None,
        bundle_key=args.bundle,
        attempt=args.attempt,
    )
    sel = selection_request(args)
    report = replay_stored(
        store, target, request=StageRequest.parse(args.stage), selection=sel, link=not args.no_link
    )
    if args.record:
        record_report(store, report, stored_sources(store, target), selection=sel)
        store.index_new()
    return emit(report, args.json)


def _replay_all(args: argparse.Namespace) -> int:
    from trajstore.replay.batch import replay_all

    summary = replay_all(
        args.store,
        executor=args.executor,
        ray_address=args.ray_address,
        run=args.run,
        rollout_from=args.rollout_from,
        rollout_to=args.rollout_to,
        workers=args.workers,
        record=args.record,
        force=args.force,
        catalog_url=args.catalog,
    )
    if args.json:
        print_json(summary.to_dict())
    else:
        d = summary.to_dict()
        print(
            f"replayed {d['total'] - d['skipped_already_recorded']} of {d['total']} bundle(s) in "
            f"{d['seconds']} s ({d['skipped_already_recorded']} already recorded): "
            f"{d['pass']} pass, {d['diverged']} diverged, {d['unsupported']} unsupported, "
            f"{d['refused']} refused"
        )
        if d["first_divergent_stage_histogram"]:
            print("first divergent stage:")
            for stage, n in d["first_divergent_stage_histogram"].items():
                print(f"  {stage:<22} {n}")
        for r in d["refusals"]:
            print(f"  refused: {r}")
    if summary.refused:
        return 2
    return 1 if summary.diverged or summary.unsupported else 0
