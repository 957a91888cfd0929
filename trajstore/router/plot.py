"""Per-step curves of a run comparison (matplotlib, Agg: no display needed).

One panel per compared metric, one line per run, steps on x in actor-step
order. A null (unmeasured or metric_error) step is a gap in the line, never a
point at 0. Panels whose values are all positive use a log scale, since R3
drift sits orders of magnitude below baseline.
"""

from __future__ import annotations

from pathlib import Path

from trajstore.router.compare import RATIO_METRICS, RunComparison


def plot_path(path: Path | str) -> Path:
    """`path` checked as where a plot can be written (a new or existing .png file, its
    parent creatable), before the comparison it draws is computed."""
    from trajstore.errors import UsageError
    from trajstore.jsonio import check_creatable, user_path

    path = user_path(path)  # --plot=~/x.png reaches us unexpanded
    if path.suffix.lower() != ".png":
        raise UsageError(f"plot file {str(path)!r} must end in .png (it is written as PNG)")
    if path.is_dir():
        raise UsageError(f"{path}: is a directory; the plot needs a file name")
    check_creatable(path)
    return path


def plot_comparison(cmp: RunComparison, path: Path | str, *, title: str | None = None) -> Path:
    """Write the per-step curves of ``cmp`` to ``path`` (PNG) and return it."""
    path = plot_path(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = cmp.steps
    labels = [f"{rollout}:{step}" for rollout, step in steps]
    xs = list(range(len(steps)))
    metrics = RATIO_METRICS
    fig, axes = plt.subplots(len(metrics), 1, figsize=(8, 2.2 * len(metrics)), sharex=True)
    for ax, metric in zip(axes, metrics, strict=True):
        seen: list[float] = []
        for run in cmp.runs:
            ys = [cmp.value(run, s, metric) for s in steps]
            seen += [y for y in ys if y is not None]
            ax.plot(
                xs,
                [float("nan") if y is None else y for y in ys],
                marker="o",
                markersize=3,
                label=run,
            )
        if seen and min(seen) > 0:
            ax.set_yscale("log")
        ax.set_ylabel(metric, fontsize=8)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8, loc="best")
    step_every = max(1, len(xs) // 12)
    axes[-1].set_xticks(xs[::step_every])
    axes[-1].set_xticklabels(labels[::step_every], fontsize=7, rotation=45)
    axes[-1].set_xlabel("actor step (rollout_id:step_id)")
    fig.suptitle(title or "router consistency: " + " vs ".join(cmp.runs), fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
    return path
