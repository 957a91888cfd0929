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
by key) read only the View (a step's samples summary from the digests the view
build packs: `SampleCache`): on a loaded 2-core box one DuckDB query through
SQLAlchemy costs 5-20 ms, which alone would miss the 10 ms p99 target. Listing
endpoints with filters and cursors still query the snapshot (queries.py).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import aggregate_order_by

from trajstore.catalog import open_catalog, sync_catalog, tables
from trajstore.catalog.db import Catalog
from trajstore.catalog.direct import SETTLE_NS
from trajstore.catalog.queries import jsonable, samples_of, whole_first
from trajstore.catalog.sync import changes
from trajstore.errors import StoreError
from trajstore.store import Store

log = logging.getLogger("trajstore.api")

WATCHED = (Path("refs") / "bundles", Path("refs") / "tombstones", Path("results"))
#: bundles whose sample digests one miss loads besides its own (next in catalog order)
DIGEST_BATCH = 256
#: new bundles' digests a view build loads up front when they hold at most this many samples
#: in all (their sample ids take about 60 bytes each); beyond it they load on first use
PRELOAD_SAMPLES = 500_000
#: the packed digests (`_pack_digests`) a DuckDB snapshot keeps, in characters: about 15 a
#: sample with short sample ids, 33 MB for a 100,000-step store of 2.3 million samples; the
#: bundles beyond it are read on first use (`_load_digests_by_key`)
PACKED_CHARS = 256 << 20
#: bundles packed per query beyond which a pack goes by key ranges: DuckDB keeps the memory
#: an aggregation used (one query over 2.3 million samples grew the server by 300 MB for
#: good; in 16,384-bundle ranges by nothing measurable, for 0.1 s more)
PACK_CHUNK = 16384


def _rows(conn: sa.Connection, q: Any) -> list[dict[str, Any]]:
    res = conn.execute(q)
    cols = list(res.keys())
    return [{c: jsonable(c, v) for c, v in zip(cols, row, strict=True)} for row in res]


