"""The capture writer in a process of its own (TRAJSTORE_CAPTURE_WRITER=process): the same
bundles as the writer thread, its failures counted in the training process, its death
survived."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_capture import enabled, one_step

from trajstore.capture import CaptureConfig, CaptureConfigError, CaptureManager, writer_process
from trajstore.store.api import Store

pytestmark = pytest.mark.integration

SAMPLE = {"sample_id": "a", "group_index": 0, "response_length": 2, "total_length": 3}


def _files(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _capture(
    out: Path, writer: str, steps: int = 3, cap: CaptureManager | None = None
) -> CaptureManager:
    cap = cap or CaptureManager(enabled(out, writer=writer))
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        assert one_step(
            cap,
            i,
            0,
            log_probs=torch.randn(5, generator=g).to(torch.bfloat16),  # no NumPy dtype
            old_log_probs=torch.from_numpy(np.linspace(-2, 0, 5, dtype=np.float64)),
            entropy=torch.randn(10, generator=g)[::2],  # a strided view
        )
    return cap


def test_the_writer_process_writes_the_bytes_the_writer_thread_writes(tmp_path):
    for writer in ("thread", "process"):
        stats = _capture(tmp_path / writer, writer).close()
        assert (stats.written, stats.errors) == (3, 0), writer
    thread, process = _files(tmp_path / "thread"), _files(tmp_path / "process")
    assert len(thread) == 3 * 9
    assert process == thread


def test_a_recompute_config_holding_what_does_not_pickle_is_written_as_by_the_thread(tmp_path):
    """The thread writer keeps only the recompute keys of a trainer's config; the process
    writer hands over only those too, so a lock or a lambda elsewhere in it costs nothing."""
    config = {"advantage_estimator": "grpo", "callback": lambda: None, "lock": threading.Lock()}
    for writer in ("thread", "process"):
        cap = CaptureManager(enabled(tmp_path / writer, writer=writer))
        with cap.step(0, 0, recompute=config) as st:
            z = torch.zeros(2)
            st.add(0, samples=[SAMPLE], log_probs=z, old_log_probs=z, advantages=z)
        assert (cap.close().written, cap.stats.errors) == (1, 0), writer
    assert _files(tmp_path / "process") == _files(tmp_path / "thread")


def test_the_writer_is_chosen_by_its_variable(tmp_path):
    assert CaptureConfig().writer == ("process" if os.name == "posix" else "thread")
    env = {"TRAJSTORE_CAPTURE_DIR": str(tmp_path), "TRAJSTORE_CAPTURE_WRITER": "Thread"}
    assert CaptureConfig.from_env(env).writer == "thread"
    with pytest.raises(CaptureConfigError, match="TRAJSTORE_CAPTURE_WRITER='fork'"):
        CaptureConfig.from_env({**env, "TRAJSTORE_CAPTURE_WRITER": "fork"})
    with pytest.raises(CaptureConfigError, match="writer must be one of thread, process"):
        CaptureConfig(writer="threads")


def test_a_bundle_the_writer_process_fails_is_counted_and_logged_in_the_training_process(
    tmp_path, caplog
):
    out = tmp_path / "out"
    cap = CaptureManager(enabled(out, writer="process"))
    if out.exists():
        out.rmdir()
    out.write_text("a file where the capture directory was")  # every bundle now fails
    with caplog.at_level(logging.ERROR, logger="trajstore.capture"):
        stats = _capture(out, "process", steps=2, cap=cap).close()
    assert (stats.enqueued, stats.written, stats.errors) == (2, 0, 2)
    logged = [r.getMessage() for r in caplog.records if r.name == "trajstore.capture"]
    assert len(logged) == 2, logged
    assert "error while writing step 0:0" in logged[0]
    assert "Traceback" in logged[0] and "out" in logged[0]


def test_store_mode_through_the_writer_process_counts_what_it_ingested(tmp_path):
    store_dir = tmp_path / "store"
    Store.open(store_dir).close()
    cap = CaptureManager(
        CaptureConfig(enabled=True, store_dir=store_dir, run="r", writer="process")
    )
    assert one_step(cap, 4, 2) and one_step(cap, 5, 0)
    stats = cap.close()
    assert (stats.written, stats.ingested, stats.errors) == (2, 2, 0)
    with Store.open(store_dir) as store:
        steps = sorted((row["rollout_id"], row["step_id"]) for row in store.bundles(run="r"))
    assert steps == [(4, 2), (5, 0)]


def test_a_killed_writer_process_costs_bundles_not_the_training(tmp_path):
    cap = _capture(tmp_path / "before", "process", steps=1)
    assert cap.close().written == 1
    cap = CaptureManager(enabled(tmp_path / "out", writer="process"))
    child = writer_process._shared().proc
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    assert one_step(cap, 1, 0)  # the training thread is not told: it goes on
    assert one_step(cap, 2, 0)
    stats = cap.close(timeout=30)
    assert (stats.written, stats.errors) == (0, 2)
    # the next manager starts a writer process of its own
    again = _capture(tmp_path / "after", "process", steps=1).close()
    assert (again.written, again.errors) == (1, 0)
    assert writer_process._shared().proc.pid != child.pid


def test_ctrl_c_in_the_terminal_leaves_the_writer_process_to_the_trainer(tmp_path):
    """SIGINT reaches the whole process group; the trainer decides, and its close() still
    flushes through the writer process."""
    cap = CaptureManager(enabled(tmp_path / "out", writer="process"))
    child = writer_process._shared().proc
    os.kill(child.pid, signal.SIGINT)
    assert one_step(cap, 0, 0)
    stats = cap.close(timeout=30)
    assert (stats.written, stats.errors) == (1, 0)
    assert child.poll() is None


def test_a_writer_process_that_cannot_start_is_an_error_at_start_up(tmp_path, monkeypatch):
    old = writer_process._shared().proc
    os.kill(old.pid, signal.SIGKILL)  # no writer process left to share
    old.wait(timeout=30)
    monkeypatch.setattr(sys, "executable", "/bin/false")  # exits at once, says nothing
    with pytest.raises(RuntimeError, match="the capture writer process did not start"):
        CaptureManager(enabled(tmp_path / "out", writer="process"))
    monkeypatch.undo()
    stats = _capture(tmp_path / "again", "process", steps=1).close()
    assert (stats.written, stats.errors) == (1, 0)


def test_beyond_its_queue_a_stalled_writer_process_holds_one_record(tmp_path):
    """queue_size=1 with the writer process stopped (SIGSTOP): the first record is handed
    over, the second waits in the queue, the rest are dropped, as with a busy thread."""
    cap = CaptureManager(enabled(tmp_path / "out", writer="process", queue_size=1))
    child = writer_process._shared().proc
    os.kill(child.pid, signal.SIGSTOP)
    try:
        one_step(cap, 0, 0)
        deadline = time.monotonic() + 30
        while not cap._writer._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.01)  # the feeder has taken the first record
        for s in range(1, 10):
            one_step(cap, 0, s)
        assert (cap.stats.enqueued, cap.stats.dropped) == (2, 8)
    finally:
        os.kill(child.pid, signal.SIGCONT)
    stats = cap.close(timeout=30)
    assert (stats.written, stats.errors) == (2, 0)
