"""Open a slime dump without running its pickle's code.

slime writes its dumps with ``torch.save`` and reads them back with
``torch.load(weights_only=False)``: any object, including one whose unpickling calls
``os.system``. Here every dump is read with ``torch.load(weights_only=True)`` (torch's
restricted unpickler: tensors, dicts, lists, tuples, sets, strings, numbers, bytes,
torch dtypes) plus the few NumPy globals a dump's plain values can need (a NumPy array or
scalar in a sample's ``metadata`` or ``reward``, written by a reward function or read
from a parquet file). Nothing else is built: a dump that asks for any other global (a
class, a function, ``os.system``, a slime ``Sample`` object) is refused with one line
naming it, before the store is opened.

The zip container torch.save writes keeps a CRC-32 of every member: each is checked
before torch reads it, so a flipped byte inside the pickle or a tensor's data is a
refusal, not a silently different value. (Bytes outside every member, e.g. the alignment
padding of a local header, are never read; a flip there changes nothing loaded.)
"""

from __future__ import annotations

import importlib
import re
import zipfile
from pathlib import Path
from typing import Any

from trajstore.errors import BundleError, IntegrityError


class UnsafeDumpError(BundleError):
    """A dump whose pickle asks for more than plain values (exit 2)."""


#: numpy.dtypes classes of the plain numeric dtypes (bool, ints, floats)
_NUMERIC_DTYPES = (
    "BoolDType",
    "Int8DType",
    "Int16DType",
    "Int32DType",
    "Int64DType",
    "UInt8DType",
    "UInt16DType",
    "UInt32DType",
    "UInt64DType",
    "Float16DType",
    "Float32DType",
    "Float64DType",
)


def _numpy_globals() -> list[Any]:
    """The NumPy callables an array or scalar's pickle names (numpy 1 or 2 module paths)."""
    import numpy as np

    out: list[Any] = [np.ndarray, np.dtype]
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        out += [mod._reconstruct, mod.scalar]
        break
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:  # numpy >= 1.25 may pickle a dtype through its class
        for name in _NUMERIC_DTYPES:
            cls = getattr(dtypes, name, None)
            if cls is not None:
                out.append(cls)
    return out


#: torch's message names the global it refused: "Unsupported global: GLOBAL os.system ..."
_GLOBAL = re.compile(r"(?:Unsupported global|unsupported GLOBAL)[^A-Za-z_]*(?:GLOBAL )?([\w.]+)")


def _check_zip(path: Path) -> None:
    """Every member's CRC-32 against its bytes (torch.save's container is a zip)."""
    try:
        if not zipfile.is_zipfile(path):
            raise IntegrityError(
                f"{path}: not a torch.save archive (a zip file); a slime dump is written by "
                "torch.save"
            )
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
    except zipfile.BadZipFile as exc:
        raise IntegrityError(f"{path}: damaged torch.save archive: {exc}") from None
    except (OSError, EOFError, RuntimeError, ValueError) as exc:
        raise IntegrityError(f"{path}: damaged torch.save archive: {exc}") from None
    if bad is not None:
        raise IntegrityError(
            f"{path}: damaged torch.save archive: member {bad} fails its CRC-32 check "
            "(the file was changed after slime wrote it)"
        )


def load_dump(path: str | Path) -> Any:
    """The object a slime dump holds, built by the restricted unpickler only."""
    import pickle

    import torch

    path = Path(path)
    if not path.is_file():
        raise BundleError(f"{path}: not a file")
    _check_zip(path)
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        found = _GLOBAL.search(text)
        what = f"the global {found.group(1)}" if found else "more than plain values"
        raise UnsafeDumpError(
            f"{path}: refused: its pickle asks for {what}, which a slime dump does not hold "
            "(loaded with weights_only=True: tensors, numbers, strings, lists, dicts, NumPy "
            "arrays); nothing was written"
        ) from None
    except (RuntimeError, EOFError, ValueError, KeyError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise IntegrityError(f"{path}: cannot be read as a torch.save file: {first}") from None
