"""Replay every matching bundle of a store on an executor (local processes or Ray).

Workers each open the store themselves and write result documents directly
(no catalog lock), so an interrupted run keeps what it finished; a rerun
skips bundles that already have a result from this trajstore version unless
``force``. A result's name is fixed by the run and the bundle key
(`result_name`) and written create-if-absent, so a job run twice (Ray retries
a job whose worker died) records each bundle once. Memory is bounded by one
chunk of targets per worker.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trajstore import __version__
from trajstore.errors import TrajstoreError
from trajstore.vocab import Verdict


@dataclass(frozen=True)
class BatchTarget:
    run: str
    kind: str
    rollout_id: int
    step_id: int | None
    keys: tuple[str, ...]

    def describe(self) -> str:
        what = (
            f"{self.rollout_id}:{self.step_id}"
            if self.kind == "step"
            else f"rollout {self.rollout_id}"
        )
        return f"{self.run} {what}"


@dataclass
class BatchSummary:
    total: int = 0
    skipped: int = 0
    passed: int = 0
    diverged: int = 0
    unsupported: int = 0
    refused: int = 0
    histogram: Counter = field(default_factory=Counter)
    refusals: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "skipped_already_recorded": self.skipped,
            Verdict.PASS.value: self.passed,
            Verdict.DIVERGED.value: self.diverged,
            Verdict.UNSUPPORTED.value: self.unsupported,
            Verdict.REFUSED.value: self.refused,
            "first_divergent_stage_histogram": {
                str(stage): count for stage, count in sorted(self.histogram.items())
            },
            "refusals": self.refusals[:20],
            "seconds": round(self.seconds, 3),
        }


def list_targets(
    store: Any, *, run: str | None, rollout_from: int | None, rollout_to: int | None
) -> list[BatchTarget]:
    """Latest attempt of every (run, kind, anchor), all ranks, ordered by (run, rollout, step).
    A run the store does not hold, a reversed rollout range or a range holding none of
    the run's bundles is refused (it would select nothing and report "0 of 0 replayed"
    as a success)."""
    from trajstore.errors import UsageError, check_known_run

    live = list(store.refs.live().values())
    if rollout_from is not None and rollout_to is not None and rollout_from > rollout_to:
        raise UsageError(f"--rollout-from {rollout_from} is after --rollout-to {rollout_to}")
    check_known_run(run, (e.run for e in live))
    groups: dict[tuple, list] = {}
    for e in live:
        if run is not None and e.run != run:
            continue
        if rollout_from is not None and e.rollout_id < rollout_from:
            continue
        if rollout_to is not None and e.rollout_id > rollout_to:
            continue
        groups.setdefault((e.run, e.kind, e.rollout_id, e.step_id), []).append(e)
    if not groups and (rollout_from is not None or rollout_to is not None):
        held = sorted({e.rollout_id for e in live if run is None or e.run == run})
        what = f"run {run!r}" if run is not None else "the store"
        span = f"rollouts {held[0]}..{held[-1]}" if held else "no bundles"
        lo = "" if rollout_from is None else rollout_from
        hi = "" if rollout_to is None else rollout_to
        raise UsageError(f"no bundle of {what} in rollouts {lo}..{hi} (it holds {span})")
    out = []
    for (run_name, kind, rollout_id, step_id), entries in groups.items():
        latest = max(entry.attempt for entry in entries)
        keys = tuple(sorted(entry.key for entry in entries if entry.attempt == latest))
        out.append(BatchTarget(run_name, kind, rollout_id, step_id, keys))
    # rollouts first within a rollout id, so a step's linkage partner is replayed alongside
    out.sort(
        key=lambda target: (
            target.run,
            target.rollout_id,
            -1 if target.step_id is None else target.step_id,
        )
    )
    return out


def _recorded_keys(store: Any) -> set[str]:
    """Bundles with a whole replay recorded by this version (a partial one, some samples
    or stages, leaves the bundle to replay)."""
    import sqlalchemy as sa

    from trajstore.catalog import tables

    results = tables.replay_results
    with store.catalog() as cat, cat.connect() as conn:
        rows = conn.execute(
            sa.select(results.c.bundle_key)
            .where(results.c.trajstore_version == __version__, results.c.selection.is_(None))
            .distinct()
        )
        return {row[0] for row in rows}


#: open stores by (process, store, catalog), reused by every job a worker runs (a forked
#: worker opens its own: the pid differs)
_stores: dict[tuple[int, str, str | None], Any] = {}
#: per worker process: rollout reports reused by the steps of the same rollout, for the
#: (store, replay-all run) the last job came from (keys are unique only within a store)
_rollout_cache: dict = {}
_rollout_cache_owner: list[tuple[str, str]] = []
#: targets per job of small rollout ids sharing one (a larger rollout id is a job of its own)
CHUNK = 4
#: a rollout id's targets go to one job up to this many: each step's linkage check replays
#: its rollout, once a worker (`_rollout_cache`), so a rollout id split over two jobs that
#: two workers run at once was replayed by both (4 steps a rollout, 2 workers: every
#: rollout twice, `replay --all` ~8% slower)
GROUP_MAX = 16
#: what a replay worker imports (a local pool's fork server imports them once for all)
WORKER_MODULES = ("trajstore.replay.batch", "trajstore.replay.from_store", "trajstore.store")


@dataclass(frozen=True)
class ReplayJob:
    """A chunk of targets for one worker; everything it needs travels with it (picklable)."""

    store: str
    catalog_url: str | None
    targets: tuple[BatchTarget, ...]
    record: bool
    batch_id: str
    #: a fresh document name taken when the job is submitted: its results are named
    #: `<stamp>-<key digest>`, the same on a retry and no older than the job
    stamp: str


def result_name(stamp: str, key: str) -> str:
    """The result document name of `key` in one job: a retried job reuses it. It sorts by
    the job's submission time, as a server catalog's incremental sync expects."""
    from blake3 import blake3

    return f"{stamp}-{blake3(key.encode()).hexdigest()[:16]}"


def _open_store(store: str, catalog_url: str | None) -> Any:
    from trajstore.store import Store

    key = (os.getpid(), store, catalog_url)
    opened = _stores.get(key)
    if opened is None:
        opened = _stores[key] = Store.open(store, create=False, catalog_url=catalog_url)
    return opened


def _forget_stores() -> None:
    """Close this process's cached stores (the in-process worker of a one-worker run)."""
    for key in [k for k in _stores if k[0] == os.getpid()]:
        _stores.pop(key).close()
    _rollout_cache.clear()
    _rollout_cache_owner.clear()


