"""Run-level aggregates for browsing a run: verdict counts, a binned strip, one result.

Why a module beside `queries`: these answer "what does this run look like at a
glance" for the web view (docs/web.md) and return a bounded amount of data
however many steps the run holds (counts per status, at most MAX_STRIP_BINS
bins, at most MAX_DIVERGENCES divergence rows), so a page over a
10,000-step run never fetches every step. They reuse the listing's notion of
a step (latest attempt) and of its verdict (latest recorded result).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from trajstore.catalog import tables
from trajstore.catalog.db import Catalog
from trajstore.catalog.queries import _row, stats
from trajstore.catalog.statements import check_rollout_range, step_verdicts
from trajstore.errors import UsageError
from trajstore.vocab import STEP_STATUSES, UNREPLAYED, Verdict

MAX_STRIP_BINS = 2000
MAX_DIVERGENCES = 1000
#: a bin's colour is its worst status, in this order (worst first)
STATUS_SEVERITY: tuple[str, ...] = (
    Verdict.REFUSED.value,
    Verdict.DIVERGED.value,
    Verdict.UNSUPPORTED.value,
    UNREPLAYED,
    Verdict.PASS.value,
)


#: (rollout_id, status, first_divergent_stage, n: step count), a row per rollout and verdict
VerdictRows = list[tuple[int, str, str | None, int]]


def verdict_rows(
    catalog: Catalog, run: str, rollout_from: int | None = None, rollout_to: int | None = None
) -> VerdictRows:
    """`step_verdicts`' rows as plain tuples (rollout_id, status, first_divergent_stage, n).

    A row per rollout (and status and stage): tens of thousands on a 100,000-step run, where
    making each a dict of JSON values (`executor`) was most of the summary's and the strip's
    time (~0.3 s each; the values are ints and strings already). The whole run's rows answer
    both the summary and any strip (`rows=`), so a server reads them once per catalog
    generation rather than once for each (~0.15 s apiece at 100,000 steps)."""
    text, params = step_verdicts(run, rollout_from, rollout_to)
    with catalog.connect() as conn:
        return [tuple(row) for row in conn.execute(sa.text(text), params)]


def run_summary(catalog: Catalog, run: str, *, rows: VerdictRows | None = None) -> dict[str, Any]:
    """Steps of a run by verdict, the first-divergent-stage histogram, bytes and dedup.
    ``rows``: the run's `verdict_rows`, when the caller has them already."""
    by_status = dict.fromkeys(STEP_STATUSES, 0)
    histogram: dict[str, int] = {}
    for _, status, stage, n in verdict_rows(catalog, run) if rows is None else rows:
        by_status[status] = by_status.get(status, 0) + n
        if stage:
            histogram[stage] = histogram.get(stage, 0) + n
    sizes = stats(catalog, run=run)
    # physical: what the run's bundles added to the store (null: not recorded at ingest)
    logical, physical = sizes["logical_bytes"], sizes["physical_bytes"]
    return {
        "run": run,
        "steps": sum(by_status.values()),
        "by_status": by_status,
        "first_divergent_stage_histogram": dict(sorted(histogram.items())),
        "bundles": sizes["bundles"],
        "logical_bytes": logical,
        "physical_bytes": physical,
        "dedup_ratio": round(logical / physical, 3) if physical else None,
    }


def step_strip(
    catalog: Catalog,
    run: str,
    *,
    rollout_from: int | None = None,
    rollout_to: int | None = None,
    bins: int = 400,
    rows: VerdictRows | None = None,
) -> dict[str, Any]:
    """The run over rollout id in at most ``bins`` equal-width bins of step counts per status.

    Each bin carries its worst status (STATUS_SEVERITY), so a chart can colour
    it by one verdict; ``first_bad_rollout`` is the lowest rollout with a
    diverged or refused step in range (null when none). ``rows``: the whole run's
    `verdict_rows`, when the caller has them (the range is then applied here: a row is
    one rollout's, so keeping those in range is what the ranged query returns).
    """
    if isinstance(bins, bool) or not 1 <= bins <= MAX_STRIP_BINS:
        raise UsageError(f"bins must be 1..{MAX_STRIP_BINS}, got {bins!r}")
    if rows is None:
        rows = verdict_rows(catalog, run, rollout_from, rollout_to)
    else:
        check_rollout_range(rollout_from, rollout_to)
        rows = [
            row
            for row in rows
            if (rollout_from is None or row[0] >= rollout_from)
            and (rollout_to is None or row[0] <= rollout_to)
        ]
    out: dict[str, Any] = {"run": run, "bins": [], "first_bad_rollout": None}
    if not rows:
        out.update(rollout_from=rollout_from, rollout_to=rollout_to, bin_width=None)
        return out
    lo = min(row[0] for row in rows) if rollout_from is None else rollout_from
    hi = max(row[0] for row in rows) if rollout_to is None else rollout_to
    width = -(-(hi - lo + 1) // bins)  # ceil: every rollout in exactly one bin
    counts: dict[int, dict[str, int]] = {}
    bad = (Verdict.DIVERGED.value, Verdict.REFUSED.value)
    for rollout_id, status, _, n in rows:
        index = (rollout_id - lo) // width
        cell = counts.setdefault(index, dict.fromkeys(STEP_STATUSES, 0))
        cell[status] = cell.get(status, 0) + n
        if status in bad and (
            out["first_bad_rollout"] is None or rollout_id < out["first_bad_rollout"]
        ):
            out["first_bad_rollout"] = rollout_id
    for index in sorted(counts):
        cell = counts[index]
        start = lo + index * width
        worst = next(status for status in STATUS_SEVERITY if cell.get(status))
        out["bins"].append(
            {
                "rollout_from": start,
                "rollout_to": min(start + width - 1, hi),
                "steps": sum(cell.values()),
                "worst": worst,
                **cell,
            }
        )
    out.update(rollout_from=lo, rollout_to=hi, bin_width=width)
    return out


def result_detail(
    catalog: Catalog, result_id: int, *, max_divergences: int = MAX_DIVERGENCES
) -> dict[str, Any] | None:
    """One recorded result: its row, per-stage verdicts with reasons, its divergences."""
    results, stage_rows, divergences = (
        tables.replay_results,
        tables.stage_results,
        tables.divergences,
    )
    with catalog.connect() as conn:
        row = conn.execute(sa.select(results).where(results.c.id == result_id)).first()
        if row is None:
            return None
        stages = conn.execute(
            sa.select(stage_rows)
            .where(stage_rows.c.result_id == result_id)
            .order_by(stage_rows.c.position)
        ).all()
        rows = conn.execute(
            sa.select(divergences)
            .where(divergences.c.result_id == result_id)
            .order_by(divergences.c.position)
            .limit(max_divergences + 1)
        ).all()
    return {
        "result": _row(row),
        "stages": [_row(stage) for stage in stages],
        "divergences": [_row(divergence) for divergence in rows[:max_divergences]],
        "divergences_truncated": len(rows) > max_divergences,
    }
