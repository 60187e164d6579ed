"""What the relay reads and rewrites in a request's headers and a response's: hop-by-hop
filtering, the request id, X-Forwarded-For, paths that a server would normalise into another."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from types import EllipsisType
from typing import Final, Protocol, overload
from urllib.parse import unquote

# RFC 9110 section 7.6.1 hop-by-hop headers, plus those the proxy recomputes itself, and
# Expect (the listener answered any 100-continue; the upstream gets the whole body at once).
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "expect",
    }
)
REQUEST_ID_HEADER: Final = "X-Request-Id"
MAX_REQUEST_ID_LEN: Final = 128


# The same names as bytes, lower-case, for the upstream head built from the client's raw
# header pairs (`upstream_header_block`).
_HOP_BY_HOP_BYTES: Final = frozenset(name.encode("ascii") for name in HOP_BY_HOP)
_CONNECTION: Final = b"connection"
_X_FORWARDED_FOR: Final = b"x-forwarded-for"
# What leaves the client's headers, by (identity, traceparent given, peer known): the
# hop-by-hop ones and those the proxy sets itself (X-Forwarded-For is merged, not dropped).
_DROPPED: Final = {
    (identity, traced, merged): _HOP_BY_HOP_BYTES
    | {b"x-request-id"}
    | ({b"accept-encoding"} if identity else set())
    | ({b"traceparent"} if traced else set())
    | ({_X_FORWARDED_FOR} if merged else set())
    for identity in (False, True)
    for traced in (False, True)
    for merged in (False, True)
}


# The same sets as sorted tuples, for the C pass (_headerblock.c compares a name with each).
_DROPPED_NAMES: Final = {key: tuple(sorted(names)) for key, names in _DROPPED.items()}

_KeptC = Callable[
    [Sequence[tuple[bytes, bytes]], tuple[bytes, ...]],
    tuple[bytes, list[bytes] | None, list[bytes] | None, bool] | None,
]
_IndexC = Callable[[list[tuple[bytes, bytes]]], dict[bytes, bytes] | None]
_FirstC = Callable[[Sequence[tuple[bytes, bytes]], bytes], bytes | None | EllipsisType]
_kept_c: _KeptC | None
_index_c: _IndexC | None
_first_c: _FirstC | None
try:
    from sidecar.proxy._headerblock import first_value as _first_c
    from sidecar.proxy._headerblock import kept as _kept_c
    from sidecar.proxy._headerblock import lowered_index as _index_c
except ImportError:  # built without a C compiler: the Python below does the same
    _kept_c = _index_c = _first_c = None
# Final: C statics in compiled code, where a module global is a dict lookup per read.
_native_kept: Final = _kept_c
_native_index: Final = _index_c
_native_first: Final = _first_c
_DEFERRED: Final = EllipsisType  # the C lookup's answer (...) for a pair list it leaves


def first_value(pairs: Sequence[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The value of the first of ``pairs`` named ``name`` (lower-case), the names compared
    ASCII case-insensitively; None for none. In C where the package was built with it
    (_headerblock.c: no lower-cased copy of each name); `_first_value_python` is the
    specification."""
    native = _native_first
    if native is not None:
        found = native(pairs, name)
        if not isinstance(found, _DEFERRED):
            return found
    return _first_value_python(pairs, name)


