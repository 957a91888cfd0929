"""Cohorts captured on many hosts: each rank stores its own shard, the last one publishes.

With no shared file system, no rank can see another's `rank-<r>/` directory,
so the cohort directory of a local capture never exists. Instead every rank
checks its own member bundle (the same gate as ingest), writes its objects
into the store and then creates one shard document with create-if-absent:

    capture/<run>/<anchor>/g<G>/rank-<r>.json   (its COMPLETE.<r> and its prepared ref)

and lists the shards of its generation. A rank that finds every expected rank
there builds the cohort COMPLETE exactly as `bundle.writer.try_finalize` does
(so an export reproduces a local capture byte for byte) and publishes one ref
per rank through the ingest's attempt claims and ref-name guards. Shards are
created before they are listed, so the last rank to arrive always sees them
all; ranks finishing together may both publish, and the conditional writes
make that one publication (same cohort bytes -> same attempt -> one ref per
key). A rank that dies before its shard exists leaves nothing published.

Once the refs exist the publisher deletes the generation's shards; until then
gc keeps the objects they name (`pending_shards`), however old.
Which shards belong together: with a session id shared by the ranks of one
launch (`TRAJSTORE_CAPTURE_SESSION`, e.g. the job id) the folder is
`s-<session>`. Without one, `g<G>` is the first generation whose slot for this
rank is free or holds these very bytes. That is right unless an earlier cohort
of the step never completed (a rank died) and the step is re-captured with
different content: the restarted rank fills its free slot next to the
survivors' old shards and the cohort mixes two captures. Give a session id
when ranks may be restarted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trajstore.cas.blobs import put_blob_added
from trajstore.errors import BundleError, NotFoundError, StoreError
from trajstore.jsonio import canonical_bytes, read_json
from trajstore.schema import CohortComplete, RankShard
from trajstore.store import gclock
from trajstore.store.api import Store
from trajstore.store.ingest import check_run_name, identity_of, ref_fields, store_rank
from trajstore.store.ingest_gate import verify_member
from trajstore.store.publish import RefPublisher, bundle_key, content_digest, now

SHARDS_KEY = "capture"
SHARD_VERSION = 1


@dataclass
class ShardOutcome:
    """What storing one rank's shard did: its slot, and the keys if it published the cohort."""

    shard: str
    published: bool = False
    keys: list[str] = field(default_factory=list)


def _anchor_name(kind: str, rollout_id: int, step_id: int | None) -> str:
    return f"step-{rollout_id}-{step_id}" if kind == "step" else f"rollout-{rollout_id}"


def store_rank_shard(
    store: Store, member: Path | str, run: str, *, session: str | None = None
) -> ShardOutcome:
    """Store cohort member `member` (a `rank-<r>/` directory holding its `COMPLETE.<r>`)
    and publish the cohort when every expected rank's shard is in the store.

    `session`, one id shared by every rank of a launch, names the shards' folder
    (`s-<session>`) instead of the first free generation. Under the store's writer
    lock: gc never runs between the shard's objects and the shard document."""
    with gclock.writing(store.objs):
        return _store_rank_shard(store, member, run, session=session)


def _store_rank_shard(
    store: Store, member: Path | str, run: str, *, session: str | None = None
) -> ShardOutcome:
    check_run_name(run)
    member = Path(member)
    r = verify_member(member)
    shard = read_json(member / f"COMPLETE.{r.rank}", f"COMPLETE.{r.rank}")
    shard["relpath"] = f"rank-{r.rank}"  # as bundle.writer.write_rank writes the cohort shard
    body, nbytes = store_rank(store.objs, r, {f"COMPLETE.{r.rank}": canonical_bytes(shard)})
    store.objs.flush()  # every object is durable before the shard names it
    _, kind, rollout_id, step_id, rank = identity_of(run, r)
    ref = {**ref_fields(run, r, r.expected_ranks, nbytes), **body}
    expected = r.expected_ranks
    doc = {"shard_version": SHARD_VERSION, "rank": rank, "shard": shard, "ref": ref}
    data = json.dumps(doc, sort_keys=True).encode()
    folder = f"{SHARDS_KEY}/{run}/{_anchor_name(kind, rollout_id, step_id)}"
    if session is not None:
        slot = f"{folder}/s-{session}"
        key = f"{slot}/rank-{rank}.json"
        if not store.space.create_if_absent(key, data) and not _same_shard(
            store.space.read(key), doc
        ):
            raise StoreError(
                f"{store.space.where(key)}: session {session!r} already stored other content "
                f"for rank {rank}; a new capture needs a new TRAJSTORE_CAPTURE_SESSION"
            )
    else:
        g = 1
        while True:
            slot = f"{folder}/g{g}"
            key = f"{slot}/rank-{rank}.json"
            if store.space.create_if_absent(key, data):
                break
            try:
                if _same_shard(store.space.read(key), doc):
                    break
            except NotFoundError:
                continue  # removed just now (its cohort was published): try the slot again
            g += 1
    outcome = ShardOutcome(shard=key)
    keys = try_publish_cohort(store, slot, expected)
    if keys is not None:
        outcome.published, outcome.keys = True, keys
    return outcome


