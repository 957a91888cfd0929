"""A hostile client against the real `trajstore serve` on loopback (issue 18, item 4).

The server is the CLI command in a subprocess, so its memory is its own and
is read from /proc/<pid>/status (VmRSS, VmHWM). Requests whose bytes matter
(`..`, `%2e%2e`, NUL, oversized headers) go over a raw socket: an HTTP
client library would normalize or refuse them before they left. Each hostile
request must get a 4xx JSON error or a bounded, correct answer; the server
must stay up, keep its memory bounded and keep serving other clients.
Bounds and figures: docs/reliability.md ("4. A hostile REST client").
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import pytest
import serving
from conftest import CAPTURE_DIR, FIXTURES
from serving import memory_kb
from trajstore.api.errors import ApiError
from trajstore.api.limits import QueueLimitedLock

from trajstore.cas import LocalObjectStore
from trajstore.store import Store

pytestmark = pytest.mark.integration

KEY = "cap/step-120-0/rank-0/a1"
PAYLOAD = f"/v1/bundles/{KEY}/payloads/log_probs"
#: the deadline the tests give a client to send one whole request (the default is 30 s)
REQUEST_TIMEOUT_S = 2
#: a ceiling for a loaded 2-core box to answer, not a measured time
WAIT_S = 90
#: traversal forms tried in every path parameter (already percent-encoded for the path)
TRAVERSALS = (
    "..",
    "%2e%2e",
    "..%2f..%2f..%2fetc%2fpasswd",
    "%2e%2e%2f%2e%2e%2frefs",
    "%2Fetc%2Fpasswd",
    "%00",
    "..%00",
    "cap%00",
)
#: every path parameter of /v1 (and the static asset name), `{}` marks where it goes
PATH_TEMPLATES = (
    "/v1/runs/{}/summary",
    "/v1/runs/{}/strip",
    "/v1/runs/{}/steps",
    "/v1/runs/{}/steps/120:0",
    "/v1/runs/{}/steps/120:0/result",
    "/v1/runs/{}/rollouts/120",
    "/v1/runs/cap/steps/{}",
    "/v1/runs/cap/steps/120:0/{}",
    "/v1/runs/cap/rollouts/{}",
    "/v1/steps/{}",
    "/v1/bundles/{}",
    "/v1/bundles/{}/samples",
    "/v1/bundles/{}/payloads/log_probs",
    f"/v1/bundles/{KEY}/{{}}",
    f"/v1/bundles/{KEY}/payloads/{{}}",
    f"/v1/bundles/{KEY}/{{}}/payloads/log_probs",
    "/static/{}",
    "/static/{}/app.js",
)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile") / "store"
    with Store.open(root, durable=False) as st:
        assert all(o.status == "published" for o in st.ingest([CAPTURE_DIR], run="cap"))
        assert all(
            o.status == "published" for o in st.ingest([FIXTURES / "example_bundle"], run="ex")
        )
    return root


def served(store: Path, token: str | None = None, **env: str) -> AbstractContextManager:
    """`trajstore serve` on a free loopback port with a short request deadline: (pid, port)."""
    return serving.served(
        store, token=token, TRAJSTORE_API_REQUEST_TIMEOUT_S=str(REQUEST_TIMEOUT_S), **env
    )


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[tuple[int, int]]:
    with served(store) as pid_port:
        yield pid_port


def raw_request(port: int, target: str, headers: str = "", body: bytes = b"") -> tuple[int, bytes]:
    """One request with exactly these bytes on the request line; (status, body)."""
    head = f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head.encode("latin-1") + body)
        data = b""
        while chunk := s.recv(1 << 16):
            data += chunk
    head_bytes, _, payload = data.partition(b"\r\n\r\n")
    return int(head_bytes.split(b" ", 2)[1]), payload


def read_answer(s: socket.socket) -> tuple[int, bytes]:
    """(status, body) of one response read from `s`, its body by Content-Length (the
    headers and the body may arrive in separate reads)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(1 << 16)
        assert chunk, f"closed before the headers: {data[:200]!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")[1:]
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = s.recv(1 << 16)
        assert chunk, "closed before the body"
        body += chunk
    return int(head.split(b" ", 2)[1]), body


def assert_json_error(status: int, body: bytes, what: str) -> dict:
    assert 400 <= status < 500, (what, status, body[:300])
    doc = json.loads(body)
    assert set(doc) == {"error", "detail"}, (what, doc)
    return doc


@pytest.fixture(scope="module")
def raw_log_probs(server: tuple[int, int]) -> bytes:
    _, port = server
    got = httpx.get(f"http://127.0.0.1:{port}{PAYLOAD}?format=raw", timeout=60)
    assert got.status_code == 200
    return got.content


