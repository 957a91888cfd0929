"""Asynchronous, off-by-default capture of replay bundles from a training loop.

Two lines in a trainer (everything else is a no-op unless ``TRAJSTORE_CAPTURE=1``)::

    from trajstore.capture import CaptureManager
    capture = CaptureManager.from_env(recompute=vars(args), rank=rank, producer_ranks=ranks)

then ``capture.rollout(...)`` after advantages are computed and
``with capture.step(R, S) as step: step.add(...)`` per micro-batch. See docs/capture.md.
"""

from trajstore.capture.config import CaptureConfig, CaptureConfigError
from trajstore.capture.manager import CaptureManager, StepCapture
from trajstore.capture.redaction import RedactionPolicy
from trajstore.capture.stats import CaptureStats

__all__ = [
    "CaptureConfig",
    "CaptureConfigError",
    "CaptureManager",
    "CaptureStats",
    "RedactionPolicy",
    "StepCapture",
]
