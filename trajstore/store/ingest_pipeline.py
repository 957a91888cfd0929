"""Ingest of many targets: the pipeline that runs the four steps of `ingest` on threads
(verify one target ahead; write a batch's targets into one pack; flush it; publish its
refs), and the progress bar. `ingest_paths` is what `Store.ingest` runs."""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from trajstore.errors import BundleError, TrajstoreError
from trajstore.store import gclock
from trajstore.store.ingest import (
    Ingestor,
    IngestOutcome,
    VerifiedTarget,
    WrittenTarget,
    check_run_name,
)


class Progress:
    """A one-line progress bar on stderr, only when stderr is a terminal."""

    def __init__(self, total: int, enabled: bool | None = None) -> None:
        self.total = total
        self.done = 0
        self.bytes = 0
        self.start = time.monotonic()
        self.enabled = sys.stderr.isatty() if enabled is None else enabled

    def update(self, outcome: IngestOutcome) -> None:
        self.done += 1
        self.bytes += outcome.logical_bytes
        if not self.enabled:
            return
        rate = self.bytes / max(time.monotonic() - self.start, 1e-6) / 1e6
        width = 30
        fill = int(width * self.done / max(self.total, 1))
        sys.stderr.write(
            f"\ringest [{'#' * fill}{'.' * (width - fill)}] "
            f"{self.done}/{self.total} {rate:7.1f} MB/s"
        )
        sys.stderr.flush()

    def clear(self) -> None:
        """Erase the bar's line, so a line printed next does not start after it."""
        if self.enabled:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def ingest_paths(
    ingestor: Ingestor,
    paths: Iterable[Path | str],
    run: str,
    *,
    progress: bool | None = None,
    on_outcome: Callable[[IngestOutcome], None] | None = None,
) -> list[IngestOutcome]:
    """Ingest every bundle/cohort at or below `paths`, as a pipeline (`_Pipeline`).

    `on_outcome` sees each outcome as soon as it is final (a published target's
    refs are already created), in the order of the returned list (the targets'
    order). Ctrl-C stores the targets that already passed the gate, then raises.
    """
    from trajstore.bundle.capture_dir import discover_targets

    targets: list[Path] = []
    outcomes: list[IngestOutcome] = []
    for p in paths:
        try:
            targets += discover_targets(p)
        except TrajstoreError as e:  # its message starts with the path the outcome names
            reason = str(e).removeprefix(f"{p}: ")
            outcomes.append(IngestOutcome(str(p), "refused", reason=reason))
            if on_outcome is not None:
                on_outcome(outcomes[-1])
    if not targets:
        return outcomes
    check_run_name(run)
    bar = Progress(len(targets), progress)

    def emit(out: IngestOutcome) -> None:
        outcomes.append(out)
        if on_outcome is not None:
            bar.clear()
            on_outcome(out)
        bar.update(out)

    try:
        _Pipeline(ingestor, targets, run).run(emit)
    finally:
        bar.close()
    return outcomes


#: A batch of written targets ends (one pack flush, then their refs) at this many
#: payload bytes or targets, when a gc waits for the writer lock, ...
BATCH_BYTES = 256 << 20
BATCH_TARGETS = 64
#: ... or, while the finisher has nothing to do, at this many bytes or targets: the
#: finisher's fsyncs then overlap the writes of the next batch, and batches grow (fewer
#: fsyncs per target) only when the finisher is the slower stage.
_EAGER_BYTES = 64 << 20
_EAGER_TARGETS = 8
#: ... or when the gate has had none ready for this long (a slow or blocked source).
_LINGER_S = 0.5
#: targets written at once (zstd, BLAKE3 and the pack writes release the GIL)
_WRITERS = 2
_END = object()
_POLL_S = 0.05


