"""The relay's pure parts (sidecar/proxy/relay.py, headers.py): the headers it forwards, the
request id it keeps, the prefix key it routes on, the paths it refuses and the error event it
writes.
The relay serving traffic is tested through a running proxy (tests/test_proxy*.py); its
timeouts in tests/test_relay_timeouts.py."""

from __future__ import annotations

import os
import random
import uuid

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from sidecar.proxy import headers as headers_module
from sidecar.proxy.headers import (
    HOP_BY_HOP,
    RequestHeaders,
    has_dot_segment,
    new_request_id,
    request_id_from,
    response_header_block,
    upstream_header_block,
)
from sidecar.proxy.relay import error_event, prompt_prefix_key
from sidecar.proxy.shape import chat_text


def filtered_items(headers: CIMultiDict[str]) -> list[tuple[str, str]]:
    """The end-to-end headers, in order, as the relay kept them before its bytes paths (a
    multidict's items): without the hop-by-hop ones and without those that any ``Connection``
    header names. The specification both header blocks are held to."""
    named = {
        token.strip().lower()
        for value in headers.getall("Connection", ())
        for token in value.split(",")
        if token.strip()
    }
    return [
        (name, value)
        for name, value in headers.items()
        if (lower := name.lower()) not in HOP_BY_HOP and lower not in named
    ]


def test_hop_by_hop_headers_are_dropped_and_the_rest_forwarded() -> None:
    headers = CIMultiDict(
        [
            ("Connection", "keep-alive, X-Private-Hop"),
            ("Keep-Alive", "timeout=5"),
            ("Transfer-Encoding", "chunked"),
            ("Host", "client.example"),
            ("Content-Length", "10"),
            ("X-Private-Hop", "drop me"),
            ("Upgrade", "h2c"),
            ("TE", "trailers"),
            ("Authorization", "Bearer sk-x"),
            ("traceparent", "00-abc-def-01"),
            ("tracestate", "k=v"),
            ("X-Session-ID", "s1"),
            ("Accept", "text/event-stream"),
        ]
    )
    out = CIMultiDict(filtered_items(headers))
    assert sorted(out.keys()) == sorted(
        ["Authorization", "traceparent", "tracestate", "X-Session-ID", "Accept"]
    )
    assert out["traceparent"] == "00-abc-def-01"
    assert filtered_items(headers) == list(out.items())  # in order
    # Every Connection header names hop-by-hop headers (RFC 9110 7.6.1), not only the first.
    headers.add("Connection", "X-Second-Hop")
    headers.add("X-Second-Hop", "drop me too")
    assert filtered_items(headers) == list(out.items())
    # Without any Connection header, only the fixed hop-by-hop set goes.
    plain = CIMultiDict([("Keep-Alive", "5"), ("X-Private-Hop", "kept"), ("accept", "*/*")])
    assert filtered_items(plain) == [("X-Private-Hop", "kept"), ("accept", "*/*")]


def test_the_client_head_by_hand() -> None:
    """vLLM's streaming head through the proxy, with what a gateway in front of it may add:
    hop-by-hop and framing headers out (the client exchange frames the body itself), those a
    Connection header names out, the upstream's X-Request-Id replaced by the proxy's (vLLM
    with --enable-request-id-headers echoes it), the rest byte for byte, in order."""
    raw = [
        (b"date", b"Thu, 03 Dec 2026 14:00:00 GMT"),
        (b"server", b"uvicorn"),
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"Connection", b"keep-alive, X-Gateway-Hop"),
        (b"X-Gateway-Hop", b"gone"),
        (b"x-request-id", b"r1"),
        (b"X-Note", b"caf\xe9"),
        (b"transfer-encoding", b"chunked"),
    ]
    assert response_header_block(raw, "r1") == (
        b"date: Thu, 03 Dec 2026 14:00:00 GMT\r\n"
        b"server: uvicorn\r\n"
        b"content-type: text/event-stream; charset=utf-8\r\n"
        b"X-Note: caf\xe9\r\n"
        b"X-Request-Id: r1\r\n"
    )
    assert response_header_block([], "r2") == b"X-Request-Id: r2\r\n"


