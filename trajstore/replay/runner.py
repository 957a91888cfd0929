"""Run the stage DAG over one bundle, or every rank of a cohort.

First divergent stage = the first *requested* stage that failed (or that was
explicitly requested and is unsupported). Skipped stages never count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trajstore.errors import SelectionError, UsageError
from trajstore.jsonio import json_safe
from trajstore.replay import builtin
from trajstore.replay.compare import Comparison
from trajstore.replay.context import ReplayContext, StageInputError, StageMemo, StageOutcome
from trajstore.replay.registry import StageDef, registered_stages, resolve_stage, stage_names
from trajstore.replay.selection import Selection, SelectionRequest, not_found, select
from trajstore.replay.source import BundleSource
from trajstore.vocab import STAGE_ORDER, Capability, StageStatus, Verdict

#: every built-in stage is registered before the runner reads the registry
BUILTIN_STAGE_MODULES = builtin.STAGE_MODULES
#: a stage that is not run because no later stage was requested
NOT_REQUESTED = "not requested"


def _plain(name: str | None) -> str | None:
    """A vocabulary member as the plain string JSON documents carry."""
    return None if name is None else str(name)


@dataclass(frozen=True)
class StageRequest:
    """Which stages count. ``explicit`` False means ``--stage all``."""

    stages: tuple[str, ...] = STAGE_ORDER
    explicit: bool = False

    @classmethod
    def parse(cls, text: str | None) -> StageRequest:
        if text is None or text.strip() in ("", "all"):
            return cls()
        names = tuple(name.strip() for name in text.split(",") if name.strip())
        known = stage_names()
        if not names:
            raise UsageError(f"no stage named in {text!r}; stages: all, {', '.join(known)}")
        unknown = [name for name in names if name not in known]
        if unknown:
            raise UsageError(
                f"unknown stage(s) {', '.join(unknown)}; stages: all, {', '.join(known)}"
            )
        return cls(names, True)


@dataclass
class BundleReport:
    label: str
    bundle_id: str
    rank: int | None
    stages: list[StageOutcome]
    selection: Selection
    bundle_key: str | None = None
    #: outputs recomputed by the stages, by name, over the selected samples (not serialized)
    recomputed: dict[str, Any] = field(default_factory=dict, repr=False)
    sample_ids: list[str] = field(default_factory=list, repr=False)
    #: `ReplayContext.upstream_comparison` of this replay (not serialized)
    upstream_comparison: tuple[Any, Comparison] | None = field(default=None, repr=False)

    def outcome(self, stage: str) -> StageOutcome:
        """This bundle's outcome of ``stage``."""
        return next(outcome for outcome in self.stages if outcome.stage == stage)

    @property
    def first_divergent_stage(self) -> str | None:
        for outcome in self.stages:
            if outcome.requested and outcome.status in (
                StageStatus.FAIL,
                StageStatus.UNSUPPORTED,
            ):
                return outcome.stage
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "bundle_id": self.bundle_id,
            "bundle_key": self.bundle_key,
            "rank": self.rank,
            "partial": self.selection.partial,
            "selected_samples": None
            if self.selection.positions is None
            else len(self.selection.positions),
            "closure_added": self.selection.closure_added,
            "first_divergent_stage": _plain(self.first_divergent_stage),
            "stages": [outcome.to_dict() for outcome in self.stages],
        }


@dataclass
class Linkage:
    """The rollout -> step check of one stored step's replay (docs/cli.md, `replay`).

    A step consumed advantages derived from its rollout's rewards whatever
    stages its producer declared; this says whether those advantages match the
    ones the rollout bundle's recomputed rewards give, or why that was not checked.
    """

    status: StageStatus  # pass | fail | skipped
    reason: str
    rollout_bundle_key: str | None = None
    rollout_bundle_id: str | None = None
    #: the rollout's own first divergent stage (None: it replays clean)
    rollout_first_divergent_stage: str | None = None
    samples_checked: int = 0
    mismatch_count: int = 0
    max_abs_error: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": str(self.status),
            "reason": self.reason,
            "rollout_bundle_key": self.rollout_bundle_key,
            "rollout_bundle_id": self.rollout_bundle_id,
            "rollout_first_divergent_stage": _plain(self.rollout_first_divergent_stage),
            "samples_checked": self.samples_checked,
            "mismatch_count": self.mismatch_count,
            "max_abs_error": json_safe(self.max_abs_error),
        }


