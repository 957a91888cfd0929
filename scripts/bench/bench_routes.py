#!/usr/bin/env python
"""Route delta storage: train routes stored as an XOR delta against the rollout routes.

    .venv/bin/python scripts/bench/bench_routes.py [--samples 32 --diff 0.18 --json OUT]

Routes are Qwen3-30B-A3B-like [T, 48, 8] uint8 with random expert ids (as
trajstore.examples.gen_long_run draws them). The train routes are the rollout routes
with a fraction `--diff` of token-layers whose *whole* top-k set is redrawn
(again as gen_long_run.py does: a re-routed token-layer picks 8 new experts,
not one id nudged by one). Both go through `write_array` the way ingest
writes them (the rollout routes as the base, the train routes with
`base=`/`base_values=`), and the stored bytes are read back from the object
store. Issue 8's target: train routes <= 0.35x of one route tensor's stored size.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from harness import emit, figure, load1

from trajstore.cas import LocalObjectStore, read_array, write_array


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--diff", type=float, default=0.18, help="fraction of token-layers re-routed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the figures here (harness.py)")
    args = ap.parse_args()
    load_before = load1()
    rng = np.random.default_rng(args.seed)
    lengths = [int(x) for x in rng.integers(300, 1500, args.samples)]
    t_total = sum(lengths)
    rollout = rng.integers(0, args.experts, (t_total, args.layers, args.topk), dtype=np.uint8)
    train = rollout.copy()
    diff = rng.random((t_total, args.layers)) < args.diff
    train[diff] = rng.integers(0, args.experts, (int(diff.sum()), args.topk), dtype=np.uint8)
    token_layers = t_total * args.layers

    with tempfile.TemporaryDirectory() as d:
        objs = LocalObjectStore(Path(d) / "routes", durable=False)

        def stored(rec) -> int:
            return sum(len(objs.get(h)) for row in rec.chunks for h in row if h is not None)

        t0 = time.perf_counter()
        base = write_array(objs, rollout, lengths, dtype_tag="torch.uint8")
        t_base = time.perf_counter() - t0
        same = write_array(
            objs, rollout, lengths, dtype_tag="torch.uint8", base=base, base_values=rollout
        )
        t0 = time.perf_counter()
        delta = write_array(
            objs, train, lengths, dtype_tag="torch.uint8", base=base, base_values=rollout
        )
        t_delta = time.perf_counter() - t0
        objs.flush()
        if not np.array_equal(read_array(objs, delta), train):
            print("delta read-back differs from the train routes", file=sys.stderr)
            return 1
        base_b, same_b, delta_b = stored(base), stored(same), stored(delta)
    res = {
        "samples": args.samples,
        "tokens": t_total,
        "shape": [t_total, args.layers, args.topk],
        "raw_bytes": int(rollout.nbytes),
        "differing_token_layers": float(diff.mean()),
        "base_stored_bytes": base_b,
        "equal_delta_bytes": same_b,
        "delta_stored_bytes": delta_b,
        "delta_vs_base": delta_b / base_b,
        "delta_vs_raw": delta_b / rollout.nbytes,
        "base_bytes_per_token_layer": base_b / token_layers,
        "delta_bytes_per_token_layer": delta_b / token_layers,
        "base_write_s": t_base,
        "delta_write_s": t_delta,
    }
    print(
        f"routes {args.samples} samples, {t_total} tokens x {args.layers} x {args.topk} uint8 = "
        f"{rollout.nbytes / 2**20:.1f} MiB raw; {diff.mean():.1%} of token-layers with the whole "
        f"top-k redrawn\n  rollout routes (base): {base_b / 2**20:.2f} MiB stored, "
        f"{res['base_bytes_per_token_layer']:.2f} B/token-layer\n  train routes, equal (R3): "
        f"{same_b} B\n  train routes, XOR delta: {delta_b / 2**20:.2f} MiB stored, "
        f"{res['delta_bytes_per_token_layer']:.2f} B/token-layer = {res['delta_vs_base']:.3f}x "
        f"the stored base ({res['delta_vs_raw']:.3f}x raw); target <= 0.35x"
    )
    emit(
        args.json,
        [
            figure(
                "train routes identical (R3) / one route tensor's stored size",
                "<= 0.01",
                same_b / base_b,
                "",
                exact=True,
                detail=f"{same_b} B of XOR delta against {base_b:,} B of stored rollout routes",
            ),
            figure(
                "train routes with ~18% of token-layers redrawn / stored base",
                "<= 0.35x",
                res["delta_vs_base"],
                "x",
                exact=True,
                detail=(
                    f"{t_total:,} tokens x {args.layers} x {args.topk} uint8, "
                    f"{diff.mean():.1%} of token-layers with the whole top-k redrawn: "
                    f"{delta_b / 2**20:.2f} MiB stored, "
                    f"{res['delta_bytes_per_token_layer']:.2f} B per token-layer "
                    f"({res['delta_vs_raw']:.3f}x raw)"
                ),
            ),
        ],
        load_before,
        results=res,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
