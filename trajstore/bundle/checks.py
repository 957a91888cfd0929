"""Content checks of an opened bundle that need no replay math.

`trajstore validate` runs these after the integrity gate: sample records,
payload lengths against the sample layout, non-finite values, semantic-group
closure. Each problem is one line naming the sample, field or payload.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from trajstore.bundle.reader import KEEP_CHECKED_BYTES, Bundle
from trajstore.errors import TrajstoreError
from trajstore.jsonio import is_binary_int_list
from trajstore.schema import Sample

#: Payloads laid out flat over the response tokens of every sample.
PER_TOKEN_PAYLOADS = frozenset(
    {
        "old_log_probs",
        "log_probs",
        "ref_log_probs",
        "entropy",
        "kl",
        "advantages",
        "returns",
        "rollout_log_probs",
        "train_log_probs",
        "loss_mask",
        # verl (trajstore.integrations.verl)
        "token_level_scores",
        "token_level_rewards",
        "values",
        "rollout_is_weights",
    }
)
#: Payloads laid out over every token (prompt + response) of every sample.
ROUTE_PAYLOADS = frozenset(
    {"rollout_routed_experts", "train_routed_experts", "train_natural_routed_experts"}
)


def sample_problems(bundle: Bundle) -> list[str]:
    """Per-sample integrity: unique ids, lengths, masks, group membership."""
    return sample_record_problems(bundle.index.samples)


def sample_record_problems(samples: list[Sample]) -> list[str]:
    """`sample_problems` over any list of sample records (e.g. a selection)."""
    out: list[str] = []
    ids = Counter(s.sample_id for s in samples)
    out += [f"sample id '{sid}' appears {n} times" for sid, n in ids.items() if n > 1]
    for s in samples:
        where = f"sample '{s.sample_id}'"
        if not (0 < s.response_length <= s.total_length):
            out.append(
                f"{where}: response_length {s.response_length} not in (0, total_length "
                f"{s.total_length}]"
            )
        if len(s.loss_mask) != s.response_length:
            out.append(
                f"{where}: loss_mask has {len(s.loss_mask)} entries, response_length is "
                f"{s.response_length}"
            )
        if not is_binary_int_list(s.loss_mask) and (
            bool in set(map(type, s.loss_mask)) or not set(s.loss_mask) <= {0, 1}
        ):
            out.append(f"{where}: loss_mask values must be 0 or 1")
        if isinstance(s.reward, list) and len(s.reward) != s.response_length:
            out.append(
                f"{where}: per-token reward has {len(s.reward)} entries, response_length is "
                f"{s.response_length}"
            )
    return out


def group_problems(bundle: Bundle) -> list[str]:
    """Semantic-group closure: every sample has a group, groups are whole."""
    out: list[str] = []
    samples = bundle.index.samples
    missing = [s.sample_id for s in samples if s.group_index is None]
    if missing:
        out.append(
            f"sample(s) {', '.join(missing[:5])} have no group_index (semantic group unknown)"
        )
    sizes = Counter(s.group_index for s in samples if s.group_index is not None)
    n = bundle.index.config.get("n_samples_per_prompt")
    if isinstance(n, int) and bundle.index.identity.kind == "rollout":
        for g, size in sorted(sizes.items()):
            if size != n:
                out.append(f"group g-{g} has {size} sample(s), n_samples_per_prompt is {n}")
    declared = bundle.index.identity.get("semantic_group_ids")
    if declared:
        present = {f"g-{g}" for g in sizes}
        undeclared = sorted(present - set(declared))
        if undeclared:
            out.append(
                f"group(s) {', '.join(undeclared)} not listed in identity.semantic_group_ids"
            )
    return out


def payload_problems(bundle: Bundle) -> list[str]:
    """Payload layout against the samples, and non-finite values."""
    out: list[str] = []
    samples = bundle.index.samples
    n_resp = sum(s.response_length for s in samples)
    n_total = sum(s.total_length for s in samples)
    kept = 0  # bytes of checked payloads left cached for the caller (ingest writes them next)
    for name in bundle.payload_names():
        try:
            t = bundle.load_payload(name)
        except TrajstoreError as exc:
            out.append(str(exc))
            continue
        if name in PER_TOKEN_PAYLOADS and t.shape != (n_resp,):
            out.append(
                f"payload '{name}': shape {list(t.shape)}, samples have {n_resp} response tokens"
            )
        if name in ROUTE_PAYLOADS and (len(t.shape) != 3 or t.shape[0] != n_total):
            out.append(f"payload '{name}': shape {list(t.shape)}, expected [{n_total}, L, K]")
        problem = _non_finite(name, t.array, t.dtype)
        if problem:
            out.append(problem)
        size = bundle.manifest.payloads[name].bytes
        if kept + size > KEEP_CHECKED_BYTES:
            bundle.release(name)  # re-read when written: one large payload in memory at a time
        else:
            kept += size
    return out


#: elements scanned per step of the non-finite check (bounds its temporaries to ~16 MiB)
_SCAN_ELEMENTS = 1 << 24


def _non_finite(name: str, arr: np.ndarray, dtype: str) -> str | None:
    """One line locating the first NaN/Inf of a float payload, scanned in bounded blocks."""
    if dtype == "torch.bfloat16":
        flat = arr.reshape(-1)

        def bad_of(block: np.ndarray) -> np.ndarray:
            return (block & 0x7F80) == 0x7F80  # exponent all ones: Inf or NaN
    elif arr.dtype.kind == "f":
        flat = arr.reshape(-1)

        def bad_of(block: np.ndarray) -> np.ndarray:
            return ~np.isfinite(block)
    else:
        return None
    count, first = 0, -1
    for start in range(0, flat.size, _SCAN_ELEMENTS):
        bad = bad_of(flat[start : start + _SCAN_ELEMENTS])
        n = int(np.count_nonzero(bad))
        if n and first < 0:
            first = start + int(np.flatnonzero(bad)[0])
        count += n
    if not count:
        return None
    return f"payload '{name}': {count} non-finite value(s) (NaN/Inf), first at flat index {first}"


def bundle_problems(bundle: Bundle) -> list[str]:
    return sample_problems(bundle) + group_problems(bundle) + payload_problems(bundle)


def bundle_warnings(bundle: Bundle) -> list[str]:
    out = list(bundle.warnings)
    if bundle.index.identity.cp != 1:
        out.append(f"identity.rank.cp = {bundle.index.identity.cp}: replay supports cp=1 only")
    return out
