"""The replay stage registry: every built-in stage registered once, in chain order."""

from __future__ import annotations

import dataclasses

import pytest

from trajstore.errors import UsageError
from trajstore.replay import builtin  # noqa: F401  (registers the built-in stages)
from trajstore.replay.registry import get_stage, register_stage, registered_stages
from trajstore.vocab import STAGE_ORDER, Stage

pytestmark = pytest.mark.unit


def test_the_router_stage_is_registered_by_its_own_module() -> None:
    assert get_stage("router.consistency").run.__module__ == "trajstore.router.stage"
    assert get_stage(Stage.LOSS_POLICY).run.__module__ == "trajstore.replay.stages"


def test_an_unknown_stage_is_a_usage_error_naming_the_stages() -> None:
    with pytest.raises(UsageError, match="unknown stage loss.critic; stages: sample, reward.raw"):
        get_stage("loss.critic")


def test_a_second_definition_of_a_registered_stage_is_refused() -> None:
    impostor = dataclasses.replace(get_stage(Stage.SAMPLE), version="v9")
    with pytest.raises(ValueError, match="registered twice"):
        register_stage(impostor)
    assert get_stage(Stage.SAMPLE).version == "v1"


def test_registered_stages_follow_the_chain_order() -> None:
    assert [stage.name for stage in registered_stages()] == list(STAGE_ORDER)
