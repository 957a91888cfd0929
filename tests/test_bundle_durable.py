"""What a bundle write fsyncs, and in which order (`write_bundle(durable=...)`), and what
capture asks for (`TRAJSTORE_CAPTURE_DURABLE`).

Observed at the system call: `os.fsync` is wrapped to record which file each call
flushed (its descriptor's /proc link), the order kept under a lock (the files before
`COMPLETE` are fsynced together, on threads).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import make_contents
from test_capture import enabled, one_step

from trajstore.bundle.writer import write_bundle, write_rank
from trajstore.capture import CaptureConfig, CaptureManager
from trajstore.capture.config import CaptureConfigError

pytestmark = pytest.mark.integration
#: the recorder reads which file a descriptor is through /proc
needs_proc = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc (Linux)")


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every path fsynced from now on, in the order the calls returned."""
    seen: list[Path] = []
    lock = threading.Lock()
    real = os.fsync

    def fsync(fd: int) -> None:
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)
        with lock:
            seen.append(path)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def _files(bundle: Path) -> set[str]:
    return {str(p.relative_to(bundle)) for p in bundle.rglob("*") if p.is_file()}


def _in_bundle(seen: list[Path], bundle: Path) -> list[str]:
    """The fsynced paths inside the bundle (written in its temp sibling, renamed after),
    relative to it; the bundle's own folder as "."."""
    out = []
    for p in seen:
        for top in (p, *p.parents):
            if top.parent == bundle.parent and top.name.lstrip(".").startswith(bundle.name):
                out.append(str(p.relative_to(top)))
                break
    return out


def _assert_fsynced_complete_last(seen: list[Path], bundle: Path) -> None:
    """Every file of `bundle` was fsynced, `COMPLETE` last but for the bundle's folder."""
    order = _in_bundle(seen, bundle)
    assert set(order) >= _files(bundle) and order.index("COMPLETE") == len(order) - 2, order


@needs_proc
def test_a_durable_bundle_has_every_file_on_disk_before_complete(tmp_path, fsyncs):
    bundle = write_bundle(tmp_path / "b", make_contents())
    order = _in_bundle(fsyncs, bundle)
    vouched = _files(bundle) - {"COMPLETE"}
    assert any(name.startswith("payloads/") for name in vouched)
    assert vouched | {"COMPLETE", "payloads", "."} == set(order), order
    complete = order.index("COMPLETE")
    assert set(order[:complete]) == vouched | {"payloads"}, order  # the payloads too
    assert order[complete + 1 :] == ["."]  # then COMPLETE's own name, before the rename
    assert fsyncs[-1] == tmp_path  # and the rename's, after it


@needs_proc
def test_a_durable_cohort_member_has_its_files_shard_and_complete_on_disk(tmp_path, fsyncs):
    cohort = tmp_path / "c"
    member = write_rank(cohort, make_contents(), rank=0, expected_ranks=[0])
    payloads = {p.name for p in fsyncs if p.parent.name == "payloads"}
    assert payloads == {p.name for p in (member / "payloads").iterdir()}
    # the member's folder (as its temp), then the shard and the COMPLETE (as theirs)
    temps = [p.name.split(".tmp-")[0] for p in fsyncs if p.parent == cohort]
    assert temps == [".rank-0", ".COMPLETE.0", ".COMPLETE"], temps
    assert fsyncs[-1] == cohort  # the cohort COMPLETE's link, last


def test_a_bundle_written_without_durable_is_never_fsynced(tmp_path, fsyncs):
    write_bundle(tmp_path / "b", make_contents(), durable=False)
    write_rank(tmp_path / "c", make_contents(), rank=0, expected_ranks=[0], durable=False)
    assert fsyncs == []
    assert (tmp_path / "b" / "COMPLETE").exists() and (tmp_path / "c" / "COMPLETE").exists()


