"""slime's debug dumps in and out of a store (`ingest --from slime`, `export --to slime`).

slime (THUDM/slime and its forks) writes ``--save-debug-rollout-data`` and
``--save-debug-train-data`` dumps with torch.save; `convert` turns them into bundles
(`trajstore.integrations.formats` ingests those), `export` writes stored runs back as
files slime's ``--load-debug-rollout-data`` reads. docs/integrations.md#slime.
"""

from __future__ import annotations

from trajstore.integrations.slime.convert import convert
from trajstore.integrations.slime.export import export

__all__ = ["convert", "export"]
