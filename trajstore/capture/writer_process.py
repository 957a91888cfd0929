"""The capture writer in a process of its own (``TRAJSTORE_CAPTURE_WRITER=process``, the
default on POSIX).

Why: the writer thread's work (assembling a bundle, ``torch.save``, the JSON documents,
the store's ingest) is Python, and holds the GIL a Python-bound training loop waits for
whenever it takes it: on two cores, TRL's optimizer steps ran ~1.13-1.19x slower with
capture on, while the writer thread used under a tenth of a core. In a process of its own
the same work runs on its own interpreter: the training process only pickles each record
(tensors as out-of-band buffers, no copy) onto a pipe, on a feeder thread whose writes
release the GIL. The bundles written are the same bytes (`BundleSink` does the writing in
both modes).

One writer process serves every `CaptureManager` of a training process: it starts with
the first (importing torch: 0.5-1.4 s here, waited for once, so that a writer process
that cannot start is an error at start-up, not a count of lost bundles later) and
outlives them, idle, until the training process exits and its pipe closes. A manager's
queue, its bound and its drop/block behaviour are the thread writer's: the feeder hands
over one record and waits for its answer before the next, so beyond the queue only the
record being written is held, as with the thread. If the writer process dies, the
records it held and every later one are counted in ``CaptureStats.errors`` (logged
once); training goes on.

Frames, both ways: ``<B op><Q writer id><I parts>``, then each part's length (``<Q``),
then the parts: a pickle (protocol 5) and its out-of-band buffers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from trajstore.bundle.assemble import CapturedRecord
from trajstore.capture.config import CaptureConfig
from trajstore.capture.redaction import filter_config
from trajstore.capture.stats import CaptureStats
from trajstore.capture.writer import STOP, BundleSink, QueuedWriter

logger = logging.getLogger("trajstore.capture")

_OPEN, _RECORD, _CLOSE = 1, 2, 3  # to the writer process
_READY, _WRITTEN, _FAILED, _CLOSED, _LOG = 11, 12, 13, 14, 15  # from it
_HEAD = struct.Struct("<BQI")
#: how long the first manager waits for the writer process to import what it needs
START_TIMEOUT_S = 120.0
_PIPE_BYTES = 1 << 20  # F_SETPIPE_SZ: fewer wake-ups per large record (Linux; best effort)


# --------------------------------------------------------------------------- frames


def _tensor(values: Any, dtype: str) -> Any:
    """A tensor rebuilt in the writer process from its values (bf16 travels as int16)."""
    import torch

    t = torch.from_numpy(values)
    return t.view(getattr(torch, dtype)) if dtype else t


class _Pickler(pickle.Pickler):
    """Tensors as NumPy arrays (pickled out of band: the pipe writes their memory)."""

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(obj, torch.Tensor):
            return NotImplemented
        if obj.is_sparse or obj.is_quantized:
            return NotImplemented
        t = obj.detach().cpu().contiguous()  # what the thread's `as_torch` writes
        try:
            if t.dtype == torch.bfloat16:
                return _tensor, (t.view(torch.int16).numpy(), "bfloat16")
            return _tensor, (t.numpy(), "")
        except (TypeError, RuntimeError):  # a dtype NumPy lacks: torch's own pickling
            return NotImplemented


def _frame(op: int, wid: int, body: Any) -> list[memoryview]:
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    _Pickler(out, protocol=5, buffer_callback=buffers.append).dump(body)
    parts = [out.getbuffer(), *(b.raw() for b in buffers)]
    head = _HEAD.pack(op, wid, len(parts)) + struct.pack(
        f"<{len(parts)}Q", *(p.nbytes for p in parts)
    )
    return [memoryview(head), *parts]


def _write_all(fd: int, parts: list[memoryview]) -> None:
    for part in parts:
        view = part.cast("B")
        while view:
            view = view[os.write(fd, view) :]


def _read_exact(f: BinaryIO, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = f.readinto(view[got:])
        if not k:
            raise EOFError
        got += k
    return buf


def _read_frame(f: BinaryIO) -> tuple[int, int, Callable[[], Any]]:
    """(op, writer id, a call that unpickles the body): the whole frame is read first,
    so a body that fails to unpickle leaves the stream at the next frame."""
    op, wid, n = _HEAD.unpack(_read_exact(f, _HEAD.size))
    sizes = struct.unpack(f"<{n}Q", _read_exact(f, 8 * n))
    parts = [_read_exact(f, size) for size in sizes]
    return op, wid, lambda: pickle.loads(parts[0], buffers=parts[1:])


def _bigger_pipe(fd: int) -> None:
    with contextlib.suppress(Exception):
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), _PIPE_BYTES)


# --------------------------------------------------------------------------- parent


class _WriterProcess:
    """This process's writer process and the thread that reads its replies."""

    def __init__(self) -> None:
        child_in, to_child = os.pipe()  # (read end, write end)
        from_child, child_out = os.pipe()
        _bigger_pipe(to_child)
        # trajstore as this process found it, after everything else on the child's path (a
        # checkout put on sys.path by hand is found; nothing installed is shadowed)
        root = str(Path(__file__).resolve().parents[2])
        code = f"import sys; sys.path.append({root!r}); from {__name__} import main; main()"
        argv = [sys.executable, "-c", code, str(child_in), str(child_out)]
        try:
            self.proc = subprocess.Popen(
                argv,
                pass_fds=(child_in, child_out),
                stdin=subprocess.DEVNULL,
            )
        finally:
            os.close(child_in)
            os.close(child_out)
        self._to_child = to_child
        self._send_lock = threading.Lock()
        self._writers: dict[int, ProcessWriter] = {}
        self._ids = itertools.count(1)
        self._ready = threading.Event()
        self.alive = True
        self._reader = threading.Thread(
            target=self._read_replies,
            args=(os.fdopen(from_child, "rb", buffering=1 << 16),),
            name="trajstore-capture-replies",
            daemon=True,
        )
        self._reader.start()
        if not self._ready.wait(START_TIMEOUT_S) or not self.alive:
            self.close()
            raise RuntimeError(
                f"the capture writer process did not start (exit code {self.proc.poll()}; "
                "its error is above); TRAJSTORE_CAPTURE_WRITER=thread writes without one"
            )

    def register(self, writer: ProcessWriter) -> int:
        wid = next(self._ids)
        self._writers[wid] = writer
        return wid

    def send(self, op: int, wid: int, body: Any) -> None:
        parts = _frame(op, wid, body)  # pickled outside the lock: other feeders go on
        with self._send_lock:
            if not self.alive:
                raise BrokenPipeError(f"the capture writer process exited ({self.proc.poll()})")
            _write_all(self._to_child, parts)

    def _read_replies(self, f: BinaryIO) -> None:
        try:
            while True:
                op, wid, body = _read_frame(f)
                if op == _READY:
                    self._ready.set()
                    continue
                if op == _LOG:  # through this process's logging, as the thread's would go
                    level, name, text = body()
                    logging.getLogger(name).log(level, "%s", text)
                    continue
                writer = self._writers.get(wid)
                if writer is not None:
                    writer._reply(op, body())
                if op == _CLOSED:
                    self._writers.pop(wid, None)
        except (EOFError, OSError, pickle.UnpicklingError):
            pass
        finally:
            self.alive = False
            self._ready.set()
            code = self.proc.wait()
            for writer in list(self._writers.values()):
                writer._lost(code)
            self._writers.clear()

    def close(self) -> None:
        """Close the pipe: the writer process finishes what it holds and exits."""
        with self._send_lock:
            self.alive = False
            with contextlib.suppress(OSError):
                os.close(self._to_child)


