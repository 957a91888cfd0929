"""The one rule for where an incremental listing starts (trajstore.listing.listing_start),
used by the ref index (store/layout.py), the catalog's sync_new and the pack listing."""

from __future__ import annotations

import pytest

from trajstore.listing import DOC_NAMES, PACK_IDS, listing_start

pytestmark = pytest.mark.unit

NOW = 1_700_000_000_000_000_000  # a clock reading in ns (19 digits)
S = 1_000_000_000


def doc(t: int, rest: str = "123-abcdef012345") -> str:
    return f"{t:020d}-{rest}"


def pack(t: int) -> str:
    return f"{t:016x}-1f-abcdef012345"


def test_nothing_known_lists_everything() -> None:
    assert listing_start(None, 300, now_ns=NOW) is None
    assert listing_start(None, 300, PACK_IDS, now_ns=NOW) is None


@pytest.mark.parametrize(
    "name",
    [
        "",
        "abc",
        f"{NOW}-1-ab",  # 19 digits: not a document name's 20
        f"{NOW:021d}-1-ab",  # 21 digits
        f" {NOW:019d}-1-ab",  # int() would take the space
        f"+{NOW:019d}-1-ab",  # or the sign
        f"{NOW:020_d}"[:20] + "-1-ab",  # or an underscore
    ],
)
def test_a_name_not_of_the_form_lists_everything(name: str) -> None:
    assert listing_start(name, 0, now_ns=NOW) is None


def test_a_bare_stamp_and_a_json_suffix_are_names_of_the_form() -> None:
    # the ref index keeps names without `.json`, the catalog's marks keep it
    assert listing_start(f"{NOW:020d}", 0, now_ns=NOW) == f"{NOW:020d}"
    assert listing_start(doc(NOW) + ".json", 0, now_ns=NOW) == f"{NOW:020d}"


def test_the_start_is_the_marks_clock_reading_less_the_margin() -> None:
    assert (
        listing_start(doc(NOW - 10 * S), 2.5, now_ns=NOW) == f"{NOW - 10 * S - 2_500_000_000:020d}"
    )


def test_margin_zero_lists_the_mark_and_its_clock_reading_again() -> None:
    mark = doc(NOW - S, "99999-ffffffffffff")
    start = listing_start(mark, 0, now_ns=NOW)
    assert start == f"{NOW - S:020d}"
    same_time_before_mark = doc(NOW - S, "1-000000000000")
    assert start < same_time_before_mark < mark  # both sort after the start: listed


def test_a_mark_ahead_of_this_hosts_clock_starts_from_the_clock() -> None:
    assert listing_start(doc(NOW + 3600 * S), 60, now_ns=NOW) == f"{NOW - 60 * S:020d}"


def test_the_start_never_goes_below_zero() -> None:
    assert listing_start(doc(5 * S), 300, now_ns=NOW) == "0" * 20
    assert listing_start(pack(5 * S), 300, PACK_IDS, now_ns=NOW) == "0" * 16


def test_pack_ids_are_hex_stamps() -> None:
    assert listing_start(pack(NOW - S), 1, PACK_IDS, now_ns=NOW) == f"{NOW - 2 * S:016x}"
    assert listing_start(pack(NOW).upper(), 0, PACK_IDS, now_ns=NOW) is None  # lowercase only
    assert listing_start(doc(NOW), 0, PACK_IDS, now_ns=NOW) is None  # 20 digits: not a pack id
    assert listing_start(pack(NOW), 0, DOC_NAMES, now_ns=NOW) is None


def test_prefixes_sort_like_the_clock() -> None:
    for clock, name in ((DOC_NAMES, doc), (PACK_IDS, pack)):
        a, b = (listing_start(name(t), 0, clock, now_ns=NOW) for t in (NOW - 2 * S, NOW - S))
        assert a is not None and b is not None and a < b < name(NOW - S)
