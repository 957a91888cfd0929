"""Decode SGLang's and vLLM's rollout outputs into the arrays capture takes, with alignment checks.

A rollout engine hands back, per request, the experts it routed every input position to and
the log-prob of every token it sampled. This module turns those into a sample's tokens,
``loss_mask``, sampler log-probs ``[R]`` and routes, and packs samples into the payloads
`trajstore.capture.CaptureManager` takes (``routes={"rollout_routed_experts": [T, L, K]}``,
``rollout_log_probs=[R]``). NumPy only: neither engine is imported.

What the engines send (read from their sources; the checks below follow them):

- **SGLang** (``sgl-project/sglang``): ``state_capturer/base.py`` (commit 0564b521,
  ``BaseHostCache``, ``BaseTopkCapturer.get_topk``), ``state_capturer/routed_experts.py``
  (024911f2), ``state_capturer/routed_experts_wire.py`` (a6463a10), the older
  ``layers/moe/routed_experts_capturer.py`` (0837e911), ``managers/io_struct.py``
  (``GenerateReqInput.routed_experts_start_len``), the tokenizer manager's meta_info
  assembly and ``scheduler_output_processor_mixin.py`` (input log-probs). The host cache is a
  zero-filled int32 ``[kv slots, num_hidden_layers, num_experts_per_tok]``; a finished
  request returns the rows of its positions ``[start_len, seqlen - 1)`` (``start_len`` is
  the request's ``routed_experts_start_len``, in ``[0, prompt_tokens]``, 0 = the whole
  sequence): one row per *input* position, none for the last token, which is never fed
  back. ``meta_info["routed_experts"]`` is base64 of the row-major bytes (little-endian
  int32; since ``routed_experts_wire.py``, ``meta_info["routed_experts_dtype"]`` may say
  ``uint16``/``uint8``, used only when every id fits). Layers the engine does not route
  (dense layers, another pipeline stage's layers) stay 0. ``output_token_logprobs`` is a
  list of ``(logprob, token_id, text)`` per generated token; ``input_token_logprobs``
  covers ``input_ids[logprob_start_len:]`` with entry 0 always ``None``.
- **slime** (``THUDM/slime`` 624b824a), the consumer: ``slime/utils/types.py``
  ``Sample._apply_meta_info`` joins multi-turn and continuation pieces (rows =
  ``existing[:start_len] + new``, expecting ``len(tokens) - 1 - start_len`` new rows);
  ``observability/rollout_data_utils.py`` refuses an all-zero MoE layer when top-k > 1
  (SGLang pipeline stages that did not merge their captures);
  ``backends/megatron_utils/cp_utils.py`` asserts ``rows == len(tokens) - 1``.
- **vLLM** (``vllm-project/vllm``): ``model_executor/layers/fused_moe/
  routed_experts_capturer.py`` (commits 42fa4c09 and 00bd1493: a zero-filled int32 host
  buffer ``[kv slots, num_hidden_layers, num_experts_per_tok]``),
  ``v1/core/sched/scheduler.py`` ``Scheduler._get_routed_experts`` (the slots of
  ``request.num_tokens - 1`` positions: prompt and output, minus the last token),
  ``outputs.py`` (``CompletionOutput.routed_experts``, ``.logprobs``,
  ``RequestOutput.prompt_logprobs``) and ``logprobs.py`` (``Logprob``, ``FlatLogprobs``: a
  sequence of ``{token_id: Logprob}``; ``prompt_logprobs[0]`` is ``None``). The capturer of
  vllm PR #32415 (``_select_buffer_dtype``) keeps ids as uint16 and switches to int32 when
  the config names more than 65,535 experts; both dtypes are accepted here.

Checks (each raises `trajstore.errors.EngineOutputError`, exit code 2, one line naming the
engine, sample, turn, layer and/or position; nothing is trimmed, padded or repaired):

- **offset**: a piece must hold ``len(input) + len(output) - 1 - start_len`` rows; one row
  per *token* (a row too many) is named as such;
- **padding**: pad ids at the start of the prompt or two or more at the end of a response
  (``pad_token_id``), and rows of zeros on every layer at the start or end of a piece
  (top-k > 1: a zero row is no selection of distinct experts) are left or right padding;
- **incomplete capture**: a MoE layer all zeros at every position (top-k > 1): a pipeline
  stage's layers were not captured; a declared dense layer that carries ids;
- **range**: an id outside ``[0, num_experts)`` (the message says when it is a wrapped -1),
  a top-k row that repeats an id;
- **dtype**: a non-integer payload, or one whose dtype cannot hold ``num_experts - 1`` (a
  dtype that overflowed), a base64 payload that is not whole rows;
- **log-probs**: one per generated token, for the token generated, finite;
- **turns**: each turn's input must start with every token so far, and its routes may not
  start past the rows gathered so far (the pieces must join).

The last token has no route: packed for capture, each sample's final row is ``-1`` (a signed
dtype), which router metrics treat as "not compared" only where the training side is ``-1``
too (`blank_final_tokens`); docs/integrations.md, "Engines".
"""

