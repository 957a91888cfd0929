"""Reading bundles behind the integrity gate, and every refusal it makes."""

from __future__ import annotations

import io
import math
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    CAPTURE_DIR,
    FIXTURE_BUNDLES,
    FIXTURES,
    copy_fixture,
    edit_json,
    make_contents,
    read_json,
    resign_bundle,
    write_json,
)
from test_bundle_format import torch_zip

from trajstore.bundle.capture_dir import discover_targets, resolve_target
from trajstore.bundle.reader import open_bundle, open_cohort, open_target
from trajstore.bundle.summary import inspect_target
from trajstore.bundle.validate import validate_path
from trajstore.bundle.writer import write_bundle
from trajstore.errors import BundleError, UsageError

pytestmark = pytest.mark.unit


def _problems(path: Path) -> list[str]:
    report = validate_path(path)
    assert report["valid"] is (not report["problems"])
    return report["problems"]


# ------------------------------------------------------------ fixtures read


@pytest.mark.parametrize("name", FIXTURE_BUNDLES)
def test_fixture_bundle_opens_with_every_payload_verified(name: str) -> None:
    bset = open_target(FIXTURES / name, verify_payloads=True)
    b = bset.first
    assert not bset.is_cohort
    assert b.major == 2
    assert b.index.identity.anchor == "120:0"
    assert b.payload_names() == [
        "advantages",
        "entropy",
        "kl",
        "log_probs",
        "old_log_probs",
        "ref_log_probs",
    ]


@pytest.mark.parametrize("name", FIXTURE_BUNDLES)
def test_fixture_bundle_validates(name: str) -> None:
    report = validate_path(FIXTURES / name)
    assert report["valid"] is True
    assert report["problems"] == []
    assert report["warnings"] == []
    assert len(report["bundles"]) == 1


def test_fixture_payloads_equal_torch_load() -> None:
    b = open_bundle(FIXTURES / "example_bundle")
    for name in b.payload_names():
        ref = torch.load(b.path / "payloads" / f"{name}.pt", weights_only=True)
        assert b.payload(name).tobytes() == ref.numpy().tobytes()


def test_capture_dir_step_selects_the_two_rank_cohort() -> None:
    target = resolve_target(CAPTURE_DIR, step=(120, 0))
    assert target == CAPTURE_DIR / "replay-120-0"
    bset = open_target(target, verify_payloads=True)
    assert bset.is_cohort
    assert [b.rank for b in bset.bundles] == [0, 1]
    assert {b.index.identity.anchor for b in bset.bundles} == {"120:0"}
    assert validate_path(target)["valid"]


def test_capture_dir_rollout_selects_the_rollout_bundle() -> None:
    target = resolve_target(CAPTURE_DIR, rollout=120)
    assert target == CAPTURE_DIR / "replay-rollout-120"
    b = open_target(target, verify_payloads=True).first
    assert b.index.identity.kind == "rollout"
    assert b.index.identity.anchor == "rollout 120"
    assert validate_path(target)["valid"]


def test_capture_dir_discovers_every_bundle() -> None:
    assert discover_targets(CAPTURE_DIR) == [
        CAPTURE_DIR / "replay-120-0",
        CAPTURE_DIR / "replay-rollout-120",
    ]


def test_capture_dir_without_a_selector_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="--step R:S or --rollout R"):
        resolve_target(CAPTURE_DIR)


def test_capture_dir_step_that_is_absent_names_the_step() -> None:
    with pytest.raises(BundleError, match="no bundle for step 121:0"):
        resolve_target(CAPTURE_DIR, step=(121, 0))


def test_rank_member_of_a_finished_cohort_opens_directly() -> None:
    b = open_bundle(CAPTURE_DIR / "replay-120-0" / "rank-1", verify_payloads=True)
    assert b.rank == 1


def test_inspect_of_an_incomplete_bundle_says_so(tmp_path: Path) -> None:
    bundle = copy_fixture("example_bundle", tmp_path)
    (bundle / "COMPLETE").unlink()
    info = inspect_target(bundle)
    assert info["complete"] is False
    assert "COMPLETE is missing" in info["reason"]
    assert info["members"][0]["bundle_id"] == "b-example"
    assert info["members"][0]["samples"]["count"] == 4


def test_inspect_of_an_unfinished_cohort_reads_its_ranks(make_cohort) -> None:
    cohort = make_cohort(ranks=3, order=[2, 0])
    info = inspect_target(cohort)
    assert info["complete"] is False
    assert "cohort is not complete" in info["reason"]
    assert [Path(m["path"]).name for m in info["members"]] == ["rank-0", "rank-2"]


