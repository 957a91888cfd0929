"""`trajstore.integrations.engines`: SGLang / vLLM outputs decoded, every misalignment named.

Payloads are built here the way each engine builds them (the oracle is the hand-built
array of known expert ids, never the decoder):

- SGLang: ``meta_info["routed_experts"] = base64(int32 rows .tobytes())`` over input
  positions ``[routed_experts_start_len, len(input) + len(output) - 1)``;
  ``output_token_logprobs = [(logprob, token_id, text), ...]``; ``input_token_logprobs``
  over ``input_ids[logprob_start_len:]`` with entry 0 ``None``.
- vLLM: ``CompletionOutput.routed_experts`` a numpy ``[prompt + output - 1, L, K]`` uint16
  array (int32 past 65,535 experts); ``logprobs`` one ``{token_id: Logprob}`` per output
  token; ``RequestOutput.prompt_logprobs`` with entry 0 ``None``. The two classes below
  carry vLLM's field names (vLLM itself is not installed and must not be).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from trajstore.capture import CaptureConfig, CaptureManager
from trajstore.cli import main
from trajstore.errors import EngineOutputError
from trajstore.integrations.engines import (
    RouterSpec,
    SGLangTurn,
    VLLMTurn,
    blank_final_tokens,
    decode_sglang,
    decode_vllm,
    rollout_log_probs,
    rollout_routes,
)

pytestmark = pytest.mark.unit

E, L, K = 8, 4, 2
ROUTER = RouterSpec(num_experts=E, num_layers=L, top_k=K)
PROMPT = [101, 102, 103, 104, 105]
OUTPUT = [201, 202, 203, 204]
OUT_LP = [-0.25, -1.5, -0.125, -2.0]


def known_rows(n: int, start: int = 0, experts: int = E) -> np.ndarray:
    """Row p (input position p), layer l, slot k: expert (7p + 3l + 5k) mod E, distinct in a row."""
    p = np.arange(start, start + n)[:, None, None]
    layer = np.arange(L)[None, :, None]
    slot = np.arange(K)[None, None, :]
    return ((7 * p + 3 * layer + 5 * slot) % experts).astype(np.int64)


def b64(rows: np.ndarray, dtype: str = "<i4") -> str:
    """What SGLang's detokenizer sends: base64 of the rows' bytes."""
    return base64.b64encode(np.ascontiguousarray(rows, dtype=dtype).tobytes()).decode("utf-8")


def sglang_turn(
    input_ids: list[int] = PROMPT,
    output_ids: list[int] = OUTPUT,
    logprobs: list[float] = OUT_LP,
    rows: np.ndarray | None = None,
    start: int = 0,
    **meta: Any,
) -> SGLangTurn:
    if rows is None:
        rows = known_rows(len(input_ids) + len(output_ids) - 1 - start, start)
    meta_info = {
        "prompt_tokens": len(input_ids),
        "completion_tokens": len(output_ids),
        "finish_reason": {"type": "stop"},
        "output_token_logprobs": [
            (lp, t, None) for lp, t in zip(logprobs, output_ids, strict=False)
        ],
        "routed_experts": b64(rows),
        **meta,
    }
    response = {"text": "...", "output_ids": list(output_ids), "meta_info": meta_info}
    return SGLangTurn.from_response(input_ids, response, routed_experts_start_len=start)


@dataclass
class Logprob:
    """vLLM's ``vllm.logprobs.Logprob``."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """vLLM's ``vllm.outputs.CompletionOutput`` fields."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    routed_experts: np.ndarray | None = None
    finish_reason: str | None = "stop"


@dataclass
class RequestOutput:
    """vLLM's ``vllm.outputs.RequestOutput`` fields this module reads."""

    request_id: str
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput] = field(default_factory=list)


def vllm_output(
    prompt: list[int] = PROMPT,
    output: list[int] = OUTPUT,
    logprobs: list[float] = OUT_LP,
    rows: np.ndarray | None = None,
    dtype: Any = np.uint16,
    prompt_lp: list[float] | None = None,
) -> RequestOutput:
    if rows is None:
        rows = known_rows(len(prompt) + len(output) - 1)
    lps = [
        {t: Logprob(lp, rank=1), (t + 1): Logprob(lp - 1.0, rank=2)}
        for t, lp in zip(output, logprobs, strict=True)
    ]
    plp = None
    if prompt_lp is not None:
        plp = [None] + [{t: Logprob(lp)} for t, lp in zip(prompt[1:], prompt_lp, strict=True)]
    comp = CompletionOutput(0, "...", list(output), sum(logprobs), lps, np.asarray(rows, dtype))
    return RequestOutput("r-0", list(prompt), plp, [comp])