class _Pipeline:
    """Ingest of many targets on threads: the gate runs one target ahead of the writers.

    The per-byte work (reading, sha256, parsing and the finite-value checks of the
    gate; BLAKE3, zstd and pack writes of the writers) is C code that releases the
    GIL, so they overlap. The writer loop batches: the objects of several gated
    targets go to one pack (one fsync for the batch, not one per target), then the
    refs of the batch are created (`_publish_all`). The order of the crash-safety
    argument is unchanged (a ref is created only after every object it names is
    flushed; nothing of a target is written before its whole gate passed).

    Memory: the gate holds at most two targets (the one it checks and one handed
    over), the writers `_WRITERS` targets plus the pack buffer (`pack_max_bytes`).

    Ctrl-C in the calling thread: the writer finishes the targets that already
    passed the gate (writes, flushes and publishes them; their outcomes are
    emitted), then `KeyboardInterrupt` is raised. A second Ctrl-C stops waiting.
    """

    def __init__(self, ingestor: Ingestor, targets: list[Path], run: str) -> None:
        self.ing = ingestor
        self.targets = targets
        self.run_name = run
        self.gated: queue.Queue[Any] = queue.Queue(maxsize=1)
        self.done: queue.Queue[Any] = queue.Queue()
        self.stop = threading.Event()

    def run(self, emit: Callable[[IngestOutcome], None]) -> None:
        threads = [
            threading.Thread(target=self._gate_loop, name="ingest-gate", daemon=True),
            threading.Thread(target=self._write_loop, name="ingest-write", daemon=True),
        ]
        for t in threads:
            t.start()
        interrupted: KeyboardInterrupt | None = None
        try:
            while True:
                try:
                    item = self.done.get()
                    if item is _END:
                        break
                    if isinstance(item, BaseException):
                        raise item
                    emit(item)
                except KeyboardInterrupt as e:
                    if interrupted is not None:
                        raise
                    interrupted = e
                    self.stop.set()
        finally:
            self.stop.set()  # whatever ends this loop (an error, `emit` raising) stops the threads
        if interrupted is not None:
            raise interrupted

    def _hand_over(self, item: Any) -> bool:
        """Put `item` for the writer; False if the pipeline stopped first."""
        while True:
            try:
                self.gated.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                if self.stop.is_set():
                    return False

    def _gate_loop(self) -> None:
        try:
            for t in self.targets:
                if self.stop.is_set() or not self._hand_over(self.ing.gate(t)):
                    return
            self._hand_over(_END)
        except BaseException as e:  # handed to the writer, raised in the calling thread
            self._hand_over(e)

    def _take(self, wait_s: float | None) -> Any:
        """The next gated item; None if none came within `wait_s` (None: no limit) or the
        pipeline stopped (items already handed over are still returned first)."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while True:
            try:
                return self.gated.get(timeout=_POLL_S)
            except queue.Empty:
                if self.stop.is_set() or (deadline is not None and time.monotonic() > deadline):
                    return None

    def _publish_all(self, written: list[WrittenTarget]) -> dict[int, IngestOutcome]:
        """Create the refs of flushed targets (`Ingestor.publish_many`), by id.

        A ref create is two fsyncs (file, directory), three documents a target, and
        most of a small target's fixed cost: the batch's documents are fsynced in one
        concurrent round (they share the file system's journal commits), then two
        directory fsyncs (claims, refs) serve the whole batch (`publish_many`).
        """
        outs = self.ing.publish_many(written, self.ing.live_keys())
        return {id(w): o for w, o in zip(written, outs, strict=True)}

    def _write_one(self, gated: VerifiedTarget) -> WrittenTarget | IngestOutcome:
        """Write a gated target, or refuse it if its source changed since the gate."""
        try:
            return self.ing.write(gated, self.run_name)
        except BundleError as e:
            return IngestOutcome(str(gated.path), "refused", reason=str(e))

    def _finish(
        self,
        batch: list[Future[WrittenTarget | IngestOutcome] | IngestOutcome],
        failed: threading.Event,
    ) -> None:
        """Wait for a batch's writes, flush its objects, then create its refs and emit its
        outcomes in target order (on the finisher thread, while the next batch is written).
        A failed write still lets the targets before it be published; its error is raised
        after them, and no later batch is published or emitted (`failed`)."""
        error: BaseException | None = None
        for x in batch:
            if isinstance(x, Future):
                try:
                    x.result()
                except BaseException as e:
                    error = error or e
        if failed.is_set():
            return  # an earlier batch failed: the loop stops; nothing of this one is emitted
        try:
            if error is not None:  # keep what precedes the first failure
                k = next(i for i, x in enumerate(batch) if isinstance(x, Future) and x.exception())
                del batch[k:]
            written = [
                r
                for x in batch
                if isinstance(x, Future) and isinstance(r := x.result(), WrittenTarget)
            ]
            outs: dict[int, IngestOutcome] = {}
            if written:
                self.ing.objs.flush()
                outs = self._publish_all(written)
            for x in batch:
                r = x if isinstance(x, IngestOutcome) else x.result()
                self.done.put(r if isinstance(r, IngestOutcome) else outs[id(r)])
        except BaseException as e:
            error = error or e
        if error is not None:
            failed.set()
            raise error

    def _write_loop(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        pending: list[Future[WrittenTarget | IngestOutcome] | IngestOutcome] = []
        inflight: list[Future[Any]] = []  # writes not yet done, of any batch
        finishing: list[Future[None]] = []  # batches handed to the finisher, oldest first
        failed = threading.Event()
        lock = contextlib.ExitStack()
        held = False  # the writer lock: from a batch's first object until its refs exist
        nbytes = 0

        def check(wait: bool) -> None:
            """Raise the first failure of a handed-over batch; with `wait`, wait for all."""
            while finishing and (wait or finishing[0].done()):
                finishing.pop(0).result()

        def seal() -> None:
            """Hand the current batch to the finisher, which flushes and publishes it while
            the next batch is written; raise an earlier batch's failure first."""
            nonlocal nbytes
            check(wait=False)
            if pending:
                finishing.append(finisher.submit(self._finish, pending.copy(), failed))
            pending.clear()
            nbytes = 0

        def drain() -> None:
            """Seal, wait until every batch is published, then release the writer lock."""
            nonlocal held
            try:
                seal()
                check(wait=True)
            finally:
                for f in finishing:  # after a failure: later batches only wait for writes
                    f.exception()
                finishing.clear()
                if held:
                    lock.close()
                    held = False

        try:
            with (
                ThreadPoolExecutor(_WRITERS, thread_name_prefix="ingest-write") as pool,
                ThreadPoolExecutor(1, thread_name_prefix="ingest-finish") as finisher,
            ):
                try:
                    while True:
                        item = self._take(_LINGER_S if pending or finishing else None)
                        if item is None:  # the gate is slow or blocked, or the pipeline stopped
                            drain()
                            if self.stop.is_set():
                                break
                            continue
                        if item is _END:
                            break
                        if isinstance(item, BaseException):
                            drain()  # store what passed before it, then raise it
                            raise item
                        if isinstance(item, IngestOutcome):
                            pending.append(item)
                            continue
                        if not held:
                            lock.enter_context(gclock.writing(self.ing.objs))
                            held = True
                        # at most _WRITERS writes run; the next waits here (bounded memory)
                        inflight[:] = [f for f in inflight if not f.done()]
                        if len(inflight) >= _WRITERS:
                            inflight[0].exception()
                        fut = pool.submit(self._write_one, item)
                        inflight.append(fut)
                        pending.append(fut)
                        nbytes += item.nbytes
                        idle = not finishing or finishing[-1].done()
                        if (
                            nbytes >= BATCH_BYTES
                            or len(pending) >= BATCH_TARGETS
                            or (idle and (nbytes >= _EAGER_BYTES or len(pending) >= _EAGER_TARGETS))
                        ):
                            seal()
                        if gclock.gc_waiting(self.ing.objs):  # never hold gc back long
                            drain()
                    drain()
                except BaseException:
                    failed.set()  # batches not yet published stay unpublished, as before
                    raise
            self.done.put(_END)
        except BaseException as e:
            self.stop.set()
            lock.close()
            self.done.put(e)
