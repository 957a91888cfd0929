"""SharedPool: one pool per process, usable again in a forked child."""

from __future__ import annotations

import os

import pytest

from trajstore.pools import SharedPool

pytestmark = pytest.mark.unit


def test_the_same_pool_is_returned_within_a_process() -> None:
    pool = SharedPool(2, "test-pool")
    assert pool.get() is pool.get()
    assert pool.get().submit(lambda: 41 + 1).result() == 42


def test_a_forked_child_gets_a_working_pool_of_its_own() -> None:
    pool = SharedPool(2, "test-pool-fork")
    parent = pool.get()
    assert parent.submit(os.getpid).result() == os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: the parent's threads do not exist here
        ok = False
        try:
            child = pool.get()
            ok = child is not parent and child.submit(os.getpid).result(timeout=10) == os.getpid()
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert pool.get() is parent
