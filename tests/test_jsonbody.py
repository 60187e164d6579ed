"""protocol/jsonbody.py: a body decodes to what json.loads makes of it, or fails as json.loads
fails (the message vLLM's 400 would quote)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.protocol import jsonbody


def outcome(decode: Any, raw: bytes) -> tuple[str, Any]:
    try:
        value = decode(raw)
    except Exception as exc:  # noqa: BLE001 - the exception itself is what is compared
        return "error", (type(exc), str(exc))
    return "value", json.dumps(value, sort_keys=True, allow_nan=True)  # -0.0, nan compared too


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a":"\xff"}',  # invalid UTF-8: both refuse, json's message
        b'{"a":"\xed\xa0\x80"}',  # an encoded lone surrogate: json keeps it
        b'{"a":"\\ud800"}',  # an escaped one
        b'{"a":1,"a":2}',  # the last member wins
        b'{"a":1e400}',  # out of float range: json says inf
        b'{"a":NaN,"b":-Infinity}',
        b'{"a":-0.0,"b":1.5e-400,"c":12345678901234567890123}',
        b'\xef\xbb\xbf{"a":1}',  # a byte-order mark
        '{"a":"é"}'.encode("utf-16"),
        b'{"a":"\x01"}',  # a raw control character
        b'{"a":1} trailing',
        b"",
        b"[" * 100_000,
    ],
)
def test_the_edges_decode_as_json_decodes_them(raw: bytes) -> None:
    assert outcome(jsonbody.loads, raw) == outcome(json.loads, raw)


_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=20,
)


@settings(max_examples=400, deadline=None)
@given(_VALUES, st.booleans(), st.sampled_from([None, 0, 2]))
def test_any_json_text_decodes_to_the_same_value(value: Any, ascii_only: bool, indent: Any) -> None:
    raw = json.dumps(value, ensure_ascii=ascii_only, indent=indent).encode("utf-8", "surrogatepass")
    assert outcome(jsonbody.loads, raw) == outcome(json.loads, raw)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=64))
def test_any_bytes_decode_or_fail_as_json_does(raw: bytes) -> None:
    assert outcome(jsonbody.loads, raw) == outcome(json.loads, raw)


def test_infinity_is_what_json_makes_of_a_huge_number() -> None:
    assert math.isinf(jsonbody.loads(b'{"a":1e400}')["a"])