@pytest.mark.parametrize("template", PATH_TEMPLATES)
def test_traversal_in_a_path_parameter_is_a_json_4xx(
    server: tuple[int, int], template: str
) -> None:
    _, port = server
    for attack in TRAVERSALS:
        target = template.format(attack)
        status, body = raw_request(port, target)
        doc = assert_json_error(status, body, target)
        assert b"root:" not in body and b"COMPLETE" not in body, (target, doc)


def test_traversal_in_query_keys_and_the_replay_body_is_a_json_4xx(
    server: tuple[int, int],
) -> None:
    _, port = server
    for attack in TRAVERSALS:
        for target in (
            f"/v1/diff?a={attack}&b=cap/120:0",
            f"/v1/diff?a=cap/120:0&b={KEY}%2f{attack}",
            f"{PAYLOAD}?sample={attack}",
            f"/v1/router/compare?run={attack}&run=cap",
        ):
            status, body = raw_request(port, target)
            assert_json_error(status, body, target)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        for field, value in (
            ("bundle", "../../etc/passwd"),
            ("bundle", "/etc/passwd"),
            ("bundle", KEY + "/../../../refs"),
            ("bundle", KEY + "\x00"),
            ("run", ".."),
            ("run", "cap\x00"),
        ):
            body = (
                {"run": "cap", field: value}
                if field == "bundle"
                else {field: value, "step": "120:0"}
            )
            got = client.post("/v1/replay", json=body)
            assert_json_error(got.status_code, got.content, f"replay {field}={value!r}")


def test_traversal_in_a_filter_matches_nothing(server: tuple[int, int]) -> None:
    """A filter is compared with catalog values, never opened: a group is not one of the
    bundle's and a run not one of the store's (404), a stage not one of the replay's (400)."""
    _, port = server
    for attack in TRAVERSALS:
        for target, expected in (
            (f"/v1/bundles/{KEY}/samples?group={attack}", (404, "not_found")),
            (f"/v1/divergences?run={attack}", (404, "not_found")),
            (f"/v1/router/metrics?run={attack}", (404, "not_found")),
            (f"/v1/stats?run={attack}", (404, "not_found")),
            (f"/v1/runs/cap/steps?first_divergent_stage={attack}", (400, "bad_request")),
            (f"/v1/divergences?stage={attack}", (400, "bad_request")),
        ):
            status, body = raw_request(port, target)
            assert (status, json.loads(body)["error"]) == expected, target


def test_web_pages_answer_the_static_shell_for_any_traversal(server: tuple[int, int]) -> None:
    """A page route matching any run name answers the package's shell, holding no data;
    one that no longer matches (a decoded `/`) is a JSON 404."""
    _, port = server
    shell = (Path(__file__).parents[1] / "api" / "web" / "static" / "index.html").read_bytes()
    shells = 0
    for attack in TRAVERSALS:
        for target in (f"/runs/{attack}", f"/runs/{attack}/steps/{attack}"):
            status, body = raw_request(port, target)
            if status == 200:
                assert body == shell, target
                shells += 1
            else:
                assert json.loads(body) == {"error": "not_found", "detail": "Not Found"}, target
    assert shells >= len(TRAVERSALS)


@pytest.mark.parametrize(
    ("header", "status", "part"),
    [
        ("bytes=0-3", 206, slice(0, 4)),
        ("bytes=" + "9" * 5000 + "-", 416, None),
        ("bytes=-" + "9" * 5000, 206, slice(None)),
        ("bytes=0-" + "9" * 5000, 206, slice(None)),
        ("bytes=4-" + "9" * 30, 206, slice(4, None)),
        ("bytes=-0", 416, None),
        ("bytes=9-2", 200, slice(None)),
        ("bytes=0-0,2-3", 200, slice(None)),
        ("bytes=" + "0-0," * 2000 + "1-1", 200, slice(None)),
        ("items=0-3", 200, slice(None)),
        ("bytes=abc", 200, slice(None)),
        ("bytes=" + " " * 8000 + "1-2", 206, slice(1, 3)),
    ],
    ids=lambda v: v[:24] if isinstance(v, str) else None,
)
def test_malformed_and_oversized_ranges_get_the_right_bytes_or_416(
    server: tuple[int, int], raw_log_probs: bytes, header: str, status: int, part: slice | None
) -> None:
    _, port = server
    got_status, body = raw_request(port, f"{PAYLOAD}?format=raw", f"Range: {header}\r\n")
    assert got_status == status
    if part is None:
        assert json.loads(body)["error"] == "range_not_satisfiable"
    else:
        assert body == raw_log_probs[part]


