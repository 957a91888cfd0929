"""The store: ingest, export, dedup, attempts, integrity, maintenance (trajstore.store)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CAPTURE_DIR, FIXTURES, copy_fixture, edit_json, make_contents, resign_bundle
from inprocess_cli import cli as run_main
from store_checks import tree_equal

from trajstore.bundle.writer import write_bundle
from trajstore.cas.blobs import get_json_blob, put_blob
from trajstore.errors import BundleError, IntegrityError, NotFoundError, StoreError, UsageError
from trajstore.store import Store, export_bundles
from trajstore.store.maintenance import fsck, gc, stats

pytestmark = pytest.mark.integration

FIXTURE_TARGETS = [
    FIXTURES / "example_bundle",
    FIXTURES / "example_bundle_divergent",
    CAPTURE_DIR / "replay-120-0",
    CAPTURE_DIR / "replay-rollout-120",
]


def cli(
    *args: str | Path, env: dict | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """`trajstore ARGS` in a fresh process (other test files import this). The tests here
    pin output and exit codes, not the process around them: they call `run_main`, the
    same command in this process (tests/inprocess_cli.py)."""
    return subprocess.run(
        [sys.executable, "-m", "trajstore", *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


def verdict(target: Path) -> tuple[int, dict]:
    proc = run_main("replay", target, "--json")
    report = json.loads(proc.stdout)
    report.pop("label", None)
    return proc.returncode, report


def stored_bytes(store: Store) -> int:
    return stats(store)["stored_bytes"]


@pytest.fixture
def store(store_url: str) -> Store:
    """A fresh store on each backend: a directory and an s3:// prefix (conftest.store_url)."""
    with Store.open(store_url, durable=False) as s:
        yield s


def _edit_a_pack(store: Store, edit) -> None:  # noqa: ANN001
    """Rewrite the bytes of the store's (only) pack in place, whatever the backend."""
    if store.is_remote:
        import obstore

        objs = store.objs
        (pack,) = [
            m["path"]
            for b in obstore.list(objs.client, prefix=objs.loc.prefix + "packs/")
            for m in b
            if m["path"].endswith(".pack")
        ]
        data = bytes(obstore.get(objs.client, pack).bytes())
        obstore.put(objs.client, pack, edit(data))
        return
    pack = next(p for p in (store.root / "packs").glob("*.pack"))
    pack.write_bytes(edit(pack.read_bytes()))


def _selector(target: Path) -> list[str]:
    index = json.loads(next(target.rglob("index.json")).read_text())
    ident = index["identity"]
    if ident.get("actor_step_id"):
        return [
            "--step",
            f"{ident['actor_step_id']['rollout_id']}:{ident['actor_step_id']['step_id']}",
        ]
    return ["--rollout", str(ident["rollout_id"])]


@pytest.mark.parametrize(
    "target", FIXTURE_TARGETS + ["cohort3"], ids=lambda t: getattr(t, "name", t)
)
def test_round_trip_is_byte_identical_and_replays_the_same(
    tmp_path: Path, target, make_cohort
) -> None:
    if target == "cohort3":
        target = make_cohort(tmp_path / "replay-7-0", ranks=3, lengths=[3, 5, 2, 7])
    st = tmp_path / "st"
    assert run_main("ingest", target, "--store", st, "--run", "r").returncode == 0
    out = tmp_path / "out" / target.name
    proc = run_main("export", "--store", st, "--run", "r", *_selector(target), out)
    assert proc.returncode == 0, proc.stderr
    assert tree_equal(target, out)
    assert verdict(target) == verdict(out)


def test_stored_bundle_reads_tensors_bit_identical(store: Store, tmp_path: Path) -> None:
    c = make_contents(lengths=[4, 9, 1, 6], dtype=torch.bfloat16)
    src = write_bundle(tmp_path / "b", c)
    store.ingest([src], run="r")
    (sb,) = store.step("r", 7, 0)
    for name, t in c.payloads.items():
        got = sb.payload_tensor(name)
        assert got.dtype == t.dtype and torch.equal(got.view(torch.uint16), t.view(torch.uint16))
    rows = sb.payload_rows("log_probs", np.array([3, 1]))
    flat = c.payloads["log_probs"].view(torch.uint16).numpy()
    assert np.array_equal(rows, np.concatenate([flat[14:20], flat[4:13]]))