def refused(match: str, fn, *args, **kwargs) -> str:
    """The call raises a one-line EngineOutputError (exit code 2) matching ``match``."""
    with pytest.raises(EngineOutputError, match=match) as err:
        fn(*args, **kwargs)
    text = str(err.value)
    assert "\n" not in text and err.value.exit_code == 2
    return text


def refused_rows(match: str, sample: str, rows: np.ndarray) -> str:
    """decode_sglang refuses the 9-token sample (PROMPT + OUTPUT) whose routes are ``rows``."""
    return refused(match, decode_sglang, sample, sglang_turn(rows=rows), router=ROUTER)


# --------------------------------------------------------------------------- SGLang


def test_sglang_routes_and_logprobs_decode_to_the_ids_sent():
    s = decode_sglang("s-0", sglang_turn(), router=ROUTER)
    assert s.tokens.tolist() == PROMPT + OUTPUT
    assert (s.prompt_length, s.response_length) == (5, 4)
    assert s.routes.dtype == np.int32
    np.testing.assert_array_equal(s.routes, known_rows(8))
    assert s.log_probs.tolist() == OUT_LP
    assert s.loss_mask.tolist() == [1, 1, 1, 1]
    assert s.record(group_index=3) == {
        "sample_id": "s-0",
        "total_length": 9,
        "response_length": 4,
        "loss_mask": [1, 1, 1, 1],
        "group_index": 3,
    }


def test_sglang_uint16_wire_dtype_is_read_as_declared():
    rows = known_rows(8)
    turn = sglang_turn(routed_experts=b64(rows, "<u2"), routed_experts_dtype="uint16")
    s = decode_sglang("s-0", turn, router=ROUTER)
    assert s.routes.dtype == np.uint16
    np.testing.assert_array_equal(s.routes, rows)


def test_sglang_input_token_logprobs_cover_the_prompt_tail():
    # logprob_start_len=2: entries for input_ids[2:], the first one None (SGLang pads it)
    entries = [(None, 103, None), (-0.5, 104, None), (-0.75, 105, None)]
    s = decode_sglang("s-0", sglang_turn(input_token_logprobs=entries), router=ROUTER)
    assert np.isnan(s.prompt_log_probs[:3]).all()
    assert s.prompt_log_probs[3:].tolist() == [-0.5, -0.75]


def test_sglang_one_row_per_token_is_the_offset_error():
    rows = known_rows(9)  # 9 tokens, 9 rows: one too many
    text = refused_rows("9 route rows for 9 tokens", "s-7", rows)
    assert (
        "sample 's-7'" in text and "one row per input position, 8" in text and "off by one" in text
    )


def test_sglang_too_few_rows_are_counted():
    text = refused_rows("6 route rows; expected 8", "s-1", known_rows(6))
    assert "sample 's-1'" in text


def test_sglang_zero_rows_before_the_routes_are_left_padding():
    rows = np.concatenate([np.zeros((2, L, K), np.int64), known_rows(8)])
    text = refused_rows("left padding", "s-2", rows)
    assert "sample 's-2'" in text and "positions 0-1" in text


def test_sglang_zero_rows_at_the_end_are_right_padding():
    # tokens and routes padded alike (a padded batch row): the counts agree, the rows do not
    out = [*OUTPUT, 0, 0]
    rows = np.concatenate([known_rows(8), np.zeros((2, L, K), np.int64)])
    turn = sglang_turn(output_ids=out, logprobs=[*OUT_LP, -0.1, -0.1], rows=rows)
    text = refused("right padding", decode_sglang, "s-3", turn, router=ROUTER)
    assert "sample 's-3'" in text and "positions 8-9" in text


def test_pad_ids_at_the_start_of_the_prompt_are_left_padding():
    turn = sglang_turn(input_ids=[0, 0, 0, *PROMPT], rows=known_rows(11))
    text = refused(
        "prompt starts with 3 pad id", decode_sglang, "s-4", turn, router=ROUTER, pad_token_id=0
    )
    assert "sample 's-4'" in text and "positions 0-2" in text