from __future__ import annotations

import base64
import binascii
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trajstore.errors import EngineOutputError, UsageError
from trajstore.integrations.adapter import blank_final_rows, route_dtype, with_final_rows

__all__ = [
    "EngineOutputError",
    "EngineSample",
    "RouterSpec",
    "SGLangTurn",
    "VLLMTurn",
    "blank_final_tokens",
    "capture_route_dtype",
    "decode_sglang",
    "decode_vllm",
    "rollout_log_probs",
    "rollout_routes",
]

#: ``meta_info["routed_experts_dtype"]`` -> the wire dtype (SGLang's routed_experts_wire.py;
#: numpy's tobytes on the engine host: little-endian)
SGLANG_WIRE_DTYPES: Mapping[str, np.dtype] = {
    "int32": np.dtype("<i4"),
    "uint16": np.dtype("<u2"),
    "uint8": np.dtype("u1"),
}


@dataclass(frozen=True)
class RouterSpec:
    """The model's routing shape: what a route row must look like.

    ``num_layers`` is the engine's layer count (``num_hidden_layers``: both engines keep a
    row slot for every layer, MoE or not); ``dense_layers`` names the layers the engine never
    routes (they arrive as zeros and go to ``config.router.dense_layers``).
    """

    num_experts: int
    num_layers: int
    top_k: int
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_experts", "num_layers", "top_k"):
            value = getattr(self, name)
            try:
                number = operator.index(value) if not isinstance(value, bool) else 0
            except TypeError:
                number = 0
            if number < 1:
                raise UsageError(
                    f"engines: RouterSpec.{name} must be a positive int, got {value!r}"
                )
            object.__setattr__(self, name, number)
        if self.top_k > self.num_experts:
            raise UsageError(
                f"engines: RouterSpec.top_k {self.top_k} exceeds num_experts {self.num_experts}"
            )
        try:
            dense = tuple(sorted({operator.index(i) for i in self.dense_layers}))
        except TypeError:
            raise UsageError(
                f"engines: dense_layers must be layer indices, got {self.dense_layers!r}"
            ) from None
        if any(i < 0 or i >= self.num_layers for i in dense):
            raise UsageError(f"engines: dense_layers {list(dense)} not in [0, {self.num_layers})")
        object.__setattr__(self, "dense_layers", dense)

    @property
    def moe_layers(self) -> list[int]:
        dense = set(self.dense_layers)
        return [i for i in range(self.num_layers) if i not in dense]

    def config(self, **lineage: Any) -> dict[str, Any]:
        """``index.json`` ``config.router`` (router-metrics.md), plus ``mode``/engine/weight
        fields given as keywords."""
        return {
            "num_experts": self.num_experts,
            "num_layers": self.num_layers,
            "top_k": self.top_k,
            "dense_layers": list(self.dense_layers),
            **lineage,
        }


@dataclass
class EngineSample:
    """One decoded sample: prompt + response tokens and what the engine reported for them.

    ``routes`` row ``p`` holds the experts each layer chose when token ``p`` was fed (``T -
    1`` rows, in the engine's dtype). ``log_probs`` has one entry per response token: the
    engine's log-prob where it generated the token (``loss_mask`` 1), 0.0 at tokens it was
    given (a tool's output between turns, ``loss_mask`` 0), as slime stores them.
    ``prompt_log_probs`` has one per prompt token, NaN where the engine reported none
    (always position 0).
    """

    sample_id: str
    tokens: np.ndarray
    prompt_length: int
    loss_mask: np.ndarray
    routes: np.ndarray | None = None
    log_probs: np.ndarray | None = None
    prompt_log_probs: np.ndarray | None = None

    @property
    def total_length(self) -> int:
        return int(self.tokens.size)

    @property
    def response_length(self) -> int:
        return self.total_length - self.prompt_length

    def record(self, **fields: Any) -> dict[str, Any]:
        """The sample record capture takes (``group_index``, ``reward``, ... as keywords)."""
        return {
            "sample_id": self.sample_id,
            "total_length": self.total_length,
            "response_length": self.response_length,
            "loss_mask": [int(v) for v in self.loss_mask],
            **fields,
        }