@dataclass
class ReplayReport:
    """One verdict over every rank replayed."""

    label: str
    bundles: list[BundleReport]
    request: StageRequest
    selection: SelectionRequest = field(default_factory=SelectionRequest)
    #: set when the first divergence is rooted in another bundle (rollout -> step linkage)
    root_bundle_key: str | None = None
    #: the upstream bundle's first divergent stage when the divergence is rooted there
    root_stage: str | None = None
    #: the rollout -> step check (stored steps only; None where it does not apply)
    linkage: Linkage | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def first(self) -> BundleReport | None:
        """The rank whose first divergence comes earliest in the stage chain."""
        best = None
        for bundle in self.bundles:
            stage = bundle.first_divergent_stage
            if stage is not None and (
                best is None
                or STAGE_ORDER.index(stage) < STAGE_ORDER.index(best.first_divergent_stage)
            ):
                best = bundle
        return best

    @property
    def first_divergent_stage(self) -> str | None:
        first = self.first
        if first is None:
            return None
        return self.root_stage or first.first_divergent_stage

    @property
    def first_divergent_rank(self) -> int | None:
        first = self.first
        return None if first is None else first.rank

    @property
    def status(self) -> Verdict:
        first = self.first
        if first is None:
            return Verdict.PASS
        outcome = first.outcome(first.first_divergent_stage)
        return (
            Verdict.UNSUPPORTED if outcome.status == StageStatus.UNSUPPORTED else Verdict.DIVERGED
        )

    @property
    def exit_code(self) -> int:
        return 0 if self.first is None else 1

    def first_divergence(self) -> dict[str, Any] | None:
        first = self.first
        if first is None:
            return None
        outcome = first.outcome(first.first_divergent_stage)
        example = outcome.divergences[0] if outcome.divergences else None
        return {
            "stage": str(self.root_stage or outcome.stage),
            "bundle_key": self.root_bundle_key or first.bundle_key,
            "downstream_stage": str(outcome.stage) if self.root_stage else None,
            "rank": first.rank,
            "sample_id": example.sample_id if example else None,
            "field": example.field if example else None,
            "token_offset": example.token_offset if example else None,
            "max_abs_error": json_safe(outcome.max_abs_error),
            "mismatch_count": outcome.mismatch_count,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "status": str(self.status),
            "first_divergent_stage": _plain(self.first_divergent_stage),
            "first_divergent_rank": self.first_divergent_rank,
            "first_divergence": self.first_divergence(),
            "root_bundle_key": self.root_bundle_key,
            "root_stage": _plain(self.root_stage),
            "requested_stages": [str(name) for name in self.request.stages]
            if self.request.explicit
            else "all",
            "selection": self.selection.describe(),
            "bundles": [bundle.to_dict() for bundle in self.bundles],
            **({} if self.linkage is None else {"linkage": self.linkage.to_dict()}),
            **self.extra,
        }


def replay_bundle(
    source: BundleSource,
    *,
    request: StageRequest | None = None,
    selection: Selection | None = None,
    upstream: dict[str, np.ndarray] | None = None,
    memo: StageMemo | None = None,
) -> BundleReport:
    """Replay one bundle; stages after the last requested one do not run.

    `memo`: stage outcomes shared with the replays of other bundles (`StageMemo`)."""
    request = request or StageRequest()
    selection = selection or Selection(None, False)
    ctx = ReplayContext(source, selection, upstream, memo)
    wanted = set(request.stages)
    last = max(STAGE_ORDER.index(name) for name in wanted)
    outcomes: list[StageOutcome] = []
    for registered in registered_stages():
        stage = resolve_stage(registered, source)
        name = stage.name
        requested = name in wanted
        explicit = request.explicit and requested
        if STAGE_ORDER.index(name) > last:
            outcome = StageOutcome(
                stage=name, status=StageStatus.SKIPPED, reason=NOT_REQUESTED, requested=False
            )
        else:
            outcome = _run_stage(stage, ctx, requested=requested, explicit=explicit)
        outcome.version = stage.version
        outcomes.append(outcome)
    return BundleReport(
        label=source.label,
        bundle_id=source.manifest.bundle_id,
        rank=source.rank,
        stages=outcomes,
        selection=selection,
        bundle_key=getattr(source, "bundle_key", None),
        recomputed=ctx.recomputed,
        sample_ids=ctx.sample_ids,
        upstream_comparison=ctx.upstream_comparison,
    )


