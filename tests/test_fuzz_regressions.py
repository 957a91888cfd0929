"""Regression tests for what fuzzing the parsers found (docs/reliability.md, tests/fuzz/).

Each input is rebuilt from a fixture by the mutation the fuzzer (or a directed
check, where marked) made, so the test says what was wrong; each must end in
trajstore's own error with a one-line message, or a refused pack index.
"""

from __future__ import annotations

import struct
import zipfile
from io import BytesIO
from pathlib import Path

import pytest
from blake3 import blake3

from trajstore.bundle.ptfile import read_pt_bytes
from trajstore.cas.objects import LocalObjectStore
from trajstore.errors import BundleError, NotFoundError
from trajstore.jsonio import parse_json
from trajstore.schema import CohortComplete

CRASHES = Path(__file__).resolve().parent / "fuzz" / "crashes"
PT_FIXTURE = Path(__file__).resolve().parent / "fixtures/relax-v2/example_bundle/payloads/kl.pt"


def _pt() -> bytes:
    return PT_FIXTURE.read_bytes()


def _member(raw: bytes, suffix: str) -> zipfile.ZipInfo:
    with zipfile.ZipFile(BytesIO(raw)) as zf:
        return next(i for i in zf.infolist() if i.filename.endswith(suffix))


def _central_dir_offset(raw: bytes, info: zipfile.ZipInfo) -> int:
    """Offset of ``info``'s central directory record (signature PK\\x01\\x02)."""
    name = info.filename.encode()
    at = raw.find(b"PK\x01\x02")
    while at >= 0:
        (name_len,) = struct.unpack("<H", raw[at + 28 : at + 30])
        if raw[at + 46 : at + 46 + name_len] == name:
            return at
        at = raw.find(b"PK\x01\x02", at + 4)
    raise AssertionError(f"no central directory record for {info.filename}")


def _one_line_bundle_error(raw: bytes) -> str:
    with pytest.raises(BundleError) as exc:
        read_pt_bytes(raw, label="fuzz")
    assert "\n" not in str(exc.value)
    return str(exc.value)


def test_pt_with_a_corrupted_pickle_member_is_a_bundle_error() -> None:
    """Fuzzer: a flipped byte inside data.pkl made zipfile raise BadZipFile (bad CRC-32)."""
    raw = bytearray(_pt())
    info = _member(bytes(raw), "/data.pkl")
    (name_len, extra_len) = struct.unpack(
        "<HH", raw[info.header_offset + 26 : info.header_offset + 30]
    )
    raw[info.header_offset + 30 + name_len + extra_len + 5] ^= 0xFF
    assert "unreadable zip member" in _one_line_bundle_error(bytes(raw))


def test_pt_declaring_an_unknown_zip_version_is_a_bundle_error() -> None:
    """Fuzzer: 'version needed to extract' 24.7 made zipfile raise NotImplementedError."""
    raw = bytearray(_pt())
    at = _central_dir_offset(bytes(raw), _member(bytes(raw), "/data.pkl"))
    raw[at + 6 : at + 8] = struct.pack("<H", 247)
    assert "not a torch.save zip file" in _one_line_bundle_error(bytes(raw))


def test_deeply_nested_json_is_a_bundle_error() -> None:
    """Directed check (json's recursion limit): 100,000 '[' raised RecursionError."""
    with pytest.raises(BundleError, match="nested too deeply"):
        parse_json(b"[" * 100_000, "manifest.json")


def _signed_idx(entries: list[tuple[bytes, int, int]]) -> bytes:
    body = b"TSIDX\x00\x00\x01" + struct.pack("<Q", len(entries))
    body += b"".join(h + struct.pack("<QQ", off, ln) for h, off, ln in entries)
    return body + blake3(body).digest()


def test_pack_index_entry_whose_end_wraps_around_is_refused(tmp_path: Path) -> None:
    """Fuzzer: off + len overflowed uint64 and passed the 'inside the pack' check."""
    store = LocalObjectStore(tmp_path / "objects")
    h = store.put(b"x" * 100)
    store.flush()
    (idx,) = (tmp_path / "objects" / "packs").glob("*.idx")
    pack_size = idx.with_suffix(".pack").stat().st_size
    idx.write_bytes(_signed_idx([(bytes.fromhex(h), 209, (1 << 64) - 102)]))
    wrapped_end = (209 + (1 << 64) - 102) % (1 << 64)
    assert wrapped_end <= pack_size  # the wrapped end looked inside the pack
    reopened = LocalObjectStore(tmp_path / "objects")
    assert reopened.corrupt_indexes == [idx]
    with pytest.raises(NotFoundError):
        reopened.get(h)


def test_pt_whose_member_offset_overflows_a_seek_is_a_bundle_error() -> None:
    """Fuzzer (input kept as found): zipfile's seek raised OverflowError on a huge offset."""
    raw = (CRASHES / "ptfile" / "seek-overflow.bin").read_bytes()
    assert "unreadable zip member" in _one_line_bundle_error(raw)


def _zip(pickled: bytes, storage: bytes) -> bytes:
    out = BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pickled)
        zf.writestr("archive/data/0", storage)
    return out.getvalue()


def test_pt_pickle_with_a_huge_memo_index_is_refused_before_allocating() -> None:
    """Fuzzer: LONG_BINPUT 175401059 made C's unpickler allocate a 1.4 GB memo (OOM)."""
    pickled = b"\x80\x02(r" + struct.pack("<I", 175_401_059) + b"t."
    assert "memo index 175401059" in _one_line_bundle_error(_zip(pickled, b""))


def test_pt_pickle_frame_declaring_2_to_the_63_bytes_is_a_bundle_error() -> None:
    """Fuzzer: FRAME 0x9595...95 made the unpickler raise OverflowError."""
    pickled = b"\x80\x04\x95" + b"\x95" * 8 + b"."
    assert "unreadable pickle" in _one_line_bundle_error(_zip(pickled, b""))


def test_pt_expanded_tensor_is_refused_not_materialized() -> None:
    """Directed check of the harness's memory property: a 1.5 KB file with stride 0 over one
    element made the reader allocate 1 GiB (up to 128 GiB within MAX_ELEMENTS)."""
    import torch

    out = BytesIO()
    torch.save(torch.zeros(1).expand(1 << 28), out)
    assert "repeats storage elements" in _one_line_bundle_error(out.getvalue())


def test_pt_bzip2_storage_record_is_refused_unread() -> None:
    """Directed check: bzip2 can inflate a few KB to gigabytes; only stored/deflated are read."""
    out = BytesIO()
    with zipfile.ZipFile(BytesIO(_pt())) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            kind = zipfile.ZIP_BZIP2 if "/data/" in info.filename else zipfile.ZIP_STORED
            dst.writestr(info.filename, src.read(info), compress_type=kind)
    assert "compression 12" in _one_line_bundle_error(out.getvalue())


def test_pt_deflated_storage_record_is_read() -> None:
    """The deflated path stays open (another zip writer than torch.save's)."""
    out = BytesIO()
    with zipfile.ZipFile(BytesIO(_pt())) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info), compress_type=zipfile.ZIP_DEFLATED)
    assert read_pt_bytes(out.getvalue()).array.tolist() == read_pt_bytes(_pt()).array.tolist()


def test_cohort_complete_with_a_non_numeric_shard_key_is_a_bundle_error() -> None:
    """Fuzzer: shard key '&' made int() raise ValueError in CohortComplete."""
    doc = {"ranks": [0, 1], "shards": {"&": {}}}
    with pytest.raises(BundleError, match="is not a rank number"):
        CohortComplete.from_dict(doc)
