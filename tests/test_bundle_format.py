"""The bundle format itself: JSON models (both majors) and the torch-free .pt reader."""

from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CAPTURE_DIR, FIXTURE_BUNDLES, FIXTURES, read_json

from trajstore.bundle.ptfile import read_pt_bytes
from trajstore.errors import BundleError
from trajstore.jsonio import canonical_dumps
from trajstore.schema import (
    CohortComplete,
    Complete,
    Index,
    Manifest,
    RankShard,
    format_major,
)

pytestmark = pytest.mark.unit

V2_BUNDLE_DIRS = [FIXTURES / n for n in FIXTURE_BUNDLES] + [
    CAPTURE_DIR / "replay-120-0" / "rank-0",
    CAPTURE_DIR / "replay-120-0" / "rank-1",
    CAPTURE_DIR / "replay-rollout-120",
]


# --------------------------------------------------------------------- schema


@pytest.mark.parametrize("bundle", V2_BUNDLE_DIRS, ids=lambda p: p.relative_to(FIXTURES).as_posix())
def test_major2_documents_round_trip_losslessly(bundle: Path) -> None:
    for name, model in (("manifest.json", Manifest), ("index.json", Index), ("COMPLETE", Complete)):
        d = read_json(bundle / name)
        assert model.from_dict(d).to_dict() == d
    for shard in bundle.glob("COMPLETE.*"):
        d = read_json(shard)
        assert RankShard.from_dict(d).to_dict() == d
    assert Manifest.from_dict(read_json(bundle / "manifest.json")).major == 2


def test_cohort_complete_round_trips_losslessly() -> None:
    d = read_json(CAPTURE_DIR / "replay-120-0" / "COMPLETE")
    assert CohortComplete.from_dict(d).to_dict() == d


def test_major1_documents_from_our_writer_round_trip_losslessly(make_bundle) -> None:
    bundle = make_bundle(kind="rollout")
    for name, model in (("manifest.json", Manifest), ("index.json", Index), ("COMPLETE", Complete)):
        d = read_json(bundle / name)
        assert model.from_dict(d).to_dict() == d
    assert Manifest.from_dict(read_json(bundle / "manifest.json")).major == 1


def test_fixture_json_is_canonical() -> None:
    path = FIXTURES / "example_bundle" / "manifest.json"
    assert canonical_dumps(read_json(path)) == path.read_text(encoding="utf-8")


def test_unknown_top_level_manifest_key_is_a_warning() -> None:
    d = read_json(FIXTURES / "example_bundle" / "manifest.json")
    d["future_feature"] = {"x": 1}
    m = Manifest.from_dict(d)
    assert m.to_dict() == d
    assert any("future_feature" in w for w in m.warnings())


def test_unknown_top_level_index_key_is_a_warning() -> None:
    d = read_json(FIXTURES / "example_bundle" / "index.json")
    d["future_feature"] = 1
    idx = Index.from_dict(d)
    assert idx.to_dict() == d
    assert idx.warnings() == ["index.json: unknown top-level key 'future_feature' (ignored)"]


def test_unknown_major_is_refused() -> None:
    d = read_json(FIXTURES / "example_bundle" / "manifest.json")
    d["format_version"] = "3.0.0"
    with pytest.raises(BundleError, match=r"unsupported format major 3"):
        Manifest.from_dict(d)


@pytest.mark.parametrize("version", ["", "v1", "1", None, 1])
def test_malformed_format_version_is_refused(version) -> None:
    with pytest.raises(BundleError, match="format_version"):
        format_major(version)


def test_both_anchors_set_is_refused() -> None:
    d = read_json(FIXTURES / "example_bundle" / "index.json")
    d["identity"]["rollout_id"] = 120
    with pytest.raises(BundleError, match="exactly one of actor_step_id and rollout_id"):
        Index.from_dict(d)


def test_non_object_tolerances_is_refused_not_a_crash() -> None:
    d = read_json(FIXTURES / "example_bundle" / "manifest.json")
    d["comparison_policy"]["tolerances"] = []
    with pytest.raises(BundleError, match="tolerances"):
        Manifest.from_dict(d)


def test_non_integer_loss_mask_is_refused_not_a_crash() -> None:
    d = read_json(FIXTURES / "example_bundle" / "index.json")
    d["samples"][0]["loss_mask"] = ["1", 1, 1]
    with pytest.raises(BundleError, match="loss_mask"):
        Index.from_dict(d)


# ----------------------------------------------------------------- .pt reader


def tensor_bits(t: torch.Tensor) -> bytes:
    flat = t.detach().contiguous().reshape(-1)
    return b"" if flat.numel() == 0 else flat.view(torch.uint8).numpy().tobytes()


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(7),
        torch.randn(3, 4, dtype=torch.float64),
        torch.randn(5).to(torch.bfloat16),
        torch.randn(5).to(torch.float16),
        torch.arange(-4, 4, dtype=torch.int64),
        torch.arange(-4, 4, dtype=torch.int32),
        torch.tensor([0, 255], dtype=torch.uint8),
        torch.tensor([True, False, True]),
        torch.zeros(0),
        torch.tensor([float("nan"), -0.0, float("inf")]),
    ],
    ids=lambda t: f"{t.dtype}-{list(t.shape)}",
)
def test_pt_reader_is_bit_identical_to_torch_load(tensor: torch.Tensor) -> None:
    raw = _saved(tensor)
    pt = read_pt_bytes(raw)
    ref = torch.load(io.BytesIO(raw), weights_only=True)
    assert pt.dtype == str(ref.dtype)
    assert pt.shape == tuple(ref.shape)
    assert pt.to_torch().dtype == ref.dtype
    assert tensor_bits(pt.to_torch()) == tensor_bits(ref)


