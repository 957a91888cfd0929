"""Replay straight from the store, with rollout -> step linkage and recording.

A step-level bundle consumes samples of its rollout's rollout-level bundle.
When both are stored, the rollout bundle is replayed first and its
*recomputed* rewards give the advantages the step should have consumed, for
the samples it consumed: the step's ``advantage.estimate`` uses them, and
`check_linkage` checks the step's recorded advantages against them even when
the step's producer declared no reward or advantage stage. A divergence that
starts in the rollout and reached the step is reported as rooted there, with
the step's stages marked downstream of it. Where the check cannot run (rollout
not stored, no rewards recomputed, ``link=False``) the report says so.
`replay_linked` is that linked replay of a step against its rollout's report, for
any sources (a benchmark replays exported directories with it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import numpy as np

from trajstore import __version__
from trajstore.errors import NotFoundError, TrajstoreError, UsageError
from trajstore.jsonio import json_safe
from trajstore.replay import kernels, slime_math, verl_math
from trajstore.replay.compare import Comparison, compare_arrays
from trajstore.replay.context import ReplayContext, StageInputError, StageMemo, StageOutcome
from trajstore.replay.registry import get_stage
from trajstore.replay.runner import (
    BundleReport,
    Linkage,
    ReplayReport,
    StageRequest,
    replay_sources,
)
from trajstore.replay.selection import SelectionRequest
from trajstore.schema import Config
from trajstore.vocab import REWARD_STAGES, Payload, Stage, StageStatus, Verdict

#: rollout stages whose outputs a step bundle consumes
FEEDS_STEPS = REWARD_STAGES
ROLLOUT_CACHE_SIZE = 8


@dataclass(frozen=True)
class Target:
    """What to replay in a store: one step, one rollout, or one bundle key."""

    run: str | None = None
    step: tuple[int, int] | None = None
    rollout: int | None = None
    bundle_key: str | None = None
    attempt: int | None = None

    def describe(self) -> str:
        if self.bundle_key:
            return f"bundle {self.bundle_key}"
        if self.step is not None:
            return f"run {self.run} step {self.step[0]}:{self.step[1]}"
        return f"run {self.run} rollout {self.rollout}"


def resolve_run(store: Any, run: str | None) -> str:
    """The run to use: the given one, or the store's only run."""
    if run is not None:
        return run
    runs = sorted({e.run for e in store.refs.live().values()})
    if len(runs) == 1:
        return runs[0]
    if not runs:
        raise NotFoundError(f"{store.url}: the store holds no bundles")
    raise UsageError(f"the store holds runs {', '.join(runs)}; pick one with --run")


def stored_sources(store: Any, target: Target) -> list[Any]:
    if sum(x is not None for x in (target.step, target.rollout, target.bundle_key)) != 1:
        raise UsageError("name exactly one of --step R:S, --rollout R, --bundle KEY")
    if target.bundle_key:
        return [store.bundle(target.bundle_key, target.run, target.attempt)]
    run = resolve_run(store, target.run)
    if target.step is not None:
        return store.step(run, *target.step, attempt=target.attempt)
    return store.rollout(run, target.rollout, attempt=target.attempt)


def upstream_rewards(rollout_report: ReplayReport) -> dict[str, float]:
    """sample_id -> recomputed post-processed reward, from a rollout replay."""
    out: dict[str, float] = {}
    for b in rollout_report.bundles:
        rewards = b.recomputed.get("rewards")
        if rewards is None:
            continue
        out.update(
            {
                sample_id: float(reward)
                for sample_id, reward in zip(
                    b.sample_ids, np.asarray(rewards).tolist(), strict=True
                )
            }
        )
    return out


def _rollout_sources(store: Any, run: str, rollout_id: int) -> list[Any] | None:
    """The stored rollout bundle's ranks (None: not stored)."""
    try:
        return store.rollout(run, rollout_id) or None
    except NotFoundError:
        return None


def _replay_rollout(
    store: Any,
    run: str,
    rollout_id: int,
    cache: dict[tuple[str, ...], ReplayReport] | None,
    sources: list[Any] | None = None,
    memo: StageMemo | None = None,
) -> ReplayReport | None:
    """The stored rollout bundle's replay (None: not stored), through the cache.

    `sources`: the rollout's ranks when the caller already looked them up; `memo`:
    where its stage outcomes are kept for the step's replay (`StageMemo`).
    """
    if sources is None:
        sources = _rollout_sources(store, run, rollout_id)
    if not sources:
        return None
    key = tuple(src.bundle_key for src in sources)
    report = None if cache is None else cache.get(key)
    if report is None:
        report = replay_sources(sources, label=sources[0].bundle_id, memo=memo)
        if cache is not None:
            while len(cache) >= ROLLOUT_CACHE_SIZE:
                cache.pop(next(iter(cache)))
            cache[key] = report
    return report


