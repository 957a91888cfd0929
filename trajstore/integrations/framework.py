"""What a framework format module hands the store: bundles, each with the files it came from.

Kept apart from the registry (`trajstore.integrations.formats`, which imports the format
modules by name) so a format module never imports the registry that imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class FrameworkBundle:
    """One bundle a format made from its files: where it goes (run, capture-directory
    child) and what it holds, plus the files it came from (for the ingest report)."""

    run: str
    child: str
    contents: Any  # trajstore.bundle.writer.BundleContents
    sources: list[str]