def test_pt_reader_reads_a_non_contiguous_view() -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    raw = _saved(base.t())
    assert np.array_equal(read_pt_bytes(raw).array, base.t().numpy())


def test_pt_reader_refuses_a_dict_of_tensors() -> None:
    raw = _saved({"a": torch.zeros(2), "b": torch.ones(2)})
    with pytest.raises(BundleError, match="does not hold a plain tensor"):
        read_pt_bytes(raw)


def test_pt_reader_refuses_a_file_that_is_not_a_zip() -> None:
    with pytest.raises(BundleError, match="not a torch.save zip"):
        read_pt_bytes(b"\x80\x02K\x01.")


def torch_zip(pkl: bytes, storages: dict[str, bytes] | None = None) -> bytes:
    """A torch.save-style zip: archive/data.pkl plus archive/data/<key> records."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pkl)
        zf.writestr("archive/byteorder", b"little")
        for key, data in (storages or {}).items():
            zf.writestr(f"archive/data/{key}", data)
        zf.writestr("archive/version", b"3\n")
    return buf.getvalue()


def _u(s: str) -> bytes:
    b = s.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(b)) + b


def _i(v: int) -> bytes:
    return pickle.BININT + struct.pack("<i", v)


def tensor_pickle(size, stride, numel: int, build_size=None) -> bytes:
    """Hand-assembled opcodes of a float32 tensor pickle (what torch.save emits).

    ``build_size`` appends a BUILD that overwrites the record's ``size``.
    """
    out = (
        pickle.PROTO + b"\x02" + pickle.GLOBAL + b"torch._utils\n_rebuild_tensor_v2\n" + pickle.MARK
    )
    out += pickle.MARK + _u("storage") + pickle.GLOBAL + b"torch\nFloatStorage\n"
    out += _u("0") + _u("cpu") + _i(numel) + pickle.TUPLE + pickle.BINPERSID
    out += _i(0)
    out += pickle.MARK + b"".join(_i(s) for s in size) + pickle.TUPLE
    out += pickle.MARK + b"".join(_i(s) for s in stride) + pickle.TUPLE
    out += (
        pickle.NEWFALSE
        + pickle.GLOBAL
        + b"collections\nOrderedDict\n"
        + pickle.EMPTY_TUPLE
        + pickle.REDUCE
    )
    out += pickle.TUPLE + pickle.REDUCE
    if build_size is not None:
        out += pickle.EMPTY_DICT + _u("size") + pickle.MARK + b"".join(_u(s) for s in build_size)
        out += pickle.TUPLE + pickle.SETITEM + pickle.BUILD
    return out + pickle.STOP


def test_hand_assembled_tensor_pickle_reads() -> None:
    """Sanity check of the crafting helpers the refusal tests below rely on."""
    data = np.array([1.5, -2.0, 3.25], dtype="<f4").tobytes()
    pt = read_pt_bytes(torch_zip(tensor_pickle((3,), (1,), 3), {"0": data}))
    assert pt.dtype == "torch.float32"
    assert pt.array.tolist() == [1.5, -2.0, 3.25]


def test_pt_reader_refuses_size_and_stride_of_different_rank() -> None:
    data = np.zeros(6, dtype="<f4").tobytes()
    with pytest.raises(BundleError, match="malformed tensor record"):
        read_pt_bytes(torch_zip(tensor_pickle((2, 3), (1,), 6), {"0": data}))


def test_pt_reader_refuses_a_build_that_rewrites_the_tensor_record() -> None:
    data = np.zeros(3, dtype="<f4").tobytes()
    with pytest.raises(BundleError, match="malformed tensor record"):
        read_pt_bytes(torch_zip(tensor_pickle((3,), (1,), 3, build_size=["a"]), {"0": data}))


def test_pt_reader_refuses_storage_smaller_than_declared() -> None:
    data = np.zeros(2, dtype="<f4").tobytes()
    with pytest.raises(BundleError, match="storage holds 8 bytes, declared 12"):
        read_pt_bytes(torch_zip(tensor_pickle((3,), (1,), 3), {"0": data}))


class _SystemCall:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _OpenCall:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


class _EvalCall:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (eval, (f"open({str(self.marker)!r}, 'w').close()",))


@pytest.mark.parametrize(
    ("payload_cls", "refused"),
    [(_SystemCall, r"\.system"), (_OpenCall, r"\.open"), (_EvalCall, r"\.eval")],
    ids=["os.system", "builtins.open", "builtins.eval"],
)
def test_pt_reader_refuses_a_malicious_pickle_without_running_it(
    tmp_path: Path, payload_cls, refused: str
) -> None:
    marker = tmp_path / "pwned"
    raw = torch_zip(pickle.dumps(payload_cls(marker), protocol=2))
    with pytest.raises(
        BundleError, match=rf"unsafe or unreadable pickle: refused pickle global .*{refused}"
    ):
        read_pt_bytes(raw, label="payload 'evil'")
    assert not marker.exists()
