"""`CaptureStats`: the counters the training thread and the writer share (the writer
thread, or the thread reading the writer process's replies).

Its own module so the hot path (`manager`) and the writer thread (`writer`)
both count into it without importing each other.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field

from trajstore.errors import disk_full_error

logger = logging.getLogger("trajstore.capture")


@dataclass
class CaptureStats:
    """Counters a trainer can log; ``dropped`` > 0 means the queue was too small.

    ``disk_full`` counts the bundles lost to a full disk or an exhausted quota
    (ENOSPC/EDQUOT, also counted in ``errors``): the capture goes on, and writes
    again once space is freed. ``abandoned`` counts the steps given micro-batches but
    never ended (nor discarded) by `close`: their bundles were not written.
    """

    enqueued: int = 0
    dropped: int = 0
    skipped: int = 0
    written: int = 0
    errors: int = 0
    ingested: int = 0
    disk_full: int = 0
    abandoned: int = 0
    dropped_sample_keys: set[str] = field(default_factory=set)
    #: disk-full kinds (the error's text) already logged since the last bundle written
    _disk_full_logged: set[str] = field(default_factory=set, repr=False)

    def count_error(self, what: str) -> None:
        """Count and log a failure (call it in the `except` block); capture never raises
        into training. A full disk is logged once per kind (ENOSPC, EDQUOT) until a bundle
        is written again, not once per bundle: every later bundle would fail alike."""
        self.errors += 1
        exc = sys.exc_info()[1]
        full = disk_full_error(exc) if exc is not None else None
        if full is None:
            logger.exception("trajstore capture: error while %s (training continues)", what)
            return
        self.disk_full += 1
        kind = full.kind
        if kind in self._disk_full_logged:
            return
        self._disk_full_logged.add(kind)
        logger.error(
            "trajstore capture: %s while %s: %s. Training continues; bundles are dropped "
            "(counted in CaptureStats.disk_full) until space is freed, and this is not "
            "logged again until one is written",
            kind,
            what,
            full,
        )

    def count_written(self) -> None:
        """A bundle was written: a later full disk is news again."""
        self.written += 1
        self._disk_full_logged.clear()