# ------------------------------------------------------------ integrity gate


def test_missing_complete_is_refused(tmp_path: Path) -> None:
    bundle = copy_fixture("example_bundle", tmp_path)
    (bundle / "COMPLETE").unlink()
    with pytest.raises(BundleError, match="COMPLETE is missing"):
        open_bundle(bundle)


def test_missing_payload_is_refused(tmp_path: Path) -> None:
    bundle = copy_fixture("example_bundle", tmp_path)
    (bundle / "payloads" / "kl.pt").unlink()
    with pytest.raises(BundleError, match=r"payload 'kl': file missing"):
        open_bundle(bundle, verify_payloads=True)


def test_missing_payload_is_a_validate_problem(tmp_path: Path) -> None:
    bundle = copy_fixture("example_bundle", tmp_path)
    (bundle / "payloads" / "kl.pt").unlink()
    assert [p for p in _problems(bundle) if "'kl'" in p] == [
        f"payload 'kl': file missing ({bundle / 'payloads' / 'kl.pt'})"
    ]


def test_truncated_payload_is_refused(tmp_path: Path) -> None:
    bundle = copy_fixture("example_bundle", tmp_path)
    f = bundle / "payloads" / "kl.pt"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(
        BundleError, match=r"payload 'kl': size \d+ bytes, manifest declares \d+ \(truncated"
    ):
        open_bundle(bundle).load_payload("kl")


def test_flipped_byte_in_payload_is_refused(tmp_path: Path) -> None:
    bundle = copy_fixture("example_bundle", tmp_path)
    f = bundle / "payloads" / "entropy.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"payload 'entropy': sha256 mismatch"):
        open_bundle(bundle).load_payload("entropy")


def test_edited_expected_json_without_resigning_is_refused(tmp_path: Path) -> None:
    bundle = copy_fixture("example_bundle", tmp_path)
    edit_json(bundle / "expected.json", lambda d: d["loss.policy"].update(loss=0.0))
    with pytest.raises(BundleError, match=r"expected.json: sha256 does not match COMPLETE"):
        open_bundle(bundle)


def test_missing_rank_shard_is_refused(tmp_path: Path) -> None:
    bundle = copy_fixture("example_bundle", tmp_path)
    (bundle / "COMPLETE.0").unlink()
    with pytest.raises(BundleError, match=r"rank shard COMPLETE.0 is missing"):
        open_bundle(bundle)


def _split_into_two_rank_shards(bundle: Path, rank1_payloads: list[str]) -> None:
    """Turn a single-rank bundle into one signed by ranks 0 and 1."""
    shard0 = read_json(bundle / "COMPLETE.0")
    shard1 = dict(shard0, expected_ranks=[0, 1])
    shard1["payloads"] = {n: shard0["payloads"][n] for n in rank1_payloads}
    shard0["expected_ranks"] = [0, 1]
    write_json(bundle / "COMPLETE.0", shard0)
    write_json(bundle / "COMPLETE.1", shard1)
    edit_json(bundle / "COMPLETE", lambda d: d.update(ranks=[0, 1], expected_ranks=[0, 1]))


def test_single_directory_bundle_signed_by_two_ranks_opens(tmp_path: Path) -> None:
    bundle = copy_fixture("example_bundle", tmp_path)
    _split_into_two_rank_shards(bundle, ["kl", "entropy"])
    shard0 = read_json(bundle / "COMPLETE.0")
    for n in ("kl", "entropy"):
        del shard0["payloads"][n]
    write_json(bundle / "COMPLETE.0", shard0)
    b = open_bundle(bundle, verify_payloads=True)
    assert sorted(b.shards) == [0, 1]


def test_payload_owned_by_two_ranks_is_refused(tmp_path: Path) -> None:
    bundle = copy_fixture("example_bundle", tmp_path)
    _split_into_two_rank_shards(bundle, ["kl"])
    with pytest.raises(BundleError, match=r"payload 'kl' is owned by two ranks \(0 and 1\)"):
        open_bundle(bundle)


def test_payload_claimed_by_no_rank_is_refused(tmp_path: Path) -> None:
    bundle = copy_fixture("example_bundle", tmp_path)
    edit_json(bundle / "COMPLETE.0", lambda d: d["payloads"].pop("kl"))
    with pytest.raises(BundleError, match=r"payload\(s\) kl claimed by no rank shard"):
        open_bundle(bundle)


def test_single_directory_bundle_missing_an_expected_rank_is_refused(tmp_path: Path) -> None:
    bundle = copy_fixture("example_bundle", tmp_path)
    edit_json(bundle / "COMPLETE", lambda d: d.update(expected_ranks=[0, 1]))
    with pytest.raises(BundleError, match=r"COMPLETE lists ranks \[0\] but expects ranks \[0, 1\]"):
        open_bundle(bundle)