def replay_stored(
    store: Any,
    target: Target,
    *,
    request: StageRequest | None = None,
    selection: SelectionRequest | None = None,
    link: bool = True,
    rollout_cache: dict[tuple[str, ...], ReplayReport] | None = None,
) -> ReplayReport:
    """Replay a stored step/rollout/bundle; gives the report replaying its export gives,
    plus the rollout linkage check of a step (``report.linkage``).

    ``rollout_cache`` (rollout bundle keys -> report) lets a caller replaying many
    steps of one rollout replay that rollout once; it is kept to a few entries.
    """
    request = request or StageRequest()
    sources = stored_sources(store, target)
    first = sources[0]
    ahead = _read_ahead(store, sources, selection, link, rollout_cache)
    label = first.bundle_id if len(sources) == 1 else f"{first.bundle_id} ({len(sources)} ranks)"
    if first.index.identity.kind != "step":
        return replay_sources(sources, label=label, request=request, selection=selection)
    unchecked = "the advantages this step consumed are not checked against its rollout's rewards"
    if not link:
        report = replay_sources(sources, label=label, request=request, selection=selection)
        report.linkage = Linkage(
            status=StageStatus.SKIPPED,
            reason=f"turned off (--no-link, REST link=false); {unchecked}",
        )
        return report
    run, rollout_id = first.ref["run"], first.index.identity.rollout_id
    # the step reads many of its rollout's payloads (the same records): a stage that reads
    # the same bytes, samples and settings in both takes the rollout's outcome
    memo = StageMemo()
    if ahead is not None and ahead[0] == rollout_id:
        # looked up by _read_ahead (the ref's rollout id is the index's)
        ro_sources = ahead[1]
        rollout_report = (
            None
            if ro_sources is None
            else _replay_rollout(store, run, rollout_id, rollout_cache, ro_sources, memo)
        )
    else:
        rollout_report = _replay_rollout(store, run, rollout_id, rollout_cache, memo=memo)
    if rollout_report is None:
        report = replay_sources(
            sources, label=label, request=request, selection=selection, memo=memo
        )
        report.linkage = Linkage(
            status=StageStatus.SKIPPED,
            reason=f"rollout {rollout_id} of run {run} is not in the store; {unchecked}",
        )
        return report
    return replay_linked(
        sources, rollout_report, label=label, request=request, selection=selection, memo=memo
    )


def replay_linked(
    sources: list[Any],
    rollout_report: ReplayReport,
    *,
    label: str,
    request: StageRequest | None = None,
    selection: SelectionRequest | None = None,
    memo: StageMemo | None = None,
) -> ReplayReport:
    """Replay a step's ranks against the replay of its rollout bundle: the step's
    ``advantage.estimate`` uses the rollout's recomputed rewards, `check_linkage` sets
    ``report.linkage``, and a fault the step consumed from the rollout's rewards is named
    as rooted there (``root_*``). Any sources will do: stored ones (`replay_stored`) or
    exported directories (`trajstore.bundle.reader.open_target`)."""
    request = request or StageRequest()
    rewards = upstream_rewards(rollout_report)
    upstream = None
    if rewards:
        upstream = [
            {"rewards_by_id": rewards}
            if all(s.sample_id in rewards for s in src.index.samples)
            else None
            for src in sources
        ]
    report = replay_sources(
        sources, label=label, request=request, selection=selection, upstream=upstream, memo=memo
    )
    report.linkage = check_linkage(report, sources, rollout_report, rewards, request)
    if (
        report.linkage.status == StageStatus.FAIL
        and report.first is not None
        and rollout_report.first_divergent_stage in FEEDS_STEPS
    ):
        # The step consumed what a faulty rollout produced: the fault is rooted there.
        report.root_bundle_key = rollout_report.first.bundle_key
        report.root_stage = rollout_report.first_divergent_stage
    return report


