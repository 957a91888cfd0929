"""Stored bundles -> slime's dumps (`trajstore export --to slime OUT_DIR`).

For each stored rollout of the range, ``OUT_DIR/rollout_<R>.pt`` (``eval_<R>.pt`` for a
run of evaluation dumps) is written as slime's ``save_debug_rollout_data`` writes it,
``torch.save({"rollout_id": R, "samples": [Sample.to_dict(), ...]})``, and, when the
rollout's step bundles are stored, ``OUT_DIR/train_<R>.pt`` as ``save_debug_train_data``
writes it (format_version 2, its samples in their order, dp_shards, whole-batch fields).
Every value comes back with the form it was ingested with (a list of Python floats, an
int32 tensor, ...), so slime's ``load_debug_rollout_data`` (``--load-debug-rollout-data
OUT_DIR/rollout_{rollout_id}.pt``) builds ``Sample`` objects equal to the ones the run
wrote: a stored run fed back to slime's trainer without SGLang.

Payload bytes are read through the store, which checks every chunk's BLAKE3: a damaged
object is an error (exit 2), never a dump with different numbers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from trajstore.bundle.ptfile import TORCH_TO_NUMPY
from trajstore.errors import BundleError, NotFoundError, UsageError
from trajstore.integrations.slime.common import (
    EXT,
    ROLLOUT_ARRAYS,
    TRAIN_ROUTES,
    rollout_file,
    train_file,
)
from trajstore.integrations.slime.values import decode, tensor_from_bits
from trajstore.jsonio import check_creatable, temp_sibling


def _ext(b: Any) -> dict[str, Any]:
    ext = (b.index.raw.get("extensions") or {}).get(EXT)
    if not isinstance(ext, dict):
        raise BundleError(
            f"{b.bundle_key}: not ingested from slime (index.json has no extensions.{EXT}); "
            "export it with --format instead"
        )
    return ext


def _from_form(bits: np.ndarray, dtype: str, form: list[Any]) -> Any:
    """A sample's array as slime had it: a list, a tensor of its dtype, a NumPy array."""
    if form and form[-1] == "pad":
        bits, form = bits[:-1], form[:-1]
    kind = form[0]
    if kind == "list":
        return bits.tolist()
    if kind == "tensor":
        return tensor_from_bits(form[1], bits)
    if kind == "ndarray":
        return np.ascontiguousarray(bits).view(np.dtype(form[1])).copy()
    raise BundleError(f"unknown array form {form!r}")


def _mask(mask: list[int], form: list[Any]) -> Any:
    if form == ["none"]:
        return None
    bits = np.asarray(mask)
    if form[0] == "tensor":
        return tensor_from_bits(form[1], bits.astype(TORCH_TO_NUMPY[form[1]]))
    if form[0] == "ndarray":
        return bits.astype(np.dtype(form[1]))
    return [int(x) for x in mask]


def _rows(field: str, kind: str) -> str:
    if kind == "rollout":
        return ROLLOUT_ARRAYS.get(field, "response")
    if field in TRAIN_ROUTES:
        return "routes"
    return "total" if field == "tokens" else "response"


