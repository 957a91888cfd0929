"""Writing major-1 bundles: round trip, cohorts, atomicity, refusals."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FIXTURES, make_contents, read_json
from test_bundle_format import tensor_bits

from trajstore.bundle.reader import open_bundle, open_target
from trajstore.bundle.writer import try_finalize, write_bundle, write_rank
from trajstore.errors import BundleError
from trajstore.jsonio import canonical_dumps

pytestmark = pytest.mark.unit


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name)


def test_round_trip_keeps_json_identical(tmp_path: Path) -> None:
    contents = make_contents(seed=1)
    b = open_bundle(write_bundle(tmp_path / "b", contents), verify_payloads=True)
    assert b.index.to_dict() == {
        "bundle_id": contents.bundle_id,
        "config": contents.config,
        "identity": contents.identity,
        "samples": contents.samples,
    }
    assert b.expected == contents.expected
    assert b.manifest.format_version == "1.0.0"
    assert b.manifest.producer == contents.producer
    assert b.warnings == []


def test_written_json_is_canonical(tmp_path: Path) -> None:
    bundle = write_bundle(tmp_path / "b", make_contents())
    for name in ("manifest.json", "index.json", "expected.json", "COMPLETE", "COMPLETE.0"):
        text = (bundle / name).read_text(encoding="utf-8")
        assert text == canonical_dumps(json.loads(text)), name


def test_major1_bundle_declares_reward_stages(tmp_path: Path) -> None:
    b = open_bundle(write_bundle(tmp_path / "b", make_contents()))
    assert sorted(b.manifest.stage_contracts) == sorted(
        [
            "sample",
            "reward.raw",
            "reward.post_process",
            "advantage.kl",
            "advantage.estimate",
            "loss.policy",
        ]
    )
    assert {c.get("version") for c in b.manifest.stage_contracts.values()} == {"v1"}


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor([0.1, -2.5, float("nan"), -0.0, 3e-38], dtype=torch.float32),
        torch.tensor([0.1, -2.5, float("inf"), -0.0], dtype=torch.bfloat16),
        torch.tensor([0.1, -2.5, 65504.0], dtype=torch.float16),
        torch.tensor([1.0 / 3.0, -1e300], dtype=torch.float64),
        torch.tensor([-(2**62), 0, 2**62 + 1], dtype=torch.int64),
        torch.tensor([-7, 0, 2**31 - 1], dtype=torch.int32),
        torch.tensor([0, 255], dtype=torch.uint8),
        torch.tensor([True, False]),
        torch.arange(24, dtype=torch.int64).reshape(2, 3, 4),
    ],
    ids=lambda t: f"{t.dtype}-{list(t.shape)}",
)
def test_round_trip_tensors_are_bit_identical(tmp_path: Path, tensor: torch.Tensor) -> None:
    contents = make_contents()
    contents.payloads["extra"] = tensor
    bundle = write_bundle(tmp_path / "b", contents)
    b = open_bundle(bundle, verify_payloads=True)
    pt = b.load_payload("extra")
    ref = torch.load(bundle / "payloads" / "extra.pt", weights_only=True)
    assert pt.dtype == str(tensor.dtype) == str(ref.dtype)
    assert pt.shape == tuple(tensor.shape)
    assert tensor_bits(pt.to_torch()) == tensor_bits(tensor) == tensor_bits(ref)


def test_non_contiguous_view_is_written_as_its_own_values(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    contents = make_contents()
    contents.payloads["extra"] = base.t()[1:]
    bundle = write_bundle(tmp_path / "b", contents)
    assert open_bundle(bundle).payload("extra").tolist() == base.t()[1:].tolist()
    # the saved storage holds only the view's elements, not its base
    assert (
        torch.load(bundle / "payloads" / "extra.pt", weights_only=True).untyped_storage().nbytes()
        == 9 * 4
    )


def test_numpy_payload_round_trips(tmp_path: Path) -> None:
    contents = make_contents()
    contents.payloads["extra"] = np.array([[1, 2], [3, 4]], dtype=np.int16)
    b = open_bundle(write_bundle(tmp_path / "b", contents))
    assert b.manifest.payloads["extra"].dtype == "torch.int16"
    assert b.payload("extra").tolist() == [[1, 2], [3, 4]]


def test_torch_save_bytes_are_written_verbatim(tmp_path: Path) -> None:
    original = (FIXTURES / "example_bundle" / "payloads" / "kl.pt").read_bytes()
    contents = make_contents()
    contents.payloads["extra"] = original
    bundle = write_bundle(tmp_path / "b", contents)
    assert (bundle / "payloads" / "extra.pt").read_bytes() == original


def test_write_refuses_to_overwrite(tmp_path: Path) -> None:
    dest = write_bundle(tmp_path / "b", make_contents(seed=1))
    before = (dest / "index.json").read_bytes()
    with pytest.raises(BundleError, match="already exists; refusing to overwrite"):
        write_bundle(dest, make_contents(seed=2))
    assert (dest / "index.json").read_bytes() == before


def test_unsupported_payload_type_raises_and_leaves_no_temp_dir(tmp_path: Path) -> None:
    contents = make_contents()
    contents.payloads["extra"] = [1.0, 2.0]
    with pytest.raises(BundleError, match=r"payload 'extra': unsupported value type list"):
        write_bundle(tmp_path / "b", contents)
    assert not (tmp_path / "b").exists()
    assert _leftovers(tmp_path) == []


def test_unreadable_tensor_dtype_is_refused_and_leaves_no_temp_dir(tmp_path: Path) -> None:
    contents = make_contents()
    contents.payloads["extra"] = torch.zeros(3, dtype=torch.complex64)
    with pytest.raises(BundleError, match=r"payload 'extra'"):
        write_bundle(tmp_path / "b", contents)
    assert not (tmp_path / "b").exists()
    assert _leftovers(tmp_path) == []


def test_invalid_identity_is_refused_and_leaves_no_temp_dir(tmp_path: Path) -> None:
    contents = make_contents()
    contents.identity["rollout_id"] = 3  # both anchors set
    with pytest.raises(BundleError, match="exactly one of actor_step_id and rollout_id"):
        write_bundle(tmp_path / "b", contents)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_payload_name_with_a_path_is_refused_by_the_writer(tmp_path: Path) -> None:
    contents = make_contents()
    contents.payloads["../x"] = torch.zeros(1)
    with pytest.raises(BundleError, match=r"payload name '\.\./x' is not a plain file name"):
        write_bundle(tmp_path / "b", contents)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("order", list(itertools.permutations([0, 1, 2])), ids=str)
def test_cohort_finalizes_exactly_when_the_last_rank_arrives(tmp_path: Path, order: tuple) -> None:
    cohort = tmp_path / "replay-7-0"
    for i, r in enumerate(order):
        assert not (cohort / "COMPLETE").exists()
        write_rank(
            cohort,
            make_contents(rank=r, world=3, bundle_id="b-c"),
            rank=r,
            expected_ranks=[0, 1, 2],
        )
        assert (cohort / f"COMPLETE.{r}").exists()
        assert (cohort / "COMPLETE").exists() is (i == len(order) - 1)
    cc = read_json(cohort / "COMPLETE")
    assert cc["ranks"] == [0, 1, 2]
    assert sorted(cc["shards"]) == ["0", "1", "2"]


def test_cohort_reads_back_every_rank(make_cohort) -> None:
    cohort = make_cohort(ranks=3, order=[2, 0, 1])
    bset = open_target(cohort, verify_payloads=True)
    assert bset.is_cohort
    assert [b.rank for b in bset.bundles] == [0, 1, 2]
    assert [b.index.samples[0].sample_id for b in bset.bundles] == ["s-0-0", "s-1-0", "s-2-0"]


def test_try_finalize_before_the_last_rank_returns_false(make_cohort) -> None:
    cohort = make_cohort(ranks=3, order=[1, 2])
    assert try_finalize(cohort) is False
    assert not (cohort / "COMPLETE").exists()


def test_try_finalize_is_idempotent(make_cohort) -> None:
    cohort = make_cohort(ranks=2)
    before = (cohort / "COMPLETE").read_bytes()
    assert try_finalize(cohort) is True
    assert (cohort / "COMPLETE").read_bytes() == before


def test_writing_a_rank_twice_is_refused(make_cohort) -> None:
    cohort = make_cohort(ranks=2, order=[0])
    with pytest.raises(BundleError, match="already exists"):
        write_rank(cohort, make_contents(rank=0, world=2), rank=0, expected_ranks=[0, 1])


def test_rank_outside_expected_ranks_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match=r"rank 3 is not among expected ranks \[0, 1\]"):
        write_rank(tmp_path / "c", make_contents(rank=3), rank=3, expected_ranks=[0, 1])


def test_cohort_shards_disagreeing_on_the_anchor_are_not_finalized(tmp_path: Path) -> None:
    cohort = tmp_path / "c"
    write_rank(cohort, make_contents(rank=0, step_id=0), rank=0, expected_ranks=[0, 1])
    with pytest.raises(BundleError, match="disagree on the anchor"):
        write_rank(cohort, make_contents(rank=1, step_id=1), rank=1, expected_ranks=[0, 1])
    assert not (cohort / "COMPLETE").exists()