def test_pad_ids_at_the_end_of_the_response_are_right_padding():
    turn = sglang_turn(output_ids=[*OUTPUT, 9, 9], logprobs=[*OUT_LP, -0.1, -0.1])
    text = refused("response ends with 2 pad ids", decode_sglang, "s-5", turn, pad_token_id=9)
    assert "sample 's-5'" in text and "positions 9-10" in text


def test_one_trailing_pad_id_is_the_stop_token_when_pad_is_eos():
    turn = sglang_turn(output_ids=[*OUTPUT[:-1], 9], rows=known_rows(8))
    assert decode_sglang("s-5", turn, router=ROUTER, pad_token_id=9).tokens[-1] == 9


def test_an_all_zero_layer_is_an_incomplete_pipeline_capture():
    rows = known_rows(8)
    rows[:, 2:] = 0  # the second pipeline stage's layers never merged in
    text = refused_rows("layer\\(s\\) 2-3 of 4 are all zeros", "s-6", rows)
    assert "sample 's-6'" in text and "pipeline-parallel" in text


def test_a_declared_dense_layer_may_be_zero_and_is_kept():
    rows = known_rows(8)
    rows[:, 0] = 0  # SGLang leaves a dense layer's slots as they were allocated
    router = RouterSpec(num_experts=E, num_layers=L, top_k=K, dense_layers=(0,))
    s = decode_sglang("s-0", sglang_turn(rows=rows), router=router)
    np.testing.assert_array_equal(s.routes, rows)
    assert router.config(mode="r3")["dense_layers"] == [0]


def test_a_declared_dense_layer_with_ids_is_refused():
    router = RouterSpec(num_experts=E, num_layers=L, top_k=K, dense_layers=(1,))
    text = refused("layer 1 is declared dense", decode_sglang, "s-0", sglang_turn(), router=router)
    assert "position 0" in text


def test_an_expert_id_out_of_range_names_position_and_layer():
    rows = known_rows(8)
    rows[4, 1] = [9, 2]
    text = refused_rows("expert id 9 at position 4, layer 1", "s-8", rows)
    assert "sample 's-8'" in text and "[0, 8)" in text


def test_a_negative_id_is_named_as_no_route():
    rows = known_rows(8)
    rows[3, 2] = [-1, 5]
    refused_rows("expert id -1 at position 3, layer 2 .*no route", "s-8", rows)


def test_a_repeated_id_in_a_top_k_row_is_refused():
    rows = known_rows(8)
    rows[6, 3] = [5, 5]
    text = refused_rows("position 6, layer 3 selects expert 5 twice", "s-9", rows)
    assert "sample 's-9'" in text


def test_a_wire_dtype_too_narrow_for_the_experts_overflowed():
    rows = known_rows(8)
    turn = sglang_turn(routed_experts=b64(rows, "u1"), routed_experts_dtype="uint8")
    big = RouterSpec(num_experts=300, num_layers=L, top_k=K)
    text = refused(
        "uint8, which holds ids up to 255; with 300 experts", decode_sglang, "s-0", turn, router=big
    )
    assert "overflowed" in text


def test_base64_that_is_not_whole_rows_is_refused():
    turn = sglang_turn(routed_experts=b64(known_rows(8).reshape(-1)[:-1]))  # 63 int32 values
    refused(
        "63 int32 values, not whole rows of 4 layers x top-2 = 8",
        decode_sglang,
        "s-0",
        turn,
        router=ROUTER,
    )


def test_text_that_is_not_base64_is_refused():
    refused(
        "not valid base64", decode_sglang, "s-0", sglang_turn(routed_experts="@@@"), router=ROUTER
    )


def test_missing_routed_experts_say_how_to_ask_for_them():
    turn = sglang_turn()
    meta = {k: v for k, v in turn.meta_info.items() if k != "routed_experts"}
    refused(
        "return_routed_experts=True",
        decode_sglang,
        "s-0",
        SGLangTurn(PROMPT, meta, OUTPUT),
        router=ROUTER,
    )


def test_a_logprob_for_another_token_names_the_position():
    turn = sglang_turn()
    meta = dict(turn.meta_info)
    meta["output_token_logprobs"] = [
        (-0.25, 201, None),
        (-1.5, 299, None),
        (-0.1, 203, None),
        (-2.0, 204, None),
    ]
    refused(
        "output_token_logprobs at position 6 is for token 299, the sequence has 202",
        decode_sglang,
        "s-0",
        SGLangTurn(PROMPT, meta, OUTPUT),
    )


