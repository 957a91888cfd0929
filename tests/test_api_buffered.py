"""Payload bodies built in memory have bounded memory (issue 18, item 5).

A Range request, ``?sample=``, ``format=pt`` and a delta record build their
body whole in memory (a cold whole npy/raw download is streamed instead). The
real `trajstore serve` is run with tiny limits through the environment: over
`TRAJSTORE_API_MAX_BUFFERED_BYTES` such a request is a JSON 422 `too_large`
before anything is decoded; under it the bytes are the same as before; over
`TRAJSTORE_API_SERIAL_BUILD_BYTES` concurrent builds run one at a time and all
answer correctly. docs/rest.md#limits.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import CAPTURE_DIR
from test_api_hostile import KEY, PAYLOAD, assert_json_error, raw_request, served

from trajstore.store import Store

pytestmark = pytest.mark.integration

#: the stored log_probs of KEY: 10 float32 = 40 raw bytes, its .pt file 1,591 bytes
PT_FILE = CAPTURE_DIR / "replay-120-0" / "rank-0" / "payloads" / "log_probs.pt"
TIGHT_LIMIT = 32


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("buffered") / "store"
    with Store.open(root, durable=False) as st:
        assert all(o.status == "published" for o in st.ingest([CAPTURE_DIR], run="cap"))
    return root


@pytest.fixture(scope="module")
def tight(store: Path) -> Iterator[int]:
    """A server that builds no body over TIGHT_LIMIT bytes in memory: its port."""
    with served(store, TRAJSTORE_API_MAX_BUFFERED_BYTES=str(TIGHT_LIMIT)) as (_, port):
        yield port


@pytest.fixture(scope="module")
def serial(store: Path) -> Iterator[int]:
    """A server that builds every body over 16 bytes one at a time and caches none: its
    port (so concurrent requests share a body only while it is being sent)."""
    env = {
        "TRAJSTORE_API_MAX_BUFFERED_BYTES": "4096",
        "TRAJSTORE_API_SERIAL_BUILD_BYTES": "16",
        "TRAJSTORE_API_CACHE_MB": "0",
    }
    with served(store, **env) as (_, port):
        yield port


def streamed_raw(port: int) -> bytes:
    got = httpx.get(f"http://127.0.0.1:{port}{PAYLOAD}?format=raw", timeout=60)
    assert got.status_code == 200
    return got.content


def first_sample(port: int) -> str:
    got = httpx.get(f"http://127.0.0.1:{port}/v1/bundles/{KEY}/samples", timeout=60)
    return got.json()["items"][0]["sample_id"]


def test_a_range_over_the_limit_is_a_422_naming_size_limit_variable_and_the_stream(
    tight: int,
) -> None:
    status, body = raw_request(tight, f"{PAYLOAD}?format=raw", "Range: bytes=0-7\r\n")
    doc = assert_json_error(status, body, "range over the limit")
    assert (status, doc["error"]) == (422, "too_large")
    for part in ("40 bytes", f"limit of {TIGHT_LIMIT}", "TRAJSTORE_API_MAX_BUFFERED_BYTES"):
        assert part in doc["detail"], doc
    assert "format=npy or raw" in doc["detail"], doc


def test_a_refused_range_leaves_the_streamed_downloads_whole(tight: int) -> None:
    raw_request(tight, f"{PAYLOAD}?format=raw", "Range: bytes=0-7\r\n")
    got = httpx.get(f"http://127.0.0.1:{tight}{PAYLOAD}", timeout=60)
    assert got.status_code == 200
    array = np.load(io.BytesIO(got.content))
    assert array.shape == (10,)
    assert array.tobytes() == streamed_raw(tight)


def test_format_pt_over_the_limit_is_a_422(tight: int) -> None:
    status, body = raw_request(tight, f"{PAYLOAD}?format=pt")
    doc = assert_json_error(status, body, "pt over the limit")
    assert (status, doc["error"]) == (422, "too_large")
    assert f"{PT_FILE.stat().st_size} bytes" in doc["detail"], doc
    assert "format=npy or raw" in doc["detail"], doc  # not a delta record: it streams


def test_a_sample_over_the_limit_is_a_422(tight: int) -> None:
    status, body = raw_request(tight, f"{PAYLOAD}?sample={first_sample(tight)}")
    doc = assert_json_error(status, body, "sample over the limit")
    assert (status, doc["error"]) == (422, "too_large")


def test_the_422_is_declared_in_openapi(tight: int) -> None:
    spec = httpx.get(f"http://127.0.0.1:{tight}/openapi.json", timeout=60).json()
    responses = spec["paths"]["/v1/bundles/{key}/payloads/{name}"]["get"]["responses"]
    assert {"422", "503"} <= set(responses)


def test_under_the_limit_a_range_is_the_streamed_bytes(serial: int) -> None:
    whole = streamed_raw(serial)
    status, body = raw_request(serial, f"{PAYLOAD}?format=raw", "Range: bytes=4-19\r\n")
    assert (status, body) == (206, whole[4:20])


def test_under_the_limit_format_pt_is_the_original_file(serial: int) -> None:
    got = httpx.get(f"http://127.0.0.1:{serial}{PAYLOAD}?format=pt", timeout=60)
    assert got.status_code == 200
    assert got.content == PT_FILE.read_bytes()


def test_concurrent_ranges_over_the_build_threshold_all_answer_right(serial: int) -> None:
    whole = streamed_raw(serial)
    ranges = [(i, i + 3 + i % 5) for i in range(8)]

    def fetch(byte_range: tuple[int, int]) -> tuple[int, bytes]:
        start, end = byte_range
        return raw_request(serial, f"{PAYLOAD}?format=raw", f"Range: bytes={start}-{end}\r\n")

    with ThreadPoolExecutor(len(ranges)) as pool:
        answers = list(pool.map(fetch, ranges))
    # 8 requests: one builds, at most 7 wait (the queue holds 8), so none is refused
    for (start, end), (status, body) in zip(ranges, answers, strict=True):
        assert (status, body) == (206, whole[start : end + 1])


def test_a_delta_record_over_the_limit_is_a_422_even_whole(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Train routes are stored as a delta against rollout routes: no body of them streams,
    so even a whole npy download is built in memory, and refused over the limit."""
    from test_router_stage import routed_contents

    from trajstore.bundle.writer import write_bundle

    root = tmp_path_factory.mktemp("buffered-delta")
    contents = routed_contents()
    contents.identity = {"actor_step_id": {"rollout_id": 1, "step_id": 0}, "rollout_id": None}
    write_bundle(root / "capture" / "replay-1-0", contents)
    with Store.open(root / "store", durable=False) as st:
        assert all(o.status == "published" for o in st.ingest([root / "capture"], run="rt"))
    path = "/v1/bundles/rt/step-1-0/a1/payloads/train_routed_experts"
    with served(root / "store", TRAJSTORE_API_MAX_BUFFERED_BYTES=str(TIGHT_LIMIT)) as (_, port):
        status, body = raw_request(port, path)
        doc = assert_json_error(status, body, "delta over the limit")
        assert (status, doc["error"]) == (422, "too_large")
        assert "delta-encoded" in doc["detail"], doc
