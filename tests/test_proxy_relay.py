"""The relay's pure parts (sidecar/proxy/relay.py, headers.py): the headers it forwards, the
request id it keeps, the prefix key it routes on, the paths it refuses and the error event it
writes.
The relay serving traffic is tested through a running proxy (tests/test_proxy*.py); its
timeouts in tests/test_relay_timeouts.py."""

from __future__ import annotations

import uuid

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from sidecar.proxy.headers import (
    filtered_headers,
    filtered_items,
    has_dot_segment,
    new_request_id,
    request_id_from,
)
from sidecar.proxy.relay import error_event, prompt_prefix_key
from sidecar.proxy.shape import chat_text


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
    out = filtered_headers(headers)
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


def test_request_ids_are_honoured_when_sane_else_generated() -> None:
    given = CIMultiDictProxy(CIMultiDict({"X-Request-Id": "abc-123"}))
    assert request_id_from(given) == "abc-123"
    for bad in ("x" * 500, "line\nbreak"):
        generated = request_id_from(CIMultiDictProxy(CIMultiDict({"X-Request-Id": bad})))
        assert generated != bad and len(generated) == 32
    assert len(request_id_from(CIMultiDictProxy(CIMultiDict()))) == 32


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
