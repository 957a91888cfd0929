"""Replay every matching bundle of a store in worker processes.

Workers each open the store themselves and write result documents directly
(no catalog lock), so an interrupted run keeps what it finished; a rerun
skips bundles that already have a result from this trajstore version unless
``force``. Memory is bounded by one target per worker.
"""

from __future__ import annotations

import multiprocessing as mp
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
    """Latest attempt of every (run, kind, anchor), all ranks, ordered by (run, rollout, step)."""
    groups: dict[tuple, list] = {}
    for e in store.refs.live().values():
        if run is not None and e.run != run:
            continue
        if rollout_from is not None and e.rollout_id < rollout_from:
            continue
        if rollout_to is not None and e.rollout_id > rollout_to:
            continue
        groups.setdefault((e.run, e.kind, e.rollout_id, e.step_id), []).append(e)
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
    import sqlalchemy as sa

    from trajstore.catalog import tables

    results = tables.replay_results
    with store.catalog() as cat, cat.connect() as conn:
        rows = conn.execute(
            sa.select(results.c.bundle_key)
            .where(results.c.trajstore_version == __version__)
            .distinct()
        )
        return {row[0] for row in rows}


_worker_store = None
#: per worker: rollout reports reused by the steps of the same rollout
_rollout_cache: dict = {}


def _worker_init(root: str) -> None:
    global _worker_store
    from trajstore.store import Store

    _worker_store = Store.open(root, create=False)


def _replay_one(args: tuple[BatchTarget, bool]) -> tuple[str, str, str | None, str | None]:
    """(target, status, first divergent stage, error) for one target."""
    target, record = args
    from trajstore.replay.from_store import Target, record_report, replay_stored

    store = _worker_store
    try:
        stored_target = Target(
            run=target.run,
            step=(target.rollout_id, target.step_id) if target.kind == "step" else None,
            rollout=target.rollout_id if target.kind == "rollout" else None,
        )
        report = replay_stored(store, stored_target, rollout_cache=_rollout_cache)
        if record:
            sources = [store.bundle(k) for k in target.keys]
            record_report(store, report, sources)
            store.objs.flush()
        return target.describe(), report.status, report.first_divergent_stage, None
    except TrajstoreError as exc:
        if record:
            _record_refusal(store, target, str(exc))
        return target.describe(), Verdict.REFUSED, None, str(exc)


def _record_refusal(store: Any, target: BatchTarget, reason: str) -> None:
    from trajstore.replay.from_store import refusal_document, write_result

    for key in target.keys:
        write_result(
            store, refusal_document(key, target.run, target.rollout_id, target.step_id, reason)
        )


def replay_all(
    root: Path,
    *,
    run: str | None = None,
    rollout_from: int | None = None,
    rollout_to: int | None = None,
    workers: int = 1,
    record: bool = False,
    force: bool = False,
    progress: bool | None = None,
) -> BatchSummary:
    from trajstore.store import Store

    start = time.perf_counter()
    store = Store.open(root, create=False)
    targets = list_targets(store, run=run, rollout_from=rollout_from, rollout_to=rollout_to)
    summary = BatchSummary(total=len(targets))
    if record and not force:
        done = _recorded_keys(store)
        todo = [target for target in targets if not all(key in done for key in target.keys)]
        summary.skipped = len(targets) - len(todo)
        targets = todo
    show = sys.stderr.isatty() if progress is None else progress
    jobs = [(target, record) for target in targets]
    if workers <= 1:
        _worker_init(str(root))
        results = map(_replay_one, jobs)
        pool = None
    else:
        ctx = (
            mp.get_context("fork") if sys.platform.startswith("linux") else mp.get_context("spawn")
        )
        pool = ctx.Pool(workers, initializer=_worker_init, initargs=(str(root),))
        results = pool.imap_unordered(_replay_one, jobs, chunksize=4)
    try:
        for i, (what, status, stage, err) in enumerate(results, 1):
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
            if show:
                sys.stderr.write(f"\rreplay: {i}/{len(jobs)} bundles")
                sys.stderr.flush()
    finally:
        if pool is not None:
            pool.terminate() if sys.exc_info()[0] else pool.close()
            pool.join()
        if show and jobs:
            sys.stderr.write("\n")
    summary.seconds = time.perf_counter() - start
    return summary
