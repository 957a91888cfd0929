"""`trajstore validate`: the integrity gate plus content checks, as a report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trajstore.bundle.checks import bundle_problems, bundle_warnings
from trajstore.bundle.reader import open_target
from trajstore.errors import TrajstoreError


def validate_path(path: Path) -> dict[str, Any]:
    """Report ``{path, valid, problems, warnings, bundles}``; never raises for bad input."""
    problems: list[str] = []
    warnings: list[str] = []
    bundles: list[str] = []
    try:
        bset = open_target(path)
    except TrajstoreError as exc:
        return {
            "path": str(path),
            "valid": False,
            "problems": [str(exc)],
            "warnings": [],
            "bundles": [],
        }
    for b in bset.bundles:
        prefix = f"rank {b.rank}: " if bset.is_cohort else ""
        bundles.append(b.label)
        problems += [prefix + p for p in bundle_problems(b)]
        warnings += [prefix + w for w in bundle_warnings(b)]
    return {
        "path": str(path),
        "valid": not problems,
        "problems": problems,
        "warnings": warnings,
        "bundles": bundles,
    }
