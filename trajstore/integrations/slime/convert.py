"""slime's debug dumps -> bundles (`trajstore ingest --from slime`).

A rollout dump (``--save-debug-rollout-data``: ``{"rollout_id", "samples":
[Sample.to_dict()]}``) becomes the rollout bundle ``replay-rollout-<R>``: one sample record
per dump sample (id ``r<R>-s<position>``, its ``group_index``, lengths, loss mask, raw reward
and, when the train dump of the rollout is given too, the post-processed reward slime
trained on), and payloads ``tokens`` (every token), ``rollout_log_probs``,
``teacher_log_probs`` and ``rollout_routed_experts`` (``[T, L, K]``; slime's rows are one
per input position, ``len(tokens) - 1``, so the last token gets a row of ``-1``: it routed
nothing). A train dump (``--save-debug-train-data``, format_version 2) becomes one step
bundle ``replay-<R>-<S>`` per optimizer step of ``dp_shards``' layout, its samples in the
order each data-parallel rank ran them, each micro-batch named ``mb-d<dp rank>-<k>``; every
per-token tensor of its samples (log_probs, ref_log_probs, advantages, returns, kl,
entropy, rollout_log_probs, ...) is a payload under its dump name, and ``train_log_probs``
repeats ``log_probs`` for the router metrics (the same bytes: stored once).

Everything else a dump holds (prompt, response, label, status, metadata, spec_info, fields
newer slime versions add, the dump's own top-level keys and ``dp_shards``) is kept in
index.json under ``slime`` (`values.encode`), with each sample's key order and each
array's original form (list, tensor and dtype), so `export.py` writes the dump back equal
field by field.

Every file is loaded (restricted unpickler, CRC-checked) and converted before anything is
written: one refusal (an unsafe pickle, a damaged file, a dump that does not pair) is one
line and exit 2, and the store is not touched.
"""

from __future__ import annotations

import glob
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trajstore.bundle.ptfile import NUMPY_TO_TORCH
from trajstore.bundle.reader import check_payload_name
from trajstore.bundle.writer import BundleContents, stage_contract
from trajstore.errors import BundleError, UsageError
from trajstore.integrations.framework import FrameworkBundle
from trajstore.integrations.slime import config as slime_config
from trajstore.integrations.slime.common import (
    EVAL_SUFFIX,
    EXT,
    ROLLOUT_ARRAYS,
    SLIME,
    SLIME_PER_TOKEN,
    TRAIN_RECORD_FIELDS,
    TRAIN_ROUTES,
    micro_batch_id,
    sample_id,
)
from trajstore.integrations.slime.load import load_dump
from trajstore.integrations.slime.values import encode, tensor_bits, tensor_of_bits
from trajstore.store.ingest import check_run_name
from trajstore.vocab import Payload, Stage

#: a file name slime gives an evaluation dump: the template's {rollout_id} is "eval_<N>"
_EVAL_NAME = re.compile(r"(?:^|[^A-Za-z0-9])eval_(\d+)(?:[^0-9]|$)")
_TEMPLATE_FIELD = re.compile(r"\{(rollout_id|rank)\}")


@dataclass
class _Dump:
    """One slime dump file: its rollout, the pickled document and its samples."""

    path: Path
    rollout_id: int
    doc: dict[str, Any]
    samples: list[dict[str, Any]]


@dataclass
class RolloutDump(_Dump):
    evaluation: bool


@dataclass
class TrainDump(_Dump):
    pass


# --------------------------------------------------------------------------- finding files


def dump_files(paths: list[str]) -> list[Path]:
    """Every dump a path names: a file, the ``.pt`` files below a directory, or the files a
    slime PATH_TEMPLATE (``{rollout_id}``, ``{rank}``) matches."""
    out: list[Path] = []
    for raw in paths:
        if _TEMPLATE_FIELD.search(raw):
            literals = _TEMPLATE_FIELD.split(raw)[::2]
            fields = _TEMPLATE_FIELD.findall(raw)
            pattern = "*".join(glob.escape(part) for part in literals)
            value = {"rollout_id": r"(?:eval_)?\d+", "rank": r"\d+"}
            regex = re.compile(
                re.escape(literals[0])
                + "".join(
                    value[f] + re.escape(lit) for f, lit in zip(fields, literals[1:], strict=True)
                )
            )
            found = sorted(Path(p) for p in glob.glob(pattern) if regex.fullmatch(p))
            if not found:
                raise UsageError(f"{raw}: the template matches no file")
            out += found
            continue
        p = Path(raw)
        if p.is_dir():
            found = sorted(q for q in p.rglob("*.pt") if q.is_file())
            if not found:
                raise UsageError(f"{raw}: no .pt file in this directory")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise UsageError(f"{raw}: no such file or directory")
    seen: set[Path] = set()
    return [p for p in out if not (p.resolve() in seen or seen.add(p.resolve()))]