@dataclass(frozen=True)
class SGLangTurn:
    """One SGLang ``/generate`` request of a sample and its response.

    ``routed_experts_start_len`` is the request's (default: ``meta_info``'s, else 0).
    ``output_ids`` is the response's; without it the ids in ``output_token_logprobs`` are
    the output.
    """

    input_ids: Sequence[int]
    meta_info: Mapping[str, Any]
    output_ids: Sequence[int] | None = None
    routed_experts_start_len: int | None = None

    @classmethod
    def from_response(
        cls,
        input_ids: Sequence[int],
        response: Mapping[str, Any],
        routed_experts_start_len: int | None = None,
    ) -> SGLangTurn:
        """From the request's ``input_ids`` and the ``/generate`` response dict."""
        if not isinstance(response, Mapping) or not isinstance(response.get("meta_info"), Mapping):
            raise EngineOutputError("sglang: a /generate response needs a 'meta_info' dict")
        return cls(
            input_ids, response["meta_info"], response.get("output_ids"), routed_experts_start_len
        )


@dataclass(frozen=True)
class VLLMTurn:
    """One vLLM request of a sample: its prompt ids and one ``CompletionOutput``
    (``token_ids``, ``logprobs``, ``routed_experts``), optionally ``prompt_logprobs``."""

    prompt_token_ids: Sequence[int]
    completion: Any
    prompt_logprobs: Sequence[Any] | None = None

    @classmethod
    def from_request_output(cls, request_output: Any, index: int = 0) -> VLLMTurn:
        """From a ``RequestOutput``: its prompt and its ``outputs[index]`` (n > 1: one sample
        per completion, each with its own routes over the shared prompt)."""
        return cls(
            request_output.prompt_token_ids,
            request_output.outputs[index],
            getattr(request_output, "prompt_logprobs", None),
        )


# --------------------------------------------------------------------------- one piece


@dataclass
class _Piece:
    """One turn, engine-neutral: what the join needs."""

    where: str
    input_ids: np.ndarray
    output_ids: np.ndarray
    rows: np.ndarray | None  # [n, L, K]: positions [start, len(input) + len(output) - 1)
    start: int
    out_log_probs: np.ndarray | None  # [len(output)]
    in_log_probs: np.ndarray | None  # [len(input)], NaN where none


def _ids(values: Any, what: str, where: str) -> np.ndarray:
    try:
        arr = np.asarray(list(values) if not isinstance(values, np.ndarray) else values)
    except TypeError:
        raise EngineOutputError(f"{where}: {what} is not a sequence of token ids") from None
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise EngineOutputError(f"{where}: {what} must be a flat list of integer token ids")
    return arr.astype(np.int64)


