"""Huge inputs (issue 18, item 5) at a size CI can afford: bounded memory, or refused up front.

The full sizes (a 2 GiB payload, 1,000,000 samples) run in
scripts/bench/bench_huge.py, whose bundle builders these tests share. Here
the same code paths run on a 128 MiB payload and 10,000 and 20,000 one-token samples,
each command in its own process with its peak RSS measured, and checked
against the documented bounds (docs/store.md "Limits", docs/reliability.md):
memory grows with one payload, not with all of them or with their windows;
per sample it grows by at most 10 KiB (the slope between 10,000 and 20,000
samples). A bound is taken as growth over the same
command on a tiny bundle, measured in the same test, so the interpreter's and
its imports' size on this machine do not enter it. No timing is asserted.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import resource
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from serving import memory_kb, served

from trajstore.bundle.reader import MAX_PAYLOAD_ENV, MAX_SAMPLES_ENV
from trajstore.bundle.writer import write_bundle

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
#: the CI payload: one `rollout_routed_experts` of 128 MiB
PAYLOAD_BYTES = 128 * MIB
#: documented bound: peak RSS grows by at most FACTOR x the largest payload + one write batch
PAYLOAD_FACTOR = 1.25
WRITE_BATCH = 64 * MIB
#: documented bound: serve's peak RSS grows by at most this while streaming any payload
STREAM_BOUND = 64 * MIB
#: documented bound (docs/reliability.md): past a fixed part, ingest's and replay's peak RSS
#: grows by at most 10 KiB per sample (measured about 7 KiB: records, chunk objects and
#: catalog rows). Asserted as the slope between MIDDLE and SAMPLES samples, where the fixed
#: part cancels: over the tiny bundle alone, FIXED at 20,000 samples would let through
#: about 18 KiB a sample
PER_SAMPLE_BYTES = 10 * 1024
#: the fixed part (write batch, encode and chunk caches): all growth over the tiny bundle
#: stays within FIXED + PER_SAMPLE_BYTES a sample
FIXED = 192 * MIB
#: the CI sample counts (the bench runs 1,000,000): both past where the caches have filled
#: (from 5,000 to 10,000 samples replay still grew 21 KiB a sample: its caches filling)
SAMPLES = 20_000
MIDDLE = 10_000
#: the tiny bundle measured against
TINY = 64
#: replay's peak RSS on one step varies from run to run by up to ~45 MiB (its chunk pool's
#: threads decode concurrently, so what is held at the peak depends on their timing: 295-339
#: MiB over five runs of the same 10,000-sample step), which alone moves the slope by 4 KiB a
#: sample; the median of this many runs of each sized step is taken
REPLAY_RUNS = 3

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not sys.platform.startswith("linux"),
        reason="peak RSS is read from Linux process accounting",
    ),
]


def _bench():  # noqa: ANN202 - the module
    """scripts/bench/bench_huge.py, for its bundle builders."""
    spec = importlib.util.spec_from_file_location(
        "bench_huge", ROOT / "scripts" / "bench" / "bench_huge.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_huge"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _bench()

#: Runs `argv`, then prints its children's peak RSS: a process forked straight from
#: pytest would inherit pytest's own high-water mark (Linux carries it across exec).
_LAUNCHER = (
    "import resource, subprocess, sys\n"
    "rc = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL)\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    "sys.exit(rc)\n"
)


def trajstore(*args: str, env: dict[str, str] | None = None) -> tuple[int, int, str]:
    """Exit code, peak RSS in bytes and stderr of `trajstore ARGS` in its own process."""
    proc = subprocess.run(
        [sys.executable, "-c", _LAUNCHER, sys.executable, "-m", "trajstore", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    return proc.returncode, int(proc.stdout.strip().splitlines()[-1]) * 1024, proc.stderr


def _step(contents) -> str:  # noqa: ANN001
    step = contents.identity["actor_step_id"]
    return f"{step['rollout_id']}:{step['step_id']}"


@pytest.fixture(scope="module")
def payload_store(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A 128 MiB route payload and a tiny one, each ingested; the ingests' peak RSS."""
    root = tmp_path_factory.mktemp("huge-payload")
    out: dict = {"root": root}
    for label, nbytes, rollout in (("tiny", 4 * MIB, 1), ("big", PAYLOAD_BYTES, 2)):
        contents = bench.payload_contents(nbytes, rollout_id=rollout)
        out[f"{label}_step"] = _step(contents)
        dest = root / f"capture-{label}" / f"replay-{rollout}-0"
        write_bundle(dest, contents)
        del contents
        out[f"{label}_pt"] = dest / "payloads" / "rollout_routed_experts.pt"
        rc, rss, err = trajstore(
            "ingest", str(dest.parent), "--store", str(root / "store"), "--run", "huge"
        )
        assert rc == 0, err
        out[f"{label}_ingest_rss"] = rss
    yield out
    shutil.rmtree(root, ignore_errors=True)