class SampleCache:
    """Sample rows of a bundle, read from the snapshot on first use and kept (LRU).

    Bundles are immutable, so a key's samples never change; loading every
    sample row at start-up cost ~30 s on a 10,000 x 256-sample store.
    """

    def __init__(self, catalog: Catalog, size: int = 4096, digest_size: int = 8192) -> None:
        self.catalog = catalog
        self.size = size
        self._rows: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()
        self.digest_size = digest_size
        self._digests: OrderedDict[str, SampleDigest] = OrderedDict()
        self._load_lock = threading.Lock()
        #: the DuckDB snapshot's connection a digest miss reads through (`_driver`), checked
        #: out of the pool on first use and held until `close` (under `_load_lock`)
        self._conn: sa.Connection | None = None
        self._closed = False
        #: every bundle's digest as JSON text (`_pack_digests`; DuckDB only), up to
        #: PACKED_CHARS in all: a lookup decodes it (microseconds) instead of reading the
        #: bundle's sample rows (an index probe, 0.5-1 ms, paid by nearly every lookup on a
        #: store much bigger than the digest cache)
        self._packed: dict[str, str] = {}
        self._packed_chars = 0

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

    def digests(self, keys: list[str], ahead: Iterable[str] = ()) -> dict[str, SampleDigest]:
        """What a samples summary needs of each of `keys`' bundles (keys with no samples
        are left out).

        A miss loads the missing keys plus up to DIGEST_BATCH keys of `ahead` not yet
        loaded, in one query of the eight columns a summary reads, straight to tuples.
        Reason: a step's first lookup read all 14 columns of its sample rows into dicts
        (`samples_of`), ~9 ms per step on a 64-sample store, paid for every step once
        per worker; in batches it is a small fraction of a millisecond. On the DuckDB
        snapshot a miss loads only the missing keys, each through the snapshot's index
        (`index_snapshot`): a batch there is an IN list, which scans every sample row.
        """
        out: dict[str, SampleDigest] = {}
        with self._lock:
            missing = self._hit_digests(keys, out)
        if not missing:
            return out
        with self._load_lock:  # one batch query at a time; a waiter may find its keys loaded
            with self._lock:
                missing = self._hit_digests(missing, out)
                batch = dict.fromkeys(missing)
                for key in ahead if not self.catalog.is_duckdb else ():
                    if len(batch) >= len(missing) + DIGEST_BATCH:
                        break
                    if key not in self._digests:
                        batch.setdefault(key)
            if not missing:
                return out
            if self.catalog.is_duckdb:  # the snapshot's index: no scan, no batch needed
                loaded = _load_digests_by_key(self._driver(), list(batch))
            else:
                loaded = _load_digests(self.catalog, list(batch))
            with self._lock:
                for key, digest in loaded.items():
                    self._digests[key] = digest
                    self._digests.move_to_end(key)
                while len(self._digests) > self.digest_size:
                    self._digests.popitem(last=False)
        out.update((key, loaded[key]) for key in missing if key in loaded)
        return out

    def _driver(self) -> Any:
        """The DuckDB driver connection digest misses read through (hold `_load_lock`).

        Held, not checked out per miss: a pool checkout and its check-in (a rollback) cost
        about 0.4 ms, a fifth of a miss on a 100,000-step store (issue 33)."""
        if self._closed:
            raise StoreError("the catalog snapshot is closed")
        if self._conn is None:
            self._conn = self.catalog.engine.connect()
        return self._conn.connection.driver_connection

    def close(self) -> None:
        """Return the held connection to the catalog's pool (before the catalog closes)."""
        with self._load_lock:
            self._closed = True
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def preload(self, keys: list[str], samples: int, *, everything: bool) -> bool:
        """Load the digests of new bundles `keys` (holding `samples` sample rows) now, if
        they fit PRELOAD_SAMPLES and the cache; True if loaded.

        Called by the view build, so a first lookup of each step finds its digest: loaded
        lazily, every worker paid a batch query per DIGEST_BATCH bundles while requests
        waited on it (p99 hundreds of ms on a 2,000-step store). `everything`: `keys` are
        all the catalog's bundles, read in one query with no key filter (a filter on a
        long key list costs more than the whole table's scan).

        A DuckDB snapshot packs them instead (`_pack`), however many, up to PACKED_CHARS:
        on a store much bigger than the digest cache nearly every first lookup of a step
        otherwise read its sample rows (issue 33: 1.5 of the 1.5-2 ms a lookup spent in
        the endpoint on a 100,000-step store).
        """
        if self.catalog.is_duckdb:
            return self._pack(keys)
        if not keys or samples > PRELOAD_SAMPLES or len(keys) > self.digest_size:
            return False
        loaded = _load_digests(self.catalog, None if everything else keys)
        with self._load_lock, self._lock:
            self._digests.update(loaded)
            while len(self._digests) > self.digest_size:
                self._digests.popitem(last=False)
        return True

    def _pack(self, keys: list[str]) -> bool:
        """Pack the digests of `keys` into `_packed` while it holds under PACKED_CHARS;
        True if any were packed.

        DuckDB aggregates them: 1 s for a 100,000-step store at start-up; a view build
        after a sync packs only its new bundles (0.1 s for 1,000 steps into 100,000)."""
        if not keys:
            return False
        with self._load_lock:
            if self._packed_chars >= PACKED_CHARS:
                return False
            for packed in _pack_digests(self._driver(), keys):
                with self._lock:
                    for key, text in packed:
                        if self._packed_chars >= PACKED_CHARS:
                            return True
                        if key not in self._packed:
                            self._packed[key] = text
                            self._packed_chars += len(text)
        return True

    def _hit_digests(self, keys: Iterable[str], out: dict[str, SampleDigest]) -> list[str]:
        """Move cached (or packed) digests of `keys` into `out`; the keys neither cached
        nor packed (hold `_lock`)."""
        missing = []
        for key in keys:
            hit = self._digests.get(key)
            if hit is None:
                text = self._packed.get(key)
                if text is None:
                    missing.append(key)
                    continue
                hit = self._digests[key] = _unpack(text)
                while len(self._digests) > self.digest_size:
                    self._digests.popitem(last=False)
            else:
                self._digests.move_to_end(key)
            out[key] = hit
        return missing


