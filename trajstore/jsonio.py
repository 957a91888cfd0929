"""Canonical JSON, JSON-safe values and file hashing shared by the bundle writer and reader."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

from trajstore.errors import BundleError

#: Refuse JSON documents larger than this before parsing them.
MAX_JSON_BYTES = 256 << 20


def canonical_dumps(obj: Any) -> str:
    """The bundle format's JSON: sorted keys, indent 2, UTF-8, trailing newline."""
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def json_safe(value: Any, *, finite_only: bool = True) -> Any:
    """``value`` with NumPy scalars and 0-d tensors as plain numbers, dicts/lists recursed.

    With ``finite_only`` (strict JSON has no NaN/Infinity) a non-finite float
    becomes None; without it, it stays (Python's json writes NaN). The one
    cleaner for every JSON document trajstore writes or serves.
    """
    if isinstance(value, float):
        return value if not finite_only or math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_safe(item, finite_only=finite_only) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item, finite_only=finite_only) for item in value]
    if callable(getattr(value, "item", None)):
        return json_safe(value.item(), finite_only=finite_only)  # NumPy scalar, 0-d tensor
    return value


def canonical_bytes(obj: Any) -> bytes:
    return canonical_dumps(obj).encode("utf-8")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_bytes(path: Path, label: str, limit: int = MAX_JSON_BYTES) -> bytes:
    """Read a regular file (never through a symlink), refusing oversize ones."""
    if path.is_symlink():
        raise BundleError(f"{label}: is a symlink ({path}); refused")
    try:
        size = path.stat().st_size
        if size > limit:
            raise BundleError(f"{label}: {size} bytes exceeds the limit of {limit}")
        return path.read_bytes()
    except FileNotFoundError:
        raise BundleError(f"{label}: missing ({path})") from None
    except IsADirectoryError:
        raise BundleError(f"{label}: is a directory ({path})") from None
    except OSError as exc:
        raise BundleError(f"{label}: unreadable ({exc.strerror}: {path})") from None


def parse_json(data: bytes, label: str) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"{label}: malformed JSON ({exc})") from None
    except RecursionError:  # e.g. 100,000 nested '[': a hostile document, not a crash
        raise BundleError(f"{label}: JSON nested too deeply") from None


def read_json(path: Path, label: str) -> Any:
    return parse_json(read_bytes(path, label), label)
