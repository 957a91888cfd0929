"""Batched durable creates and packs sealed outside the object store's lock (issue 15)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from trajstore.cas import LocalObjectStore
from trajstore.refspace import LocalRefSpace

pytestmark = pytest.mark.unit


def test_create_many_creates_in_order_and_never_replaces(tmp_path: Path) -> None:
    space = LocalRefSpace(tmp_path)
    assert space.create_if_absent("refs/claims/b", b"old")
    got = space.create_many_if_absent(
        [
            ("refs/claims/a", b"1"),
            ("refs/claims/b", b"new"),  # exists: left as it is
            ("refs/bundles/x.json", b"{}"),  # a directory not there yet
            ("refs/claims/a", b"2"),  # the same name again in one batch: the first wins
        ]
    )
    assert got == [True, False, True, False]
    assert space.read("refs/claims/a") == b"1"
    assert space.read("refs/claims/b") == b"old"
    assert space.read("refs/bundles/x.json") == b"{}"
    # no temp file is left behind, and none is listed
    for d in ("refs/claims", "refs/bundles"):
        assert sorted(os.listdir(tmp_path / d)) == sorted(e.name for e in space.list(d))


def test_create_many_of_one_or_none(tmp_path: Path) -> None:
    space = LocalRefSpace(tmp_path)
    assert space.create_many_if_absent([]) == []
    assert space.create_many_if_absent([("k", b"v")]) == [True]
    assert space.create_many_if_absent([("k", b"w")]) == [False]
    assert space.read("k") == b"v"


def test_staged_documents_are_created_only_when_asked_and_never_replace(tmp_path: Path) -> None:
    space = LocalRefSpace(tmp_path)
    assert space.create_if_absent("refs/claims/b", b"old")
    items = [
        ("refs/claims/a", b"1"),
        ("refs/claims/b", b"new"),  # exists: left as it is
        ("refs/bundles/x.json", b"{}"),  # a directory not there yet
        ("refs/bundles/y.json", b"[]"),  # never asked for: never created
    ]
    with space.staged(items) as st:
        assert not space.exists("refs/claims/a")  # staged is not created
        assert [st.create(0), st.create(1)] == [True, False]
        st.sync()
        assert st.create(2)
        st.sync()
    assert space.read("refs/claims/a") == b"1"
    assert space.read("refs/claims/b") == b"old"
    assert space.read("refs/bundles/x.json") == b"{}"
    assert not space.exists("refs/bundles/y.json")
    for d in ("refs/claims", "refs/bundles"):  # no temp file is left behind
        assert sorted(os.listdir(tmp_path / d)) == sorted(e.name for e in space.list(d))


def test_objects_put_while_a_flush_writes_its_pack_are_readable_and_flushed(
    tmp_path: Path,
) -> None:
    objs = LocalObjectStore(tmp_path, pack_max_bytes=64 << 10)  # many flushes on the way
    names: list[str] = []
    errors: list[BaseException] = []

    def writer(k: int) -> None:
        try:
            for i in range(300):
                data = f"{k}-{i}-".encode() * 50
                h = objs.put(data)
                names.append(h)
                assert objs.get(h) == data  # buffered, being sealed or packed: readable
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(3)]
    flusher = threading.Thread(target=lambda: [objs.flush() for _ in range(50)])
    for t in [*threads, flusher]:
        t.start()
    for t in [*threads, flusher]:
        t.join()
    assert not errors
    objs.flush()
    objs.close()
    again = LocalObjectStore(tmp_path)  # a new instance sees only what is on disk
    stored = {o.hash for o in again.iter_objects()}
    assert set(names) <= stored
    assert len(names) == 900


def test_list_names_is_the_listing_without_times(tmp_path: Path) -> None:
    """`list_names` reads the names alone (no stat a document): the same names as `list`,
    so a temp file being written, a subfolder and a link to a folder are left out."""
    from trajstore.jsonio import temp_sibling

    space = LocalRefSpace(tmp_path)
    for name in ("b.json", "a.json", "c.txt"):
        assert space.create_if_absent(f"refs/bundles/{name}", b"{}")
    temp_sibling(tmp_path / "refs" / "bundles" / "d.json").write_bytes(b"partial")
    (tmp_path / "refs" / "bundles" / "sub").mkdir()
    (tmp_path / "refs" / "bundles" / "to-sub").symlink_to(tmp_path / "refs" / "bundles" / "sub")
    names = space.list_names("refs/bundles")
    assert names == [d.name for d in space.list("refs/bundles")]
    assert names == ["a.json", "b.json", "c.txt"]
    assert space.list_names("refs/none") == []