@dataclass(frozen=True)
class SampleDigest:
    """One bundle's samples as a step summary sees them (read-only once built)."""

    num_samples: int
    num_tokens: int
    num_response_tokens: int
    #: (semantic_group, group_index) -> sample ids, in sample order
    groups: dict[tuple, list[str]]
    #: (micro_batch_id, the sample's own rank or None) -> number of samples
    micro_batches: dict[tuple, int]


#: the in-memory snapshot's index on samples.bundle_key (`index_snapshot`)
SNAPSHOT_SAMPLES_INDEX = "ix_snapshot_samples_bundle_key"


def index_snapshot(catalog: Catalog) -> None:
    """Index the in-memory snapshot's samples by bundle key, so that a step lookup whose
    digest is not cached reads its own sample rows (an index probe) instead of scanning
    every sample of the store: without it a miss cost a scan that grows with the store
    (about 15 ms at 10,000 steps, ten times that at 100,000) and, with the cache bounded,
    most lookups on a big store miss. Built once per server start (O(samples))."""
    if not catalog.is_duckdb:
        return  # a server database keeps its own indexes (samples' primary key leads by key)
    with catalog.begin() as conn:
        conn.exec_driver_sql(
            f"CREATE INDEX IF NOT EXISTS {SNAPSHOT_SAMPLES_INDEX} ON samples (bundle_key)"
        )


def _load_digests_by_key(driver: Any, keys: list[str]) -> dict[str, SampleDigest]:
    """The digests of `keys` (a DuckDB catalog, through its `driver` connection), one key
    at a time: each an equality on samples.bundle_key, which the snapshot's index answers
    in about a millisecond whatever the store's size (an IN list is not answered from a
    DuckDB index: it scans). The few sample rows of a bundle are put in sample order and
    summed here (`_digest`), through the driver: SQLAlchemy's statement and row handling
    cost more than the probe, and an ORDER BY in the query about half a millisecond more
    than sorting its rows here."""
    columns = ", ".join(_DIGEST_COLUMNS)
    sql = f"SELECT position, {columns} FROM samples WHERE bundle_key = ?"
    out: dict[str, SampleDigest] = {}
    for key in keys:
        rows = driver.execute(sql, [key]).fetchall()
        if rows:
            rows.sort(key=_first)
            out[key] = _digest(row[1:] for row in rows)
    return out


def _first(row: tuple) -> Any:
    return row[0]


#: a bundle's digest as one JSON text, built by DuckDB: [groups, micro-batches], each group
#: [semantic_group, group_index, [sample ids in sample order], tokens, response tokens], each
#: micro-batch [micro_batch_id, rank, samples], both in order of their first sample
_PACK_SQL = """
WITH g AS (
    SELECT bundle_key, min(position) AS first,
        json_array(semantic_group, group_index, list(sample_id ORDER BY position),
                   sum(total_length), sum(response_length))::VARCHAR AS part
    FROM samples {where} GROUP BY bundle_key, semantic_group, group_index
), m AS (
    SELECT bundle_key, min(position) AS first,
        json_array(micro_batch_id, rank, count(*))::VARCHAR AS part
    FROM samples {where} GROUP BY bundle_key, micro_batch_id, rank
), gs AS (
    SELECT bundle_key, string_agg(part, ',' ORDER BY first) AS parts FROM g GROUP BY bundle_key
), ms AS (
    SELECT bundle_key, string_agg(part, ',' ORDER BY first) AS parts FROM m GROUP BY bundle_key
)
SELECT bundle_key, '[[' || gs.parts || '],[' || ms.parts || ']]'
FROM gs JOIN ms USING (bundle_key)
"""