def _run_stage(
    stage: StageDef, ctx: ReplayContext, *, requested: bool, explicit: bool
) -> StageOutcome:
    """One stage's outcome: refused by its capability or the selection, or run."""
    name = stage.name
    capability, why = stage.capability(ctx.source)
    if capability == Capability.UNSUPPORTED:
        return StageOutcome(
            stage=name,
            status=StageStatus.UNSUPPORTED if explicit else StageStatus.SKIPPED,
            reason=f"unsupported: {why}",
            requested=explicit,
        )
    if capability == Capability.SKIPPED:
        # Named in --stage, a stage that does not run here is not a pass: say why (exit 1).
        return StageOutcome(
            stage=name,
            status=StageStatus.UNSUPPORTED if explicit else StageStatus.SKIPPED,
            reason=f"not replayable on this bundle: {why}" if explicit else why,
            requested=explicit,
        )
    if stage.cohort_level and ctx.partial:
        # Asked for by name, it cannot be honoured: say so (exit 1), never a silent pass.
        return StageOutcome(
            stage=name,
            status=StageStatus.UNSUPPORTED if explicit else StageStatus.SKIPPED,
            reason="cohort-level stage is not replayable under a partial selection",
            requested=explicit,
        )
    try:
        outcome = stage.run(ctx)
    except StageInputError as exc:
        outcome = StageOutcome(stage=name, status=StageStatus.FAIL, reason=str(exc))
    outcome.requested = requested
    return outcome


def replay_sources(
    sources: list[BundleSource],
    *,
    label: str,
    request: StageRequest | None = None,
    selection: SelectionRequest | None = None,
    upstream: list[dict[str, np.ndarray] | None] | None = None,
    memo: StageMemo | None = None,
) -> ReplayReport:
    """Replay every rank of a target and give one verdict naming the rank."""
    request = request or StageRequest()
    selection = selection or SelectionRequest()
    reports = []
    found_any = False
    for i, src in enumerate(sources):
        sel = select(src.index, selection, strict=len(sources) == 1)
        if sel is None:
            continue
        found_any = True
        reports.append(
            replay_bundle(
                src,
                request=request,
                selection=sel,
                upstream=(upstream or [None] * len(sources))[i],
                memo=memo,
            )
        )
    if not found_any:  # no rank holds any id asked for
        asked = [("sample", x) for x in selection.samples]
        asked += [("group", x) for x in selection.groups]
        asked += [("micro-batch", x) for x in selection.batches]
        raise SelectionError(
            not_found(asked, (s for src in sources for s in src.index.samples), label)
        )
    if len(sources) > 1:
        _check_cohort_selection(sources, selection, label)
    return ReplayReport(label, reports, request, selection)


def _check_cohort_selection(
    sources: list[BundleSource], request: SelectionRequest, label: str
) -> None:
    samples = [s for src in sources for s in src.index.samples]
    ids = {s.sample_id for s in samples}
    groups = {f"g-{s.group_index}" for s in samples if s.group_index is not None}
    batches = {s.micro_batch_id for s in samples}
    missing = [("sample", x) for x in request.samples if x not in ids]
    missing += [("group", x) for x in request.groups if x not in groups]
    missing += [("micro-batch", x) for x in request.batches if x not in batches]
    if missing:
        raise SelectionError(not_found(missing, samples, label))