def test_payload_rows_refuses_a_boolean_mask_or_float_positions(
    store: Store, tmp_path: Path
) -> None:
    """int() of each read a mask as positions 0 and 1, over and over, and 1.7 as 1."""
    store.ingest([write_bundle(tmp_path / "b", make_contents(lengths=[4, 9, 1, 6]))], run="r")
    (sb,) = store.step("r", 7, 0)
    with pytest.raises(UsageError, match=r"not bool .*np\.flatnonzero\(mask\)"):
        sb.payload_rows("log_probs", np.array([True, False, True, False]))
    with pytest.raises(UsageError, match="integers, not float64"):
        sb.payload_rows("log_probs", [1.7])
    masked = sb.payload_rows("log_probs", np.flatnonzero([True, False, True, False]))
    assert np.array_equal(masked, sb.payload_rows("log_probs", [0, 2]))
    assert len(masked) == 4 + 1


def test_ingest_of_a_directory_holding_no_bundle_is_refused(store: Store, tmp_path: Path) -> None:
    """It returned no outcome at all, and the CLI exited 0, as if all were stored."""
    (tmp_path / "empty" / "junk").mkdir(parents=True)
    (out,) = store.ingest(tmp_path / "empty")
    assert (out.status, out.reason) == ("refused", "no bundle, cohort or capture directory in it")
    proc = run_main("ingest", "--store", tmp_path / "cli-store", tmp_path / "empty")
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith(
        f"refused: {tmp_path / 'empty'}: no bundle, cohort or capture directory in it"
    )