_SHARED: _WriterProcess | None = None
_SHARED_LOCK = threading.Lock()


def _shared() -> _WriterProcess:
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None or not _SHARED.alive:
            _SHARED = _WriterProcess()
        return _SHARED


def _forget_after_fork() -> None:
    """A forked child (a DataLoader worker) neither shares nor keeps open the pipe: the
    writer process sees its end when the training process exits."""
    global _SHARED
    if _SHARED is not None:
        with contextlib.suppress(OSError):
            os.close(_SHARED._to_child)
    _SHARED = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


class ProcessWriter(QueuedWriter):
    """`CaptureWriter`'s interface (``put``, ``stop``) over the shared writer process."""

    def __init__(
        self, config: CaptureConfig, stats: CaptureStats, default_recompute: dict[str, Any]
    ):
        super().__init__(config, stats)
        self._closed = threading.Event()
        self._in_flight = 0  # sent, not yet answered (the feeder adds, the replies take)
        #: guards _in_flight and _gone; the feeder waits on it for the last record's answer
        self._count_lock = threading.Condition()
        self._lost_logged = False
        self._gone = False  # the writer process exited (set with _in_flight's lock)
        self._close_sent = False
        self._process = _shared()
        self._wid = self._process.register(self)
        self._process.send(_OPEN, self._wid, (config, default_recompute))
        self._thread = threading.Thread(
            target=self._feed, name="trajstore-capture-feeder", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float | None = None) -> bool:
        """Write everything queued, then stop. False when still busy after ``timeout``."""
        self._queue.put(STOP)
        return self._closed.wait(timeout)

    def _feed(self) -> None:
        while True:
            with self._count_lock:  # the last record answered before the next is taken:
                # beyond the queue only the record being written is held, as by the thread
                self._count_lock.wait_for(lambda: self._gone or not self._in_flight)
            if (rec := self._queue.get()) is STOP:
                break
            with self._count_lock:
                gone = self._gone
                if not gone:
                    self._in_flight += 1
            if gone:
                self._count_lost(1)
                continue
            try:
                if rec.recompute is not None:  # what the bundle keeps: plain, picklable values
                    rec = dataclasses.replace(rec, recompute=filter_config(rec.recompute)[0])
                self._process.send(_RECORD, self._wid, rec)
            except Exception:  # noqa: BLE001 - counted, never raised into training
                with self._count_lock:
                    counted = self._gone  # `_lost` ran since: it counted this record
                    if not counted:
                        self._in_flight -= 1
                if not counted:
                    self._failed_to_hand_over(rec)
        self._close_sent = True
        try:
            self._process.send(_CLOSE, self._wid, None)
        except Exception:  # noqa: BLE001 - the writer process is gone: nothing to wait for
            self._closed.set()

    def _failed_to_hand_over(self, rec: CapturedRecord) -> None:
        if not self._process.alive:
            self._count_lost(1)
            return
        what = f"handing {rec.kind} {rec.rollout_id}:{rec.step_id} to the writer process"
        self.stats.count_error(what)  # e.g. a value that does not pickle

    def _reply(self, op: int, body: Any) -> None:
        if op == _CLOSED:
            self._closed.set()
            return
        with self._count_lock:
            self._in_flight -= 1
            self._count_lock.notify()
        if op == _WRITTEN:
            self.stats.count_written()
            self.stats.ingested += int(body)
        elif op == _FAILED:  # logged there, and its log record sent back (_LOG)
            self.stats.errors += 1
            self.stats.disk_full += int(bool(body))

    def _lost(self, code: int | None) -> None:
        """The writer process exited: what it held is lost. Queued records are counted as
        the feeder reaches them, so `stop` still returns after the last is counted."""
        with self._count_lock:
            lost, self._in_flight, self._gone = self._in_flight, 0, True
            self._count_lock.notify()
        self._count_lost(lost, code)
        if self._close_sent:
            self._closed.set()

    def _count_lost(self, count: int, code: int | None = None) -> None:
        self.stats.errors += count
        if not self._lost_logged:
            self._lost_logged = True
            logger.error(
                "trajstore capture: the writer process exited (code %s); %d bundle(s) it "
                "held are lost and later ones are counted in errors. Training continues",
                code if code is not None else self._process.proc.poll(),
                count,
            )