def replay_job(job: ReplayJob) -> list[tuple[str, str, str | None, str | None]]:
    """(target, status, first divergent stage, error) for each target of `job`.

    Results are written create-if-absent under `result_name(job.stamp, key)`,
    so running a job twice (a Ray retry after its worker died) records once.
    """
    store = _open_store(job.store, job.catalog_url)
    if _rollout_cache_owner != [(job.store, job.batch_id)]:
        _rollout_cache.clear()
        _rollout_cache_owner[:] = [(job.store, job.batch_id)]
    return [_replay_one(store, target, job) for target in job.targets]


def _replay_one(
    store: Any, target: BatchTarget, job: ReplayJob
) -> tuple[str, str, str | None, str | None]:
    from trajstore.replay.from_store import Target, replay_stored, result_document, write_result

    try:
        stored_target = Target(
            run=target.run,
            step=(target.rollout_id, target.step_id) if target.kind == "step" else None,
            rollout=target.rollout_id if target.kind == "rollout" else None,
        )
        report = replay_stored(store, stored_target, rollout_cache=_rollout_cache)
        if job.record:
            for key in target.keys:
                doc = result_document(report, store.bundle(key))
                write_result(store, doc, name=result_name(job.stamp, key))
            store.objs.flush()
        return target.describe(), report.status, report.first_divergent_stage, None
    except TrajstoreError as exc:
        if job.record:
            _record_refusal(store, target, str(exc), job.stamp)
        return target.describe(), Verdict.REFUSED, None, str(exc)


def _record_refusal(store: Any, target: BatchTarget, reason: str, stamp: str) -> None:
    from trajstore.replay.from_store import refusal_document, write_result

    for key in target.keys:
        doc = refusal_document(key, target.run, target.rollout_id, target.step_id, reason)
        write_result(store, doc, name=result_name(stamp, key))


