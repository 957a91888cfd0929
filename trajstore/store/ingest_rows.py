"""Ingest, step 2 of 4: turn a verified payload into the rows the CAS arrays store.

Pure: reads no file, writes no object. A payload becomes one row per sample (so a
sample's tokens dedup wherever they recur), its `.pt` file an envelope around the
tensor bytes (the rows hold those), and the values the mismatch sums read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trajstore.bundle.checks import ROUTE_PAYLOADS
from trajstore.mismatch.compute import INPUT_PAYLOADS as MISMATCH_INPUTS
from trajstore.replay.source import as_float
from trajstore.schema import Index
from trajstore.store.ingest_gate import VerifiedPayload

#: route payloads stored as an XOR delta against this base payload when shapes match
DELTA_BASES = {
    "train_routed_experts": "rollout_routed_experts",
    "train_natural_routed_experts": "rollout_routed_experts",
}
BASE_NAMES = frozenset(DELTA_BASES.values())


def write_order(names: list[str]) -> list[str]:
    """Payload names in the order they are written: delta bases first (their deltas are
    written against them)."""
    return sorted(names, key=lambda n: (n not in BASE_NAMES, n))


@dataclass(frozen=True)
class SampleLayout:
    """The per-sample lengths every payload of a bundle is cut by (computed once a rank)."""

    response: list[int]
    total: list[int]
    #: prompt tokens of each sample: rows of prompt + response are windowed apart there
    heads: list[int]

    @classmethod
    def of(cls, index: Index) -> SampleLayout:
        samples = index.samples
        resp = [s.response_length for s in samples]
        total = [s.total_length for s in samples]
        return cls(resp, total, [max(0, t - r) for t, r in zip(total, resp, strict=True)])


def row_lengths(name: str, shape: tuple[int, ...], layout: SampleLayout) -> tuple[list[int], str]:
    """Chunk rows follow samples so a sample's tokens dedup wherever they recur: (lengths,
    the row kind: "response", "total" or "single")."""
    if len(shape) >= 1 and layout.response:
        order = (
            [("total", layout.total), ("response", layout.response)]
            if name in ROUTE_PAYLOADS
            else [("response", layout.response), ("total", layout.total)]
        )
        if name not in ROUTE_PAYLOADS and len(shape) != 1:
            order = [("total", layout.total)]
        for kind, lengths in order:
            if shape[0] == sum(lengths):
                return lengths, kind
    n = shape[0] if len(shape) >= 1 else 1
    return [n], "single"


@dataclass(frozen=True)
class PayloadRows:
    """A payload as it is written: its values one row per token, the row lengths, the row
    kind, the prompt heads (rows of prompt + response) or None, its `.pt` file as an
    envelope around those values (or whole, when they are not one span of it), and the
    values the mismatch sums read (None when they read none of this payload)."""

    name: str
    values: np.ndarray
    lengths: list[int]
    rows: str
    heads: list[int] | None
    dtype_tag: str
    shape: tuple[int, ...]
    file_bytes: int
    sha256: str
    envelope: bytes | None
    span: tuple[int, int] | None
    whole: bytes | None
    mismatch_input: np.ndarray | None


def payload_rows(p: VerifiedPayload, layout: SampleLayout) -> PayloadRows:
    """`p` as the CAS array and blobs that store it (no copy of its values: a view of the
    file's bytes, made contiguous only if it is not)."""
    t = p.tensor
    shape = tuple(t.shape)
    lengths, rows = row_lengths(p.name, shape, layout)
    values = np.ascontiguousarray(t.array).reshape(sum(lengths), *shape[1:])
    # Rows of prompt + response: the prompt is windowed apart, so a group's shared
    # prompt (the same prefill routes) is the same objects in every sample.
    heads = layout.heads if rows == "total" else None
    envelope = span = whole = None
    if t.data_span is not None and t.data_span[1] == values.nbytes:
        off, ln = t.data_span
        envelope, span = p.file[:off] + p.file[off + ln :], (off, ln)
    else:
        whole = p.file
    kept = None
    if p.name in MISMATCH_INPUTS:
        kept = values if p.name in ROUTE_PAYLOADS else as_float(values, t.dtype)
    return PayloadRows(
        p.name,
        values,
        lengths,
        rows,
        heads,
        t.dtype,
        shape,
        len(p.file),
        p.sha256,
        envelope,
        span,
        whole,
        kept,
    )
