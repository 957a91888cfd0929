"""The skeleton the training examples share (`moe_grpo`, `hf_moe_r3`, `trl_moe_r3`): a
command line that picks the modes, steps and seed, and each mode trained into a store as
its own run through one `CaptureManager`.

An example supplies its description, its modes and how one mode trains; the store checks,
the capture's counters and the one-line errors are here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from trajstore.errors import StoreError, TrajstoreError

T = TypeVar("T")

__all__ = ["capture_run", "check_store", "mode_parser", "run_main", "selected_modes"]


def mode_parser(
    description: str, modes: tuple[str, ...], *, steps: int, prefix: str | None = None
) -> argparse.ArgumentParser:
    """``--store``, ``--mode`` (one of ``modes`` or both), ``--steps``, ``--seed`` and, with
    ``prefix``, ``--prefix`` (the run name prefix)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--store", required=True, help="store directory (created if absent)")
    p.add_argument("--mode", choices=(*modes, "both"), default="both")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--seed", type=int, default=0)
    if prefix is not None:
        p.add_argument("--prefix", default=prefix, help=f"run name prefix (default: {prefix})")
    return p


def selected_modes(args: argparse.Namespace, modes: tuple[str, ...]) -> tuple[str, ...]:
    """The modes ``--mode`` names (``both``: every one)."""
    return modes if args.mode == "both" else (args.mode,)


def check_store(store_dir: Path | str) -> None:
    """Open (or create) the store once, so an unusable one is refused before training."""
    from trajstore.store import Store

    with Store.open(store_dir):
        pass


def capture_run(
    store_dir: Path | str,
    run: str,
    train: Callable[[Any], T],
    *,
    require_written: bool = False,
) -> T:
    """``train(manager)`` with a blocking `CaptureManager` into run ``run`` of the store;
    a writer error, a dropped bundle or (``require_written``) nothing written is a
    `StoreError` once the manager is closed."""
    from trajstore.capture import CaptureManager
    from trajstore.capture.config import CaptureConfig

    manager = CaptureManager(
        CaptureConfig(enabled=True, store_dir=Path(store_dir), run=run, block=True)
    )
    try:
        out = train(manager)
    finally:
        stats = manager.close()
    if stats.errors or stats.dropped or (require_written and not stats.written):
        raise StoreError(
            f"capture of run {run!r} into {store_dir}: {stats.written} written, "
            f"{stats.errors} writer error(s), {stats.dropped} dropped"
        )
    return out


def run_main(name: str, body: Callable[[], int]) -> int:
    """``body()``, with a trajstore error printed as one line ``<name>: error: ...`` and
    its exit code returned (docs/cli.md)."""
    try:
        return body()
    except TrajstoreError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return exc.exit_code
