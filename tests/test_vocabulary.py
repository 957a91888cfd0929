"""The replay vocabulary is defined once (trajstore/vocab.py)
and prints as the bundle format's words."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import numpy as np
import pytest

from trajstore.jsonio import json_safe
from trajstore.vocab import (
    LOSS_FIELDS,
    STAGE_ORDER,
    STEP_STATUSES,
    Stage,
    StageStatus,
    Verdict,
    required_loss_fields,
)

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
VOCAB = REPO / "trajstore" / "vocab.py"


def string_constants(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


def test_stage_names_are_spelled_only_in_the_vocabulary() -> None:
    # "sample" is an ordinary word elsewhere; every other stage name is dotted and unmistakable
    dotted = {stage.value for stage in Stage if "." in stage.value}
    spelled = [
        f"{path.relative_to(REPO)}:{line} {value}"
        for folder in ("trajstore", "api")
        for path in sorted((REPO / folder).rglob("*.py"))
        if path != VOCAB
        for line, value in string_constants(path)
        if value in dotted
    ]
    assert spelled == []


def test_loss_policy_is_one_literal() -> None:
    found = [value for _, value in string_constants(VOCAB) if value == "loss.policy"]
    assert found == ["loss.policy"]


def test_the_vocabulary_imports_nothing_of_trajstore() -> None:
    tree = ast.parse(VOCAB.read_text(encoding="utf-8"))
    imported = [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    ] + [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert not [name for name in imported if name.startswith("trajstore")]


def test_members_print_and_serialize_as_their_words() -> None:
    assert str(Stage.LOSS_POLICY) == "loss.policy"
    assert f"{Stage.ROUTER_CONSISTENCY}" == "router.consistency"
    assert f"[{StageStatus.PASS:>7}]" == "[   pass]"
    assert json.dumps({Stage.SAMPLE: [Verdict.DIVERGED]}) == '{"sample": ["diverged"]}'
    assert Stage.REWARD_RAW == "reward.raw" and {"reward.raw": 1}[Stage.REWARD_RAW] == 1


def test_stage_order_is_the_chain_upstream_first() -> None:
    assert [str(stage) for stage in STAGE_ORDER] == [
        "sample",
        "reward.raw",
        "reward.post_process",
        "advantage.kl",
        "advantage.estimate",
        "loss.policy",
        "loss.value",
        "router.consistency",
    ]


def test_step_statuses_are_plain_strings_for_argparse() -> None:
    assert STEP_STATUSES == ("pass", "diverged", "unsupported", "refused", "unreplayed")
    assert all(type(status) is str for status in STEP_STATUSES)


def test_kl_loss_is_required_only_with_use_kl_loss() -> None:
    assert required_loss_fields(False) == [
        "loss",
        "pg_loss",
        "entropy_loss",
        "pg_clipfrac",
        "ppo_kl",
    ]
    assert required_loss_fields(True) == list(LOSS_FIELDS)


def test_json_safe_nulls_non_finite_floats_and_unwraps_numpy_scalars() -> None:
    doc = {"a": [math.nan, np.float32(1.5), np.int64(3)], "b": (math.inf, "x", None)}
    assert json_safe(doc) == {"a": [None, 1.5, 3], "b": [None, "x", None]}
    kept = json_safe({"a": math.inf}, finite_only=False)
    assert kept == {"a": math.inf}
    assert type(json_safe(np.int64(3))) is int
