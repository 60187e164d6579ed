"""A compact, versioned binary form of `RequestRecord`, for the worker -> collector channel.

Why not JSON (``to_dict``): a record's bulk is its timelines, 8 bytes per event per column as
`Int64s` already holds them; JSON turns each value into decimal text and back (~150 µs per
256-token record on a worker's loop, against ~8 µs to encode here, ~20 µs to decode in the
collector). Here the columns travel as their raw bytes and everything else as fixed-width
fields, so encoding costs one ``struct.pack`` plus a few byte joins, and decoding builds
`Int64s` straight from slices of the frame.

Layout of version 2 (little-endian; ``str`` = u32 length + UTF-8 with surrogates passed
through, so any Python string survives; ``col`` = u32 count + count * 8 raw bytes)::

    u8 version | _FIXED (presence bits, scalars) | client timeline | [server timeline]
    | [engine: 5 * f64] | str request_id, endpoint | optional strs (by presence bit)
    | u32 n_attributes, (str key, str value) * n | client cols | [server cols] | [shape]

A timeline is ``q start_ns, q end_ns, q events_total, u8 bits (1: has_end, 2: has a choice
column)``; its columns follow the strings (offsets, tokens, then choices when it has them).
The client's token column is usually the server's (records share one column between their
sides, or a prefix of it when the client left early): a flag says so and it is not sent twice.
Integers must fit in 64 bits; a record that does not (a hostile upstream's usage numbers)
raises `ValueError`, which the channel counts as an encode error.

Any change of layout bumps `WIRE_VERSION`; `decode_record` refuses versions it does not know.
The layout is written and read in C as well (`_recordwire.c`, where the package was built with
it): a change here is made there too, and tests/test_recordwire.py, which holds the C codec to
this one's bytes and answers, fails until it is.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Callable, Mapping

from sidecar.record import (
    EngineTiming,
    Int64s,
    Outcome,
    RequestRecord,
    RequestShape,
    Timeline,
    TokenSource,
    int64s_from_bytes,
    new_engine_timing,
    new_record,
    new_timeline,
)

WIRE_VERSION = 2  # 2: request_read_ns, choice columns

# Enum members by wire index. Written out, not taken from the enums' order: a member added to
# an enum must not silently renumber the others (it makes encode_record fail until it is
# added here, at the end, with a version bump).
_OUTCOMES: tuple[Outcome, ...] = tuple(
    Outcome(v)
    for v in ("ok", "http_error", "upstream_error", "timeout", "client_cancelled", "rejected")
)
_TOKEN_SOURCES: tuple[TokenSource, ...] = tuple(
    TokenSource(v) for v in ("usage", "usage_total", "chunk_count", "none")
)
_OUTCOME_INDEX = {o: i for i, o in enumerate(_OUTCOMES)}
_TOKEN_SOURCE_INDEX = {s: i for i, s in enumerate(_TOKEN_SOURCES)}

# Presence bits of _FIXED's flags word.
_HAS_SERVER = 1 << 0
_HAS_ENGINE = 1 << 1
_HAS_SHAPE = 1 << 2
_HAS_N_IN = 1 << 3
_HAS_N_OUT = 1 << 4
_HAS_N_CACHED = 1 << 5
_HAS_HTTP_STATUS = 1 << 6
_CLIENT_STREAM = 1 << 7
_UPSTREAM_STREAM = 1 << 8
_TOKENS_SHARED = 1 << 9  # client tokens == server tokens[:len(client offsets)]
# Optional strings, in this order after request_id and endpoint.
_OPTIONAL_STRINGS = ("model", "finish_reason", "error_type", "replica", "route_policy")
_STRING_BITS = tuple(1 << (10 + i) for i in range(len(_OPTIONAL_STRINGS)))
_HAS_REQUEST_READ = 1 << (10 + len(_OPTIONAL_STRINGS))

# flags, wall_time_ns, outcome, token_source, n_in, n_out, n_cached, http_status,
# request_read_ns
_FIXED = struct.Struct("<IqBBqqqqq")
# start_ns, end_ns, events_total, bits (_HAS_END, _HAS_CHOICES), n_events
_TIMELINE = struct.Struct("<qqqBI")
_HAS_END = 1
_HAS_CHOICES = 2
_ENGINE = struct.Struct("<B5d")  # presence bits of the five fields, then the fields (0 absent)
# flags (has max_tokens, ignore_eos set, ignore_eos value, has temperature, 4 string bits),
# max_tokens, n, temperature, prefix_size, n_hashes
_SHAPE = struct.Struct("<BqqdqI")
_SHAPE_STRINGS = ("session_id", "prefix_unit", "body", "completion_text")
_U32 = struct.Struct("<I")

_NATIVE_LITTLE = sys.byteorder == "little"


class WireError(ValueError):
    """Bytes that are not a record this build can read."""


def _column(values: Int64s) -> bytes:
    data = values.data
    if _NATIVE_LITTLE:
        return data
    swapped = array("q", data)  # pragma: no cover - big-endian hosts
    swapped.byteswap()  # pragma: no cover
    return swapped.tobytes()  # pragma: no cover


def _text(value: str) -> bytes:
    raw = value.encode("utf-8", "surrogatepass")
    return _U32.pack(len(raw)) + raw


def _timeline(timeline: Timeline) -> bytes:
    end = timeline.end_ns
    bits = (_HAS_END if end is not None else 0) | (
        _HAS_CHOICES if timeline.choices is not None else 0
    )
    return _TIMELINE.pack(
        timeline.start_ns,
        0 if end is None else end,
        timeline.events_total,
        bits,
        len(timeline.offsets_ns),
    )


# The same encoder in C (_recordwire.c: one call where `_encode` was ~625 bytecodes of a
# worker's 32-token request), where the package was built with it; it hands back None for what
# it leaves to `_encode` (a record with a shape, values of unexpected types), which stays the
# specification: tests/test_recordwire.py holds the two to the same bytes.
# And the decoder (one call where `_decode`, its strings and columns were ~1,150 of the
# collector's ~4.2k bytecodes per record), which leaves a record with a shape to `_decode`.
_native_encode: Callable[[RequestRecord], bytes | None] | None
_native_decode: Callable[[bytes], RequestRecord | None] | None
try:
    from sidecar.proxy import _recordwire

    _recordwire.configure(_OUTCOME_INDEX, _TOKEN_SOURCE_INDEX, WIRE_VERSION)
    # The record's types built without their dataclass __init__ (record.slots_constructor).
    _recordwire.configure_decoder(
        new_record,
        new_timeline,
        new_engine_timing,
        int64s_from_bytes,
        WireError,
        _OUTCOMES,
        _TOKEN_SOURCES,
    )
    # The encoder reads an exact record's and timeline's fields from their slots.
    _recordwire.configure_slots(RequestRecord, Timeline)
    _native_encode, _native_decode = _recordwire.encode, _recordwire.decode
except ImportError:  # built without a C compiler (or on a big-endian host): the Python ones
    _native_encode = _native_decode = None


def native_encoder() -> Callable[[RequestRecord], bytes | None] | None:
    """The C encoder (None where it is not built): a record's bytes, None for one it leaves to
    the Python encoder; it raises for a record the format cannot hold, where `encode_record`
    raises ValueError. For compiled callers, which then need no interpreted call per record."""
    return _native_encode


def encode_record(record: RequestRecord) -> bytes:
    """The record as bytes (see the module's layout). Raises ValueError for a record that does
    not fit the format (an integer beyond 64 bits, an enum member unknown to this version)."""
    try:
        if _native_encode is not None:
            wire = _native_encode(record)
            if wire is not None:
                return wire
        return _encode(record)
    except (struct.error, KeyError, OverflowError) as exc:
        raise ValueError(
            f"record {record.request_id!r} does not fit wire version {WIRE_VERSION}: {exc}"
        ) from None


def _encode(record: RequestRecord) -> bytes:
    client, server = record.client, record.server
    flags = 0
    if record.client_stream:
        flags |= _CLIENT_STREAM
    if record.upstream_stream:
        flags |= _UPSTREAM_STREAM
    if server is not None:
        flags |= _HAS_SERVER
        n_client = len(client.tokens)
        # A byte compare of the packed columns: cheap, and exact whatever object holds them.
        if (
            n_client <= len(server.tokens)
            and server.tokens.data[: 8 * n_client] == client.tokens.data
        ):
            flags |= _TOKENS_SHARED
    engine, shape = record.engine, record.shape
    if engine is not None:
        flags |= _HAS_ENGINE
    if shape is not None:
        flags |= _HAS_SHAPE
    n_in, n_out, n_cached, status = (record.n_in, record.n_out, record.n_cached, record.http_status)
    if n_in is not None:
        flags |= _HAS_N_IN
    if n_out is not None:
        flags |= _HAS_N_OUT
    if n_cached is not None:
        flags |= _HAS_N_CACHED
    if status is not None:
        flags |= _HAS_HTTP_STATUS
    request_read = record.request_read_ns
    if request_read is not None:
        flags |= _HAS_REQUEST_READ
    optional = (
        record.model,
        record.finish_reason,
        record.error_type,
        record.replica,
        record.route_policy,
    )
    for bit, value in zip(_STRING_BITS, optional, strict=True):
        if value is not None:
            flags |= bit
    parts = [
        bytes((WIRE_VERSION,)),
        _FIXED.pack(
            flags,
            record.wall_time_ns,
            _OUTCOME_INDEX[record.outcome],
            _TOKEN_SOURCE_INDEX[record.token_source],
            n_in or 0,
            n_out or 0,
            n_cached or 0,
            status or 0,
            request_read or 0,
        ),
        _timeline(client),
    ]
    if server is not None:
        parts.append(_timeline(server))
    if engine is not None:
        values = (
            engine.time_to_first_token_ms,
            engine.generation_time_ms,
            engine.queue_time_ms,
            engine.mean_itl_ms,
            engine.tokens_per_second,
        )
        present = sum(1 << i for i, v in enumerate(values) if v is not None)
        parts.append(_ENGINE.pack(present, *(0.0 if v is None else v for v in values)))
    parts.append(_text(record.request_id))
    parts.append(_text(record.endpoint))
    parts.extend(_text(value) for value in optional if value is not None)
    attributes = record.attributes
    parts.append(_U32.pack(len(attributes)))
    for key, value in attributes.items():
        parts.append(_text(key))
        parts.append(_text(value))
    parts.append(_column(client.offsets_ns))
    if server is None or not flags & _TOKENS_SHARED:
        parts.append(_column(client.tokens))
    if client.choices is not None:
        parts.append(_column(client.choices))
    if server is not None:
        parts.append(_column(server.offsets_ns))
        parts.append(_column(server.tokens))
        if server.choices is not None:
            parts.append(_column(server.choices))
    if shape is not None:
        parts.append(_encode_shape(shape))
    return b"".join(parts)


def _encode_shape(shape: RequestShape) -> bytes:
    flags = 0
    if shape.max_tokens is not None:
        flags |= 1
    if shape.ignore_eos is not None:
        flags |= 2
        if shape.ignore_eos:
            flags |= 4
    if shape.temperature is not None:
        flags |= 8
    strings = [getattr(shape, name) for name in _SHAPE_STRINGS]
    for i, value in enumerate(strings):
        if value is not None:
            flags |= 16 << i
    hashes = Int64s(shape.prefix_hashes)
    head = _SHAPE.pack(
        flags,
        shape.max_tokens or 0,
        shape.n,
        0.0 if shape.temperature is None else shape.temperature,
        shape.prefix_size,
        len(hashes),
    )
    return b"".join([head, *(_text(v) for v in strings if v is not None), _column(hashes)])


class _Reader:
    """Walks a frame (the request shape's part, read once per shaped record); every read
    checks its bounds, so truncated bytes raise WireError."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes, pos: int) -> None:
        self.data = data
        self.pos = pos

    def unpack(self, layout: struct.Struct) -> tuple[int | float, ...]:
        end = self.pos + layout.size
        if end > len(self.data):
            raise WireError("record bytes cut short")
        values: tuple[int | float, ...] = layout.unpack_from(self.data, self.pos)
        self.pos = end
        return values

    def text(self) -> str:
        value, self.pos = _text_at(self.data, self.pos)
        return value

    def column(self, count: int) -> Int64s:
        values, self.pos = _column_at(self.data, self.pos, count)
        return values


_CUT_SHORT = "record bytes cut short"
_U32_AT = _U32.unpack_from
_FIXED_AT = _FIXED.unpack_from
_TIMELINE_AT = _TIMELINE.unpack_from


def _text_at(data: bytes, pos: int) -> tuple[str, int]:
    """The string at ``pos`` and the position after it."""
    if pos + 4 > len(data):
        raise WireError(_CUT_SHORT)
    (size,) = _U32_AT(data, pos)
    pos += 4
    end = pos + size
    if end > len(data):
        raise WireError(_CUT_SHORT)
    try:
        return data[pos:end].decode("utf-8", "surrogatepass"), end
    except UnicodeDecodeError as exc:
        raise WireError(f"not UTF-8: {exc}") from None


def _column_at(data: bytes, pos: int, count: int) -> tuple[Int64s, int]:
    """The column of ``count`` values at ``pos`` and the position after it."""
    end = pos + 8 * count
    if end > len(data):
        raise WireError(_CUT_SHORT)
    raw = data[pos:end]
    if not _NATIVE_LITTLE:  # pragma: no cover - big-endian hosts
        swapped = array("q", raw)
        swapped.byteswap()
        raw = swapped.tobytes()
    return Int64s(raw), end


def decode_record(data: bytes | memoryview) -> RequestRecord:
    """The record `encode_record` wrote; WireError for anything else."""
    if type(data) is not bytes:
        data = bytes(data)
    if not data:
        raise WireError("empty record")
    version = data[0]
    if version != WIRE_VERSION:
        raise WireError(f"record wire version {version} (this build reads {WIRE_VERSION})")
    try:
        if _native_decode is not None:
            record = _native_decode(data)
            if record is not None:
                return record
        return _decode(data)
    except (IndexError, ValueError) as exc:
        if isinstance(exc, WireError):
            raise
        raise WireError(f"malformed record: {exc}") from None


def _decode(data: bytes) -> RequestRecord:
    """One function with its position in a local: the collector decodes every record (the
    `_Reader` methods this replaced were a third of its bytecodes per record)."""
    size = len(data)
    pos = 1 + _FIXED.size
    if pos + _TIMELINE.size > size:
        raise WireError(_CUT_SHORT)
    flags, wall, outcome_index, source_index, n_in, n_out, n_cached, status, request_read = (
        _FIXED_AT(data, 1)
    )
    client_head = _TIMELINE_AT(data, pos)
    pos += _TIMELINE.size
    server_head = None
    if flags & _HAS_SERVER:
        if pos + _TIMELINE.size > size:
            raise WireError(_CUT_SHORT)
        server_head = _TIMELINE_AT(data, pos)
        pos += _TIMELINE.size
    engine = None
    if flags & _HAS_ENGINE:
        if pos + _ENGINE.size > size:
            raise WireError(_CUT_SHORT)
        present, *values = _ENGINE.unpack_from(data, pos)
        pos += _ENGINE.size
        engine = EngineTiming(
            *(float(v) if present & (1 << i) else None for i, v in enumerate(values))
        )
    request_id, pos = _text_at(data, pos)
    endpoint, pos = _text_at(data, pos)
    optional: list[str | None] = []
    for bit in _STRING_BITS:
        if flags & bit:
            value, pos = _text_at(data, pos)
            optional.append(value)
        else:
            optional.append(None)
    model, finish_reason, error_type, replica, route_policy = optional
    if pos + 4 > size:
        raise WireError(_CUT_SHORT)
    (n_attributes,) = _U32_AT(data, pos)
    pos += 4
    attributes: dict[str, str] = {}
    for _ in range(n_attributes):
        key, pos = _text_at(data, pos)
        attributes[key], pos = _text_at(data, pos)
    n_client = client_head[4]
    client_offsets, pos = _column_at(data, pos, n_client)
    shared = bool(flags & _TOKENS_SHARED) and server_head is not None
    client_tokens: Int64s | None = None
    if not shared:
        client_tokens, pos = _column_at(data, pos, n_client)
    client_choices = None
    if client_head[3] & _HAS_CHOICES:
        client_choices, pos = _column_at(data, pos, n_client)
    server = None
    if server_head is not None:
        n_server = server_head[4]
        server_offsets, pos = _column_at(data, pos, n_server)
        server_tokens, pos = _column_at(data, pos, n_server)
        server_choices = None
        if server_head[3] & _HAS_CHOICES:
            server_choices, pos = _column_at(data, pos, n_server)
        if client_tokens is None:
            if n_client > n_server:
                raise WireError("shared token column shorter than the client's events")
            # The same object when whole: records keep one column for both sides.
            client_tokens = server_tokens if n_client == n_server else server_tokens[:n_client]
        server = _timeline_from(server_head, server_offsets, server_tokens, server_choices)
    assert client_tokens is not None
    client = _timeline_from(client_head, client_offsets, client_tokens, client_choices)
    shape = None
    if flags & _HAS_SHAPE:
        reader = _Reader(data, pos)
        shape = _decode_shape(reader)
        pos = reader.pos
    if pos != size:
        raise WireError(f"{size - pos} bytes after the record")
    return RequestRecord(
        request_id=request_id,
        wall_time_ns=wall,
        outcome=_OUTCOMES[outcome_index],
        endpoint=endpoint,
        model=model,
        client_stream=bool(flags & _CLIENT_STREAM),
        upstream_stream=bool(flags & _UPSTREAM_STREAM),
        client=client,
        server=server,
        engine=engine,
        n_in=n_in if flags & _HAS_N_IN else None,
        n_out=n_out if flags & _HAS_N_OUT else None,
        n_cached=n_cached if flags & _HAS_N_CACHED else None,
        token_source=_TOKEN_SOURCES[source_index],
        finish_reason=finish_reason,
        http_status=status if flags & _HAS_HTTP_STATUS else None,
        error_type=error_type,
        replica=replica,
        route_policy=route_policy,
        attributes=attributes,
        shape=shape,
        request_read_ns=request_read if flags & _HAS_REQUEST_READ else None,
    )


def _timeline_from(
    head: tuple[int, ...], offsets: Int64s, tokens: Int64s, choices: Int64s | None
) -> Timeline:
    return Timeline(
        start_ns=head[0],
        offsets_ns=offsets,
        tokens=tokens,
        end_ns=head[1] if head[3] & _HAS_END else None,
        events_total=head[2],
        choices=choices,
    )


def _decode_shape(reader: _Reader) -> RequestShape:
    head = reader.unpack(_SHAPE)
    flags = int(head[0])
    strings: Mapping[str, str | None] = {
        name: reader.text() if flags & (16 << i) else None for i, name in enumerate(_SHAPE_STRINGS)
    }
    hashes = reader.column(int(head[5]))
    return RequestShape(
        max_tokens=int(head[1]) if flags & 1 else None,
        ignore_eos=bool(flags & 4) if flags & 2 else None,
        n=int(head[2]),
        temperature=float(head[3]) if flags & 8 else None,
        session_id=strings["session_id"],
        prefix_unit=strings["prefix_unit"],
        prefix_size=int(head[4]),
        prefix_hashes=tuple(hashes.tolist()),
        body=strings["body"],
        completion_text=strings["completion_text"],
    )
