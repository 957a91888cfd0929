"""The bundle gate's JSON fast paths give exactly what the stdlib paths give.

`parse_json` lets orjson parse what it can parse the stdlib's way and hands
everything else (NaN, 1e400, integers beyond 64 bits, lone surrogates, deep
nesting, every error) to `json.loads`; `is_binary_int_list` only ever proves
"every item is the int 0 or 1". The loss-mask checks built on it keep their
messages, and the .pt reader's cache of checked tensor records changes no result.
`canonical_bytes` writes through orjson only what orjson writes as the stdlib does.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trajstore.bundle.checks import sample_record_problems
from trajstore.bundle.ptfile import read_pt_bytes
from trajstore.errors import BundleError
from trajstore.jsonio import (
    _parse_stdlib,
    canonical_bytes,
    dumps_sorted_indent1,
    is_binary_int_list,
    parse_json,
)
from trajstore.schema import Sample
from trajstore.vocab import Stage

pytestmark = pytest.mark.unit


def _outcome(fn, data: bytes) -> tuple[str, str]:  # noqa: ANN001
    try:
        return "ok", repr(fn(data, "doc.json"))
    except BundleError as exc:
        return "refused", str(exc)


TRICKY = [
    b'{"a": 1, "b": 2, "a": 3}',  # duplicate key: the last wins, first position kept
    b"[NaN, Infinity, -Infinity]",  # the stdlib's extensions of JSON
    b"[1e400, -1e400, 1.5e-400, -0, -0.0]",
    b"[18446744073709551615, 18446744073709551616, -9223372036854775809]",
    b'{"big": 123456789012345678901234567890}',
    b'"\\ud800"',  # a lone surrogate escape
    b'"\xed\xa0\x80"',  # an encoded surrogate: not UTF-8
    b"\xef\xbb\xbf{}",  # a BOM
    b'"\x01"',
    b'"a\\u0000b"',
    b"[1,]",
    b"{}\x00",
    b"",
    b" \t\r\n[1] ",
    b"[" * 1500 + b"]" * 1500,  # past orjson's depth, within the stdlib's
    b"[" * 100_000 + b"]" * 100_000,  # past both: 'nested too deeply'
    b"[0.1, 2.2250738585072011e-308, 4.9406564584124654e-324, 1.7976931348623157e308]",
    b'{"s": "\\u00e9\xc3\xa9\xf0\x9f\x98\x80"}',
]


@pytest.mark.parametrize("data", TRICKY, ids=range(len(TRICKY)))
def test_parse_json_is_the_stdlib_on_edge_cases(data: bytes) -> None:
    assert _outcome(parse_json, data) == _outcome(_parse_stdlib, data)


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=5), children, max_size=6)
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(_json_values, st.booleans(), st.sampled_from([None, 2]))
def test_parse_json_matches_the_stdlib_on_random_documents(
    value: object, ascii_only: bool, indent: int | None
) -> None:
    data = json.dumps(value, ensure_ascii=ascii_only, indent=indent).encode()
    assert _outcome(parse_json, data) == _outcome(_parse_stdlib, data)
    assert _outcome(parse_json, data[:-1]) == _outcome(_parse_stdlib, data[:-1])


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789-+.eE", min_size=1, max_size=40))
def test_parse_json_matches_the_stdlib_on_number_like_tokens(token: str) -> None:
    data = f"[{token}]".encode()
    assert _outcome(parse_json, data) == _outcome(_parse_stdlib, data)


def test_a_long_digit_run_anywhere_is_found() -> None:
    from trajstore import jsonio

    assert not jsonio._has_long_digit_run(b"[" + b"123456789012345678" + b"]")
    assert jsonio._has_long_digit_run(b'{"x": "1234567890123456789"}')
    # a run straddling two scan blocks
    block = jsonio._SCAN_BYTES
    data = b" " * (block - 10) + b"9" * 19 + b" " * 20
    assert jsonio._has_long_digit_run(data)
    assert not jsonio._has_long_digit_run(b" " * (block - 9) + b"9" * 18 + b" ")


@pytest.mark.parametrize(
    ("values", "binary"),
    [
        ([0, 1, 1, 0], True),
        ([1], True),
        ([], False),  # not proven: the exact checks decide (and pass it)
        ([0, True], False),
        ([False], False),
        ([1.0], False),
        ([0, 2], False),
        ([10], False),
        ([101, 0], False),
        ([-1], False),
        ([[0], [1]], False),
        ([[]], False),
        (["1"], False),
        ([None], False),
        ([2**70], False),
        ((0, 1), False),
    ],
)
def test_is_binary_int_list(values: list, binary: bool) -> None:
    assert is_binary_int_list(values) is binary
    if binary:  # what it proves
        assert set(map(type, values)) == {int} and set(values) <= {0, 1}


def _sample(mask: list) -> dict:
    return {"sample_id": "s0", "response_length": 2, "total_length": 3, "loss_mask": mask}


@pytest.mark.parametrize(
    ("mask", "problem"),
    [
        ([0, 1], None),
        ([True, 1], "sample 's0': loss_mask values must be 0 or 1"),
        ([0, 2], "sample 's0': loss_mask values must be 0 or 1"),
        ([1, 2**70], "sample 's0': loss_mask values must be 0 or 1"),
    ],
)
def test_loss_mask_checks_keep_their_messages(mask: list, problem: str | None) -> None:
    sample = Sample.from_dict(_sample(mask))
    assert sample_record_problems([sample]) == ([problem] if problem else [])


@pytest.mark.parametrize("bad", [1.0, "1", None, [1]])
def test_a_non_integer_loss_mask_entry_is_refused(bad: object) -> None:
    with pytest.raises(BundleError) as exc:
        Sample.from_dict(_sample([0, bad]))
    assert str(exc.value) == "index.json sample 's0': loss_mask entries must be integers"


def _pt(arr: np.ndarray, archive: str) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(torch.from_numpy(arr), buf)
    raw = buf.getvalue()
    with zipfile.ZipFile(io.BytesIO(raw)) as zf:  # rename the archive folder
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as w:
            for info in zf.infolist():
                name = archive + info.filename[info.filename.index("/") :]
                w.writestr(name, zf.read(info))
    return out.getvalue()


def test_pt_files_sharing_one_tensor_record_each_read_their_own_values() -> None:
    a = np.arange(6, dtype=np.float32)
    b = np.arange(6, 12, dtype=np.float32)
    ta, tb = read_pt_bytes(_pt(a, "a")), read_pt_bytes(_pt(b, "b"))
    assert (ta.dtype, ta.shape) == (tb.dtype, tb.shape) == ("torch.float32", (6,))
    assert ta.array.tolist() == a.tolist() and tb.array.tolist() == b.tolist()
    again = read_pt_bytes(_pt(a, "a"))
    assert again.array.tolist() == a.tolist() and again.data_span == ta.data_span


def test_read_bytes_refusals_keep_their_words(tmp_path: Path) -> None:
    from trajstore.jsonio import read_bytes, read_regular

    (tmp_path / "doc.json").write_bytes(b"{}")
    (tmp_path / "empty.json").write_bytes(b"")
    (tmp_path / "dir.json").mkdir()
    (tmp_path / "link.json").symlink_to(tmp_path / "doc.json")
    assert read_bytes(tmp_path / "doc.json", "doc") == b"{}"
    assert read_bytes(tmp_path / "empty.json", "doc") == b""
    assert read_regular(tmp_path / "doc.json", 1) is None  # over the limit: not read
    cases = {
        "link.json": f"doc: is a symlink ({tmp_path / 'link.json'}); refused",
        "dir.json": f"doc: is a directory ({tmp_path / 'dir.json'})",
        "gone.json": f"doc: missing ({tmp_path / 'gone.json'})",
    }
    for name, message in cases.items():
        assert read_regular(tmp_path / name, 1 << 20) is None
        with pytest.raises(BundleError) as exc:
            read_bytes(tmp_path / name, "doc")
        assert str(exc.value) == message
    with pytest.raises(BundleError) as exc:
        read_bytes(tmp_path / "doc.json", "doc", limit=1)
    assert str(exc.value) == "doc: 2 bytes exceeds the limit of 1"


def test_read_bytes_reads_a_file_whose_size_says_nothing() -> None:
    from trajstore.jsonio import read_bytes

    status = Path("/proc/self/status")  # a regular file of size 0 with content
    if not status.exists():
        pytest.skip("no /proc")
    assert read_bytes(status, "status").startswith(b"Name:")


FIXTURES = Path(__file__).resolve().parent / "fixtures" / "relax-v2"


@pytest.mark.parametrize(
    "target", ["example_bundle", "example_capture_dir/replay-120-0"], ids=["plain", "cohort"]
)
def test_an_opened_bundle_keeps_the_bytes_its_gate_checked(target: str) -> None:
    from trajstore.bundle.reader import open_target

    for b in open_target(FIXTURES / target).bundles:
        names = ["manifest.json", "index.json", "expected.json", "COMPLETE"]
        names += [f"COMPLETE.{r}" for r in b.complete.ranks]
        assert sorted(b.files) == sorted(names)
        for name, data in b.files.items():
            assert data == (b.path / name).read_bytes()
        b.release()  # with the payloads: a cohort's ingest keeps one rank in memory
        assert b.files == {}


#: what a ref document holds, and the text each writer might write differently
_REF_LIKE = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(max_codepoint=0x2FF), max_size=8)
    | st.sampled_from(["", "\x7f", "a\nb", '"\\/', "\u00e9", "0" * 64]),
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(st.text(max_size=5), children, max_size=5)
        | st.tuples(children, children)
    ),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(_REF_LIKE)
def test_dumps_sorted_indent1_is_the_stdlibs_bytes(value: object) -> None:
    assert dumps_sorted_indent1(value) == json.dumps(value, sort_keys=True, indent=1).encode()


def test_dumps_sorted_indent1_of_a_ref_is_the_stdlibs_bytes() -> None:
    ref = {
        "attempt": 1,
        "cohort_ranks": None,
        "documents": {"index": "ab" * 32, "manifest": "cd" * 32},
        "payloads": {"log_probs": {"file": {"span": [64, 4096]}, "rows": "response"}},
        "rank": None,
        "run": "r-1.x",
        "sentinels": {},
    }
    assert dumps_sorted_indent1(ref) == json.dumps(ref, sort_keys=True, indent=1).encode()


def _stdlib_canonical(value: object) -> tuple[str, bytes | str]:
    """The oracle: the bundle format's JSON as the stdlib writes it (or its error)."""
    try:
        text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        return "ok", text.encode("utf-8")
    except (TypeError, ValueError) as exc:  # UnicodeEncodeError is a ValueError
        return "error", type(exc).__name__


