"""The REST server's snapshot poll: what a quiet store costs it, and what it still sees.

The poller re-syncs when the watched directories' stat moves, and, as a backstop for a
document created within the clock tick of the last stat, every 5 s. That backstop listed
every document of the store (0.8 s of CPU per 20,000 steps, holding the GIL, so the step
GET's p99 grew with the store); it is needed only while a directory's last change is
recent, so a store whose directories had settled when last listed is not listed again.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from trajstore.api.snapshot import WATCHED, CatalogSnapshot

from trajstore.catalog.direct import SETTLE_NS
from trajstore.store import Store

pytestmark = pytest.mark.unit


def date_dirs(root: Path, shift_ns: int) -> None:
    """Date the watched directories' last change `shift_ns` from now (negative: long
    ago, settled; positive: still recent when the snapshot lists them, however slow the
    machine is in between)."""
    when = time.time_ns() + shift_ns
    for folder in WATCHED:
        (root / folder).mkdir(parents=True, exist_ok=True)
        os.utime(root / folder, ns=(when, when))


def stamp_of(folder: Path) -> tuple[int, int]:
    st = os.stat(folder)
    return st.st_atime_ns, st.st_mtime_ns


def test_a_settled_quiet_store_is_not_listed_again(tmp_path: Path, make_bundle) -> None:
    root = tmp_path / "store"
    with Store.open(root) as store:
        store.ingest([make_bundle(rollout_id=0, step_id=0)], run="r")
        date_dirs(root, -10 * SETTLE_NS)
        snap = CatalogSnapshot(store, poll_s=3600)
        try:
            snap._last_sync = time.monotonic() - 60  # the 5 s backstop is due
            listed_at = snap._last_sync
            assert snap.refresh() is False
            assert snap._last_sync == listed_at  # no sync ran: nothing was listed
        finally:
            snap.catalog.close()


def test_a_document_within_the_ticks_of_a_recent_change_is_still_found(
    tmp_path: Path, make_bundle
) -> None:
    root = tmp_path / "store"
    with Store.open(root) as store:
        store.ingest([make_bundle(rollout_id=0, step_id=0)], run="r")
        date_dirs(root, 60 * SETTLE_NS)
        snap = CatalogSnapshot(store, poll_s=3600)  # lists directories changed recently
        try:
            refs = root / "refs" / "bundles"
            before = stamp_of(refs)
            store.ingest([make_bundle(rollout_id=1, step_id=0)], run="r")
            os.utime(refs, ns=before)  # as if created within the same clock tick
            assert snap.refresh() is False  # within min_interval_s of the last sync
            snap._last_sync = time.monotonic() - 60
            assert snap.refresh() is True  # the backstop lists the directory again
            assert sorted(snap.view.steps_of_rollout) == [("r", 0), ("r", 1)]
        finally:
            snap.catalog.close()