def _finite(value: Any, what: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise EngineOutputError(f"{where}: {what} is {value!r}, not a number")
    out = float(value)
    if not math.isfinite(out):
        raise EngineOutputError(f"{where}: {what} is {out} (not finite)")
    return out


def _sglang_token_logprobs(
    entries: Any, ids: np.ndarray, first: int, what: str, where: str, *, none_first: bool
) -> np.ndarray:
    """``[(logprob, token_id, text), ...]`` aligned with ``ids``: float64 values (NaN for the
    leading None of ``input_token_logprobs``). Positions in messages start at ``first``."""
    if not isinstance(entries, Sequence) or isinstance(entries, (str, bytes)):
        raise EngineOutputError(f"{where}: meta_info[{what!r}] is not a list")
    if len(entries) != ids.size:
        raise EngineOutputError(
            f"{where}: meta_info[{what!r}] has {len(entries)} entries for {ids.size} tokens"
        )
    out = np.empty(ids.size, dtype=np.float64)
    for i, entry in enumerate(entries):
        pos = first + i
        if not isinstance(entry, Sequence) or len(entry) not in (2, 3):
            raise EngineOutputError(
                f"{where}: {what} at position {pos} is {entry!r}, not (logprob, token_id, text)"
            )
        logprob, token = entry[0], entry[1]
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
            raise EngineOutputError(f"{where}: {what} at position {pos} has token id {token!r}")
        if int(token) != int(ids[i]):
            raise EngineOutputError(
                f"{where}: {what} at position {pos} is for token {int(token)}, the sequence has "
                f"{int(ids[i])} there"
            )
        if logprob is None and none_first and i == 0:
            out[i] = np.nan
            continue
        out[i] = _finite(logprob, f"the {what} log-prob at position {pos}", where)
    return out


def _sglang_rows(meta_info: Mapping[str, Any], router: RouterSpec, where: str) -> np.ndarray:
    """base64 ``meta_info["routed_experts"]`` -> ``[n, L, K]`` in the wire dtype."""
    payload = meta_info.get("routed_experts")
    if payload is None:
        raise EngineOutputError(
            f"{where}: meta_info has no 'routed_experts' (send return_routed_experts=True to a "
            "server started with --enable-return-routed-experts)"
        )
    if not isinstance(payload, str):
        raise EngineOutputError(
            f"{where}: meta_info['routed_experts'] is a {type(payload).__name__}, not base64 text"
        )
    name = meta_info.get("routed_experts_dtype", "int32")
    dtype = SGLANG_WIRE_DTYPES.get(str(name).strip().lower())
    if dtype is None:
        raise EngineOutputError(
            f"{where}: meta_info['routed_experts_dtype'] {name!r} is none of "
            f"{', '.join(SGLANG_WIRE_DTYPES)}"
        )
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise EngineOutputError(
            f"{where}: meta_info['routed_experts'] is not valid base64"
        ) from None
    if len(raw) % dtype.itemsize:
        raise EngineOutputError(
            f"{where}: routed_experts holds {len(raw)} bytes, not a whole number of {dtype.name} "
            "values"
        )
    flat = np.frombuffer(raw, dtype=dtype)
    per_row = router.num_layers * router.top_k
    if flat.size % per_row:
        raise EngineOutputError(
            f"{where}: routed_experts holds {flat.size} {dtype.name} values, not whole rows of "
            f"{router.num_layers} layers x top-{router.top_k} = {per_row}"
        )
    return flat.reshape(-1, router.num_layers, router.top_k)


def _sglang_piece(turn: SGLangTurn, router: RouterSpec | None, where: str) -> _Piece:
    if not isinstance(turn, SGLangTurn):
        raise UsageError(f"engines: decode_sglang takes SGLangTurn(s), got {type(turn).__name__}")
    meta = turn.meta_info
    if not isinstance(meta, Mapping):
        raise EngineOutputError(f"{where}: meta_info is a {type(meta).__name__}, not a dict")
    input_ids = _ids(turn.input_ids, "input_ids", where)
    entries = meta.get("output_token_logprobs")
    if entries is not None and (
        not isinstance(entries, Sequence) or isinstance(entries, (str, bytes))
    ):
        raise EngineOutputError(f"{where}: meta_info['output_token_logprobs'] is not a list")
    if turn.output_ids is not None:
        output_ids = _ids(turn.output_ids, "output_ids", where)
    elif entries is not None:
        ids = [e[1] if isinstance(e, Sequence) and len(e) in (2, 3) else e for e in entries]
        output_ids = _ids(ids, "the token ids of output_token_logprobs", where)
    else:
        raise EngineOutputError(
            f"{where}: neither output_ids nor meta_info['output_token_logprobs'] gives the output"
        )
    for key, have in (("prompt_tokens", input_ids.size), ("completion_tokens", output_ids.size)):
        said = meta.get(key)
        if isinstance(said, int) and not isinstance(said, bool) and said != have:
            got = "input_ids" if key == "prompt_tokens" else "the output"
            raise EngineOutputError(f"{where}: meta_info says {key}={said}, {got} has {have}")
    out_lp = None
    if entries is not None:
        out_lp = _sglang_token_logprobs(
            entries, output_ids, input_ids.size, "output_token_logprobs", where, none_first=False
        )
    in_lp = None
    in_entries = meta.get("input_token_logprobs")
    if in_entries is not None:
        if not isinstance(in_entries, Sequence) or isinstance(in_entries, (str, bytes)):
            raise EngineOutputError(f"{where}: meta_info['input_token_logprobs'] is not a list")
        n = len(in_entries)
        if not 0 < n <= input_ids.size:
            raise EngineOutputError(
                f"{where}: meta_info['input_token_logprobs'] has {n} entries for "
                f"{input_ids.size} input tokens"
            )
        first = input_ids.size - n
        in_lp = np.full(input_ids.size, np.nan)
        in_lp[first:] = _sglang_token_logprobs(
            in_entries, input_ids[first:], first, "input_token_logprobs", where, none_first=True
        )
    start = _start_len(turn, meta, input_ids.size, where)
    rows = _sglang_rows(meta, router, where) if router is not None else None
    return _Piece(where, input_ids, output_ids, rows, start, out_lp, in_lp)


def _start_len(turn: SGLangTurn, meta: Mapping[str, Any], n_input: int, where: str) -> int:
    given, said = turn.routed_experts_start_len, meta.get("routed_experts_start_len")
    for value, src in ((given, "the request's"), (said, "meta_info's")):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise EngineOutputError(f"{where}: {src} routed_experts_start_len is {value!r}")
    if given is not None and said is not None and given != said:
        raise EngineOutputError(
            f"{where}: the request's routed_experts_start_len {given} differs from meta_info's "
            f"{said}"
        )
    start = given if given is not None else (said or 0)
    if not 0 <= start <= n_input:
        raise EngineOutputError(
            f"{where}: routed_experts_start_len {start} is outside [0, {n_input}] (SGLang takes "
            "it within the prompt)"
        )
    return start


def _logprob_of(entry: Any) -> Any:
    """vLLM's ``Logprob`` (``.logprob``), or its dict form after a JSON/msgspec round trip."""
    if isinstance(entry, Mapping):
        return entry.get("logprob")
    return getattr(entry, "logprob", entry)


def _vllm_logprobs(
    positions: Any, ids: np.ndarray, first: int, what: str, where: str, *, none_first: bool
) -> np.ndarray:
    """A sequence of ``{token_id: Logprob}`` aligned with ``ids`` -> float64 (NaN for the
    leading None of ``prompt_logprobs``)."""
    try:
        n = len(positions)
    except TypeError:
        raise EngineOutputError(f"{where}: {what} is not a sequence") from None
    if n != ids.size:
        raise EngineOutputError(f"{where}: {what} has {n} positions for {ids.size} tokens")
    out = np.empty(ids.size, dtype=np.float64)
    for i in range(n):
        pos, entry = first + i, positions[i]
        if entry is None and none_first and i == 0:
            out[i] = np.nan
            continue
        if not isinstance(entry, Mapping):
            raise EngineOutputError(
                f"{where}: {what} at position {pos} is {type(entry).__name__}, not "
                "{token_id: Logprob}"
            )
        token = int(ids[i])
        if token not in entry:
            raise EngineOutputError(
                f"{where}: {what} at position {pos} has no entry for token {token}, the token "
                f"there (it has {sorted(int(k) for k in entry)[:8]})"
            )
        out[i] = _finite(_logprob_of(entry[token]), f"the {what} log-prob at position {pos}", where)
    return out


def _vllm_piece(turn: VLLMTurn, router: RouterSpec | None, where: str) -> _Piece:
    if not isinstance(turn, VLLMTurn):
        raise UsageError(f"engines: decode_vllm takes VLLMTurn(s), got {type(turn).__name__}")
    comp = turn.completion
    input_ids = _ids(turn.prompt_token_ids, "prompt_token_ids", where)
    token_ids = getattr(comp, "token_ids", None)
    if token_ids is None:
        raise EngineOutputError(
            f"{where}: the completion has no token_ids (not a CompletionOutput?)"
        )
    output_ids = _ids(token_ids, "CompletionOutput.token_ids", where)
    out_lp = None
    if getattr(comp, "logprobs", None) is not None:
        out_lp = _vllm_logprobs(
            comp.logprobs,
            output_ids,
            input_ids.size,
            "CompletionOutput.logprobs",
            where,
            none_first=False,
        )
    in_lp = None
    if turn.prompt_logprobs is not None:
        in_lp = _vllm_logprobs(
            turn.prompt_logprobs, input_ids, 0, "prompt_logprobs", where, none_first=True
        )
    rows = None
    if router is not None:
        routed = getattr(comp, "routed_experts", None)
        if routed is None:
            raise EngineOutputError(
                f"{where}: CompletionOutput.routed_experts is None (start vLLM with "
                "enable_return_routed_experts=True)"
            )
        rows = np.asarray(routed)
    return _Piece(where, input_ids, output_ids, rows, 0, out_lp, in_lp)


# --------------------------------------------------------------------------- route checks


def _spans(indices: Any) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _wrapped(value: int) -> str:
    """Why an out-of-range id looks the way it does, when it is a known overflow pattern."""
    for bits in (8, 16, 32):
        if value == 2**bits - 1:
            return f" ({value} is -1 wrapped to uint{bits}: a dtype that overflowed)"
    if value == -1:
        return " (-1: no route; SGLang and vLLM report none)"
    if value < 0:
        return " (a negative id: a dtype that overflowed?)"
    return ""


def _check_dtype(rows: np.ndarray, router: RouterSpec, where: str) -> None:
    if not np.issubdtype(rows.dtype, np.integer):
        raise EngineOutputError(f"{where}: routed experts are {rows.dtype}, not integer ids")
    top = np.iinfo(rows.dtype).max
    if top < router.num_experts - 1:
        raise EngineOutputError(
            f"{where}: routed experts arrive as {rows.dtype}, which holds ids up to {top}; with "
            f"{router.num_experts} experts larger ids wrapped (a dtype that overflowed)"
        )
    if rows.ndim != 3 or rows.shape[1:] != (router.num_layers, router.top_k):
        raise EngineOutputError(
            f"{where}: routed experts have shape {list(rows.shape)}; expected [positions, "
            f"{router.num_layers} layers, top-{router.top_k}]"
        )


def _zero_runs(flags: np.ndarray) -> tuple[int, int]:
    """Lengths of the leading and trailing runs of True."""
    if flags.all():
        return flags.size, flags.size
    return int(np.argmin(flags)), int(np.argmin(flags[::-1]))


def _padding_message(where: str, lead: int, trail: int, start: int, n: int) -> str:
    if lead:
        return (
            f"{where}: {lead} route row(s) of zeros on every layer at positions "
            f"{_spans(range(start, start + lead))}: left padding left in (a zero row selects "
            "no distinct experts)"
        )
    return (
        f"{where}: {trail} route row(s) of zeros on every layer at positions "
        f"{_spans(range(start + n - trail, start + n))}: right padding left in (a zero row "
        "selects no distinct experts)"
    )


def _check_rows(piece: _Piece, router: RouterSpec) -> np.ndarray:
    """Every route check of one piece, in the order that names the root cause first."""
    rows, where, start = piece.rows, piece.where, piece.start
    assert rows is not None
    _check_dtype(rows, router, where)
    n_tokens = piece.input_ids.size + piece.output_ids.size
    expected = n_tokens - 1 - start
    n = rows.shape[0]
    moe = router.moe_layers
    live = rows[:, moe] if router.dense_layers else rows  # the layers the engine routes
    can_tell = router.top_k > 1 and bool(moe)  # a zero row is no selection only when K > 1
    zero_rows = (live == 0).all(axis=(1, 2)) if can_tell else np.zeros(n, dtype=bool)
    if n != expected:
        lead, trail = _zero_runs(zero_rows)
        extra = n - expected
        if extra > 0 and lead < n and max(lead, trail) >= extra:
            left = lead >= extra
            raise EngineOutputError(
                _padding_message(where, lead if left else 0, 0 if left else trail, start, n)
            )
        if extra == 1:
            span = (
                f"{n_tokens} tokens"
                if not start
                else f"positions {start}-{n_tokens - 1} (routed_experts_start_len {start})"
            )
            raise EngineOutputError(
                f"{where}: {n} route rows for {span}; the engine reports one row per input "
                f"position, {expected} (the last token is never fed back): one row per token "
                "is off by one"
            )
        raise EngineOutputError(
            f"{where}: {n} route rows; expected {expected} = {n_tokens} tokens - 1 - "
            f"routed_experts_start_len {start}"
        )
    if n == 0:
        return rows
    if can_tell:
        empty = [layer for layer in moe if not rows[:, layer].any()]
        if empty:
            raise EngineOutputError(
                f"{where}: layer(s) {_spans(empty)} of {router.num_layers} are all zeros at every "
                f"position: not captured (an incomplete pipeline-parallel capture, or dense layers "
                "to declare in RouterSpec.dense_layers)"
            )
        lead, trail = _zero_runs(zero_rows)
        if lead or trail:
            raise EngineOutputError(_padding_message(where, lead, trail, start, n))
    for layer in router.dense_layers:
        hit = np.flatnonzero(rows[:, layer].any(axis=-1))
        if hit.size:
            raise EngineOutputError(
                f"{where}: layer {layer} is declared dense but carries expert ids (position "
                f"{start + int(hit[0])})"
            )
    bad = (live < 0) | (live >= router.num_experts)
    if bad.any():
        r, li, k = (int(x) for x in np.argwhere(bad)[0])
        value = int(live[r, li, k])
        raise EngineOutputError(
            f"{where}: expert id {value} at position {start + r}, layer {moe[li]} is outside "
            f"[0, {router.num_experts}){_wrapped(value)}"
        )
    if router.top_k > 1:
        srt = np.sort(live, axis=-1)
        dup = (srt[..., 1:] == srt[..., :-1]).any(axis=-1)
        if dup.any():
            r, li = (int(x) for x in np.argwhere(dup)[0])
            row = live[r, li]
            twice = int(srt[r, li][1:][srt[r, li][1:] == srt[r, li][:-1]][0])
            raise EngineOutputError(
                f"{where}: position {start + r}, layer {moe[li]} selects expert {twice} twice "
                f"(top-{router.top_k} row {row.tolist()} repeats an id)"
            )
    return rows


# --------------------------------------------------------------------------- join


def _check_padding_ids(piece: _Piece, pad: int | None, first: bool) -> None:
    if pad is None:
        return
    lead, _ = _zero_runs(piece.input_ids == pad)
    if first and lead:
        n = lead
        raise EngineOutputError(
            f"{piece.where}: the prompt starts with {n} pad id(s) {pad} (positions "
            f"{_spans(range(n))}): left padding left in"
        )
    out = piece.output_ids
    _, trail = _zero_runs(out == pad)
    if trail >= 2:  # one may be the model's own stop token when pad == eos
        at = piece.input_ids.size + out.size - trail
        raise EngineOutputError(
            f"{piece.where}: the response ends with {trail} pad ids {pad} (positions "
            f"{_spans(range(at, at + trail))}): right padding left in"
        )


def _join(
    engine: str,
    sample_id: str,
    pieces: list[_Piece],
    router: RouterSpec | None,
    pad_token_id: int | None,
) -> EngineSample:
    tokens = pieces[0].input_ids
    prompt_length = int(tokens.size)
    mask: list[np.ndarray] = []
    log_probs: list[np.ndarray] = []
    with_lp = [p.out_log_probs is not None for p in pieces]
    if any(with_lp) and not all(with_lp):
        k = with_lp.index(False)
        raise EngineOutputError(
            f"{pieces[k].where}: no output log-probs, while other turns of the sample have them"
        )
    rows: np.ndarray | None = None
    for k, piece in enumerate(pieces):
        _check_padding_ids(piece, pad_token_id, first=k == 0)
        if k:
            have, got = tokens.size, piece.input_ids
            head = got[: min(have, got.size)]
            diff = np.flatnonzero(head != tokens[: head.size])
            if diff.size or got.size < have:
                at = int(diff[0]) if diff.size else int(got.size)
                what = (
                    f"token {int(got[at])} where the sample has {int(tokens[at])}"
                    if diff.size
                    else f"only {got.size} of the {have} tokens so far"
                )
                raise EngineOutputError(
                    f"{piece.where}: input_ids do not continue the sample: at position {at} "
                    f"{what} (the pieces do not join)"
                )
            inserted = got.size - have
            mask.append(np.zeros(inserted, dtype=np.int8))
            log_probs.append(np.zeros(inserted))
        tokens = np.concatenate([piece.input_ids, piece.output_ids])
        mask.append(np.ones(piece.output_ids.size, dtype=np.int8))
        if piece.out_log_probs is not None:
            log_probs.append(piece.out_log_probs)
        if router is not None:
            new = _check_rows(piece, router)
            have_rows = 0 if rows is None else rows.shape[0]
            if piece.start > have_rows:
                before = (
                    f"the turns before give rows for positions 0-{have_rows - 1} only"
                    if have_rows
                    else "no turn before gives the rows ahead of it"
                )
                raise EngineOutputError(
                    f"{piece.where}: routes start at position {piece.start}, but {before} (the "
                    "pieces do not join)"
                )
            if rows is not None and rows.dtype != new.dtype:
                raise EngineOutputError(
                    f"{piece.where}: routes arrive as {new.dtype}, earlier turns as {rows.dtype}"
                )
            rows = new if rows is None else np.concatenate([rows[: piece.start], new])
    response = tokens.size - prompt_length
    if response < 1:
        raise EngineOutputError(f"{engine} sample {sample_id!r}: the engine generated no token")
    return EngineSample(
        sample_id=sample_id,
        tokens=tokens,
        prompt_length=prompt_length,
        loss_mask=np.concatenate(mask),
        routes=rows,
        log_probs=np.concatenate(log_probs) if all(with_lp) else None,
        prompt_log_probs=pieces[0].in_log_probs,
    )


def _decode(
    engine: str,
    sample_id: str,
    turns: Any,
    cls: type,
    piece_of: Any,
    router: RouterSpec | None,
    pad_token_id: int | None,
) -> EngineSample:
    if not isinstance(sample_id, str) or not sample_id:
        raise UsageError(f"engines: sample_id must be a non-empty string, got {sample_id!r}")
    if router is not None and not isinstance(router, RouterSpec):
        raise UsageError(f"engines: router must be a RouterSpec, got {type(router).__name__}")
    seq = [turns] if isinstance(turns, cls) else list(turns)
    if not seq:
        raise UsageError(f"engines: sample {sample_id!r} has no turns")
    pieces = []
    for k, turn in enumerate(seq):
        where = f"{engine} sample {sample_id!r}" + (f" turn {k}" if len(seq) > 1 else "")
        pieces.append(piece_of(turn, router, where))
    return _join(engine, sample_id, pieces, router, pad_token_id)


def _decoder(engine: str, turn: type, piece: Any, doc: str) -> Any:
    """The public decoder of one engine: ``(sample_id, turns, *, router=None,
    pad_token_id=None) -> EngineSample``."""

    def decode(
        sample_id: str,
        turns: Any,
        *,
        router: RouterSpec | None = None,
        pad_token_id: int | None = None,
    ) -> EngineSample:
        return _decode(engine, sample_id, turns, turn, piece, router, pad_token_id)

    decode.__name__ = decode.__qualname__ = f"decode_{engine}"
    decode.__doc__ = doc
    return decode


decode_sglang = _decoder(
    "sglang",
    SGLangTurn,
    _sglang_piece,
    """One sample from its SGLang request(s): one turn, or the turns of a multi-turn or
    continued sample in order (each turn's ``input_ids`` continue the sample; its routes
    replace the rows from its ``routed_experts_start_len`` on, as slime joins them).

    Routes are decoded when ``router`` is given (their shape needs layers and top-k).
    """,
)
decode_vllm = _decoder(
    "vllm",
    VLLMTurn,
    _vllm_piece,
    """One sample from its vLLM request(s) (`VLLMTurn.from_request_output`); a later turn's
    prompt continues the sample, and its routes (the whole sequence) replace the earlier ones.
    """,
)


# --------------------------------------------------------------------------- for capture


def capture_route_dtype(num_experts: int) -> np.dtype:
    """The smallest signed dtype holding ``-1`` and every id below ``num_experts``."""
    try:
        return route_dtype(num_experts, signed=True)
    except ValueError as exc:
        raise UsageError(f"engines: {exc}") from None


def rollout_routes(samples: Sequence[EngineSample], router: RouterSpec) -> np.ndarray:
    """``routes={"rollout_routed_experts": ...}`` for capture: ``[T, L, K]`` over every token
    of every sample in order, each sample's last row ``-1`` (no route: the engine never fed
    that token), in `capture_route_dtype`."""
    dtype = capture_route_dtype(router.num_experts)
    tail = (router.num_layers, router.top_k)
    for s in samples:
        if s.routes is None:
            raise UsageError(f"engines: sample {s.sample_id!r} was decoded without a RouterSpec")
        if s.routes.shape != (s.total_length - 1, *tail):
            raise UsageError(
                f"engines: sample {s.sample_id!r} routes {list(s.routes.shape)} do not match "
                f"{s.total_length} tokens and the RouterSpec"
            )
    return with_final_rows([s.routes for s in samples], tail, dtype)


def rollout_log_probs(samples: Sequence[EngineSample]) -> np.ndarray:
    """``rollout_log_probs`` for capture: ``[R]`` float64, the response tokens of every
    sample in order."""
    for s in samples:
        if s.log_probs is None:
            raise UsageError(f"engines: sample {s.sample_id!r} carries no log-probs")
    return np.concatenate([s.log_probs for s in samples]) if samples else np.zeros(0)


def blank_final_tokens(routes: Any, total_lengths: Sequence[int]) -> np.ndarray:
    """A signed copy of training-side ``[T, L, K]`` routes with each sample's last row ``-1``.

    The rollout engine never routed a sample's last token, so that token cannot be compared:
    with ``-1`` on both sides router metrics leave it out (a dense slot); ``-1`` on one side
    only is ``expert_id_out_of_range``.
    """
    try:
        return blank_final_rows(routes, total_lengths)
    except ValueError as exc:
        raise UsageError(f"engines: {exc}") from None
