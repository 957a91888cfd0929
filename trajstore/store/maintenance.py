"""fsck, gc and stats: the store's truth is its objects and refs, so these read only those.

gc's safety argument: an object is deleted only if no live ref reaches it
AND its file is older than the grace period, and gc marks and sweeps holding
the store's gc lock exclusively (trajstore.store.gclock) while every writer
holds it shared from its first object to its last ref, re-reading the object
index after a gc. So no ingest is in flight during a sweep and none trusts an
object a sweep removed: the rule holds at grace 0. On an S3 store there is no
such lock and the grace is the only protection: an in-flight ingest's objects
are younger than the grace (given one bundle's ingest takes less), and an
ingest that deduplicates against an *old, unreachable* object while gc runs
can lose it (fsck reports the ref; re-running that ingest restores it).
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from trajstore.cas import RepackResult, load_record, record_objects
from trajstore.errors import StoreError, TrajstoreError, UsageError
from trajstore.store import gclock
from trajstore.store.api import Store
from trajstore.store.layout import anchor_label
from trajstore.store.stored_bundle import get_json_blob, payload_file_bytes

ROUTE_NAMES = ("rollout_routed_experts", "train_routed_experts", "train_natural_routed_experts")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)?\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, None: 1}


def parse_duration(text: str) -> float:
    """`90s`, `15m`, `1h`, `2d`, `1w` or plain seconds."""
    m = _DURATION.match(str(text))
    if not m:
        raise UsageError(
            f"duration {text!r} is not a number with an optional unit s/m/h/d/w (e.g. 1h)"
        )
    return float(m.group(1)) * _UNITS[m.group(2)]


@dataclass
class FsckReport:
    objects_checked: int = 0
    refs_checked: int = 0
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, **asdict(self)}


def ref_closure(
    store: Store, ref: dict[str, Any], unread: set[str] | None = None
) -> dict[str, str]:
    """hash -> what it is (for naming problems), for every object a ref needs.

    A payload record that cannot be read hides the chunks it names: it is added to
    `unread` (when given), since a closure without them is not the whole closure."""
    need: dict[str, str] = {}
    for k, h in ref["documents"].items():
        need[h] = f"{k} document"
    # a cohort member has COMPLETE.<r> twice (its own, and the cohort's with relpath):
    # both are needed, so the two maps are walked separately, never merged by name
    for where in ("sentinels", "cohort_sentinels"):
        for k, h in (ref.get(where) or {}).items():
            need.setdefault(h, f"{k} sentinel")
    document = (ref.get("mismatch") or {}).get("document")
    if document:
        need.setdefault(document, "mismatch document")
    for name, p in ref["payloads"].items():
        need[p["record"]] = f"payload {name!r} record"
        f = p.get("file") or {}
        for k in ("envelope", "whole"):
            if f.get(k):
                need.setdefault(f[k], f"payload {name!r} file {k}")
        try:
            for h in record_objects(store.objs, load_record(store.objs, p["record"])):
                need.setdefault(h, f"payload {name!r} chunk/metadata")
        except TrajstoreError:  # the record itself is reported as missing/corrupt
            if unread is not None:
                unread.add(p["record"])
    return need


def fsck(store: Store, *, deep: bool = True) -> FsckReport:
    """Re-hash every object; check every live ref's closure
    (and, if deep, that each .pt reproduces).

    Holds the gc lock shared, like a writer: a gc sweep rewriting a pack between the
    listing of the objects and the check of a ref would read as a missing object."""
    with gclock.writing(store.objs):
        return _fsck(store, deep=deep)


def _fsck(store: Store, *, deep: bool) -> FsckReport:
    rep = FsckReport()
    where: dict[str, str] = {}  # hash -> location of its first stored copy
    for info in store.objs.iter_objects():
        where.setdefault(info.hash, info.location)
    rep.objects_checked = len(where)
    bad = store.objs.verify_many(list(where))  # batched where reads cost a request
    good = set(where) - bad.keys()
    for h, problem in bad.items():
        rep.problems.append(f"{where[h]}: {problem}")
    for path in getattr(store.objs, "corrupt_indexes", []):
        rep.problems.append(f"pack index {path} is corrupt; its objects are unreadable")
    store.refs.refresh(force=True)  # every ref, not only those after the listing mark
    rep.problems += store.refs.problems
    live = store.refs.live()
    groups: dict[tuple, list] = defaultdict(list)
    for key, e in sorted(live.items()):
        rep.refs_checked += 1
        try:
            ref = store.refs.read(e.name)
            need = ref_closure(store, ref)
        except (TrajstoreError, KeyError, TypeError) as ex:
            rep.problems.append(f"ref {key}: unreadable ({ex})")
            continue
        missing = [(h, what) for h, what in need.items() if h not in good]
        for h, what in missing:
            state = "corrupt" if h in bad else "missing"
            rep.problems.append(f"ref {key}: {what} object {h} is {state}")
        if deep and not missing:
            try:
                for p in ref["payloads"].values():
                    payload_file_bytes(store.objs, p, load_record(store.objs, p["record"]))
                for k in ("manifest", "index", "expected"):
                    get_json_blob(store.objs, ref["documents"][k])
            except TrajstoreError as ex:
                rep.problems.append(f"ref {key}: {ex}")
        if e.cohort_ranks is not None:
            groups[(e.run, e.kind, e.rollout_id, e.step_id, e.attempt)].append(e)
    for (run, kind, r, s, a), members in sorted(groups.items(), key=lambda kv: str(kv[0])):
        want = sorted(members[0].cohort_ranks or ())
        have = sorted(m.rank for m in members)
        if have != want:
            what = anchor_label(kind, r, s)
            keys = " ".join(m.key for m in sorted(members, key=lambda m: m.rank))
            rep.warnings.append(
                f"run {run!r} {what} attempt {a}: cohort ranks {have} of {want} published "
                "(an interrupted ingest, or a rank removed by an older trajstore); it lists, "
                "but replay and export refuse it until the ingest is re-run or the ranks "
                f"left are removed: trajstore rm {keys}"
            )
    return rep


def live_objects(store: Store, unread: set[str] | None = None) -> set[str]:
    """Objects reachable from a live ref, or from a cohort shard not yet published.
    Payload records that could not be read (so their chunks are not in it) go to `unread`."""
    from trajstore.store.shards import pending_shards

    out: set[str] = set()
    store.refs.refresh(force=True)  # gc's safety needs every ref: a full listing
    for e in store.refs.live().values():
        out |= set(ref_closure(store, store.refs.read(e.name), unread))
    for ref in pending_shards(store):
        out |= set(ref_closure(store, ref, unread))
    return out


def check_live_objects_stored(store: Store, live: set[str], unread: set[str]) -> None:
    """Refuse to sweep a store that lacks objects its live refs need.

    Why: gc deletes what the live set does not name, so an incomplete live set (a record
    that cannot be read hides its chunks) or a store already missing live objects (a pack
    whose index was lost reads as a pack without an index, which gc removes) would turn
    damage that can still be repaired into lost data. One set difference against the
    object index: the live set is already computed."""
    lost = store.objs.missing(live) | unread
    if lost:
        raise StoreError(
            f"gc refused, nothing deleted: {len(lost)} object(s) that live bundles need are "
            f"missing or unreadable in {store.url} (e.g. a pack whose index was lost, kept "
            f"as it is); run `trajstore fsck --store {store.url}` to name them and their "
            "bundles, restore the files (or re-ingest or `trajstore rm` those bundles), "
            "then gc again"
        )


#: the shortest grace `trajstore gc` accepts on a store without the gc lock (S3)
UNLOCKED_MIN_GRACE_S = 600.0


def check_cli_grace(store: Store, grace_s: float) -> None:
    """Refuse a grace under 10 minutes where nothing stops gc from sweeping an in-flight
    ingest's objects (an S3 store: no lock reaches writers on other hosts; there the
    grace must outlast any one ingest). A directory store takes any grace, 0 included."""
    if not gclock.protects(store.objs) and grace_s < UNLOCKED_MIN_GRACE_S:
        raise UsageError(
            f"gc --grace {grace_s:g}s refused on {store.url}: an object store has no lock "
            "against writers on other hosts, so a grace shorter than an ingest could delete "
            "the objects of one in flight; use --grace 10m or more"
        )


def gc(store: Store, grace_s: float = 3600.0) -> dict[str, Any]:
    """Delete objects unreachable from every live ref and older than `grace_s`."""
    if grace_s < 0:
        raise UsageError("grace must be >= 0")
    started = time.time()
    # Exclusive against writers (gclock): no ref can appear for an object swept here.
    with gclock.collecting(store.objs):
        unread: set[str] = set()
        keep = live_objects(store, unread)
        check_live_objects_stored(store, keep, unread)
        res: RepackResult = store.objs.repack(lambda h: h in keep, older_than=grace_s)
    return {
        "live_objects": len(keep),
        "objects_dropped": res.objects_dropped,
        "bytes_freed": res.bytes_freed,
        "packs_rewritten": res.packs_rewritten,
        "files_removed": res.files_removed,
        "grace_s": grace_s,
        "seconds": round(time.time() - started, 3),
    }


def stats(store: Store) -> dict[str, Any]:
    """Logical vs physical bytes, dedup ratio, objects, per run; route bytes per token-layer.

    A run's `physical_bytes` is what its bundles added to the object store at ingest
    (each ref's `added_bytes`: an object counts for the bundle that stored it, so the
    runs' figures add up to the store's), null ("not recorded") when a bundle was
    ingested before trajstore recorded it; `referenced_bytes` is every distinct object
    its bundles reference, shared ones included. The REST run summary and the web view
    give the same `physical_bytes` from the catalog.
    """
    sizes: dict[str, int] = {}
    for info in store.objs.iter_objects():
        sizes.setdefault(info.hash, info.size)
    per_run: dict[str, dict[str, Any]] = {}
    reach: dict[str, set[str]] = defaultdict(set)
    route_objs: dict[str, set[str]] = defaultdict(set)
    route_units: dict[str, int] = defaultdict(int)
    all_reach: set[str] = set()
    for e in store.refs.live().values():
        ref = store.refs.read(e.name)
        r = per_run.setdefault(
            e.run, {"run": e.run, "bundles": 0, "logical_bytes": 0, "physical_bytes": 0}
        )
        r["bundles"] += 1
        r["logical_bytes"] += sum(
            int(p.get("logical_bytes") or 0) for p in ref["payloads"].values()
        )
        added = ref.get("added_bytes")
        if not isinstance(added, int) or isinstance(added, bool) or r["physical_bytes"] is None:
            r["physical_bytes"] = None  # not recorded for at least one of its bundles
        else:
            r["physical_bytes"] += added
        closure = set(ref_closure(store, ref))
        reach[e.run] |= closure
        all_reach |= closure
        for name in ROUTE_NAMES:
            p = ref["payloads"].get(name)
            if p is not None and len(p["shape"]) == 3:
                rec = load_record(store.objs, p["record"])
                objs = {h for row in rec.chunks for h in row if h} | {rec.meta, p["record"]}
                route_objs[e.run] |= objs
                route_units[e.run] += p["shape"][0] * p["shape"][1]
    runs = []
    for run, r in sorted(per_run.items()):
        phys = r["physical_bytes"]
        r["dedup_ratio"] = round(r["logical_bytes"] / phys, 3) if phys else None
        r["referenced_bytes"] = sum(sizes.get(h, 0) for h in reach[run])
        r["objects"] = len(reach[run])
        if route_units[run]:
            rb = sum(sizes.get(h, 0) for h in route_objs[run])
            r["route_bytes"] = rb
            r["route_bytes_per_token_layer"] = round(rb / route_units[run], 4)
        runs.append(r)
    logical = sum(r["logical_bytes"] for r in runs)
    physical = sum(sizes.get(h, 0) for h in all_reach)
    stored = sum(sizes.values())
    added = [r["physical_bytes"] for r in runs]
    return {
        "runs": runs,
        "bundles": sum(r["bundles"] for r in runs),
        "logical_bytes": logical,
        "physical_bytes": physical,
        # the runs' added bytes: equals physical_bytes unless objects outlived the bundle
        # that stored them (rm + gc) or an interrupted ingest stored them first
        "added_bytes": None if None in added else sum(added),
        "dedup_ratio": round(logical / physical, 3) if physical else None,
        "objects": len(sizes),
        "stored_bytes": stored,
        "garbage_bytes": stored - physical,
    }
