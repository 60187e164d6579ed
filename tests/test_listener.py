"""The traffic listener's connection hygiene, each case an attack or mistake reproduced on a real
socket: slow heads and bodies, idle keep-alive, too many connections, too many or too large
headers, malformed and smuggling framings, Expect: 100-continue, pipelining, and an upstream
that speaks broken HTTP. Every request that reaches the listener ends in exactly one record."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import pytest
from proxy_stack import stack
from reliability_helpers import settle, until

from sidecar.record import Outcome

CHAT = "/v1/chat/completions"
BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 3}
).encode()


def request_bytes(request_id: str, body: bytes = BODY, extra: str = "") -> bytes:
    return (
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: {request_id}\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


async def connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.split("://")[1].rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def read_all(reader: asyncio.StreamReader, timeout: float = 10.0) -> bytes:
    return await asyncio.wait_for(reader.read(), timeout)


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await writer.wait_closed()
    except ConnectionError:
        pass


async def test_a_slow_head_is_answered_408_and_recorded() -> None:
    async with stack(header_timeout="300ms") as s:
        reader, writer = await connect(s.url)
        writer.write(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nX-Request-Id: slow-head\r\n".encode())
        answer = await read_all(reader)  # the rest of the head never comes
        await close(writer)
        (record,) = await settle(s.server, s.records, 1, s.replicas)
    assert status_of(answer) == 408
    assert record.outcome is Outcome.REJECTED and record.error_type == "header_timeout"
    assert record.replica is None


async def test_a_connection_that_sends_nothing_is_closed_without_a_record() -> None:
    async with stack(header_timeout="200ms") as s:
        reader, writer = await connect(s.url)
        assert await read_all(reader) == b""  # closed by the proxy, nothing said
        await close(writer)
        # Once the proxy has let the connection go it has done all it will about it.
        traffic = s.server.traffic
        assert traffic is not None
        await until(lambda: not traffic.connections, what="the connection let go")
        assert s.server.proxy.requests_total == 0 and not s.records.records


async def test_a_trickled_body_is_answered_408_and_never_holds_a_slot() -> None:
    async with stack(body_timeout="300ms") as s:
        reader, writer = await connect(s.url)
        writer.write(request_bytes("trickle")[:-20])  # the body's last 20 bytes never come
        answer = await read_all(reader)
        await close(writer)
        (record,) = await settle(s.server, s.records, 1, s.replicas)
        assert s.server.proxy.in_flight == 0
    assert status_of(answer) == 408 and b"RequestTimeout" in answer
    assert record.outcome is Outcome.REJECTED and record.error_type == "body_timeout"
    assert record.request_id == "trickle" and record.endpoint == "chat"


async def test_an_idle_keepalive_connection_is_closed() -> None:
    async with stack(keepalive_timeout="300ms") as s:
        reader, writer = await connect(s.url)
        writer.write(request_bytes("first"))
        head = await asyncio.wait_for(reader.readuntil(b"data: [DONE]\n\n"), 10)
        assert status_of(head) == 200
        rest = await read_all(reader)  # then the connection idles until the proxy closes it
        assert rest == b"0\r\n\r\n" or rest.endswith(b"0\r\n\r\n")
        await close(writer)
        (record,) = await settle(s.server, s.records, 1, s.replicas)
    assert record.outcome is Outcome.OK


async def test_connections_beyond_the_cap_get_503_and_a_record() -> None:
    async with stack(max_connections="2") as s:
        held = [await connect(s.url) for _ in range(2)]
        # Connected on our side is not yet accepted on the proxy's: wait until it holds both.
        traffic = s.server.traffic
        assert traffic is not None
        await until(lambda: len(traffic.connections) == 2, what="two connections held")
        reader, writer = await connect(s.url)
        answer = await read_all(reader)
        await close(writer)
        for _, w in held:
            await close(w)
        (record,) = await settle(s.server, s.records, 1, s.replicas)
        # The held connections were free slots again: the next request is served.
        reader, writer = await connect(s.url)
        writer.write(request_bytes("after"))
        ok = await asyncio.wait_for(reader.readuntil(b"data: [DONE]\n\n"), 10)
        await close(writer)
        await settle(s.server, s.records, 2, s.replicas)
    assert status_of(answer) == 503 and b"ServiceUnavailable" in answer
    assert record.outcome is Outcome.REJECTED and record.error_type == "max_connections"
    assert status_of(ok) == 200


@pytest.mark.parametrize(
    ("extra", "limit"),
    [
        ("".join(f"X-H{i}: v\r\n" for i in range(30)), {"max_header_count": "20"}),
        ("X-Big: " + "a" * 5000 + "\r\n", {"max_header_bytes": "4096"}),
    ],
)
async def test_too_many_or_too_large_headers_get_431(extra: str, limit: dict[str, Any]) -> None:
    async with stack(**limit) as s:
        reader, writer = await connect(s.url)
        writer.write(request_bytes("big", extra=extra))
        answer = await read_all(reader)
        await close(writer)
        (record,) = await settle(s.server, s.records, 1, s.replicas)
    assert status_of(answer) == 431
    assert record.outcome is Outcome.REJECTED and record.error_type == "headers_too_large"


SMUGGLING = [
    # Content-Length and Transfer-Encoding together (CL.TE / TE.CL)
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    # two different Content-Lengths
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nContent-Length: 5\r\n\r\n"
    b"abcde",
    # an obfuscated Transfer-Encoding
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, identity\r\n\r\n"
    b"0\r\n\r\n",
    # a space before the colon
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length : 4\r\n\r\nabcd",
    # a bare LF inside a chunk size line
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"4\nabcd\r\n0\r\n\r\n",
    # garbage (a TLS hello)
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)),
]


@pytest.mark.parametrize("raw", SMUGGLING, ids=range(len(SMUGGLING)))
async def test_malformed_and_smuggling_framings_are_refused_recorded_and_logged_tersely(
    raw: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="sidecar.proxy")
    async with stack() as s:
        reader, writer = await connect(s.url)
        writer.write(raw.replace(b"Host: x", b"Host: x\r\nAuthorization: Bearer sk-secret-123"))
        answer = await read_all(reader)
        await close(writer)
        (record,) = await settle(s.server, s.records, 1, s.replicas)
        # Nothing went upstream.
        assert [r.requests_total for r in s.server.proxy.router.replicas] == [0]
    assert status_of(answer) == 400
    assert record.outcome is Outcome.REJECTED and record.error_type == "malformed_http"
    lines = [r.getMessage() for r in caplog.records if "malformed request" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "sk-secret" not in caplog.text and "Bearer" not in caplog.text


async def test_expect_continue_with_an_oversized_length_gets_413_at_once() -> None:
    async with stack(max_body_bytes="1000") as s:
        reader, writer = await connect(s.url)
        writer.write(
            (
                f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nX-Request-Id: big\r\n"
                "Content-Length: 5000\r\nExpect: 100-continue\r\n\r\n"
            ).encode()
        )
        answer = await read_all(reader)  # without sending a byte of the body
        await close(writer)
        (record,) = await settle(s.server, s.records, 1, s.replicas)
    assert status_of(answer) == 413
    assert record.outcome is Outcome.REJECTED and record.error_type == "body_too_large"
    assert record.request_id == "big"


async def test_expect_continue_gets_100_then_the_answer() -> None:
    async with stack() as s:
        reader, writer = await connect(s.url)
        head = request_bytes("cont", extra="Expect: 100-continue\r\n")
        writer.write(head[: -len(BODY)])
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(BODY)
        answer = await asyncio.wait_for(reader.readuntil(b"data: [DONE]\n\n"), 10)
        await close(writer)
        (record,) = await settle(s.server, s.records, 1, s.replicas)
    assert status_of(answer) == 200 and record.outcome is Outcome.OK


async def test_pipelined_requests_are_answered_in_order() -> None:
    async with stack() as s:
        reader, writer = await connect(s.url)
        writer.write(
            request_bytes("one")
            + request_bytes("two")
            + request_bytes("three", extra="Connection: close\r\n")
        )
        answer = await read_all(reader)
        await close(writer)
        records = await settle(s.server, s.records, 3, s.replicas)
    ids = [
        line.split(b": ")[1].strip()
        for line in answer.split(b"\r\n")
        if line.lower().startswith(b"x-request-id")
    ]
    assert ids == [b"one", b"two", b"three"]
    assert answer.count(b"data: [DONE]") == 3
    assert all(r.outcome is Outcome.OK for r in records)


async def test_a_client_that_leaves_during_a_pipelined_request_is_noticed_at_once() -> None:
    """The second request waited behind the first (reading paused); once it is handled, reading
    goes on as for a request that came alone, so the client's leaving is seen while the replica
    still holds its answer (5 s here), not after it was written to nobody."""
    async with stack() as s:
        reader, writer = await connect(s.url)
        writer.write(
            request_bytes("first")
            + request_bytes("second", extra="X-Sim-Fault: slow_headers_ms=5000\r\n")
        )
        await asyncio.wait_for(reader.readuntil(b"data: [DONE]\n\n"), 10)
        replicas = s.server.proxy.router.replicas
        await until(
            lambda: sum(r.requests_total for r in replicas) == 2,
            what="the second request sent to the replica",
        )
        await close(writer)
        first, second = await asyncio.wait_for(settle(s.server, s.records, 2, s.replicas), 3.0)
    assert first.request_id == "first" and first.outcome is Outcome.OK
    assert second.request_id == "second"
    assert second.outcome is Outcome.CLIENT_CANCELLED and second.error_type == "client_disconnected"


async def test_an_upstream_speaking_broken_http_is_a_502() -> None:
    async def broken(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 2OO OK\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        writer.close()

    from reliability_helpers import proxy_to

    async with raw_upstream(broken) as url, proxy_to([url]) as p:
        reader, writer = await connect(p.url)
        writer.write(
            request_bytes(
                "broken",
                body=BODY.replace(b'"stream": true', b'"stream": false'),
                extra="Connection: close\r\n",
            )
        )
        answer = await read_all(reader)
        await close(writer)
        (record,) = await settle(p.server, p.records, 1)
    assert status_of(answer) == 502
    assert record.outcome is Outcome.UPSTREAM_ERROR
    assert record.error_type == "upstream_protocol_error"


async def test_open_files_limit_is_raised_to_the_hard_limit() -> None:
    import resource

    from sidecar.proxy.listener import raise_open_files_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard <= 256:
        pytest.skip(f"the open-files hard limit here ({hard}) leaves nothing to raise to")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        assert raise_open_files_limit() == min(hard, 1 << 20)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == min(hard, 1 << 20)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize(
    ("target", "status"),
    [
        ("http://evil.example:8080/v1/models?x=1", 200),  # absolute form: served as its path
        ("*", 400),
        ("evil.example:443", 400),  # authority form (CONNECT)
    ],
)
async def test_request_targets_are_paths_for_our_upstream_only(target: str, status: int) -> None:
    async with stack() as s:
        reader, writer = await connect(s.url)
        method = "CONNECT" if ":" in target and "/" not in target else "GET"
        writer.write(f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        answer = await read_all(reader)
        await close(writer)
        (record,) = await settle(s.server, s.records, 1, s.replicas)
    assert status_of(answer) == status
    if status == 200:
        assert record.endpoint == "/v1/models" and record.outcome is Outcome.OK
        assert b'"object":"list"' in answer
    else:
        assert record.outcome is Outcome.REJECTED and record.error_type == "malformed_http"
        assert [r.requests_total for r in s.server.proxy.router.replicas] == [0]


async def test_a_failure_inside_request_parsing_still_answers_and_records(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sidecar.proxy.listener import ClientConnection

    def broken(self: ClientConnection, name: bytes, value: bytes) -> None:
        raise KeyError("a bug")

    monkeypatch.setattr(ClientConnection, "on_header", broken)
    async with stack() as s:
        reader, writer = await connect(s.url)
        writer.write(request_bytes("bug"))
        answer = await read_all(reader)
        await close(writer)
        (record,) = await settle(s.server, s.records, 1, s.replicas)
    assert status_of(answer) == 500
    assert record.outcome is Outcome.REJECTED
    assert record.error_type == "proxy_error:request_parsing"


def _sse(*payloads: str) -> bytes:
    """An HTTP/1.1 chunked event-stream body, one chunk per event, and its terminator."""
    events = [f"data: {p}\n\n".encode() for p in payloads]
    return b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"


def _one_chunk(*payloads: str) -> bytes:
    """The same events as the proxy relays one read of them: one chunk, then the end."""
    events = b"".join(f"data: {p}\n\n".encode() for p in payloads)
    return b"%x\r\n%b\r\n0\r\n\r\n" % (len(events), events)


_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    b"Connection: close\r\n\r\n"
)
_TOKEN = json.dumps(
    {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}],
    }
)


class WriteSpy:
    """A client connection's real transport, with every ``write`` counted."""

    def __init__(self, transport: Any) -> None:
        self.inner = transport
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self.inner.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@asynccontextmanager
async def raw_upstream(serve: Any) -> AsyncIterator[str]:
    """An upstream that is ``serve(reader, writer)`` on a plain asyncio server: its URL."""
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


