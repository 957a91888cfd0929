"""The conversion layer every framework adapter shares (trajstore.integrations.adapter).

Expected values are written out by hand from the padded batches below, not computed by the
functions under test.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from trajstore.integrations.adapter import (
    FrameworkAdapter,
    SampleIds,
    blank_final_rows,
    config_get,
    group_of_position,
    groups_of_uids,
    keep_mask,
    last_token_lengths,
    micro_batch_id,
    pack,
    per_token,
    plain,
    route_dtype,
    trim_routes,
    with_final_rows,
)

pytestmark = pytest.mark.unit


def test_a_right_padded_batch_packs_to_each_samples_real_tokens_in_order() -> None:
    padded = torch.tensor([[1.0, 2.0, 0.0, 0.0], [3.0, 4.0, 5.0, 0.0], [6.0, 0.0, 0.0, 0.0]])
    keep = keep_mask(torch.tensor([2, 3, 1]), 4)
    assert keep.tolist() == [
        [True, True, False, False],
        [True, True, True, False],
        [True, False, False, False],
    ]
    assert pack(padded, keep).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert per_token(torch.tensor([0.5, -1.0, 2.0]), torch.tensor([2, 3, 1])).tolist() == [
        0.5,
        0.5,
        -1.0,
        -1.0,
        -1.0,
        2.0,
    ]


def test_packing_copies_so_a_later_in_place_update_does_not_reach_the_bundle() -> None:
    padded = torch.tensor([[1.0, 2.0]], requires_grad=True)
    packed = pack(padded, torch.tensor([[True, True]]))
    with torch.no_grad():
        padded.add_(10.0)
    assert packed.tolist() == [1.0, 2.0]
    assert not packed.requires_grad


def test_a_response_ends_at_its_last_loss_token() -> None:
    mask = torch.tensor([[1, 1, 0, 1, 0, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    assert last_token_lengths(mask).tolist() == [4, 1, 0]


def test_groups_follow_the_first_appearance_of_each_uid() -> None:
    assert groups_of_uids(["b", "a", "b", "c", "a"], 5) == [0, 1, 0, 2, 1]
    assert groups_of_uids(np.array([7, 7, 3]), 3) == [0, 0, 1]
    assert groups_of_uids(None, 3) == [0, 1, 2]


def test_groups_by_position_are_numbered_across_generation_batches() -> None:
    # generation batch 2 of 8 rows in groups of 4: rows 0-3 are group 4, rows 4-7 group 5
    assert [group_of_position(2, row, 8, 4) for row in range(8)] == [4] * 4 + [5] * 4


def test_a_row_consumed_again_in_one_step_gets_an_iteration_suffix() -> None:
    ids = SampleIds()
    assert [ids(f"s{row}", row) for row in (3, 1, 3, 3, 1)] == [
        "s3",
        "s1",
        "s3-it2",
        "s3-it3",
        "s1-it2",
    ]
    assert micro_batch_id(7) == "mb-0007"


def test_configs_of_any_form_become_plain_json() -> None:
    from dataclasses import dataclass

    @dataclass
    class Clip:
        low: float
        high: tuple[float, float]

    node = {"actor": {"clip": Clip(0.2, (0.1, 0.3)), "steps": np.int64(3)}}
    assert plain(node) == {"actor": {"clip": {"low": 0.2, "high": [0.1, 0.3]}, "steps": 3}}
    assert config_get(node, "actor.clip.low") == 0.2
    assert config_get(node, "actor.missing.x", "dflt") == "dflt"


def test_routes_are_trimmed_to_the_real_tokens_of_each_sample() -> None:
    # 2 samples, 4 positions, 1 layer, top-1: row 0 has 3 real tokens, row 1 has 2 (left-padded)
    routes = torch.tensor([[[[1]], [[2]], [[3]], [[9]]], [[[9]], [[9]], [[4]], [[5]]]])
    real = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1]])
    out = trim_routes(routes, real)
    assert out.dtype == torch.int32
    assert out.reshape(-1).tolist() == [1, 2, 3, 4, 5]
    # routes one position short (the last token is never fed back): the mask is cut to them
    assert trim_routes(routes[:, :3], real).reshape(-1).tolist() == [1, 2, 3, 4]


def test_route_ids_get_the_smallest_dtype_that_holds_them() -> None:
    assert route_dtype(8) == np.uint8
    assert route_dtype(255) == np.uint8
    assert route_dtype(256) == np.int16
    assert route_dtype(70000) == np.int32
    assert route_dtype(128, signed=True) == np.int8
    assert route_dtype(129, signed=True) == np.int16
    with pytest.raises(ValueError, match="do not fit int32"):
        route_dtype(2**31 + 1, signed=True)


def test_routes_of_input_positions_get_a_blank_row_for_each_last_token() -> None:
    a = np.array([[[1, 2]], [[3, 4]]])  # 3 tokens, 2 routed input positions, 1 layer, top-2
    b = np.array([[[5, 6]]])  # 2 tokens
    out = with_final_rows([a, b], (1, 2), np.int8)
    assert out.dtype == np.int8
    assert out.reshape(-1, 2).tolist() == [[1, 2], [3, 4], [-1, -1], [5, 6], [-1, -1]]
    train = np.array([[[1, 2]], [[3, 4]], [[7, 0]], [[5, 6]], [[2, 3]]], dtype=np.uint8)
    blanked = blank_final_rows(train, [3, 2])
    assert blanked.dtype == np.int16  # uint8 ids and -1 need a wider signed dtype
    assert blanked.reshape(-1, 2).tolist() == [[1, 2], [3, 4], [-1, -1], [5, 6], [-1, -1]]
    with pytest.raises(ValueError, match="sum to 4, the routes have 5 rows"):
        blank_final_rows(train, [2, 2])


class _Missing(FrameworkAdapter):
    name = "Nowhere"
    module = "trajstore_no_such_framework"
    extra = "nowhere"
    tested = "1.2"

    def recompute_config(self, source: Any, **options: Any) -> dict[str, Any]:
        return {"nowhere": dict(source)}


def test_a_missing_framework_is_an_import_error_with_the_install_hint() -> None:
    adapter = _Missing()
    with pytest.raises(ImportError, match=r"pip install 'trajstore\[nowhere\]'"):
        adapter.require()
    assert adapter.installed_version() is None


def test_another_release_is_warned_about_once(caplog: pytest.LogCaptureFixture) -> None:
    adapter = _Missing()
    assert adapter.is_tested("1.2") and adapter.is_tested("1.2.3") and adapter.is_tested(None)
    assert not adapter.is_tested("1.3")
    with caplog.at_level("WARNING", logger="trajstore.capture"):
        adapter.warn_untested("1.3")
        adapter.warn_untested("1.3")
    warnings = [r.getMessage() for r in caplog.records if "written against" in r.getMessage()]
    assert warnings == ["trajstore: Nowhere capture is written against Nowhere 1.2; this is 1.3"]


def test_each_adapter_names_its_own_installed_release_on_every_call() -> None:
    """The release is read once per adapter (every captured step names it); each adapter
    still names its own, and a missing framework stays None."""
    from importlib.metadata import version

    from trajstore.integrations.trl import TRL
    from trajstore.integrations.verl.records import VERL

    missing = _Missing()
    for _ in range(2):
        assert TRL.installed_version() == version("trl")
        assert VERL.installed_version() == version("verl")
        assert missing.installed_version() is None
