"""The worker -> collector record codec: exact round trips, refusals, and what it shares."""

from __future__ import annotations

import dataclasses
import gc
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_helpers import require_module

from sidecar.proxy import recordwire
from sidecar.proxy.recordwire import WIRE_VERSION, WireError, decode_record, encode_record
from sidecar.record import (
    EngineTiming,
    Int64s,
    Outcome,
    RequestRecord,
    RequestShape,
    Timeline,
    TokenSource,
)

I64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
# Any Python string, lone surrogates included (a JSON body may decode to one).
TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
FLOATS = st.floats(allow_nan=False)  # NaN != NaN would fail the equality, not the codec


@st.composite
def timelines(draw: st.DrawFn, tokens: Int64s | None = None) -> Timeline:
    n = draw(st.integers(0, 40)) if tokens is None else len(tokens)
    offsets = draw(st.lists(I64, min_size=n, max_size=n))
    counts = tokens if tokens is not None else Int64s(draw(st.lists(I64, min_size=n, max_size=n)))
    return Timeline(
        start_ns=draw(I64),
        offsets_ns=Int64s(offsets),
        tokens=counts,
        end_ns=draw(st.none() | I64),
        events_total=draw(I64),
    )


shapes = st.builds(
    RequestShape,
    max_tokens=st.none() | I64,
    ignore_eos=st.none() | st.booleans(),
    n=I64,
    temperature=st.none() | FLOATS,
    session_id=st.none() | TEXT,
    prefix_unit=st.none() | st.sampled_from(["chars", "tokens"]),
    prefix_size=I64,
    prefix_hashes=st.lists(I64, max_size=10).map(tuple),
    body=st.none() | TEXT,
    completion_text=st.none() | TEXT,
)

engines = st.builds(EngineTiming, *(st.none() | FLOATS for _ in range(5)))


@st.composite
def records(draw: st.DrawFn) -> RequestRecord:
    server = draw(st.none() | timelines())
    sharing = draw(st.sampled_from(["own", "same", "prefix"])) if server is not None else "own"
    if server is not None and sharing == "same":
        client = draw(timelines(tokens=server.tokens))  # one column for both sides
    elif server is not None and sharing == "prefix":
        cut = draw(st.integers(0, len(server.tokens)))
        client = draw(timelines(tokens=server.tokens[:cut]))  # the client left early
    else:
        client = draw(timelines())
    return RequestRecord(
        request_id=draw(TEXT),
        wall_time_ns=draw(I64),
        outcome=draw(st.sampled_from(Outcome)),
        endpoint=draw(TEXT),
        model=draw(st.none() | TEXT),
        client_stream=draw(st.booleans()),
        upstream_stream=draw(st.booleans()),
        client=client,
        server=server,
        engine=draw(st.none() | engines),
        n_in=draw(st.none() | I64),
        n_out=draw(st.none() | I64),
        n_cached=draw(st.none() | I64),
        token_source=draw(st.sampled_from(TokenSource)),
        finish_reason=draw(st.none() | TEXT),
        http_status=draw(st.none() | I64),
        error_type=draw(st.none() | TEXT),
        replica=draw(st.none() | TEXT),
        route_policy=draw(st.none() | TEXT),
        attributes=draw(st.dictionaries(TEXT, TEXT, max_size=4)),
        shape=draw(st.none() | shapes),
        request_read_ns=draw(st.none() | I64),
    )


def native_encode() -> Any:
    """The C encoder (_recordwire.c): built by `pip install -e .` wherever a C compiler is
    (fails in CI, skips elsewhere without it)."""
    module = require_module("sidecar.proxy._recordwire", "-e . (with a C compiler: gcc)")
    assert recordwire._native_encode is module.encode  # the one encode_record runs
    return module.encode


@settings(max_examples=400, deadline=None)
@given(records())
def test_the_c_encoder_writes_the_python_encoders_bytes(record: RequestRecord) -> None:
    """Byte for byte, or None (a record with a shape: the Python encoder's)."""
    wire = native_encode()(record)
    if record.shape is not None:
        assert wire is None
    else:
        assert wire == recordwire._encode(record)


class RecordSubclass(RequestRecord):
    __slots__ = ()


class TimelineSubclass(Timeline):
    __slots__ = ()


def test_the_c_encoder_reads_exact_records_from_their_slots_and_others_by_name() -> None:
    """Every field the encoder reads is a slot of RequestRecord or Timeline (28), read at its
    offset for objects of exactly those types; a subclass's (which could redefine a field) by
    getattr, with the same bytes."""
    module = require_module("sidecar.proxy._recordwire", "-e . (with a C compiler: gcc)")
    assert module.configure_slots(RequestRecord, Timeline) == 22 + 6
    plain = dataclasses.replace(streamed_record(), shape=None)
    assert plain.server is not None
    fields = {f.name: getattr(plain, f.name) for f in dataclasses.fields(plain)}
    client = plain.client
    sub_client = TimelineSubclass(
        **{f.name: getattr(client, f.name) for f in dataclasses.fields(client)}
    )
    sub = RecordSubclass(**{**fields, "client": sub_client})
    assert type(sub) is not RequestRecord and type(sub.client) is not Timeline
    assert module.encode(sub) == module.encode(plain) == recordwire._encode(plain)