def test_ingest_of_an_empty_path_is_refused_not_the_current_directory(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_bundle(tmp_path / "replay-7-0", make_contents(lengths=3))
    monkeypatch.chdir(tmp_path)  # Path("") is ".": it ingested every bundle under it
    (out,) = store.ingest("")
    assert out.status == "refused" and "an empty path" in (out.reason or "")
    assert store.bundles() == []


def test_remove_of_one_key_given_as_a_string(store: Store, tmp_path: Path) -> None:
    """A str was iterated: 'no published bundle 'r'', its first letter."""
    store.ingest([write_bundle(tmp_path / "b", make_contents(lengths=3))], run="r")
    assert store.remove("r/step-7-0/a1") == ["r/step-7-0/a1"]
    assert store.bundles() == []


def test_store_lookups_refuse_ids_that_are_not_integers(store: Store, tmp_path: Path) -> None:
    """int() read 7.9 as step 7, True as 1 and a step "70" unpacked as 7:0."""
    store.ingest([write_bundle(tmp_path / "b", make_contents(lengths=3))], run="r")
    assert len(store.step("r", np.int64(7), 0)) == 1
    for call, error in (
        (lambda: store.step("r", 7.9, 0), "rollout_id must be an integer, not float 7.9"),
        (lambda: store.step("r", 7, False), "step_id must be an integer, not bool False"),
        (lambda: store.step("r", *"70"), "rollout_id must be an integer, not str '7'"),
        (lambda: store.step("r", 7, 0, attempt="1"), "attempt must be an integer, not str"),
        (lambda: store.rollout("r", 7.0), "rollout_id must be an integer, not float"),
    ):
        with pytest.raises(UsageError, match=re.escape(error)):
            call()


def test_store_bundles_refuses_an_unknown_run_and_a_negative_limit(
    store: Store, tmp_path: Path
) -> None:
    """Both answered a list: [] for the misspelt run, all rows but the last for -1."""
    store.ingest([write_bundle(tmp_path / "b", make_contents(lengths=3))], run="r")
    with pytest.raises(NotFoundError, match=r"run 'rr' is not in the store \(runs: r\)"):
        store.bundles(run="rr")
    with pytest.raises(UsageError, match="limit must be 0 or more, not -1"):
        store.bundles(limit=-1)
    assert [row["key"] for row in store.bundles(run="r", limit=1)] == ["r/step-7-0/a1"]


def test_ingest_of_one_rank_directory_of_a_cohort_is_refused(
    store: Store, tmp_path: Path, make_cohort
) -> None:
    """Stored alone it was the whole step (no cohort_ranks): replay answered for one rank."""
    cohort = make_cohort(tmp_path / "replay-7-0", ranks=2, lengths=[3, 5, 2, 7])
    (out,) = store.ingest(cohort / "rank-1", run="r")
    assert out.status == "refused"
    assert out.reason == f"rank 1 of a cohort of ranks [0, 1]; ingest its cohort directory {cohort}"
    assert store.bundles() == []
    (whole,) = store.ingest(cohort, run="r")
    assert whole.status == "published" and len(store.step("r", 7, 0)) == 2


def test_stock_zarr_open_array_equals_ingested_tensor(store: Store, tmp_path: Path) -> None:
    import zarr

    from trajstore.cas import CASZarrStore

    c = make_contents(lengths=[5, 2, 8, 3])
    store.ingest([write_bundle(tmp_path / "b", c)], run="r")
    (sb,) = store.step("r", 7, 0)
    z = zarr.open_array(
        store=CASZarrStore(store.objs, {"log_probs": sb.record("log_probs")}),
        path="log_probs",
        mode="r",
    )
    lengths = z.attrs["trajstore"]["row_lengths"]
    got = np.concatenate([z[i, :n] for i, n in enumerate(lengths)])
    assert got.dtype == np.float32 and np.array_equal(got, c.payloads["log_probs"].numpy())


def test_reingest_is_a_noop_and_another_run_adds_no_bytes(store: Store, tmp_path: Path) -> None:
    src = write_bundle(tmp_path / "b", make_contents(lengths=50))
    assert store.ingest([src], run="a")[0].status == "published"
    before = stored_bytes(store)
    assert store.ingest([src], run="a")[0].status == "unchanged"
    assert store.ingest([src], run="b")[0].status == "published"
    assert stored_bytes(store) == before


def _rollout_and_subset(tmp_path: Path) -> tuple[Path, Path, int]:
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(50, 600, 128)]
    c = make_contents(groups=16, samples_per_group=8, lengths=lengths, kind="rollout")
    rollout = write_bundle(tmp_path / "replay-rollout-7", c)
    picks = [int(i) for i in rng.permutation(128)[:32][::-1]]
    offs = np.concatenate([[0], np.cumsum(lengths)])
    s = make_contents(groups=4, samples_per_group=8, lengths=[lengths[i] for i in picks])
    s.samples = [c.samples[i] for i in picks]
    s.payloads = {
        n: torch.cat([t[offs[i] : offs[i + 1]] for i in picks]) for n, t in c.payloads.items()
    }
    s.identity["semantic_group_ids"] = sorted({f"g-{x['group_index']}" for x in s.samples})
    s.identity["micro_batch_ids"] = sorted({x["micro_batch_id"] for x in s.samples})
    s.expected.pop("reward.raw")
    s.expected.pop("reward.post_process")
    step = write_bundle(tmp_path / "replay-7-0", s)
    return rollout, step, sum(t.numel() * t.element_size() for t in s.payloads.values())


def test_subset_step_bundle_adds_at_most_ten_percent(store: Store, tmp_path: Path) -> None:
    rollout, step, logical = _rollout_and_subset(tmp_path)
    assert store.ingest([rollout], run="r")[0].status == "published"
    before = stored_bytes(store)
    out = store.ingest([step], run="r")[0]
    assert out.status == "published", out.reason
    assert stored_bytes(store) - before <= 0.10 * logical


