"""What only an S3 store has: the commit point under racing writers on a real S3 server
(conditional PUTs decide), configuration from the AWS variables only, the CLI on s3://."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import make_contents
from inprocess_cli import cli

from trajstore.bundle.writer import write_bundle
from trajstore.cas.s3 import S3RefSpace, parse_s3_url, s3_client
from trajstore.store import Store

pytestmark = pytest.mark.integration

RACERS = 4
#: creators of one key released together by one barrier, and how many keys they race for
CREATORS, ROUNDS = 6, 5


def _ref_keys(store: Store) -> list[str]:
    """The key of every ref object in the bucket (duplicates included)."""
    return [
        json.loads(store.space.read(f"refs/bundles/{d.name}"))["key"]
        for d in store.space.list("refs/bundles")
    ]


def test_racing_ingests_of_one_identity_publish_exactly_one_ref(
    s3_env: Any, tmp_path: Path
) -> None:
    url = s3_env.fresh_url("race")
    same = write_bundle(tmp_path / "same" / "replay-7-0", make_contents(lengths=40, seed=1))
    other = write_bundle(tmp_path / "other" / "replay-7-0", make_contents(lengths=40, seed=2))
    Store.open(url).close()
    # RACERS processes on one identity: half ingest one content, half another
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trajstore",
                "ingest",
                "--store",
                url,
                "--json",
                str(same if i % 2 == 0 else other),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(RACERS)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * RACERS, [e for _, e in outs]
    with Store.open(url, create=False) as store:
        keys = _ref_keys(store)
        # one attempt numbering: the two contents hold a1 and a2, each published once
        assert sorted(keys) == ["default/step-7-0/a1", "default/step-7-0/a2"]
        assert store.attempts("default", "step", 7, 0) == [1, 2]
        digests = {
            b.attempt: b.ref["content_digest"]
            for b in (store.step("default", 7, 0, attempt=a)[0] for a in (1, 2))
        }
        assert len(set(digests.values())) == 2
        rows = store.bundles(all_attempts=True)
    assert [r["key"] for r in rows] == ["default/step-7-0/a1", "default/step-7-0/a2"]


def test_creators_of_one_key_released_together_make_exactly_one_winner(s3_env: Any) -> None:
    """The commit point itself, raced: CREATORS creators (each its own S3 client) wait on
    one barrier, then all create the same new key at once; ROUNDS keys. The conditional
    PUT lets exactly one win each, and the key holds the winner's bytes. (A check-then-put
    lets several win: every creator's check runs before any creator's put lands.)"""
    loc = parse_s3_url(s3_env.fresh_url("create-once"))
    spaces = [S3RefSpace(s3_client(loc.bucket), loc) for _ in range(CREATORS)]
    for space in spaces:  # each client connected before the race, not during it
        assert not space.exists("refs/warm-up")
    barrier = threading.Barrier(CREATORS)
    won: list[list[int]] = []
    errors: list[BaseException] = []

    def creator(i: int) -> None:
        for r in range(ROUNDS):
            barrier.wait()
            try:
                if spaces[i].create_if_absent(f"refs/race-{r}", f"creator {i}".encode()):
                    won[r].append(i)
            except BaseException as e:  # noqa: BLE001 - reported by the test below
                errors.append(e)
            barrier.wait()  # every creator done with key r before the next round starts

    won.extend([] for _ in range(ROUNDS))
    threads = [threading.Thread(target=creator, args=(i,)) for i in range(CREATORS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert errors == [] and not any(t.is_alive() for t in threads)
    assert [len(w) for w in won] == [1] * ROUNDS, won
    for r, (winner,) in enumerate(won):
        assert spaces[0].read(f"refs/race-{r}") == f"creator {winner}".encode()


def test_a_plain_http_endpoint_needs_aws_allow_http(s3_env: Any) -> None:
    env = {**os.environ, "AWS_ALLOW_HTTP": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "trajstore", "ls", "--store", s3_env.fresh_url()],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "AWS_ALLOW_HTTP=true" in proc.stderr


def test_cli_ingest_export_and_fsck_work_on_an_s3_store(
    s3_env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = s3_env.fresh_url("cli")
    src = write_bundle(tmp_path / "cap" / "replay-7-0", make_contents(lengths=30))
    assert cli("ingest", "--store", url, tmp_path / "cap").returncode == 0
    out = tmp_path / "out"
    proc = cli("export", "--store", url, "--step", "7:0", out)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.rglob("*")) == sorted(p.name for p in src.rglob("*"))
    assert cli("fsck", "--store", url).returncode == 0
    monkeypatch.setenv("TRAJSTORE_STORE", "")
    assert cli("ls", "--store", url).returncode == 0


def test_serve_on_an_s3_store_answers_a_lookup_by_actor_step_id(
    s3_env: Any, tmp_path: Path
) -> None:
    import httpx
    from web_demo import serve

    url = s3_env.fresh_url("serve")
    write_bundle(tmp_path / "cap" / "replay-7-0", make_contents(lengths=30))
    assert cli("ingest", "--store", url, "--run", "r", tmp_path / "cap").returncode == 0
    with serve(url) as base:  # type: ignore[arg-type]  # an s3:// URL as the store
        step = httpx.get(f"{base}/v1/runs/r/steps/7:0", timeout=60)
        (log_probs,) = [
            p for p in step.json()["bundles"][0]["payloads"] if p["name"] == "log_probs"
        ]
        body = httpx.get(f"{base}{log_probs['url']}", timeout=60)
    assert step.status_code == 200 and body.status_code == 200
    with Store.open(url, create=False) as store:
        stored = store.step("r", 7, 0)[0].payload("log_probs")
    assert np.array_equal(np.load(io.BytesIO(body.content)), stored)


def test_a_damaged_pack_index_cache_is_ignored(s3_env: Any, tmp_path: Path) -> None:
    """Pack indexes are cached locally (immutable); a bad cached copy is refetched."""
    url = s3_env.fresh_url("idx")
    c = make_contents(lengths=25)
    with Store.open(url) as store:
        store.ingest([write_bundle(tmp_path / "b", c)])
        cached = sorted((store.root / "pack-index").glob("*.idx"))
    assert cached
    for path in cached:
        path.write_bytes(b"damaged")
    with Store.open(url, create=False) as store:
        got = store.step("default", 7, 0)[0].payload("log_probs")
    assert np.array_equal(got, c.payloads["log_probs"].numpy())


def test_an_s3_store_knows_the_objects_it_wrote_without_a_request(
    s3_env: Any, tmp_path: Path
) -> None:
    """`has_cached` (a writer skips encoding and putting a chunk it answers for) knows the
    objects of a pack this handle wrote or listed, as on a directory: the one packed
    object store over both backends."""
    url = s3_env.fresh_url("known")
    with Store.open(url) as store:
        small, large = store.objs.put(b"s" * 100), store.objs.put(b"L" * (2 << 20))
        assert store.objs.has_cached(small, 100)  # buffered
        store.objs.flush()
        assert store.objs.has_cached(small, 100) and store.objs.has_cached(large, 2 << 20)
    with Store.open(url, create=False) as store:  # listed at the open
        assert store.objs.has_cached(small, 100)


def test_reading_two_samples_fetches_their_chunks_not_the_pack(
    s3_env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranged GETs: the bytes asked of the server (counted at the obstore client, a
    third-party call, passed through unchanged) are a small part of the pack."""
    import obstore

    url = s3_env.fresh_url("ranged")
    c = make_contents(groups=8, samples_per_group=4, lengths=3000)  # 32 samples, 1 pack
    with Store.open(url) as store:
        store.ingest([write_bundle(tmp_path / "b", c)])
    with Store.open(url, create=False) as store:
        (b,) = store.step("default", 7, 0)
        packs = [
            m["size"]
            for batch in obstore.list(store.objs.client, prefix=store.objs.loc.prefix + "packs/")
            for m in batch
            if m["path"].endswith(".pack")
        ]
        asked: list[int] = []
        real = obstore.get_ranges

        def counting(client: Any, path: str, *, starts: list, ends: list) -> Any:
            asked.extend(e - s for s, e in zip(starts, ends, strict=True))
            return real(client, path, starts=starts, ends=ends)

        monkeypatch.setattr(obstore, "get_ranges", counting)
        rows = b.payload_rows("log_probs", np.array([5, 20]))
    flat = c.payloads["log_probs"].numpy()
    want = np.concatenate([flat[i * 3000 : (i + 1) * 3000] for i in (5, 20)])
    assert np.array_equal(rows, want)
    assert len(packs) == 1 and 0 < sum(asked) < packs[0] / 10


def test_a_store_created_anew_at_a_url_does_not_inherit_its_cached_catalog(
    s3_env: Any, tmp_path: Path
) -> None:
    import obstore

    url = s3_env.fresh_url("anew")
    with Store.open(url) as store:
        store.ingest([write_bundle(tmp_path / "a", make_contents(lengths=5))], run="old")
        assert [r["run"] for r in store.bundles()] == ["old"]
        client, prefix = store.objs.client, store.objs.loc.prefix
    names = [m["path"] for b in obstore.list(client, prefix=prefix) for m in b]
    obstore.delete(client, names)  # the bucket prefix wiped; the local cache stays
    with Store.open(url) as store:
        store.ingest([write_bundle(tmp_path / "b", make_contents(lengths=5))], run="new")
        assert [r["run"] for r in store.bundles()] == ["new"]
