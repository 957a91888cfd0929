"""Ingest, step 4 of 4: publish refs, one per rank, once every object they name is durable.

Attempts: the identity of a bundle is (run, kind, rollout_id, step_id, rank),
and attempts are numbered per anchor (run, kind, rollout_id, step_id): the
first capture seen for an anchor is attempt 1, a different one claims
attempt N+1 by creating `refs/claims/<anchor>.a<N>` (holding the capture's
digest: the cohort COMPLETE's for every rank of a cohort, the content digest
for a single-producer bundle) with create-if-absent. So the ranks of one
cohort share one attempt, a single-producer re-capture of a step captured as
a cohort (or the reverse) is a new attempt rather than a mix, and two
concurrent ingests never publish two different contents under one key. Same
content -> same attempt -> a no-op when its ref is already live.

One ref per key: before creating a ref, a writer fixes its name with
create-if-absent on `refs/claims/<key digest>.ref<G>` (G counts publications
of that key, a new one only after the previous was removed by `rm`); the ref
is then created under that name with create-if-absent. Two writers racing on
one key agree on the name, so exactly one ref object exists, and a writer
that died between the two steps is completed by the next ingest.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from blake3 import blake3

from trajstore.errors import StoreError
from trajstore.jsonio import dumps_sorted_indent1
from trajstore.refspace import RefSpace
from trajstore.store.layout import BUNDLE_REFS_KEY, CLAIMS_KEY, RefIndex, new_doc_name

REF_VERSION = 1


def bundle_key(
    run: str, kind: str, rollout_id: int, step_id: int | None, rank: int | None, attempt: int
) -> str:
    anchor = f"step-{rollout_id}-{step_id}" if kind == "step" else f"rollout-{rollout_id}"
    parts = [run, anchor] + ([f"rank-{rank}"] if rank is not None else []) + [f"a{attempt}"]
    return "/".join(parts)


def content_digest(documents: dict[str, str], cohort_sentinels: dict[str, str]) -> str:
    """Manifest (with every payload's sha256), index and expected determine a bundle's content.

    A cohort member's digest also covers the cohort COMPLETE (every rank's
    metadata hashes), so a re-captured cohort is a new attempt on every rank
    and the ranks of one attempt always belong together.
    """
    parts = {k: documents[k] for k in ("manifest", "index", "expected")}
    parts["cohort"] = cohort_sentinels.get("COMPLETE")
    text = json.dumps(parts, sort_keys=True)
    return blake3(text.encode()).hexdigest()


@dataclass
class PreparedRef:
    """A rank's ref document, all but its key, attempt and publication time; every object
    it names is written (its identity: run, kind, rollout_id, step_id, rank)."""

    identity: tuple
    digest: str
    doc: dict[str, Any]


class RefPublisher:
    """Creates refs in one ref space (claims, guards, refs); keeps its `RefIndex` fresh."""

    def __init__(self, space: RefSpace, refs: RefIndex) -> None:
        self.space = space
        self.refs = refs
        self._refs_lock = threading.Lock()  # RefIndex is not thread-safe; publishers may be

    def publish_many(
        self, targets: list[list[PreparedRef]], live: set[str]
    ) -> list[tuple[bool, list[str]]]:
        """Create the refs of targets (each its ranks' prepared refs) whose objects are
        durable (flushed), in order; `live` holds the keys already live (this call adds the
        ones it publishes). Per target: whether this call published it, and its keys.

        The common case, a first capture of each anchor, costs one round of fsyncs for the
        whole batch (`RefSpace.staged`): every anchor's attempt-1 claim, and the ref guard
        and ref it leads to, are written and fsynced before any of them is created; then
        the claims are created, then the guards of the claims this call made, the claims
        directory is fsynced once, then the refs of the guards this call made, and the refs
        directory is fsynced once. So each ref is created only after its claim and guard
        are durable (the module docstring's order). Anything but that first try (a claim
        held by another capture, a guard held by another writer, the second capture of an
        anchor in the batch) takes the one-by-one path (`claim_attempt`, `publish`), so
        attempts and keys are those of publishing the targets one at a time.
        """
        items = [(t, p) for t, prepared in enumerate(targets) for p in prepared]
        captures = [p.doc["cohort_sentinels"].get("COMPLETE") or p.digest for _, p in items]
        first: dict[tuple, int] = {}  # anchor -> its first item: tries attempt 1 in the batch
        for i, (_, p) in enumerate(items):
            first.setdefault(p.identity[:4], i)
        staged: list[tuple[str, bytes]] = [
            (f"{CLAIMS_KEY}/{anchor_hash(items[i][1].identity[:4])}.a1", captures[i].encode())
            for i in first.values()
        ]
        # attempt 1's guard and ref of each item of the same capture as its anchor's first
        # try (a cohort's ranks share it) whose key is not live: staged with the claims,
        # used only if this call makes that claim (else attempt 1 may be another capture)
        ahead: dict[int, tuple[str, bytes, int]] = {}  # item -> key, ref data, staged index
        ahead_keys: set[str] = set()
        for i, (_, p) in enumerate(items):
            f = first[p.identity[:4]]
            key = bundle_key(*p.identity, 1)
            if captures[i] != captures[f] or key in live or key in ahead_keys:
                continue
            ahead_keys.add(key)
            doc = {**p.doc, "key": key, "attempt": 1, "published_at": now()}
            data = dumps_sorted_indent1(doc)
            name = new_doc_name()
            ahead[i] = (key, data, len(staged))
            staged.append((f"{CLAIMS_KEY}/{key_hash(key)}.ref1", name.encode()))
            staged.append((f"{BUNDLE_REFS_KEY}/{name}.json", data))
        made: dict[int, bool] = {}
        created: set[int] = set()  # items whose ref this call created ahead
        by_guard: list[int] = []  # items whose guard this call created
        with self.space.staged(staged) as st:
            for k, i in enumerate(first.values()):
                made[i] = st.create(k)
            for i, (_, _, g) in ahead.items():
                if made[first[items[i][1].identity[:4]]] and st.create(g):
                    by_guard.append(i)
            st.sync()  # the claims and guards made are durable before any ref exists
            for i in by_guard:
                if st.create(ahead[i][2] + 1):
                    created.add(i)
            st.sync()
        if created:
            with self._refs_lock:
                self.refs.invalidate()
        # every anchor's attempt-1 claim exists now: the others start by reading it
        todo: list[tuple[int, str, bytes]] = []
        keys: list[list[str]] = [[] for _ in targets]
        published: set[int] = set()
        for i, (t, p) in enumerate(items):
            anchor = p.identity[:4]
            ours = made[first[anchor]] and captures[i] == captures[first[anchor]]
            attempt = 1 if ours else self.claim_attempt(anchor, captures[i], 1)
            key = bundle_key(*p.identity, attempt)
            keys[t].append(key)
            if i in created:
                published.add(t)
                live.add(key)
                continue
            if key in live:
                continue
            live.add(key)
            if ours and i in ahead:  # its guard was there already: the batch path below
                todo.append((t, key, ahead[i][1]))
                continue
            p.doc.update(key=key, attempt=attempt, published_at=now())
            todo.append((t, key, dumps_sorted_indent1(p.doc)))
        mine = [new_doc_name() for _ in todo]
        guards = [f"{CLAIMS_KEY}/{key_hash(key)}.ref1" for _, key, _ in todo]
        held = self.space.create_many_if_absent(
            [(g, m.encode()) for g, m in zip(guards, mine, strict=True)]
        )
        names = [m if h else self._held(g) for g, m, h in zip(guards, mine, held, strict=True)]
        done = self.space.create_many_if_absent(
            [
                (f"{BUNDLE_REFS_KEY}/{n}.json", data)
                for n, (_, _, data) in zip(names, todo, strict=True)
            ]
        )
        if any(done):
            with self._refs_lock:
                self.refs.invalidate()
        for (t, key, data), ok in zip(todo, done, strict=True):
            if ok or self.publish(key, data):
                published.add(t)
        return [(t in published, keys[t]) for t in range(len(targets))]

    def _held(self, claim: str) -> str:
        try:
            return self.space.read(claim).decode().strip()
        except (StoreError, UnicodeDecodeError) as e:
            raise StoreError(f"cannot read claim {self.space.where(claim)}: {e}") from None

    def claim_attempt(self, identity: tuple, digest: str, taken: int = 0) -> int:
        """The attempt of `digest` under `identity`'s anchor, claiming a new one if needed;
        claims 1..`taken` are known to exist (read, not created)."""
        idh = anchor_hash(identity)
        n = 1
        while True:
            claim = f"{CLAIMS_KEY}/{idh}.a{n}"
            if n > taken and self.space.create_if_absent(claim, digest.encode()):
                return n
            if self._held(claim) == digest:
                return n
            n += 1

    def publish(self, key: str, data: bytes) -> bool:
        """Create the one ref of `key` (unless live already); True if this call created it."""
        kh = key_hash(key)
        g = 1
        while True:
            guard = f"{CLAIMS_KEY}/{kh}.ref{g}"
            mine = new_doc_name()
            # whoever creates the guard fixes the ref's name for every writer of this key
            name = mine if self.space.create_if_absent(guard, mine.encode()) else self._held(guard)
            if self.space.create_if_absent(f"{BUNDLE_REFS_KEY}/{name}.json", data):
                with self._refs_lock:
                    self.refs.invalidate()
                return True
            with self._refs_lock:
                self.refs.refresh(force=True)
                live = self.refs.live().get(key)
                listed = {e.name for e in self.refs.all()}
            if live is not None and live.name >= name:
                return False  # published by the other writer (or later): one ref per key
            if live is None and name not in listed:
                # listed after its creation (a listing can lag): trust the existing object
                return False
            g += 1  # that publication was removed (rm); the next one is new


def anchor_hash(identity: tuple) -> str:
    return blake3(json.dumps(list(identity)).encode()).hexdigest()[:40]


def key_hash(key: str) -> str:
    return blake3(key.encode()).hexdigest()[:40]


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
