"""The benchmark verdict rule (scripts/bench/verdicts.py) on synthetic figures: met or
missed only from the workload the target names and from repetitions whose spread is
smaller than the margin; otherwise "not measured" or "inconclusive" (issue 29 item 12)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))
from verdicts import (  # noqa: E402
    INCONCLUSIVE,
    MET,
    MISSED,
    NOT_MEASURED,
    Target,
    decide,
)

AT_MOST_1_05 = Target(1.05, "<=")
AT_LEAST_0_8 = Target(0.8, ">=")
P99_AT_10K_STEPS = Target(10.0, "<=", workload=10_000, workload_unit="steps")


def test_tight_repetitions_on_the_right_side_are_met() -> None:
    assert decide([1.00, 1.01, 0.99], AT_MOST_1_05).status == MET
    assert decide([0.95, 1.00, 0.97, 0.99, 1.02], AT_LEAST_0_8).status == MET


def test_tight_repetitions_on_the_wrong_side_are_missed() -> None:
    verdict = decide([1.12, 1.13, 1.11], AT_MOST_1_05)
    assert (verdict.status, verdict.median) == (MISSED, 1.12)
    assert verdict.cell() == "**missed**"
    assert decide([0.28, 0.27, 0.29], Target(0.35, ">=")).status == MISSED


def test_four_noisy_repetitions_whose_median_meets_the_target_are_inconclusive() -> None:
    """The TRL capture figure issue 29 names: median 1.01x, spread 0.94-1.15 > margin 0.04."""
    verdict = decide([1.15, 0.94, 0.97, 1.02], AT_MOST_1_05)
    assert verdict.status == INCONCLUSIVE
    assert verdict.cell() == "inconclusive (spread 0.94-1.15 >= margin 0.055)"


def test_a_spread_just_under_the_margin_decides() -> None:
    assert decide([0.90, 0.95, 0.99], AT_MOST_1_05).status == MET  # spread 0.09 < 0.10
    assert decide([0.85, 0.95, 0.99], AT_MOST_1_05).status == INCONCLUSIVE  # 0.14 >= 0.10


def test_a_median_on_the_bound_is_never_decided() -> None:
    assert decide([1.05, 1.05, 1.05], AT_MOST_1_05).status == INCONCLUSIVE


@pytest.mark.parametrize("reps", [[0.5], [0.5, 0.51]])
def test_fewer_than_three_repetitions_are_inconclusive(reps: list[float]) -> None:
    assert decide(reps, AT_MOST_1_05).status == INCONCLUSIVE


def test_a_smaller_workload_than_the_target_names_is_not_measured() -> None:
    """REST p99 "at 10,000 steps" from a 120-step store: however good, not measured."""
    verdict = decide([0.81, 0.80, 0.82], P99_AT_10K_STEPS, workload=120)
    assert verdict.status == NOT_MEASURED
    assert verdict.cell() == "not measured (measured on 120 steps, target at 10,000 steps)"
    assert decide([0.81, 0.80, 0.82], P99_AT_10K_STEPS).status == NOT_MEASURED  # size unknown
    assert decide([0.81, 0.80, 0.82], P99_AT_10K_STEPS, workload=10_040).status == MET


def test_no_figure_is_not_measured() -> None:
    assert decide(None, AT_MOST_1_05).status == NOT_MEASURED
    assert decide([], AT_MOST_1_05).status == NOT_MEASURED
    assert decide([float("nan")], AT_MOST_1_05).status == NOT_MEASURED


def test_an_exact_figure_is_decided_by_its_one_value() -> None:
    """Bytes stored are the same on every run: one run decides."""
    assert decide([0.169], Target(0.25, "<="), exact=True).status == MET
    assert decide([0.30], Target(0.25, "<="), exact=True).status == MISSED


def test_an_unknown_comparison_is_refused() -> None:
    with pytest.raises(ValueError, match="op must be"):
        Target(1.0, "<")


def test_the_runner_judges_a_figure_over_every_run_at_its_workload() -> None:
    """harness.Result.verdict (what `make bench` prints) applies the rule to a figure as a
    script writes it (harness.figure): the repetitions of every run together, and a run on
    a smaller store than the target names is not measured, whatever its value."""
    from harness import Result, check_document, figure

    def run(value: float, steps: int) -> Result:
        f = figure("ls", "<= 0.3 s on a 100,000-step store", value, "s", reps=[value] * 3,
                   workload=steps, target_workload=100_000, workload_unit="steps")  # fmt: skip
        return Result("scale", "bench_scale.py", "cmd", figures=check_document({"figures": [f]}))

    small = run(0.1, 2_000)
    assert small.figures[0]["met"] is False  # the script's own reading agrees
    assert small.verdict(small.figures[0]).cell() == (
        "not measured (measured on 2,000 steps, target at 100,000 steps)"
    )
    full = run(0.2, 100_000)
    full.reps = [run(0.21, 100_000), run(0.19, 100_000)]
    assert full.verdict(full.figures[0]).status == MET
    full.reps.append(run(0.6, 100_000))  # one run far off: the spread covers the margin
    assert full.verdict(full.figures[0]).status == INCONCLUSIVE