def _int(value: Any, where: str) -> int:
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise BundleError(f"{where} must be an integer, got {type(value).__name__}")
    return int(value)


def classify(path: Path, doc: Any) -> RolloutDump | TrainDump:
    """A loaded dump as the rollout or train dump its keys say it is."""
    if not isinstance(doc, dict) or not isinstance(doc.get("samples"), list):
        keys = sorted(map(str, doc)) if isinstance(doc, dict) else type(doc).__name__
        raise BundleError(
            f"{path}: not a slime rollout or train dump (expected a dict with 'samples'; "
            f"got {keys})"
        )
    samples = doc["samples"]
    bad = next((i for i, s in enumerate(samples) if not isinstance(s, dict)), None)
    if bad is not None:
        raise BundleError(f"{path}: samples[{bad}] is a {type(samples[bad]).__name__}, not a dict")
    rollout_id = _int(doc.get("rollout_id"), f"{path}: rollout_id")
    if rollout_id < 0:
        raise BundleError(f"{path}: rollout_id {rollout_id} is negative")
    if "format_version" in doc:
        version = doc["format_version"]
        if version != 2:
            raise BundleError(
                f"{path}: train dump format_version {version!r} is not supported (2 only)"
            )
        return TrainDump(path, rollout_id, doc, samples)
    found = _EVAL_NAME.search(path.name)
    evaluation = found is not None and int(found.group(1)) == rollout_id
    return RolloutDump(path, rollout_id, doc, samples, evaluation)


# --------------------------------------------------------------------------- arrays


@dataclass
class ArrayValue:
    """One sample's array: its bits, torch dtype name, and the form slime gave it."""

    bits: np.ndarray
    dtype: str
    form: list[Any]


def as_array(value: Any) -> ArrayValue | None:
    """`value` (a tensor, a NumPy array, or a list of only floats / only ints, nested for
    routes) as an array, or None when it is none of these (then it is kept as a value)."""
    if type(value).__module__.startswith("torch") and type(value).__name__ == "Tensor":
        try:
            name, bits = tensor_bits(value)
        except BundleError:
            return None
        return ArrayValue(bits, name, ["tensor", name])
    if isinstance(value, np.ndarray):
        name = NUMPY_TO_TORCH.get(value.dtype.name)
        if name is None or value.dtype.byteorder == ">":
            return None
        return ArrayValue(np.ascontiguousarray(value), name, ["ndarray", value.dtype.str])
    if type(value) is list and value:
        flat = value
        while flat and type(flat[0]) is list:
            flat = [x for row in flat for x in row]
        kinds = set(map(type, flat))
        if kinds == {float}:
            return ArrayValue(np.asarray(value, dtype=np.float64), "torch.float64", ["list"])
        if kinds == {int}:
            try:
                arr = np.asarray(value, dtype=np.int64)
            except (OverflowError, ValueError):
                return None
            return ArrayValue(arr, "torch.int64", ["list"])
    return None


