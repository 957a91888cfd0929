"""Response and request models. Field names are the catalog's column names.

Catalog rows are open models (`extra="allow"`): the documented fields are
typed, and columns added by a later migration pass through unchanged.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorResponse(BaseModel):
    error: str = Field(description="machine-readable code, e.g. not_found, invalid_request")
    detail: Any = Field(description="human-readable message or validation errors")


class Health(BaseModel):
    status: str
    version: str
    runs: int
    generation: int = Field(description="catalog snapshot generation; grows on each applied sync")
    sync_error: str | None = None


class Run(Open):
    run: str
    num_bundles: int
    num_step_bundles: int
    num_rollout_bundles: int
    min_rollout_id: int | None = None
    max_rollout_id: int | None = None
    first_published_at: str | None = None
    last_published_at: str | None = None


class RunList(BaseModel):
    items: list[Run]


class StepItem(Open):
    run: str
    rollout_id: int
    step_id: int
    attempt: int
    num_bundles: int
    ranks: list[int] = []
    bundle_keys: list[str] = []
    status: str | None = None
    first_divergent_stage: str | None = None


class StepPage(BaseModel):
    items: list[StepItem]
    next_cursor: str | None


class PayloadInfo(BaseModel):
    name: str
    dtype: str | None
    shape: list[int] | None
    logical_bytes: int | None
    record: str | None = Field(description="content hash of the payload's array record")
    url: str


class Verdict(Open):
    """The latest recorded replay result: the newest whole replay's, else the newest partial
    one's (its `selection` names the part). Null fields when none."""

    bundle_key: str
    status: str | None = None
    first_divergent_stage: str | None = None
    first_divergent_rank: int | None = None
    root_bundle_key: str | None = None
    recorded_at: str | None = None
    trajstore_version: str | None = None


class GroupSummary(BaseModel):
    semantic_group: str | None
    group_index: int | None
    num_samples: int
    sample_ids: list[str]


class MicroBatchSummary(BaseModel):
    micro_batch_id: str | None
    rank: int | None
    num_samples: int


class SamplesSummary(BaseModel):
    num_samples: int
    num_tokens: int
    num_response_tokens: int
    groups: list[GroupSummary]
    micro_batches: list[MicroBatchSummary]


class BundleBrief(BaseModel):
    key: str
    bundle_id: str | None
    rank: int | None
    attempt: int
    format_version: str | None
    num_samples: int | None
    num_tokens: int | None
    rollout_weight: str | None
    actor_weight: str | None
    published_at: str | None
    capabilities: dict[str, str] = Field(description="stage -> capability, from the manifest")
    payloads: list[PayloadInfo]
    samples_url: str


class StepDetail(BaseModel):
    run: str
    kind: str
    rollout_id: int
    step_id: int | None
    attempt: int
    attempts: list[int]
    ranks: list[int]
    bundles: list[BundleBrief]
    samples: SamplesSummary
    capabilities: dict[str, str] = Field(description="union over ranks (the first rank's wins)")
    rollout_bundle_keys: list[str] = Field(
        description="the linked rollout-level bundle (latest attempt), empty if not stored"
    )
    step_ids: list[int] = Field(description="for a rollout: its stored actor steps")
    latest_verdict: Verdict | None


class BundleDetail(BaseModel):
    bundle: Open
    capabilities: dict[str, str]
    payloads: list[PayloadInfo]
    samples: SamplesSummary
    latest_verdict: Verdict | None


class SampleRow(Open):
    bundle_key: str
    position: int
    sample_id: str
    group_index: int | None = None
    semantic_group: str | None = None
    micro_batch_id: str | None = None
    response_length: int | None = None
    total_length: int | None = None


class SampleList(BaseModel):
    items: list[SampleRow]


class ReplayRequest(BaseModel):
    """The CLI's selectors: exactly one of step, rollout, bundle."""

    model_config = ConfigDict(extra="forbid")

    run: str | None = Field(None, max_length=200, description="default: the store's only run")
    step: str | None = Field(None, max_length=64, description='actor step id "R:S"')
    rollout: int | None = Field(None, ge=0, le=2**63 - 1)
    bundle: str | None = Field(None, max_length=1000, description="a stored bundle key")
    attempt: int | None = Field(None, ge=1, le=2**31 - 1)
    stage: str = Field("all", max_length=1000, description='"all" or a comma list of stages')
    samples: list[str] = Field([], max_length=10000)
    groups: list[str] = Field([], max_length=10000)
    batches: list[str] = Field([], max_length=10000)
    link: bool = Field(True, description="link a step to its stored rollout bundle")
    record: bool = Field(False, description="store the result (needs the token, or loopback)")


class ReplayResponse(BaseModel):
    exit_code: int
    recorded: list[str] = Field(description="names of the result documents written")
    report: dict[str, Any]


class Page(BaseModel):
    items: list[Open]
    next_cursor: str | None


class RunSummary(BaseModel):
    """A run at a glance: its steps by latest verdict, where they diverged first, bytes."""

    run: str
    steps: int = Field(description="actor steps (latest attempt)")
    by_status: dict[str, int] = Field(
        description="pass, diverged, unsupported, refused, unreplayed"
    )
    first_divergent_stage_histogram: dict[str, int]
    bundles: int
    logical_bytes: int
    physical_bytes: int | None = Field(
        description="bytes the run's bundles added to the store at ingest (objects already "
        "stored count for the bundle that stored them); null: not recorded (bundles "
        "ingested before trajstore recorded it)"
    )
    dedup_ratio: float | None = Field(description="logical / physical; null when unknown")


class StripBin(Open):
    rollout_from: int
    rollout_to: int
    steps: int
    worst: str = Field(description="the bin's worst status (refused > diverged > ... > pass)")


class Strip(BaseModel):
    run: str
    rollout_from: int | None
    rollout_to: int | None
    bin_width: int | None
    first_bad_rollout: int | None = Field(description="lowest rollout with a diverged step")
    bins: list[StripBin] = Field(description="only bins holding steps")


class StepResult(BaseModel):
    """The step's latest recorded result in full: stages with reasons, divergences."""

    result: Open
    stages: list[Open]
    divergences: list[Open]
    divergences_truncated: bool


class RouterComparison(Open):
    """`trajstore router compare --format json` over a window of steps, plus a cursor."""

    runs: list[str]
    steps: list[dict[str, Any]]
    next_cursor: str | None


class DiffResponse(BaseModel):
    same: bool
    reports: list[dict[str, Any]] = Field(description="`trajstore diff --json`, one per rank")
