"""MoE router consistency (rollout routing replay, "R3").

`trajstore.router.metrics` measures how far the experts the training forward
executed disagree with those the rollout engine chose, and how far the
selected-token log-probs drifted, on masked response tokens only
(contract: docs/router-metrics.md). NumPy only: no torch import, so the CLI and
REST paths that report metrics stay fast.
"""
