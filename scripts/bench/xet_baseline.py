"""The Hugging Face Xet baseline the ingest benchmarks measure trajstore against (issue 33).

Xet is a content-defined-chunking dedup store written in Rust (`pip install hf_xet`, in the
dev extra). Run offline against a local CAS directory, it is what a user would otherwise
put the same files in: `hf_xet.XetSession().new_upload_commit(endpoint="local://DIR")`,
one `start_upload_file(path, sha256=hf_xet.SKIP_SHA256)` per file, `wait_to_finish()`;
the timed span includes writing its xorbs and shards to disk. Its physical bytes are the
CAS directory's bytes on disk, next to its own `dedup_metrics`.

Imported by the bench scripts (`bench_store.py`, `bench_slime_ingest.py`), which run from
this directory; never by the library.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: the fields of Xet's `dedup_metrics` a benchmark reports
METRICS = (
    "total_bytes",
    "new_bytes",
    "deduped_bytes",
    "xorb_bytes_uploaded",
    "shard_bytes_uploaded",
    "total_chunks",
    "deduped_chunks",
)


def require_xet() -> None:
    """Exit with a one-line hint when hf_xet is missing (before anything is generated)."""
    try:
        import hf_xet  # noqa: F401
    except ImportError:
        raise SystemExit(
            "hf_xet is not installed: pip install hf_xet (the dev extra has it)"
        ) from None


def isolate(work: Path) -> None:
    """Point Xet's cache into `work` (never the user's cache) and turn telemetry off."""
    os.environ["HF_XET_CACHE"] = str(work / "xet-cache")
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"


def forget_trajstore_caches() -> None:
    """Empty trajstore's per-process caches (encoded windows, decoded chunks), so an ingest
    repeated in one process costs what `trajstore ingest` costs in a new one: the encode
    cache would otherwise spare a repetition the compression of every window it saw."""
    from trajstore.cas.arrays import ENCODE_CACHE
    from trajstore.cas.chunk_cache import CHUNK_CACHE

    ENCODE_CACHE.clear()
    CHUNK_CACHE.clear()


def tree_bytes(root: Path) -> int:
    """Bytes of every regular file under `root` (what it takes on disk, before blocks)."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def files_under(root: Path) -> list[Path]:
    """Every regular file under `root`, sorted: what a user would hand Xet for a directory."""
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def run_xet(files: Iterable[Path], cas: Path) -> dict[str, Any]:
    """Store `files` into a fresh local Xet CAS at `cas`: wall seconds (session to the CAS
    written), the CAS directory's bytes and Xet's own dedup metrics."""
    import hf_xet

    cas.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    session = hf_xet.XetSession()
    commit = session.new_upload_commit(endpoint=f"local://{cas}")
    for path in files:
        commit.start_upload_file(str(path), sha256=hf_xet.SKIP_SHA256)
    report = commit.wait_to_finish()
    wall = time.perf_counter() - start
    m = report.dedup_metrics
    return {
        "wall_s": wall,
        "cas_dir_bytes": tree_bytes(cas),
        "dedup_metrics": {name: getattr(m, name) for name in METRICS},
    }
