"""Canonical JSON, JSON-safe values, file reading and hashing, temp-file names and atomic
creates shared by the bundle writer and reader and the store."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Any

from trajstore.errors import BundleError, UsageError
from trajstore.pools import SharedPool

try:  # about 5x faster than the stdlib on bundle documents (long int lists: loss masks)
    import orjson as _orjson
except ImportError:  # pragma: no cover - a dependency; the stdlib alone gives the same results
    _orjson = None

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


class _NotExact(Exception):
    """A value orjson would write differently from the stdlib (or not at all)."""


#: floats orjson writes exactly as Python's repr: zero and 1e-4 <= |x| < 1e16 (outside, repr
#: switches to exponent notation: 1e-05, 1e+16; orjson writes 0.00001, 1e16)
_EXACT_FLOAT_LO, _EXACT_FLOAT_HI = 1e-4, 1e16
_INT_LO, _INT_HI = -(1 << 63), 1 << 64  # orjson's integer range


#: orjson >= 3.10 writes a Fragment's bytes verbatim: how a number orjson would spell
#: differently is written in the stdlib's spelling (without it, the document falls back)
_FRAGMENT = getattr(_orjson, "Fragment", None)
_NON_FINITE = {"nan": b"NaN", "inf": b"Infinity", "-inf": b"-Infinity"}  # json's allow_nan


def _stdlib_number(x: int | float) -> Any:
    """A number as the stdlib's json spells it, for orjson to write verbatim."""
    if _FRAGMENT is None:
        raise _NotExact
    if type(x) is float:
        text = _NON_FINITE.get(repr(x))
        return _FRAGMENT(text if text is not None else float.__repr__(x).encode())
    return _FRAGMENT(int.__repr__(x).encode())


def _exact_float(x: float) -> bool:
    return x == 0.0 or _EXACT_FLOAT_LO <= abs(x) < _EXACT_FLOAT_HI  # False for NaN


def _orjson_plain(obj: Any) -> Any:
    """``obj`` as a value orjson writes byte for byte as `canonical_dumps` would: plain
    dicts (str keys), lists, str, int, bool and None as they are; a float or int orjson
    spells otherwise (1e-05, NaN, beyond 64 bits) as a Fragment of the stdlib's spelling;
    a str subclass (a `StrEnum` stage name) as its plain text, as the stdlib writes it.
    Raises _NotExact for anything else (the stdlib path then decides)."""
    kind = type(obj)
    if kind is str or kind is bool or obj is None:
        return obj
    if kind is int:
        return obj if _INT_LO <= obj < _INT_HI else _stdlib_number(obj)
    if kind is float:
        return obj if _exact_float(obj) else _stdlib_number(obj)
    if kind is dict:
        out = {}
        for key, value in obj.items():
            if type(key) is not str:
                if not isinstance(key, str):
                    raise _NotExact  # the stdlib turns int/float/bool/None keys into text
                key = str.__str__(key)
            out[key] = _orjson_plain(value)
        return out
    if kind is list or kind is tuple:
        ints = all(type(x) is int for x in obj)  # loss masks, shapes: a document's bulk
        if ints and (not obj or (min(obj) >= _INT_LO and max(obj) < _INT_HI)):
            return obj
        return [_orjson_plain(x) for x in obj]
    if isinstance(obj, str):
        return str.__str__(obj)
    raise _NotExact


def canonical_bytes(obj: Any) -> bytes:
    """`canonical_dumps` as UTF-8, through orjson when it writes the same bytes (about 10x
    faster: the capture writer and ingest write several documents per bundle); tests pin
    that both agree."""
    if _orjson is not None:
        try:
            plain = _orjson_plain(obj)
            return _orjson.dumps(plain, option=_orjson.OPT_INDENT_2 | _orjson.OPT_SORT_KEYS) + b"\n"
        except (_NotExact, TypeError, RecursionError):
            pass  # orjson.JSONEncodeError is a TypeError (e.g. a lone surrogate, deep nesting)
    return canonical_dumps(obj).encode("utf-8")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