def _read_ahead(
    store: Any,
    sources: list[Any],
    selection: SelectionRequest | None,
    link: bool,
    rollout_cache: dict[tuple[str, ...], ReplayReport] | None,
) -> tuple[int, list[Any] | None] | None:
    """Start reading the payloads a whole-bundle replay is about to read: the stored
    rollout's first (its replay comes first, for the linkage), then the target's.

    The reads (fetch, hash check, zstd) run on threads while this one parses the
    indexes and replays. Returns (rollout id, the rollout's ranks) when they were
    looked up for a step, going by its ref (the index, checked later, decides).
    """
    if selection is not None and not selection.empty:
        return None  # a selection reads only its samples' chunks, when the stage asks
    first = sources[0]
    found = None
    if link and first.ref.get("kind") == "step":
        rollout_id = int(first.ref["rollout_id"])
        try:
            ro = _rollout_sources(store, first.ref["run"], rollout_id)
        except TrajstoreError:
            ro = None  # raised again where the replay looks it up, after the step's checks
        else:
            found = (rollout_id, ro)
        cached = (
            ro and rollout_cache is not None and tuple(s.bundle_key for s in ro) in rollout_cache
        )
        if ro and not cached:
            for src in ro:
                src.prefetch()
    for src in sources:
        src.prefetch()
    return found


def check_linkage(
    report: ReplayReport,
    sources: list[Any],
    rollout_report: ReplayReport,
    rewards: dict[str, float],
    request: StageRequest,
) -> Linkage:
    """Check the advantages each replayed rank consumed against its rollout's rewards.

    The expected advantages are GRPO's (docs/replay-math.md): the rollout
    bundle's *recomputed* post-processed reward of each sample on every response
    token. Where the step's ``advantage.estimate`` did not run (its producer did
    not declare it) or passed while this check fails, the check's outcome
    takes that stage's place in the step's report, so it counts in the verdict.
    """
    ro = rollout_report.first or rollout_report.bundles[0]
    ro_name = f"rollout bundle {ro.bundle_id} ({ro.bundle_key})"
    ro_stage = rollout_report.first_divergent_stage
    base = {
        "rollout_bundle_key": ro.bundle_key,
        "rollout_bundle_id": ro.bundle_id,
        "rollout_first_divergent_stage": ro_stage,
    }
    if not rewards:
        post = next(
            (
                outcome
                for bundle in rollout_report.bundles
                for outcome in bundle.stages
                if outcome.stage == Stage.REWARD_POST_PROCESS
            ),
            None,
        )
        why = "" if post is None else f" ({post.stage} {post.status}: {post.reason})"
        return Linkage(
            status=StageStatus.SKIPPED,
            reason=f"{ro_name} recomputed no rewards{why}; the advantages this step consumed are "
            "not checked against them",
            **base,
        )
    by_label = {src.label: src for src in sources}  # a directory's ranks have no bundle key
    requested = not request.explicit or bool(
        {Stage.REWARD_POST_PROCESS, Stage.ADVANTAGE_ESTIMATE} & set(request.stages)
    )
    checked = mismatches = 0
    max_err: float | None = None
    missing: list[str] = []
    skipped: list[str] = []
    for b in report.bundles:
        got = _linkage_outcome(by_label[b.label], b, rewards, ro_name)
        if isinstance(got, str):
            skipped.append(got)
            continue
        outcome, n, lacking = got
        checked += n
        missing += lacking
        mismatches += outcome.mismatch_count or 0
        max_err = max(max_err or 0.0, outcome.max_abs_error or 0.0)
        _merge_linkage(b, outcome, requested)
    if not checked:
        return Linkage(
            status=StageStatus.SKIPPED, reason="; ".join(skipped) or "no sample to check", **base
        )
    note = ""
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        note += f"; {len(missing)} consumed sample(s) not in the rollout bundle, unchecked: "
        note += ", ".join(missing[:5]) + more
    if skipped:
        note += "; " + "; ".join(skipped)
    if mismatches == 0:
        return Linkage(
            status=StageStatus.PASS,
            reason=(
                f"the advantages {checked} sample(s) consumed match those "
                f"{ro_name}'s recomputed rewards give{note}"
            ),
            samples_checked=checked,
            max_abs_error=max_err,
            **base,
        )
    where = (
        f"the rollout diverges first at {ro_stage}"
        if ro_stage in FEEDS_STEPS
        else "the rollout's rewards replay clean, so the fault is this step's"
    )
    return Linkage(
        status=StageStatus.FAIL,
        reason=f"{mismatches} advantage token(s) of {checked} consumed sample(s) differ from those "
        f"{ro_name}'s recomputed rewards give (max_abs_error={max_err:.3e}); {where}{note}",
        samples_checked=checked,
        mismatch_count=mismatches,
        max_abs_error=max_err,
        **base,
    )


