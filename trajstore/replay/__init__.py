"""Replay engine: recompute the GRPO stage chain on a plain CPU.

`kernels` holds the NumPy numerics (no torch import, so a replay stays fast);
the stage runner, comparison and divergence report build on them.
"""
