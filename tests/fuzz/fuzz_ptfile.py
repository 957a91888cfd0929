"""Coverage-guided fuzzing of the `.pt` reader (trajstore.bundle.ptfile.read_pt_bytes).

Property: any bytes either parse into a tensor or raise a TrajstoreError with a
one-line message; never another exception, a hang or an allocation beyond the
input's own size. Run: ``python tests/fuzz/fuzz_ptfile.py [workdir] tests/fuzz/corpus/ptfile``
plus libFuzzer flags (``-atheris_runs=N``, ``-max_total_time=S``, ``-rss_limit_mb=M``).
"""

from __future__ import annotations

import io
import sys
import zipfile

import atheris

with atheris.instrument_imports(include=["trajstore"]):
    from trajstore.bundle.ptfile import read_pt_bytes
    from trajstore.errors import TrajstoreError


#: deflate's ceiling (~1032:1): a stored or deflated record never legitimately exceeds it
_MAX_EXPANSION = 1032
SEP = b"\x00SEP\x00"


def as_pt_file(data: bytes) -> bytes:
    """The file to parse: ``data[1:]`` as is when ``data[0]`` is odd, else a fresh zip.

    A mutated pickle fails the zip's CRC-32, so raw mutation alone never reaches
    the unpickler; the second mode writes ``pickle SEP storage`` into a valid
    ``archive/data.pkl`` + ``archive/data/0`` container (CRCs computed here).
    """
    if not data or data[0] & 1:
        return data[1:]
    pickled, _, storage = data[1:].partition(SEP)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pickled)
        zf.writestr("archive/byteorder", b"little")
        zf.writestr("archive/data/0", storage)
    return out.getvalue()


def one_input(data: bytes) -> None:
    """Parse ``data``; only a one-line TrajstoreError may escape (anything else is a finding)."""
    data = as_pt_file(data)
    try:
        t = read_pt_bytes(data, label="fuzz")
    except TrajstoreError as exc:
        if "\n" in str(exc):
            raise AssertionError(f"multi-line error message: {exc!r:.200}") from None
        return
    if t.array.nbytes > _MAX_EXPANSION * len(data) + 64:
        raise AssertionError(f"{t.array.nbytes} bytes materialized from a {len(data)}-byte file")


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
