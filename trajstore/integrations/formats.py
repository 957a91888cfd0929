"""Framework dump formats: what `trajstore ingest --from NAME` reads and `export --to NAME`
writes.

Why a registry: each RL framework writes its own debug dumps (slime's torch.save files,
verl's, ...). The command line knows only this table; each format is one module of
`trajstore.integrations`, imported when it is named, that turns its files into ordinary
bundles (`FrameworkBundle`) and stored bundles back into its files. Everything between
(the integrity gate, dedup, attempts, the catalog, S3) is the store's, unchanged.

A format module provides:

- ``convert(paths, *, run, config) -> list[FrameworkBundle]``
  (`trajstore.integrations.framework`): read and check every file
  first, raising a `TrajstoreError` (exit 2) before anything is written;
- ``export(store, *, run, rollouts, out) -> list[Path]``: write the stored rollouts back as
  the framework's files under ``out``.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from trajstore.errors import UsageError
from trajstore.integrations.framework import FrameworkBundle


@dataclass(frozen=True)
class FrameworkFormat:
    """One registered format: its name on the command line and the module that reads it."""

    name: str
    module: str
    summary: str


#: every format `--from` / `--to` accept (one module per framework)
FORMATS: dict[str, FrameworkFormat] = {
    "slime": FrameworkFormat(
        "slime",
        "trajstore.integrations.slime",
        "slime's --save-debug-rollout-data / --save-debug-train-data dumps (torch.save)",
    ),
}


def format_names() -> list[str]:
    return sorted(FORMATS)


def load_format(name: str) -> ModuleType:
    """The module of format `name`; UsageError (exit 2) naming the known ones otherwise."""
    fmt = FORMATS.get(name)
    if fmt is None:
        raise UsageError(f"unknown format {name!r}; formats: {', '.join(format_names())}")
    return importlib.import_module(fmt.module)


def convert(name: str, paths: list[str], *, run: str, config: str | None) -> list[Any]:
    """Format `name`'s files as bundles, every file read and checked (nothing written)."""
    bundles = load_format(name).convert(paths, run=run, config=config)
    if not bundles:
        raise UsageError(f"no {name} dumps found in {', '.join(paths)}")
    return bundles


def ingest_bundles(
    store: Any,
    bundles: list[FrameworkBundle],
    *,
    on_outcome: Callable[[Any], None] | None = None,
) -> list[Any]:
    """Write `bundles` as bundle directories in a temp capture directory and ingest them,
    run by run, each outcome naming the files its bundle came from."""
    from trajstore.bundle.writer import write_bundle

    outcomes: list[Any] = []
    tmp = Path(tempfile.mkdtemp(prefix="trajstore-import-"))
    try:
        by_run: dict[str, list[FrameworkBundle]] = {}
        for b in bundles:
            write_bundle(tmp / b.run / b.child, b.contents)
            by_run.setdefault(b.run, []).append(b)
        for run_name, members in by_run.items():
            sources = {
                str(tmp / run_name / b.child): f"{', '.join(b.sources)} ({b.child})"
                for b in members
            }

            def report(outcome: Any, sources: dict[str, str] = sources) -> None:
                outcome.path = sources.get(outcome.path, outcome.path)
                if on_outcome is not None:
                    on_outcome(outcome)

            outcomes += store.ingest(
                [str(tmp / run_name / b.child) for b in members],
                run=run_name,
                on_outcome=report,
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return outcomes


def export_to(
    name: str, store: Any, *, run: str, rollouts: tuple[int, int], out: str | os.PathLike[str]
) -> list[Path]:
    """Write the stored rollouts ``rollouts[0]..rollouts[1]`` of `run` as `name`'s files."""
    return load_format(name).export(store, run=run, rollouts=rollouts, out=Path(out))