def _collect(
    samples: list[dict[str, Any]],
    field: str,
    rows: str,
    lengths: list[tuple[int, int]],
    names: list[str] | None = None,
) -> tuple[Any, list[list[Any]]] | None:
    """Field `field` of every sample as one payload (rows: ``total``, ``response`` or
    ``routes``) and each sample's form; None when a sample has no array there or the
    samples' dtypes differ (then the field is kept as a value in every sample). With
    `names` (a field slime defines, each sample's name for messages), an array of the wrong
    length or shape is refused, naming the sample: slime itself refuses such a sample
    (``_validate_response_metadata_lengths``, ``prepare_routed_experts_for_routing_replay``).
    """
    parts: list[np.ndarray] = []
    padded: list[bool] = []
    forms: list[list[Any]] = []
    dtype: str | None = None
    trailing: tuple[int, ...] | None = None

    def misfit(i: int, what: str) -> None:
        if names is not None:
            raise BundleError(f"{names[i]}: {field} {what}")

    for i, (sample, (total, response)) in enumerate(zip(samples, lengths, strict=True)):
        got = as_array(sample.get(field))
        if got is None or (dtype is not None and got.dtype != dtype):
            return None
        dtype = got.dtype
        bits = got.bits
        pad = False
        if rows == "routes":
            if bits.ndim != 3 or (trailing is not None and bits.shape[1:] != trailing):
                want = "[rows, layers, top_k]" if trailing is None else f"[rows, {trailing}]"
                misfit(i, f"has shape {list(bits.shape)}, expected {want} like the others")
                return None
            trailing = bits.shape[1:]
            pad = bits.shape[0] == total - 1
            if pad:
                if bits.dtype.kind != "i":
                    return None  # no -1 row for the last token in an unsigned dtype
                got.form = [*got.form, "pad"]
            elif bits.shape[0] != total:
                misfit(
                    i,
                    f"has {bits.shape[0]} rows; one per input position is len(tokens) - 1 = "
                    f"{total - 1}",
                )
                return None
        else:
            want = total if rows == "total" else response
            if bits.ndim != 1 or bits.shape[0] != want:
                what = "len(tokens)" if rows == "total" else "response_length"
                misfit(i, f"has shape {list(bits.shape)}, {what} is {want}")
                return None
        parts.append(bits)
        padded.append(pad)
        forms.append(got.form)
    if dtype is None:
        return None
    # one array for the payload, filled in place (routes: the last token's row of -1)
    out = np.empty(
        (sum(len(p) + f for p, f in zip(parts, padded, strict=True)), *parts[0].shape[1:]),
        dtype=parts[0].dtype,
    )
    at = 0
    for part, pad in zip(parts, padded, strict=True):
        out[at : at + len(part)] = part
        at += len(part)
        if pad:
            out[at] = -1
            at += 1
    return tensor_of_bits(dtype, out), forms