def _routed(tmp_path: Path, name: str, routes: torch.Tensor, lengths: list[int]) -> Path:
    c = make_contents(
        lengths=lengths,
        extra_payloads={"rollout_routed_experts": routes, "train_routed_experts": routes.clone()},
    )
    c.config["router"] = {"num_layers": 48, "top_k": 8, "num_experts": 64}
    return write_bundle(tmp_path / name, c)


def test_identical_routes_in_two_runs_are_stored_once(store: Store, tmp_path: Path) -> None:
    lengths = [40, 60, 30, 70]
    total = sum(n + 3 for n in lengths)
    routes = torch.randint(0, 64, (total, 48, 8), dtype=torch.uint8)
    a = _routed(tmp_path, "a", routes, lengths)
    b_contents_dir = _routed(tmp_path, "b", routes, lengths)
    store.ingest([a], run="a")
    before = stored_bytes(store)
    store.ingest([b_contents_dir], run="b")
    assert stored_bytes(store) == before  # same bundle content: every object shared
    route_bytes = stats(store)["runs"][0]["route_bytes"]
    assert route_bytes < 1.3 * routes.numel()  # train routes (== rollout routes) cost ~nothing


def test_all_zero_kl_costs_next_to_nothing(store: Store, tmp_path: Path) -> None:
    c = make_contents(lengths=[500, 800, 300, 1200])
    c.payloads["kl"] = torch.zeros_like(c.payloads["kl"])
    store.ingest([write_bundle(tmp_path / "b", c)], run="r")
    (sb,) = store.step("r", 7, 0)
    rec = sb.record("kl")
    assert all(h is None for row in rec.chunks for h in row)
    assert np.array_equal(sb.payload("kl"), np.zeros(2800, np.float32))


def test_recaptured_step_is_a_second_attempt_and_both_are_kept(
    store: Store, tmp_path: Path
) -> None:
    c = make_contents(lengths=[4, 4, 4, 4])
    first = write_bundle(tmp_path / "first", c)
    c.payloads["log_probs"] = c.payloads["log_probs"].clone()
    c.payloads["log_probs"][5] += 1.0
    second = write_bundle(tmp_path / "second", c)
    assert store.ingest([first], run="r")[0].keys == ["r/step-7-0/a1"]
    assert store.ingest([second], run="r")[0].keys == ["r/step-7-0/a2"]
    assert store.step("r", 7, 0)[0].attempt == 2
    old = store.step("r", 7, 0, attempt=1)[0]
    assert np.array_equal(old.payload("log_probs"), c.payloads["log_probs"].numpy()) is False
    keys = [row["key"] for row in store.bundles(run="r", all_attempts=True)]
    assert keys == ["r/step-7-0/a1", "r/step-7-0/a2"]


def test_a_step_recaptured_by_one_producer_after_a_cohort_is_a_new_attempt(store: Store) -> None:
    store.ingest([CAPTURE_DIR], run="r")  # 120:0 as a 2-rank cohort
    store.ingest([FIXTURES / "example_bundle_divergent"], run="r")  # 120:0 from one producer
    assert store.attempts("r", "step", 120, 0) == [1, 2]
    assert [b.rank for b in store.step("r", 120, 0)] == [None]
    assert [b.rank for b in store.step("r", 120, 0, attempt=1)] == [0, 1]


def test_ls_and_query_show_a_step_resumed_on_fewer_ranks_once(tmp_path: Path, make_cohort) -> None:
    """Attempt 1 on ranks 0-2, then a resumed attempt 2 on ranks 0-1: attempt 1's rank 2
    is superseded too, as `Store.step` (replay, export) has it."""
    st = tmp_path / "st"
    for cohort in (make_cohort(ranks=3, seed=1), make_cohort(ranks=2, seed=2)):
        done = run_main("ingest", "--store", st, "--run", "R", cohort)
        assert done.returncode == 0, done.stderr
    assert [b.ref["key"] for b in Store.open(st).step("R", 7, 0)] == [
        "R/step-7-0/rank-0/a2",
        "R/step-7-0/rank-1/a2",
    ]
    ls = run_main("ls", "--store", st, "--json")
    assert [b["key"] for b in json.loads(ls.stdout)] == [
        "R/step-7-0/rank-0/a2",
        "R/step-7-0/rank-1/a2",
    ]
    steps = run_main("query", "steps", "--store", st, "--format", "json")
    assert [(s["attempt"], s["ranks"]) for s in json.loads(steps.stdout)] == [(2, [0, 1])]
    unreplayed = run_main(
        "query", "steps", "--store", st, "--status", "unreplayed", "--format", "json"
    )
    assert len(json.loads(unreplayed.stdout)) == 1


