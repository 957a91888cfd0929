"""Error types. Each carries the CLI exit code it maps to.

Exit codes (docs/cli.md): 0 success, 1 a divergence / requested unsupported
stage, 2 invalid input, integrity failure or usage error. The CLI prints
`trajstore: error: <message>` on one line for every TrajstoreError and never
a traceback.
"""

from __future__ import annotations


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


class IntegrityError(TrajstoreError):
    """Stored content does not match its address or a declared size/hash."""


class StoreError(TrajstoreError):
    """The store or its catalog is unusable (layout, lock, migration)."""