def _reference_upstream_headers(
    raw: list[tuple[bytes, bytes]],
    request_id: str,
    peer: str | None,
    identity: bool,
    traceparent: str | None,
) -> list[tuple[bytes, bytes]]:
    """The upstream's headers as the relay built them before its bytes path (a multidict of
    `filtered_items`, edited): the specification `upstream_header_block` is held to."""
    headers = CIMultiDict(
        filtered_items(CIMultiDict((n.decode("latin-1"), v.decode("latin-1")) for n, v in raw))
    )
    headers["X-Request-Id"] = request_id
    if peer is not None:
        given = headers.getall("X-Forwarded-For", ())
        headers.popall("X-Forwarded-For", None)
        headers["X-Forwarded-For"] = ", ".join([*given, peer])
    if identity:
        headers["Accept-Encoding"] = "identity"
    if traceparent is not None:
        headers["traceparent"] = traceparent
    return [(n.encode("latin-1"), v.encode("latin-1")) for n, v in headers.items()]


def _lines(block: bytes) -> list[tuple[bytes, bytes]]:
    assert block.endswith(b"\r\n")
    pairs = [line.split(b": ", 1) for line in block[:-2].split(b"\r\n")]
    return [(name, value) for name, value in pairs]


def test_the_upstream_head_by_hand() -> None:
    """An OpenAI client's headers through the proxy: hop-by-hop ones out (Host, Connection,
    Content-Length are the serializer's or the proxy's), those a Connection header names
    out, the client's X-Forwarded-For kept ahead of the peer, its X-Request-Id and
    Accept-Encoding replaced; the rest byte for byte, in order (a latin-1 value included)."""
    raw = [
        (b"Host", b"127.0.0.1:8000"),
        (b"Accept-Encoding", b"gzip, deflate"),
        (b"Connection", b"keep-alive, X-Hop"),
        (b"X-Hop", b"gone"),
        (b"Authorization", b"Bearer sk-x"),
        (b"x-forwarded-for", b"203.0.113.7"),
        (b"X-Request-Id", b"client-1"),
        (b"X-Note", b"caf\xe9"),
        (b"Content-Length", b"180"),
    ]
    block = upstream_header_block(raw, "r1", "10.0.0.9", True)
    assert block == (
        b"Authorization: Bearer sk-x\r\n"
        b"X-Note: caf\xe9\r\n"
        b"X-Request-Id: r1\r\n"
        b"X-Forwarded-For: 203.0.113.7, 10.0.0.9\r\n"
        b"Accept-Encoding: identity\r\n"
    )
    # A pass-through (no identity), no peer, with the proxy's traceparent: the client's
    # Accept-Encoding and X-Forwarded-For go as sent, its traceparent is replaced.
    raw.append((b"traceparent", b"00-client"))
    block = upstream_header_block(raw, "r1", None, False, "00-proxy")
    assert _lines(block) == [
        (b"Accept-Encoding", b"gzip, deflate"),
        (b"Authorization", b"Bearer sk-x"),
        (b"x-forwarded-for", b"203.0.113.7"),
        (b"X-Note", b"caf\xe9"),
        (b"X-Request-Id", b"r1"),
        (b"traceparent", b"00-proxy"),
    ]


def random_headers(
    rng: random.Random, names: list[bytes], most: int, values: list[bytes]
) -> list[tuple[bytes, bytes]]:
    """Up to ``most`` header pairs of these names (some letters' case flipped: names are
    case-insensitive) and values; a Connection header names others from the pool, with empty
    tokens and spaces."""
    raw = []
    for _ in range(rng.randint(0, most)):
        name = bytes(
            c ^ 32 if 97 <= (c | 32) <= 122 and rng.random() < 0.3 else c for c in rng.choice(names)
        )
        if name.lower() == b"connection":
            tokens = [rng.choice(names).lower() for _ in range(rng.randint(0, 3))]
            value = rng.choice([b",", b", "]).join(tokens + rng.choice([[], [b""], [b" "]]))
        else:
            value = rng.choice(values)
        raw.append((name, value))
    return raw