def _linkage_outcome(
    src: Any, b: BundleReport, rewards: dict[str, float], ro_name: str
) -> tuple[StageOutcome, int, list[str]] | str:
    """(outcome, samples checked, samples the rollout lacks), or why this rank is unchecked."""
    who = f"rank {b.rank}: " if b.rank is not None else ""
    config = src.index.config
    why = slime_math.linkage_unsupported(config) or verl_math.linkage_unsupported(config)
    if why:
        return f"{who}{why}"
    estimator = config.get("advantage_estimator") or "grpo"
    if estimator != "grpo":
        return f"{who}advantage_estimator {estimator!r} is not recomputed (grpo only)"
    # every documented key, loss-family ones included: the advantages a step consumed are
    # its rollout's post-processed rewards under both chains (replay-math.md)
    unknown = sorted(set(config) - set(Config.FIELDS))
    if unknown:
        return f"{who}config key(s) {', '.join(unknown)} not understood by this engine"
    if src.index.identity.cp != 1:
        return f"{who}context parallelism cp={src.index.identity.cp} is not supported"
    stage = get_stage(Stage.ADVANTAGE_ESTIMATE)
    reused = b.upstream_comparison
    if reused is not None and reused[0] is rewards:
        # The step's advantage.estimate compared its recorded advantages with those these
        # very rewards give, every consumed sample's, as below would: the same comparison.
        comp, n, lacking = reused[1], len(b.sample_ids), []
    else:
        got = _compare_consumed(src, b, rewards, stage.name, ro_name)
        if isinstance(got, str):
            return f"{who}{got}"
        comp, n, lacking = got
    if comp.ok:
        reason = f"rollout linkage: advantages match {ro_name}'s recomputed rewards"
    else:
        reason = (
            f"rollout linkage: {comp.mismatch_count} advantage token(s) differ from those "
            f"{ro_name}'s recomputed rewards give (max_abs_error={comp.max_abs_error:.3e})"
        )
    outcome = StageOutcome(
        stage=stage.name,
        status=StageStatus.PASS if comp.ok else StageStatus.FAIL,
        reason=reason,
        max_abs_error=comp.max_abs_error,
        mismatch_count=comp.mismatch_count,
        divergences=comp.divergences,
        version=stage.version,
    )
    return outcome, n, lacking


def _compare_consumed(
    src: Any, b: BundleReport, rewards: dict[str, float], stage: str, ro_name: str
) -> tuple[Comparison, int, list[str]] | str:
    """The consumed samples' recorded advantages against those `rewards` give:
    (comparison, samples compared, samples the rollout lacks), or why not compared."""
    ctx = ReplayContext(src, b.selection)
    have = [i for i, sid in enumerate(ctx.sample_ids) if sid in rewards]
    lacking = [sid for sid in ctx.sample_ids if sid not in rewards]
    if not have:
        return f"none of the samples this step consumed is in {ro_name}"
    try:
        consumed = ctx.payload(Payload.ADVANTAGES)
    except StageInputError as exc:
        return str(exc)
    ids = [ctx.sample_ids[i] for i in have]
    lengths = ctx.lengths[have]
    if lacking:
        consumed = np.concatenate([consumed[ctx.offsets[i] : ctx.offsets[i + 1]] for i in have])
    from_rollout = kernels.grpo_returns(
        np.array([rewards[sid] for sid in ids], dtype=np.float32), lengths
    )
    atol, rtol = src.manifest.tolerance(stage)
    comp = compare_arrays(
        stage,
        Payload.ADVANTAGES,
        consumed,
        from_rollout,
        atol=atol,
        rtol=rtol,
        exact=Payload.ADVANTAGES in src.manifest.exact_fields,
        sample_ids=ids,
        offsets=kernels.segment_offsets(lengths),
    )
    return comp, len(have), lacking


def _merge_linkage(b: BundleReport, outcome: StageOutcome, requested: bool) -> None:
    """Put the check in the step's advantage.estimate slot where it adds information:
    the stage did not run, or passed on the step's own rewards while the check fails."""
    pos = next(i for i, s in enumerate(b.stages) if s.stage == Stage.ADVANTAGE_ESTIMATE)
    current = b.stages[pos]
    if current.status == StageStatus.SKIPPED or (
        current.status == StageStatus.PASS and outcome.status == StageStatus.FAIL
    ):
        outcome.requested = requested
        b.stages[pos] = outcome