async def test_a_stream_that_came_with_its_head_leaves_in_one_write() -> None:
    """The replica's head, events and end arrive in one read: the client's head, events and
    end go out in one write (the head is held for the events already here), byte for byte."""

    async def whole(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(_STREAM_HEAD + _sse(_TOKEN, "[DONE]"))
        await close(writer)

    from reliability_helpers import proxy_to

    async with raw_upstream(whole) as url, proxy_to([url]) as p:
        reader, writer = await connect(p.url)
        traffic = p.server.traffic
        assert traffic is not None
        await until(lambda: len(traffic.connections) == 1)
        (connection,) = traffic.connections
        spy = WriteSpy(connection.transport)
        connection.transport = cast(asyncio.Transport, spy)  # counted, then passed on
        writer.write(request_bytes("one-write"))
        answer = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 10)
        await close(writer)
        (record,) = await settle(p.server, p.records, 1)
    assert record.outcome is Outcome.OK and record.n_out == 1
    assert len(spy.writes) == 1
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"Transfer-Encoding: chunked" in head
    assert body == _one_chunk(_TOKEN, "[DONE]")


async def test_a_held_head_does_not_wait_for_the_first_event() -> None:
    """The replica sends its head and only then, after the client has the head, its events:
    holding the head for the events that came with it must not hold it for later ones."""
    client_has_head = asyncio.Event()

    async def head_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(_STREAM_HEAD)
        await writer.drain()
        await client_has_head.wait()
        writer.write(_sse(_TOKEN, "[DONE]"))
        await close(writer)

    from reliability_helpers import proxy_to

    async with raw_upstream(head_first) as url, proxy_to([url]) as p:
        reader, writer = await connect(p.url)
        writer.write(request_bytes("head-first"))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        client_has_head.set()
        body = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 10)
        await close(writer)
        (record,) = await settle(p.server, p.records, 1)
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert body == _one_chunk(_TOKEN, "[DONE]")
    assert record.outcome is Outcome.OK and record.n_out == 1