@pytest.mark.parametrize("seed", range(20))
def test_the_upstream_head_equals_the_multidict_path(seed: int) -> None:
    """Random header sets (hop-by-hop names in any case, Connection headers naming others,
    with empty tokens and spaces, repeated X-Forwarded-For, the headers the proxy sets,
    latin-1 values), every choice of peer, identity and traceparent: the same headers as the
    multidict path gave, the client's own in the same order (those the proxy sets may move
    to the end: order between different names carries no meaning, RFC 9110 5.3)."""
    rng = random.Random(seed)
    pool = [
        b"Host", b"Connection", b"Keep-Alive", b"TE", b"Transfer-Encoding", b"Upgrade",
        b"Content-Length", b"Expect", b"Proxy-Authorization", b"Trailer", b"X-Request-Id",
        b"X-Forwarded-For", b"Accept-Encoding", b"traceparent", b"Authorization", b"Accept",
        b"X-Custom-A", b"x-custom-b", b"User-Agent",
    ]  # fmt: skip
    for _ in range(50):
        raw = random_headers(rng, pool, 12, [b"v", b"a b", b"caf\xe9", b"10.1.1.1", b""])
        peer = rng.choice([None, "10.0.0.9"])
        identity = rng.random() < 0.5
        traceparent = rng.choice([None, "00-" + "a" * 32 + "-" + "b" * 16 + "-01"])
        new = _lines(upstream_header_block(raw, "rid", peer, identity, traceparent))
        old = _reference_upstream_headers(raw, "rid", peer, identity, traceparent)
        assert sorted(new) == sorted(old), raw
        set_by_proxy = {b"x-request-id", b"x-forwarded-for", b"accept-encoding", b"traceparent"}
        assert [h for h in new if h[0].lower() not in set_by_proxy] == [
            h for h in old if h[0].lower() not in set_by_proxy
        ], raw


@pytest.mark.parametrize("seed", range(10))
def test_the_client_head_equals_the_multidict_path(seed: int) -> None:
    """Random upstream header sets (hop-by-hop names in any case, Connection headers naming
    others, an upstream X-Request-Id, latin-1 values): `filtered_items` of the multidict with
    the proxy's X-Request-Id in the upstream's place, line for line and in order."""
    rng = random.Random(seed)
    pool = [
        b"Connection", b"Keep-Alive", b"Transfer-Encoding", b"Content-Length", b"Trailer",
        b"Upgrade", b"X-Request-Id", b"Content-Type", b"Date", b"Server", b"X-Custom-A",
        b"x-custom-b",
    ]  # fmt: skip
    for _ in range(50):
        raw = random_headers(rng, pool, 10, [b"v", b"a b", b"caf\xe9", b"text/event-stream", b""])
        kept = filtered_items(
            CIMultiDict((n.decode("latin-1"), v.decode("latin-1")) for n, v in raw)
        )
        expected = [
            (n.encode("latin-1"), v.encode("latin-1"))
            for n, v in kept
            if n.lower() != "x-request-id"
        ] + [(b"X-Request-Id", b"rid")]
        assert _lines(response_header_block(raw, "rid")) == expected, raw


@pytest.mark.parametrize("seed", range(10))
def test_request_header_lookups_answer_as_a_multidict_does(seed: int) -> None:
    """`RequestHeaders.get` (the parser's pairs, looked up by name) against the multidict the
    listener used to build: any case of a name, repeated names (the first value), latin-1
    values, names that are not there (None, or the default), and a name outside latin-1."""
    rng = random.Random(seed)
    pool = [b"X-Request-Id", b"traceparent", b"X-Session", b"Content-Length", b"Expect", b"A"]
    for _ in range(50):
        raw = random_headers(rng, pool, 8, [b"v", b"a b", b"caf\xe9", b"", b"100-continue"])
        multi = CIMultiDictProxy(
            CIMultiDict((n.decode("latin-1"), v.decode("latin-1")) for n, v in raw)
        )
        headers = RequestHeaders(raw)
        for name in ["x-request-id", "TRACEPARENT", "x-session", "Content-Length", "expect"]:
            assert headers.get(name) == multi.get(name), (name, raw)
            assert headers.get(name, "") == multi.get(name, ""), (name, raw)
        assert headers.get("X-Not-There") is None and headers.get("Ünïcode\u0100") is None


def test_request_header_lookups_keep_a_bounded_memo_of_names() -> None:
    """Each name looked up is lowered once and kept, up to a bound: a process that looks up
    many distinct names (a header configured per deployment, tests) keeps no more."""
    headers = RequestHeaders([(b"X-Name-7", b"seven"), (b"x-name-150", b"150")])
    for i in range(200):
        assert headers.get(f"x-NAME-{i}") == {7: "seven", 150: "150"}.get(i)
    assert len(headers_module._LOOKUP_KEYS) <= headers_module._MAX_LOOKUP_KEYS


