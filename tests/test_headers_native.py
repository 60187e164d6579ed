"""The C functions over header pairs (_headerblock.c) against their specification in headers.py:
`_kept_python`, the same lines, X-Forwarded-For values and Connection findings for generated
header lists, in every set of dropped names the proxy uses; `_lowered_index_python`, the same
index of lower-cased names; `_first_value_python`, the same first value of a name."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_helpers import require_module

from sidecar.proxy import headers
from sidecar.proxy.headers import (
    _DROPPED,
    _DROPPED_FROM_RESPONSE,
    _DROPPED_FROM_RESPONSE_NAMES,
    _DROPPED_NAMES,
    RequestHeaders,
    _first_value_python,
    _kept,
    _kept_python,
    _lowered_index,
    _lowered_index_python,
    first_value,
)

# Every (dropped set, its tuple) the relay passes: the request's eight, the response's one.
DROPPED_SETS = [(_DROPPED[key], _DROPPED_NAMES[key]) for key in sorted(_DROPPED)] + [
    (_DROPPED_FROM_RESPONSE, _DROPPED_FROM_RESPONSE_NAMES)
]

NAME_POOL = [
    b"Host", b"Connection", b"Keep-Alive", b"TE", b"Transfer-Encoding", b"Upgrade",
    b"Content-Length", b"Expect", b"Proxy-Authorization", b"Trailer", b"Trailers",
    b"X-Request-Id", b"X-Forwarded-For", b"Accept-Encoding", b"traceparent", b"Authorization",
    b"Accept", b"X-Custom", b"close", b"",
]  # fmt: skip
# bytes.strip()'s whitespace and bytes that are not: what a Connection token may hold.
PADDING = st.sampled_from([b"", b" ", b"\t", b" \t", b"\x0b", b"\x0c", b"\r\n", b"\xa0", b"\x1c"])


def flip_case(name: bytes, flips: list[bool]) -> bytes:
    return bytes(
        c ^ 32 if 97 <= (c | 32) <= 122 and flip else c
        for c, flip in zip(name, flips + [False] * len(name), strict=False)
    )


@st.composite
def header_names(draw: st.DrawFn) -> bytes:
    if draw(st.booleans()):
        name = draw(st.sampled_from(NAME_POOL))
        return flip_case(name, draw(st.lists(st.booleans(), max_size=len(name))))
    return draw(st.binary(max_size=12))  # anything: the C pass must not care


@st.composite
def header_lists(draw: st.DrawFn) -> list[tuple[bytes, bytes]]:
    """Pairs whose names come from a few drawn for the list (Connection among them half the
    time), so that a Connection header's tokens often name the list's other headers."""
    names = draw(st.lists(header_names(), min_size=1, max_size=5))
    if draw(st.booleans()):
        names.append(b"Connection")
    pairs = []
    for _ in range(draw(st.integers(0, 14))):
        name = flip_case(draw(st.sampled_from(names)), draw(st.lists(st.booleans(), max_size=8)))
        if name.lower() == b"connection":
            tokens = [
                draw(PADDING) + draw(st.sampled_from(names)) + draw(PADDING)
                for _ in range(draw(st.integers(0, 4)))
            ]
            value = b",".join(tokens)
        else:
            value = draw(st.binary(max_size=8))
        pairs.append((name, value))
    return pairs


def native_module() -> Any:
    """The C module: built by `pip install -e .` wherever a C compiler is (fails in CI, skips
    elsewhere without it)."""
    return require_module("sidecar.proxy._headerblock", "-e . (with a C compiler: gcc)")


def native() -> Any:
    """The C pass `_kept` calls."""
    module = native_module()
    assert headers._native_kept is module.kept
    return module.kept


@settings(max_examples=1000, deadline=None)
@given(header_lists())
def test_the_c_pass_gives_what_the_python_gives(raw: list[tuple[bytes, bytes]]) -> None:
    native()
    for dropped, names in DROPPED_SETS:
        assert _kept(raw, dropped, names) == _kept_python(raw, dropped), (raw, names)


def test_by_hand_one_pass() -> None:
    kept = native()
    raw = [
        (b"Host", b"h"),
        (b"CONNECTION", b" Keep-Alive ,\tX-Hop, ,x-forwarded-for"),
        (b"X-Hop", b"1"),
        (b"x-Forwarded-For", b"203.0.113.7"),
        (b"X-Forwarded-For", b"198.51.100.1"),
        (b"X-Note", b"caf\xe9"),
    ]
    names = _DROPPED_NAMES[False, False, True]  # X-Forwarded-For dropped, to be merged
    # One pass: X-Hop still in (the Python does a second pass with it dropped, as `_kept`).
    assert kept(raw, names) == (
        b"X-Hop: 1\r\nX-Note: caf\xe9\r\n",
        [b"203.0.113.7", b"198.51.100.1"],
        [b"x-hop"],
        True,
    )
    assert _kept(raw, _DROPPED[False, False, True], names) == (
        b"X-Note: caf\xe9\r\n",
        [b"203.0.113.7", b"198.51.100.1"],
        True,
    )
    assert kept([], names) == (b"", None, None, False)


def test_what_the_c_pass_leaves_to_the_python() -> None:
    kept = native()
    names = _DROPPED_NAMES[False, False, False]
    # Not a list of (bytes, bytes) tuples: None, and `_kept` answers with the Python's.
    assert kept((( b"A", b"1"),), names) is None  # fmt: skip
    assert kept([(b"A", "1")], names) is None
    assert kept([(b"A", b"1", b"2")], names) is None
    assert kept([[b"A", b"1"]], names) is None
    assert _kept(((b"A", b"1"),), _DROPPED[False, False, False], names) == (b"A: 1\r\n", [], False)
    with pytest.raises(TypeError):
        kept([], list(names))
    with pytest.raises(TypeError):
        kept([], ("connection",))


def test_more_pairs_than_the_c_pass_keeps_on_its_stack() -> None:
    native()
    raw = [(b"X-%d" % i, b"v") if i % 7 else (b"Keep-Alive", b"x") for i in range(300)]
    for dropped, names in DROPPED_SETS:
        block, forwarded, named = _kept(raw, dropped, names)
        assert (block, forwarded, named) == _kept_python(raw, dropped)
        assert block.count(b"\r\n") == 300 - len(range(0, 300, 7))


@settings(max_examples=500, deadline=None)
@given(header_lists())
def test_the_c_index_is_the_python_index(raw: list[tuple[bytes, bytes]]) -> None:
    module = native_module()
    assert headers._native_index is module.lowered_index
    assert _lowered_index(raw) == _lowered_index_python(raw), raw


def test_the_index_keeps_a_names_first_value_by_hand() -> None:
    native_module()
    raw = [(b"X-Id", b"1"), (b"Accept", b"*/*"), (b"x-ID", b"2"), (b"X-\xc9", b"3")]
    assert _lowered_index(raw) == {b"x-id": b"1", b"accept": b"*/*", b"x-\xc9": b"3"}
    assert RequestHeaders(raw).get("x-id") == "1"  # as a multidict's get: the first
    # Not a list of (bytes, bytes) tuples: the Python's.
    assert headers._native_index is not None
    assert headers._native_index(((b"A", b"1"),)) is None  # type: ignore[arg-type]
    assert headers._native_index([(b"A", "1")]) is None  # type: ignore[list-item]


@settings(max_examples=500, deadline=None)
@given(header_lists(), st.integers(0, 20))
def test_the_c_first_value_is_the_pythons(raw: list[tuple[bytes, bytes]], pick: int) -> None:
    """A name from the list (lower-cased, as callers ask) or one it may lack."""
    module = native_module()
    assert headers._native_first is module.first_value
    names = [name.lower() for name, _ in raw] + [b"content-type", b"", b"x-absent"]
    name = names[pick % len(names)]
    assert first_value(raw, name) == _first_value_python(raw, name), (raw, name)


def test_the_first_value_by_hand() -> None:
    module = native_module()
    raw = [(b"Date", b"d"), (b"CONTENT-type", b"text/event-stream"), (b"content-type", b"x")]
    assert first_value(raw, b"content-type") == b"text/event-stream"
    assert first_value(raw, b"content-encoding") is None
    assert module.first_value(((b"A", b"1"),), b"a") is ...  # not a list: the Python's
    assert first_value(((b"A", b"1"),), b"a") == b"1"
    with pytest.raises(TypeError):
        module.first_value(raw, "content-type")