def test_a_header_block_over_h11s_limit_is_refused_and_the_server_goes_on(
    server: tuple[int, int],
) -> None:
    _, port = server
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(f"GET {PAYLOAD} HTTP/1.1\r\nHost: x\r\nRange: bytes=".encode())
        with contextlib.suppress(OSError):  # the server may reset while we still send
            for _ in range(64):
                s.sendall(b"1" * 65536)
            s.sendall(b"-\r\n\r\n")
        answer = b""
        with contextlib.suppress(OSError):
            answer = s.recv(1 << 16)
    assert answer == b"" or answer.split(b" ", 2)[1].startswith(b"4"), answer[:200]
    assert httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=60).status_code == 200


@pytest.mark.parametrize(
    "target",
    [
        "/v1/runs/cap/steps?limit=1001",
        "/v1/runs/cap/steps?limit=0",
        "/v1/runs/cap/steps?limit=-1",
        "/v1/runs/cap/steps?limit=" + "9" * 30,
        "/v1/runs/cap/steps?limit=" + "9" * 5000,
        "/v1/divergences?limit=100000000",
        "/v1/router/metrics?limit=1e9",
        "/v1/router/compare?run=cap&run=ex&limit=100000",
        "/v1/runs/cap/strip?bins=100000000",
        "/v1/runs/cap/steps/120:" + "9" * 5000,
    ],
)
def test_a_huge_page_size_or_number_is_a_422(server: tuple[int, int], target: str) -> None:
    _, port = server
    status, body = raw_request(port, target)
    assert status == 422, (target, body[:300])
    assert json.loads(body)["error"] == "invalid_request"


def _cursor(tag: str, values: object) -> str:
    """A hand-made cursor: its tag, a digest of its query's filters (checked after the
    values, so any will do here), its keyset values."""
    text = base64.urlsafe_b64encode(json.dumps([tag, "0" * 12, values]).encode()).decode()
    return text.rstrip("=")


#: (listing, its cursor tag, a cursor of the right length)
LISTINGS = (
    ("/v1/runs/cap/steps?", "steps", 4),
    ("/v1/runs/cap/steps?sort=-status&", "steps:-status", 5),
    ("/v1/runs/cap/steps?sort=tokens&", "steps:tokens", 5),
    ("/v1/divergences?", "divergences", 5),
    ("/v1/router/metrics?", "router_metrics", 4),
)


@pytest.mark.parametrize(("listing", "tag", "width"), LISTINGS)
def test_cursor_garbage_is_a_400(
    server: tuple[int, int], listing: str, tag: str, width: int
) -> None:
    _, port = server
    garbage = [
        "garbage",
        "%00",
        "%ff%fe",
        "A" * 1999,
        "eyJhIjoxfQ",  # {"a":1}
        _cursor("other", [0] * width),
        _cursor(tag, [0] * (width + 1)),
        _cursor(tag, [{"a": 1}] + [[1]] * (width - 1)),  # containers: were a 500
        _cursor(tag, ["x"] * width),  # a string where an id goes: was a 500
        _cursor(tag, [1.5] * width),
        _cursor(tag, ["cap"] + [10**30] * (width - 1)),  # past BIGINT
        _cursor(tag, [None] * width),
    ]
    for cursor in garbage:
        status, body = raw_request(port, f"{listing}cursor={cursor}")
        doc = assert_json_error(status, body, cursor[:60])
        assert status == 400 and doc["error"] == "bad_request", (cursor[:60], doc)
    status, body = raw_request(port, f"{listing}cursor={'A' * 2001}")
    assert status == 422


def test_the_router_compare_cursor_garbage_is_a_400(server: tuple[int, int]) -> None:
    _, port = server
    for cursor in ("x", "1:x", "::", "1:2:3", "%00:1"):
        status, body = raw_request(port, f"/v1/router/compare?run=cap&run=ex&cursor={cursor}")
        assert status == 400 and json.loads(body)["error"] == "bad_filter", cursor