def _capture_one_step(out: Path, **config) -> None:
    # the writer thread: the fsyncs happen in this process, where the wrapper sees them
    # (the writer process runs the same `BundleSink`: the last test watches it)
    cap = CaptureManager(enabled(out, block=True, writer="thread", **config))
    assert one_step(cap, 0, 0)
    stats = cap.close()
    assert (stats.written, stats.errors) == (1, 0), stats


def test_capture_writes_bundles_without_fsync_by_default(tmp_path, fsyncs):
    _capture_one_step(tmp_path / "cap")
    assert (tmp_path / "cap" / "replay-0-0" / "COMPLETE").exists()
    assert fsyncs == []


def test_durable_capture_fsyncs_each_bundle_before_publishing_it(tmp_path, fsyncs):
    config = CaptureConfig.from_env({"TRAJSTORE_CAPTURE_DURABLE": "1"})
    assert config.durable
    _capture_one_step(tmp_path / "cap", durable=config.durable)
    bundle = tmp_path / "cap" / "replay-0-0"
    _assert_fsynced_complete_last(fsyncs, bundle)


def test_a_misspelt_durable_setting_is_refused_at_start(tmp_path):
    with pytest.raises(CaptureConfigError, match="TRAJSTORE_CAPTURE_DURABLE='sure'"):
        CaptureConfig.from_env({"TRAJSTORE_CAPTURE_DURABLE": "sure"})
    with pytest.raises(CaptureConfigError, match="durable must be True or False"):
        CaptureConfig(durable="no")


def test_a_bundle_an_os_crash_tore_is_refused_not_read(tmp_path):
    """Without fsync an OS crash may leave a published bundle whose data never reached
    the disk (ext4 keeps such a file's name with no bytes): its hashes refuse it."""
    bundle = write_bundle(tmp_path / "b", make_contents(), durable=False)
    payload = next((bundle / "payloads").iterdir())
    payload.write_bytes(b"")
    store = tmp_path / "store"
    for argv in (["validate", str(bundle)], ["ingest", str(bundle), "--store", str(store)]):
        proc = subprocess.run(
            [sys.executable, "-m", "trajstore", *argv], capture_output=True, text=True
        )
        assert proc.returncode == 2, (argv, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr
        assert f"payload '{payload.stem}'" in proc.stderr, (argv, proc.stdout, proc.stderr)


_PROBE = """
import os

_real = os.fsync


def _fsync(fd):
    _real(fd)
    with open(os.environ["FSYNC_LOG"], "a") as log:
        log.write(os.readlink(f"/proc/self/fd/{fd}") + "\\n")


os.fsync = _fsync
"""


@needs_proc
def test_the_writer_process_fsyncs_as_configured(tmp_path, monkeypatch):
    """The writer process gets the config pickled and runs the same `BundleSink`: its own
    fsyncs (a `sitecustomize` loaded by that process alone logs them) follow `durable`."""
    from trajstore.capture import writer_process

    def fresh_writer_process() -> None:  # the shared one was started without the probe
        shared = writer_process._SHARED
        if shared is not None and shared.proc.poll() is None:
            shared.proc.kill()
            shared.proc.wait(timeout=30)

    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(_PROBE)
    log = tmp_path / "fsyncs.log"
    log.touch()
    fresh_writer_process()
    monkeypatch.setenv("FSYNC_LOG", str(log))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(probe), os.environ.get("PYTHONPATH", "")])
    )
    try:
        for durable in (False, True):
            cap = CaptureManager(
                enabled(tmp_path / f"cap-{durable}", writer="process", durable=durable)
            )
            assert one_step(cap, 0, 0)
            stats = cap.close(timeout=60)
            assert (stats.written, stats.errors) == (1, 0), stats
    finally:
        monkeypatch.undo()
        fresh_writer_process()  # later tests start one without the probe
    synced = [Path(line) for line in log.read_text().splitlines()]
    assert not [p for p in synced if "cap-False" in str(p)], synced
    bundle = tmp_path / "cap-True" / "replay-0-0"
    _assert_fsynced_complete_last(synced, bundle)