def test_the_c_encoder_fails_as_the_python_one_does() -> None:
    encode = native_encode()
    big = RequestRecord(
        request_id="big", wall_time_ns=0, outcome=Outcome.OK, endpoint="chat", n_in=2**63
    )
    with pytest.raises(OverflowError):
        encode(big)
    with pytest.raises(struct.error):
        recordwire._encode(big)
    plain = dataclasses.replace(streamed_record(), shape=None)
    assert encode(plain) == recordwire._encode(plain)
    unknown = dataclasses.replace(plain, outcome="no such outcome")  # type: ignore[arg-type]
    with pytest.raises(KeyError):
        encode(unknown)
    with pytest.raises(KeyError):
        recordwire._encode(unknown)
    # What it leaves to the Python encoder: None, and encode_record still answers.
    odd = dataclasses.replace(plain, request_id=b"not text")  # type: ignore[arg-type]
    assert encode(odd) is None
    with pytest.raises(AttributeError):
        encode_record(odd)  # what the Python encoder raised before there was a C one
    with pytest.raises(AttributeError):
        encode("not a record")


@settings(max_examples=300, deadline=None)
@given(records())
def test_every_record_survives_the_round_trip_exactly(record: RequestRecord) -> None:
    decoded = decode_record(encode_record(record))
    assert decoded == record
    assert decoded.to_dict() == record.to_dict()  # None fields stay None, enums stay enums
    assert type(decoded.client.offsets_ns) is Int64s


@settings(max_examples=100, deadline=None)
@given(records(), st.data())
def test_cut_or_damaged_bytes_raise_wire_error_never_something_else(
    record: RequestRecord, data: st.DataObject
) -> None:
    wire = encode_record(record)
    cut = data.draw(st.integers(0, len(wire) - 1))
    with pytest.raises(WireError):
        decode_record(wire[:cut])
    with pytest.raises(WireError):
        decode_record(wire + b"\x00")
    position = data.draw(st.integers(0, len(wire) - 1))
    flipped = bytearray(wire)
    flipped[position] ^= 0xFF
    try:
        decode_record(bytes(flipped))
    except WireError:
        pass  # either an error of its own kind, or some record: never a crash of another type


def native_decode() -> Any:
    module = require_module("sidecar.proxy._recordwire", "-e . (with a C compiler: gcc)")
    assert recordwire._native_decode is module.decode  # the one decode_record runs
    return module.decode


def python_decode(data: bytes) -> RequestRecord:
    """decode_record with the Python decoder: the C one's specification."""
    saved = recordwire._native_decode
    recordwire._native_decode = None
    try:
        return decode_record(data)
    finally:
        recordwire._native_decode = saved


def same_answer(data: bytes) -> None:
    """decode_record (the C decoder) and the Python one: the same record, or both WireError."""
    try:
        expected: RequestRecord | None = python_decode(data)
    except WireError:
        expected = None
    if expected is None:
        with pytest.raises(WireError):
            decode_record(data)
    else:
        got = decode_record(data)
        # A flipped byte can make a float NaN, which is unequal to itself: the two records
        # then say the same when their reprs do (NaN's is "nan", and no field is left out).
        assert got == expected or repr(got) == repr(expected)
        # the same sharing: one token column for both sides when the Python decoder has one
        if expected.server is not None:
            assert (got.client.tokens is got.server.tokens) == (  # type: ignore[union-attr]
                expected.client.tokens is expected.server.tokens
            )


@settings(max_examples=300, deadline=None)
@given(records(), st.data())
def test_the_c_decoder_reads_what_the_python_one_reads(
    record: RequestRecord, data: st.DataObject
) -> None:
    """On whole frames, cut frames, a byte flipped anywhere, a byte added: one answer."""
    decode = native_decode()
    wire = encode_record(record)
    if record.shape is None:
        assert decode(wire) == record
    else:
        assert decode(wire) is None  # the Python decoder's
    same_answer(wire)
    same_answer(wire[: data.draw(st.integers(0, len(wire) - 1))])
    same_answer(wire + b"\x00")
    flipped = bytearray(wire)
    for _ in range(data.draw(st.integers(1, 3))):
        flipped[data.draw(st.integers(1, len(wire) - 1))] ^= data.draw(st.integers(1, 255))
    same_answer(bytes(flipped))