# --------------------------------------------------------------------------- child


#: one frame at a time on the reply pipe: the main loop answers records while a store's
#: worker threads may log (each log record is a frame too)
_REPLY_LOCK = threading.Lock()


def _send_reply(fd: int, op: int, wid: int, body: Any) -> None:
    parts = _frame(op, wid, body)
    with _REPLY_LOCK:
        _write_all(fd, parts)


class _ToTrainingProcess(logging.Handler):
    """trajstore's log records (a failed bundle, a full disk, with their tracebacks) sent
    to the training process, which logs them through its own handlers."""

    def __init__(self, fd: int):
        super().__init__()
        self.fd = fd

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            _send_reply(self.fd, _LOG, 0, (record.levelno, record.name, text))
        except Exception:  # noqa: BLE001 - logging never raises
            self.handleError(record)


def main(argv: list[str] | None = None) -> int:
    """The writer process (arguments: the pipe's file descriptors, IN_FD OUT_FD)."""
    args = sys.argv[1:] if argv is None else argv
    in_fd, out_fd = int(args[0]), int(args[1])
    with contextlib.suppress(Exception):  # a lower priority: training first
        os.setpriority(os.PRIO_PROCESS, 0, 10)
    # Ctrl-C reaches the whole process group: the training process decides what it means
    # (usually: close capture, which flushes through here); this one ends with its pipe
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(  # anything else (a library's warning) goes to the shared stderr
        level=logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s (capture writer process %(process)d): "
        "%(message)s",
    )
    ours = logging.getLogger("trajstore")
    ours.addHandler(_ToTrainingProcess(out_fd))
    ours.setLevel(logging.INFO)  # the training process's own levels decide what shows
    ours.propagate = False
    import torch  # noqa: F401 - every bundle needs it: imported before saying ready

    _send_reply(out_fd, _READY, 0, None)
    sinks: dict[int, BundleSink] = {}
    with os.fdopen(in_fd, "rb", buffering=1 << 20) as inp:
        while True:
            try:
                op, wid, body = _read_frame(inp)
            except EOFError:
                break
            try:
                value = body()
            except Exception:  # noqa: BLE001 - one unreadable record, not the process
                logger.exception("trajstore capture: the writer process could not read a record")
                if op == _RECORD:
                    _send_reply(out_fd, _FAILED, wid, False)
                continue
            if op == _OPEN:
                config, recompute = value
                sinks[wid] = BundleSink(config, CaptureStats(), recompute)
            elif op == _RECORD and wid not in sinks:  # its open was unreadable (logged)
                _send_reply(out_fd, _FAILED, wid, False)
            elif op == _RECORD:
                sink = sinks[wid]
                written, ingested, full = (
                    sink.stats.written,
                    sink.stats.ingested,
                    sink.stats.disk_full,
                )
                sink.write(value)
                if sink.stats.written > written:
                    _send_reply(out_fd, _WRITTEN, wid, sink.stats.ingested - ingested)
                else:
                    _send_reply(out_fd, _FAILED, wid, sink.stats.disk_full > full)
            elif op == _CLOSE:
                if wid in sinks:
                    sinks.pop(wid).close()
                _send_reply(out_fd, _CLOSED, wid, None)
    for sink in sinks.values():
        sink.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
