"""Ingest many targets at once on an executor (`trajstore ingest --executor ray`).

One job per target (a bundle or cohort directory): the worker opens the store
itself (`Store.open(location)`: a directory every worker can reach, or an
`s3://` URL) and runs the ordinary ingest of that one target. Ingest is
already idempotent (same content -> same attempt claim -> no new ref when its
key is live), so a job rerun after its worker died publishes nothing twice.
The target directories must be readable from the workers (the same host or a
shared mount); the store is the only other thing they share.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trajstore.errors import TrajstoreError
from trajstore.executors import ExecutorSpec, make_executor
from trajstore.store.ingest import IngestOutcome

#: what an ingest worker imports (a local pool's fork server imports them once for all)
WORKER_MODULES = ("trajstore.store.ingest_batch", "trajstore.store")
#: open stores of a worker process, by (process, location, catalog)
_stores: dict[tuple[int, str, str | None], Any] = {}


@dataclass(frozen=True)
class IngestJob:
    """One target for one worker (picklable: it travels to the cluster)."""

    store: str
    catalog_url: str | None
    path: str
    run: str


def ingest_job(job: IngestJob) -> list[IngestOutcome]:
    """The outcomes of ingesting `job.path` (one per target found there)."""
    from trajstore.store import Store

    key = (os.getpid(), job.store, job.catalog_url)
    store = _stores.get(key)
    if store is None:
        store = _stores[key] = Store.open(job.store, create=False, catalog_url=job.catalog_url)
    return store.ingest([job.path], run=job.run, progress=False)


def ingest_on_executor(
    location: str | os.PathLike[str],
    paths: Iterable[str | os.PathLike[str]],
    run: str,
    spec: ExecutorSpec,
    *,
    catalog_url: str | None = None,
    on_outcome: Callable[[IngestOutcome], None] | None = None,
) -> list[IngestOutcome]:
    """Ingest every target under `paths` into the store at `location`, spread over `spec`.

    Outcomes arrive in the order jobs finish; `on_outcome` sees each as soon
    as it is final.
    """
    from trajstore.bundle.capture_dir import discover_targets
    from trajstore.store import Store
    from trajstore.store.ingest import check_run_name

    check_run_name(run)
    where = str(location) if "://" in str(location) else str(Path(location).resolve())
    with Store.open(where, create=True, catalog_url=catalog_url) as store:
        # a server catalog is created and migrated here once, not raced by the workers
        store.index_new()
    outcomes: list[IngestOutcome] = []

    def emit(outcome: IngestOutcome) -> None:
        outcomes.append(outcome)
        if on_outcome is not None:
            on_outcome(outcome)

    shown: dict[str, str] = {}  # the absolute path a worker reads -> the path as discovered
    for p in paths:
        try:
            found = discover_targets(Path(p))
        except TrajstoreError as exc:
            emit(IngestOutcome(str(p), "refused", reason=str(exc)))
            continue
        shown.update({str(Path(t).resolve()): str(t) for t in found})
    jobs = [IngestJob(where, catalog_url, path, run) for path in shown]
    with make_executor(spec, WORKER_MODULES) as pool:
        for done in pool.map_unordered(ingest_job, jobs):
            for outcome in done:
                outcome.path = shown.get(outcome.path, outcome.path)
                emit(outcome)
    return outcomes
