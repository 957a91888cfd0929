"""Multi-rank capture with real processes (multiprocessing forkserver).

Each rank writes its own ``rank-<r>/`` and cohort shard and tries to finalize
without waiting; the last rank publishes the cohort. A rank killed mid-write
leaves a cohort that is never complete, and readers refuse it.

The ranks are forked from multiprocessing's fork server, which imports torch and the
capture modules once (when it starts) instead of once per rank: each rank is still its
own fresh process, started from a parent that ran nothing but those imports. The
readers' commands run in this process (`trajstore.cli.main`).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from forked import fork_server

from trajstore.cli import main

pytestmark = pytest.mark.integration

RANKS = [0, 1, 2, 3]
#: what the fork server imports once for every rank (torch.optim imports torch._dynamo on
#: first use: 2.5 s of CPU a rank)
PRELOAD = ["torch", "torch._dynamo", "trajstore.capture", "trajstore.examples.tiny_grpo"]


@pytest.fixture(scope="module", autouse=True)
def _fork_server() -> Iterator[None]:
    """This module's own fork server, `PRELOAD` imported (tests/forked.py)."""
    with fork_server(PRELOAD):
        yield


def _context():
    return mp.get_context("forkserver")


def _adopt(environ: dict[str, str]) -> None:
    """In a rank: this test's environment, not the one the fork server started with."""
    os.environ.clear()
    os.environ.update(environ)


def _capture(rank: int, dest: str, mode: str, ranks: list[int] = RANKS):
    from trajstore.capture import CaptureConfig, CaptureManager

    cfg = CaptureConfig(
        enabled=True,
        output_dir=dest if mode == "dir" else None,
        store_dir=dest if mode == "store" else None,
        run="mr",
        rank=rank,
        producer_ranks=ranks,
        rollouts=frozenset(),  # step bundles only
        parallel={"dp": len(ranks), "tp": 1, "pp": 1, "cp": 1},
    )
    return cfg, CaptureManager


def _rank_worker(
    rank: int, dest: str, mode: str, my_turn, next_turn, environ, ranks: list[int] = RANKS
) -> None:
    """One DP rank: a real tiny GRPO step on its own data, captured when its turn comes."""
    from trajstore.examples import tiny_grpo

    _adopt(environ)
    cfg, manager = _capture(rank, dest, mode, ranks)
    loop = tiny_grpo.TinyGRPO(seed=rank, tag=f"k{rank}-", group_offset=1000 * rank)
    cap = manager(cfg, recompute=loop.recompute_config())
    loop.capture = cap
    ro = loop.rollout(0)
    assert my_turn.wait(120)
    loop.train_step(ro, 0)
    stats = cap.close()
    next_turn.set()
    sys.exit(0 if (stats.written, stats.errors) == (1, 0) else 3)


def _victim_worker(rank: int, dest: str, go, environ) -> None:
    """A rank whose bundle is large (MoE routes), so a kill lands mid-write."""
    import torch

    _adopt(environ)
    cfg, manager = _capture(rank, dest, "dir")
    cap = manager(cfg)
    assert go.wait(120)
    with cap.step(0, 0) as st:
        st.add(
            0,
            samples=[
                {
                    "sample_id": f"v-{i}",
                    "group_index": 9000,
                    "response_length": 4,
                    "total_length": 8,
                }
                for i in range(2)
            ],
            log_probs=torch.zeros(8),
            old_log_probs=torch.zeros(8),
            advantages=torch.zeros(8),
            routes={"train_routed_experts": torch.zeros(16, 2048, 2048, dtype=torch.uint8)},
        )
    threading.Event().wait(120)  # killed before this returns


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`trajstore *args` run in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def run_ranks_in_order(dest: Path, mode: str, order: list[int]) -> None:
    """Start every rank at once; rank ``order[k]`` captures only after ``order[k-1]`` closed."""
    ctx = _context()
    ranks = sorted(order)
    turns = [ctx.Event() for _ in range(len(order) + 1)]
    procs = {
        r: ctx.Process(
            target=_rank_worker,
            args=(
                r,
                str(dest),
                mode,
                turns[order.index(r)],
                turns[order.index(r) + 1],
                dict(os.environ),
                ranks,
            ),
        )
        for r in ranks
    }
    for p in procs.values():
        p.start()
    turns[0].set()
    for p in procs.values():
        p.join(180)
    assert {r: p.exitcode for r, p in procs.items()} == {r: 0 for r in ranks}


