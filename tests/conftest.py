"""Shared test fixtures: the Relax v2 fixture bundles and a major-1 bundle factory.

``make_bundle`` / ``make_cohort`` write small, real bundles with trajstore's
own writer (format major 1). Their values are deterministic per ``seed`` but
are NOT mathematically consistent: rewards, advantages, KL and the expected
loss numbers are random, so a replay of these bundles is expected to diverge.
Tests that need consistent numbers use `replay_builders`, or compute them with
`oracle` (docs/replay-math.md in plain torch; never trajstore.replay.kernels,
which the numbers are meant to check) and pass them through ``payloads=`` /
``expected=`` / ``samples=`` overrides, or build a ``BundleContents`` with
``make_contents`` and edit it.

``resign_bundle`` re-signs a single bundle directory after a test edited it
(payload sizes and hashes in the manifest, metadata hashes in COMPLETE and
every COMPLETE.<r>), so a test can reach the check behind the integrity gate.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# Two xdist workers share two cores, and the models under test are tiny: a second intra-op
# thread per process only spins beside the other worker (a loaded 2-core box took the web
# demo's MoE runs from ~3 s of CPU to ~12 with torch's default of a thread per core). One
# each, for this process and every child a test starts (set before torch is imported; an
# explicit OMP_NUM_THREADS wins).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from trajstore.bundle.writer import BundleContents, write_bundle, write_rank
from trajstore.jsonio import canonical_bytes, sha256_bytes

# A suite started in the background of a non-interactive shell (`make test &`) inherits
# SIGINT ignored, and so would every command the Ctrl-C tests interrupt: a Python
# started with SIGINT ignored never raises KeyboardInterrupt. With a handler here, the
# children start with the default action again (exec resets handled signals).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

#: the public producer's bundles, kept as the project's own test data
#: (tests/fixtures/relax-v2/README.md says where they come from)
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "relax-v2"
FIXTURE_BUNDLES = ("example_bundle", "example_bundle_divergent")
CAPTURE_DIR = FIXTURES / "example_capture_dir"

#: per-token float payloads every factory bundle carries
PER_TOKEN = ("old_log_probs", "log_probs", "ref_log_probs", "entropy", "kl", "advantages")


@contextmanager
def patched_environ(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` for the block, every name restored (or removed) after:
    for fixtures wider than a test, where pytest's ``monkeypatch`` does not reach."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def copy_fixture(name: str, dest_root: Path) -> Path:
    """A writable copy of ``FIXTURES/<name>`` under ``dest_root``."""
    dest = dest_root / Path(name).name
    shutil.copytree(FIXTURES / name, dest)
    for p in [dest, *dest.rglob("*")]:
        p.chmod(p.stat().st_mode | 0o200)
    return dest


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def write_json(path: Path, obj: Any) -> None:
    path.write_bytes(canonical_bytes(obj))


def edit_json(path: Path, edit: Callable[[Any], object]) -> None:
    """Apply ``edit`` (which mutates the parsed document in place) to a JSON file."""
    doc = read_json(path)
    edit(doc)
    write_json(path, doc)


def resign_bundle(bundle: Path) -> None:
    """Recompute payload specs (bytes, sha256) and every metadata/payload hash."""
    manifest = read_json(bundle / "manifest.json")
    for name, spec in manifest["payloads"].items():
        f = bundle / "payloads" / f"{name}.pt"
        if f.is_file() and not f.is_symlink():
            data = f.read_bytes()
            spec["bytes"] = len(data)
            spec["sha256"] = sha256_bytes(data)
    write_json(bundle / "manifest.json", manifest)
    metadata = {
        n: sha256_bytes((bundle / n).read_bytes())
        for n in ("manifest.json", "index.json", "expected.json")
    }
    complete = read_json(bundle / "COMPLETE")
    complete["metadata"] = metadata
    write_json(bundle / "COMPLETE", complete)
    for shard_path in bundle.glob("COMPLETE.*"):
        shard = read_json(shard_path)
        shard["metadata"] = metadata
        shard["payloads"] = {
            n: manifest["payloads"][n]["sha256"]
            for n in shard["payloads"]
            if n in manifest["payloads"]
        }
        write_json(shard_path, shard)


def make_contents(
    *,
    groups: int = 2,
    samples_per_group: int = 2,
    lengths: int | list[int] | None = None,
    rank: int | None = None,
    seed: int = 0,
    kind: str = "step",
    rollout_id: int = 7,
    step_id: int = 0,
    dtype: torch.dtype = torch.float32,
    world: int = 1,
    bundle_id: str | None = None,
    extra_payloads: dict[str, Any] | None = None,
) -> BundleContents:
    """A small major-1 bundle's contents (see the module docstring).

    - ``lengths``: response length per sample (int: all equal; list: one per
      sample; None: random 1..6 from ``seed``); total_length = response + 3.
    - ``rank``: sample ids ``s-<rank>-<i>`` and group indices offset by
      ``rank * groups``, so the ranks of a cohort hold disjoint samples/groups.
    - ``kind``: "step" (actor_step_id = rollout_id:step_id) or "rollout".
    - one micro-batch per group: ``mb-<global group index:04d>``.
    """
    rng = random.Random(seed * 1000 + (rank or 0))
    gen = torch.Generator().manual_seed(seed * 1000 + (rank or 0))
    n = groups * samples_per_group
    if lengths is None:
        lens = [rng.randint(1, 6) for _ in range(n)]
    elif isinstance(lengths, int):
        lens = [lengths] * n
    else:
        if len(lengths) != n:
            raise ValueError(f"lengths has {len(lengths)} entries, need {n}")
        lens = list(lengths)
    g0 = (rank or 0) * groups
    prefix = "s" if rank is None else f"s-{rank}"
    samples = []
    for i, length in enumerate(lens):
        g = g0 + i // samples_per_group
        raw = round(rng.uniform(0.0, 1.0), 4)
        samples.append(
            {
                "group_index": g,
                "label_hash": None,
                "loss_mask": [1] * (length - 1) + [rng.choice([0, 1])],
                "micro_batch_id": f"mb-{g:04d}",
                "raw_reward": raw,
                "response_length": length,
                "reward": round(raw - 0.5, 4),
                "sample_id": f"{prefix}-{i}",
                "total_length": length + 3,
            }
        )
    tokens = sum(lens)
    payloads: dict[str, Any] = {
        name: (-torch.rand(tokens, generator=gen)).to(dtype) for name in PER_TOKEN
    }
    payloads.update(extra_payloads or {})
    group_ids = sorted({f"g-{s['group_index']}" for s in samples}, key=lambda x: int(x[2:]))
    identity = {
        "actor_step_id": {"rollout_id": rollout_id, "step_id": step_id} if kind == "step" else None,
        "consumer_batch_ids": ["cb-0"],
        "micro_batch_ids": sorted({s["micro_batch_id"] for s in samples}),
        "normalization_cohort_ids": ["nc-0"],
        "rank": {"cp": 1, "dp": world, "pp": 1, "tp": 1},
        "rollout_id": rollout_id if kind == "rollout" else None,
        "rollout_partition_ids": [f"rollout-{rollout_id}"],
        "semantic_group_ids": group_ids,
        "weight_lineage": {
            "actor_weight": f"w-{rollout_id}",
            "rollout_weight": f"w-{rollout_id - 1}",
        },
    }
    config = {
        "advantage_estimator": "grpo",
        "entropy_coef": 0.0,
        "eps_clip": 0.2,
        "eps_clip_high": 0.28,
        "grpo_std_normalization": True,
        "kl_coef": 0.0,
        "kl_loss_type": "k3",
        "n_samples_per_prompt": samples_per_group,
        "rewards_normalization": True,
    }
    expected = {
        "loss.policy": {
            "entropy_loss": rng.uniform(0, 2),
            "loss": rng.uniform(-1, 1),
            "pg_clipfrac": 0.0,
            "pg_loss": rng.uniform(-1, 1),
            "ppo_kl": rng.uniform(0, 0.1),
        },
        "reward.post_process": {"rewards": [s["reward"] for s in samples]},
        "reward.raw": {"raw_rewards": [s["raw_reward"] for s in samples]},
    }
    anchor = f"{rollout_id}-{step_id}" if kind == "step" else f"rollout-{rollout_id}"
    return BundleContents(
        bundle_id=bundle_id or f"b-{anchor}-seed{seed}",
        identity=identity,
        samples=samples,
        config=config,
        payloads=payloads,
        expected=expected,
        producer={"commit": "test", "dirty_patch_digest": "", "torch_version": torch.__version__},
    )


@pytest.fixture
def make_bundle(tmp_path: Path) -> Callable[..., Path]:
    """``make_bundle(dest=None, **make_contents_kwargs) -> Path`` (a new bundle dir)."""
    counter = iter(range(1_000_000))

    def _make(dest: Path | None = None, **kwargs: Any) -> Path:
        dest = dest or tmp_path / f"bundle-{next(counter)}"
        rank = kwargs.get("rank")
        return write_bundle(dest, make_contents(**kwargs), rank=rank)

    return _make


@pytest.fixture
def make_cohort(tmp_path: Path) -> Callable[..., Path]:
    """``make_cohort(dest=None, ranks=2, order=None, **kwargs) -> Path``.

    Writes every rank with `write_rank` in ``order`` (default ascending); all
    ranks share the anchor and bundle id, each holds its own samples.
    """
    counter = iter(range(1_000_000))

    def _make(
        dest: Path | None = None, ranks: int = 2, order: list[int] | None = None, **kwargs: Any
    ) -> Path:
        dest = dest or tmp_path / f"cohort-{next(counter)}"
        expected_ranks = list(range(ranks))
        kwargs.setdefault("bundle_id", "b-cohort")
        for r in order if order is not None else expected_ranks:
            write_rank(
                dest,
                make_contents(rank=r, world=ranks, **kwargs),
                rank=r,
                expected_ranks=expected_ranks,
            )
        return dest

    return _make


@pytest.fixture(params=["duckdb", "postgresql"])
def catalog_url(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """A catalog backend for the catalog suite: None (the store's own DuckDB file) or
    a fresh PostgreSQL schema's URL (tests/pg_server.py: skips, or fails under CI,
    when no server answers)."""
    if request.param == "duckdb":
        yield None
        return
    from pg_server import fresh_schema

    with fresh_schema() as url:
        yield url


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One SeaweedFS S3 server on loopback for the whole run (tests/s3server.py)."""
    from s3server import s3_server as start

    with start(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture
def s3_env(s3_server: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """The AWS variables (and a private cache dir) that point this test's processes at
    the session's S3 server; returns the server (`fresh_url()` gives a new store)."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TRAJSTORE_CACHE_DIR", str(tmp_path / "trajstore-cache"))
    return s3_server


@pytest.fixture(params=["local", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where a store suite's store lives: a fresh directory, or a fresh s3://BUCKET/PREFIX."""
    if request.param == "local":
        return str(tmp_path / "store")
    return request.getfixturevalue("s3_env").fresh_url()


def user_env() -> dict[str, str]:
    """This environment as a user's shell has it: no TRAJSTORE_* setting, and Python's
    streams buffered as usual (PYTHONUNBUFFERED would hide an ordering bug)."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TRAJSTORE_") and k != "PYTHONUNBUFFERED"
    }


@dataclass(frozen=True)
class DemoRun:
    """`trajstore demo demo-store`, run as `make demo` runs it."""

    cwd: Path  # where it ran: demo-store/ and demo-store-work/ are here
    returncode: int
    output: str  # its stdout and stderr as one stream, in the order written


@contextmanager
def _exclusive(lock: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``lock`` for the block: one xdist worker at a time."""
    import fcntl

    with lock.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def session_shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory every xdist worker of this session sees (this session's own: pytest
    numbers each session's base directory), the base directory without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """The demo, once per session (a minute), in a fresh directory outside the checkout;
    what it leaves behind is the README tour's data (tests/test_docs_tour.py).

    It runs once for all xdist workers (the first to ask runs it, under a lock the others
    wait on); each worker gets its own copy of what it left, so a test that writes into
    the store (the tour records results) never races a reader in another worker."""
    shared = session_shared_dir(tmp_path_factory)
    ran, record = shared / "demo-ran", shared / "demo-ran.json"
    with _exclusive(shared / "demo-ran.lock"):
        if not record.exists():
            ran.mkdir()
            proc = subprocess.run(
                [sys.executable, "-m", "trajstore", "demo", "demo-store"],
                cwd=ran,
                env=user_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            record.write_text(json.dumps({"returncode": proc.returncode, "output": proc.stdout}))
    cwd = tmp_path_factory.mktemp("demo")
    shutil.copytree(ran, cwd, symlinks=True, dirs_exist_ok=True)
    done = json.loads(record.read_text())
    return DemoRun(cwd, done["returncode"], done["output"])


SIDES = ("unit", "integration")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test names its side of the `make test-fast` split (a file's `pytestmark`), so a
    new file cannot slip a server or a trainer into the fast loop unnoticed."""
    unmarked = sorted(
        {
            item.nodeid.split("::")[0]
            for item in items
            if not any(item.get_closest_marker(side) for side in SIDES)
        }
    )
    if unmarked:
        raise pytest.UsageError(
            "test files without `pytestmark = pytest.mark.unit` or `.integration`: "
            + ", ".join(unmarked)
        )
