"""What every replay stage works with: its inputs (`ReplayContext`) and its result.

Kept apart from the stages themselves so that a stage defined anywhere (the
GRPO chain in `trajstore.replay.stages`, the router check in
`trajstore.router.stage`) depends on this module and the registry only, never
on another stage's module.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np

from trajstore.bundle.checks import PER_TOKEN_PAYLOADS
from trajstore.errors import TrajstoreError
from trajstore.jsonio import json_safe
from trajstore.replay import kernels
from trajstore.replay.compare import Comparison, Divergence, compare_arrays
from trajstore.replay.selection import Selection
from trajstore.replay.source import BundleSource, as_float, payload_rows
from trajstore.vocab import Payload, StageStatus

#: the most concrete divergences one stage keeps as examples
MAX_STAGE_EXAMPLES = 10


class StageInputError(TrajstoreError):
    """A stage cannot run on this bundle's inputs (reported as that stage's failure)."""


@dataclass
class StageOutcome:
    stage: str
    status: StageStatus
    reason: str = ""
    requested: bool = True
    max_abs_error: float | None = None
    mismatch_count: int | None = None
    divergences: list[Divergence] = field(default_factory=list)
    version: str = ""
    #: recorded inputs the stage used as given because the bundle cannot recompute them
    #: (``<micro_batch>.<field>``, e.g. ``mb-0000.aux_loss``; replay-math.md)
    trusted: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": str(self.stage),
            "version": self.version,
            "status": str(self.status),
            "reason": self.reason,
            "requested": self.requested,
            "max_abs_error": json_safe(self.max_abs_error),
            "mismatch_count": self.mismatch_count,
            "divergences": [divergence.to_dict() for divergence in self.divergences],
            "trusted": list(self.trusted),
        }


def outcome_of(stage: str, comparisons: list[Comparison], reason_template: str) -> StageOutcome:
    """Pass when no comparison found a mismatch; else fail with ``reason_template``
    formatted with the mismatch count ``n`` and the largest error ``err``."""
    mismatches = sum(comparison.mismatch_count for comparison in comparisons)
    max_err = max((comparison.max_abs_error for comparison in comparisons), default=0.0)
    if mismatches == 0:
        return StageOutcome(
            stage=stage, status=StageStatus.PASS, max_abs_error=max_err, mismatch_count=0
        )
    examples = [divergence for comparison in comparisons for divergence in comparison.divergences]
    return StageOutcome(
        stage=stage,
        status=StageStatus.FAIL,
        reason=reason_template.format(n=mismatches, err=max_err),
        max_abs_error=max_err,
        mismatch_count=mismatches,
        divergences=examples[:MAX_STAGE_EXAMPLES],
    )


def is_number(value: Any) -> bool:
    """A JSON number (bool is not one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class StageMemo:
    """Outcomes of stages, by everything they read, shared by the replays of one linked
    step (its rollout bundle, then the step; `trajstore.replay.from_store`).

    A step consumes its rollout's samples and shares most of its payloads with it (the
    same CAS records: old/ref log-probs, kl, advantages), so a stage such as advantage.kl
    reads the very same bytes in both bundles. A key names those bytes by their records
    (a record's name is the BLAKE3 of its bytes; its chunks are hash-checked when read),
    plus the samples, the config values, the tolerance and exact fields the stage reads:
    equal keys give equal outcomes, so the second one is a copy of the first. Only sources
    that name their payloads' records (`StoredBundle.payload_identity`) have keys.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[StageOutcome, dict[str, Any]]] = {}
        #: (the samples' loss_mask lists, the float32 mask built from them)
        self._masks: list[tuple[list[Any], np.ndarray]] = []

    def mask(self, masks: list[Any]) -> np.ndarray | None:
        """A copy of the mask built from lists equal to `masks`, item by item (the lists
        are compared, in C: a step's samples carry their rollout's loss masks), or None."""
        for kept, array in self._masks:
            if kept == masks:
                return array.copy()
        return None

    def keep_mask(self, masks: list[Any], array: np.ndarray) -> None:
        self._masks.append((masks, array.copy()))

    def get(self, key: tuple | None) -> tuple[StageOutcome, dict[str, Any]] | None:
        """A copy of the outcome stored under `key` and its stored values, or None."""
        hit = None if key is None else self._entries.get(key)
        if hit is None:
            return None
        return with_copied_divergences(hit[0]), hit[1]

    def put(self, key: tuple | None, outcome: StageOutcome, values: dict[str, Any]) -> None:
        """Keep `outcome` (as it is now: the runner sets fields of the one it returns)."""
        if key is not None:
            self._entries[key] = (with_copied_divergences(outcome), values)


#: a StageOutcome or a Comparison: a dataclass with a list of divergence records
_WithDivergences = TypeVar("_WithDivergences")


def with_copied_divergences(result: _WithDivergences) -> _WithDivergences:
    """A copy of a stage outcome or a comparison with its own divergence records (the
    runner and the report set fields of those they return)."""
    return replace(result, divergences=[replace(d) for d in result.divergences])


class ReplayContext:
    """Selected inputs of one bundle plus the outputs recomputed so far."""

    def __init__(
        self,
        source: BundleSource,
        selection: Selection,
        upstream: dict[str, Any] | None = None,
        memo: StageMemo | None = None,
    ):
        self.source = source
        self.memo = memo
        self.selection = selection
        samples = source.index.samples
        self.all_lengths = np.array([s.response_length for s in samples], dtype=np.int64)
        positions = selection.positions
        self.positions = np.arange(len(samples)) if positions is None else positions
        self.samples = [samples[i] for i in self.positions]
        self.sample_ids = [sample.sample_id for sample in self.samples]
        self.lengths = self.all_lengths[self.positions]
        self.offsets = kernels.segment_offsets(self.lengths)
        self.config = source.index.config
        self.recomputed: dict[str, np.ndarray] = {}
        #: values an upstream bundle recomputed for these samples (rollout -> step linkage)
        self.upstream = upstream or {}
        #: (upstream ``rewards_by_id``, advantage.estimate's comparison of the recorded
        #: advantages with those these rewards give), when it ran on every selected sample's:
        #: what the rollout linkage checks (`trajstore.replay.from_store.check_linkage`)
        self.upstream_comparison: tuple[Any, Comparison] | None = None
        self._payloads: dict[str, np.ndarray] = {}

    def memo_key(self, stage: str, payloads: tuple[str, ...], *values: Any) -> tuple | None:
        """What `stage` reads, for `StageMemo`: the records of `payloads` (and their
        specs), these samples, the stage's tolerance, the exact fields and `values` (the
        code's name, the config values it used). None: no memo, or a payload without a
        record name."""
        ident = getattr(self.source, "payload_identity", None)
        if self.memo is None or ident is None:
            return None
        specs = self.source.manifest.payloads
        named = []
        for name in payloads:
            spec = specs.get(name)
            if spec is None:
                named.append((name, None))
                continue
            record = ident(name)
            if record is None:
                return None
            named.append((name, record, tuple(spec.shape), spec.dtype))
        return (
            stage,
            tuple(named),
            values,
            self.tolerance(stage),
            repr(self.source.manifest.exact_fields),
            tuple(self.sample_ids),
            self.all_lengths.tobytes(),
            np.asarray(self.positions, dtype=np.int64).tobytes(),
        )

    @property
    def partial(self) -> bool:
        return self.selection.partial

    def cfg(self, key: str, default: Any) -> Any:
        value = self.config.get(key, default)
        return default if value is None else value

    def has_payload(self, name: str) -> bool:
        return name in self.source.manifest.payloads

    def payload(self, name: str) -> np.ndarray:
        if name not in self._payloads:
            if not self.has_payload(name):
                raise StageInputError(f"incomplete bundle: payload '{name}' is missing")
            shape = tuple(self.source.manifest.payloads[name].shape)
            want = int(self.all_lengths.sum())
            if name in PER_TOKEN_PAYLOADS and shape != (want,):
                # Never slice or compare a payload that does not follow the sample layout.
                raise StageInputError(
                    f"payload '{name}' has shape {list(shape)}, samples have {want} response tokens"
                )
            raw = payload_rows(self.source, name, self.selection.positions, self.all_lengths)
            self._payloads[name] = as_float(raw, self.source.manifest.payloads[name].dtype)
        return self._payloads[name]

    def mask(self) -> np.ndarray:
        if not self.samples:
            return np.zeros(0, dtype=np.float32)
        if self.memo is None:
            return self._mask()
        masks = [sample.loss_mask for sample in self.samples]
        array = self.memo.mask(masks)
        if array is None:  # built once per linked replay from equal lists (StageMemo)
            array = self._mask()
            self.memo.keep_mask(masks, array)
        return array

    def _mask(self) -> np.ndarray:
        return np.concatenate(
            [np.asarray(sample.loss_mask, dtype=np.float32) for sample in self.samples]
        )

    def expected_per_sample(self, stage: str, key: str) -> np.ndarray | None:
        """A per-sample list from expected.json, restricted to the selection."""
        record = self.source.expected.get(stage, {})
        if not isinstance(record, dict) or key not in record:
            return None
        values = record[key]
        count = len(self.source.index.samples)
        if not isinstance(values, list) or len(values) != count:
            raise StageInputError(
                f"expected.json {stage}.{key} must list {count} values (one per sample)"
            )
        bad = next((i for i, value in enumerate(values) if not is_number(value)), None)
        if bad is not None:
            raise StageInputError(
                f"expected.json {stage}.{key}[{bad}] is {values[bad]!r}, not a number"
            )
        return np.asarray(values, dtype=np.float64)[self.positions]

    def tolerance(self, stage: str) -> tuple[float, float]:
        return self.source.manifest.tolerance(stage)

    def compare(
        self,
        stage: str,
        field_name: str,
        expected: np.ndarray,
        actual: np.ndarray,
        *,
        per_token: bool,
    ) -> Comparison:
        atol, rtol = self.tolerance(stage)
        return compare_arrays(
            stage,
            field_name,
            expected,
            actual,
            atol=atol,
            rtol=rtol,
            exact=field_name in self.source.manifest.exact_fields,
            sample_ids=self.sample_ids,
            offsets=self.offsets if per_token else None,
        )

    def compare_advantages(
        self, stage: str, advantages: np.ndarray, returns: np.ndarray
    ) -> list[Comparison]:
        """Recomputed per-token advantages (first) and, when the bundle has them, returns
        against the captured payloads: what a family's advantage stage compares."""
        comparisons = [
            self.compare(
                stage,
                Payload.ADVANTAGES,
                self.payload(Payload.ADVANTAGES),
                advantages,
                per_token=True,
            )
        ]
        if self.has_payload(Payload.RETURNS):
            comparisons.append(
                self.compare(
                    stage, Payload.RETURNS, self.payload(Payload.RETURNS), returns, per_token=True
                )
            )
        return comparisons
