"""Read `torch.save` files without torch and without running their pickle.

`torch.load(weights_only=True)` costs a 1.4 s torch import here and still
runs an unpickler over untrusted bytes. This reader parses the zip container
that `torch.save` writes (``<archive>/data.pkl`` + ``<archive>/data/<key>``)
with an unpickler that resolves only the handful of globals a plain tensor
needs; anything else (a class, a function, a non-tensor result) is refused
before any object is built, so a malicious payload's code never runs.

The result is a NumPy array plus the torch dtype name, bit-identical to what
``torch.load`` returns. bfloat16 has no NumPy dtype: its bits come back as
uint16 with ``dtype == "torch.bfloat16"``.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import struct
import zipfile
import zlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from trajstore.errors import BundleError

# torch storage class name -> (torch dtype name, numpy dtype)
_STORAGES: dict[str, tuple[str, str]] = {
    "FloatStorage": ("torch.float32", "<f4"),
    "DoubleStorage": ("torch.float64", "<f8"),
    "HalfStorage": ("torch.float16", "<f2"),
    "BFloat16Storage": ("torch.bfloat16", "<u2"),
    "LongStorage": ("torch.int64", "<i8"),
    "IntStorage": ("torch.int32", "<i4"),
    "ShortStorage": ("torch.int16", "<i2"),
    "CharStorage": ("torch.int8", "i1"),
    "ByteStorage": ("torch.uint8", "u1"),
    "BoolStorage": ("torch.bool", "?"),
    "UInt16Storage": ("torch.uint16", "<u2"),
    "UInt32Storage": ("torch.uint32", "<u4"),
    "UInt64Storage": ("torch.uint64", "<u8"),
}

#: torch dtype name -> numpy dtype used to hold its bits.
TORCH_TO_NUMPY: dict[str, np.dtype] = {t: np.dtype(n) for t, n in _STORAGES.values()}
NUMPY_TO_TORCH: dict[str, str] = {
    "float32": "torch.float32",
    "float64": "torch.float64",
    "float16": "torch.float16",
    "int64": "torch.int64",
    "int32": "torch.int32",
    "int16": "torch.int16",
    "int8": "torch.int8",
    "uint8": "torch.uint8",
    "bool": "torch.bool",
    "uint16": "torch.uint16",
    "uint32": "torch.uint32",
    "uint64": "torch.uint64",
}

#: Refuse absurd declared sizes before allocating anything.
MAX_ELEMENTS = 1 << 34
#: A tensor's pickle is a few hundred bytes; a larger data.pkl is refused unread.
MAX_PICKLE_BYTES = 1 << 20


@dataclass(frozen=True)
class _StorageType:
    torch_dtype: str
    np_dtype: np.dtype


@dataclass(frozen=True)
class _StorageRef:
    key: str
    stype: _StorageType
    numel: int


@dataclass
class _TensorSpec:
    storage: _StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class PtTensor:
    """A tensor read from a .pt file: torch dtype name, shape and values."""

    dtype: str
    shape: tuple[int, ...]
    array: np.ndarray
    #: byte range of the tensor's data inside the file (contiguous tensors only)
    data_span: tuple[int, int] | None

    def to_torch(self):  # noqa: ANN201 - torch is optional at import time
        """Convert to a torch tensor (imports torch)."""
        import torch

        arr = np.ascontiguousarray(self.array)
        if self.dtype == "torch.bfloat16":
            return torch.from_numpy(arr.copy()).view(torch.bfloat16)
        return torch.from_numpy(arr.copy())


def _rebuild_tensor_v2(
    storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None
):  # noqa: ANN001
    if not isinstance(storage, _StorageRef):
        raise pickle.UnpicklingError("tensor storage is not a storage reference")
    if backward_hooks:
        raise pickle.UnpicklingError("tensor carries backward hooks")
    return _TensorSpec(
        storage, int(storage_offset), tuple(int(s) for s in size), tuple(int(s) for s in stride)
    )


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only what a plain tensor needs; refuses every other global."""

    def find_class(self, module: str, name: str):  # noqa: ANN201
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor_v2
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch" and name in _STORAGES:
            tname, npname = _STORAGES[name]
            return _StorageType(tname, np.dtype(npname))
        raise pickle.UnpicklingError(f"refused pickle global {module}.{name}")

    def persistent_load(self, pid):  # noqa: ANN001, ANN201
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unsupported persistent id {pid!r:.60}")
        _, stype, key, _location, numel = pid
        if not isinstance(stype, _StorageType):
            raise pickle.UnpicklingError("storage type is not a known tensor storage")
        return _StorageRef(str(key), stype, int(numel))


