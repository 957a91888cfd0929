#!/usr/bin/env python
"""What routes add to replay: the same long run with and without routes [T, 48, 8], one run.

    .venv/bin/python scripts/bench/bench_route_replay.py --dir DIR [--rollouts 2] [--steps 4]
        [--samples 128] [--reps 3] [--json OUT]

`trajstore.examples.gen_long_run` writes the run twice with the same seed,
once with `--routes` (the routes draw from the same generator, so later
rollouts' lengths shift a little; the unrouted time is scaled by the response
tokens). Each is ingested into its own store and replayed with
`replay_all(workers=1, record=True, force=True)`, as `replay --all --record
--force` does: recording recomputes the route metrics from both route tensors
even where the producer recorded none for `router.consistency` to check. One
warm-up, then `--reps` timed runs, alternating. Printed: replay seconds per
million response tokens without routes (the baseline), the routed / unrouted
time ratio, and the extra seconds per million route token-layers (both route
tensors read, hash-checked, decoded and compared). docs/deployment.md scales
its replay estimate with these two rates.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from harness import emit, load1, machine_line, say


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="work directory (must not exist)")
    ap.add_argument("--rollouts", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import sqlalchemy as sa
    from trajstore.examples import gen_long_run

    from trajstore.catalog import tables
    from trajstore.replay.batch import replay_all
    from trajstore.store import Store

    args.dir.mkdir(parents=True)
    load_before = load1()
    say(f"{machine_line()}, date {time.strftime('%Y-%m-%d %H:%M')}, load {load_before}")
    stores: dict[str, Path] = {}
    sizes: dict[str, dict] = {}
    for variant in ("plain", "routes"):
        cap = args.dir / f"cap-{variant}"
        gen = [str(cap), "--rollouts", str(args.rollouts), "--steps", str(args.steps)]
        gen += ["--samples", str(args.samples)] + (["--routes"] if variant == "routes" else [])
        assert gen_long_run.main(gen) == 0
        root = stores[variant] = args.dir / f"store-{variant}"
        with Store.open(root, durable=False) as store:
            refused = [o for o in store.ingest([cap], run="r") if o.status == "refused"]
            assert not refused, refused
            s = tables.samples
            with store.catalog() as cat, cat.connect() as conn:
                resp, total, bundles = conn.execute(
                    sa.select(
                        sa.func.sum(s.c.response_length),
                        sa.func.sum(s.c.total_length),
                        sa.func.count(sa.distinct(s.c.bundle_key)),
                    )
                ).one()
        sizes[variant] = {"bundles": bundles, "response_tokens": resp, "total_tokens": total}
    say(f"generated and ingested: {sizes}; load {load1()}")
    # the routes draw from the same generator, so later rollouts' lengths shift a little:
    # the unrouted time is scaled to the routed run's response tokens below
    scale = sizes["routes"]["response_tokens"] / sizes["plain"]["response_tokens"]
    assert abs(scale - 1) < 0.05, sizes

    times: dict[str, list[float]] = {"plain": [], "routes": []}
    verdicts: dict[str, dict] = {}
    for rep in range(args.reps + 1):
        order = ("plain", "routes") if rep % 2 == 0 else ("routes", "plain")
        for variant in order:
            summary = replay_all(
                stores[variant], workers=1, record=True, force=True, progress=False
            )
            d = summary.to_dict()
            verdicts[variant] = {k: d[k] for k in ("total", "pass", "diverged", "refused")}
            if rep:  # rep 0 is the warm-up
                times[variant].append(summary.seconds)
    med = {k: statistics.median(v) for k, v in times.items()}
    n = sizes["routes"]
    # both route tensors (rollout and train) of every bundle, 48 layers each
    token_layers = 2 * n["total_tokens"] * 48
    per_mtok = med["plain"] / (sizes["plain"]["response_tokens"] / 1e6)
    per_mtl = (med["routes"] - med["plain"] * scale) / (token_layers / 1e6)
    say(f"verdicts: {verdicts}")
    for k in ("plain", "routes"):
        say(f"{k:6}: median {med[k]:.2f} s (runs {', '.join(f'{x:.2f}' for x in times[k])})")
    say(
        f"routed / unrouted replay time: {med['routes'] / (med['plain'] * scale):.2f}x; "
        f"{per_mtok:.2f} s per million response tokens without routes; "
        f"+{per_mtl:.4f} s per million route token-layers ({token_layers:,} in the run)"
    )
    # no target is set for these rates (docs/deployment.md scales with them): no figures
    emit(
        args.json,
        [],
        load_before,
        sizes=sizes,
        seconds=times,
        median=med,
        s_per_m_response_tokens=per_mtok,
        s_per_m_route_token_layers=per_mtl,
        verdicts=verdicts,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