def test_a_100000_sample_replay_selection_is_refused_with_bounded_memory(
    server: tuple[int, int],
) -> None:
    pid, port = server
    before = memory_kb(pid)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
        ids = [f"s-{i}" for i in range(100_000)]
        got = client.post("/v1/replay", json={"run": "cap", "step": "120:0", "samples": ids})
        assert got.status_code == 422 and got.json()["error"] == "invalid_request"
        # within the schema's 10,000 ids: a 400 naming the unknown ones, its detail cut short
        got = client.post(
            "/v1/replay", json={"run": "cap", "step": "120:0", "samples": ids[:10_000]}
        )
        assert got.status_code == 400 and got.json()["error"] == "bad_selection"
        assert len(got.content) < 4000
        # one id of 3 MB: under the body limit, and the answer does not echo it
        got = client.post(
            "/v1/replay", json={"run": "cap", "step": "120:0", "samples": ["x" * (3 << 20)]}
        )
        assert got.status_code == 400 and len(got.content) < 4000
    grown_mb = (memory_kb(pid)["VmHWM"] - before["VmHWM"]) / 1024
    assert grown_mb < 100, f"peak RSS grew {grown_mb:.0f} MB"


def test_a_body_over_the_limit_is_a_413_before_it_is_read(server: tuple[int, int]) -> None:
    pid, port = server
    before = memory_kb(pid)
    declared = 512 << 20
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(
            b"POST /v1/replay HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {declared}\r\n\r\n".encode()
            + b"[" * 1000
        )
        status, body = read_answer(s)
    assert status == 413
    assert json.loads(body)["error"] == "payload_too_large"
    # chunked: no Content-Length, so it is counted as it arrives (6 MiB sent, then refused)
    chunk = b" " * (1 << 20)
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(
            b"POST /v1/replay HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        with contextlib.suppress(OSError):
            for _ in range(6):
                s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        status, body = read_answer(s)
    assert status == 413 and json.loads(body)["error"] == "payload_too_large"
    grown_mb = (memory_kb(pid)["VmHWM"] - before["VmHWM"]) / 1024
    assert grown_mb < 50, f"peak RSS grew {grown_mb:.0f} MB"


def _closed_by_server(s: socket.socket) -> bool:
    """Whether the server closed `s` (non-blocking): EOF or a reset, not "no data yet"."""
    try:
        while s.recv(1 << 16):
            pass
    except BlockingIOError:
        return False
    except OSError:
        pass
    return True


def test_slow_clients_are_cut_off_and_others_keep_being_served(store: Path) -> None:
    """600 connections: idle, half a request line, half the headers, half a body."""
    with served(store) as (pid, port):
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/v1/health", timeout=60).status_code == 200
        before = memory_kb(pid)
        openers = (
            b"",
            b"GET /v1/runs/cap/ste",
            b"GET /v1/health HTTP/1.1\r\nHost: x\r\nX-Slow: ",
            b"POST /v1/replay HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{",
        )
        slow = []
        try:
            for i in range(600):
                s = socket.create_connection(("127.0.0.1", port), timeout=30)
                s.sendall(openers[i % len(openers)])
                slow.append(s)
            # while they hang, a normal client is answered, and correctly
            with httpx.Client(base_url=base, timeout=60) as client:
                for _ in range(20):
                    got = client.get("/v1/runs/cap/steps/120:0")
                    assert got.status_code == 200 and got.json()["step_id"] == 0
            held = memory_kb(pid)
            # each is closed once it has not sent a whole request within the deadline
            for s in slow:
                s.setblocking(False)
            deadline = time.monotonic() + REQUEST_TIMEOUT_S + 60
            open_ones = list(slow)
            while open_ones and time.monotonic() < deadline:
                time.sleep(0.5)
                open_ones = [s for s in open_ones if not _closed_by_server(s)]
            assert not open_ones, f"{len(open_ones)} of {len(slow)} slow connections still open"
        finally:
            for s in slow:
                s.close()
        assert httpx.get(f"{base}/v1/health", timeout=60).status_code == 200
        grown_mb = (held["VmRSS"] - before["VmRSS"]) / 1024
        print(f"600 slow connections: RSS {before['VmRSS']} -> {held['VmRSS']} kB")
        assert grown_mb < 64, f"RSS grew {grown_mb:.0f} MB for 600 idle connections"


def test_a_kept_alive_connection_outlives_the_request_deadline(server: tuple[int, int]) -> None:
    """The deadline covers receiving a request, not the connection: a client that keeps
    sending whole requests stays connected past it."""
    _, port = server
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        first = client.get("/v1/health")
        sockets_used = set()
        end = time.monotonic() + REQUEST_TIMEOUT_S * 2
        while time.monotonic() < end:
            got = client.get("/v1/runs")
            assert got.status_code == 200
            sockets_used.add(got.extensions["network_stream"].get_extra_info("client_addr"))
            time.sleep(0.2)
    assert first.status_code == 200
    assert len(sockets_used) == 1, sockets_used


def test_the_replay_lock_refuses_one_waiter_too_many() -> None:
    """The lock replays, comparisons and diffs share: one holder, `max_waiting` waiters,
    then 503 busy at once (a flood would otherwise hold every thread of the pool)."""
    gate = QueueLimitedLock(max_waiting=1)
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with gate:
            holding.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(60)
    waiter = threading.Thread(target=lambda: gate.__enter__() or gate.__exit__())
    waiter.start()  # the one allowed waiter
    deadline = time.monotonic() + 60
    while gate._admitted._value and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(ApiError) as refused:
        gate.__enter__()
    assert (refused.value.status_code, refused.value.code) == (503, "busy")
    release.set()
    holder.join(60)
    waiter.join(60)
    with gate:  # free again
        pass


def _all_loose_store(root: Path) -> Path:
    """The capture stored with every object a loose file under objects/ (as objects of
    1 MiB and more always are), so that one object can be swapped for a FIFO."""
    Store.open(root, durable=False).close()
    objects = LocalObjectStore(root, pack_threshold=0, durable=False)
    with Store(root, durable=False, objs=objects) as st:
        assert all(o.status == "published" for o in st.ingest([CAPTURE_DIR], run="cap"))
    assert not any((root / "packs").glob("*.pack"))
    return root


def _write_end_once_read(fifo: Path, reader: threading.Thread) -> int:
    """The FIFO's write end, once some process has opened it for reading (ENXIO until then)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
        assert reader.is_alive(), "the replay was answered without reading the FIFO"
        assert time.monotonic() < deadline, "the server never opened the FIFO"
        time.sleep(0.01)


def test_a_flood_beyond_the_replay_queue_is_refused_busy_and_the_server_goes_on(
    tmp_path: Path,
) -> None:
    """One replay is held inside the replay lock (the expected.json object it reads is a
    FIFO nobody writes yet); then QUEUED more replays wait and every one past them is a
    JSON 503 `busy` at once, while lookups are answered. Released, the held and queued
    replays finish and the server answers normally."""
    queued, flood = 2, 12
    store = _all_loose_store(tmp_path / "store")
    with Store.open(store, create=False) as st:
        expected_hash = st.step("cap", 120, 0)[0].ref["documents"]["expected"]
    obj = store / "objects" / expected_hash[:2] / expected_hash
    data = obj.read_bytes()
    answers: dict[str, tuple[int, str, str]] = {}

    with served(store, TRAJSTORE_API_MAX_QUEUED_REPLAYS=str(queued)) as (_, port):
        base = f"http://127.0.0.1:{port}"

        def replay(name: str) -> None:
            with httpx.Client(base_url=base, timeout=WAIT_S * 3) as c:
                got = c.post("/v1/replay", json={"run": "cap", "step": "120:0"})
                error = got.json().get("error", "") if got.status_code != 200 else ""
                answers[name] = (got.status_code, got.headers["content-type"], error)

        obj.unlink()
        os.mkfifo(obj)
        holder = threading.Thread(target=replay, args=("holder",))
        holder.start()
        fd = _write_end_once_read(obj, holder)  # the holder is inside the lock, reading
        threads = [threading.Thread(target=replay, args=(f"f{i}",)) for i in range(flood)]
        try:
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + WAIT_S
            while len(answers) < flood - queued and time.monotonic() < deadline:
                time.sleep(0.05)
            while_held = dict(answers)
            with httpx.Client(base_url=base, timeout=WAIT_S) as client:
                runs = client.get("/v1/runs")
                assert runs.status_code == 200 and "cap" in runs.text
        finally:  # the real bytes: from the FIFO for the held reader, in place for the rest
            tmp = obj.with_suffix(".restore")
            tmp.write_bytes(data)
            os.replace(tmp, obj)
            os.set_blocking(fd, True)
            with os.fdopen(fd, "wb") as pipe:
                pipe.write(data)
            for thread in (holder, *threads):
                thread.join(WAIT_S * 3)
        busy = (503, "application/json", "busy")
        assert sorted(while_held.values()) == [busy] * (flood - queued), (
            f"while one replay held the lock, {flood} more got {sorted(while_held.values())}; "
            f"expected {flood - queued} JSON 503 busy (the queue holds {queued})"
        )
        assert answers["holder"] == (200, "application/json", "")
        done = sorted(v for k, v in answers.items() if k not in while_held and k != "holder")
        assert done == [(200, "application/json", "")] * queued
        with httpx.Client(base_url=base, timeout=WAIT_S) as client:
            again = client.post("/v1/replay", json={"run": "cap", "step": "120:0"})
            assert again.status_code == 200 and again.json()["exit_code"] == 0
            step = client.get("/v1/runs/cap/steps/120:0")
            assert step.status_code == 200 and step.json()["step_id"] == 0