def _mask(value: Any, response_length: int, where: str) -> tuple[list[int], list[Any]]:
    """A loss mask as the record's 0/1 list, and its form (None: slime's all ones)."""
    if value is None:
        return [1] * response_length, ["none"]
    got = as_array(value)
    if got is None or got.bits.ndim != 1 or got.bits.dtype.kind not in "iub":
        raise BundleError(f"{where}: loss_mask is not a list of 0/1")
    mask = got.bits.astype(np.int64).tolist()
    if len(mask) != response_length or not set(mask) <= {0, 1}:
        raise BundleError(
            f"{where}: loss_mask has {len(mask)} entries (values {sorted(set(mask))[:4]}), "
            f"response_length is {response_length}"
        )
    if got.form == ["list"] and not all(type(x) is int for x in value):
        raise BundleError(f"{where}: loss_mask is not a list of 0/1")
    return mask, got.form


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float, np.integer, np.floating)):
        return float(value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", None) == 0:
        return _number(value.item())
    return None


def _router(args: dict[str, Any], payload: Any) -> dict[str, Any] | None:
    """config.router for a bundle with route payload `payload`: L and K from its shape,
    num_experts from slime's arguments (never guessed from the ids)."""
    if payload is None or args.get("num_experts") is None:
        return None
    mode = "baseline"
    if args.get("use_rollout_routing_replay"):
        mode = "r3"
    elif args.get("use_routing_replay"):
        mode = "r2"
    return {
        "num_experts": int(args["num_experts"]),
        "num_layers": int(payload.shape[1]),
        "top_k": int(payload.shape[2]),
        "mode": mode,
        "rollout_engine": "sglang",
        "train_engine": "megatron",
    }


def _plain_ints(sample: dict[str, Any], *keys: str) -> list[str]:
    """The `keys` whose value is a plain int: the sample record holds them; any other
    (a NumPy integer, ...) is kept as it is, so the export gives back its type too."""
    return [k for k in keys if type(sample.get(k)) is int]


def _kept(sample: dict[str, Any], modeled: set[str], where: str) -> dict[str, Any]:
    kept = {}
    for key, value in sample.items():
        if key in modeled:
            continue
        try:
            kept[key] = encode(value)
        except BundleError as exc:
            raise BundleError(f"{where}: field {key!r}: {exc}") from None
    return kept


def _header(doc: dict[str, Any], path: Path) -> dict[str, Any]:
    """A dump's top-level keys other than its samples, kept as values, and their order."""
    kept = {}
    for key, value in doc.items():
        if key == "samples":
            continue
        if not isinstance(key, str):
            raise BundleError(f"{path}: top-level key {key!r} is not a string")
        try:
            kept[key] = encode(value)
        except BundleError as exc:
            raise BundleError(f"{path}: {key}: {exc}") from None
    return {"keys": [str(k) for k in doc], "kept": kept}


# --------------------------------------------------------------------------- rollout bundle

#: slime's commit and torch are not in its dumps: unknown, not this host's (so the same
#: dumps make the same bundles wherever they are ingested)
PRODUCER = {"commit": "", "dirty_patch_digest": "", "torch_version": ""}


def rollout_bundle(
    dump: RolloutDump, train: TrainDump | None, args: dict[str, Any], run: str
) -> FrameworkBundle:
    r = dump.rollout_id
    where = f"{dump.path}"
    if not dump.samples:
        raise BundleError(f"{where}: the dump holds no samples")
    groups = [s.get("group_index") for s in dump.samples]
    singleton = dump.evaluation and not all(
        isinstance(g, int) and not isinstance(g, bool) for g in groups
    )
    lengths: list[tuple[int, int]] = []
    for p, s in enumerate(dump.samples):
        who = f"{where}: sample {p}"
        g = groups[p]
        if not singleton and (not isinstance(g, int) or isinstance(g, bool) or g < 0):
            raise BundleError(f"{who}: group_index {g!r} is not a non-negative integer")
        tokens = as_array(s.get("tokens"))
        if tokens is None or tokens.bits.ndim != 1:
            raise BundleError(f"{who}: tokens is not a list or tensor of token ids")
        response = s.get("response_length")
        if isinstance(response, bool) or not isinstance(response, (int, np.integer)):
            raise BundleError(f"{who}: response_length {response!r} is not an integer")
        response = int(response)
        total = int(tokens.bits.shape[0])
        if not 0 < response <= total:
            raise BundleError(f"{who}: response_length {response} not in (0, len(tokens) {total}]")
        lengths.append((total, response))

    payloads: dict[str, Any] = {}
    forms: dict[str, list[list[Any]]] = {}
    names = [f"{where}: sample {p}" for p in range(len(dump.samples))]
    for field, rows in ROLLOUT_ARRAYS.items():
        got = _collect(dump.samples, field, rows, lengths, names)
        if got is not None:
            payloads[field], forms[field] = got
    if "tokens" not in payloads:
        raise BundleError(f"{where}: the samples' tokens do not share one integer dtype")

    post = _post_processed(train, len(dump.samples)) if train is not None else {}
    reward_key = args.get("reward_key")
    records = []
    for p, s in enumerate(dump.samples):
        who = f"{where}: sample {p}"
        total, response = lengths[p]
        mask, mask_form = _mask(s.get("loss_mask"), response, who)
        modeled = {"tokens", "loss_mask", *payloads, *_plain_ints(s, "response_length")}
        if not singleton:
            modeled.add("group_index")
        kept = _kept(s, modeled, who)
        sample_forms = {field: forms[field][p] for field in forms}
        sample_forms["loss_mask"] = mask_form
        record: dict[str, Any] = {
            "sample_id": sample_id(r, p),
            "group_index": p if singleton else groups[p],
            "response_length": response,
            "total_length": total,
            "loss_mask": mask,
            EXT: {"keys": [str(k) for k in s], "kept": kept, "forms": sample_forms},
        }
        reward = s.get("reward")
        raw = _number(reward.get(reward_key) if isinstance(reward, dict) and reward_key else reward)
        if raw is not None:
            record["raw_reward"] = raw
        if p in post:
            record["reward"] = post[p]
        records.append(record)

    sizes: dict[int, int] = {}
    for record in records:
        sizes[record["group_index"]] = sizes.get(record["group_index"], 0) + 1
    cfg = SLIME.recompute_config(args, evaluation=dump.evaluation)
    n = args.get("n_samples_per_prompt") if args.get("args_given") else None
    if not dump.evaluation and n is not None and set(sizes.values()) == {n}:
        cfg["n_samples_per_prompt"] = n
    router = _router(args, payloads.get("rollout_routed_experts"))
    if router is not None:
        cfg["router"] = router
    contracts = {Stage.SAMPLE: stage_contract(Stage.SAMPLE, ["index.samples"], [])}
    expected: dict[str, Any] = {}
    has_raw = all("raw_reward" in rec for rec in records)
    if post and has_raw and not dump.evaluation:
        contracts[Stage.REWARD_POST_PROCESS] = stage_contract(
            Stage.REWARD_POST_PROCESS,
            ["index.samples.raw_reward", "index.samples.group_index", "config.slime"],
            ["index.samples.reward"],
        )
        if len(post) == len(records):
            expected[Stage.REWARD_POST_PROCESS] = {"rewards": [rec["reward"] for rec in records]}
    identity = {
        "actor_step_id": None,
        "rollout_id": r,
        "semantic_group_ids": [f"g-{g}" for g in sorted(sizes)],
        "weight_lineage": {"rollout_weight": _weight(dump.samples), "actor_weight": None},
    }
    header = _header(dump.doc, dump.path)
    sources = [str(dump.path)] + ([str(train.path)] if post else [])
    run_name = check_run_name(run + EVAL_SUFFIX) if dump.evaluation else run
    return _bundle(
        (run_name, f"replay-rollout-{r}", sources),
        f"slime-{'eval' if dump.evaluation else 'rollout'}-{r}",
        (identity, records, cfg, payloads, contracts),
        expected,
        {**header, "kind": "rollout", "evaluation": dump.evaluation},
    )


def _bundle(where: tuple, name: str, parts: tuple, expected: dict, ext: dict) -> FrameworkBundle:
    """One slime bundle ``name``: ``where`` it goes (run, capture child, the dump files it
    came from) and its contents (``parts``: identity, sample records, config, payloads,
    stage contracts; ``ext``: what index.json keeps under ``extensions.slime``)."""
    identity, samples, config, payloads, contracts = parts
    # BundleContents' fields in their order: bundle_id ... stage_contracts, producer
    contents = BundleContents(
        name,
        identity,
        samples,
        config,
        payloads,
        expected,
        contracts,
        PRODUCER,
        extensions={EXT: ext},
    )
    run, child, sources = where
    return FrameworkBundle(run=run, child=child, contents=contents, sources=sources)


def _weight(samples: list[dict[str, Any]]) -> str | None:
    """The rollout's weight version when every sample names the same last one."""
    last = {
        str(s["weight_versions"][-1])
        for s in samples
        if isinstance(s.get("weight_versions"), list) and s["weight_versions"]
    }
    return last.pop() if len(last) == 1 else None


def _post_processed(train: TrainDump, count: int) -> dict[int, float]:
    """rollout position -> the post-processed reward slime trained it with (``rewards``)."""
    out: dict[int, float] = {}
    for i, t in enumerate(train.samples):
        p = t.get("rollout_position")
        value = _number(t.get("rewards"))
        if p is None or value is None:
            continue
        p = _int(p, f"{train.path}: samples[{i}].rollout_position")
        if 0 <= p < count:
            out[p] = value
    return out


# --------------------------------------------------------------------------- step bundles


def _steps(train: TrainDump, positions: set[int]) -> list[list[tuple[int, str | None]]]:
    """Each optimizer step's (rollout position, micro-batch id), in the order the
    data-parallel ranks ran them (``dp_shards``: partition, micro_batch_indices,
    num_microbatches)."""
    where = f"{train.path}: dp_shards"
    shards = train.doc.get("dp_shards")
    if not shards:
        return [[(p, None) for p in sorted(positions)]]
    if not isinstance(shards, list) or not all(isinstance(s, dict) for s in shards):
        raise BundleError(f"{where} is not a list of per-rank layouts")
    counts = shards[0].get("num_microbatches")
    if not isinstance(counts, list) or not counts:
        raise BundleError(f"{where}[0].num_microbatches is not a list of per-step counts")
    counts = [_int(c, f"{where}[0].num_microbatches") for c in counts]
    steps: list[list[tuple[int, str | None]]] = [[] for _ in counts]
    for d, shard in enumerate(shards):
        shard_counts = [
            _int(c, f"{where}[{d}].num_microbatches") for c in shard.get("num_microbatches") or []
        ]
        if shard_counts != counts:
            raise BundleError(
                f"{where}[{d}].num_microbatches {shard_counts} differs from rank 0's {counts}"
            )
        partition = shard.get("partition")
        batches = shard.get("micro_batch_indices")
        if not isinstance(partition, list) or not isinstance(batches, list):
            raise BundleError(f"{where}[{d}] has no partition / micro_batch_indices lists")
        if len(batches) != sum(counts):
            raise BundleError(
                f"{where}[{d}]: {len(batches)} micro-batches, num_microbatches sums to "
                f"{sum(counts)}"
            )
        dp = _int(shard.get("data_parallel_rank", d), f"{where}[{d}].data_parallel_rank")
        start = 0
        for s, n in enumerate(counts):
            for k, batch in enumerate(batches[start : start + n]):
                for j in batch:
                    j = _int(j, f"{where}[{d}].micro_batch_indices")
                    if not 0 <= j < len(partition):
                        raise BundleError(f"{where}[{d}]: local index {j} outside its partition")
                    p = _int(partition[j], f"{where}[{d}].partition")
                    steps[s].append((p, micro_batch_id(dp, k)))
            start += n
    placed = [p for step in steps for p, _ in step]
    if sorted(placed) != sorted(positions) or len(set(placed)) != len(placed):
        raise BundleError(
            f"{where}: the micro-batches place {len(placed)} sample(s) "
            f"({len(set(placed))} distinct), the dump holds {len(positions)}"
        )
    return steps


def step_bundles(
    train: TrainDump, rollout: RolloutDump, args: dict[str, Any], run: str
) -> list[FrameworkBundle]:
    where = str(train.path)
    by_pos: dict[int, tuple[int, dict[str, Any]]] = {}
    for i, t in enumerate(train.samples):
        if "rollout_position" not in t:
            raise BundleError(
                f"{where}: samples[{i}] has no rollout_position; it cannot be paired with "
                f"the rollout dump {rollout.path}"
            )
        p = _int(t["rollout_position"], f"{where}: samples[{i}].rollout_position")
        if not 0 <= p < len(rollout.samples):
            raise BundleError(
                f"{where}: samples[{i}].rollout_position {p} is not a sample of "
                f"{rollout.path} ({len(rollout.samples)} samples)"
            )
        if p in by_pos:
            raise BundleError(f"{where}: rollout_position {p} appears twice")
        by_pos[p] = (i, t)
    steps = _steps(train, set(by_pos))
    header = _header(train.doc, train.path)
    out = []
    for s, step in enumerate(steps):
        members = [(p, mb, *by_pos[p]) for p, mb in step]
        out.append(_step_bundle(train, rollout, args, run, s, len(steps), members, header))
    return out


def _step_bundle(
    train: TrainDump,
    rollout: RolloutDump,
    args: dict[str, Any],
    run: str,
    s: int,
    steps: int,
    members: list[tuple[int, str | None, int, dict[str, Any]]],
    header: dict[str, Any],
) -> FrameworkBundle:
    r = train.rollout_id
    samples = [t for _, _, _, t in members]
    lengths: list[tuple[int, int]] = []
    for p, _, i, t in members:
        who = f"{train.path}: samples[{i}]"
        response = t.get("response_lengths")
        if isinstance(response, bool) or not isinstance(response, (int, np.integer)):
            raise BundleError(f"{who}: response_lengths {response!r} is not an integer")
        tokens = as_array(t.get("tokens"))
        total = t.get("total_lengths", None if tokens is None else int(tokens.bits.shape[0]))
        if total is None:
            raise BundleError(f"{who}: neither total_lengths nor tokens")
        total = _int(total, f"{who}.total_lengths")
        if not 0 < int(response) <= total:
            raise BundleError(f"{who}: response_lengths {response} not in (0, {total}]")
        expected = rollout.samples[p].get("response_length")
        if expected != int(response):
            raise BundleError(
                f"{who}: response_lengths {response} differs from the rollout dump's sample "
                f"{p} ({expected})"
            )
        lengths.append((total, int(response)))

    payloads: dict[str, Any] = {}
    forms: dict[str, list[list[Any]]] = {}
    names = [f"{train.path}: samples[{i}]" for _, _, i, _ in members]
    candidates = [k for k in dict.fromkeys(k for t in samples for k in t)]
    for field in candidates:
        if field in TRAIN_RECORD_FIELDS:
            continue
        rows = "routes" if field in TRAIN_ROUTES else "total" if field == "tokens" else None
        if rows is None:
            first = as_array(samples[0].get(field))
            if first is None or first.bits.ndim != 1 or first.bits.dtype.kind != "f":
                continue
            rows = "response"
        try:
            check_payload_name(field)
        except BundleError:
            continue
        known = field in TRAIN_ROUTES or field in SLIME_PER_TOKEN or field == "tokens"
        got = _collect(samples, field, rows, lengths, names if known else None)
        if got is not None:
            payloads[field], forms[field] = got
    derived = []
    if Payload.LOG_PROBS in payloads and Payload.TRAIN_LOG_PROBS not in payloads:
        payloads[Payload.TRAIN_LOG_PROBS] = payloads[Payload.LOG_PROBS]
        derived.append(Payload.TRAIN_LOG_PROBS)
    if Payload.ROLLOUT_ROUTED_EXPERTS not in payloads:
        from_rollout = [rollout.samples[p] for p, _, _, _ in members]
        got = _collect(from_rollout, Payload.ROLLOUT_ROUTED_EXPERTS, "routes", lengths, None)
        if got is not None:
            payloads[Payload.ROLLOUT_ROUTED_EXPERTS] = got[0]
            derived.append(Payload.ROLLOUT_ROUTED_EXPERTS)

    records = []
    for (p, mb, i, t), (total, response) in zip(members, lengths, strict=True):
        who = f"{train.path}: samples[{i}]"
        mask, mask_form = _mask(t.get("loss_masks"), response, who)
        lengths_fields = _plain_ints(t, "response_lengths", "total_lengths")
        modeled = {"loss_masks", *lengths_fields, *(k for k in payloads if k not in derived)}
        sample_forms = {field: forms[field][len(records)] for field in forms}
        sample_forms["loss_masks"] = mask_form
        kept = _kept(t, modeled, who)
        record: dict[str, Any] = {
            "sample_id": sample_id(r, p),
            "group_index": rollout.samples[p].get("group_index"),
            "response_length": response,
            "total_length": total,
            "loss_mask": mask,
            "micro_batch_id": mb,
            EXT: {
                "keys": [str(k) for k in t],
                "kept": kept,
                "forms": sample_forms,
                "order": i,
            },
        }
        reward = _number(t.get("rewards"))
        if reward is not None:
            record["reward"] = reward
        raw = _number(t.get("local_raw_reward"))
        if raw is not None:
            record["raw_reward"] = raw
        records.append(record)

    cfg = SLIME.recompute_config(args, steps_in_dump=steps)
    router = _router(args, payloads.get(Payload.ROLLOUT_ROUTED_EXPERTS))
    if router is not None:
        cfg["router"] = router
    contracts = {Stage.SAMPLE: stage_contract(Stage.SAMPLE, ["index.samples"], [])}
    if Payload.KL in payloads:
        contracts[Stage.ADVANTAGE_KL] = stage_contract(
            Stage.ADVANTAGE_KL,
            [Payload.LOG_PROBS, Payload.REF_LOG_PROBS, "config.slime"],
            [Payload.KL],
        )
    if Payload.ADVANTAGES in payloads:
        contracts[Stage.ADVANTAGE_ESTIMATE] = stage_contract(
            Stage.ADVANTAGE_ESTIMATE,
            ["index.samples.reward", Payload.KL, "config.slime"],
            [Payload.ADVANTAGES, Payload.RETURNS],
        )
    mb_ids = [mb for _, mb, _, _ in members if mb is not None]
    groups = sorted({rec["group_index"] for rec in records})
    identity = {
        "actor_step_id": {"rollout_id": r, "step_id": s},
        "rollout_id": None,
        "micro_batch_ids": list(dict.fromkeys(mb_ids)),
        "semantic_group_ids": [f"g-{g}" for g in groups],
        "rank": {"dp": max(1, len(train.doc.get("dp_shards") or []))},
        "weight_lineage": {"rollout_weight": _weight(rollout.samples), "actor_weight": None},
    }
    extension = {
        **header,
        "kind": "train",
        "step": s,
        "steps": steps,
        "num_samples": len(train.samples),
        "derived": derived,
    }
    return _bundle(
        (run, f"replay-{r}-{s}", [str(train.path), str(rollout.path)]),
        f"slime-step-{r}-{s}",
        (identity, records, cfg, payloads, contracts),
        {},
        extension,
    )


# --------------------------------------------------------------------------- entry point


#: the first number of a file name: slime's templates put {rollout_id} in both dumps' names
_NAME_NUMBER = re.compile(r"\d+")


def _by_name(files: list[Path]) -> list[list[Path]]:
    """The files in groups that share the first number of their names (a rollout's
    ``rollout_data/N.pt``, ``eval_N.pt`` and ``train_data/N.pt``), in that number's order;
    names without a number come last, together. Only memory depends on this: pairing goes
    by the ``rollout_id`` each dump holds."""
    numbered: dict[int, list[Path]] = {}
    rest: list[Path] = []
    for path in files:
        found = _NAME_NUMBER.search(path.stem)
        if found is None:
            rest.append(path)
        else:
            numbered.setdefault(int(found.group()), []).append(path)
    return [numbered[k] for k in sorted(numbered)] + ([rest] if rest else [])


def convert(paths: list[str], *, run: str, config: str | None) -> Iterator[FrameworkBundle]:
    """The bundles of every dump `paths` name, one rollout at a time (its dumps are loaded,
    checked and converted, then dropped, so memory holds one rollout's dumps). A refusal is
    raised before the bundles of the dumps after it; nothing is written here."""
    check_run_name(run)
    args = slime_config.read_args(config)
    seen_rollouts: dict[tuple[bool, int], Path] = {}
    seen_trains: dict[int, Path] = {}
    pending: dict[int, TrainDump] = {}  # train dumps whose rollout dump is not read yet
    converted: set[int] = set()  # rollouts (not evaluations) whose bundles are out
    for group in _by_name(dump_files(paths)):
        rollouts: list[RolloutDump] = []
        for path in group:
            dump = classify(path, load_dump(path))
            r = dump.rollout_id
            if isinstance(dump, TrainDump):
                if r in seen_trains:
                    raise BundleError(
                        f"{path}: a second train dump of rollout {r} (the first: "
                        f"{seen_trains[r]}); slime writes one per rollout"
                    )
                if r in converted:
                    raise BundleError(
                        f"{path}: the train dump of rollout {r} came after its rollout dump "
                        f"{seen_rollouts[False, r]} was converted; give them names that carry "
                        "the rollout id, as slime's templates do"
                    )
                seen_trains[r] = path
                pending[r] = dump
                continue
            key = (dump.evaluation, r)
            if key in seen_rollouts:
                raise BundleError(
                    f"{path}: a second {'evaluation' if dump.evaluation else 'rollout'} dump "
                    f"of rollout {r} (the first: {seen_rollouts[key]})"
                )
            seen_rollouts[key] = path
            rollouts.append(dump)
        for dump in sorted(rollouts, key=lambda d: d.evaluation):
            train = None if dump.evaluation else pending.pop(dump.rollout_id, None)
            if not dump.evaluation:
                converted.add(dump.rollout_id)
            yield rollout_bundle(dump, train, args, run)
            if train is not None:
                yield from step_bundles(train, dump, args, run)
    for r, train in sorted(pending.items()):
        raise BundleError(
            f"{train.path}: the rollout dump of rollout {r} is not among the paths; a train "
            "dump has no group_index or prompt of its own, so ingest it with its rollout "
            "dump (both files of --dump-details)"
        )