def _pack_digests(driver: Any, keys: list[str]) -> Iterator[list[tuple[str, str]]]:
    """(key, packed digest) of `keys`' bundles with samples, through a DuckDB `driver`
    connection, a list per query; `_unpack` reads one back. The aggregation runs in DuckDB
    (about 1 s for 2.3 million samples): built in Python, the same digests took 7 s and
    800 MB of objects. Up to PACK_CHUNK keys in one query, more by ranges of PACK_CHUNK
    (sorted: DuckDB compares strings by their UTF-8 bytes, the order of their code points)."""
    if len(keys) <= PACK_CHUNK:
        where = "WHERE bundle_key IN (SELECT unnest($keys))"
        yield driver.execute(_PACK_SQL.format(where=where), {"keys": keys}).fetchall()
        return
    wanted = set(keys)
    ordered = sorted(wanted)
    sql = _PACK_SQL.format(where="WHERE bundle_key BETWEEN $low AND $high")
    for start in range(0, len(ordered), PACK_CHUNK):
        part = ordered[start : start + PACK_CHUNK]
        rows = driver.execute(sql, {"low": part[0], "high": part[-1]}).fetchall()
        yield [row for row in rows if row[0] in wanted]


def _unpack(text: str) -> SampleDigest:
    """The digest `_pack_digests` packed (the same as `_digest` of its sample rows)."""
    groups_part, batches_part = json.loads(text)
    groups: dict[tuple, list[str]] = {}
    count = tokens = response_tokens = 0
    for group, index, sample_ids, total, response in groups_part:
        groups[group, index] = sample_ids
        count += len(sample_ids)
        tokens += total or 0
        response_tokens += response or 0
    micro_batches = {(micro_batch, rank): n for micro_batch, rank, n in batches_part}
    return SampleDigest(count, tokens, response_tokens, groups, micro_batches)


def _load_digests(catalog: Catalog, keys: list[str] | None) -> dict[str, SampleDigest]:
    """The digests of `keys` (None: every bundle; those with samples): aggregated by the
    database, one row per (bundle, group) and per (bundle, micro-batch), not per sample."""
    s = tables.samples
    where = sa.true() if keys is None else s.c.bundle_key.in_(keys)
    by_group = (
        sa.select(
            s.c.bundle_key,
            s.c.semantic_group,
            s.c.group_index,
            sa.func.array_agg(aggregate_order_by(s.c.sample_id, s.c.position)),
            sa.func.sum(s.c.total_length),
            sa.func.sum(s.c.response_length),
        )
        .where(where)
        .group_by(s.c.bundle_key, s.c.semantic_group, s.c.group_index)
    )
    by_micro_batch = (
        sa.select(s.c.bundle_key, s.c.micro_batch_id, s.c.rank, sa.func.count())
        .where(where)
        .group_by(s.c.bundle_key, s.c.micro_batch_id, s.c.rank)
    )
    with catalog.connect() as conn, conn.begin():  # one snapshot for both queries
        groups = conn.execute(by_group).all()
        micro_batches = conn.execute(by_micro_batch).all()
    counts: dict[str, list[int]] = {}  # key -> [samples, tokens, response tokens]
    by_key: dict[str, dict[tuple, list[str]]] = {}
    for key, group, index, sample_ids, tokens, response_tokens in groups:
        count = counts.setdefault(key, [0, 0, 0])
        count[0] += len(sample_ids)
        count[1] += int(tokens or 0)
        count[2] += int(response_tokens or 0)
        by_key.setdefault(key, {})[group, index] = list(sample_ids)
    batches: dict[str, dict[tuple, int]] = {}
    for key, micro_batch, rank, samples in micro_batches:
        batches.setdefault(key, {})[micro_batch, rank] = int(samples)
    return {
        key: SampleDigest(*count, by_key[key], batches.get(key, {}))
        for key, count in counts.items()
    }