def _chunks(
    targets: list[BatchTarget], size: int, group_max: int = GROUP_MAX
) -> list[tuple[BatchTarget, ...]]:
    """Jobs of whole rollout ids (a rollout and its steps, up to `group_max` targets, a
    larger one in pieces of that many), smaller rollout ids together up to `size`."""
    groups: list[list[BatchTarget]] = []
    for target in targets:
        if groups and (groups[-1][-1].run, groups[-1][-1].rollout_id) == (
            target.run,
            target.rollout_id,
        ):
            groups[-1].append(target)
        else:
            groups.append([target])
    out: list[list[BatchTarget]] = []
    for group in groups:
        for i in range(0, len(group), group_max):
            piece = group[i : i + group_max]
            if out and len(out[-1]) + len(piece) <= size:
                out[-1] += piece
            else:
                out.append(list(piece))
    return [tuple(chunk) for chunk in out]


def replay_all(
    root: str | Path,
    *,
    run: str | None = None,
    rollout_from: int | None = None,
    rollout_to: int | None = None,
    workers: int | None = None,
    record: bool = False,
    force: bool = False,
    progress: bool | None = None,
    executor: str = "local",
    ray_address: str | None = None,
    catalog_url: str | None = None,
) -> BatchSummary:
    """Replay the latest attempt of every matching bundle on `executor` ("local" or "ray").

    Each worker opens the store itself (a path or URL: `Store.open(root)`), so
    with Ray the workers read straight from the store, not through this process.
    """
    from trajstore.executors import ExecutorSpec, make_executor
    from trajstore.store import Store
    from trajstore.store.layout import new_doc_name

    start = time.perf_counter()
    spec = ExecutorSpec(executor, workers, ray_address)
    where = str(root) if "://" in str(root) else str(Path(root).resolve())
    store = Store.open(where, create=False, catalog_url=catalog_url)
    targets = list_targets(store, run=run, rollout_from=rollout_from, rollout_to=rollout_to)
    summary = BatchSummary(total=len(targets))
    if record and not force:
        done = _recorded_keys(store)
        todo = [target for target in targets if not all(key in done for key in target.keys)]
        summary.skipped = len(targets) - len(todo)
        targets = todo
    show = sys.stderr.isatty() if progress is None else progress
    batch_id = new_doc_name()
    # a generator: each job is stamped when the executor takes it
    jobs = (
        ReplayJob(where, catalog_url, chunk, record, batch_id, new_doc_name())
        for chunk in _chunks(targets, CHUNK)
    )
    i = 0
    try:
        with make_executor(spec, WORKER_MODULES) as pool:
            for results in pool.map_unordered(replay_job, jobs):
                for what, status, stage, err in results:
                    i += 1
                    _count(summary, what, status, stage, err)
                if show:
                    sys.stderr.write(f"\rreplay: {i}/{len(targets)} bundles")
                    sys.stderr.flush()
    finally:
        _forget_stores()
        if show and targets:
            sys.stderr.write("\n")
    try:
        if record:
            _index_results(store, catalog_url, batch_id)
    finally:
        store.close()
    summary.seconds = time.perf_counter() - start
    return summary


def _index_results(store: Any, catalog_url: str | None, batch_id: str) -> None:
    """Apply this run's results to a server catalog (a DuckDB catalog syncs when read).

    A server catalog's incremental sync lists result names after its high-water mark
    minus a margin. Another writer may have moved the mark past this run's first
    names while it ran (a long run, or a writer whose clock is ahead), so the listing
    here reaches back to the run's start (`batch_id` is named then), margin included.
    """
    import sqlalchemy as sa

    from trajstore.catalog import tables
    from trajstore.catalog.access import is_server_url
    from trajstore.catalog.db import open_catalog
    from trajstore.catalog.sync import sync_new
    from trajstore.listing import listing_margin_s

    if not is_server_url(catalog_url):
        return
    state = tables.sync_state
    with open_catalog(store.root, catalog_url) as cat:
        with cat.connect() as conn:
            mark = conn.execute(
                sa.select(state.c.high_water).where(state.c.directory == "results")
            ).scalar()
        behind_s = max(0, int((mark or batch_id)[:20]) - int(batch_id[:20])) / 1e9
        sync_new(cat, store.space, store.load_document, margin_s=behind_s + listing_margin_s())


def _count(
    summary: BatchSummary, what: str, status: str, stage: str | None, err: str | None
) -> None:
    if status == Verdict.PASS:
        summary.passed += 1
    elif status == Verdict.DIVERGED:
        summary.diverged += 1
    elif status == Verdict.UNSUPPORTED:
        summary.unsupported += 1
    else:
        summary.refused += 1
        summary.refusals.append(f"{what}: {err}")
    if stage:
        summary.histogram[stage] += 1
