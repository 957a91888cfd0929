"""`trajstore replay`: recompute the stage chain and name the first divergence."""

from __future__ import annotations

import argparse
from pathlib import Path

from trajstore.cli._common import print_json, target_selector


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
        description="Replay a bundle, cohort or capture directory (or a step in a store with --store).",
    )
    p.add_argument("target", nargs="?", help="bundle, cohort or capture directory")
    sel = p.add_mutually_exclusive_group()
    sel.add_argument("--step", metavar="R:S", help="actor step id")
    sel.add_argument("--rollout", metavar="R", help="rollout id")
    add_selection_args(p)
    p.set_defaults(func=cmd_replay)


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

    if args.target is None:
        raise UsageError("replay needs a bundle/capture directory (or --store DIR with a selector)")
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
