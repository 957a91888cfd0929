"""Argument helpers shared by command modules."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def default_store() -> str | None:
    """`TRAJSTORE_STORE` may stand for --store (here, not in the package's __init__, so that
    command modules never import the module that imports them)."""
    return os.environ.get("TRAJSTORE_STORE") or None


def default_catalog() -> str | None:
    """`TRAJSTORE_CATALOG` may stand for --catalog."""
    return os.environ.get("TRAJSTORE_CATALOG") or None


def add_catalog_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--catalog URL: a server catalog shared by every host (docs/catalog.md)."""
    p.add_argument(
        "--catalog",
        metavar="URL",
        default=default_catalog(),
        help="catalog database, e.g. postgresql+psycopg://user@host:5432/db (env "
        "TRAJSTORE_CATALOG; default: the store's own DuckDB file). Give the password "
        "through PGPASSWORD or ~/.pgpass, not the URL, which `ps` shows",
    )


def add_target_args(p: argparse.ArgumentParser) -> None:
    """A bundle/cohort/capture directory plus --step/--rollout."""
    p.add_argument("target", help="bundle, cohort or capture directory")
    sel = p.add_mutually_exclusive_group()
    sel.add_argument("--step", metavar="R:S", help="actor step id, in a capture directory")
    sel.add_argument("--rollout", metavar="R", help="rollout id, in a capture directory")


def target_selector(args: argparse.Namespace) -> dict[str, Any]:
    from trajstore.bundle.capture_dir import parse_rollout, parse_step

    return {
        "step": parse_step(args.step) if args.step is not None else None,
        "rollout": parse_rollout(args.rollout) if args.rollout is not None else None,
    }


def rollout_id(text: str) -> int:
    """argparse type of --rollout-from/--rollout-to: a rollout id (an integer from 0 to
    the catalog's BIGINT maximum)."""
    from trajstore.catalog.statements import BIGINT_MAX

    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= BIGINT_MAX:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a rollout id (an integer from 0 to {BIGINT_MAX})"
        )
    return value


def error_bound(text: str) -> float:
    """argparse type of --min-abs-err: a finite number >= 0 (`nan` would match no row)."""
    import math

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number >= 0")
    return value


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def add_executor_args(p: argparse._ActionsContainer, when: str = "") -> None:
    """--executor local|ray and --ray-address (replay --all, ingest; docs/deployment.md)."""
    p.add_argument(
        "--executor",
        choices=("local", "ray"),
        default="local",
        help=f"{when}where bundles run: processes on this host (default) or a Ray cluster",
    )
    p.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="with --executor ray: the cluster, host:port (default $RAY_ADDRESS, else a Ray "
        "instance started on this machine)",
    )
