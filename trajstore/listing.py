"""Where an incremental listing starts: one rule for every folder whose names begin with
their writer's clock (refs, tombstones and results: `<time_ns:020d>-<pid>-<hex>`; pack
ids: `<time_ns:016x>-<pid:x>-<hex>`).

A listing that only asks for names after a start (S3 `StartAfter`, a catalog's
high-water mark) pays for what is new. The start is the time of the newest name already
known, or this host's clock if that is earlier (a writer whose clock runs ahead cannot
push it past names others write later), minus the margin, written as a time prefix of
a name. So the newest known name itself, and every name of the same clock reading, is
listed again, and a name is missed only if its clock reading lies more than the margin
before the start (a writer whose clock lags by more, an upload visible that much later).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from trajstore.errors import UsageError

__all__ = [
    "DEFAULT_MARGIN_S",
    "DOC_NAMES",
    "MARGIN_ENV",
    "PACK_IDS",
    "NameClock",
    "listing_margin_s",
    "listing_start",
]

#: the clock-skew margin of every incremental listing: the store's refs and packs and a
#: server catalog's sync (writers and `replay --record` on PostgreSQL)
MARGIN_ENV = "TRAJSTORE_CATALOG_MARGIN_S"
DEFAULT_MARGIN_S = 300.0


def listing_margin_s() -> float:
    """How far before the newest name already known an incremental listing starts:
    `TRAJSTORE_CATALOG_MARGIN_S` or 300 s. Names start with their writer's clock, so a
    writer whose clock is behind by up to this much is still seen."""
    raw = os.environ.get(MARGIN_ENV)
    if not raw:
        return DEFAULT_MARGIN_S
    try:
        margin = float(raw)
    except ValueError:
        margin = -1.0
    if not margin >= 0:
        raise UsageError(f"{MARGIN_ENV} must be a number of seconds >= 0, got {raw!r}")
    return margin


@dataclass(frozen=True)
class NameClock:
    """How a kind of name begins with its writer's clock: `digits` characters of
    `time.time_ns()` in `base` (zero-padded), then `-`."""

    digits: int
    base: int

    def stamp(self, name: str) -> int | None:
        """The clock reading a name begins with; None if it does not begin with one."""
        head = name.split("-", 1)[0]
        alphabet = "0123456789abcdef"[: self.base]
        if len(head) != self.digits or head.strip(alphabet):
            return None
        return int(head, self.base)

    def prefix(self, time_ns: int) -> str:
        return f"{time_ns:0{self.digits}{'x' if self.base == 16 else 'd'}}"


#: refs, tombstones, claims' ref names and replay results (`trajstore.store.layout.new_doc_name`)
DOC_NAMES = NameClock(20, 10)
#: pack ids (`trajstore.cas.packs.new_pack_id`)
PACK_IDS = NameClock(16, 16)


def listing_start(
    newest: str | None,
    margin_s: float,
    clock: NameClock = DOC_NAMES,
    *,
    now_ns: int | None = None,
) -> str | None:
    """The name an incremental listing starts after: the clock reading of `newest` (the
    newest name already known), or `now_ns` (this host's clock) if earlier, minus
    `margin_s`, as a time prefix (never below zero); None (list everything) when nothing
    is known or `newest` does not begin with a clock reading of `clock`'s form."""
    mark_ns = None if newest is None else clock.stamp(newest)
    if mark_ns is None:
        return None
    now = time.time_ns() if now_ns is None else now_ns
    return clock.prefix(max(min(mark_ns, now) - int(margin_s * 1e9), 0))