def _same_shard(stored: bytes, doc: dict[str, Any]) -> bool:
    """Whether a stored shard document is `doc` but for `ref.added_bytes`: a retry finds
    its objects stored already and adds nothing, so the first write's count stands."""

    def content(d: Any) -> Any:
        if not isinstance(d, dict) or not isinstance(d.get("ref"), dict):
            return d
        return {**d, "ref": {k: v for k, v in d["ref"].items() if k != "added_bytes"}}

    try:
        other = json.loads(stored)
    except ValueError:
        return False
    return content(other) == content(doc)


def _read_shards(store: Store, folder: str) -> dict[int, dict[str, Any]]:
    docs: dict[int, dict[str, Any]] = {}
    for d in store.space.list(folder):
        if not (d.name.startswith("rank-") and d.name.endswith(".json")):
            continue
        try:
            doc = json.loads(store.space.read(f"{folder}/{d.name}"))
        except NotFoundError:
            continue  # its cohort was just published and the shard removed
        except ValueError as e:
            where = f"{store.space.where(folder)}/{d.name}"
            raise StoreError(f"shard {where}: unreadable ({e})") from None
        docs[int(doc["rank"])] = doc
    return docs


def try_publish_cohort(store: Store, folder: str, expected: list[int]) -> list[str] | None:
    """Publish the cohort whose shards are in `folder` if every expected rank is there;
    None (nothing done) otherwise. Safe to race: the ref space's conditional writes decide.
    Under the writer lock (its cohort COMPLETE blob is new until the refs name it)."""
    with gclock.writing(store.objs):
        return _try_publish_cohort(store, folder, expected)


def _try_publish_cohort(store: Store, folder: str, expected: list[int]) -> list[str] | None:
    docs = _read_shards(store, folder)
    if sorted(docs) != expected:
        return None
    shards = {r: RankShard.from_dict(docs[r]["shard"], f"COMPLETE.{r}") for r in expected}
    if {tuple(sorted(s.expected_ranks)) for s in shards.values()} != {tuple(expected)}:
        raise BundleError(f"{store.space.where(folder)}: shards disagree on expected ranks")
    if len({repr(s.anchor()) for s in shards.values()}) != 1:
        raise BundleError(f"{store.space.where(folder)}: shards disagree on the anchor")
    cohort = {"ranks": expected, "shards": {str(r): shards[r].raw for r in expected}}
    CohortComplete.from_dict(cohort)
    whole, whole_added = put_blob_added(store.objs, canonical_bytes(cohort))
    store.objs.flush()
    publisher = RefPublisher(store.space, store.refs)
    keys = []
    live = store.refs.live()
    for r in expected:
        ref = dict(docs[r]["ref"])
        if r == expected[0] and ref.get("added_bytes") is not None:
            ref["added_bytes"] += whole_added  # the cohort COMPLETE, stored here once
        ref["cohort_sentinels"] = {**ref["cohort_sentinels"], "COMPLETE": whole}
        ref["content_digest"] = content_digest(ref["documents"], ref["cohort_sentinels"])
        identity = (ref["run"], ref["kind"], ref["rollout_id"], ref["step_id"])
        attempt = publisher.claim_attempt(identity, whole)
        key = bundle_key(*identity, r, attempt)
        keys.append(key)
        if key in live:
            continue
        ref.update(key=key, attempt=attempt, published_at=now())
        publisher.publish(key, json.dumps(ref, sort_keys=True, indent=1).encode())
    # Published: the refs now keep the objects alive, the shards are done. A racing
    # publisher that already read them publishes the same refs; one that did not finds
    # the generation incomplete and does nothing.
    for r in expected:
        store.space.delete(f"{folder}/rank-{r}.json")
    return keys


def pending_shards(store: Store) -> list[dict[str, Any]]:
    """The prepared refs of shards whose cohort is not published yet (gc keeps their objects)."""
    out = []
    for d in store.space.walk(SHARDS_KEY):
        if d.name.endswith(".json"):
            try:
                out.append(json.loads(store.space.read(f"{SHARDS_KEY}/{d.name}"))["ref"])
            except (NotFoundError, ValueError, KeyError, TypeError):
                continue  # published (deleted) meanwhile, or not a shard
    return out
