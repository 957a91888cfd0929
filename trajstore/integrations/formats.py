"""Framework dump formats: what `trajstore ingest --from NAME` reads and `export --to NAME`
writes.

Why a registry: each RL framework writes its own debug dumps (slime's torch.save files,
verl's, ...). The command line knows only this table; each format is one module of
`trajstore.integrations`, imported when it is named, that turns its files into ordinary
bundles (`FrameworkBundle`) and stored bundles back into its files. Everything between
(the integrity gate, dedup, attempts, the catalog, S3) is the store's, unchanged.

A format module provides:

- ``convert(paths, *, run, config) -> Iterator[FrameworkBundle]``
  (`trajstore.integrations.framework`), one rollout at a time: read and check every file
  before its bundles, raising a `TrajstoreError` (exit 2); `stage` writes them to a temp
  directory and only then is a store opened, so a refusal leaves no trace;
- ``export(store, *, run, rollouts, out) -> list[Path]``: write the stored rollouts back as
  the framework's files under ``out``.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from trajstore.errors import UsageError


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


@dataclass
class Staged:
    """A format's files converted and written as bundle directories in a temp directory:
    each bundle's run, capture-directory child and source files. `ingest_staged` stores
    them; `cleanup` removes the directory."""

    root: Path
    bundles: list[tuple[str, str, list[str]]] = field(default_factory=list)

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def stage(name: str, paths: list[str], *, run: str, config: str | None) -> Staged:
    """Format `name`'s files as bundle directories in a temp directory (``$TMPDIR``), every
    file read, checked and converted before this returns: a refusal removes them and
    raises, and no store is involved. The format hands over one rollout at a time, so
    memory holds one rollout's files; the temp directory holds every bundle."""
    from trajstore.bundle.writer import write_bundle

    module = load_format(name)
    staged = Staged(Path(tempfile.mkdtemp(prefix=f"trajstore-{name}-")))
    try:
        for b in module.convert(paths, run=run, config=config):
            # staging: the ingest that follows is what makes them durable
            write_bundle(staged.root / b.run / b.child, b.contents, durable=False)
            staged.bundles.append((b.run, b.child, b.sources))
        if not staged.bundles:
            raise UsageError(f"no {name} dumps found in {', '.join(paths)}")
    except BaseException:
        staged.cleanup()
        raise
    return staged


def ingest_staged(
    store: Any, staged: Staged, *, on_outcome: Callable[[Any], None] | None = None
) -> list[Any]:
    """Ingest the staged bundles run by run, each outcome naming the files its bundle came
    from (not the temp directory)."""
    outcomes: list[Any] = []
    runs = list(dict.fromkeys(run for run, _, _ in staged.bundles))
    for run in runs:
        members = [(child, sources) for r, child, sources in staged.bundles if r == run]
        names = {
            str(staged.root / run / child): f"{', '.join(sources)} ({child})"
            for child, sources in members
        }

        def report(outcome: Any, names: dict[str, str] = names) -> None:
            outcome.path = names.get(outcome.path, outcome.path)
            if on_outcome is not None:
                on_outcome(outcome)

        outcomes += store.ingest(
            [str(staged.root / run / child) for child, _ in members], run=run, on_outcome=report
        )
    return outcomes


def ingest_from(
    name: str,
    store: Any,
    paths: list[str],
    *,
    run: str,
    config: str | None = None,
    on_outcome: Callable[[Any], None] | None = None,
) -> list[Any]:
    """`stage` then `ingest_staged` (the Python face of ``ingest --from``)."""
    staged = stage(name, paths, run=run, config=config)
    try:
        return ingest_staged(store, staged, on_outcome=on_outcome)
    finally:
        staged.cleanup()


def export_to(
    name: str, store: Any, *, run: str, rollouts: tuple[int, int], out: str | os.PathLike[str]
) -> list[Path]:
    """Write the stored rollouts ``rollouts[0]..rollouts[1]`` of `run` as `name`'s files."""
    return load_format(name).export(store, run=run, rollouts=rollouts, out=Path(out))
