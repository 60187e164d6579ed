"""The incremental SSE parser: vLLM's streams, every split point, line endings, UTF-8, cuts."""

from __future__ import annotations

import re
from collections.abc import Callable
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_helpers import require_module
from vllm_chunks import (
    CHAT_BANG,
    CHAT_HELLO,
    CHAT_ROLE,
    CHAT_USAGE,
    COMPLETION_HELLO,
    ERROR_SPACED,
)

from sidecar.protocol import (
    BOM,
    DONE_EVENT,
    KEEPALIVE_EVENT,
    SSEError,
    SSEEvent,
    SSEParser,
    encode_data_event,
    sse,
)


def native_data_events() -> Callable[[bytes, int], tuple[list[SSEEvent], int]]:
    """The C loop (_tokenscan.c): built by `pip install -e .` wherever a C compiler is
    (fails in CI, skips elsewhere without it)."""
    module = require_module("sidecar.protocol._tokenscan", "-e . (with a C compiler: gcc)")
    loop: Callable[[bytes, int], tuple[list[SSEEvent], int]] = module.data_events
    return loop


@pytest.fixture(autouse=True, params=["native", "python"])
def common_read_loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs with the parser's common-read loop in C and in Python (the two
    must give the same events, split anywhere)."""
    if request.param == "native":
        monkeypatch.setattr(sse, "_data_events", native_data_events())
    else:
        monkeypatch.setattr(sse, "_data_events", sse.data_events)
    return str(request.param)


# Chat with include_usage and keep-alives (sent while queued, in prefill and between tokens).
CHAT_STREAM = (
    b": keep-alive\n\n"
    + b"data: " + CHAT_ROLE.encode() + b"\n\n"
    + b"data: " + CHAT_HELLO.encode() + b"\n\n"
    + b": keep-alive\n\n"
    + b"data: " + CHAT_BANG.encode() + b"\n\n"
    + b"data: " + CHAT_USAGE.encode() + b"\n\n"
    + b"data: [DONE]\n\n"
)  # fmt: skip
CHAT_EXPECTED = [
    (None, "keep-alive"),
    (CHAT_ROLE, None),
    (CHAT_HELLO, None),
    (None, "keep-alive"),
    (CHAT_BANG, None),
    (CHAT_USAGE, None),
    ("[DONE]", None),
]

# Completions that fail mid-stream: the error event, then [DONE] all the same.
COMPLETIONS_ERROR_STREAM = (
    b"data: " + COMPLETION_HELLO.encode() + b"\n\n"
    + b": keep-alive\n\n"
    + b"data: " + ERROR_SPACED.encode() + b"\n\n"
    + b"data: [DONE]\n\n"
)  # fmt: skip
COMPLETIONS_EXPECTED = [
    (COMPLETION_HELLO, None),
    (None, "keep-alive"),
    (ERROR_SPACED, None),
    ("[DONE]", None),
]


def parse(parts: list[bytes], max_event_size: int = 1 << 20) -> tuple[list[SSEEvent], SSEParser]:
    """Feed ``parts`` one by one, then close; check the raw bytes reproduce the input."""
    parser = SSEParser(max_event_size)
    events: list[SSEEvent] = []
    for part in parts:
        events += parser.feed(part)
    events += parser.close()
    assert b"".join(e.raw for e in events) + parser.pending == b"".join(parts)
    assert parser.pending_bytes == len(parser.pending)
    return events, parser


def summary(events: list[SSEEvent]) -> list[tuple[str | None, str | None]]:
    return [(e.data, e.comment) for e in events]


def byte_feeds(stream: bytes) -> list[bytes]:
    return [stream[i : i + 1] for i in range(len(stream))]


@pytest.mark.parametrize(
    ("stream", "expected"),
    [(CHAT_STREAM, CHAT_EXPECTED), (COMPLETIONS_ERROR_STREAM, COMPLETIONS_EXPECTED)],
    ids=["chat", "completions-error"],
)
def test_vllm_stream_whole_split_and_bytewise(
    stream: bytes, expected: list[tuple[str | None, str | None]]
) -> None:
    whole, parser = parse([stream])
    assert summary(whole) == expected
    assert parser.pending_bytes == 0 and not parser.truncated
    assert [e.is_done for e in whole] == [False] * (len(expected) - 1) + [True]
    # Each event's raw is exactly one block of the input, in order.
    assert [e.raw for e in whole] == [block + b"\n\n" for block in stream.split(b"\n\n")[:-1]]
    for cut in range(len(stream) + 1):
        assert parse([stream[:cut], stream[cut:]])[0] == whole, f"split at byte {cut}"
    assert parse(byte_feeds(stream))[0] == whole


def test_events_are_returned_by_the_feed_that_completes_them() -> None:
    parser = SSEParser()
    first = b"data: " + CHAT_HELLO.encode() + b"\n"
    assert parser.feed(first) == []
    assert parser.truncated
    (event,) = parser.feed(b"\n: keep-")
    assert event.data == CHAT_HELLO and event.raw == first + b"\n"
    assert parser.pending == b": keep-"
    (keepalive,) = parser.feed(b"alive\n\n")
    assert keepalive == SSEEvent(None, KEEPALIVE_EVENT, comment="keep-alive")
    assert parser.pending_bytes == 0 and not parser.truncated


@pytest.mark.parametrize(
    ("read", "expected", "pending"),
    [
        (b"data:x\n\n", ["x"], b""),
        (b"data:\n\n", [""], b""),
        (b"data: a\r\n\n", ["a"], b""),
        (b"data: a\rb\n\n", ["a"], b""),  # the CR ends the line; "b" is an unknown field
        (b"data: a\n\ndata: b\r\n\r\n", ["a", "b"], b""),
        (b"data: a\n\n: c\n\ndata: b\n\n", ["a", None, "b"], b""),
        (b"data: a\ndata: b\n\n", ["a\nb"], b""),
        (b"data: a\n\n\n", ["a"], b"\n"),
        (b"data: a\n\ndata: cut", ["a"], b"data: cut"),
        (b"data: a\n\ndata: cut\n", ["a"], b"data: cut\n"),
        (b"data: \xc3\xa9\n\n", ["\u00e9"], b""),
    ],
)
def test_reads_holding_whole_events_or_not(
    read: bytes, expected: list[str | None], pending: bytes
) -> None:
    # The same read as the first of the stream, after an earlier event, and byte by byte.
    prior = b"data: prior\n\n"
    first, parser = parse([read])
    later, later_parser = parse([prior, read])
    bytewise, bytewise_parser = parse(byte_feeds(read))
    assert [e.data for e in first] == expected
    assert later == [SSEEvent("prior", prior), *first]
    assert bytewise == first
    assert parser.pending == later_parser.pending == bytewise_parser.pending == pending


@pytest.mark.parametrize("eol", [b"\r\n", b"\r"], ids=["crlf", "cr"])
def test_crlf_and_lone_cr_streams_give_the_same_data(eol: bytes) -> None:
    stream = CHAT_STREAM.replace(b"\n", eol)
    whole, parser = parse([stream])
    assert summary(whole) == CHAT_EXPECTED
    assert [e.raw for e in whole] == [b + eol * 2 for b in stream.split(eol * 2)[:-1]]
    for cut in range(len(stream) + 1):
        assert parse([stream[:cut], stream[cut:]])[0] == whole, f"split at byte {cut}"
    assert parse(byte_feeds(stream))[0] == whole


def test_a_final_cr_is_held_until_the_next_byte_or_close() -> None:
    # The last CR may be the first half of a CRLF; only the next byte (or EOF) tells.
    parser = SSEParser()
    assert parser.feed(b"data: a\r\r") == []
    assert parser.pending == b"data: a\r\r"
    assert parser.close() == [SSEEvent("a", b"data: a\r\r")]
    assert parser.pending_bytes == 0 and not parser.truncated


def test_crlf_split_across_feeds() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: a\r") == []
    assert parser.feed(b"\ndata: b\r\n\r") == []
    assert parser.feed(b"\n") == [SSEEvent("a\nb", b"data: a\r\ndata: b\r\n\r\n")]
    assert parser.feed(b"data: c\r") == []
    assert parser.feed(b"\n\r\n") == [SSEEvent("c", b"data: c\r\n\r\n")]
    assert parser.close() == [] and parser.pending_bytes == 0


def test_mixed_line_endings_in_one_block() -> None:
    events, _ = parse([b"data: a\rdata: b\r\ndata: c\n\r\ndata: d\n\n"])
    assert summary(events) == [("a\nb\nc", None), ("d", None)]


def test_multiline_data_optional_space_and_empty_values() -> None:
    events, _ = parse([b"data: line1\ndata:line2\ndata\n\ndata:\n\ndata:  two spaces\n\n"])
    assert [e.data for e in events] == ["line1\nline2\n", "", " two spaces"]


def test_event_id_retry_and_unknown_fields() -> None:
    stream = (
        b"event: update\nid: 42\nretry: 3000\nfoo: bar\ndata: x\n\n"
        b"id\nretry: 3s\ndata: y\n\n"
        b"id: a\x00b\ndata: z\n\n"
        b"Data: not-a-data-field\n\n"
    )
    events, parser = parse([stream])
    assert events[0] == SSEEvent("x", events[0].raw, event="update", id="42", retry=3000)
    assert (events[1].data, events[1].id, events[1].retry) == ("y", "", None)
    assert (events[2].data, events[2].id) == ("z", None)  # an id holding NUL is ignored
    assert events[3].data is None and events[3].comment is None  # field names are case-sensitive
    assert parser.last_event_id == ""  # the last *valid* id, which persists across events


def test_comments() -> None:
    events, _ = parse([b":a\n: b\n:\n\n: note\ndata: payload\n\n"])
    assert summary(events) == [(None, "a\nb\n"), ("payload", None)]  # a data block is data


def test_blank_lines_between_events_ride_with_the_next_event() -> None:
    events, parser = parse([b"\n\r\n\rdata: a\n\n\n\ndata: b\n\n\n"])
    assert [(e.data, e.raw) for e in events] == [
        ("a", b"\n\r\n\rdata: a\n\n"),
        ("b", b"\n\ndata: b\n\n"),
    ]
    assert parser.pending == b"\n" and not parser.truncated


def test_bom_is_skipped_only_at_stream_start() -> None:
    stream = BOM + b"data: x\n\n" + BOM + b"data: y\n\n"
    for cut in range(len(stream) + 1):
        events, _ = parse([stream[:cut], stream[cut:]])
        # The second BOM is part of a field name "\ufeffdata", which is not "data".
        assert [(e.data, e.raw) for e in events] == [
            ("x", BOM + b"data: x\n\n"),
            (None, BOM + b"data: y\n\n"),
        ]
    assert parse([b"data: " + BOM + b"x\n\n"])[0][0].data == "\ufeffx"
    # A lone partial BOM is ordinary (invalid) content.
    events, parser = parse([b"\xef\xbb"])
    assert events == [] and parser.truncated and parser.pending == b"\xef\xbb"


def test_utf8_split_inside_characters() -> None:
    text = "héllo 世界 🙂"
    stream = encode_data_event(text)
    assert stream == b"data: " + text.encode() + b"\n\n"
    for cut in range(len(stream) + 1):
        (event,), _ = parse([stream[:cut], stream[cut:]])
        assert event.data == text
    (event,), _ = parse(byte_feeds(stream))
    assert event.data == text


def test_invalid_utf8_is_replaced_not_raised() -> None:
    events, _ = parse([b"data: \xff\xfe ok \xe4\xb8\n", b"event: \xc3\n\n: \x80\n\n"])
    assert events[0].data == "\ufffd\ufffd ok \ufffd"
    assert events[0].event == "\ufffd"
    assert events[1].comment == "\ufffd"


@pytest.mark.parametrize(
    ("tail", "truncated"),
    [
        (b'data: {"partial', True),
        (b"data: {}\n", True),  # a complete line but no blank line: the event is discarded
        (b"data: {}\r", True),
        (b": keep-al", True),
        (b"\n", False),  # a spare blank line is not an event
        (b"\r", False),
        (b"", False),
    ],
)
def test_stream_cut_mid_event(tail: bytes, truncated: bool) -> None:
    head = b"data: " + CHAT_HELLO.encode() + b"\n\n"
    events, parser = parse([head + tail])
    assert summary(events) == [(CHAT_HELLO, None)]
    assert parser.pending == tail
    assert parser.pending_bytes == len(tail)
    assert parser.truncated is truncated


def test_oversize_event_raises_and_keeps_what_was_parsed() -> None:
    parser = SSEParser(max_event_size=64)
    ok = b"data: small\n\n"
    big = b"data: " + b"x" * 100 + b"\n\n"
    with pytest.raises(SSEError, match="max_event_size=64") as info:
        parser.feed(ok + big)
    assert info.value.events == [SSEEvent("small", ok)]
    assert parser.pending == big
    with pytest.raises(SSEError):
        parser.feed(b"data: more\n\n")
    assert isinstance(info.value, ValueError)


def test_oversize_event_raises_while_still_incomplete() -> None:
    parser = SSEParser(max_event_size=64)
    assert parser.feed(b"data: " + b"x" * 50) == []
    with pytest.raises(SSEError) as info:
        parser.feed(b"x" * 50)
    assert info.value.events == []
    assert parser.pending_bytes == 106


def test_event_of_exactly_the_limit_is_accepted() -> None:
    event = b"data: " + b"x" * 56 + b"\n\n"
    assert len(event) == 64
    for cut in range(len(event) + 1):
        parser = SSEParser(max_event_size=64)
        assert [e.raw for e in parser.feed(event[:cut]) + parser.feed(event[cut:])] == [event]


def test_large_event_in_small_reads() -> None:
    payload = "y" * 300_000
    stream = encode_data_event(payload)
    parts = [stream[i : i + 7] for i in range(0, len(stream), 7)]
    (event,), parser = parse(parts)
    assert event.data == payload and parser.pending_bytes == 0


def test_encoders() -> None:
    assert DONE_EVENT == b"data: [DONE]\n\n"
    assert KEEPALIVE_EVENT == b": keep-alive\n\n"
    assert encode_data_event('{"a":1}') == b'data: {"a":1}\n\n'
    assert encode_data_event("a\nb\r\nc") == b"data: a\ndata: b\ndata: c\n\n"
    (event,), _ = parse([encode_data_event("a\nb\r\nc")])
    assert event.data == "a\nb\nc"


def test_feed_after_close_and_empty_feeds() -> None:
    parser = SSEParser()
    assert parser.feed(b"") == []
    assert parser.feed(bytearray(b"data: x\n\n")) == [SSEEvent("x", b"data: x\n\n")]
    assert parser.close() == []
    assert parser.close() == []
    with pytest.raises(RuntimeError):
        parser.feed(b"data: y\n\n")
    with pytest.raises(ValueError):
        SSEParser(max_event_size=0)


# --- property tests ------------------------------------------------------------------------


def reference_parse(stream: bytes) -> tuple[list[tuple[str, str | None]], str | None]:
    """A direct transcription of the WHATWG algorithm on decoded text: the dispatched events as
    (data, event field) and the source's last event ID string (which a blank line sets from the
    last event ID buffer). An unterminated last line is dropped."""
    text = stream.decode("utf-8-sig", "replace")  # drops one leading BOM, if any
    lines = re.split("\r\n|\r|\n", text)[:-1]
    events: list[tuple[str, str | None]] = []
    data: list[str] = []
    has_data = False
    event: str | None = None
    id_buffer: str | None = None
    last_id: str | None = None
    for line in lines:
        if line == "":
            last_id = id_buffer
            if has_data:
                events.append(("\n".join(data), event))
            data, has_data, event = [], False, None
            continue
        if line.startswith(":"):
            continue
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            data.append(value)
            has_data = True
        elif name == "event":
            event = value
        elif name == "id" and "\x00" not in value:
            id_buffer = value
    return events, last_id


line_text = st.text(
    st.characters(exclude_characters="\r\n", exclude_categories=["Cs"]), max_size=12
)
sse_line = st.one_of(
    st.builds(lambda v: "data: " + v, line_text),
    st.builds(lambda v: "data:" + v, line_text),
    st.builds(lambda v: ":" + v, line_text),
    st.builds(lambda v: "event: " + v, line_text),
    st.builds(lambda v: "id: " + v, line_text),
    st.builds(lambda v: "retry: " + v, st.from_regex(r"[0-9]{0,4}x?", fullmatch=True)),
    line_text,
)
line_end = st.sampled_from(["\n", "\r\n", "\r"])
sse_block = st.builds(
    lambda lines, blank: "".join(a + b for a, b in lines) + blank,
    st.lists(st.tuples(sse_line, line_end), min_size=1, max_size=4),
    line_end,
)
sse_stream = st.builds(
    lambda bom, blocks, tail: (BOM if bom else b"") + "".join(blocks).encode() + tail,
    st.booleans(),
    st.lists(sse_block, max_size=6),
    st.one_of(st.just(b""), st.binary(max_size=6), line_text.map(str.encode)),
)
noisy_bytes = st.lists(
    st.sampled_from(
        [
            b"\n",
            b"\r",
            b"\r\n",
            b":",
            b" ",
            b"data",
            b"id",
            b"x",
            b"\xc3",
            b"\xa9",
            b"\xef\xbb\xbf",
            b"\xf0\x9f\x99\x82",
            b"\x00",
            b"\xff",
        ]
    ),
    max_size=40,
).map(b"".join)


def check_split_invariance(stream: bytes, cuts: list[int]) -> None:
    whole, whole_parser = parse([stream])
    bounds = [0, *sorted(cuts), len(stream)]
    parts = [stream[a:b] for a, b in pairwise(bounds)]
    split, split_parser = parse(parts)
    assert split == whole
    assert split_parser.pending == whole_parser.pending
    assert split_parser.truncated == whole_parser.truncated
    expected, last_id = reference_parse(stream)
    assert [(e.data, e.event) for e in whole if e.data is not None] == expected
    assert whole_parser.last_event_id == last_id


@settings(max_examples=400)
@given(st.data(), sse_stream)
def test_property_split_anywhere_structured(data: st.DataObject, stream: bytes) -> None:
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=8))
    check_split_invariance(stream, cuts)


@settings(max_examples=400)
@given(st.data(), noisy_bytes)
def test_property_split_anywhere_noisy_bytes(data: st.DataObject, stream: bytes) -> None:
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=8))
    check_split_invariance(stream, cuts)


@given(st.lists(st.one_of(line_text, st.none()), max_size=8), st.data())
def test_property_encoded_events_round_trip(
    payloads: list[str | None], data: st.DataObject
) -> None:
    # None stands for a keep-alive comment between data events.
    stream = b"".join(KEEPALIVE_EVENT if p is None else encode_data_event(p) for p in payloads)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=5))
    bounds = [0, *sorted(cuts), len(stream)]
    events, parser = parse([stream[a:b] for a, b in pairwise(bounds)])
    assert [e.data for e in events] == payloads
    assert [e.comment for e in events] == ["keep-alive" if p is None else None for p in payloads]
    assert parser.pending_bytes == 0


@pytest.mark.parametrize(
    ("data", "max_size", "expected_data", "stop"),
    [
        (b"data: a\n\n", 100, ["a"], 9),
        (b"data:a\n\ndata:  b\n\n", 100, ["a", " b"], 18),
        (b"data:\n\n", 100, [""], 7),
        (b"data: a\n\n: keep-alive\n\n", 100, ["a"], 9),  # a comment ends the run
        (b"data: a\n\ndata: b\r\n\r\n", 100, ["a"], 9),  # so does a CR
        (b"data: a\n\ndata: b\n", 100, ["a"], 9),  # and an event the read cut
        (b"data: a\n\ndata", 100, ["a"], 9),
        (b"data: a\nevent: x\n\n", 100, [], 0),  # a second line: the general parser's
        (b"data: abc\n\n", 11, ["abc"], 11),  # exactly the limit
        (b"data: abc\n\n", 10, [], 0),  # one byte over
        (b"data: \xff\xc3\n\n", 100, ["\ufffd\ufffd"], 10),
        (b"", 100, [], 0),
        (b"dat", 100, [], 0),
    ],
)
def test_the_common_read_loop_by_hand(
    common_read_loop: str, data: bytes, max_size: int, expected_data: list[str], stop: int
) -> None:
    events, at = sse._data_events(data, max_size)
    assert [e.data for e in events] == expected_data
    assert at == stop
    assert b"".join(e.raw for e in events) == data[:stop]
    assert all(e[2:] == (None, None, None, None) for e in events)
    if len(events) == 1 and stop == len(data):
        assert events[0].raw is data  # the read itself, not a copy


@settings(max_examples=300)
@given(st.one_of(sse_stream, noisy_bytes), st.integers(1, 64))
def test_the_native_common_read_loop_is_the_python_one(stream: bytes, max_size: int) -> None:
    assert native_data_events()(stream, max_size) == sse.data_events(stream, max_size)


def test_the_native_common_read_loop_refuses_what_is_not_bytes() -> None:
    loop = native_data_events()
    with pytest.raises(TypeError):
        loop(bytearray(b"data: a\n\n"), 10)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        loop(b"data: a\n\n")  # type: ignore[call-arg]
