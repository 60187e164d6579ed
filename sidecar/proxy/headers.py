"""What the relay reads and rewrites in a request's headers: hop-by-hop filtering, the
request id, X-Forwarded-For, paths that a server would normalise into another."""

from __future__ import annotations

import os
from typing import Final
from urllib.parse import unquote

from multidict import CIMultiDict, CIMultiDictProxy

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
REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID_LEN = 128


def filtered_items(headers: CIMultiDict[str] | CIMultiDictProxy[str]) -> list[tuple[str, str]]:
    """The end-to-end headers, in order: without the hop-by-hop ones and without those that a
    ``Connection`` header names (every ``Connection`` header, as RFC 9110 7.6.1 allows several;
    most requests have none, and then no set of tokens is built)."""
    named: set[str] | tuple[()] = ()
    if "Connection" in headers:
        named = {
            token.strip().lower()
            for value in headers.getall("Connection")
            for token in value.split(",")
            if token.strip()
        }
    return [
        (name, value)
        for name, value in headers.items()
        if (lower := name.lower()) not in HOP_BY_HOP and lower not in named
    ]


def filtered_headers(headers: CIMultiDict[str] | CIMultiDictProxy[str]) -> CIMultiDict[str]:
    """`filtered_items` as a new multidict (the upstream request's, which the relay edits)."""
    return CIMultiDict(filtered_items(headers))


FORWARDED_FOR: Final = "X-Forwarded-For"


def has_dot_segment(path: str) -> bool:
    """True when a segment of the path, percent-decoded, is ``.`` or ``..`` (or holds a
    backslash, which some servers read as a separator)."""
    if "." not in path and "%" not in path and "\\" not in path:
        return False  # the common path: no decoding
    decoded = unquote(path)
    return any(segment in (".", "..") or "\\" in segment for segment in decoded.split("/"))


def request_id_from(headers: CIMultiDictProxy[str]) -> str:
    given = headers.get(REQUEST_ID_HEADER)
    if given and len(given) <= MAX_REQUEST_ID_LEN and given.isprintable():
        return given
    return new_request_id()


def new_request_id() -> str:
    """A random (version 4) UUID as 32 hex digits, what ``uuid.uuid4().hex`` gives, made
    without the UUID object: its constructor was ~100 bytecodes of every request."""
    raw = bytearray(os.urandom(16))
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80  # the RFC 9562 variant
    return raw.hex()