def _fast_canonical(value: object) -> tuple[str, bytes | str]:
    try:
        return "ok", canonical_bytes(value)
    except (TypeError, ValueError) as exc:
        return "error", type(exc).__name__


CANONICAL_EDGES = [
    [0.0, -0.0, 1e-4, 9.999e-5, 1e-5, 1e-7, 1e15, 9.999999999999998e15, 1e16, 1e22, 5e-324],
    [float("nan"), float("inf"), -float("inf")],
    [2**63 - 1, -(2**63), 2**64 - 1, 2**64, -(2**63) - 1, 10**30],
    {Stage.LOSS_POLICY: {"loss": 0.5}, "advantage.estimate": [1, 2]},  # a StrEnum key
    {1: "int key", "1": "str key"},
    {None: 1, True: 2, 2.5: 3},
    {"s": '\x00\x1f\x7f\u2028\u2029\U0001f600 é \\ " /'},
    {"lone": "\ud800"},
    [[], {}, [[]], {"a": {}}, (), (1, 2)],
    [Stage.SAMPLE, True, False, None],
    {"set": {1, 2}},
    [[1] * 5000, list(range(-3, 3))],
]


@pytest.mark.parametrize("value", CANONICAL_EDGES, ids=range(len(CANONICAL_EDGES)))
def test_canonical_bytes_is_the_stdlib_on_edge_cases(value: object) -> None:
    assert _fast_canonical(value) == _stdlib_canonical(value)


@settings(max_examples=300, deadline=None)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**70), max_value=2**70)
        | st.floats()
        | st.text(),
        lambda children: (
            st.lists(children, max_size=6)
            | st.dictionaries(st.text(max_size=5) | st.integers(), children, max_size=6)
        ),
        max_leaves=30,
    )
)
def test_canonical_bytes_matches_the_stdlib_on_random_documents(value: object) -> None:
    assert _fast_canonical(value) == _stdlib_canonical(value)
