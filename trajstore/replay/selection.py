"""Sample selection with semantic-group closure.

`--sample`, `--group` and `--batch` pick samples; the selection is then
closed over semantic groups (every member of every touched group joins), so
group-level stages see whole groups. Missing membership refuses; a group is
never inferred from a batch size or a position.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from trajstore.errors import SelectionError
from trajstore.schema import Index, Sample

_GROUP = re.compile(r"^g-(\d+)\Z", re.ASCII)  # not "g-1\n" nor fullwidth digits


@dataclass(frozen=True)
class SelectionRequest:
    samples: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    batches: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.samples or self.groups or self.batches)

    def describe(self) -> dict[str, list[str]]:
        return {
            "samples": list(self.samples),
            "groups": list(self.groups),
            "batches": list(self.batches),
        }


@dataclass
class Selection:
    """Sample positions (bundle order) a replay runs on."""

    positions: np.ndarray | None  # None: every sample
    partial: bool = False
    closure_added: list[str] = field(default_factory=list)


#: ids of each kind a "not found" error lists (then how many there are in all)
LISTED_IDS = 8
_PLURAL = {"sample": "samples", "group": "groups", "micro-batch": "micro-batches"}


def _listed(ids: list[str]) -> str:
    """The first LISTED_IDS ids (an unprintable one as its repr: the error stays one line)."""
    shown = ", ".join(i if i.isprintable() else repr(i) for i in ids[:LISTED_IDS])
    return shown if len(ids) <= LISTED_IDS else f"{shown}, ... ({len(ids)} in all)"


def _what_there_is(samples: Iterable[Sample], kinds: Iterable[str]) -> str:
    """The ids of each kind ("sample", "group", "micro-batch") the samples hold, as
    " (groups: g-0, g-1; ...)": an error naming an id that is not there says which are."""
    samples = list(samples)
    parts = []
    for kind in dict.fromkeys(kinds):
        if kind == "sample":
            ids = list(dict.fromkeys(s.sample_id for s in samples))
        elif kind == "group":
            ids = [f"g-{g}" for g in sorted({s.group_index for s in samples} - {None})]
        else:
            ids = sorted({s.micro_batch_id for s in samples} - {None})
        parts.append(f"{_PLURAL[kind]}: {_listed(ids) if ids else 'none'}")
    return f" ({'; '.join(parts)})" if parts else ""


def not_found(unknown: list[tuple[str, str]], samples: Iterable[Sample], where: str) -> str:
    """The message for ids (kind, id) that no sample of `where` has, with the ones it has."""
    named = ", ".join(f"{kind} {_listed([name])}" for kind, name in unknown)
    return f"{named} not found in {where}" + _what_there_is(samples, (k for k, _ in unknown))


def parse_group(text: str) -> int:
    match = _GROUP.match(text)
    if not match:
        raise SelectionError(f"group id {text!r} is not of the form g-N")
    return int(match.group(1))


def select(index: Index, request: SelectionRequest, *, strict: bool = True) -> Selection | None:
    """Resolve a request against one bundle's samples.

    Returns None when nothing in this bundle matches and ``strict`` is False
    (a rank of a cohort that holds none of the requested samples).
    """
    if request.empty:
        return Selection(None, False)
    samples = index.samples
    by_id = {s.sample_id: i for i, s in enumerate(samples)}
    chosen: set[int] = set()
    unknown: list[tuple[str, str]] = []
    for sid in request.samples:
        if sid in by_id:
            chosen.add(by_id[sid])
        else:
            unknown.append(("sample", sid))
    for g in request.groups:
        gi = parse_group(g)
        members = [i for i, s in enumerate(samples) if s.group_index == gi]
        if members:
            chosen.update(members)
        else:
            unknown.append(("group", g))
    for mb in request.batches:
        if not re.fullmatch(r"mb-\d+", mb, re.ASCII):  # re.match+"$" passed "mb-0\n"
            raise SelectionError(f"micro-batch id {mb!r} is not of the form mb-NNNN")
        # Missing membership refuses: a sample without micro_batch_id might belong to mb.
        lacking = [s.sample_id for s in samples if s.micro_batch_id is None]
        if lacking:
            raise SelectionError(
                f"cannot select micro-batch {mb}: sample(s) {', '.join(lacking[:5])} "
                "have no micro_batch_id"
            )
        members = [i for i, s in enumerate(samples) if s.micro_batch_id == mb]
        if not members:
            unknown.append(("micro-batch", mb))
        chosen.update(members)
    if unknown and strict:
        raise SelectionError(not_found(unknown, samples, f"bundle {index.bundle_id}"))
    if not chosen:
        return None
    # Semantic-group closure.
    closed = set(chosen)
    for i in chosen:
        g = samples[i].group_index
        if g is None:
            raise SelectionError(
                f"sample {samples[i].sample_id} has no group_index; its semantic group is unknown, "
                "refusing to guess"
            )
        closed.update(j for j, s in enumerate(samples) if s.group_index == g)
    added = [samples[j].sample_id for j in sorted(closed - chosen)]
    positions = np.array(sorted(closed), dtype=np.int64)
    partial = len(positions) != len(samples)
    return Selection(positions if partial else None, partial, added)
