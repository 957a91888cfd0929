"""The one rule that turns a benchmark figure into a verdict (issue 29 item 12).

A verdict says `met` or `missed` only when the figure was measured on the workload its
target names and its repetitions decide it:

1. no figure, or a figure measured on a smaller workload than the target names
   (120 steps for a target "at 10,000 steps") -> `not measured`;
2. an exact figure (bytes, counts: the same on every run) -> its one value decides;
3. fewer than MIN_REPS repetitions -> `inconclusive` (a spread needs repetitions);
4. the spread of the repetitions (max - min) at least the margin (|median - bound|)
   -> `inconclusive`: another run could land on the other side;
5. otherwise the median decides: `met` or `missed`.

run.py (`make bench`, through harness.Result.verdict) decides every verdict of
docs/benchmarks.md with `decide`; the hand-measured figures there follow the same rule
(tests/test_bench_verdicts.py pins it).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

#: the fewest repetitions whose spread can stand for a figure's noise
MIN_REPS = 3

MET, MISSED, INCONCLUSIVE, NOT_MEASURED = "met", "missed", "inconclusive", "not measured"


@dataclass(frozen=True)
class Target:
    """`<figure> <op> <bound>`, on a workload of at least `workload` (None: any size)."""

    bound: float
    op: str  # "<=" or ">="
    workload: float | None = None
    workload_unit: str = ""

    def __post_init__(self) -> None:
        if self.op not in ("<=", ">="):
            raise ValueError(f"op must be '<=' or '>=', not {self.op!r}")

    def holds(self, value: float) -> bool:
        return value <= self.bound if self.op == "<=" else value >= self.bound


@dataclass(frozen=True)
class Verdict:
    status: str
    reason: str = ""
    median: float | None = None
    runs: int = 0  # repetitions the median is over

    def cell(self) -> str:
        """The verdict column's text: missed in bold, the reason of an undecided one."""
        if self.status == MISSED:
            return "**missed**"
        if self.status == MET:
            return MET
        return f"{self.status} ({self.reason})" if self.reason else self.status


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def decide(
    reps: Sequence[float] | None,
    target: Target,
    *,
    workload: float | None = None,
    exact: bool = False,
) -> Verdict:
    """The verdict of a figure measured `len(reps)` times on `workload` (see the module)."""
    values = [float(x) for x in reps or () if x is not None and not math.isnan(float(x))]
    if not values:
        return Verdict(NOT_MEASURED, "no figure")
    if target.workload is not None and (workload is None or workload < target.workload):
        unit = f" {target.workload_unit}" if target.workload_unit else ""
        got = "an unknown size" if workload is None else f"{_num(workload)}{unit}"
        return Verdict(NOT_MEASURED, f"measured on {got}, target at {_num(target.workload)}{unit}")
    median = statistics.median(values)
    if exact:
        return Verdict(MET if target.holds(median) else MISSED, "", median, len(values))
    if len(values) < MIN_REPS:
        n = len(values)
        return Verdict(INCONCLUSIVE, f"{n} run{'s' if n > 1 else ''}, need {MIN_REPS}", median, n)
    spread = max(values) - min(values)
    margin = abs(median - target.bound)
    if spread >= margin:
        return Verdict(
            INCONCLUSIVE,
            f"spread {_num(min(values))}-{_num(max(values))} >= margin {_num(margin)}",
            median,
            len(values),
        )
    return Verdict(MET if target.holds(median) else MISSED, "", median, len(values))