def test_ingest_of_a_large_payload_holds_about_one_copy(payload_store: dict) -> None:
    grown = payload_store["big_ingest_rss"] - payload_store["tiny_ingest_rss"]
    assert grown <= PAYLOAD_FACTOR * PAYLOAD_BYTES + WRITE_BATCH, (
        f"ingest grew {grown / MIB:.0f} MiB for a {PAYLOAD_BYTES / MIB:.0f} MiB payload"
    )


def test_replay_of_a_large_payload_step_is_bounded(payload_store: dict) -> None:
    store = str(payload_store["root"] / "store")
    rc, tiny, err = trajstore(
        "replay", "--store", store, "--run", "huge", "--step", payload_store["tiny_step"]
    )
    assert rc == 0, err
    rc, big, err = trajstore(
        "replay", "--store", store, "--run", "huge", "--step", payload_store["big_step"]
    )
    assert rc == 0, err
    assert big - tiny <= PAYLOAD_FACTOR * PAYLOAD_BYTES + WRITE_BATCH


def test_rest_download_of_a_large_payload_streams_in_bounded_memory(payload_store: dict) -> None:
    """The server's peak RSS grows by far less than the body it sends (streamed, not held)."""
    key = f"huge/step-{payload_store['big_step'].replace(':', '-')}/a1"
    want = bench.tensor_sha256(payload_store["big_pt"])
    # TRAJSTORE_API_CACHE_MB: a body that fits the cache would be kept on purpose
    with (
        served(payload_store["root"] / "store", TRAJSTORE_API_CACHE_MB="16") as (pid, port),
        httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client,
    ):
        before = memory_kb(pid)["VmHWM"] * 1024
        digest, got = hashlib.sha256(), 0
        url = f"/v1/bundles/{key}/payloads/rollout_routed_experts"
        with client.stream("GET", url, params={"format": "raw"}) as resp:
            assert resp.status_code == 200
            for piece in resp.iter_bytes(MIB):
                digest.update(piece)
                got += len(piece)
        grown = memory_kb(pid)["VmHWM"] * 1024 - before
    assert (digest.hexdigest(), got) == want
    assert grown <= STREAM_BOUND, f"serve grew {grown / MIB:.0f} MiB sending the payload"


