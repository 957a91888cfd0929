"""Coverage-guided fuzzing of the pack index readers (`.idx` files of the CAS).

The store's ``PackSet.read_index`` (a real local store in a temp dir,
which checks the entries against the pack's size) and ``decode_pack_index``
without a size (what a cached or S3 index is read with) are fed the same bytes.
The first input byte picks whether the harness re-signs the body with its BLAKE3
trailer (otherwise the fuzzer could never pass the checksum and would only
exercise the refusal path); the next 4 bytes give the pack's size.

Property: a reader returns None (corrupt index, counted) or entries whose every
``off + len`` (exact integers) lies inside the pack; it never raises.
"""

from __future__ import annotations

import atexit
import logging
import shutil
import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["trajstore"]):
    from blake3 import blake3

    from trajstore.cas import LocalObjectStore
    from trajstore.cas.packs import decode_pack_index

_ROOT = Path(tempfile.mkdtemp(prefix="fuzz-idx-"))
atexit.register(shutil.rmtree, _ROOT, True)
_STORE = LocalObjectStore(_ROOT / "objects")
_PACKS = _ROOT / "objects" / "packs"
_PID = "f" * 32
logging.getLogger("trajstore").setLevel(logging.ERROR)  # one warning per corrupt index: noise


def _check_entries(entries: object, pack_size: int | None, who: str) -> None:
    if entries is None:
        return
    for off, ln in zip(entries["off"].tolist(), entries["len"].tolist(), strict=True):
        if pack_size is not None and off + ln > pack_size:
            raise AssertionError(f"{who}: entry ({off}, {ln}) beyond a {pack_size}-byte pack")


def one_input(data: bytes) -> None:
    """Feed one index to both readers; any exception is a finding."""
    if len(data) < 5:
        return
    sign, pack_size, body = data[0] & 1, int.from_bytes(data[1:5], "little"), data[5:]
    raw = body + blake3(body).digest() if sign else body
    _PACKS.mkdir(parents=True, exist_ok=True)
    (_PACKS / f"{_PID}.idx").write_bytes(raw)
    with open(_PACKS / f"{_PID}.pack", "wb") as f:
        f.truncate(pack_size)  # sparse: size without bytes
    _check_entries(_STORE.packs.read_index(_PID), pack_size, "PackSet.read_index")
    _STORE.corrupt_indexes.clear()
    _check_entries(decode_pack_index(raw), None, "decode_pack_index")


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