def test_flipped_byte_is_reported_by_fsck_and_by_reads(store: Store, tmp_path: Path) -> None:
    store.ingest([write_bundle(tmp_path / "b", make_contents(lengths=300))], run="r")
    store.close()
    rec_hash = Store.open(store.url).step("r", 7, 0)[0].record("log_probs").chunks[0][0]
    chunk = Store.open(store.url).objs.get(rec_hash)

    def flip(data: bytes) -> bytes:  # a byte inside that chunk object (found by its bytes)
        out = bytearray(data)
        out[data.find(chunk) + 10] ^= 0xFF
        return bytes(out)

    _edit_a_pack(store, flip)
    proc = run_main("fsck", "--store", store.url)
    assert proc.returncode == 2 and rec_hash in proc.stderr
    with pytest.raises(IntegrityError, match=rec_hash):
        Store.open(store.url).step("r", 7, 0)[0].payload("log_probs")


def test_a_lookup_leaves_the_loss_masks_unparsed_but_no_data_escapes_their_checks(
    tmp_path: Path,
) -> None:
    """`Store.step` and a bundle's metadata do not parse index.json (its loss masks are
    most of a lookup's cost); any read of samples, payloads or files runs its checks first,
    with the message and exit code a lookup used to give. (Local only: it rewrites a ref
    in place, which no backend allows; the lookup code is the same on both.)"""
    store = Store.open(tmp_path / "store", durable=False)
    store.ingest([write_bundle(tmp_path / "b", make_contents(lengths=5))], run="r")
    (entry,) = store.refs.at_anchor("r", "step", 7, 0)
    ref_path = store.layout.bundle_refs / f"{entry.name}.json"
    ref = json.loads(ref_path.read_bytes())
    index = get_json_blob(store.objs, ref["documents"]["index"])
    index["samples"][1]["loss_mask"][2] = "1"  # one bad entry deep in the loss masks
    ref["documents"]["index"] = put_blob(store.objs, json.dumps(index).encode())
    store.objs.flush()
    ref_path.write_bytes(json.dumps(ref).encode())
    store.close()
    msg = f"index.json samples[1] '{index['samples'][1]['sample_id']}': loss_mask entries"

    with Store.open(store.root) as st:
        (b,) = st.step("r", 7, 0)  # looked up, metadata readable: the masks are not parsed
        assert (b.bundle_id, b.attempt, b.rank) == (index["bundle_id"], 1, None)
        assert "log_probs" in b.payload_names() and "log_probs" in b.manifest.payloads
        reads = {
            "index": lambda: b.index,
            "payload": lambda: b.payload("log_probs"),
            "rows": lambda: b.payload_rows("log_probs", np.array([0])),
            "file": lambda: b.payload_file("log_probs"),
            "record": lambda: b.record("log_probs"),
            "index.json": lambda: b.file_bytes("index.json"),
        }
        for read in reads.values():  # each refused (a failed parse is not cached)
            with pytest.raises(BundleError, match=re.escape(msg)):
                read()
    out = tmp_path / "out"
    proc = run_main("export", "--store", store.root, "--run", "r", "--step", "7:0", out)
    assert proc.returncode == BundleError.exit_code, proc.stderr
    assert msg in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_invalid_bundle_is_refused_and_the_rest_ingested(tmp_path: Path) -> None:
    cap = tmp_path / "cap"
    write_bundle(cap / "replay-7-0", make_contents(lengths=5))
    bad = write_bundle(cap / "replay-7-1", make_contents(lengths=5, step_id=1))
    (bad / "payloads" / "kl.pt").write_bytes(b"tampered")
    st = tmp_path / "st"
    proc = run_main("ingest", cap, "--store", st)
    assert proc.returncode == 2
    assert "replay-7-1" in proc.stderr and "kl" in proc.stderr
    s = Store.open(st)
    assert s.step("default", 7, 0)
    with pytest.raises(NotFoundError):
        s.step("default", 7, 1)


