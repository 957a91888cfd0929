"""The capture writer: assemble, write and (in store mode) ingest bundles (`BundleSink`),
on a thread of the training process (`CaptureWriter`, ``TRAJSTORE_CAPTURE_WRITER=thread``)
or in the writer process (`trajstore.capture.writer_process`, the default on POSIX).

Why apart from the training thread: it only snapshots and enqueues
(`trajstore.capture.manager`); everything slow (assembling the bundle, torch
serialization, fsync when durable, the store's ingest) happens here, at a lower OS
priority, and every failure is logged and counted instead of raised.

Into an `s3://` store no rank sees another's files: each stages in a private
local directory, stores its own cohort shard (`trajstore.store.shards`) and
the last rank to arrive publishes the cohort.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

from trajstore.bundle.assemble import CapturedRecord, build_contents
from trajstore.bundle.capture_dir import rollout_dir_name, step_dir_name
from trajstore.bundle.writer import write_bundle, write_rank
from trajstore.capture.config import CaptureConfig
from trajstore.capture.redaction import filter_config
from trajstore.capture.stats import CaptureStats
from trajstore.errors import StoreError

logger = logging.getLogger("trajstore.capture")

#: store mode stages bundles under ``<store>/.capture-staging/<run>/`` before ingest
STAGING = ".capture-staging"
#: queued behind every record by `stop`: the writer has nothing more to write
STOP = object()


class BundleSink:
    """Writes captured records as bundles (and ingests them in store mode), one at a time.

    The part of the writer that is neither a queue nor a thread: the writer thread runs
    one, and the writer process (`trajstore.capture.writer_process`) one per manager."""

    def __init__(
        self, config: CaptureConfig, stats: CaptureStats, default_recompute: dict[str, Any]
    ):
        self.config = config
        self.stats = stats
        self._default_recompute = default_recompute
        self._remote = str(config.store_dir or "").startswith("s3://")
        #: the store, opened once for the sink's life and closed with it: a Store keeps
        #: its parsed refs and pack index and refreshes them by what is new, so ingesting a
        #: bundle reads the refs published since the last one, where opening it per bundle
        #: re-read the ref cache (~1 s of the writer's CPU at 100,000 refs)
        self._store: Any = None
        self._private: Path | None = None  # this process's staging for an s3:// store

    def write(self, rec: CapturedRecord) -> None:
        """Write ``rec``, counting it written or (logged) failed; never raises."""
        try:
            self._write(rec)
            self.stats.count_written()
        except Exception:  # noqa: BLE001 - logged and counted, never raised
            what = (
                f"writing step {rec.rollout_id}:{rec.step_id}"
                if rec.kind == "step"
                else f"writing rollout {rec.rollout_id}"
            )
            self.stats.count_error(what)

    def close(self) -> None:
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.close()
            self._store = None

    def _base_dir(self) -> Path:
        cfg = self.config
        if self._remote:
            if self._private is None:
                self._private = Path(tempfile.mkdtemp(prefix="trajstore-capture-"))
            return self._private / cfg.run
        if cfg.store_dir is not None:
            return Path(cfg.store_dir) / STAGING / cfg.run
        assert cfg.output_dir is not None
        return cfg.output_dir

    def _producers(self, kind: str) -> tuple[int, ...] | None:
        cfg = self.config
        if kind == "rollout" and cfg.rollout_ranks is not None:
            return cfg.rollout_ranks
        return cfg.producer_ranks

    def _write(self, rec: CapturedRecord) -> None:
        if rec.recompute is not None:
            recompute, _ = filter_config(rec.recompute)
        else:
            recompute = dict(self._default_recompute)
        contents = build_contents(rec, self.config, recompute)
        name = (
            rollout_dir_name(rec.rollout_id)
            if rec.kind == "rollout"
            else step_dir_name(rec.rollout_id, rec.step_id)
        )
        if self.config.store_dir is not None and not self._remote:
            self._open_store()  # the store must exist before staging lives inside it
        dest = self._base_dir() / name
        ranks = self._producers(rec.kind)
        if ranks is not None and len(ranks) > 1:
            write_rank(
                dest,
                contents,
                rank=int(self.config.rank),
                expected_ranks=list(ranks),
                durable=self.config.durable,
            )
            if self._remote:
                self._store_shard(dest, int(self.config.rank))
                return
            complete = (dest / "COMPLETE").exists()
        else:
            write_bundle(dest, contents, durable=self.config.durable)
            complete = True
        if complete and self.config.store_dir is not None:
            self._ingest(dest)

    def _open_store(self) -> Any:
        """The writer's store, opened on first use. A local store removed since is an error
        for that bundle (never silently re-created empty under the run's staging)."""
        from trajstore.store.api import Store  # lazy: the store is optional for capture

        if self._store is None:
            self._store = Store.open(str(self.config.store_dir))
        elif not self._remote and not self._store.layout.is_store():
            raise StoreError(f"{self._store.root}: the capture's store is gone")
        return self._store

    def _store_shard(self, cohort: Path, rank: int) -> None:
        """Store this rank's member of `cohort` in the s3:// store; publish if it is the last.

        The private staged copy is removed either way once stored; a refusal keeps it.
        """
        from trajstore.store.shards import store_rank_shard

        outcome = store_rank_shard(
            self._open_store(),
            cohort / f"rank-{rank}",
            self.config.run,
            session=self.config.session,
        )
        if outcome.published:
            self.stats.ingested += 1
        shutil.rmtree(cohort, ignore_errors=True)

    def _ingest(self, path: Path) -> None:
        """Ingest a completed staged bundle/cohort once (whichever rank claims it).

        On success the staged copy is removed; on refusal it stays for a later
        ``trajstore ingest`` and the failure is counted.
        """
        claims = path.parent / ".claims"
        claims.mkdir(parents=True, exist_ok=True)
        # Keyed by the COMPLETE bytes: a re-capture of the same step (resume) is a new claim.
        key = hashlib.sha256((path / "COMPLETE").read_bytes()).hexdigest()[:16]
        try:
            fd = os.open(claims / f"{path.name}.{key}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return
        os.close(fd)
        outcomes = self._open_store().ingest([path], run=self.config.run)
        refused = [o for o in outcomes if getattr(o, "status", "published") == "refused"]
        if refused or not outcomes:
            why = refused[0].reason if refused else "nothing ingested"
            raise RuntimeError(f"store refused {path.name}: {why}; staged copy kept at {path}")
        self.stats.ingested += 1
        shutil.rmtree(path, ignore_errors=True)


class QueuedWriter:
    """The bounded queue of snapshot records both writers drain (the thread here, the
    feeder of `trajstore.capture.writer_process`): `put` drops or waits as configured, and
    `stop` queues `STOP` behind everything queued."""

    def __init__(self, config: CaptureConfig, stats: CaptureStats):
        self.config = config
        self.stats = stats
        self._queue: queue.Queue = queue.Queue(maxsize=config.queue_size)

    def put(self, rec: CapturedRecord) -> bool:
        """Queue a record (waiting for space when configured to block); False when full."""
        try:
            if self.config.block:
                self._queue.put(rec)
            else:
                self._queue.put_nowait(rec)
        except queue.Full:
            return False
        return True


class CaptureWriter(QueuedWriter):
    """The writer thread: drains the queue into a `BundleSink`."""

    def __init__(
        self, config: CaptureConfig, stats: CaptureStats, default_recompute: dict[str, Any]
    ):
        super().__init__(config, stats)
        self._sink = BundleSink(config, stats, default_recompute)
        self._thread = threading.Thread(
            target=self._run, name="trajstore-capture-writer", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float | None = None) -> bool:
        """Write everything queued, then stop. False when still busy after ``timeout``."""
        self._queue.put(STOP)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        with contextlib.suppress(Exception):  # a lower priority: training first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        try:
            while (rec := self._queue.get()) is not STOP:
                self._sink.write(rec)
        finally:
            self._sink.close()
