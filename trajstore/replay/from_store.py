"""Replay straight from the store, with rollout -> step linkage and recording.

A step-level bundle consumes samples of its rollout's rollout-level bundle.
When both are stored, the rollout bundle is replayed first and its
*recomputed* rewards feed the step's advantage stage for the samples the step
consumed; a divergence that starts in the rollout is then reported as rooted
there, with the step's stages marked downstream of it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import numpy as np

from trajstore import __version__
from trajstore.errors import NotFoundError, UsageError
from trajstore.replay.runner import ReplayReport, StageRequest, replay_sources
from trajstore.replay.selection import SelectionRequest

#: rollout stages whose outputs a step bundle consumes
FEEDS_STEPS = ("reward.raw", "reward.post_process")
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
        raise NotFoundError(f"{store.root}: the store holds no bundles")
    raise UsageError(f"the store holds runs {', '.join(runs)}; pick one with --run")


def stored_sources(store: Any, target: Target) -> list[Any]:
    if sum(x is not None for x in (target.step, target.rollout, target.bundle_key)) != 1:
        raise UsageError("name exactly one of --step R:S, --rollout R, --bundle KEY")
    if target.bundle_key:
        return [store.bundle(target.bundle_key)]
    run = resolve_run(store, target.run)
    if target.step is not None:
        return store.step(run, *target.step, attempt=target.attempt)
    return store.rollout(run, target.rollout, attempt=target.attempt)


def _upstream_rewards(rollout_report: ReplayReport) -> dict[str, float]:
    """sample_id -> recomputed post-processed reward, from a rollout replay."""
    out: dict[str, float] = {}
    for b in rollout_report.bundles:
        rewards = b.recomputed.get("rewards")
        if rewards is None:
            continue
        out.update(
            {
                sid: float(r)
                for sid, r in zip(b.sample_ids, np.asarray(rewards).tolist(), strict=True)
            }
        )
    return out


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
    plus the rollout linkage when the rollout bundle is stored too.

    ``rollout_cache`` (rollout bundle keys -> report) lets a caller replaying many
    steps of one rollout replay that rollout once; it is kept to a few entries.
    """
    sources = stored_sources(store, target)
    first = sources[0]
    kind = first.index.identity.kind
    label = first.bundle_id if len(sources) == 1 else f"{first.bundle_id} ({len(sources)} ranks)"
    upstream = None
    rollout_report = None
    if link and kind == "step":
        run = first.ref["run"]
        try:
            rollout_sources = store.rollout(run, first.index.identity.rollout_id)
        except NotFoundError:
            rollout_sources = []
        if rollout_sources:
            cache_key = tuple(src.bundle_key for src in rollout_sources)
            rollout_report = None if rollout_cache is None else rollout_cache.get(cache_key)
            if rollout_report is None:
                rollout_report = replay_sources(rollout_sources, label=rollout_sources[0].bundle_id)
                if rollout_cache is not None:
                    while len(rollout_cache) >= ROLLOUT_CACHE_SIZE:
                        rollout_cache.pop(next(iter(rollout_cache)))
                    rollout_cache[cache_key] = rollout_report
            rewards = _upstream_rewards(rollout_report)
            if rewards:
                upstream = []
                for src in sources:
                    ids = [s.sample_id for s in src.index.samples]
                    if all(i in rewards for i in ids):
                        upstream.append({"rewards_by_id": rewards})
                    else:
                        upstream.append(None)
    report = replay_sources(
        sources, label=label, request=request, selection=selection, upstream=upstream
    )
    if rollout_report is not None and report.first is not None:
        root = rollout_report.first_divergent_stage
        if root in FEEDS_STEPS:
            report.root_bundle_key = rollout_report.first.bundle_key
            report.root_stage = root
    return report


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
        **_result_header(bundle.bundle_key, ref["run"], ref["rollout_id"], ref.get("step_id"), report.status),
        "first_divergent_stage": report.first_divergent_stage,
        "first_divergent_rank": report.first_divergent_rank,
        "root_bundle_key": report.root_bundle_key,
        "selection": None if selection is None or selection.empty else selection.describe(),
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


def refusal_document(key: str, run: str, rollout_id: int, step_id: int | None, reason: str) -> dict[str, Any]:
    """The result document of a bundle replay refused (integrity, selection, ...)."""
    return {
        **_result_header(key, run, rollout_id, step_id, "refused"),
        "first_divergent_stage": None,
        "first_divergent_rank": None,
        "root_bundle_key": None,
        "selection": None,
        "reason": reason,
        "stages": [],
        "divergences": [],
    }


def _result_header(key: str, run: str, rollout_id: int, step_id: int | None, status: str) -> dict[str, Any]:
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


def write_result(store: Any, doc: dict[str, Any]) -> str:
    """Publish one immutable result document (no catalog lock); returns its name."""
    from trajstore.store.layout import atomic_create, new_doc_name

    name = new_doc_name()
    atomic_create(
        store.layout.results / f"{name}.json",
        json.dumps(doc, sort_keys=True, default=_json_default).encode(),
        durable=store.durable,
    )
    return name


def _router_metrics(bundle: Any) -> dict[str, Any] | None:
    """Route metrics recomputed from a routed bundle's payloads (catalog source 'replay')."""
    if "rollout_routed_experts" not in bundle.manifest.payloads and "router" not in bundle.index.config:
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
    return [write_result(store, result_document(report, src, selection=selection)) for src in sources]


def _json_default(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")
