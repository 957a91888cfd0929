"""The one interface the replay engine reads a bundle through.

A bundle directory (`trajstore.bundle.reader.Bundle`) and a bundle in the
store both provide it, so the engine never knows where bytes come from.
`rows` lets a store read only the chunks of the selected samples.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from trajstore.replay.kernels import segment_offsets
from trajstore.schema import Index, Manifest


@runtime_checkable
class BundleSource(Protocol):
    """What replay needs of a bundle: documents plus payload arrays."""

    manifest: Manifest
    index: Index
    expected: dict[str, Any]
    rank: int | None

    @property
    def label(self) -> str: ...

    def payload_names(self) -> list[str]: ...

    def payload(self, name: str) -> np.ndarray:
        """The whole payload (torch dtype bits; bf16 as uint16)."""
        ...


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """Exact widening of bfloat16 bits (uint16) to float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def as_float(arr: np.ndarray, torch_dtype: str) -> np.ndarray:
    """Float view for the math: bf16/fp16 widen to float32, float64 stays."""
    if torch_dtype == "torch.bfloat16":
        return bf16_to_float32(arr)
    if arr.dtype == np.float64:
        return arr
    return arr.astype(np.float32, copy=False)


def slice_rows(flat: np.ndarray, lengths: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Concatenate the token spans of ``positions`` out of a flat per-token array."""
    offsets = segment_offsets(lengths)
    if len(positions) == 0:
        return flat[:0]
    idx = np.concatenate([np.arange(offsets[p], offsets[p + 1]) for p in positions])
    return flat[idx]


def payload_rows(
    source: BundleSource, name: str, positions: np.ndarray | None, lengths: np.ndarray
) -> np.ndarray:
    """A per-token payload restricted to the samples at ``positions`` (None: all).

    Sources that can fetch only some rows (the store) define ``payload_rows``.
    """
    if positions is None:
        return source.payload(name)
    own = getattr(source, "payload_rows", None)
    if own is not None:
        return own(name, positions)
    return slice_rows(source.payload(name), lengths, positions)