def test_a_logprob_count_that_differs_from_the_output_is_refused():
    turn = sglang_turn(logprobs=OUT_LP[:3])
    refused("has 3 entries for 4 tokens", decode_sglang, "s-0", turn)


def test_a_non_finite_logprob_names_the_position():
    refused(
        "log-prob at position 7 is nan",
        decode_sglang,
        "s-0",
        sglang_turn(logprobs=[-0.1, -0.2, float("nan"), -0.3]),
    )


def test_meta_info_prompt_tokens_must_match_input_ids():
    turn = sglang_turn(prompt_tokens=7)
    refused("prompt_tokens=7, input_ids has 5", decode_sglang, "s-0", turn, router=ROUTER)


# --------------------------------------------------------------------------- SGLang turns


def two_turns(start: int | None = None, second_input: list[int] | None = None):
    """Turn 0: PROMPT -> OUTPUT; a tool adds [301, 302]; turn 1 continues with [401, 402, 403]
    and reports routes from ``start`` (default: the 8 rows turn 0 gave) on."""
    full = known_rows(len(PROMPT) + 4 + 2 + 3 - 1)  # the sample's 13 rows
    t0 = sglang_turn(rows=full[:8])
    inp1 = second_input or [*PROMPT, *OUTPUT, 301, 302]
    start = 8 if start is None else start
    out1 = [401, 402, 403]
    t1 = sglang_turn(inp1, out1, [-0.5, -0.625, -0.75], rows=full[start:], start=start)
    return full, [t0, t1]


def test_sglang_turns_join_into_one_sample():
    full, turns = two_turns()
    s = decode_sglang("s-mt", turns, router=ROUTER)
    assert s.tokens.tolist() == [*PROMPT, *OUTPUT, 301, 302, 401, 402, 403]
    np.testing.assert_array_equal(s.routes, full)
    assert s.loss_mask.tolist() == [1, 1, 1, 1, 0, 0, 1, 1, 1]
    assert s.log_probs.tolist() == [*OUT_LP, 0.0, 0.0, -0.5, -0.625, -0.75]


def test_a_later_turn_from_position_zero_replaces_every_row():
    full, turns = two_turns(start=0)
    np.testing.assert_array_equal(decode_sglang("s-mt", turns, router=ROUTER).routes, full)


def test_routes_that_start_past_the_rows_so_far_do_not_join():
    _, turns = two_turns(start=10)  # rows for positions 8-9 were never reported
    text = refused(
        "turn 1: routes start at position 10", decode_sglang, "s-mt", turns, router=ROUTER
    )
    assert "positions 0-7 only" in text and "do not join" in text


def test_a_continuation_with_one_row_per_token_is_the_offset_error():
    _, turns = two_turns()
    t1 = turns[1]
    meta = {**t1.meta_info, "routed_experts": b64(known_rows(6, 8))}  # positions 8-13: one too many
    bad = SGLangTurn(t1.input_ids, meta, t1.output_ids, 8)
    text = refused(
        "turn 1: 6 route rows for positions 8-13 \\(routed_experts_start_len 8\\)",
        decode_sglang,
        "s-mt",
        [turns[0], bad],
        router=ROUTER,
    )
    assert "one row per input position, 5" in text


def test_a_first_turn_without_the_prompt_rows_does_not_join():
    # routed_experts_start_len=5 on the only request: rows 0-4 were never reported
    turn = sglang_turn(rows=known_rows(3, 5), start=5)
    text = refused(
        "routes start at position 5, but no turn before", decode_sglang, "s-pd", turn, router=ROUTER
    )
    assert "sample 's-pd'" in text and "do not join" in text


def test_a_turn_whose_input_rewrites_the_sample_does_not_join():
    bad = [*PROMPT[:3], 999, *PROMPT[4:], *OUTPUT, 301, 302]
    _, turns = two_turns(second_input=bad)
    text = refused(
        "turn 1: input_ids do not continue the sample: at position 3 token 999",
        decode_sglang,
        "s-mt",
        turns,
        router=ROUTER,
    )
    assert "sample 's-mt'" in text and "do not join" in text


