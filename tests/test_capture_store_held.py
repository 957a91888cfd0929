"""Store-mode capture holds its store open: each bundle's ingest reads only what is new.

Opening the store per bundle re-read the saved ref index and every ref published since it
was saved, a cost that grew with the store (about a second of the writer's CPU a bundle
at 100,000 refs). What is observed here is the file reads themselves (an audit hook on
`open`), not the writer's internals.
"""

from __future__ import annotations

import collections
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

from trajstore.capture import CaptureConfig, CaptureManager
from trajstore.capture.manager import STAGING
from trajstore.store.api import Store

pytestmark = pytest.mark.integration

#: (path -> read opens) while a test listens; the hook itself stays for the process
_READS: collections.Counter | None = None


def _audit(event: str, args: tuple) -> None:
    if _READS is None or event != "open":
        return
    path, mode, flags = args
    reading = "r" in mode if isinstance(mode, str) else (flags & os.O_ACCMODE) == os.O_RDONLY
    if reading and isinstance(path, (str, bytes, os.PathLike)):
        _READS[os.fsdecode(path)] += 1


sys.addaudithook(_audit)


def _step(cap: CaptureManager, rollout_id: int, step_id: int) -> None:
    samples = [
        {"sample_id": f"s{rollout_id}", "group_index": 0, "response_length": 3, "total_length": 5}
    ]
    with cap.step(rollout_id, step_id) as st:
        st.add(
            0,
            samples=samples,
            log_probs=torch.tensor([-1.0, -0.5, -2.0]) - rollout_id,
            old_log_probs=torch.tensor([-1.1, -0.4, -2.0]),
            advantages=torch.tensor([0.7, 0.7, 0.7]),
            loss_mask=torch.tensor([1.0, 1.0, 1.0]),
        )


def _capture(store_dir: Path, run: str, steps: int) -> None:
    # the writer thread: the probe counts this process's reads (a writer process holds
    # its store the same way, `BundleSink`)
    config = CaptureConfig(enabled=True, store_dir=store_dir, run=run, block=True, writer="thread")
    cap = CaptureManager(config)
    for r in range(steps):
        _step(cap, r, 0)
    stats = cap.close()
    assert (stats.written, stats.ingested, stats.errors) == (steps, steps, 0), stats


def _reads_while(fn) -> collections.Counter:
    global _READS
    _READS = collections.Counter()
    try:
        fn()
        return _READS
    finally:
        _READS = None


def test_a_capture_reads_each_ref_and_the_saved_index_at_most_once(tmp_path):
    store_dir = tmp_path / "store"
    Store.open(store_dir).close()
    _capture(store_dir, "earlier", 3)  # refs another run left in the store
    reads = _reads_while(lambda: _capture(store_dir, "now", 6))
    refs = store_dir / "refs"
    ref_reads = {  # the documents (a folder is opened too, to fsync it)
        p: n for p, n in reads.items() if Path(p).is_relative_to(refs) and p.endswith(".json")
    }
    assert len(ref_reads) >= 3, reads  # the earlier run's refs were read: the probe sees reads
    assert max(ref_reads.values()) == 1, ref_reads
    index_reads = sum(n for p, n in reads.items() if Path(p).name == "ref-index.json")
    assert index_reads <= 1, reads


def test_a_store_removed_during_capture_fails_the_bundle_and_is_not_recreated(tmp_path):
    store_dir = tmp_path / "store"
    Store.open(store_dir).close()
    cap = CaptureManager(CaptureConfig(enabled=True, store_dir=store_dir, run="r", block=True))
    _step(cap, 0, 0)
    staged = store_dir / STAGING / "r" / "replay-0-0"
    deadline = time.monotonic() + 60
    while (  # the first one is in and its staged copy gone: the writer is idle
        not cap.stats.ingested or staged.exists()
    ) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cap.stats.ingested == 1 and not staged.exists()
    shutil.rmtree(store_dir)
    _step(cap, 1, 0)
    stats = cap.close()
    assert stats.errors == 1, stats
    assert not store_dir.exists()  # nothing written where the store was


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-q"]))
