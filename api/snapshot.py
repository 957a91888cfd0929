"""The server's catalog: a private in-memory copy, refreshed from the store's documents.

DuckDB admits one process per file, so the server never holds `catalog.duckdb`:
it copies it once (`Catalog.snapshot_in_memory`) and from then on applies new
refs, tombstones and results to the copy itself (`sync_catalog`), polling the
three directories' mtimes. `trajstore ingest` and `replay --record` in other
processes therefore never meet a lock held by the server, and what they publish
is visible within about a second. A sync that fails (a damaged document) is
retried at each poll; until one succeeds, `last_error` holds the error and
/v1/health answers "degraded" (docs/rest.md "Health").

On top of the snapshot sits a `View`: plain dicts of the bundle rows, the
samples and payloads of each bundle and each bundle's latest replay result,
rebuilt (incrementally: samples and payloads of a key never change) after each
sync that applied something. The hot lookups (a step by actor step id, a bundle
by key) read only the View: on a loaded 2-core box one DuckDB query through
SQLAlchemy costs 5-20 ms, which alone would miss the 10 ms p99 target. Listing
endpoints with filters and cursors still query the snapshot (queries.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from trajstore.catalog import open_catalog, sync_catalog, tables
from trajstore.catalog.db import Catalog
from trajstore.catalog.queries import jsonable, samples_of
from trajstore.catalog.sync import changes
from trajstore.store import Store

log = logging.getLogger("trajstore.api")

WATCHED = (Path("refs") / "bundles", Path("refs") / "tombstones", Path("results"))


def _rows(conn: sa.Connection, q: Any) -> list[dict[str, Any]]:
    res = conn.execute(q)
    cols = list(res.keys())
    return [{c: jsonable(c, v) for c, v in zip(cols, row, strict=True)} for row in res]


class SampleCache:
    """Sample rows of a bundle, read from the snapshot on first use and kept (LRU).

    Bundles are immutable, so a key's samples never change; loading every
    sample row at start-up cost ~30 s on a 10,000 x 256-sample store.
    """

    def __init__(self, catalog: Catalog, size: int = 4096) -> None:
        self.catalog = catalog
        self.size = size
        self._rows: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str, default: Any = None) -> Any:
        with self._lock:
            rows = self._rows.get(key)
            if rows is not None:
                self._rows.move_to_end(key)
                return rows
        rows = samples_of(self.catalog, key)
        if not rows:
            return default
        with self._lock:
            self._rows[key] = rows
            while len(self._rows) > self.size:
                self._rows.popitem(last=False)
        return rows


@dataclass(frozen=True)
class View:
    """An immutable read model of one snapshot generation (swapped whole on refresh)."""

    generation: int = 0
    bundles: dict[str, dict[str, Any]] = field(default_factory=dict)  # every row, removed too
    samples: SampleCache | dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    payloads: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    latest_result: dict[str, dict[str, Any]] = field(default_factory=dict)
    # (run, kind, rollout_id, step_id) -> visible (not removed) rows, every attempt
    groups: dict[tuple, list[dict[str, Any]]] = field(default_factory=dict)
    runs: tuple[str, ...] = ()
    steps_of_rollout: dict[tuple, list[int]] = field(default_factory=dict)  # (run, rollout_id)

    def visible(self, key: str) -> dict[str, Any] | None:
        row = self.bundles.get(key)
        return None if row is None or row["removed_at"] is not None else row

    def group(
        self, run: str, kind: str, rollout_id: int, step_id: int | None, attempt: int | None
    ) -> tuple[list[dict[str, Any]], list[int]]:
        """Rows of the latest (or the named) attempt of a step/rollout, and every attempt."""
        rows = self.groups.get((run, kind, rollout_id, step_id), [])
        attempts = sorted({r["attempt"] for r in rows})
        if attempt is None:
            chosen = [r for r in rows if r["is_latest"]]
        else:
            chosen = [r for r in rows if r["attempt"] == attempt]
        chosen.sort(key=lambda r: (-1 if r["rank"] is None else r["rank"], r["key"]))
        return chosen, attempts


def _build_view(catalog: Catalog, previous: View, generation: int) -> View:
    with catalog.connect() as conn:
        bundles = {row["key"]: row for row in _rows(conn, sa.select(tables.bundles))}
        new_keys = [key for key in bundles if key not in previous.payloads]
        payloads = dict(previous.payloads)
        for start in range(0, len(new_keys), 2000):
            part = new_keys[start : start + 2000]
            for key in part:
                payloads[key] = {}
            query = sa.select(tables.payloads).where(tables.payloads.c.bundle_key.in_(part))
            for row in _rows(conn, query):
                payloads[row["bundle_key"]][row["name"]] = row
        results = tables.replay_results
        latest: dict[str, dict[str, Any]] = {}
        for row in _rows(
            conn,
            sa.select(results).order_by(
                results.c.recorded_at.asc().nulls_first(), results.c.id.asc()
            ),
        ):
            latest[row["bundle_key"]] = row
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in bundles.values():
        if row["removed_at"] is None:
            group = (row["run"], row["kind"], row["rollout_id"], row["step_id"])
            groups.setdefault(group, []).append(row)
    runs = tuple(sorted({row["run"] for row in bundles.values() if row["removed_at"] is None}))
    steps: dict[tuple, set[int]] = {}
    for run, kind, rollout_id, step_id in groups:
        if kind == "step":
            steps.setdefault((run, rollout_id), set()).add(step_id)
    steps_of_rollout = {key: sorted(step_ids) for key, step_ids in steps.items()}
    samples = (
        previous.samples if isinstance(previous.samples, SampleCache) else SampleCache(catalog)
    )
    return View(generation, bundles, samples, payloads, latest, groups, runs, steps_of_rollout)


class CatalogSnapshot:
    """An in-memory catalog of a store, kept current by a background thread."""

    def __init__(self, store: Store, *, poll_s: float = 0.25, min_interval_s: float = 1.0) -> None:
        self.store = store
        self.poll_s = poll_s
        self.min_interval_s = min_interval_s
        self.last_error: str | None = None  # the last sync's failure; None once one succeeds
        self.catalog = self._initial_snapshot()
        self._lock = threading.Lock()
        self._stamp: tuple = ()
        self._last_sync = 0.0
        self.view = View()
        self.refresh(force=True)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _initial_snapshot(self) -> Catalog:
        """Sync the file catalog, copy it into memory, release the file.

        A catalog that cannot be opened stops the server; a sync that fails (a
        damaged ref or result document) does not: the server starts on what the
        catalog already holds and reports the error through /v1/health, and the
        background refresh retries until the document is repaired.
        """
        cat = open_catalog(self.store.root, self.store.catalog_url)
        if not cat.is_duckdb:
            # a server database (PostgreSQL) is shared, not copied, and never synced from a
            # listing here: writers keep it current (trajstore.catalog.access)
            return cat
        try:
            try:
                sync_catalog(cat, self.store.space, self.store.load_document)
            except Exception as exc:
                self._failed(exc)
            if cat.file is None:
                return cat
            return cat.snapshot_in_memory()
        finally:
            if cat.is_duckdb and cat.file is not None:
                cat.close()

    def _dir_stamp(self) -> tuple:
        out = []
        for d in WATCHED:
            try:
                st = os.stat(self.store.root / d)
                out.append((st.st_mtime_ns, st.st_nlink, st.st_size))
            except OSError:
                out.append(None)
        return tuple(out)

    def refresh(self, *, force: bool = False) -> bool:
        """Sync new documents into the snapshot when the directories changed; True if
        anything was applied. At most one sync at a time; a concurrent caller skips."""
        if not self._lock.acquire(blocking=force):
            return False
        if not self.catalog.is_duckdb:
            try:
                return self._follow_server(force)
            finally:
                self._lock.release()
        try:
            stamp = self._dir_stamp()
            now = time.monotonic()
            stale = now - self._last_sync > 5.0  # mtime granularity backstop
            if not force and (
                (stamp == self._stamp and not stale) or now - self._last_sync < self.min_interval_s
            ):
                return False
            self._last_sync = now
            before = self._synced_count()
            try:
                stats = sync_catalog(self.catalog, self.store.space, self.store.load_document)
            except Exception as exc:  # keep serving, retry at the next poll
                self._failed(exc)
                # batches before the bad document were committed: show them too
                applied = self._synced_count() != before
                if applied or force:
                    self.view = _build_view(self.catalog, self.view, self.view.generation + 1)
                return applied
            self._stamp = stamp
            if self.last_error is not None:
                log.info("catalog sync recovered")
            self.last_error = None
            changed = stats.new_refs or stats.new_tombstones or stats.new_results
            if changed or force:
                self.view = _build_view(self.catalog, self.view, self.view.generation + 1)
            return bool(changed)
        finally:
            self._lock.release()

    def _follow_server(self, force: bool) -> bool:
        """A server catalog: rebuild the view when its change counter moved (one query a
        poll; the store is not listed). True if it moved."""
        try:
            count = changes(self.catalog)
        except Exception as exc:  # the database is unreachable: keep serving the view
            self._failed(exc)
            return False
        if self.last_error is not None:
            log.info("catalog reachable again")
        self.last_error = None
        moved = count != self._stamp
        now = time.monotonic()
        if moved and not force and now - self._last_sync < self.min_interval_s:
            return False  # writers are busy: rebuild at most once per min_interval_s
        if moved or force:
            self._stamp = count
            self._last_sync = now
            self.view = _build_view(self.catalog, self.view, self.view.generation + 1)
        return moved

    def _failed(self, exc: Exception) -> None:
        """Record a sync failure (logged once per distinct message, not at every poll)."""
        error = f"{type(exc).__name__}: {exc}"
        if error != self.last_error:
            log.warning("catalog sync failed: %s", error)
        self.last_error = error

    def _synced_count(self) -> int:
        """Documents applied so far; a failed sync may still have applied some."""
        with self.catalog.connect() as conn:
            count = sa.select(sa.func.count()).select_from(tables.synced_documents)
            return int(conn.execute(count).scalar_one())

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.refresh()
            except Exception:  # never let the refresher die
                log.exception("catalog refresh failed")

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name="trajstore-catalog", daemon=True
            )
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.catalog.close()


def keys_of(rows: Iterable[dict[str, Any]]) -> list[str]:
    return [r["key"] for r in rows]
