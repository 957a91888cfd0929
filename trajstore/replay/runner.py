"""Run the stage DAG over one bundle, or every rank of a cohort.

First divergent stage = the first *requested* stage that failed (or that was
explicitly requested and is unsupported). Skipped stages never count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trajstore.errors import SelectionError, UsageError
from trajstore.replay.compare import json_number
from trajstore.replay.selection import Selection, SelectionRequest, select
from trajstore.replay.source import BundleSource
from trajstore.replay.stages import (
    STAGE_ORDER,
    STAGES,
    ReplayContext,
    StageInputError,
    StageOutcome,
    capability,
)


@dataclass(frozen=True)
class StageRequest:
    """Which stages count. ``explicit`` False means ``--stage all``."""

    stages: tuple[str, ...] = STAGE_ORDER
    explicit: bool = False

    @classmethod
    def parse(cls, text: str | None) -> StageRequest:
        if text is None or text.strip() in ("", "all"):
            return cls()
        names = tuple(s.strip() for s in text.split(",") if s.strip())
        unknown = [s for s in names if s not in STAGES]
        if unknown:
            raise UsageError(
                f"unknown stage(s) {', '.join(unknown)}; stages: all, {', '.join(STAGE_ORDER)}"
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

    @property
    def first_divergent_stage(self) -> str | None:
        for s in self.stages:
            if s.requested and s.status in ("fail", "unsupported"):
                return s.stage
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
            "first_divergent_stage": self.first_divergent_stage,
            "stages": [s.to_dict() for s in self.stages],
        }


@dataclass
class Linkage:
    """The rollout -> step check of one stored step's replay (docs/cli.md, `replay`).

    A step consumed advantages derived from its rollout's rewards whatever
    stages its producer declared; this says whether those advantages match the
    ones the rollout bundle's recomputed rewards give, or why that was not checked.
    """

    status: str  # pass | fail | skipped
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
            "status": self.status,
            "reason": self.reason,
            "rollout_bundle_key": self.rollout_bundle_key,
            "rollout_bundle_id": self.rollout_bundle_id,
            "rollout_first_divergent_stage": self.rollout_first_divergent_stage,
            "samples_checked": self.samples_checked,
            "mismatch_count": self.mismatch_count,
            "max_abs_error": json_number(self.max_abs_error),
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
        for b in self.bundles:
            s = b.first_divergent_stage
            if s is not None and (
                best is None or STAGE_ORDER.index(s) < STAGE_ORDER.index(best.first_divergent_stage)
            ):
                best = b
        return best

    @property
    def first_divergent_stage(self) -> str | None:
        f = self.first
        if f is None:
            return None
        return self.root_stage or f.first_divergent_stage

    @property
    def first_divergent_rank(self) -> int | None:
        f = self.first
        return None if f is None else f.rank

    @property
    def status(self) -> str:
        f = self.first
        if f is None:
            return "pass"
        outcome = next(s for s in f.stages if s.stage == f.first_divergent_stage)
        return "unsupported" if outcome.status == "unsupported" else "diverged"

    @property
    def exit_code(self) -> int:
        return 0 if self.first is None else 1

    def first_divergence(self) -> dict[str, Any] | None:
        f = self.first
        if f is None:
            return None
        outcome = next(s for s in f.stages if s.stage == f.first_divergent_stage)
        d = outcome.divergences[0] if outcome.divergences else None
        return {
            "stage": self.root_stage or outcome.stage,
            "bundle_key": self.root_bundle_key or f.bundle_key,
            "downstream_stage": outcome.stage if self.root_stage else None,
            "rank": f.rank,
            "sample_id": d.sample_id if d else None,
            "field": d.field if d else None,
            "token_offset": d.token_offset if d else None,
            "max_abs_error": json_number(outcome.max_abs_error),
            "mismatch_count": outcome.mismatch_count,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "status": self.status,
            "first_divergent_stage": self.first_divergent_stage,
            "first_divergent_rank": self.first_divergent_rank,
            "first_divergence": self.first_divergence(),
            "root_bundle_key": self.root_bundle_key,
            "root_stage": self.root_stage,
            "requested_stages": list(self.request.stages) if self.request.explicit else "all",
            "selection": self.selection.describe(),
            "bundles": [b.to_dict() for b in self.bundles],
            **({} if self.linkage is None else {"linkage": self.linkage.to_dict()}),
            **self.extra,
        }


def replay_bundle(
    source: BundleSource,
    *,
    request: StageRequest | None = None,
    selection: Selection | None = None,
    upstream: dict[str, np.ndarray] | None = None,
) -> BundleReport:
    """Replay one bundle; stages after the last requested one do not run."""
    request = request or StageRequest()
    selection = selection or Selection(None, False)
    ctx = ReplayContext(source, selection, upstream)
    wanted = set(request.stages)
    last = max(STAGE_ORDER.index(s) for s in wanted)
    outcomes: list[StageOutcome] = []
    for i, name in enumerate(STAGE_ORDER):
        requested = name in wanted
        if i > last:
            outcomes.append(StageOutcome(name, "skipped", "not requested", requested=False))
            continue
        cap, why = capability(source, name)
        if cap == "unsupported":
            explicit = request.explicit and requested
            status = "unsupported" if explicit else "skipped"
            outcomes.append(StageOutcome(name, status, f"unsupported: {why}", requested=explicit))
            continue
        if cap == "skipped":
            outcomes.append(StageOutcome(name, "skipped", why, requested=False))
            continue
        stage = STAGES[name]
        if stage.cohort_level and selection.partial:
            # Asked for by name, it cannot be honoured: say so (exit 1), never a silent pass.
            explicit = request.explicit and requested
            outcomes.append(
                StageOutcome(
                    name,
                    "unsupported" if explicit else "skipped",
                    "cohort-level stage is not replayable under a partial selection",
                    requested=explicit,
                )
            )
            continue
        try:
            out = stage.run(ctx)
        except StageInputError as exc:
            out = StageOutcome(name, "fail", str(exc))
        out.requested = requested
        outcomes.append(out)
    for out in outcomes:
        out.version = STAGES[out.stage].version
    return BundleReport(
        source.label,
        source.manifest.bundle_id,
        source.rank,
        outcomes,
        selection,
        bundle_key=getattr(source, "bundle_key", None),
        recomputed=ctx.recomputed,
        sample_ids=ctx.sample_ids,
    )


def replay_sources(
    sources: list[BundleSource],
    *,
    label: str,
    request: StageRequest | None = None,
    selection: SelectionRequest | None = None,
    upstream: list[dict[str, np.ndarray] | None] | None = None,
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
                src, request=request, selection=sel, upstream=(upstream or [None] * len(sources))[i]
            )
        )
    if not found_any:
        raise SelectionError(f"selection {selection.describe()} matches no sample in {label}")
    if len(sources) > 1:
        _check_cohort_selection(sources, selection, label)
    return ReplayReport(label, reports, request, selection)


def _check_cohort_selection(
    sources: list[BundleSource], request: SelectionRequest, label: str
) -> None:
    ids = {s.sample_id for src in sources for s in src.index.samples}
    groups = {
        f"g-{s.group_index}"
        for src in sources
        for s in src.index.samples
        if s.group_index is not None
    }
    batches = {s.micro_batch_id for src in sources for s in src.index.samples}
    missing = [f"sample {x}" for x in request.samples if x not in ids]
    missing += [f"group {x}" for x in request.groups if x not in groups]
    missing += [f"micro-batch {x}" for x in request.batches if x not in batches]
    if missing:
        raise SelectionError(f"{', '.join(missing)} not found in {label}")