def test_rank_shard_with_another_anchor_is_refused(tmp_path: Path) -> None:
    bundle = copy_fixture("example_bundle", tmp_path)
    edit_json(bundle / "COMPLETE.0", lambda d: d["actor_step_id"].update(step_id=1))
    with pytest.raises(
        BundleError, match=r"COMPLETE.0: anchor .* differs from index.json identity"
    ):
        open_bundle(bundle)


def test_rank_member_of_an_unfinished_cohort_is_refused(make_cohort) -> None:
    cohort = make_cohort(ranks=3, order=[0, 1])
    assert not (cohort / "COMPLETE").exists()
    with pytest.raises(
        BundleError, match=r"cohort is not complete .*rank bundle of an unfinished cohort"
    ):
        open_bundle(cohort / "rank-0")


def test_unfinished_cohort_is_refused(make_cohort) -> None:
    cohort = make_cohort(ranks=3, order=[2, 1])
    with pytest.raises(
        BundleError,
        match=r"cohort is not complete \(no cohort COMPLETE; rank dirs present: \[1, 2\]\)",
    ):
        open_target(cohort)


def test_cohort_missing_a_shard_sentinel_is_refused(make_cohort) -> None:
    cohort = make_cohort(ranks=2)
    (cohort / "COMPLETE.1").unlink()
    with pytest.raises(BundleError, match=r"cohort shard COMPLETE.1 is missing"):
        open_cohort(cohort)


def test_rank_member_swapped_after_finalize_is_refused(make_cohort, tmp_path: Path) -> None:
    cohort = make_cohort(ranks=2)
    other = make_cohort(tmp_path / "other", ranks=2, seed=5)
    (cohort / "rank-1").rename(tmp_path / "old-rank-1")
    (other / "rank-1").rename(cohort / "rank-1")
    with pytest.raises(BundleError, match=r"rank 1 metadata hashes differ from the cohort"):
        open_bundle(cohort / "rank-1")


def test_unknown_major_bundle_is_refused(tmp_path: Path) -> None:
    bundle = copy_fixture("example_bundle", tmp_path)
    edit_json(bundle / "manifest.json", lambda d: d.update(format_version="3.0.0"))
    resign_bundle(bundle)
    with pytest.raises(BundleError, match=r"unsupported format major 3 \(format_version '3.0.0'\)"):
        open_bundle(bundle)


@pytest.mark.parametrize("name", ["../x", "a/b", ".."])
def test_payload_name_with_a_path_is_refused(tmp_path: Path, name: str) -> None:
    bundle = copy_fixture("example_bundle", tmp_path)

    def add(d: dict) -> None:
        d["payloads"][name] = dict(d["payloads"]["kl"], name=name)

    edit_json(bundle / "manifest.json", add)
    edit_json(bundle / "COMPLETE.0", lambda d: d["payloads"].update({name: "0" * 64}))
    resign_bundle(bundle)
    with pytest.raises(
        BundleError,
        match=rf"payload name {name!r} is not a plain file name; refused".replace(".", r"\."),
    ):
        open_bundle(bundle)


def test_symlinked_payload_is_refused(tmp_path: Path) -> None:
    bundle = copy_fixture("example_bundle", tmp_path)
    f = bundle / "payloads" / "kl.pt"
    outside = tmp_path / "kl-elsewhere.pt"
    f.rename(outside)
    f.symlink_to(outside)  # same bytes, so only the link itself is wrong
    with pytest.raises(BundleError, match=r"payload 'kl': .* is a symlink; refused"):
        open_bundle(bundle).load_payload("kl")


def test_symlinked_metadata_file_is_refused(tmp_path: Path) -> None:
    bundle = copy_fixture("example_bundle", tmp_path)
    f = bundle / "expected.json"
    f.rename(tmp_path / "expected.json")
    f.symlink_to(tmp_path / "expected.json")
    with pytest.raises(BundleError, match=r"expected.json: is a symlink"):
        open_bundle(bundle)


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_payload_with_a_malicious_pickle_is_refused_without_running_it(tmp_path: Path) -> None:
    bundle = copy_fixture("example_bundle", tmp_path)
    marker = tmp_path / "pwned"
    (bundle / "payloads" / "kl.pt").write_bytes(torch_zip(pickle.dumps(_Evil(marker), protocol=2)))
    resign_bundle(bundle)  # the hashes match: only the pickle itself is wrong
    b = open_bundle(bundle)
    with pytest.raises(
        BundleError,
        match=r"payload 'kl': unsafe or unreadable pickle: refused pickle global io\.open",
    ):
        b.load_payload("kl")
    assert not marker.exists()
    assert any("refused pickle global" in p for p in _problems(bundle))
    assert not marker.exists()


