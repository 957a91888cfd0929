"""`trajstore inspect` and `trajstore validate`: bundle directories, no math."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trajstore.cli._common import add_target_args, print_json, target_selector


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect", help="identity, layout, producer, capabilities (incomplete bundles too)"
    )
    add_target_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("validate", help="format, integrity, safety, group closure; no math")
    add_target_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_validate)


def _targets(args: argparse.Namespace) -> list[Path]:
    from trajstore.bundle.capture_dir import discover_targets, list_capture, resolve_target

    sel = target_selector(args)
    path = Path(args.target)
    if sel["step"] is None and sel["rollout"] is None and path.is_dir() and list_capture(path):
        return discover_targets(path)
    return [resolve_target(path, **sel)]


def cmd_inspect(args: argparse.Namespace) -> int:
    from trajstore.bundle.summary import format_inspect, inspect_target

    infos = [inspect_target(t) for t in _targets(args)]
    if args.json:
        print_json(infos if len(infos) != 1 else infos[0])
    else:
        print("\n\n".join(format_inspect(i) for i in infos))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from trajstore.bundle.validate import validate_path

    reports = [validate_path(t) for t in _targets(args)]
    ok = all(r["valid"] for r in reports)
    if args.json:
        print_json(reports if len(reports) != 1 else reports[0])
    else:
        for r in reports:
            print(f"{r['path']}: {'valid' if r['valid'] else 'INVALID'}")
            for w in r["warnings"]:
                print(f"  warning: {w}")
    for r in reports:
        for prob in r["problems"]:
            print(f"trajstore: invalid: {r['path']}: {prob}", file=sys.stderr)
    return 0 if ok else 2
