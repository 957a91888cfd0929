"""The pipelined ingest of many targets (gate thread ahead of the writer, batched packs and
refs) answers exactly as ingesting them one at a time would."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import edit_json, make_contents, resign_bundle
from store_checks import tree_equal

from trajstore.bundle.writer import write_bundle
from trajstore.cas import LocalObjectStore, write_array
from trajstore.cas.arrays import ENCODE_CACHE
from trajstore.store import Store, export_bundles
from trajstore.store.ingest import IngestOutcome, store_rank
from trajstore.store.ingest_gate import VerifiedRank
from trajstore.store.ingest_write import Recorder
from trajstore.store.maintenance import fsck

pytestmark = pytest.mark.unit


def _steps(root: Path, steps: range, *, seed: int = 0, tokens: int = 300) -> list[Path]:
    out = []
    for s in steps:
        dest = root / f"replay-7-{s}"
        write_bundle(dest, make_contents(lengths=tokens, step_id=s, seed=seed + s))
        out.append(dest)
    return out


def test_outcomes_arrive_in_target_order_with_their_refs_already_created(tmp_path: Path) -> None:
    targets = _steps(tmp_path / "cap", range(12))
    edit_json(targets[5] / "index.json", lambda d: d["samples"][0].update(response_length=0))
    resign_bundle(targets[5])
    seen: list[tuple[str, str, bool]] = []
    with Store.open(tmp_path / "st") as store:

        def check(o: IngestOutcome) -> None:
            live = set(Store.open(tmp_path / "st").refs.live())  # a fresh reader: on disk
            seen.append((o.path, o.status, all(k in live for k in o.keys)))

        outs = store.ingest([tmp_path / "cap"], run="r", on_outcome=check)
    order = sorted(targets)  # the order targets are found in
    assert [o.path for o in outs] == [str(t) for t in order]
    assert [s for _, s, _ in seen] == ["refused" if t == targets[5] else "published" for t in order]
    assert all(ok for _, status, ok in seen if status == "published")
    assert [(p, s) for p, s, _ in seen] == [(o.path, o.status) for o in outs]


def test_a_step_and_its_recapture_in_one_batch_get_attempts_in_target_order(
    tmp_path: Path,
) -> None:
    cap = tmp_path / "cap"
    first = _steps(cap, range(6))
    again = _steps(cap / "resumed", range(3), seed=50)  # same steps, new content
    with Store.open(tmp_path / "st") as store:
        outs = store.ingest([cap], run="r")
    keys = {o.path: o.keys for o in outs}
    assert [keys[str(t)] for t in first] == [[f"r/step-7-{s}/a1"] for s in range(6)]
    assert [keys[str(t)] for t in again] == [[f"r/step-7-{s}/a2"] for s in range(3)]
    out = tmp_path / "export"
    with Store.open(tmp_path / "st") as store:
        export_bundles(store.step("r", 7, 1, attempt=2), out)
        assert tree_equal(again[1], out)
        assert not fsck(store).problems


def test_a_second_ingest_of_the_same_targets_changes_nothing(tmp_path: Path) -> None:
    targets = _steps(tmp_path / "cap", range(8))
    with Store.open(tmp_path / "st") as store:
        store.ingest([tmp_path / "cap"], run="r")
        refs = sorted(p.name for p in (tmp_path / "st" / "refs" / "bundles").iterdir())
        again = store.ingest([tmp_path / "cap"], run="r")
    assert [o.status for o in again] == ["unchanged"] * len(targets)
    assert sorted(p.name for p in (tmp_path / "st" / "refs" / "bundles").iterdir()) == refs


def test_windows_remembered_from_another_store_are_written_to_this_one(tmp_path: Path) -> None:
    """The encode cache remembers object names per process; a store that lacks them gets
    every object (`has_cached` is per store), and the bundles' added bytes count them all
    (which bundle of a batch is credited with an object they share depends on which
    writer stored it first, so the runs' totals are compared, not bundle by bundle)."""
    _steps(tmp_path / "cap", range(3), tokens=5000)
    docs = []
    for name in ("a", "b"):
        with Store.open(tmp_path / name) as store:
            store.ingest([tmp_path / "cap"], run="r")
            docs.append(
                sorted(
                    (doc["physical_bytes"], doc["added_bytes"])
                    for doc in (
                        json.loads(p.read_bytes())
                        for p in (tmp_path / name / "refs" / "bundles").iterdir()
                    )
                )
            )
            assert not fsck(store).problems
    assert [p for p, _ in docs[0]] == [p for p, _ in docs[1]]
    assert sum(a for _, a in docs[0]) == sum(a for _, a in docs[1]) > 0


def test_a_window_named_from_memory_gives_the_same_record_and_accounting(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    lengths = [700, 300, 1200]
    routes = rng.integers(0, 128, (sum(lengths), 48, 8), dtype=np.uint8)
    ENCODE_CACHE.clear()
    objs = LocalObjectStore(tmp_path / "o")
    cold = Recorder(objs)
    a = write_array(cold, routes, lengths, dtype_tag="torch.uint8")
    objs.flush()
    ENCODE_CACHE._d.clear()  # the bytes are evicted, the names are remembered
    warm = Recorder(objs)
    b = write_array(warm, routes, lengths, dtype_tag="torch.uint8")
    assert a == b and cold.sizes == warm.sizes


def test_a_document_changed_after_the_gate_is_refused_not_stored(tmp_path: Path) -> None:
    """Without the bytes the gate checked (`Bundle.files` is empty over its cap, and for a
    cohort's ranks), a document is read again and must be what the gate checked."""
    from trajstore.bundle.reader import open_bundle
    from trajstore.errors import BundleError

    (target,) = _steps(tmp_path / "cap", range(1))
    b = open_bundle(target)  # the gate read and checked index.json
    b.files = {}
    edit_json(target / "index.json", lambda d: d["samples"][0].update(reward=9.0))
    objs = LocalObjectStore(tmp_path / "o")
    with pytest.raises(BundleError, match="index.json: changed after the integrity gate"):
        store_rank(objs, VerifiedRank(b, {}))


def test_the_documents_stored_are_the_bytes_the_gate_checked(tmp_path: Path) -> None:
    """With the bytes the gate kept, documents are not read again: a file changed after
    the gate is not what is stored, the checked bytes are."""
    from trajstore.bundle.reader import open_bundle
    from trajstore.cas.blobs import get_blob

    (target,) = _steps(tmp_path / "cap", range(1))
    checked = (target / "index.json").read_bytes()
    b = open_bundle(target)
    assert b.files["index.json"] == checked
    edit_json(target / "index.json", lambda d: d["samples"][0].update(reward=9.0))
    objs = LocalObjectStore(tmp_path / "o")
    body, _ = store_rank(objs, VerifiedRank(b, {}))
    assert get_blob(objs, body["documents"]["index"]) == checked


def test_a_writer_sees_a_gc_waiting_only_while_one_holds_the_turnstile(tmp_path: Path) -> None:
    """A batch ends when gc waits, so gc is held back by one target at most."""
    from trajstore.store import gclock

    with Store.open(tmp_path / "st") as store:
        assert not gclock.gc_waiting(store.objs)
        with gclock.collecting(store.objs):
            assert gclock.gc_waiting(store.objs)
        assert not gclock.gc_waiting(store.objs)


def test_train_routes_are_stored_as_a_delta_against_the_rollout_routes(tmp_path: Path) -> None:
    """`DELTA_BASES`: train routes equal to the rollout routes cost one record and no chunk
    (each window XORs to zero), and read back bit-identical."""
    from trajstore.examples import gen_long_run

    cap = tmp_path / "capture"
    args = ["--rollouts", "1", "--steps", "1", "--samples", "8", "--per-prompt", "4"]
    args += ["--routes", "--layers", "4", "--topk", "2", "--route-diff", "0"]
    assert gen_long_run.main([str(cap), *args]) == 0
    with Store.open(tmp_path / "store") as store:
        assert all(o.status == "published" for o in store.ingest([cap], run="r"))
        (b,) = store.rollout("r", 0)
        train = b.record("train_routed_experts")
        assert train.base == b.ref["payloads"]["rollout_routed_experts"]["record"]
        assert all(h is None for row in train.chunks for h in row)
        assert (
            b.payload_file("train_routed_experts")
            == (cap / "replay-rollout-0" / "payloads" / "train_routed_experts.pt").read_bytes()
        )