#: open flags of the one-syscall read: never through a symlink, never waiting on a FIFO
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
#: files up to this size are read with one os.read (Linux reads at most ~2 GiB per call)
_ONE_READ = 1 << 30


def read_regular(path: Path | str, limit: int) -> bytes | None:
    """The bytes of ``path`` when it is a regular file (not a symlink) of at most ``limit``
    bytes, read with one open and one fstat; None for anything else (the caller's checked
    path then words the refusal)."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except (OSError, ValueError):
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        if st.st_size > _ONE_READ:
            with open(fd, "rb", closefd=False) as f:
                return f.read()
        data = os.read(fd, st.st_size) if st.st_size else b""
        if len(data) != st.st_size or os.read(fd, 1):
            return None  # it changed size while read: the checked path reads it again
        return data
    except OSError:
        return None
    finally:
        os.close(fd)


def user_path(path: str | os.PathLike[str]) -> Path:
    """A local path as a user wrote it, a leading `~` being their home directory. pathlib
    does not expand it, the shell does not in `--store=~/runs` or in an env file, and a
    literal `./~/runs` was created instead (reported as "~/runs")."""
    return Path(os.path.expanduser(os.fspath(path)))


def temp_sibling(path: Path) -> Path:
    """A hidden, unique temp name beside `path`: written there, then linked or renamed
    into place, so the final name never holds a partial file (readers skip dot names)."""
    return path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"


def check_creatable(path: Path) -> None:
    """Refuse an output path that cannot be created because an ancestor is not a directory
    (`out/x` where `out` is a file): one line naming it, instead of the OSError of a
    mkdir deep inside a command, after its work was done."""
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"{parent}: exists and is not a directory (needed for {path})")
            return


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by name (a directory's entries: its links)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: threads fsyncing a batch of files (they wait on the disk, not the CPU)
_FSYNC_THREADS = 8
_fsync_pool = SharedPool(_FSYNC_THREADS, "fsync")


def fsync_all(paths: list[Path]) -> None:
    """fsync every path (files or directories) at once, on threads: fsyncs issued together
    share the file system's journal commits, where one after the other each waits for
    its own."""
    if len(paths) < 2:
        for p in paths:
            fsync_path(p)
        return
    pool = _fsync_pool.get()
    for f in [pool.submit(fsync_path, p) for p in paths]:
        f.result()


def atomic_create(path: Path, data: bytes, *, durable: bool = True) -> bool:
    """Create `path` holding `data` unless it exists; False if it did.

    temp + fsync + link: the final name never holds a partial file and an
    existing file is never replaced, so this is a commit point (a store's refs, a
    cohort's COMPLETE). `durable` also fsyncs the directory, so the link survives
    a crash.
    """
    tmp = temp_sibling(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        if durable:
            fsync_path(path.parent)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def read_bytes(path: Path, label: str, limit: int = MAX_JSON_BYTES) -> bytes:
    """Read a regular file (never through a symlink), refusing oversize ones."""
    data = read_regular(path, limit)
    return data if data is not None else _read_bytes_checked(path, label, limit)


def _read_bytes_checked(path: Path, label: str, limit: int) -> bytes:
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


#: digits -> b"9", every other byte -> b" ": a run of _LONG_INT of them is a possible integer
#: outside orjson's 64-bit range (which orjson would return as a float, the stdlib as an int)
_DIGIT_MAP = bytes(0x39 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_LONG_INT = b"9" * 19  # 18 digits always fit in an int64; 19 or more may not
#: bytes translated per step of the long-digit-run scan (bounds its temporary copy)
_SCAN_BYTES = 16 << 20


def _has_long_digit_run(data: bytes) -> bool:
    """True when ``data`` holds 19 or more consecutive ASCII digits (anywhere, strings too)."""
    step = _SCAN_BYTES
    overlap = len(_LONG_INT) - 1
    for start in range(0, max(len(data), 1), step):
        block = data[max(0, start - overlap) : start + step]
        if _LONG_INT in block.translate(_DIGIT_MAP):
            return True
    return False


def _parse_stdlib(data: bytes, label: str) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"{label}: malformed JSON ({exc})") from None
    except RecursionError:  # e.g. 100,000 nested '[': a hostile document, not a crash
        raise BundleError(f"{label}: JSON nested too deeply") from None


def _plain(obj: Any, depth: int = 0) -> bool:
    """Whether `obj` is made only of what orjson and the stdlib write alike: dicts with
    string keys, lists, tuples, printable ASCII strings, bools, None and plain ints (a
    float may be written another way, other text escaped by one and not the other)."""
    if depth > 64:
        return False
    t = type(obj)
    if t is str:  # printable ASCII: the stdlib escapes DEL (0x7f), orjson may not
        return obj.isascii() and obj.isprintable()
    if obj is None or t is bool or t is int:
        return True
    if t is dict:
        return all(type(k) is str and k.isascii() and _plain(v, depth + 1) for k, v in obj.items())
    if t is list or t is tuple:
        return all(_plain(v, depth + 1) for v in obj)
    return False


_LEADING = re.compile(rb"^((?:  )+)", re.M)


def dumps_sorted_indent1(obj: Any) -> bytes:
    """``json.dumps(obj, sort_keys=True, indent=1).encode()``, byte for byte.

    A store's ref documents are written so; the stdlib's encoder is pure Python once an
    indent is asked for (about 1 ms for a ref, a tenth of a small bundle's ingest). orjson
    writes the same document with indent 2 in a few microseconds, halved here line by
    line (a JSON string holds no raw newline); whatever orjson might write differently
    (`_plain` says no, or orjson refuses it, e.g. an int beyond 64 bits) goes to the stdlib.
    """
    if _orjson is not None and _plain(obj):
        try:
            text = _orjson.dumps(obj, option=_orjson.OPT_SORT_KEYS | _orjson.OPT_INDENT_2)
        except (TypeError, _orjson.JSONEncodeError):
            pass
        else:
            return _LEADING.sub(lambda m: m[1][: len(m[1]) // 2], text)
    return json.dumps(obj, sort_keys=True, indent=1).encode()


#: `parse_json_fast`'s answer when orjson cannot give the stdlib's result
NOT_PARSED = object()


def parse_json_fast(data: bytes) -> Any:
    """orjson's parse of ``data`` where it gives ``json.loads``' result, else `NOT_PARSED`
    (the caller then parses with the stdlib, which also words the error).

    orjson refuses what the stdlib accepts beyond strict JSON (NaN, Infinity, 1e400,
    lone surrogate escapes, nesting past 1024) and would turn an integer outside 64 bits
    into a float, so a document it refuses, or one with a run of 19+ digits, is not
    parsed here.
    """
    if _orjson is not None and type(data) is bytes and not _has_long_digit_run(data):
        try:
            return _orjson.loads(data)
        except _orjson.JSONDecodeError:
            pass
    return NOT_PARSED


def parse_json(data: bytes, label: str) -> Any:
    """``json.loads`` of UTF-8 ``data``, or a one-line BundleError naming ``label``
    (orjson where it gives the same result: `parse_json_fast`)."""
    value = parse_json_fast(data)
    return _parse_stdlib(data, label) if value is NOT_PARSED else value


def is_binary_int_list(values: list) -> bool:
    """True when every item of ``values`` is the int 0 or 1 (no bool, float or other type),
    in one C pass: orjson writes such a list of n items as exactly 2n+1 bytes of ``[],01``
    (any other item is longer or writes another byte). False says "not proven": the
    caller runs its exact check (always, without orjson).
    """
    if _orjson is None or type(values) is not list or not values:
        return False
    try:
        text = _orjson.dumps(values)
    except (TypeError, _orjson.JSONEncodeError):  # e.g. an int beyond 64 bits
        return False
    return len(text) == 2 * len(values) + 1 and not text.translate(None, b"[],01")


def read_json(path: Path, label: str) -> Any:
    return parse_json(read_bytes(path, label), label)
