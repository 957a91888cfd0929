"""Export a stored bundle (or cohort) back to a bundle directory, byte for byte
(or converted to the other format major with ``--format``).

Every file is reproduced from the store: documents and sentinels are stored
verbatim, and each `.pt` is its stored envelope with the tensor bytes spliced
back in, checked against the manifest's sha256 before it is written. The
directory is built in a hidden sibling and renamed into place, like the
bundle writer: OUT never holds a partial export.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from trajstore.errors import IntegrityError, UsageError
from trajstore.jsonio import check_creatable, temp_sibling
from trajstore.store.stored_bundle import StoredBundle

METADATA = ("manifest.json", "index.json", "expected.json")


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _write_member(sb: StoredBundle, dest: Path) -> None:
    dest.mkdir(parents=True)
    (dest / "payloads").mkdir()
    for name in sb.payload_names():
        _write(dest / "payloads" / f"{name}.pt", sb.payload_file(name))
    for fname in METADATA:
        _write(dest / fname, sb.file_bytes(fname))
    sentinels = sorted(sb.ref.get("sentinels") or {}, key=lambda n: (n == "COMPLETE", n))
    for fname in sentinels:  # COMPLETE last, as a producer writes it
        _write(dest / fname, sb.file_bytes(fname))


def export_bundles(
    bundles: list[StoredBundle], out: Path | str, *, format_major: int | None = None
) -> Path:
    """Write `bundles` (one single-producer bundle, or every rank of one cohort) at `out`."""
    out = Path(out)
    if not bundles:
        raise UsageError("nothing to export")
    if out.exists():
        raise UsageError(f"{out}: already exists; refusing to overwrite")
    check_creatable(out)
    if format_major is not None and any(b.manifest.major != format_major for b in bundles):
        return _export_converted(bundles, out, format_major)
    cohort = bundles[0].ref.get("cohort_ranks")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(out)
    try:
        if cohort is None:
            if len(bundles) != 1:
                raise UsageError("several single-producer bundles cannot form one export")
            _write_member(bundles[0], tmp)
        else:
            whole = {b.ref["cohort_sentinels"].get("COMPLETE") for b in bundles}
            if len(whole) != 1 or sorted(b.rank for b in bundles) != sorted(cohort):
                raise IntegrityError(
                    f"ranks {[b.rank for b in bundles]} do not form one published cohort {cohort}"
                )
            tmp.mkdir()
            for b in sorted(bundles, key=lambda b: b.rank):
                _write_member(b, tmp / f"rank-{b.rank}")
                _write_cohort_file(b, tmp, f"COMPLETE.{b.rank}")
            _write_cohort_file(bundles[0], tmp, "COMPLETE")
        os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_cohort_file(b: StoredBundle, dest: Path, fname: str) -> None:
    from trajstore.cas.blobs import get_blob

    h = (b.ref.get("cohort_sentinels") or {}).get(fname)
    if h is None:
        raise IntegrityError(f"{b.bundle_key}: cohort file {fname} is not stored")
    _write(dest / fname, get_blob(b.objs, h))


def _export_converted(bundles: list[StoredBundle], out: Path, major: int) -> Path:
    """Rewrite the documents in another format major; payload files stay byte-identical."""
    from trajstore.bundle.convert import convert_contents
    from trajstore.bundle.writer import write_bundle, write_rank

    def contents(b: StoredBundle):  # noqa: ANN202
        files = {name: b.payload_file(name) for name in b.payload_names()}
        return convert_contents(b.manifest.raw, b.index.raw, b.expected, files, major)

    cohort = bundles[0].ref.get("cohort_ranks")
    if cohort is None:
        return write_bundle(out, contents(bundles[0]))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(out)
    try:
        for b in sorted(bundles, key=lambda b: b.rank):
            write_rank(tmp, contents(b), rank=b.rank, expected_ranks=list(cohort))
        os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
