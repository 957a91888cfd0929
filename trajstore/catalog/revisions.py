"""The catalog schema revisions this trajstore knows (no SQLAlchemy: the CLI's direct
reader checks a catalog's revision without importing it)."""

from __future__ import annotations

# Ordered list of revisions this code knows; the last one is the head.
KNOWN_REVISIONS: tuple[str, ...] = ("0001", "0002", "0003", "0004", "0005", "0006")
HEAD_REVISION = KNOWN_REVISIONS[-1]
