"""Coverage-guided fuzzing of a bundle's JSON documents and the reader's checks on them.

The first input byte picks a target: one of the schema models' ``from_dict``
(manifest.json, index.json, COMPLETE, COMPLETE.<r>, cohort COMPLETE) after
``parse_json``, expected.json through the bundle reader's own ``parse_expected``
(what replay then reads from it is fuzzed by ``fuzz_expected.py``), or a whole bundle
directory opened with ``open_bundle``. In that last mode the rest of the input
is split on ``\\x00\\x00`` into manifest, index, expected, COMPLETE and a rank
shard (written as ``COMPLETE.<r>`` for each rank COMPLETE lists), and the
metadata hashes of COMPLETE and the shard are re-signed when they are JSON
objects (so the fuzzer reaches the checks behind the hash gate).

Property: a TrajstoreError with a one-line message, or success; nothing else.
"""

from __future__ import annotations

import atexit
import json
import shutil
import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["trajstore"]):
    from trajstore.bundle.reader import METADATA_FILES, open_bundle, parse_expected
    from trajstore.errors import TrajstoreError
    from trajstore.jsonio import parse_json, sha256_bytes
    from trajstore.schema import CohortComplete, Complete, Index, Manifest, RankShard

_MODELS = (Manifest, Index, Complete, RankShard, CohortComplete)
_ROOT = Path(tempfile.mkdtemp(prefix="fuzz-docs-"))
atexit.register(shutil.rmtree, _ROOT, True)


def _json_object(raw: bytes) -> dict | None:
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def _open_dir(body: bytes) -> None:
    parts = (body.split(b"\x00\x00") + [b""] * 5)[:5]
    bundle = _ROOT / "bundle"
    shutil.rmtree(bundle, ignore_errors=True)
    bundle.mkdir()
    for name, raw in zip(METADATA_FILES, parts, strict=False):
        (bundle / name).write_bytes(raw)
    signed = {n: sha256_bytes(r) for n, r in zip(METADATA_FILES, parts, strict=False)}
    complete, shard = parts[3], parts[4]
    doc = _json_object(complete)
    ranks: list[int] = []
    if doc is not None:
        doc["metadata"] = signed
        complete = json.dumps(doc).encode()
        if isinstance(doc.get("ranks"), list):
            ranks = [r for r in doc["ranks"] if type(r) is int and 0 <= r < 8][:4]
    (bundle / "COMPLETE").write_bytes(complete)
    shard_doc = _json_object(shard)
    if shard_doc is not None:
        shard_doc["metadata"] = signed  # so the shard checks behind the hash check are reached
        shard = json.dumps(shard_doc).encode()
    for r in ranks:
        (bundle / f"COMPLETE.{r}").write_bytes(shard)
    open_bundle(bundle)


def target(kind: int, body: bytes) -> None:
    """Parse ``body`` as document ``kind`` (see the module docstring)."""
    kind %= len(_MODELS) + 2
    if kind < len(_MODELS):
        _MODELS[kind].from_dict(parse_json(body, "fuzz"))
    elif kind == len(_MODELS):
        parse_expected(body)
    else:
        _open_dir(body)


def one_input(data: bytes) -> None:
    """Only a one-line TrajstoreError may escape; any other exception is a finding."""
    if not data:
        return
    try:
        target(data[0], data[1:])
    except TrajstoreError as exc:
        if "\n" in str(exc):
            raise AssertionError(f"multi-line error message: {exc!r:.200}") from None


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
