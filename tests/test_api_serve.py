"""`trajstore serve --workers N` and the streamed cold payload download, on real servers.

The multi-worker server is the real command in a subprocess on a loopback
port; the streamed download runs under uvicorn in a thread (tests/test_api.py's
`serve`). Payloads are long enough to span several decode batches
(api/streaming.py BATCH_BYTES) and are bfloat16, so the .npy path widens them.
"""

from __future__ import annotations

import io
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from conftest import make_contents
from serving import served
from test_api import serve
from trajstore.api import streaming

from trajstore.bundle.writer import write_bundle
from trajstore.cas.arrays import load_record
from trajstore.cli import main as trajstore_main
from trajstore.store import Store

pytestmark = pytest.mark.integration

#: tokens per sample: 4 samples of bf16 log-probs span two decode batches
LONG = (streaming.BATCH_BYTES // 2) // 4 + 5000


@pytest.fixture(scope="module")
def long_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """Four steps (rollout 3) of bf16 payloads; the tensors of step 3:0 by payload name."""
    root = tmp_path_factory.mktemp("serve")
    capture = root / "capture"
    first: dict[str, torch.Tensor] = {}
    for step in range(4):
        contents = make_contents(
            lengths=LONG if step == 0 else 64,
            rollout_id=3,
            step_id=step,
            seed=step,
            dtype=torch.bfloat16,
        )
        write_bundle(capture / f"replay-3-{step}", contents)
        if step == 0:
            payloads = capture / "replay-3-0" / "payloads"
            first = {p.stem: torch.load(p, weights_only=True) for p in payloads.glob("*.pt")}
    with Store.open(root / "store", durable=False) as store:
        assert all(o.status == "published" for o in store.ingest([capture], run="r"))
    return root / "store", first


def _workers_of(pid: int) -> list[int]:
    """Child processes of `pid` started by multiprocessing's spawn (uvicorn's workers)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"spawn_main" in cmdline:
            out.append(int(entry.name))
    return out


@pytest.fixture
def two_workers(long_store: tuple[Path, dict]) -> Iterator[tuple[int, httpx.Client]]:
    store, _ = long_store
    with (
        served(store, "--workers", "2") as (pid, port),
        httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client,
    ):
        yield pid, client


def test_serve_two_workers_answer_concurrent_lookups_and_downloads(
    two_workers: tuple[int, httpx.Client], long_store: tuple[Path, dict]
) -> None:
    pid, client = two_workers
    _, tensors = long_store
    assert len(_workers_of(pid)) == 2
    url = "/v1/bundles/r/step-3-0/a1/payloads/log_probs"
    expected_raw = tensors["log_probs"].view(torch.int16).numpy().tobytes()

    def one(i: int) -> None:
        # a fresh connection each time, so the kernel spreads them over both workers
        with httpx.Client(base_url=client.base_url, timeout=60) as c:
            step = i % 4
            got = c.get(f"/v1/runs/r/steps/3:{step}")
            assert got.status_code == 200, got.text
            body = got.json()
            assert (body["rollout_id"], body["step_id"], body["kind"]) == (3, step, "step")
            assert body["bundles"][0]["key"] == f"r/step-3-{step}/a1"
            if i % 8 == 0:
                raw = c.get(url, params={"format": "raw"})
                assert raw.status_code == 200 and raw.content == expected_raw

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(48)))


def test_streamed_cold_download_is_byte_identical(long_store: tuple[Path, dict]) -> None:
    store, tensors = long_store
    tensor = tensors["log_probs"]
    assert tensor.numel() * 2 > streaming.BATCH_BYTES  # more than one decode batch
    bits = tensor.view(torch.int16).numpy()
    url = "/v1/bundles/r/step-3-0/a1/payloads/log_probs"
    with serve(store) as client:
        raw = client.get(url, params={"format": "raw"})  # first: streamed while decoded
        assert raw.status_code == 200 and raw.content == bits.tobytes()
        assert int(raw.headers["content-length"]) == bits.nbytes
        assert raw.headers["x-shape"] == ",".join(map(str, tensor.shape))
        npy = client.get(url)  # .npy (default), also cold: its own ETag
        arr = np.load(io.BytesIO(npy.content), allow_pickle=False)
        assert arr.dtype == np.float32
        np.testing.assert_array_equal(arr, tensor.float().numpy())
        assert int(npy.headers["content-length"]) == len(npy.content)
        again = client.get(url, params={"format": "raw"})  # kept in the body cache
        assert again.content == raw.content
        part = client.get(url, params={"format": "raw"}, headers={"Range": "bytes=100-4195"})
        assert part.status_code == 206 and part.content == raw.content[100:4196]


def _float_store(root: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """One float32 step (rollout 5) whose `kl` holds all-zero (fill) windows between
    stored ones; the tensors by payload name."""
    tokens = 4 * LONG
    kl = -torch.rand(tokens, generator=torch.Generator().manual_seed(5))
    kl[:20_000] = 0.0  # the first windows are fill (not stored)
    kl[2 * LONG : 2 * LONG + 50_000] = 0.0
    contents = make_contents(
        lengths=LONG, rollout_id=5, seed=5, dtype=torch.float32, extra_payloads={"kl": kl}
    )
    write_bundle(root / "capture" / "replay-5-0", contents)
    with Store.open(root / "store", durable=False) as store:
        assert all(o.status == "published" for o in store.ingest([root / "capture"], run="f"))
    payloads = root / "capture" / "replay-5-0" / "payloads"
    return root / "store", {p.stem: torch.load(p, weights_only=True) for p in payloads.glob("*.pt")}


@pytest.fixture(scope="module")
def float_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """`_float_store`, built once: the test that damages it works on its own copy."""
    return _float_store(tmp_path_factory.mktemp("float"))


def test_streamed_download_with_fill_and_short_windows_is_byte_identical(
    float_store: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    store, tensors = float_store
    url = "/v1/bundles/f/step-5-0/a1/payloads/kl"
    with serve(store) as client:
        raw = client.get(url, params={"format": "raw"})
        assert raw.status_code == 200 and raw.content == tensors["kl"].numpy().tobytes()
        npy = client.get(url)
        np.testing.assert_array_equal(
            np.load(io.BytesIO(npy.content), allow_pickle=False), tensors["kl"].numpy()
        )


def test_a_corrupt_chunk_cuts_the_stream_before_its_bytes(
    tmp_path: Path, float_store: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    """Every chunk is hash-checked before its batch is sent: a damaged object in the
    third batch ends the response (the headers are out: the connection is cut) after
    at most the batches before it, all of them right."""
    shutil.copytree(float_store[0], tmp_path / "store")
    store, tensors = tmp_path / "store", float_store[1]
    expected = tensors["log_probs"].numpy().tobytes()
    with Store.open(store, create=False) as opened:
        (bundle,) = opened.step("f", 5, 0)
        record = load_record(opened.objs, bundle.ref["payloads"]["log_probs"]["record"])
        offset = 0
        for h, nbytes in streaming._windows(record):
            if offset >= 2 * streaming.BATCH_BYTES and h is not None:
                break
            offset += nbytes
        stored = opened.objs.get(h)
    packs = [p for p in (store / "packs").glob("*.pack") if stored in p.read_bytes()]
    assert len(packs) == 1
    data = bytearray(packs[0].read_bytes())
    at = data.index(stored) + len(stored) // 2
    data[at] ^= 0xFF
    packs[0].write_bytes(bytes(data))
    got = bytearray()
    with serve(store) as client:
        url = "/v1/bundles/f/step-5-0/a1/payloads/log_probs"
        with (
            pytest.raises(httpx.RemoteProtocolError),
            client.stream("GET", url, params={"format": "raw"}) as response,
        ):
            assert response.status_code == 200
            for piece in response.iter_raw():
                got += piece
        assert client.get("/v1/health").status_code == 200
    assert len(got) <= offset and bytes(got) == expected[: len(got)]


def test_serve_rejects_a_bad_worker_count(
    long_store: tuple[Path, dict], capsys: pytest.CaptureFixture[str]
) -> None:
    store, _ = long_store
    returncode, stderr = _serve_in_process(capsys, store, "--workers", "0")
    assert returncode == 2
    assert stderr.strip().splitlines() == [stderr.strip()]
    assert "--workers must be 1..64" in stderr


def _serve(
    store: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`trajstore serve --store STORE ARGS...` run to its end: every test here expects it
    to stop before it serves."""
    return subprocess.run(
        [sys.executable, "-m", "trajstore", "serve", "--store", str(store), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def _serve_in_process(
    capsys: pytest.CaptureFixture[str], store: Path, *args: str
) -> tuple[int, str]:
    """`trajstore serve --store STORE ARGS...` through the CLI's entry point in this
    process, for the refusals made before anything binds (a setting, an argument, a
    missing store): its exit code and stderr. A refusal that stopped happening would
    fail on the message, not serve: the stores these are given do not open."""
    capsys.readouterr()
    try:
        returncode = trajstore_main(["serve", "--store", str(store), *args])
    except SystemExit as exc:  # argparse's own refusals
        returncode = exc.code
    return returncode, capsys.readouterr().err


def _serve_without_a_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, str]:
    """`trajstore serve` on a store that does not exist: what it checks before opening the
    store is all it does (nothing binds)."""
    return _serve_in_process(capsys, tmp_path / "none", *args)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("TRAJSTORE_API_REQUEST_TIMEOUT_S", "0"),
        ("TRAJSTORE_API_MAX_QUEUED_REPLAYS", "-1"),
        ("TRAJSTORE_API_MAX_BUFFERED_BYTES", "2G"),
        ("TRAJSTORE_API_SERIAL_BUILD_BYTES", "1.5"),
        ("TRAJSTORE_API_CACHE_MB", "512M"),
    ],
)
def test_serve_refuses_a_malformed_api_setting_before_it_starts(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    name: str,
    value: str,
) -> None:
    # checked before the store is opened: the setting is what the one line names
    monkeypatch.setenv(name, value)
    returncode, stderr = _serve_without_a_store(tmp_path, capsys)
    assert returncode == 2
    assert stderr.startswith(f"trajstore: error: {name}={value!r}: expected ")
    assert len(stderr.strip().splitlines()) == 1