def _first_value_python(pairs: Sequence[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in pairs:
        if key.lower() == name:
            return value
    return None


def upstream_header_block(
    raw: Sequence[tuple[bytes, bytes]],
    request_id: str,
    peer: str | None,
    identity: bool,
    traceparent: str | None = None,
) -> bytes:
    """The upstream request's header lines (``Name: value`` and CRLF each; Host and
    Content-Length are the serializer's), from the client's header pairs as the parser gave
    them: the end-to-end headers (RFC 9110 7.6.1: not the hop-by-hop ones, nor those a
    ``Connection`` header names), in order, names and values byte for byte, then those
    the proxy sets: ``X-Request-Id`` (the client's replaced), ``X-Forwarded-For`` (the
    client's values, then ``peer``: nginx's $proxy_add_x_forwarded_for; as sent when there is
    no peer), ``Accept-Encoding: identity`` when ``identity`` (the proxy reads the answer) and
    ``traceparent`` when given (the client's replaced). Bytes from the parser's bytes: no
    multidict, no text round trip."""
    key = (identity, traceparent is not None, peer is not None)
    block, forwarded, xff_named = _kept(raw, _DROPPED[key], _DROPPED_NAMES[key])
    parts = [block, b"X-Request-Id: %s\r\n" % request_id.encode("latin-1")]
    if peer is not None:
        # A Connection header that named X-Forwarded-For made the client's hop-by-hop.
        values = [] if xff_named else forwarded
        values.append(peer.encode("latin-1"))
        parts.append(b"X-Forwarded-For: %s\r\n" % b", ".join(values))
    if identity:
        parts.append(b"Accept-Encoding: identity\r\n")
    if traceparent is not None:
        parts.append(b"traceparent: %s\r\n" % traceparent.encode("latin-1"))
    return b"".join(parts)


_DROPPED_FROM_RESPONSE: Final = _HOP_BY_HOP_BYTES | {b"x-request-id"}
_DROPPED_FROM_RESPONSE_NAMES: Final = tuple(sorted(_DROPPED_FROM_RESPONSE))


def response_header_block(raw: Sequence[tuple[bytes, bytes]], request_id: str) -> bytes:
    """The client's response header lines from the upstream's header pairs as llhttp gave
    them: the end-to-end headers, as for the request (`upstream_header_block`), in order,
    names and values byte for byte, then ``X-Request-Id`` (the upstream's replaced: vLLM run
    with --enable-request-id-headers echoes the one the proxy sent, and a client must not read
    it twice). The framing lines are the client exchange's (`ClientExchange.start_block`)."""
    block, _, _ = _kept(raw, _DROPPED_FROM_RESPONSE, _DROPPED_FROM_RESPONSE_NAMES)
    return block + b"X-Request-Id: %s\r\n" % request_id.encode("latin-1")


def _kept(
    raw: Sequence[tuple[bytes, bytes]], dropped: frozenset[bytes], names: tuple[bytes, ...]
) -> tuple[bytes, list[bytes], bool]:
    """The end-to-end header lines of ``raw`` (those not in ``dropped``, nor named by a
    Connection header: RFC 9110 7.6.1), in order, names and values byte for byte; the values
    of the X-Forwarded-For headers when ``dropped`` holds it (to be merged); whether a
    Connection header named X-Forwarded-For. ``names``: ``dropped`` as a tuple. In C where
    the package was built with it (_headerblock.c); `_kept_python` is the specification."""
    native = _native_kept
    if native is not None:
        one_pass = native(raw, names)
        if one_pass is not None:
            block, forwarded, extra, xff_named = one_pass
            if extra is not None:  # a Connection header named end-to-end headers: they go too
                again = native(raw, names + tuple(extra))
                if again is None:
                    return _kept_python(raw, dropped)
                block, forwarded = again[0], again[1]
            return block, [] if forwarded is None else forwarded, xff_named
    return _kept_python(raw, dropped)


def _kept_python(
    raw: Sequence[tuple[bytes, bytes]], dropped: frozenset[bytes]
) -> tuple[bytes, list[bytes], bool]:
    """`_kept` in Python: what the C pass must give."""
    parts, forwarded, named = _kept_lines(raw, dropped)
    extra = named - dropped
    extra.discard(b"")
    if extra:  # a Connection header named end-to-end headers: they go too (RFC 9110 7.6.1)
        parts, forwarded, _ = _kept_lines(raw, dropped | extra)
    return b"".join(parts), forwarded, _X_FORWARDED_FOR in named


def _kept_lines(
    raw: Sequence[tuple[bytes, bytes]], dropped: frozenset[bytes]
) -> tuple[list[bytes], list[bytes], set[bytes]]:
    """(the kept headers' line parts, the X-Forwarded-For values when it is dropped to be
    merged, the names every Connection header gives)."""
    parts: list[bytes] = []
    forwarded: list[bytes] = []
    named: set[bytes] = set()
    for name, value in raw:
        lower = name.lower()
        if lower in dropped:
            if lower == _CONNECTION:
                named.update(token.strip().lower() for token in value.split(b","))
            elif lower == _X_FORWARDED_FOR:
                forwarded.append(value)
            continue
        parts += (name, b": ", value, b"\r\n")
    return parts, forwarded, named


def has_dot_segment(path: str) -> bool:
    """True when a segment of the path, percent-decoded, is ``.`` or ``..`` (or holds a
    backslash, which some servers read as a separator)."""
    if "." not in path and "%" not in path and "\\" not in path:
        return False  # the common path: no decoding
    decoded = unquote(path)
    return any(segment in (".", "..") or "\\" in segment for segment in decoded.split("/"))


class HeaderLookup(Protocol):
    """What reads a request's headers by name: `RequestHeaders`, or a multidict."""

    def get(self, name: str, /) -> str | None: ...


# A name as callers look it up -> its lowered bytes: the few names a request reads (constants
# and the configured session and SLO class headers), kept once rather than lowered and encoded
# per lookup (6.8 -> 5.8 µs for a request's head and five lookups, timeit). Bounded: past it,
# names are lowered per lookup.
_LOOKUP_KEYS: Final[dict[str, bytes]] = {}
_MAX_LOOKUP_KEYS: Final = 64


class RequestHeaders:
    """A request's header pairs as the parser gave them (bytes, in order), looked up by name:
    case-insensitively, the first value, as text (latin-1), as a multidict's `get` answers.
    A request reads five or six of its headers once each (its id, trace context, session and
    SLO class, Content-Length, Expect): one dict of lowered names, made at the first lookup,
    costs a third less than a multidict of them all (5.8 µs against 8.9 for an OpenAI client's
    17 headers and five lookups, benchmarks/RESULTS.md "The request's headers without a
    multidict")."""

    __slots__ = ("pairs", "_index")

    def __init__(self, pairs: list[tuple[bytes, bytes]]) -> None:
        self.pairs = pairs
        self._index: dict[bytes, bytes] | None = None

    @overload
    def get(self, name: str, /) -> str | None: ...
    @overload
    def get(self, name: str, default: str, /) -> str: ...
    def get(self, name: str, default: str | None = None, /) -> str | None:
        index = self._index
        if index is None:
            index = _lowered_index(self.pairs)
            self._index = index
        key = _LOOKUP_KEYS.get(name)
        if key is None:
            key = name.lower().encode("latin-1", "replace")
            if len(_LOOKUP_KEYS) < _MAX_LOOKUP_KEYS:
                _LOOKUP_KEYS[name] = key
        raw = index.get(key)
        return default if raw is None else raw.decode("latin-1")


def _lowered_index(pairs: list[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    """Each name lower-cased -> its first value; in C where the package was built with it
    (_headerblock.c), `_lowered_index_python` is the specification."""
    native = _native_index
    if native is not None:
        index = native(pairs)
        if index is not None:
            return index
    return _lowered_index_python(pairs)


def _lowered_index_python(pairs: list[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    index = {}
    for name, value in reversed(pairs):  # the first of a name is kept
        index[name.lower()] = value
    return index


NO_HEADERS: Final = RequestHeaders([])


def request_id_from(headers: HeaderLookup) -> str:
    given = headers.get(REQUEST_ID_HEADER)
    if given and len(given) <= MAX_REQUEST_ID_LEN and given.isprintable():
        return given
    return new_request_id()


# The operating system's random bytes, taken 256 ids at a time: one getrandom call per
# request was ~60 % of an id's cost (565 -> 230 ns, timeit). Still the kernel's CSPRNG; a
# forked child starts without its parent's bytes, or the two would hand out the same ids.
_RANDOM_BATCH: Final = 16 * 256


class _RandomBytes:
    """The batch in hand and how much of it is used: an object's attributes, not module
    globals (each read of which is a lookup in the module's dict in compiled code)."""

    __slots__ = ("data", "at")

    def __init__(self) -> None:
        self.data = bytearray()
        self.at = 0


_RANDOM: Final = _RandomBytes()


def _forget_random() -> None:
    _RANDOM.data = bytearray()
    _RANDOM.at = 0


os.register_at_fork(after_in_child=_forget_random)


def new_request_id() -> str:
    """A random (version 4) UUID as 32 hex digits, what ``uuid.uuid4().hex`` gives, made
    without the UUID object: its constructor was ~100 bytecodes of every request."""
    state = _RANDOM
    at = state.at
    if at + 16 > len(state.data):
        state.data = bytearray(os.urandom(_RANDOM_BATCH))
        at = 0
    state.at = at + 16
    raw = state.data[at : at + 16]
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80  # the RFC 9562 variant
    return raw.hex()
