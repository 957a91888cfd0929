"""Coverage-guided fuzzing of a bundle's JSON documents and the reader's checks on them.

The first input byte picks a target: one of the schema models' ``from_dict``
(manifest.json, index.json, COMPLETE, COMPLETE.<r>, cohort COMPLETE) after
``parse_json``, expected.json as the reader takes it, or a whole bundle
directory opened with ``open_bundle``. In that last mode the rest of the input
is split on ``\\x00\\x00`` into manifest, index, expected and COMPLETE, written to
a temp dir, and COMPLETE's metadata hashes are re-signed when it is a JSON
object (so the fuzzer reaches the checks behind the hash gate).

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
    from trajstore.bundle.reader import METADATA_FILES, open_bundle
    from trajstore.errors import BundleError, TrajstoreError
    from trajstore.jsonio import parse_json, sha256_bytes
    from trajstore.schema import CohortComplete, Complete, Index, Manifest, RankShard

_MODELS = (Manifest, Index, Complete, RankShard, CohortComplete)
_ROOT = Path(tempfile.mkdtemp(prefix="fuzz-docs-"))
atexit.register(shutil.rmtree, _ROOT, True)


def _expected(doc: object) -> None:
    if not isinstance(doc, dict):
        raise BundleError("expected.json: expected a JSON object keyed by stage")


def _open_dir(body: bytes) -> None:
    parts = (body.split(b"\x00\x00") + [b""] * 4)[:4]
    bundle = _ROOT / "bundle"
    shutil.rmtree(bundle, ignore_errors=True)
    bundle.mkdir()
    for name, raw in zip(METADATA_FILES, parts, strict=False):
        (bundle / name).write_bytes(raw)
    complete = parts[3]
    try:
        doc = json.loads(complete)
    except (ValueError, RecursionError):
        doc = None
    if isinstance(doc, dict):
        doc["metadata"] = {n: sha256_bytes(r) for n, r in zip(METADATA_FILES, parts, strict=False)}
        complete = json.dumps(doc).encode()
    (bundle / "COMPLETE").write_bytes(complete)
    open_bundle(bundle)


def target(kind: int, body: bytes) -> None:
    """Parse ``body`` as document ``kind`` (see the module docstring)."""
    kind %= len(_MODELS) + 2
    if kind < len(_MODELS):
        _MODELS[kind].from_dict(parse_json(body, "fuzz"))
    elif kind == len(_MODELS):
        _expected(parse_json(body, "expected.json"))
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