def test_the_c_decoder_refuses_what_is_not_bytes() -> None:
    decode = native_decode()
    with pytest.raises(TypeError):
        decode(bytearray(encode_record(streamed_record())))


def streamed_record() -> RequestRecord:
    tokens = Int64s([1, 1, 2, 1])
    return RequestRecord(
        request_id="req-1",
        wall_time_ns=1_700_000_000_000_000_000,
        outcome=Outcome.OK,
        endpoint="chat",
        model="m",
        client=Timeline(0, Int64s([10, 20, 30, 40]), tokens, 50, 6),
        server=Timeline(3, Int64s([8, 18, 28, 38]), tokens, 45, 7),
        engine=EngineTiming(time_to_first_token_ms=1.5, queue_time_ms=None),
        n_in=12,
        n_out=5,
        n_cached=None,
        token_source=TokenSource.USAGE,
        finish_reason="stop",
        http_status=200,
        replica="127.0.0.1:8000",
        route_policy="least_outstanding",
        attributes={"slo_class": "interactive"},
        shape=RequestShape(
            max_tokens=5,
            ignore_eos=False,
            temperature=None,
            prefix_unit="chars",
            prefix_size=256,
            prefix_hashes=(1, 2**62),
        ),
    )


def test_a_streamed_record_by_hand() -> None:
    record = streamed_record()
    wire = encode_record(record)
    assert wire[0] == WIRE_VERSION
    decoded = decode_record(wire)
    assert decoded == record
    assert decoded.engine == EngineTiming(time_to_first_token_ms=1.5)
    assert decoded.n_cached is None and decoded.shape is not None
    assert decoded.shape.ignore_eos is False and decoded.shape.temperature is None
    # The shared token column travels once and comes back as one object for both sides.
    assert decoded.server is not None and decoded.client.tokens is decoded.server.tokens
    alone = encode_record(
        dataclasses.replace(
            record, client=Timeline(0, Int64s([10, 20, 30, 40]), Int64s([9, 9, 9, 9]), 50, 6)
        )
    )
    assert len(alone) == len(wire) + 4 * 8


def test_the_c_decoder_leaves_its_records_out_of_the_cycle_collector() -> None:
    """The collector process holds a window of decoded records: untracked, they cost its full
    collections nothing (proxy/_recordwire.c says why none can be in a reference cycle)."""
    native_decode()
    record = dataclasses.replace(streamed_record(), shape=None)  # a shape: the Python decoder
    decoded = decode_record(encode_record(record))
    assert decoded == record
    for part in (decoded, decoded.client, decoded.server, decoded.engine):
        assert not gc.is_tracked(part), part
    assert gc.is_tracked(record) and gc.is_tracked(record.client)  # made here: tracked


def test_columns_travel_as_raw_bytes() -> None:
    """Eight bytes per event per column, whatever the values: the bulk of a long stream costs
    what it costs in memory, not a decimal rendering of it."""

    def size(n: int) -> int:
        tokens = Int64s([1] * n)
        return len(
            encode_record(
                RequestRecord(
                    request_id="r",
                    wall_time_ns=0,
                    outcome=Outcome.OK,
                    endpoint="completions",
                    client=Timeline(0, Int64s(range(n)), tokens, n, n),
                    server=Timeline(0, Int64s(range(n)), tokens, n, n),
                )
            )
        )

    assert size(1000) - size(0) == 3 * 8 * 1000  # two offset columns, one shared token column
    assert size(0) < 200


def test_a_record_without_server_side_or_extras() -> None:
    record = RequestRecord(
        request_id="x",
        wall_time_ns=-5,
        outcome=Outcome.REJECTED,
        endpoint="/v1/models",
        client_stream=False,
        upstream_stream=False,
        http_status=429,
        error_type="max_concurrency",
    )
    decoded = decode_record(encode_record(record))
    assert decoded == record
    assert decoded.server is None and decoded.engine is None and decoded.shape is None
    assert decoded.model is None and decoded.client.end_ns is None


def test_what_does_not_fit_is_a_value_error_on_encode() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        encode_record(
            RequestRecord(
                request_id="big", wall_time_ns=0, outcome=Outcome.OK, endpoint="chat", n_in=2**64
            )
        )


def test_unknown_versions_and_garbage_are_refused() -> None:
    wire = encode_record(streamed_record())
    with pytest.raises(WireError, match="wire version 99"):
        decode_record(bytes([99]) + wire[1:])
    with pytest.raises(WireError, match="empty"):
        decode_record(b"")
    # An outcome index beyond the table.
    bad = bytearray(wire)
    flags_size = struct.calcsize("<Iq")
    bad[1 + flags_size] = 200
    with pytest.raises(WireError):
        decode_record(bytes(bad))