def test_a_turn_without_logprobs_among_turns_with_them_is_refused():
    _, turns = two_turns()
    meta = {k: v for k, v in turns[1].meta_info.items() if k != "output_token_logprobs"}
    bare = SGLangTurn(
        turns[1].input_ids, meta, turns[1].output_ids, turns[1].routed_experts_start_len
    )
    refused("turn 1: no output log-probs", decode_sglang, "s-mt", [turns[0], bare], router=ROUTER)


# --------------------------------------------------------------------------- vLLM


def test_vllm_uint16_routes_and_logprobs_decode_to_the_ids_sent():
    out = vllm_output(prompt_lp=[-1.0, -2.0, -3.0, -4.0])
    s = decode_vllm("v-0", VLLMTurn.from_request_output(out), router=ROUTER)
    assert s.routes.dtype == np.uint16
    np.testing.assert_array_equal(s.routes, known_rows(8))
    assert s.log_probs.tolist() == OUT_LP
    assert np.isnan(s.prompt_log_probs[0]) and s.prompt_log_probs[1:].tolist() == [
        -1.0,
        -2.0,
        -3.0,
        -4.0,
    ]


def test_vllm_int32_routes_beyond_65535_experts():
    many = 70_000
    rows = known_rows(8, experts=many) + 69_930  # every id above uint16's range
    assert rows.min() >= 65_536 and rows.max() < many
    router = RouterSpec(num_experts=many, num_layers=L, top_k=K)
    out = vllm_output(rows=rows, dtype=np.int32)
    s = decode_vllm("v-0", VLLMTurn.from_request_output(out), router=router)
    assert s.routes.dtype == np.int32
    np.testing.assert_array_equal(s.routes, rows)


def test_vllm_uint16_with_more_than_65535_experts_overflowed():
    router = RouterSpec(num_experts=70_000, num_layers=L, top_k=K)
    out = vllm_output(dtype=np.uint16)
    text = refused(
        "uint16, which holds ids up to 65535; with 70000 experts",
        decode_vllm,
        "v-1",
        VLLMTurn.from_request_output(out),
        router=router,
    )
    assert "vllm sample 'v-1'" in text and "overflowed" in text


def test_vllm_minus_one_wrapped_to_uint16_is_named():
    rows = known_rows(8).astype(np.uint16)
    rows[2, 0, 1] = np.uint16(65535)
    out = vllm_output(rows=rows)
    refused(
        "expert id 65535 at position 2, layer 0 .*-1 wrapped to uint16",
        decode_vllm,
        "v-0",
        VLLMTurn.from_request_output(out),
        router=ROUTER,
    )


def test_vllm_one_row_per_token_is_the_offset_error():
    out = vllm_output(rows=known_rows(9))
    refused(
        "9 route rows for 9 tokens",
        decode_vllm,
        "v-2",
        VLLMTurn.from_request_output(out),
        router=ROUTER,
    )


def test_vllm_logprobs_without_the_sampled_token_name_the_position():
    out = vllm_output()
    out.outputs[0].logprobs[2] = {777: Logprob(-0.1)}
    refused(
        "CompletionOutput.logprobs at position 7 has no entry for token 203",
        decode_vllm,
        "v-0",
        VLLMTurn.from_request_output(out),
    )


def test_vllm_turns_join_and_the_last_routes_cover_the_sample():
    first = vllm_output()
    full = known_rows(12)
    prompt2 = [*PROMPT, *OUTPUT, 301]
    second = vllm_output(prompt2, [401, 402, 403], [-0.5, -0.5, -0.5], rows=full)
    turns = [VLLMTurn.from_request_output(first), VLLMTurn.from_request_output(second)]
    s = decode_vllm("v-mt", turns, router=ROUTER)
    np.testing.assert_array_equal(s.routes, full)
    assert s.loss_mask.tolist() == [1, 1, 1, 1, 0, 1, 1, 1]


def test_vllm_a_turn_that_drops_tokens_does_not_join():
    second = vllm_output([*PROMPT, *OUTPUT[:2]], [401], [-0.5], rows=known_rows(7))
    turns = [VLLMTurn.from_request_output(vllm_output()), VLLMTurn.from_request_output(second)]
    refused(
        "turn 1: input_ids do not continue the sample: at position 7 only 7 of the 9",
        decode_vllm,
        "v-mt",
        turns,
        router=ROUTER,
    )


# --------------------------------------------------------------------------- into capture