@pytest.mark.parametrize("seed", [3])
def test_four_ranks_in_random_order_publish_one_complete_cohort(tmp_path, seed, capsys):
    order = random.Random(seed).sample(RANKS, len(RANKS))
    run_ranks_in_order(tmp_path, "dir", order)
    cohort = tmp_path / "replay-0-0"
    complete = json.loads((cohort / "COMPLETE").read_text())
    assert complete["ranks"] == RANKS
    assert sorted(p.name for p in cohort.iterdir() if p.is_dir()) == [f"rank-{r}" for r in RANKS]
    code, out, err = cli(capsys, "validate", str(tmp_path))
    assert code == 0, out + err
    code, out, err = cli(capsys, "replay", str(tmp_path), "--step", "0:0", "--json")
    assert code == 0, out + err
    assert len(json.loads(out)["bundles"]) == len(RANKS)


def test_ranks_publish_into_a_store_once_complete(tmp_path, capsys):
    from trajstore.store.api import Store  # local, like the rank helpers: spawned ranks stay light

    store_dir = tmp_path / "store"
    run_ranks_in_order(store_dir, "store", [1, 0])  # two ranks keep the test short
    with Store.open(store_dir, create=False) as store:
        ranks = sorted(b.rank for b in store.step("mr", 0, 0))
    assert ranks == [0, 1]
    assert not (store_dir / ".capture-staging" / "mr" / "replay-0-0").exists()
    code, out, err = cli(
        capsys, "replay", "--store", str(store_dir), "--step", "0:0", "--run", "mr"
    )
    assert code == 0, out + err


def test_rank_killed_mid_write_leaves_a_cohort_readers_refuse(tmp_path, capsys):
    ctx = _context()
    go = ctx.Event()
    environ = dict(os.environ)
    victim = ctx.Process(target=_victim_worker, args=(3, str(tmp_path), go, environ))
    victim.start()
    turns = [ctx.Event() for _ in range(6)]  # kept referenced until the children unpickle them
    for e in turns[:3]:
        e.set()
    others = [
        ctx.Process(
            target=_rank_worker, args=(r, str(tmp_path), "dir", turns[r], turns[3 + r], environ)
        )
        for r in (0, 1, 2)
    ]
    for p in others:
        p.start()
    for p in others:
        p.join(180)
    assert [p.exitcode for p in others] == [0, 0, 0]
    cohort = tmp_path / "replay-0-0"
    go.set()
    deadline = time.monotonic() + 120
    while not list(cohort.glob(".rank-3.tmp-*")) and time.monotonic() < deadline:
        time.sleep(0.001)
    started = bool(list(cohort.glob(".rank-3.tmp-*")))
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(30)
    assert victim.exitcode == -signal.SIGKILL
    assert started, "rank 3 never started writing"
    assert not (cohort / "COMPLETE").exists()
    assert not (cohort / "COMPLETE.3").exists()
    code, out, err = cli(capsys, "validate", str(tmp_path))
    assert code == 2
    assert "cohort is not complete" in out + err
    code, out, err = cli(capsys, "replay", str(tmp_path), "--step", "0:0")
    assert code == 2
    assert "cohort is not complete" in err
    code, out, err = cli(capsys, "replay", str(cohort / "rank-0"))
    assert code == 2, "a rank of an unfinished cohort must not be replayable on its own"
