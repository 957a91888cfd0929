"""Checks on a store's published bundles shared by the crash, full-disk and race tests."""

from __future__ import annotations

import filecmp
import shutil
import uuid
from pathlib import Path

from trajstore.errors import NotFoundError
from trajstore.store import Store, export_bundles


def tree_equal(a: Path, b: Path) -> bool:
    cmp = filecmp.dircmp(a, b)
    if cmp.left_only or cmp.right_only or cmp.funny_files:
        return False
    _, mismatch, errors = filecmp.cmpfiles(a, b, cmp.common_files, shallow=False)
    return not mismatch and not errors and all(tree_equal(a / d, b / d) for d in cmp.common_dirs)


def visible_bundles(st: Path | str, targets: list[Path], tmp: Path, run: str = "default") -> int:
    """Every target (`replay-7-<s>`) is absent from `run` or fully there, its export
    byte-identical to the target; returns how many are there."""
    store = Store.open(st, create=False)
    visible = 0
    for t in targets:
        step = int(t.name.rsplit("-", 1)[1])
        try:
            bundles = store.step(run, 7, step)
        except NotFoundError:
            continue
        out = tmp / f"check-{uuid.uuid4().hex[:8]}"
        export_bundles(bundles, out)
        assert tree_equal(t, out), (run, t)
        shutil.rmtree(out)
        visible += 1
    return visible
