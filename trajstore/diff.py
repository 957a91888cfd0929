"""`trajstore diff`: what differs between two bundles, down to the token.

Each side is anything that provides the replay source interface (a bundle
directory or a stored bundle). Per-token payloads are compared per sample,
matched by sample_id, so a reordering is reported once, as a sample-order
difference, not as a difference at every token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trajstore.bundle.checks import PER_TOKEN_PAYLOADS, ROUTE_PAYLOADS


@dataclass
class Difference:
    kind: str  # identity | samples | config | expected | payload
    what: str
    detail: str
    sample_id: str | None = None
    token_offset: int | None = None
    a: Any = None
    b: Any = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class DiffReport:
    a: str
    b: str
    differences: list[Difference] = field(default_factory=list)

    @property
    def same(self) -> bool:
        return not self.differences

    @property
    def exit_code(self) -> int:
        return 0 if self.same else 1

    def first_payload_difference(self) -> Difference | None:
        return next((d for d in self.differences if d.kind == "payload"), None)

    def to_dict(self) -> dict[str, Any]:
        fp = self.first_payload_difference()
        return {
            "a": self.a,
            "b": self.b,
            "same": self.same,
            "first_payload_difference": None if fp is None else fp.to_dict(),
            "differences": [d.to_dict() for d in self.differences],
        }

    def format(self) -> str:
        if self.same:
            return (
                f"{self.a} and {self.b}: identical "
                "(identity, samples, config, expected values, payloads)"
            )
        lines = [f"{self.a} vs {self.b}: {len(self.differences)} difference(s)"]
        for d in self.differences:
            where = d.what
            if d.sample_id is not None:
                where += f" {d.sample_id}" + (
                    f"@{d.token_offset}" if d.token_offset is not None else ""
                )
            line = f"  [{d.kind}] {where}: {d.detail}"
            if d.a is not None or d.b is not None:
                line += f" (a={d.a!r} b={d.b!r})"
            lines.append(line)
        fp = self.first_payload_difference()
        if fp is not None and fp.sample_id is not None:
            lines.append(
                f"first differing payload: {fp.what} at {fp.sample_id}@{fp.token_offset}: "
                f"a={fp.a!r} b={fp.b!r}"
            )
        elif fp is not None:  # a payload on one side only, or of another dtype or shape
            both = f" (a={fp.a!r} b={fp.b!r})" if fp.a is not None or fp.b is not None else ""
            lines.append(f"first differing payload: {fp.what}: {fp.detail}{both}")
        return "\n".join(lines)


def _first_dict_difference(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any] | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return (f"{path}{k}", a.get(k, "<absent>"), b.get(k, "<absent>"))
            got = _first_dict_difference(a[k], b[k], f"{path}{k}.")
            if got:
                return got
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            got = _first_dict_difference(x, y, f"{path}[{i}].")
            if got:
                return got
        return None
    if a != b and not (
        isinstance(a, float) and isinstance(b, float) and np.isnan(a) and np.isnan(b)
    ):
        return (path.rstrip("."), a, b)
    return None


def _token_lengths(src: Any, name: str) -> list[int] | None:
    if name in PER_TOKEN_PAYLOADS:
        return [s.response_length for s in src.index.samples]
    if name in ROUTE_PAYLOADS:
        return [s.total_length for s in src.index.samples]
    return None


def _segments(src: Any, name: str) -> dict[str, np.ndarray] | None:
    lengths = _token_lengths(src, name)
    arr = src.payload(name)
    if lengths is None or arr.shape[0] != sum(lengths):
        return None
    out, start = {}, 0
    for s, n in zip(src.index.samples, lengths, strict=True):
        out[s.sample_id] = arr[start : start + n]
        start += n
    return out


def _scalar(x: Any) -> Any:
    return x.item() if isinstance(x, np.generic) else x


def _first_unequal(x: np.ndarray, y: np.ndarray) -> int | None:
    """Index along axis 0 of the first row whose bits differ (so NaN equals NaN);
    0 if shapes differ."""
    if x.shape != y.shape:
        return 0
    if x.size == 0:
        return None
    rows = x.shape[0] if x.ndim else 1
    xb = np.ascontiguousarray(x).view(np.uint8).reshape(rows, -1)
    yb = np.ascontiguousarray(y).view(np.uint8).reshape(rows, -1)
    differing = np.flatnonzero((xb != yb).any(axis=1))
    return int(differing[0]) if differing.size else None


def diff_sources(a: Any, b: Any, *, a_label: str, b_label: str) -> DiffReport:
    rep = DiffReport(a_label, b_label)
    add = rep.differences.append
    got = _first_dict_difference(a.index.identity.raw, b.index.identity.raw)
    if got:
        add(Difference("identity", got[0], "identity differs", a=got[1], b=got[2]))
    ids_a = [s.sample_id for s in a.index.samples]
    ids_b = [s.sample_id for s in b.index.samples]
    only_a, only_b = sorted(set(ids_a) - set(ids_b)), sorted(set(ids_b) - set(ids_a))
    if only_a or only_b:
        detail = f"only in a: {_listed(only_a)}; only in b: {_listed(only_b)}"
        add(Difference("samples", "sample set", detail))
    elif ids_a != ids_b:
        add(Difference("samples", "sample order", "same samples in a different order"))
    rec_b = {s.sample_id: s.raw for s in b.index.samples}
    for s in a.index.samples:
        if s.sample_id in rec_b:
            got = _first_dict_difference(s.raw, rec_b[s.sample_id])
            if got:
                add(
                    Difference(
                        "samples",
                        got[0],
                        "sample record differs",
                        sample_id=s.sample_id,
                        a=got[1],
                        b=got[2],
                    )
                )
                break
    got = _first_dict_difference(a.index.config, b.index.config)
    if got:
        add(Difference("config", got[0], "config differs", a=got[1], b=got[2]))
    got = _first_dict_difference(a.expected, b.expected)
    if got:
        add(Difference("expected", got[0], "recorded expected value differs", a=got[1], b=got[2]))
    names_a, names_b = set(a.payload_names()), set(b.payload_names())
    for name in sorted(names_a ^ names_b):
        add(
            Difference(
                "payload",
                name,
                "present on one side only" + (" (a)" if name in names_a else " (b)"),
            )
        )
    for name in sorted(names_a & names_b):
        sa_, sb_ = a.manifest.payloads[name], b.manifest.payloads[name]
        if sa_.dtype != sb_.dtype:
            add(Difference("payload", name, "dtype differs", a=sa_.dtype, b=sb_.dtype))
            continue
        seg_a, seg_b = _segments(a, name), _segments(b, name)
        if seg_a is not None and seg_b is not None:
            for sid in ids_a:
                if sid not in seg_b:
                    continue
                i = _first_unequal(seg_a[sid], seg_b[sid])
                if i is not None:
                    va = seg_a[sid][i] if i < len(seg_a[sid]) else None
                    vb = seg_b[sid][i] if i < len(seg_b[sid]) else None
                    add(
                        Difference(
                            "payload",
                            name,
                            "values differ",
                            sample_id=sid,
                            token_offset=i,
                            a=_scalar(va.tolist() if isinstance(va, np.ndarray) else va),
                            b=_scalar(vb.tolist() if isinstance(vb, np.ndarray) else vb),
                        )
                    )
                    break
        else:
            xa, xb = a.payload(name), b.payload(name)
            if xa.shape != xb.shape:
                add(
                    Difference("payload", name, "shape differs", a=list(xa.shape), b=list(xb.shape))
                )
            elif (i := _first_unequal(xa, xb)) is not None:
                add(Difference("payload", name, f"values differ at row {i}"))
    return rep


def _listed(ids: list[str], most: int = 10) -> str:
    """`ids` as a list, the first `most` of them and how many more (a cut list says so)."""
    more = f" and {len(ids) - most} more" if len(ids) > most else ""
    return f"{ids[:most]}{more}"