def _local_data_offset(raw: bytes, info: zipfile.ZipInfo, label: str) -> int:
    """Offset of a stored member's bytes: local header + name + extra, inside ``raw``."""
    start = info.header_offset
    if start < 0 or raw[start : start + 4] != b"PK\x03\x04" or len(raw) < start + 30:
        raise BundleError(f"{label}: bad zip local header for {info.filename!r}")
    name_len, extra_len = struct.unpack("<HH", raw[start + 26 : start + 30])
    off = start + 30 + name_len + extra_len
    if off + info.file_size > len(raw):
        raise BundleError(f"{label}: zip member {info.filename!r} runs past the end of the file")
    return off


#: What a damaged zip member's read raises (CRC, truncation, odd compression, encryption).
_ZIP_READ_ERRORS = (
    zipfile.BadZipFile,
    zlib.error,
    NotImplementedError,
    RuntimeError,
    EOFError,
    OSError,
    ValueError,
    OverflowError,
    struct.error,
)


def _read_member(zf: zipfile.ZipFile, name: str, label: str, limit: int) -> bytes:
    """A member's bytes, its declared size checked against ``limit`` before inflating it."""
    try:
        info = zf.getinfo(name)
        if info.file_size > limit:
            raise BundleError(
                f"{label}: zip member {name!r} declares {info.file_size} bytes, "
                f"beyond the limit of {limit}"
            )
        return zf.read(info)
    except _ZIP_READ_ERRORS as exc:
        raise BundleError(f"{label}: unreadable zip member {name!r} ({exc})") from None


#: A tensor pickle memoizes a handful of objects; C's unpickler sizes its memo to the index.
MAX_MEMO_INDEX = 1 << 16
_PUT_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


def _check_memo_indices(pickled: bytes, label: str) -> None:
    """Refuse a memo index that would make the unpickler allocate gigabytes (LONG_BINPUT 2**31).

    Scans opcodes without building anything (pickletools); a stream it cannot
    walk is refused as unreadable.
    """
    try:
        for op, arg, _ in pickletools.genops(pickled):
            if op.name in _PUT_OPS and not (isinstance(arg, int) and 0 <= arg < MAX_MEMO_INDEX):
                raise BundleError(f"{label}: pickle memo index {arg!r:.20} is beyond the limit")
    except (ValueError, EOFError, UnicodeDecodeError, struct.error, OverflowError) as exc:
        raise BundleError(f"{label}: unsafe or unreadable pickle: {exc}") from None


#: Tensor records already checked, by their pickle's bytes: a bundle's payloads of one shape
#: and dtype share one pickle, so it is walked and unpickled once (bounded: pickles up to
#: _RECORD_BYTES, a tensor's is ~150, and _RECORDS_MAX of them; cleared when full).
_RECORDS: dict[bytes, _TensorSpec] = {}
_RECORDS_MAX = 256
_RECORD_BYTES = 4096


def _tensor_record(pickled: bytes, label: str) -> _TensorSpec:
    """The checked tensor record of a data.pkl (memo indices, restricted unpickle, fields)."""
    obj = _RECORDS.get(pickled)
    if obj is not None:
        return obj
    _check_memo_indices(pickled, label)
    try:
        obj = _RestrictedUnpickler(io.BytesIO(pickled)).load()
    except (
        pickle.UnpicklingError,
        EOFError,
        TypeError,
        ValueError,
        AttributeError,
        OverflowError,  # a FRAME declaring 2**63 bytes
        KeyError,
        IndexError,
        RecursionError,
        struct.error,
    ) as exc:
        raise BundleError(f"{label}: unsafe or unreadable pickle: {exc}") from None
    if not isinstance(obj, _TensorSpec):
        raise BundleError(f"{label}: does not hold a plain tensor (got {type(obj).__name__})")
    _check_spec(obj, label)
    if len(pickled) <= _RECORD_BYTES:
        if len(_RECORDS) >= _RECORDS_MAX:
            _RECORDS.clear()
        _RECORDS[pickled] = obj
    return obj