def result_document(
    report: ReplayReport, bundle: Any, *, selection: SelectionRequest | None = None
) -> dict[str, Any]:
    """The catalog's replay-result document for one stored bundle (docs/catalog.md)."""
    mine = next((b for b in report.bundles if b.bundle_key == bundle.bundle_key), None)
    stages = [] if mine is None else mine.stages
    divergences = [d.to_dict() for s in stages for d in s.divergences]
    fd = report.first_divergence()
    ref = bundle.ref
    return {
        **_result_header(
            bundle.bundle_key, ref["run"], ref["rollout_id"], ref.get("step_id"), report.status
        ),
        "first_divergent_stage": report.first_divergent_stage,
        "first_divergent_rank": report.first_divergent_rank,
        "root_bundle_key": report.root_bundle_key,
        "linkage": None if report.linkage is None else report.linkage.to_dict(),
        "selection": _part_replayed(report, selection),
        "first_divergence": fd,
        "stages": [
            {
                "stage": s.stage,
                "status": s.status,
                "reason": s.reason,
                "max_abs_error": s.max_abs_error,
                "mismatch_count": s.mismatch_count,
                "first_sample": s.divergences[0].sample_id if s.divergences else None,
                "first_field": s.divergences[0].field if s.divergences else None,
                "first_token": s.divergences[0].token_offset if s.divergences else None,
            }
            for s in stages
        ],
        "divergences": divergences,
        "router_metrics": _router_metrics(bundle),
    }


def _part_replayed(report: ReplayReport, selection: SelectionRequest | None) -> dict | None:
    """What part of the bundle a partial replay covered (None: all of it): the samples,
    groups and micro-batches selected, and the stages when a list was asked for. The
    catalog ranks a whole replay's result above any partial one (queries.whole_first)."""
    part = None if selection is None or selection.empty else selection.describe()
    if report.request.explicit:
        part = {**(part or {}), "stages": [str(name) for name in report.request.stages]}
    return part


def refusal_document(
    key: str, run: str, rollout_id: int, step_id: int | None, reason: str
) -> dict[str, Any]:
    """The result document of a bundle replay refused (integrity, selection, ...)."""
    return {
        **_result_header(key, run, rollout_id, step_id, Verdict.REFUSED),
        "first_divergent_stage": None,
        "first_divergent_rank": None,
        "root_bundle_key": None,
        "selection": None,
        "reason": reason,
        "stages": [],
        "divergences": [],
    }


def _result_header(
    key: str, run: str, rollout_id: int, step_id: int | None, status: str
) -> dict[str, Any]:
    return {
        "result_version": 1,
        "bundle_key": key,
        "run": run,
        "rollout_id": rollout_id,
        "step_id": step_id,
        "trajstore_version": __version__,
        "recorded_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "status": status,
    }


def write_result(store: Any, doc: dict[str, Any], *, name: str | None = None) -> str:
    """Publish one immutable result document (no catalog lock); returns its name.

    With `name`, an existing document of that name is kept (create-if-absent):
    replay-all names results by run and bundle so a retried job records once.
    """
    from trajstore.store.layout import RESULTS_KEY, new_doc_name

    name = name or new_doc_name()
    store.space.create_if_absent(
        f"{RESULTS_KEY}/{name}.json",
        json.dumps(json_safe(doc, finite_only=False), sort_keys=True).encode(),
    )
    return name


def _router_metrics(bundle: Any) -> dict[str, Any] | None:
    """Route metrics recomputed from a routed bundle's payloads (catalog source 'replay')."""
    payloads = bundle.manifest.payloads
    if Payload.ROLLOUT_ROUTED_EXPERTS not in payloads and "router" not in bundle.index.config:
        return None
    from trajstore.errors import TrajstoreError
    from trajstore.router.stage import recompute_router_metrics

    try:
        return recompute_router_metrics(bundle).to_dict()
    except TrajstoreError as exc:
        return {"metric_error": ["missing_route"], "detail": str(exc)}


def record_report(
    store: Any,
    report: ReplayReport,
    sources: list[Any],
    *,
    selection: SelectionRequest | None = None,
) -> list[str]:
    """Write one immutable result document per replayed bundle (no catalog lock)."""
    return [
        write_result(store, result_document(report, src, selection=selection)) for src in sources
    ]