def test_rollout_routes_mark_each_final_token_unrouted():
    a = decode_sglang("a", sglang_turn(), router=ROUTER)
    b = decode_vllm("b", VLLMTurn.from_request_output(vllm_output()), router=ROUTER)
    packed = rollout_routes([a, b], ROUTER)
    assert packed.dtype == np.int8 and packed.shape == (18, L, K)
    np.testing.assert_array_equal(packed[:8], known_rows(8))
    np.testing.assert_array_equal(packed[9:17], known_rows(8))
    assert (packed[[8, 17]] == -1).all()
    assert rollout_log_probs([a, b]).tolist() == OUT_LP + OUT_LP


def test_blank_final_tokens_marks_the_last_row_of_each_sample():
    train = np.arange(5 * L * K, dtype=np.uint8).reshape(5, L, K) % E
    out = blank_final_tokens(train, [2, 3])
    assert out.dtype == np.int16
    assert (out[[1, 4]] == -1).all()
    np.testing.assert_array_equal(out[[0, 2, 3]], train[[0, 2, 3]])


def test_decoded_samples_captured_are_what_router_metrics_measures(tmp_path, capsys):
    """Two SGLang samples (one multi-turn) through CaptureManager into a bundle, then
    `trajstore router metrics`: the numbers are those of the hand-built ids and log-probs."""
    full, turns = two_turns()
    samples = [
        decode_sglang("s-0", sglang_turn(), router=ROUTER),
        decode_sglang("s-mt", turns, router=ROUTER),
    ]
    rollout = rollout_routes(samples, ROUTER)
    # the trainer routed every token, the final ones too; it differs from the engine at
    # three (token, layer) slots: s-0 position 6, s-0's final token, s-mt position 12
    train_raw = rollout.astype(np.int64)
    train_raw[[8, 22]] = [known_rows(1, 8)[0], known_rows(1, 13)[0]]
    for t, layer in [(6, 0), (8, 3), (9 + 12, 1)]:
        train_raw[t, layer] = (train_raw[t, layer] + 1) % E  # still distinct within the row
    train = blank_final_tokens(train_raw, [9, 14])
    roll_lp = rollout_log_probs(samples)
    train_lp = roll_lp.copy()
    train_lp[2] += np.log(3.0)  # s-0's third response token: a probability ratio of 3
    mask = np.concatenate([s.loss_mask for s in samples])
    assert mask.tolist() == [1, 1, 1, 1] + [1, 1, 1, 1, 0, 0, 1, 1, 1]
    valid_tokens, compared = 11, 11 - 2  # each sample's final token is valid, not compared
    cfg = {"advantage_estimator": "grpo", "router": ROUTER.config(mode="baseline")}
    manager = CaptureManager(
        CaptureConfig(enabled=True, output_dir=tmp_path / "cap", run="eng", block=True),
        recompute=cfg,
    )
    r_total = sum(s.response_length for s in samples)
    zeros = torch.zeros(r_total)
    with manager.step(0, 0) as step:
        step.add(
            0,
            samples=[s.record(group_index=0) for s in samples],
            log_probs=zeros,
            old_log_probs=zeros,
            advantages=zeros,
            loss_mask=torch.from_numpy(mask.astype(np.float32)),
            routes={
                "rollout_routed_experts": torch.from_numpy(rollout),
                "train_routed_experts": torch.from_numpy(train),
            },
            rollout_log_probs=torch.from_numpy(roll_lp),
            train_log_probs=torch.from_numpy(train_lp),
        )
    stats = manager.close()
    assert stats.errors == 0 and stats.dropped == 0
    bundle = tmp_path / "cap" / "replay-0-0"
    assert main(["router", "metrics", str(bundle), "--json"]) == 0
    (b,) = json.loads(capsys.readouterr().out)["bundles"]
    m = b["metrics"]
    assert m["metric_error"] == []
    assert m["valid_tokens"] == valid_tokens
    assert m["valid_token_layers"] == compared * L
    assert m["route_mismatch_rate"] == pytest.approx(2 / (compared * L))
    assert m["per_layer_mismatch"] == [
        pytest.approx(1 / compared),
        pytest.approx(1 / compared),
        0,
        0,
    ]
    assert m["token_any_mismatch"] == pytest.approx(2 / valid_tokens)
    assert m["kl_k1"] == pytest.approx(-np.log(3.0) / valid_tokens)
    assert m["f_tau_2"] == pytest.approx(1 / valid_tokens)