def test_rm_hides_and_gc_frees_only_unreachable(store: Store, tmp_path: Path) -> None:
    a = write_bundle(tmp_path / "a", make_contents(lengths=400, seed=1))
    b = write_bundle(tmp_path / "b", make_contents(lengths=400, seed=2, step_id=1))
    store.ingest([a, b], run="r")
    assert store.remove(["r/step-7-0/a1"]) == ["r/step-7-0/a1"]
    with pytest.raises(NotFoundError):
        store.step("r", 7, 0)
    before = stored_bytes(store)
    assert gc(store, grace_s=3600)["objects_dropped"] == 0  # everything is younger than the grace
    res = gc(store, grace_s=0)
    assert res["objects_dropped"] > 0 and stored_bytes(store) < before
    assert fsck(store).ok
    assert store.step("r", 7, 1)[0].payload("kl").shape == (400 * 4,)


def _stored_files(store: Store) -> dict[str, int]:
    """Every pack, pack index and loose object of a store, with its size, whatever the backend."""
    if store.is_remote:
        import obstore

        objs = store.objs
        return {
            m["path"][len(objs.loc.prefix) :]: int(m["size"])
            for folder in ("packs/", "objects/")
            for b in obstore.list(objs.client, prefix=objs.loc.prefix + folder)
            for m in b
        }
    return {
        str(f.relative_to(store.root)): f.stat().st_size
        for folder in ("packs", "objects")
        for f in (store.root / folder).rglob("*")
        if f.is_file()
    }


def _drop_pack_index(store: Store, pack: str) -> None:
    """Delete the index of `pack` ("packs/<id>.pack"), as a lost file or a failed write would."""
    idx = pack.removesuffix(".pack") + ".idx"
    if store.is_remote:
        import obstore

        obstore.delete(store.objs.client, store.objs.loc.prefix + idx)
    else:
        (store.root / idx).unlink()


def test_gc_refuses_a_store_that_lost_a_pack_index_and_deletes_nothing(
    store: Store, tmp_path: Path
) -> None:
    """A pack whose index is lost holds live objects that fsck names as missing; it also
    looks like a pack whose index write failed (gc's to remove). gc must not decide."""
    store.ingest([write_bundle(tmp_path / "b", make_contents(lengths=50))], run="r")
    store.close()
    (pack,) = [f for f in _stored_files(store) if f.endswith(".pack")]
    _drop_pack_index(store, pack)
    files = _stored_files(store)
    damage = fsck(Store.open(store.url)).to_dict()
    assert not damage["ok"] and "is missing" in damage["problems"][0]

    with pytest.raises(StoreError, match=r"gc refused, nothing deleted: \d+ object\(s\) that live"):
        gc(Store.open(store.url), grace_s=0)
    assert _stored_files(store) == files  # the pack and every object are still there
    assert fsck(Store.open(store.url)).to_dict() == damage
    if not store.is_remote:  # the CLI takes no grace under 10m on S3 (a fresh pack is kept)
        proc = run_main("gc", "--store", store.url, "--grace", "0", "--json")
        assert proc.returncode == 2 and proc.stdout == ""
        (line,) = proc.stderr.splitlines()
        assert line.startswith("trajstore: error: gc refused, nothing deleted: ")
        assert f"run `trajstore fsck --store {store.url}`" in line
        assert _stored_files(store) == files