def _samples(b: Any, kind: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(slime sample dict, the record's ``slime`` part) of every sample of bundle `b`."""
    records = b.index.samples
    total = np.array([s.total_length for s in records], dtype=np.int64)
    response = np.array([s.response_length for s in records], dtype=np.int64)
    offsets = {
        "total": np.concatenate([[0], np.cumsum(total)]),
        "routes": np.concatenate([[0], np.cumsum(total)]),
        "response": np.concatenate([[0], np.cumsum(response)]),
    }
    arrays: dict[str, tuple[np.ndarray, str]] = {}
    mask_key = "loss_mask" if kind == "rollout" else "loss_masks"
    out = []
    for i, rec in enumerate(records):
        part = rec.raw.get(EXT)
        if not isinstance(part, dict):
            raise BundleError(f"{b.bundle_key}: sample {rec.sample_id} has no {EXT} record")
        kept, forms = part.get("kept", {}), part.get("forms", {})
        sample: dict[str, Any] = {}
        for key in part.get("keys", []):
            if key in kept:
                sample[key] = decode(kept[key])
            elif key == mask_key:
                sample[key] = _mask(rec.loss_mask, forms[key])
            elif key in ("group_index",):
                sample[key] = rec.group_index
            elif key in ("response_length", "response_lengths"):
                sample[key] = rec.response_length
            elif key == "total_lengths":
                sample[key] = rec.total_length
            elif key in forms:
                if key not in arrays:
                    spec = b.manifest.payloads.get(key)
                    if spec is None:
                        raise BundleError(f"{b.bundle_key}: payload {key!r} is not stored")
                    arrays[key] = (b.payload(key), spec.dtype)
                values, dtype = arrays[key]
                off = offsets[_rows(key, kind)]
                sample[key] = _from_form(values[off[i] : off[i + 1]], dtype, forms[key])
            else:
                raise BundleError(
                    f"{b.bundle_key}: sample {rec.sample_id}: field {key!r} is neither kept "
                    "nor stored"
                )
        out.append((sample, part))
    return out


def _document(header: dict[str, Any], samples: list[dict[str, Any]]) -> dict[str, Any]:
    kept = header.get("kept", {})
    doc: dict[str, Any] = {}
    for key in header.get("keys", []):
        doc[key] = samples if key == "samples" else decode(kept[key])
    return doc


def rollout_document(b: Any) -> tuple[dict[str, Any], bool]:
    """The rollout dump a stored rollout bundle came from, and whether it is an evaluation."""
    ext = _ext(b)
    if ext.get("kind") != "rollout":
        raise BundleError(f"{b.bundle_key}: not a slime rollout dump")
    samples = [sample for sample, _ in _samples(b, "rollout")]
    return _document(ext, samples), bool(ext.get("evaluation"))


def train_document(steps: list[Any]) -> dict[str, Any]:
    """The train dump the stored step bundles of one rollout came from (every step)."""
    exts = [_ext(b) for b in steps]
    first = exts[0]
    count = int(first.get("steps", 0))
    have = sorted(int(e.get("step", -1)) for e in exts)
    if have != list(range(count)):
        raise NotFoundError(
            f"{steps[0].bundle_key}: the train dump had {count} step(s), the store holds "
            f"step(s) {have}"
        )
    if any((e["keys"], e["kept"]) != (first["keys"], first["kept"]) for e in exts):
        raise BundleError(
            f"{steps[0].bundle_key}: the stored steps come from different train dumps"
        )
    ordered: dict[int, dict[str, Any]] = {}
    for b in steps:
        for sample, part in _samples(b, "train"):
            ordered[int(part["order"])] = sample
    if sorted(ordered) != list(range(int(first["num_samples"]))):
        raise BundleError(
            f"{steps[0].bundle_key}: the stored steps hold {len(ordered)} of the train dump's "
            f"{first['num_samples']} samples"
        )
    return _document(first, [ordered[i] for i in range(len(ordered))])


def _save(obj: Any, path: Path) -> None:
    import torch

    tmp = temp_sibling(path)
    try:
        torch.save(obj, tmp)
        os.rename(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def export(store: Any, *, run: str, rollouts: tuple[int, int], out: Path) -> list[Path]:
    """Write the stored rollouts (and their train dumps) of `run` in the range as slime's
    files under `out`; refuse before writing when any target file exists."""
    first, last = rollouts
    live = list(store.refs.live().values())
    if not any(e.run == run for e in live):
        store.refs.refresh(force=True)
        live = list(store.refs.live().values())
    wanted = sorted(
        {e.rollout_id for e in live if e.run == run and e.kind == "rollout"}
        & set(range(first, last + 1))
    )
    if not wanted:
        what = f"rollout {first}" if first == last else f"rollouts {first}-{last}"
        raise NotFoundError(f"run {run!r} has no {what} in the store")
    plan: list[tuple[int, Any, list[Any]]] = []
    targets: list[Path] = []
    for r in wanted:
        (bundle,) = store.rollout(run, r)
        step_ids = sorted(
            {e.step_id for e in live if e.run == run and e.kind == "step" and e.rollout_id == r}
        )
        steps = [b for s in step_ids for b in store.step(run, r, s)]
        plan.append((r, bundle, steps))
        targets.append(out / rollout_file(r, bool(_ext(bundle).get("evaluation"))))
        if steps:
            targets.append(out / train_file(r))
    clash = [str(p) for p in targets if os.path.lexists(p)]
    if clash:
        raise UsageError(f"{clash[0]}: already exists; refusing to overwrite")
    check_creatable(out)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for r, bundle, steps in plan:  # one rollout's documents in memory at a time
        doc, evaluation = rollout_document(bundle)
        _save(doc, out / rollout_file(r, evaluation))
        written.append(out / rollout_file(r, evaluation))
        if steps:
            _save(train_document(steps), out / train_file(r))
            written.append(out / train_file(r))
    return written