def test_request_ids_are_honoured_when_sane_else_generated() -> None:
    given = CIMultiDictProxy(CIMultiDict({"X-Request-Id": "abc-123"}))
    assert request_id_from(given) == "abc-123"
    for bad in ("x" * 500, "line\nbreak"):
        generated = request_id_from(CIMultiDictProxy(CIMultiDict({"X-Request-Id": bad})))
        assert generated != bad and len(generated) == 32
    assert len(request_id_from(CIMultiDictProxy(CIMultiDict()))) == 32
    assert request_id_from(RequestHeaders([(b"x-request-ID", b"from-pairs")])) == "from-pairs"


def test_generated_request_ids_are_random_version_4_uuids() -> None:
    """What `uuid.uuid4().hex` gives (users may parse the id as a UUID), without the object:
    the version and variant bits set, the other 122 bits random (none stuck across ids)."""
    ids = [new_request_id() for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    seen_ones = 0
    for text in ids:
        parsed = uuid.UUID(hex=text)
        assert parsed.hex == text and len(text) == 32
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122
        seen_ones |= parsed.int
    random_bits = (1 << 128) - 1 ^ (0xF << 76) ^ (0x3 << 62)
    assert seen_ones & random_bits == random_bits  # every random bit was 1 at least once


def test_a_forked_process_does_not_repeat_its_parents_request_ids() -> None:
    """Ids come from a batch of the kernel's random bytes: a child forked with a batch half
    used must not hand out the ids its parent hands out next."""
    new_request_id()  # a batch in hand
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, then out at once (no pytest teardown here)
        try:
            os.write(write_end, " ".join(new_request_id() for _ in range(3)).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        childs = pipe.read().decode().split()
    os.waitpid(pid, 0)
    parents = [new_request_id() for _ in range(3)]
    assert len(childs) == 3 and not set(childs) & set(parents), (childs, parents)


def test_prefix_keys() -> None:
    assert prompt_prefix_key({"prompt": "abcdef"}, chars=3, tokens=2) == b"abc"
    assert prompt_prefix_key({"prompt": [[5, 6, 7]]}, chars=3, tokens=2) == b"5,6"
    assert prompt_prefix_key({"prompt": [5, 6, 7]}, chars=3, tokens=2) == b"5,6"
    chat = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ]
    }
    assert prompt_prefix_key(chat, chars=100, tokens=2) == (b"system\x1fbe brief\x1euser\x1fhi\x1e")
    # The first block only; the canonical text stops at the message that completes it.
    assert prompt_prefix_key(chat, chars=9, tokens=2) == b"system\x1fbe"
    assert chat_text(chat["messages"], limit=9) == "system\x1fbe brief\x1e"
    assert chat_text(chat["messages"]) == "system\x1fbe brief\x1euser\x1fhi\x1e"
    assert (
        prompt_prefix_key({"messages": [{"role": "user", "content": None}]}, chars=10, tokens=2)
        == b"user\x1f\x1e"
    )
    assert prompt_prefix_key({"messages": "junk"}, chars=10, tokens=2) is None


@pytest.mark.parametrize(
    ("path", "refused"),
    [
        ("/v1/chat/completions", False),
        ("/v1/a.b/c", False),  # a dot inside a segment is a name, not a step
        ("/v1/..a", False),
        ("/v1/../admin", True),
        ("/.", True),
        ("/v1/%2e%2e/admin", True),  # decoded before it is judged: what the upstream would see
        ("/v1/.%2E/x", True),
        ("/v1/a\\b", True),  # a backslash some servers read as a separator
        ("/v1/%5cb", True),
    ],
)
def test_dot_segments_are_found_after_percent_decoding(path: str, refused: bool) -> None:
    assert has_dot_segment(path) is refused


def test_the_error_event_is_written_the_way_vllm_writes_it() -> None:
    # vLLM's chat stream writes compact JSON; its completions stream json.dumps' default spacing.
    assert error_event("chat", "boom", "BadGateway", 502) == (
        b'data: {"error":{"message":"boom","type":"BadGateway","param":null,"code":502}}\n\n'
    )
    assert error_event("completions", "boom", "BadGateway", 502) == (
        b'data: {"error": {"message": "boom", "type": "BadGateway", "param": null, '
        b'"code": 502}}\n\n'
    )
