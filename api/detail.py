"""Response bodies built from the catalog snapshot, shared by the step and bundle routes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from trajstore.jsonio import json_safe
from trajstore.store.layout import anchor_label

from . import models
from .errors import ApiError
from .snapshot import View
from .state import AppState


def bundle_url(key: str) -> str:
    return "/v1/bundles/" + quote(key, safe="/")


def payload_infos(view: View, key: str) -> list[models.PayloadInfo]:
    return [
        models.PayloadInfo(
            name=payload["name"],
            dtype=payload["dtype"],
            shape=payload["shape"],
            logical_bytes=payload["logical_bytes"],
            record=payload["record"],
            url=f"{bundle_url(key)}/payloads/{quote(payload['name'], safe='')}",
        )
        for _, payload in sorted(view.payloads.get(key, {}).items())
    ]


def _none_first(key: tuple) -> tuple:
    """Sort key putting None before any value, element by element."""
    return tuple((part is None, part) for part in key)


def samples_summary(view: View, rows: list[dict[str, Any]]) -> models.SamplesSummary:
    """Counts, groups and micro-batches over the samples of ``rows``' bundles."""
    groups: dict[tuple, list[str]] = {}
    micro_batches: dict[tuple, int] = {}
    num_samples = num_tokens = num_response_tokens = 0
    digests = view.sample_digests([row["key"] for row in rows])
    for row in rows:
        digest = digests.get(row["key"])
        if digest is None:  # a bundle with no sample rows
            continue
        num_samples += digest.num_samples
        num_tokens += digest.num_tokens
        num_response_tokens += digest.num_response_tokens
        for group, sample_ids in digest.groups.items():
            groups.setdefault(group, []).extend(sample_ids)
        for (micro_batch_id, sample_rank), count in digest.micro_batches.items():
            micro_batch = (micro_batch_id, row["rank"] if sample_rank is None else sample_rank)
            micro_batches[micro_batch] = micro_batches.get(micro_batch, 0) + count
    return models.SamplesSummary(
        num_samples=num_samples,
        num_tokens=num_tokens,
        num_response_tokens=num_response_tokens,
        groups=[
            models.GroupSummary(
                semantic_group=group,
                group_index=index,
                num_samples=len(sample_ids),
                sample_ids=sample_ids,
            )
            for (group, index), sample_ids in sorted(
                groups.items(), key=lambda item: _none_first(item[0])
            )
        ],
        micro_batches=[
            models.MicroBatchSummary(micro_batch_id=micro_batch, rank=rank, num_samples=count)
            for (micro_batch, rank), count in sorted(
                micro_batches.items(), key=lambda item: _none_first(item[0])
            )
        ],
    )


def latest_verdict(view: View, keys: list[str]) -> models.Verdict | None:
    """The latest replay result over ``keys``' bundles: the newest whole replay's, else
    the newest partial one's (catalog.queries.whole_first)."""
    results = [view.latest_result[key] for key in keys if key in view.latest_result]
    if not results:
        return None
    latest = max(
        results,
        key=lambda result: (result["selection"] is None, result["recorded_at"] or "", result["id"]),
    )
    return models.Verdict(**json_safe(latest))


def check_run(view: View, run: str, known: Sequence[str] | None = None) -> None:
    """404 unless `run` has visible bundles (or is one of `known`, when given)."""
    runs = view.runs if known is None else known
    if run not in runs:
        raise ApiError(404, "not_found", f"no run {run!r} (runs: {list(runs)[:20]})")


def check_range(rollout_from: int | None, rollout_to: int | None) -> None:
    if rollout_from is not None and rollout_to is not None and rollout_from > rollout_to:
        raise ApiError(
            400, "bad_filter", f"rollout_from ({rollout_from}) > rollout_to ({rollout_to})"
        )


def known_bundle(view: View, key: str) -> dict[str, Any]:
    """The catalog row of a published, visible bundle; 404 otherwise."""
    row = view.visible(key)
    if row is None:
        raise ApiError(404, "not_found", f"no published bundle {key[:200]!r}")
    return row


def group_detail(
    state: AppState,
    run: str,
    kind: str,
    rollout_id: int,
    step_id: int | None,
    attempt: int | None,
) -> models.StepDetail:
    """One actor step or rollout (all its ranks' bundles of one attempt)."""
    view = state.view
    check_run(view, run)
    rows, attempts = view.group(run, kind, rollout_id, step_id, attempt)
    what = anchor_label(kind, rollout_id, step_id)
    if not rows:
        extra = f" attempt {attempt} (attempts: {attempts})" if attempts else ""
        raise ApiError(404, "not_found", f"run {run!r} has no {what}{extra}")
    capabilities: dict[str, str] = {}
    briefs = []
    for row in rows:
        row_capabilities = state.capabilities(row)
        for stage, capability in row_capabilities.items():
            capabilities.setdefault(stage, capability)
        briefs.append(
            models.BundleBrief(
                key=row["key"],
                bundle_id=row["bundle_id"],
                rank=row["rank"],
                attempt=row["attempt"],
                format_version=row["format_version"],
                num_samples=row["num_samples"],
                num_tokens=row["num_tokens"],
                rollout_weight=row["rollout_weight"],
                actor_weight=row["actor_weight"],
                published_at=row["published_at"],
                capabilities=row_capabilities,
                payloads=payload_infos(view, row["key"]),
                samples_url=f"{bundle_url(row['key'])}/samples",
            )
        )
    linked: list[str] = []
    step_ids: list[int] = []
    if kind == "step":
        linked = [row["key"] for row in view.group(run, "rollout", rollout_id, None, None)[0]]
    else:
        step_ids = view.steps_of_rollout.get((run, rollout_id), [])
    return models.StepDetail(
        run=run,
        kind=kind,
        rollout_id=rollout_id,
        step_id=step_id,
        attempt=rows[0]["attempt"],
        attempts=attempts,
        ranks=[row["rank"] for row in rows if row["rank"] is not None],
        bundles=briefs,
        samples=samples_summary(view, rows),
        capabilities=capabilities,
        rollout_bundle_keys=linked,
        step_ids=step_ids,
        latest_verdict=latest_verdict(view, [row["key"] for row in rows]),
    )
