"""Regression tests for what fuzzing the parsers found (docs/reliability.md, tests/fuzz/).

Each input is rebuilt from a fixture by the mutation the fuzzer (or a directed
check, where marked) made, so the test says what was wrong; each must end in
trajstore's own error with a one-line message, or a refused pack index.
"""

from __future__ import annotations

import importlib.util
import json
import struct
import zipfile
from collections.abc import Callable
from io import BytesIO
from pathlib import Path

import pytest
from blake3 import blake3

from trajstore.bundle.ptfile import read_pt_bytes
from trajstore.bundle.reader import parse_expected
from trajstore.cas import LocalObjectStore
from trajstore.errors import BundleError, NotFoundError
from trajstore.jsonio import parse_json
from trajstore.replay.context import StageOutcome
from trajstore.schema import CohortComplete

pytestmark = pytest.mark.unit

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


# -- what replay reads from expected.json (tests/fuzz/fuzz_expected.py) ---------------------
#
# Each input is the harness's seed (tests/fuzz/corpus/expected/) with one value changed, the
# way the harness writes it: into the template bundle, re-signed, opened by the bundle
# reader and replayed through every stage. Each raised from the stage that read it; now the
# reader refuses it in one line, or the stage fails saying what was wrong.

EXPECTED_SEEDS = Path(__file__).resolve().parent / "fuzz" / "corpus" / "expected"


def _fuzz_expected():  # noqa: ANN202 - the harness module
    spec = importlib.util.spec_from_file_location(
        "fuzz_expected", Path(__file__).resolve().parent / "fuzz" / "fuzz_expected.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _replayed(template: str, edit: Callable[[dict], object]) -> dict[str, StageOutcome]:
    """The harness's template `template` ("family" or "routed") replayed with its seed
    expected.json edited by `edit`: each stage's outcome by name."""
    seed = (EXPECTED_SEEDS / template).read_bytes()
    expected = json.loads(seed[1:])
    edit(expected)
    report = _fuzz_expected().replay_with_expected(seed[0], json.dumps(expected).encode())
    return {s.stage: s for s in report.bundles[0].stages}


def _micro_batch(expected: dict) -> dict:
    return expected["loss.policy"]["micro_batches"]["mb-0000"]


def test_a_micro_batch_record_that_is_no_object_fails_loss_policy() -> None:
    """Directed check of fuzz_expected: micro_batches {"mb-0000": 5} raised AttributeError
    ('int' object has no attribute 'get') in replay/losses.py."""
    stages = _replayed("family", lambda e: e["loss.policy"]["micro_batches"].update({"mb-0000": 5}))
    loss = stages["loss.policy"]
    assert loss.status == "fail"
    assert loss.reason == "expected.json loss.policy.micro_batches['mb-0000'] must be an object"


@pytest.mark.parametrize(
    ("field", "value", "what"),
    [
        ("token_normalizer", "x", "a number above 0"),
        ("token_normalizer", 0, "a number above 0"),
        ("aux_loss", "x", "a finite number"),
    ],
)
def test_a_micro_batch_number_that_is_no_number_fails_loss_policy(
    field: str, value: object, what: str
) -> None:
    """Directed check of fuzz_expected: token_normalizer "x" raised ValueError (could not
    convert string to float), 0 divided by zero into an inf loss, aux_loss "x" raised too."""
    stages = _replayed("family", lambda e: _micro_batch(e).update({field: value}))
    loss = stages["loss.policy"]
    assert loss.status == "fail"
    assert loss.reason == (
        f"expected.json loss.policy.micro_batches['mb-0000'].{field} is {value!r}, not {what}"
    )


def test_a_string_among_the_rewards_per_function_fails_reward_raw() -> None:
    """Directed check of fuzz_expected: a string in rewards_per_func raised ValueError from
    np.array in replay/losses.py."""
    stages = _replayed(
        "family", lambda e: e["reward.raw"]["rewards_per_func"][0].__setitem__(0, "x")
    )
    raw = stages["reward.raw"]
    assert raw.status == "fail"
    assert raw.reason == "expected.json reward.raw.rewards_per_func holds 'x', not a number or null"


def test_an_integer_beyond_a_float64_in_expected_json_is_refused_by_the_reader() -> None:
    """Directed check of fuzz_expected: 10**400 anywhere in expected.json raised OverflowError
    (int too large to convert to float) in whichever stage read it."""
    seed = (EXPECTED_SEEDS / "family").read_bytes()
    expected = json.loads(seed[1:])
    expected["loss.policy"]["loss"] = 10**400
    with pytest.raises(BundleError) as refused:
        _fuzz_expected().replay_with_expected(seed[0], json.dumps(expected).encode())
    assert str(refused.value) == "expected.json: an integer of 401 digits is beyond a float64"
    assert parse_expected(b'{"a": [1e308, ' + b"9" * 308 + b"]}")  # within a float64: read


@pytest.mark.parametrize("codes", [[1, {}], 5, {"missing_route": 1}])
def test_recorded_metric_error_that_is_no_list_of_codes_disagrees(codes: object) -> None:
    """Directed check of fuzz_expected: metric_error [1, {}] raised TypeError (sorting a dict
    with an int) in router/stage.py, 5 raised TypeError (not iterable)."""
    stages = _replayed("routed", lambda e: e["router.consistency"].update({"metric_error": codes}))
    router = stages["router.consistency"]
    assert router.status == "fail"
    assert [d.field for d in router.divergences] == ["metric_error"]


def test_recorded_metric_error_that_is_a_number_disagrees_as_the_fuzzer_found_it() -> None:
    """Fuzzer (fuzz_expected, input kept as found, 6,739 inputs into its first run):
    router.consistency's "metric_error": 2 raised TypeError ('int' object is not iterable)."""
    data = (CRASHES / "expected" / "metric-error-int.bin").read_bytes()
    assert b'"metric_error": 2' in data
    report = _fuzz_expected().replay_with_expected(data[0], data[1:])
    (router,) = [s for s in report.bundles[0].stages if s.stage == "router.consistency"]
    assert router.status == "fail"
    assert "metric_error" in [d.field for d in router.divergences]
