"""The label cap both metric sinks apply (sidecar/sinks/labels.py)."""

from __future__ import annotations

import pytest

from sidecar.sinks.labels import MAX_VALUE_CHARS, OTHER, BoundedLabel


def test_the_first_values_keep_their_names_and_later_ones_read_other() -> None:
    bounded = BoundedLabel(cap=2, max_chars=5)
    assert [bounded(v) for v in ("x", "y", "z", "x", "toolong")] == ["x", "y", OTHER, "x", OTHER]
    assert bounded.overflowed == 2


def test_only_an_admitted_value_takes_a_slot() -> None:
    """A name the upstream refused (a 404) reads other and leaves the slot to a real one."""
    bounded = BoundedLabel(cap=1)
    assert bounded("junk", admit=False) == OTHER
    assert bounded("real") == "real"
    assert bounded("junk", admit=False) == OTHER
    assert bounded("real", admit=False) == "real"  # once admitted, always its own name


def test_a_long_value_is_other_and_cap_zero_keeps_no_name() -> None:
    assert BoundedLabel(cap=8)("m" * (MAX_VALUE_CHARS + 1)) == OTHER
    assert BoundedLabel(cap=8)("m" * MAX_VALUE_CHARS) == "m" * MAX_VALUE_CHARS
    assert BoundedLabel(cap=0)("m") == OTHER
    with pytest.raises(ValueError):
        BoundedLabel(cap=-1)