def test_gc_still_removes_a_pack_without_an_index_that_no_live_bundle_needs(
    store: Store, tmp_path: Path
) -> None:
    """What a full disk leaves (a pack whose index write failed) is gc's to delete."""
    src = write_bundle(tmp_path / "b", make_contents(lengths=50))
    store.ingest([src], run="r")
    before = _stored_files(store)
    store.objs.put(b"an object whose pack index was never written")
    store.objs.flush()
    (pack,) = [f for f in set(_stored_files(store)) - set(before) if f.endswith(".pack")]
    _drop_pack_index(store, pack)
    store.close()

    assert gc(Store.open(store.url), grace_s=0)["files_removed"] == 1
    assert _stored_files(store) == before
    with Store.open(store.url) as st:
        assert fsck(st).ok
        assert tree_equal(src, export_bundles(st.step("r", 7, 0), tmp_path / "out" / "b"))


def test_rm_of_a_run_lists_its_bundles_in_training_order(store: Store, tmp_path: Path) -> None:
    late = write_bundle(tmp_path / "late", make_contents(lengths=20, seed=2, step_id=1))
    early = write_bundle(tmp_path / "early", make_contents(lengths=20, seed=1))
    store.ingest([late], run="r")  # published first, yet listed after step (7, 0)
    store.ingest([early, CAPTURE_DIR], run="r")
    assert store.remove(run="r") == [
        "r/step-7-0/a1",
        "r/step-7-1/a1",
        "r/rollout-120/a1",
        "r/step-120-0/rank-0/a1",
        "r/step-120-0/rank-1/a1",
    ]


def test_reindex_rebuilds_an_identical_catalog(store: Store, tmp_path: Path) -> None:
    store.ingest([FIXTURES / "example_bundle", CAPTURE_DIR], run="r")
    before = store.bundles(all_attempts=True)
    (store.root / "catalog.duckdb").unlink()
    assert store.reindex()["new_refs"] == 4
    assert store.bundles(all_attempts=True) == before


def test_reindex_after_rm_and_gc_still_works(store: Store, tmp_path: Path) -> None:
    a = write_bundle(tmp_path / "a", make_contents(lengths=50, seed=1))
    b = write_bundle(tmp_path / "b", make_contents(lengths=50, seed=2, step_id=1))
    store.ingest([a], run="keep")
    store.ingest([b], run="drop")
    store.remove(run="drop")
    assert gc(store, grace_s=0)["objects_dropped"] > 0
    store.reindex()  # reads every ref, the removed one's collected documents included
    assert [b["run"] for b in store.bundles()] == ["keep"]


def test_export_refuses_a_conversion_it_cannot_express(store: Store, tmp_path: Path) -> None:
    b = copy_fixture("example_bundle", tmp_path)
    edit_json(b / "index.json", lambda ix: ix["samples"][3].update(reward=[-1.0]))  # per-token
    resign_bundle(b)
    store.ingest([b], run="r")
    with pytest.raises(UsageError, match="per-token rewards"):
        export_bundles(store.step("r", 120, 0), tmp_path / "out", format_major=1)
    assert not (tmp_path / "out").exists()


