"""A payload changed in place, its size kept: only the manifest's sha256 can tell.

The other tamper tests change a file's length, which the size check refuses first.
Here one byte inside a tensor's data is flipped (found with `zipfile`, not with
trajstore's own .pt reader), so the file still parses and still has the declared
size. `trajstore ingest` must refuse it, and so must a capture into a store whose
cohort a rank completes after another rank's staged member was changed.
"""

from __future__ import annotations

import logging
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import make_contents
from test_store import cli

from trajstore.bundle.writer import write_bundle
from trajstore.capture import CaptureConfig, CaptureManager
from trajstore.capture.writer import STAGING
from trajstore.errors import NotFoundError
from trajstore.store import Store

pytestmark = pytest.mark.unit


def flip_a_data_byte(pt: Path) -> None:
    """Flip the first byte of the tensor storage inside a torch.save file, in place."""
    with zipfile.ZipFile(pt) as z:
        (info,) = [i for i in z.infolist() if i.filename.split("/")[-2:-1] == ["data"]]
    raw = bytearray(pt.read_bytes())
    # the storage starts after its local file header: 30 bytes + name + extra field
    name_len = int.from_bytes(raw[info.header_offset + 26 : info.header_offset + 28], "little")
    extra_len = int.from_bytes(raw[info.header_offset + 28 : info.header_offset + 30], "little")
    start = info.header_offset + 30 + name_len + extra_len
    size = len(raw)
    raw[start] ^= 0xFF
    pt.write_bytes(bytes(raw))
    assert pt.stat().st_size == size


def test_ingest_refuses_a_same_size_byte_flip_and_stores_the_rest(tmp_path: Path) -> None:
    cap = tmp_path / "cap"
    write_bundle(cap / "replay-7-0", make_contents(lengths=40))
    bad = write_bundle(cap / "replay-7-1", make_contents(lengths=40, step_id=1))
    flip_a_data_byte(bad / "payloads" / "log_probs.pt")
    st = tmp_path / "st"
    Store.open(st).close()
    proc = cli("ingest", "--store", st, cap)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"trajstore: refused: {bad}: payload 'log_probs': sha256 mismatch")
    with Store.open(st, create=False) as store:
        assert store.step("default", 7, 0)
        with pytest.raises(NotFoundError):
            store.step("default", 7, 1)


def _capture_rank(store: Path, rank: int) -> CaptureManager:
    """One rank of a two-rank cohort captured into `store` (its own samples and group)."""
    cap = CaptureManager(
        CaptureConfig(
            enabled=True,
            store_dir=store,
            run="t",
            rank=rank,
            producer_ranks=(0, 1),
            parallel={"dp": 2, "tp": 1, "pp": 1, "cp": 1},
            block=True,
        )
    )
    samples = [
        {"sample_id": f"r{rank}-{i}", "group_index": rank, "response_length": 3, "total_length": 5}
        for i in range(2)
    ]
    with cap.step(0, 0) as step:
        step.add(
            0,
            samples=samples,
            log_probs=torch.tensor([-1.0, -0.5, -2.0, -0.1, -0.3, -0.2]),
            old_log_probs=torch.tensor([-1.1, -0.4, -2.0, -0.2, -0.3, -0.2]),
            advantages=torch.tensor([0.7, 0.7, 0.7, -0.7, -0.7, -0.7]),
        )
    return cap


def test_capture_into_a_store_refuses_a_staged_member_changed_in_place(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 0's member waits in the store's staging for rank 1; it is changed there (same
    size); rank 1 completes the cohort and its ingest refuses it: counted, logged, the
    staged cohort kept for a look, nothing published."""
    st = tmp_path / "st"
    stats0 = _capture_rank(st, 0).close()
    assert (stats0.written, stats0.errors) == (1, 0)
    staged = st / STAGING / "t" / "replay-0-0"
    flip_a_data_byte(staged / "rank-0" / "payloads" / "log_probs.pt")
    caplog.set_level(logging.ERROR, logger="trajstore.capture")
    stats1 = _capture_rank(st, 1).close()
    assert (stats1.written, stats1.errors, stats1.ingested) == (0, 1, 0)
    why = [  # the error with its traceback, as either capture writer logs it
        r.getMessage() + (logging.Formatter().formatException(r.exc_info) if r.exc_info else "")
        for r in caplog.records
        if r.name == "trajstore.capture" and r.levelno >= logging.ERROR
    ]
    assert len(why) == 1 and "rank 0: payload 'log_probs': sha256 mismatch" in why[0], why
    assert (staged / "COMPLETE").is_file()  # the cohort is whole, only refused
    with Store.open(st, create=False) as store:
        assert store.bundles() == []
