"""Training-inference mismatch per step, computed once when a bundle is stored.

`compute` (NumPy) measures a bundle's sampler-vs-trainer log-prob drift and its
rollout-vs-training route disagreement as *sums* (numerators, denominators, extremes)
that the ranks of a step add up; the store keeps them in the bundle's ref (key
``mismatch``) and the catalog indexes them (table ``mismatch_metrics``, migration 0006).
`metrics` (no NumPy, no SQLAlchemy) names the derived metrics and writes the SQL that
turns the sums into per-step values, so the catalog-only commands stay light.
Contract: docs/mismatch.md.
"""

from __future__ import annotations

#: version of the ``mismatch`` entry of a bundle ref
MISMATCH_VERSION = 1