def test_serve_refuses_a_misspelt_api_variable_before_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # TRAJSTORE_API_TOKN=... would otherwise serve without the token the user meant to set
    monkeypatch.setenv("TRAJSTORE_API_TOKN", "s3cret")
    returncode, stderr = _serve_without_a_store(tmp_path, capsys)
    assert returncode == 2
    assert stderr.startswith("trajstore: error: unknown variable TRAJSTORE_API_TOKN (known: ")
    assert "TRAJSTORE_API_TOKEN" in stderr
    assert len(stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("host", "token", "warned"),
    [
        ("0.0.0.0", None, True),
        ("0.0.0.0", "s3cret", False),
        ("127.0.0.1", None, False),
        ("::1", None, False),
    ],
)
def test_serve_warns_before_serving_other_hosts_without_a_token(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    host: str,
    token: str | None,
    warned: bool,
) -> None:
    # a missing store stops it right after the warning: nothing binds in this test
    monkeypatch.delenv("TRAJSTORE_API_TOKEN", raising=False)
    if token is not None:
        monkeypatch.setenv("TRAJSTORE_API_TOKEN", token)
    returncode, stderr = _serve_without_a_store(tmp_path, capsys, "--host", host)
    lines = stderr.strip().splitlines()
    assert returncode == 2 and lines[-1].endswith("not a trajstore store (no TRAJSTORE_STORE)")
    warning = f"trajstore: warning: serving on {host} without TRAJSTORE_API_TOKEN: anyone who "
    assert (lines[0].startswith(warning) and len(lines) == 2) if warned else len(lines) == 1


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_on_a_port_in_use_is_one_line(long_store: tuple[Path, dict], workers: str) -> None:
    # one worker: uvicorn logged "[Errno 98] ... address already in use" among its INFO
    # lines and exited 3, a code trajstore does not document
    store, _ = long_store
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _serve(store, "--port", str(port), "--workers", workers)
    assert done.returncode == 2
    assert done.stderr == (
        f"trajstore: error: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    )


def test_serve_refuses_an_unknown_log_level(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # it was an internal error (KeyError: 'bogus') from uvicorn's level table
    returncode, stderr = _serve_without_a_store(tmp_path, capsys, "--log-level", "bogus")
    assert returncode == 2
    assert "argument --log-level: invalid choice: 'bogus'" in stderr