_DIGEST_COLUMNS = (
    "sample_id",
    "semantic_group",
    "group_index",
    "micro_batch_id",
    "rank",
    "total_length",
    "response_length",
)


def _digest_row(sample: dict[str, Any]) -> tuple:
    return tuple(sample[column] for column in _DIGEST_COLUMNS)


def _digest(rows: Iterable[tuple]) -> SampleDigest:
    """The digest of one bundle's sample rows (`_DIGEST_COLUMNS`, in sample order)."""
    groups: dict[tuple, list[str]] = {}
    micro_batches: dict[tuple, int] = {}
    count = tokens = response_tokens = 0
    for sample_id, group, index, micro_batch, rank, total, response in rows:
        count += 1
        tokens += total or 0
        response_tokens += response or 0
        groups.setdefault((group, index), []).append(sample_id)
        micro_batches[micro_batch, rank] = micro_batches.get((micro_batch, rank), 0) + 1
    return SampleDigest(count, tokens, response_tokens, groups, micro_batches)


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
    keys: tuple[str, ...] = ()  # every bundle key, in catalog order
    position: dict[str, int] = field(default_factory=dict)  # key -> its index in `keys`

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

    def sample_digests(self, keys: list[str]) -> dict[str, SampleDigest]:
        """The sample digests of `keys`' bundles; a miss also loads the bundles that follow
        the first key in catalog order (the next steps a reader is likely to ask for)."""
        if not isinstance(self.samples, SampleCache):
            return {
                key: _digest(rows)
                for key in keys
                if (rows := [_digest_row(row) for row in self.samples.get(key, [])])
            }
        start = self.position.get(keys[0], len(self.keys)) + 1 if keys else 0
        return self.samples.digests(keys, self.keys[start : start + 4 * DIGEST_BATCH])


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
            # the last row of a bundle is its latest result (queries.whole_first)
            sa.select(results).order_by(
                whole_first(results).desc(),
                results.c.recorded_at.asc().nulls_first(),
                results.c.id.asc(),
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
    new_samples = sum(bundles[key]["num_samples"] or 0 for key in new_keys)
    samples.preload(new_keys, new_samples, everything=len(new_keys) == len(bundles))
    keys = tuple(bundles)
    position = {key: index for index, key in enumerate(keys)}
    return View(
        generation,
        bundles,
        samples,
        payloads,
        latest,
        groups,
        runs,
        steps_of_rollout,
        keys,
        position,
    )


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
        #: the watched directories were settled when the last sync listed them (see refresh)
        self._settled = False
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
                index_snapshot(cat)
                return cat
            snapshot = cat.snapshot_in_memory()
            index_snapshot(snapshot)
            return snapshot
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
            # mtime granularity backstop: a document created in the same clock tick as the
            # stamp's would not move it. Not needed once the directories were settled when
            # last listed (unchanged SETTLE_NS before the listing: a later change moves their
            # mtime); listing every 5 s cost ~0.8 s of CPU, holding the GIL, per 20,000 steps.
            stale = not self._settled and now - self._last_sync > 5.0
            if not force and (
                (stamp == self._stamp and not stale) or now - self._last_sync < self.min_interval_s
            ):
                return False
            self._last_sync = now
            listed_ns = time.time_ns()
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
            self._settled = all(d is not None and d[0] <= listed_ns - SETTLE_NS for d in stamp)
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
        if isinstance(self.view.samples, SampleCache):
            self.view.samples.close()
        self.catalog.close()


def keys_of(rows: Iterable[dict[str, Any]]) -> list[str]:
    return [r["key"] for r in rows]