def test_payload_holding_a_dict_of_tensors_is_refused(tmp_path: Path) -> None:
    bundle = copy_fixture("example_bundle", tmp_path)
    buf = io.BytesIO()
    torch.save({"kl": torch.zeros(10)}, buf)
    (bundle / "payloads" / "kl.pt").write_bytes(buf.getvalue())
    resign_bundle(bundle)
    with pytest.raises(
        BundleError, match=r"payload 'kl': does not hold a plain tensor \(got dict\)"
    ):
        open_bundle(bundle).load_payload("kl")


def test_payload_dtype_other_than_declared_is_refused(tmp_path: Path) -> None:
    bundle = copy_fixture("example_bundle", tmp_path)
    edit_json(bundle / "manifest.json", lambda d: d["payloads"]["kl"].update(dtype="torch.float64"))
    resign_bundle(bundle)
    with pytest.raises(
        BundleError, match=r"payload 'kl': dtype torch.float32, manifest declares torch.float64"
    ):
        open_bundle(bundle).load_payload("kl")


def test_bundle_id_differing_between_manifest_and_index_is_refused(tmp_path: Path) -> None:
    bundle = copy_fixture("example_bundle", tmp_path)
    edit_json(bundle / "index.json", lambda d: d.update(bundle_id="b-other"))
    resign_bundle(bundle)
    with pytest.raises(BundleError, match=r"bundle_id differs"):
        open_bundle(bundle)


# ------------------------------------------------------------ content checks


def test_nan_in_a_payload_is_a_validate_problem_naming_it(tmp_path: Path) -> None:
    contents = make_contents()
    contents.payloads["kl"][2] = math.nan
    bundle = write_bundle(tmp_path / "b", contents)
    open_bundle(bundle, verify_payloads=True)  # still opens
    assert _problems(bundle) == [
        "payload 'kl': 1 non-finite value(s) (NaN/Inf), first at flat index 2"
    ]


def test_inf_in_a_bfloat16_payload_is_a_validate_problem(tmp_path: Path) -> None:
    contents = make_contents(dtype=torch.bfloat16)
    contents.payloads["entropy"][0] = math.inf
    bundle = write_bundle(tmp_path / "b", contents)
    assert _problems(bundle) == [
        "payload 'entropy': 1 non-finite value(s) (NaN/Inf), first at flat index 0"
    ]


def test_duplicate_sample_ids_are_a_validate_problem(tmp_path: Path) -> None:
    contents = make_contents()
    contents.samples[1]["sample_id"] = contents.samples[0]["sample_id"]
    bundle = write_bundle(tmp_path / "b", contents)
    assert _problems(bundle) == ["sample id 's-0' appears 2 times"]


def test_loss_mask_length_mismatch_is_a_validate_problem(tmp_path: Path) -> None:
    contents = make_contents(lengths=3)
    contents.samples[2]["loss_mask"] = [1, 1]
    bundle = write_bundle(tmp_path / "b", contents)
    assert _problems(bundle) == ["sample 's-2': loss_mask has 2 entries, response_length is 3"]


def test_per_token_payload_length_mismatch_is_a_validate_problem(tmp_path: Path) -> None:
    contents = make_contents(lengths=3)  # 4 samples x 3 tokens
    contents.payloads["advantages"] = contents.payloads["advantages"][:-1]
    bundle = write_bundle(tmp_path / "b", contents)
    assert _problems(bundle) == [
        "payload 'advantages': shape [11], samples have 12 response tokens"
    ]


def test_incomplete_semantic_group_in_a_rollout_bundle_is_a_validate_problem(
    tmp_path: Path,
) -> None:
    contents = make_contents(kind="rollout", groups=2, samples_per_group=3, lengths=2)
    del contents.samples[-1]
    contents.payloads = {k: v[:-2] for k, v in contents.payloads.items()}
    bundle = write_bundle(tmp_path / "b", contents)
    assert _problems(bundle) == ["group g-1 has 2 sample(s), n_samples_per_prompt is 3"]


def test_factory_bundle_payloads_read_back_as_written(tmp_path: Path) -> None:
    contents = make_contents(seed=3)
    b = open_bundle(write_bundle(tmp_path / "b", contents))
    for name, tensor in contents.payloads.items():
        assert np.array_equal(b.payload(name), tensor.numpy())