def read_pt_bytes(raw: bytes, *, label: str = "payload") -> PtTensor:
    """Parse the bytes of a `torch.save` file holding exactly one plain tensor."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(raw))
        names = zf.namelist()
    except _ZIP_READ_ERRORS as exc:
        raise BundleError(f"{label}: not a torch.save zip file ({exc})") from None
    pkl = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkl) != 1:
        raise BundleError(f"{label}: not a torch.save file (no single <archive>/data.pkl)")
    root = pkl[0][: -len("data.pkl")]
    byteorder = root + "byteorder"
    if byteorder in names and _read_member(zf, byteorder, label, 64).strip() not in (
        b"little",
        b"",
    ):
        raise BundleError(f"{label}: big-endian torch files are not supported")
    pickled = _read_member(zf, pkl[0], label, MAX_PICKLE_BYTES)
    obj = _tensor_record(pickled, label)
    st = obj.storage
    numel = 1
    for s in obj.size:
        if s < 0 or s > MAX_ELEMENTS:
            raise BundleError(f"{label}: dimension {s} of shape {obj.size!r:.80} is out of range")
        numel *= s
    if numel > MAX_ELEMENTS or st.numel > MAX_ELEMENTS:
        raise BundleError(f"{label}: declared size {numel} elements is beyond the limit")
    member = f"{root}data/{st.key}"
    try:
        info = zf.getinfo(member)
    except KeyError:
        raise BundleError(f"{label}: storage record {member!r} missing") from None
    itemsize = st.stype.np_dtype.itemsize
    if info.file_size != st.numel * itemsize:
        raise BundleError(
            f"{label}: storage holds {info.file_size} bytes, declared {st.numel * itemsize}"
        )
    if info.compress_type == zipfile.ZIP_STORED:
        off = _local_data_offset(raw, info, label)
        data = np.frombuffer(raw, dtype=st.stype.np_dtype, count=st.numel, offset=off)
    elif info.compress_type == zipfile.ZIP_DEFLATED:
        # deflate inflates at most ~1032:1, so memory stays within ~1000x the file's size;
        # bzip2/lzma can inflate a few KB to the 128 GiB MAX_ELEMENTS allows: refused below
        off = None
        member_bytes = _read_member(zf, member, label, info.file_size)
        if len(member_bytes) != info.file_size:
            raise BundleError(f"{label}: storage record {member!r} inflates to the wrong size")
        data = np.frombuffer(member_bytes, dtype=st.stype.np_dtype)
    else:
        raise BundleError(
            f"{label}: storage record {member!r} uses zip compression {info.compress_type}; "
            "only stored (torch.save's) or deflated records are read"
        )
    contiguous = _is_contiguous(obj.size, obj.stride)
    if numel == 0:
        arr = np.zeros(obj.size, dtype=st.stype.np_dtype)
        span = None
    elif contiguous:
        if obj.offset < 0 or obj.offset + numel > st.numel:
            raise BundleError(f"{label}: tensor view exceeds its storage")
        arr = data[obj.offset : obj.offset + numel].reshape(obj.size)
        span = (off + obj.offset * itemsize, numel * itemsize) if off is not None else None
    else:
        last = obj.offset + sum((s - 1) * abs(t) for s, t in zip(obj.size, obj.stride, strict=True))
        if obj.offset < 0 or last >= st.numel or any(t < 0 for t in obj.stride):
            raise BundleError(f"{label}: tensor view exceeds its storage")
        if numel > st.numel:
            # stride 0 / overlapping strides: a 1.5 KB file would materialize gigabytes
            raise BundleError(
                f"{label}: tensor view repeats storage elements ({numel} elements from a "
                f"{st.numel}-element storage: an expanded tensor); save it contiguous"
            )
        arr = np.lib.stride_tricks.as_strided(
            data[obj.offset :], shape=obj.size, strides=[t * itemsize for t in obj.stride]
        ).copy()
        span = None
    return PtTensor(st.stype.torch_dtype, tuple(obj.size), arr, span)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_spec(obj: _TensorSpec, label: str) -> None:
    """Refuse a tensor record whose fields a crafted pickle (BUILD) made odd."""
    st = obj.storage
    ok = (
        isinstance(st, _StorageRef)
        and isinstance(st.stype, _StorageType)
        and isinstance(st.stype.np_dtype, np.dtype)
        and isinstance(st.key, str)
        and _is_int(st.numel)
        and st.numel >= 0
        and _is_int(obj.offset)
        and isinstance(obj.size, tuple)
        and isinstance(obj.stride, tuple)
        and len(obj.size) == len(obj.stride)
        and all(_is_int(s) for s in obj.size + obj.stride)
    )
    if not ok:
        raise BundleError(f"{label}: malformed tensor record (storage, offset, size or stride)")


def _is_contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for s, t in zip(reversed(size), reversed(stride), strict=True):
        if s != 1 and t != expected:
            return False
        expected *= s
    return True


def tensor_to_numpy(value) -> tuple[np.ndarray, str]:  # noqa: ANN001
    """(numpy bits, torch dtype name) of a torch tensor or numpy array."""
    if isinstance(value, np.ndarray):
        name = NUMPY_TO_TORCH.get(value.dtype.name)
        if name is None:
            raise BundleError(f"unsupported numpy dtype {value.dtype}")
        return value, name
    import torch

    t = value.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy(), "torch.bfloat16"
    return t.numpy(), str(t.dtype)


def as_torch(value):  # noqa: ANN001, ANN201
    """A detached, contiguous CPU torch tensor from a torch tensor or numpy array."""
    import torch

    if isinstance(value, np.ndarray):
        tensor_to_numpy(value)  # refuses unsupported dtypes
        return torch.from_numpy(np.ascontiguousarray(value).copy())
    return value.detach().cpu().contiguous().clone()
