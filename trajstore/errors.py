"""Error types. Each carries the CLI exit code it maps to.

Exit codes (docs/cli.md): 0 success, 1 a divergence / requested unsupported
stage, 2 invalid input, integrity failure or usage error. The CLI prints
`trajstore: error: <message>` on one line for every TrajstoreError and never
a traceback.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable


class TrajstoreError(Exception):
    """Base class: a clear, one-line, user-facing failure."""

    exit_code: int = 2


class UsageError(TrajstoreError):
    """Bad command-line usage or bad arguments to an API call."""


class BundleError(TrajstoreError):
    """A bundle is malformed, incomplete, unsafe or fails its integrity gate."""


class SelectionError(TrajstoreError):
    """A sample/group/micro-batch selection cannot be honoured."""


class NotFoundError(TrajstoreError):
    """A step, bundle, run or payload does not exist."""


def check_known_run(run: str | None, known: Iterable[str]) -> None:
    """Refuse a run filter naming no run of the store (`known`): it would select nothing,
    which reads as "nothing there" when the name is only misspelt. None: no filter."""
    names = sorted(set(known))
    if run is not None and run not in names:
        raise NotFoundError(f"run {run!r} is not in the store (runs: {', '.join(names) or 'none'})")


def check_known_sample(sample_id: str | None, found: bool, run: str | None) -> None:
    """Refuse a sample filter naming no sample of any bundle (of `run`, when given): like a
    misspelt run, it would list nothing, which reads as "that sample never diverged"."""
    if sample_id is not None and not found:
        where = f"run {run!r}" if run is not None else "the store"
        raise NotFoundError(f"sample {sample_id!r} is in no bundle of {where}")


class EngineOutputError(TrajstoreError):
    """An inference engine's output (SGLang's meta_info, vLLM's CompletionOutput) does not
    line up with its sample: routes, log-probs or tokens misaligned, padded, out of range.
    Raised by `trajstore.integrations.engines`, naming the sample, turn, layer or position."""


class IntegrityError(TrajstoreError):
    """Stored content does not match its address or a declared size/hash."""


class StoreError(TrajstoreError):
    """The store or its catalog is unusable (layout, lock, migration)."""


class CatalogDamagedError(StoreError):
    """A DuckDB catalog file that DuckDB cannot read back (cut short, overwritten, a block
    failing its checksum). Why its own type: the catalog is an index of the refs, so the
    fix is always `trajstore reindex`, which moves the file aside and rebuilds it.

    `reindex_args` is what to pass reindex (the CLI puts the `--store` it was given);
    without it the store is taken to be the directory holding the file."""

    def __init__(self, file: str, reason: str, reindex_args: str | None = None) -> None:
        super().__init__(file, reason)
        self.file = file
        self.reason = reason
        self.reindex_args = reindex_args

    def __str__(self) -> str:
        args = self.reindex_args or f"--store {os.path.dirname(self.file) or '.'}"
        return f"catalog {self.file} cannot be read ({self.reason}); run: trajstore reindex {args}"


class DiskFullError(StoreError):
    """The file system holding the store (or an output) is full or over quota.

    `kind` is the condition alone ("no space left on device", "disk quota exceeded"),
    for counting and logging once per kind.
    """

    def __init__(self, message: str, kind: str = "no space left on device") -> None:
        super().__init__(message)
        self.kind = kind


#: errno values that mean "no room to write": a full device, an exhausted quota
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_DISK_FULL_TEXT = tuple(os.strerror(e) for e in sorted(DISK_FULL_ERRNOS))


def disk_full_error(exc: BaseException) -> DiskFullError | None:
    """A one-line DiskFullError if `exc` or what it wraps (`__cause__`/`__context__`,
    e.g. a database driver's error) says the disk is full or over quota; else None.

    Why one place: ENOSPC reaches the CLI from a pack write, an fsync, a ref's temp
    file or the catalog's database, as an OSError or as a driver's own exception.
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, DiskFullError):
            return e
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            kind = os.strerror(e.errno).lower()
            where = f" writing {e.filename}" if e.filename else ""
            return DiskFullError(f"{kind}{where}{_AFTER}", kind)
        text = str(e)
        for why in _DISK_FULL_TEXT:
            if why in text:
                first = text.strip().splitlines()[0][:300]
                return DiskFullError(f"{why.lower()} ({first}){_AFTER}", why.lower())
        e = e.__cause__ or e.__context__
    return None


_AFTER = (
    "; nothing half-written is visible (what was published before stays): "
    "free space, then run the same command again"
)
