"""`CaptureStats`: the counters the training thread and the writer thread share.

Its own module so the hot path (`manager`) and the writer thread (`writer`)
both count into it without importing each other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger("trajstore.capture")


@dataclass
class CaptureStats:
    """Counters a trainer can log; ``dropped`` > 0 means the queue was too small."""

    enqueued: int = 0
    dropped: int = 0
    skipped: int = 0
    written: int = 0
    errors: int = 0
    ingested: int = 0
    dropped_sample_keys: set[str] = field(default_factory=set)

    def count_error(self, what: str) -> None:
        """Count and log a failure; capture never raises into training."""
        self.errors += 1
        logger.exception("trajstore capture: error while %s (training continues)", what)