def test_export_of_a_bundle_key_refuses_a_run_or_attempt_it_contradicts(
    store: Store, tmp_path: Path
) -> None:
    store.ingest([FIXTURES / "example_bundle"], run="r")
    key = "r/step-120-0/a1"
    for given, error in (
        (["--attempt", "2"], f"bundle {key!r} is attempt 1, not attempt 2"),
        (["--run", "default"], f"bundle {key!r} is of run 'r', not of run 'default'"),
    ):
        proc = run_main("export", "--store", store.url, "--bundle", key, *given, tmp_path / "out")
        assert proc.returncode == 2
        assert proc.stderr.startswith(f"trajstore: error: {error}: name the bundle alone")
        assert not (tmp_path / "out").exists()
    proc = run_main("export", "--store", store.url, "--bundle", key, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr


def test_store_cli_needs_a_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRAJSTORE_STORE", raising=False)
    proc = run_main("stats")
    assert proc.returncode == 2 and "--store" in proc.stderr


def test_gc_keeps_every_file_of_a_stored_cohort(store: Store, tmp_path: Path, make_cohort) -> None:
    """A member's own COMPLETE.<r> and the cohort's COMPLETE.<r> differ (relpath): both live."""
    cohort = make_cohort(tmp_path / "replay-7-0", ranks=2, lengths=[3, 4, 2, 5])
    store.ingest([cohort], run="r")
    assert gc(store, grace_s=0)["objects_dropped"] == 0
    assert fsck(store).ok
    out = export_bundles(store.step("r", 7, 0), tmp_path / "out" / "replay-7-0")
    assert tree_equal(cohort, out)


def test_rm_of_one_rank_of_a_cohort_is_refused_naming_every_rank(
    tmp_path: Path, make_cohort
) -> None:
    st = tmp_path / "st"
    run_main("ingest", "--store", st, "--run", "A", make_cohort(ranks=3))
    ranks = [f"A/step-7-0/rank-{r}/a1" for r in range(3)]
    for some in ([ranks[0]], ranks[1:]):
        proc = run_main("rm", "--store", st, *some)
        assert (proc.returncode, proc.stdout) == (2, "")
        assert proc.stderr == (
            f"trajstore: error: {some[0]} is one rank of run 'A' step 7:0 attempt 1; a cohort "
            "is removed whole (its other ranks would list but not replay), so name every "
            f"rank: trajstore rm {' '.join(ranks)}\n"
        )
    assert not list((st / "refs" / "tombstones").glob("*.json"))  # nothing removed
    ls = run_main("ls", "--store", st, "--json")
    assert [b["key"] for b in json.loads(ls.stdout)] == ranks
    assert run_main("rm", "--store", st, *ranks).returncode == 0
    assert json.loads(run_main("ls", "--store", st, "--json").stdout) == []


def test_rm_takes_a_whole_cohort_a_single_producer_bundle_or_a_run(
    store: Store, tmp_path: Path, make_cohort
) -> None:
    store.ingest([make_cohort(tmp_path / "replay-7-0", ranks=2)], run="r")
    store.ingest([write_bundle(tmp_path / "one", make_contents(step_id=1))], run="r")
    store.ingest([write_bundle(tmp_path / "other", make_contents(step_id=1))], run="s")
    with pytest.raises(UsageError, match="rank-0/a1 r/step-7-0/rank-1/a1$"):
        store.remove(["r/step-7-0/rank-1/a1"])
    assert [b.rank for b in store.step("r", 7, 0)] == [0, 1]
    assert store.remove(["r/step-7-1/a1"]) == ["r/step-7-1/a1"]
    cohort = ["r/step-7-0/rank-0/a1", "r/step-7-0/rank-1/a1"]
    assert store.remove(cohort) == cohort
    with pytest.raises(NotFoundError):
        store.step("r", 7, 0)
    assert store.remove(run="s") == ["s/step-7-1/a1"]
    assert fsck(store).warnings == []


def test_fsck_says_how_to_clear_a_cohort_an_older_rm_left_half_removed(
    tmp_path: Path, make_cohort
) -> None:
    st = tmp_path / "st"
    with Store.open(st) as store:
        store.ingest([make_cohort(ranks=2)], run="A")
    # what `trajstore rm A/step-7-0/rank-0/a1` wrote before it refused part of a cohort
    tombstones = st / "refs" / "tombstones"
    tombstones.mkdir(parents=True, exist_ok=True)
    doc = {
        "tombstone_version": 1,
        "key": "A/step-7-0/rank-0/a1",
        "removed_at": "2026-12-01T00:00:00Z",
    }
    (tombstones / f"{time.time_ns():020d}-1-00.json").write_text(json.dumps(doc))
    (warning,) = fsck(Store.open(st)).warnings
    assert "replay and export refuse it" in warning
    assert warning.endswith("trajstore rm A/step-7-0/rank-1/a1")
    assert run_main("rm", "--store", st, "A/step-7-0/rank-1/a1").returncode == 0
    assert fsck(Store.open(st)).warnings == []
