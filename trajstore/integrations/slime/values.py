"""Any value a slime dump holds, as JSON that gives it back exactly.

Why: a dump's fields that trajstore does not model (prompt, response, metadata, status,
spec_info, top-p spans, fields newer slime versions add, ...) are kept in the bundle's
index.json, so `export --to slime` returns them as they were. JSON numbers, strings,
lists, dicts of string keys, booleans and null stand for themselves (floats round-trip
through ``repr``; NaN and Infinity are written as Python's json writes them). Anything
else becomes a one-key object ``{"$slime": [kind, ...]}``: a tuple, bytes, a torch tensor
or NumPy array (dtype, shape, base64 of its bytes), a NumPy scalar, a torch dtype, a set,
and a dict whose keys are not all strings, not in sorted order (JSON objects are written
with sorted keys; the pairs keep the order) or that include ``$slime``.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from trajstore.bundle.ptfile import TORCH_TO_NUMPY
from trajstore.errors import BundleError

TAG = "$slime"


def _is_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and type(value).__name__ in (
        "Tensor",
        "Parameter",
    )


def tensor_bits(value: Any) -> tuple[str, np.ndarray]:
    """(torch dtype name, a NumPy array holding its bits) of a CPU tensor."""
    import torch

    t = value.detach().cpu().contiguous()
    name = str(t.dtype)
    if name not in TORCH_TO_NUMPY:
        raise BundleError(f"tensor of dtype {name} cannot be kept (supported: plain numbers)")
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return name, t.numpy().view(TORCH_TO_NUMPY[name])


def tensor_from_bits(name: str, bits: np.ndarray) -> Any:
    """The torch tensor of dtype `name` whose bits are `bits`."""
    import torch

    # one copy (the tensor owns it); np.array, not np.ascontiguousarray, which would turn
    # a 0-d array into shape (1,)
    arr = np.array(bits, order="C", copy=True).view(TORCH_TO_NUMPY[name])
    if name == "torch.bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def tensor_of_bits(name: str, bits: np.ndarray) -> Any:
    """The torch tensor of dtype `name` over the C-contiguous array `bits` (no copy: the
    tensor shares its memory)."""
    import torch

    arr = bits.view(TORCH_TO_NUMPY[name])
    if name == "torch.bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def encode(value: Any) -> Any:
    """`value` as JSON that `decode` turns back into an equal value of the same types."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) is list:
        return [encode(v) for v in value]
    if type(value) is dict:
        keys = list(value)
        # a JSON object is written with sorted keys: kept as one only when that is its order
        if all(type(k) is str for k in keys) and TAG not in value and keys == sorted(keys):
            return {k: encode(v) for k, v in value.items()}
        return {TAG: ["dict", [[encode(k), encode(v)] for k, v in value.items()]]}
    if type(value) is tuple:
        return {TAG: ["tuple", [encode(v) for v in value]]}
    if type(value) in (bytes, bytearray):
        return {TAG: [type(value).__name__, base64.b64encode(bytes(value)).decode("ascii")]}
    if type(value) in (set, frozenset):
        return {TAG: [type(value).__name__, [encode(v) for v in value]]}
    if _is_tensor(value):
        name, bits = tensor_bits(value)
        data = base64.b64encode(bits.tobytes()).decode("ascii")
        return {TAG: ["tensor", name, list(bits.shape), data]}
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            raise BundleError(f"a NumPy array of dtype {value.dtype} cannot be kept")
        arr = np.array(value, order="C")
        data = base64.b64encode(arr.tobytes()).decode("ascii")
        return {TAG: ["ndarray", arr.dtype.str, list(arr.shape), data]}
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return {TAG: ["npscalar", value.dtype.str, encode(value.item())]}
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return {TAG: ["torch_dtype", str(value)]}
    raise BundleError(f"a value of type {type(value).__name__} cannot be kept")


def decode(value: Any) -> Any:
    """The value `encode` was given."""
    if type(value) is list:
        return [decode(v) for v in value]
    if type(value) is not dict:
        return value
    if TAG not in value or len(value) != 1:
        return {k: decode(v) for k, v in value.items()}
    kind, *rest = value[TAG]
    if kind == "dict":
        return {decode(k): decode(v) for k, v in rest[0]}
    if kind == "tuple":
        return tuple(decode(v) for v in rest[0])
    if kind in ("bytes", "bytearray"):
        data = base64.b64decode(rest[0])
        return data if kind == "bytes" else bytearray(data)
    if kind in ("set", "frozenset"):
        items = [decode(v) for v in rest[0]]
        return set(items) if kind == "set" else frozenset(items)
    if kind == "tensor":
        name, shape, data = rest
        bits = np.frombuffer(base64.b64decode(data), dtype=TORCH_TO_NUMPY[name])
        return tensor_from_bits(name, bits.reshape(shape))
    if kind == "ndarray":
        dtype, shape, data = rest
        return np.frombuffer(base64.b64decode(data), dtype=np.dtype(dtype)).reshape(shape).copy()
    if kind == "npscalar":
        return np.dtype(rest[0]).type(decode(rest[1]))
    if kind == "torch_dtype":
        import torch

        return getattr(torch, rest[0].removeprefix("torch."))
    raise BundleError(f"index.json: unknown kept-value kind {kind!r}")
