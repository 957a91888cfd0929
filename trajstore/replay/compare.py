"""Compare recomputed values with what the producer recorded.

``|actual - expected| <= atol + rtol * |expected|`` per element; exact fields
compare with ``==``; a non-finite actual where the expected is finite is a
mismatch. Per-token mismatches are located as (sample_id, token offset in
that sample's response); the first 10 are kept as concrete examples.

Each example keeps the dtype its two values came from, so a report can print
them with enough digits to round-trip that dtype (`format_value`): two float32
values one ulp apart must never print the same.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from trajstore.jsonio import json_safe

MAX_EXAMPLES = 10


def format_value(x: float | None, dtype: str | None = None) -> str:
    """The shortest decimal that reads back as ``x`` in ``dtype`` ("null" for None).

    float32 needs at most 9 significant digits, float64 at most 17; without a
    dtype the value is printed as float64 (which round-trips every float dtype).
    """
    if x is None:
        return "null"
    if dtype is not None and np.dtype(dtype).kind == "f" and np.dtype(dtype).itemsize < 8:
        return str(np.dtype(dtype).type(x))
    return repr(float(x))


def float_dtype(x: object) -> str:
    """Name of the float dtype ``x``'s values are held in (float64 for lists and ints)."""
    dt = np.asarray(x).dtype
    return dt.name if dt.kind == "f" else "float64"


@dataclass
class Divergence:
    """One concrete mismatch: where, and both values."""

    stage: str
    sample_id: str | None
    field: str
    token_offset: int | None
    expected: float | None
    actual: float | None
    abs_err: float | None
    #: dtype ``expected``/``actual`` were held in (None: unknown, printed as float64)
    expected_dtype: str | None = None
    actual_dtype: str | None = None

    def to_dict(self) -> dict:
        """JSON-safe: a non-finite number becomes null (strict JSON has no NaN/Infinity).

        Values are the exact float64 of what was compared (a float32 converts
        exactly), so JSON's shortest float64 repr tells any two of them apart.
        """
        doc = {key: json_safe(value) for key, value in asdict(self).items()}
        # names from the vocabulary are str subclasses: serialize their plain value
        doc["stage"], doc["field"] = str(self.stage), str(self.field)
        return doc

    def where(self) -> str:
        if self.sample_id is None:
            return self.field
        if self.token_offset is None:
            return f"{self.field} {self.sample_id}"
        return f"{self.field} {self.sample_id}@{self.token_offset}"


@dataclass
class Comparison:
    max_abs_error: float
    mismatch_count: int
    divergences: list[Divergence]

    @property
    def ok(self) -> bool:
        return self.mismatch_count == 0


def _num(value: float) -> float | None:
    """A compared value as recorded: NaN becomes None, infinities stay."""
    value = float(value)
    return None if np.isnan(value) else value


def compare_arrays(
    stage: str,
    field: str,
    expected: np.ndarray,
    actual: np.ndarray,
    *,
    atol: float,
    rtol: float,
    exact: bool = False,
    sample_ids: list[str] | None = None,
    offsets: np.ndarray | None = None,
) -> Comparison:
    """Elementwise comparison.

    ``offsets`` (N+1 segment starts) marks a per-token array: mismatches are
    reported as sample@offset. Without it, element i belongs to sample i
    (per-sample values) or, with no sample_ids, to the field itself.
    """
    e_dtype, a_dtype = float_dtype(expected), float_dtype(actual)
    e = np.asarray(expected, dtype=np.float64).reshape(-1)
    a = np.asarray(actual, dtype=np.float64).reshape(-1)
    if e.shape != a.shape:
        missing = Divergence(
            stage=stage,
            sample_id=None,
            field=field,
            token_offset=None,
            expected=None,
            actual=None,
            abs_err=None,
        )
        return Comparison(
            max_abs_error=float("inf"),
            mismatch_count=max(e.size, a.size),
            divergences=[missing],
        )
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(a - e)
        both_nan = np.isnan(a) & np.isnan(e)
        if exact:
            bad = (a != e) & ~both_nan
        else:
            bad = ~(diff <= atol + rtol * np.abs(e)) & ~both_nan
            same_inf = np.isinf(a) & np.isinf(e) & (np.sign(a) == np.sign(e))
            bad &= ~same_inf
    idx = np.flatnonzero(bad)
    finite = diff[np.isfinite(diff)]
    max_err = float(finite.max()) if finite.size else 0.0
    if idx.size and not np.all(np.isfinite(diff[idx])):
        max_err = float("inf")
    examples: list[Divergence] = []
    for i in idx[:MAX_EXAMPLES]:
        i = int(i)
        if offsets is not None:
            pos = int(np.searchsorted(offsets, i, side="right") - 1)
            sample_id, token_offset = sample_ids[pos], i - int(offsets[pos])
        elif sample_ids is not None:
            sample_id, token_offset = sample_ids[i], None
        else:
            sample_id, token_offset = None, None
        examples.append(
            Divergence(
                stage=stage,
                sample_id=sample_id,
                field=field,
                token_offset=token_offset,
                expected=_num(e[i]),
                actual=_num(a[i]),
                abs_err=_num(diff[i]),
                expected_dtype=e_dtype,
                actual_dtype=a_dtype,
            )
        )
    return Comparison(max_abs_error=max_err, mismatch_count=int(idx.size), divergences=examples)
