"""Render a replay report as text (the CLI's default) or JSON."""

from __future__ import annotations

from trajstore.replay.compare import Divergence, format_value
from trajstore.replay.runner import NOT_REQUESTED, BundleReport, ReplayReport
from trajstore.vocab import StageStatus


def _fmt_err(x: float | None) -> str:
    """An error magnitude: 6 significant digits say how far apart, not which values."""
    return "null" if x is None else f"{x:.6g}"


def divergence_line(d: Divergence) -> str:
    """One mismatch; expected/actual round-trip their dtype so they never print the same."""
    actual = format_value(d.actual, d.actual_dtype)
    if d.expected is None and d.actual is None and d.abs_err is None:
        return f"{d.where()}: missing"
    if d.expected is None and d.abs_err is None:
        return f"{d.where()}: actual={actual}"
    expected = format_value(d.expected, d.expected_dtype)
    return f"{d.where()}: expected={expected} actual={actual} abs_err={_fmt_err(d.abs_err)}"


def format_bundle(report: BundleReport, header: str) -> list[str]:
    lines = [header]
    if report.selection.partial:
        n = len(report.selection.positions)
        extra = (
            f" (group closure added {', '.join(report.selection.closure_added)})"
            if report.selection.closure_added
            else ""
        )
        lines.append(f"  selection: {n} sample(s){extra}")
    for outcome in report.stages:
        if outcome.reason == NOT_REQUESTED:
            continue
        line = f"[{outcome.status:>7}] {outcome.stage}"
        if outcome.reason:
            line += f" — {outcome.reason}"
        if not outcome.requested and outcome.status in (StageStatus.PASS, StageStatus.FAIL):
            line += "  (input only)"
        lines.append(line)
        if outcome.trusted:
            lines.append(" " * 10 + "taken on trust (not recomputable from the bundle): ")
            lines[-1] += ", ".join(outcome.trusted)
        for divergence in outcome.divergences:
            lines.append(" " * 10 + divergence_line(divergence))
    return lines


def format_report(report: ReplayReport) -> str:
    out: list[str] = []
    multi = len(report.bundles) > 1
    for bundle in report.bundles:
        first_stage = bundle.first_divergent_stage
        if first_stage is None:
            verdict = "all requested stages pass"
        elif bundle.outcome(first_stage).status == StageStatus.UNSUPPORTED:
            verdict = f"requested stage {first_stage} is unsupported"
        else:
            verdict = f"first divergent stage: {first_stage}"
        rank = f" rank {bundle.rank}" if bundle.rank is not None else ""
        out += format_bundle(bundle, f"bundle {bundle.bundle_id}{rank} — {verdict}")
        out.append("")
    if multi:
        first_stage = report.first_divergent_stage
        if first_stage:
            out.append(
                f"cohort {report.label} — first divergent stage: {first_stage}"
                f" (rank {report.first_divergent_rank})"
            )
        else:
            out.append(
                f"cohort {report.label} — "
                f"all requested stages pass on {len(report.bundles)} rank(s)"
            )
    if report.linkage is not None:
        out.append(f"rollout linkage: {report.linkage.status} — {report.linkage.reason}")
    if report.root_bundle_key:
        out.append(
            f"first divergent stage: {report.root_stage} in upstream bundle "
            f"{report.root_bundle_key}; "
            f"this bundle's {report.first.first_divergent_stage} is downstream of it"
        )
    return "\n".join(out).rstrip("\n")