@pytest.fixture(scope="module")
def samples_store(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny bundle, 10,000 and 20,000 one-token samples, ingested in that order into one
    store; each ingest's peak RSS and each step's replay's (every stage passing)."""
    root = tmp_path_factory.mktemp("huge-samples")
    out: dict = {"root": root}
    store = str(root / "store")
    for label, n, rollout in (("tiny", TINY, 1), ("middle", MIDDLE, 3), ("big", SAMPLES, 2)):
        contents = bench.samples_contents(n, rollout_id=rollout)
        out[f"{label}_step"] = _step(contents)
        dest = root / f"capture-{label}" / f"replay-{rollout}-0"
        write_bundle(dest, contents)
        del contents
        rc, rss, err = trajstore("ingest", str(dest.parent), "--store", store, "--run", "huge")
        assert rc == 0, err
        out[f"{label}_ingest_rss"] = rss
    for label in ("tiny", "middle", "big"):
        step = out[f"{label}_step"]
        peaks = []
        for _ in range(1 if label == "tiny" else REPLAY_RUNS):
            rc, rss, err = trajstore("replay", "--store", store, "--run", "huge", "--step", step)
            assert rc == 0, err  # every stage recomputed over all samples and agreeing
            peaks.append(rss)
        out[f"{label}_replay_rss"] = statistics.median(peaks)
    yield out
    shutil.rmtree(root, ignore_errors=True)


def _per_sample(samples_store: dict, command: str) -> tuple[float, int]:
    """(bytes a sample between MIDDLE and SAMPLES, growth of SAMPLES over the tiny bundle)."""
    big, middle, tiny = (samples_store[f"{k}_{command}_rss"] for k in ("big", "middle", "tiny"))
    return (big - middle) / (SAMPLES - MIDDLE), big - tiny


@pytest.mark.parametrize("command", ["ingest", "replay"])
def test_many_samples_cost_at_most_10_kib_each(samples_store: dict, command: str) -> None:
    slope, grown = _per_sample(samples_store, command)
    assert slope <= PER_SAMPLE_BYTES, (
        f"{command}: {slope / 1024:.1f} KiB a sample from {MIDDLE} to {SAMPLES} samples"
    )
    assert grown <= FIXED + PER_SAMPLE_BYTES * SAMPLES, (
        f"{command}: grew {grown / MIB:.0f} MiB for {SAMPLES} samples"
    )


def test_a_payload_over_the_limit_is_refused_before_it_is_read(tmp_path: Path) -> None:
    contents = bench.payload_contents(4 * MIB)
    write_bundle(tmp_path / "capture" / "replay-1-0", contents)
    env = dict(os.environ, **{MAX_PAYLOAD_ENV: str(MIB)})
    store = tmp_path / "store"
    rc, _, err = trajstore(
        "ingest", str(tmp_path / "capture"), "--store", str(store), "--run", "r", env=env
    )
    assert rc == 2
    lines = err.strip().splitlines()
    assert any("beyond the limit of 1048576" in line and MAX_PAYLOAD_ENV in line for line in lines)
    assert "Traceback" not in err
    assert not list((store / "refs" / "bundles").glob("*.json"))


def test_a_bundle_over_the_sample_limit_is_refused_before_its_payloads(tmp_path: Path) -> None:
    write_bundle(tmp_path / "capture" / "replay-1-0", bench.samples_contents(TINY))
    env = dict(os.environ, **{MAX_SAMPLES_ENV: str(TINY - 1)})
    store = tmp_path / "store"
    rc, _, err = trajstore(
        "ingest", str(tmp_path / "capture"), "--store", str(store), "--run", "r", env=env
    )
    assert rc == 2
    assert f"lists {TINY} samples, beyond the limit of {TINY - 1}" in err
    assert "Traceback" not in err
    assert not list((store / "refs" / "bundles").glob("*.json"))


def test_a_malformed_payload_limit_is_a_usage_error(tmp_path: Path) -> None:
    contents = bench.payload_contents(4 * MIB)
    write_bundle(tmp_path / "capture" / "replay-1-0", contents)
    env = dict(os.environ, **{MAX_PAYLOAD_ENV: "lots"})
    rc, _, err = trajstore("validate", str(tmp_path / "capture"), env=env)
    assert rc == 2
    assert MAX_PAYLOAD_ENV in err and "Traceback" not in err


def test_the_launcher_reports_the_child_not_pytest() -> None:
    """The measuring helper itself: a 200 MiB allocation shows, pytest's own size does not."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    code = "import numpy as np; a = np.ones(200 << 20, dtype=np.uint8); print(a.sum())"
    proc = subprocess.run(
        [sys.executable, "-c", _LAUNCHER, sys.executable, "-c", code],
        capture_output=True,
        text=True,
    )
    rss = int(proc.stdout.strip().splitlines()[-1]) * 1024
    assert 200 * MIB <= rss < 200 * MIB + 150 * MIB
    assert own > 0
