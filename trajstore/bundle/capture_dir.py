"""Capture directories: ``replay-<R>-<S>/`` and ``replay-rollout-<R>/`` children.

A capture directory is what a training run writes: one step-level bundle per
actor step and one rollout-level bundle per rollout, each either a plain
bundle or a multi-rank cohort. ``--step R:S`` / ``--rollout R`` pick one.
"""

from __future__ import annotations

import re
from pathlib import Path

from trajstore.bundle.reader import is_bundle_dir, is_cohort_dir
from trajstore.errors import BundleError, UsageError

# \Z, not "$": "$" also matches before a final newline, so "replay-0-0\n" was a bundle
STEP_DIR = re.compile(r"^replay-(\d+)-(\d+)\Z", re.ASCII)
ROLLOUT_DIR = re.compile(r"^replay-rollout-(\d+)\Z", re.ASCII)
_STEP_ARG = re.compile(r"^(\d+):(\d+)$", re.ASCII)  # after strip(); ASCII: not "３:0"


def parse_step(text: str) -> tuple[int, int]:
    """Parse an actor step id ``R:S`` (non-negative ints)."""
    m = _STEP_ARG.match(text.strip()) if isinstance(text, str) else None
    if not m:
        raise UsageError(
            f"step id {text!r} is not ROLLOUT:STEP with non-negative integers (e.g. 120:0)"
        )
    return int(m.group(1)), int(m.group(2))


def parse_rollout(text: str) -> int:
    digits = text.strip() if isinstance(text, str) else ""
    if not (digits.isascii() and digits.isdigit()):
        raise UsageError(f"rollout id {text!r} is not a non-negative integer")
    return int(text)


def step_dir_name(rollout_id: int, step_id: int) -> str:
    return f"replay-{rollout_id}-{step_id}"


def rollout_dir_name(rollout_id: int) -> str:
    return f"replay-rollout-{rollout_id}"


def is_target_dir(path: Path) -> bool:
    """A bundle or a cohort (something `open_target` opens)."""
    return is_bundle_dir(path) or is_cohort_dir(path)


def _named_bundle(child: Path) -> bool:
    """A `replay-*` child that is a directory or a link (to one, or dangling): a bundle of
    the capture, listed so that it is used or its problem reported, never skipped (a
    capture assembled from links to bundles elsewhere lost them without a word)."""
    named = STEP_DIR.match(child.name) or ROLLOUT_DIR.match(child.name)
    return bool(named) and (child.is_dir() or child.is_symlink())


def list_capture(path: Path) -> list[Path]:
    """The step and rollout bundle directories directly under a capture directory."""
    return [c for c in sorted(path.iterdir()) if _named_bundle(c)] if path.is_dir() else []


def resolve_target(
    path: Path | str, *, step: tuple[int, int] | None = None, rollout: int | None = None
) -> Path:
    """The bundle/cohort directory a CLI target plus ``--step``/``--rollout`` names."""
    path = Path(path)
    if step is not None and rollout is not None:
        raise UsageError("--step and --rollout are mutually exclusive")
    if not path.exists():
        raise BundleError(f"{path}: no such file or directory")
    if is_target_dir(path):
        if step is not None or rollout is not None:
            _check_selected(path, step, rollout)
        return path
    children = list_capture(path)
    if not children:
        raise BundleError(f"{path}: not a bundle, cohort or capture directory")
    if step is None and rollout is None:
        raise UsageError(
            f"{path} is a capture directory with {len(children)} bundle(s); "
            "pick one with --step R:S or --rollout R"
        )
    name = step_dir_name(*step) if step is not None else rollout_dir_name(rollout)
    target = path / name
    if not target.is_dir():
        have = ", ".join(c.name for c in children[:8])
        what = f"step {step[0]}:{step[1]}" if step is not None else f"rollout {rollout}"
        raise BundleError(f"{path}: no bundle for {what} (expected {name}/; have {have})")
    return target


def _check_selected(path: Path, step: tuple[int, int] | None, rollout: int | None) -> None:
    """A bundle or cohort directory given with --step/--rollout must be that step or rollout:
    replaying step 0:0 when 5:0 was asked for is a verdict about the wrong step."""
    from trajstore.bundle.reader import open_target
    from trajstore.errors import TrajstoreError

    try:
        ident = open_target(path).first.index.identity
    except TrajstoreError:
        return  # not readable as a bundle: the command opens it and says why
    if ident.kind == "step":
        holds = f"step {ident.rollout_id}:{ident.step_id}"
    else:
        holds = f"rollout {ident.rollout_id}"
    asked = f"step {step[0]}:{step[1]}" if step is not None else f"rollout {rollout}"
    if holds != asked:
        raise UsageError(
            f"{path} is the bundle of {holds}, not {asked}; drop --step/--rollout "
            "or give the capture directory that holds it"
        )


def discover_targets(path: Path | str) -> list[Path]:
    """Every bundle/cohort directory at or below ``path`` (for ingest and validate).

    A `replay-*` link is a target, as a linked bundle given directly is; other links are
    not entered (one to `/` or to a whole dataset would be walked). A directory holding
    none is refused (an ingest of it stored nothing and exited 0), and so is an empty
    path, which `Path` would read as the current directory."""
    if isinstance(path, str) and not path:
        raise BundleError("'': an empty path (it would be the current directory)")
    path = Path(path)
    if not path.exists():
        raise BundleError(f"{path}: no such file or directory")
    if is_target_dir(path):
        return [path]
    if not path.is_dir():
        raise BundleError(f"{path}: not a bundle, cohort or capture directory")
    found = _targets_below(path)
    if not found:
        raise BundleError(f"{path}: no bundle, cohort or capture directory in it")
    return found


def _targets_below(path: Path) -> list[Path]:
    found: list[Path] = []
    for child in sorted(path.iterdir()):
        if child.name.startswith("."):
            continue
        # A replay-* child is a target even when broken, so that it is reported, not skipped.
        if _named_bundle(child):
            found.append(child)
        elif child.is_dir() and not child.is_symlink():
            found.extend([child] if is_target_dir(child) else _targets_below(child))
    return found
