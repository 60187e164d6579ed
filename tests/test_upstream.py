"""The data path's HTTP/1.1 client (sidecar/proxy/upstream.py) against a raw upstream on a real
socket: keep-alive reuse, a pooled connection the replica closed, interim responses, HEAD, and a
body delimited by the connection's end."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from collections.abc import AsyncIterator, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_helpers import require_module
from reliability_helpers import RawUpstream, proxy_to, settle, until

from sidecar.proxy.upstream import UpstreamError, UpstreamExchange, UpstreamPool
from sidecar.record import Outcome

CHAT = "/v1/chat/completions"
BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 1}
).encode()
SSE = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":'
    b'[{"index":0,"delta":{"content":"hi"},"logprobs":null,"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":3,"total_tokens":4,"completion_tokens":1}}\n\n'
    b"data: [DONE]\n\n"
)


def sse_response(keep_alive: bool = True) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        + (b"" if keep_alive else b"Connection: close\r\n")
        + b"Content-Length: "
        + str(len(SSE)).encode()
        + b"\r\n\r\n"
        + SSE
    )


# The head of a chat request sent through an `UpstreamPool` (Content-Length: BODY's).
POOL_HEAD = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(BODY)}\r\n\r\n".encode()


async def answered_whole(pool: UpstreamPool, port: int) -> UpstreamExchange:
    """One chat request through the pool, its whole answer read (the SSE the upstream sent)."""
    exchange = await pool.exchange("127.0.0.1", port, POOL_HEAD, BODY, connect_timeout=5)
    await exchange.response()
    assert await exchange.read_body(1 << 20) == SSE
    return exchange


async def post_stream(url: str, request_id: str) -> tuple[int, bytes]:
    host, port = url.split("://")[1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        (
            f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"X-Request-Id: {request_id}\r\nConnection: close\r\n"
            f"Content-Length: {len(BODY)}\r\n\r\n"
        ).encode()
        + BODY
    )
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return int(answer.split(b" ", 2)[1]), answer


async def test_sequential_requests_share_one_upstream_connection() -> None:
    async def answer(_c: int, _n: int, _head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(sse_response())
        return True

    upstream = RawUpstream(answer)
    async with upstream as url, proxy_to([url], engine_scrape_interval="0") as p:
        for i in range(5):
            status, body = await post_stream(p.url, f"r{i}")
            assert status == 200 and body.count(b"data: [DONE]") == 1
        await settle(p.server, p.records, 5)
        assert p.server.proxy.pool.open_connections == 1
    assert (upstream.connections, upstream.requests) == (1, 5)


WHOLE = (
    b'{"id":"c","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":3,"total_tokens":4,"completion_tokens":1}}'
)


@pytest.mark.parametrize(
    "content_type,payload", [(b"text/event-stream", SSE), (b"application/json", WHOLE)]
)
async def test_the_client_gets_the_upstream_head_filtered_and_no_trailer(
    content_type: bytes, payload: bytes
) -> None:
    """The client's head is the upstream's end-to-end headers byte for byte, in order (a
    gateway's Connection-named header and the framing headers out, the upstream's
    X-Request-Id replaced by the proxy's, which it echoed) and its own framing; a chunked
    body's trailer reaches no head (a whole answer's goes out after its body is read), and
    the answer is measured."""
    chunk = b"%x\r\n%b\r\n" % (len(payload), payload)

    async def answer(_c: int, _n: int, _head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: %b; charset=utf-8\r\n"
            % content_type
            + b"Connection: keep-alive, X-Gateway-Hop\r\nX-Gateway-Hop: gone\r\n"
            b"x-request-id: rid-7\r\nX-Note: caf\xe9\r\nTrailer: X-Tail\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + chunk + b"0\r\nX-Tail: t\r\n\r\n"
        )
        return True

    async with RawUpstream(answer) as url, proxy_to([url], engine_scrape_interval="0") as p:
        status, answered = await post_stream(p.url, "rid-7")
        (record,) = await settle(p.server, p.records, 1)
    head, _, body = answered.partition(b"\r\n\r\n")
    framing = (
        b"Transfer-Encoding: chunked"
        if content_type == b"text/event-stream"
        else b"Content-Length: %d" % len(WHOLE)
    )
    assert status == 200 and head == (
        b"HTTP/1.1 200 OK\r\ncontent-type: %b; charset=utf-8\r\n" % content_type
        + b"X-Note: caf\xe9\r\nX-Request-Id: rid-7\r\n%b\r\nConnection: close" % framing
    )
    assert b"X-Tail" not in body
    assert record.outcome is Outcome.OK and record.n_out == 1


async def test_a_connection_the_upstream_does_not_keep_is_not_reused() -> None:
    async def answer(_c: int, _n: int, _head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(sse_response(keep_alive=False))
        return False

    upstream = RawUpstream(answer)
    async with upstream as url, proxy_to([url], engine_scrape_interval="0") as p:
        for i in range(3):
            assert (await post_stream(p.url, f"r{i}"))[0] == 200
        records = await settle(p.server, p.records, 3)
    assert upstream.connections == 3
    assert all(r.outcome is Outcome.OK for r in records)


async def test_a_pooled_connection_reset_unread_is_replaced_once() -> None:
    """The keep-alive race: the replica closed an idle connection just as a request was sent
    on it, and its kernel reset the connection since nothing read the request. That request
    is sent again on a new connection to the same replica, once."""

    async def answer(
        _c: int, on_connection: int, _head: bytes, writer: asyncio.StreamWriter
    ) -> bool:
        if on_connection == 2:
            reset(writer)  # the second request on a connection: reset, not answered
            return False
        writer.write(sse_response())
        return True

    upstream = RawUpstream(answer)
    async with upstream as url, proxy_to([url], engine_scrape_interval="0") as p:
        assert (await post_stream(p.url, "first"))[0] == 200
        status, body = await post_stream(p.url, "second")
        records = await settle(p.server, p.records, 2)
    assert status == 200 and b"data: [DONE]" in body
    assert all(r.outcome is Outcome.OK for r in records)
    assert (upstream.connections, upstream.requests) == (2, 3)


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a reset (RST), as a kernel does for a socket closed with unread data."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@pytest.mark.parametrize("pooled", [False, True])
async def test_a_request_the_replica_took_and_dropped_is_never_sent_twice(pooled: bool) -> None:
    """A replica that read the request and closed the connection without answering may be
    generating: the request is not retried on another replica (nor on this one), and the
    client's 502 says what happened. Counting what each replica received proves it."""

    async def drop(_c: int, on_connection: int, _head: bytes, writer: asyncio.StreamWriter) -> bool:
        if pooled and on_connection == 1:
            writer.write(sse_response())
            return True
        return False  # read the request, then an orderly close

    async def answer(_c: int, _n: int, _head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(sse_response())
        return True

    dropping, healthy = RawUpstream(drop), RawUpstream(answer)
    async with (
        dropping as first,
        healthy as second,
        proxy_to([second, first], engine_scrape_interval="0", route_policy="round_robin") as p,
    ):
        # Round robin's first turn is the second replica listed: `first`, the dropping one.
        if pooled:
            assert (await post_stream(p.url, "warm"))[0] == 200  # to `first`
            assert (await post_stream(p.url, "other"))[0] == 200  # ... then to `second`
        status, body = await post_stream(p.url, "dropped")
        records = await settle(p.server, p.records, 3 if pooled else 1)
    assert status == 502
    message = json.loads(body.split(b"\r\n\r\n", 1)[1])["error"]["message"]
    assert "closed the connection after the request was sent" in message
    assert "not retried" in message
    (record,) = [r for r in records if r.request_id == "dropped"]
    assert record.outcome is Outcome.UPSTREAM_ERROR
    assert record.error_type == "upstream_closed_before_response"
    assert dropping.requests == (2 if pooled else 1)  # received once
    assert healthy.requests == (1 if pooled else 0)  # never sent the dropped one
    assert all(r.healthy for r in p.server.proxy.router.replicas)


async def test_interim_responses_are_skipped() -> None:
    async def answer(_c: int, _n: int, _head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" + sse_response())
        return True

    async with RawUpstream(answer) as url, proxy_to([url], engine_scrape_interval="0") as p:
        status, body = await post_stream(p.url, "hints")
        (record,) = await settle(p.server, p.records, 1)
    assert status == 200 and body.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert record.outcome is Outcome.OK and record.n_out == 1


async def test_a_body_ended_by_the_connection_close_is_complete() -> None:
    async def answer(_c: int, _n: int, _head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + SSE)
        return False

    async with RawUpstream(answer) as url, proxy_to([url], engine_scrape_interval="0") as p:
        status, _ = await post_stream(p.url, "eof")
        (record,) = await settle(p.server, p.records, 1)
    assert status == 200 and record.outcome is Outcome.OK and record.n_out == 1


async def test_head_requests_pass_through_without_waiting_for_a_body() -> None:
    async def answer(_c: int, _n: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        assert head.startswith(b"HEAD /v1/models ")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 1234\r\n\r\n")
        return True

    async with (
        RawUpstream(answer) as url,
        proxy_to([url], idle_timeout="2s", engine_scrape_interval="0") as p,
    ):
        host, port = p.url.split("://")[1].rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        # Two on one connection: the first answer declares the GET's length and carries no
        # body, so the second answer is read where it starts.
        writer.write(b"HEAD /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.write(b"HEAD /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        rest = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        records = await settle(p.server, p.records, 2)
    assert first.startswith(b"HTTP/1.1 200 ") and b"Content-Length: 1234" in first
    assert rest.startswith(b"HTTP/1.1 200 ") and rest.endswith(b"\r\n\r\n")
    assert all(r.outcome is Outcome.OK for r in records)


async def test_an_idle_pooled_connection_expires_and_one_taken_again_is_kept() -> None:
    """A connection back in the pool is closed after ``keepalive_s`` without a request (its
    alarm, `timeouts.Alarms`); one taken again before then is not closed by the alarm of its
    earlier idle spell, and expires after its next one."""

    async def answer(_c: int, _n: int, _head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(sse_response())
        return True

    async with RawUpstream(answer) as url:
        port = int(url.rsplit(":", 1)[1])
        pool = UpstreamPool(keepalive_s=0.1, kernel_stamps=False)
        first = await answered_whole(pool, port)
        pool.release(first)
        connection = first.connection
        await asyncio.sleep(0.03)
        second = await pool.exchange("127.0.0.1", port, POOL_HEAD, BODY, connect_timeout=5)
        assert second.reused and second.connection is connection
        await asyncio.sleep(0.25)  # past the first idle spell's expiry, in use: kept
        assert not connection.closed and pool.open_connections == 1
        await second.response()
        assert await second.read_body(1 << 20) == SSE
        pool.release(second)
        await until(lambda: pool.open_connections == 0)  # its second idle spell expired
        assert connection.closed


async def test_a_read_held_for_an_exchange_that_ended_meanwhile_is_refused() -> None:
    """Reads are stamped on arrival and fed after the loop's turn (ArrivalBatch). A read held
    for an exchange whose connection went back to the pool and took a new request before the
    turn's work: bytes after a response, so the connection is dropped, never fed to the new
    exchange's parser (which would read them as the new answer)."""
    from sidecar.proxy.upstream import UpstreamError, UpstreamPool

    async def answer(_c: int, _n: int, _head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(sse_response())
        return True

    async with RawUpstream(answer) as url:
        port = int(url.rsplit(":", 1)[1])
        pool = UpstreamPool(kernel_stamps=False)  # the read-stamped path ArrivalBatch serves
        first = await answered_whole(pool, port)
        pool.release(first)
        connection = first.connection
        arrivals = connection.arrivals
        assert arrivals is not None
        arrivals.add(first, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", 0)  # held
        second = await pool.exchange("127.0.0.1", port, POOL_HEAD, BODY, connect_timeout=5)
        assert second.reused and second.connection is connection
        arrivals.run()  # the turn's work: the held read is not the second exchange's
        with pytest.raises(UpstreamError) as failure:
            await second.response()
        assert failure.value.kind == "disconnected" and failure.value.before_response
        pool.close_exchange(second)


async def test_a_read_held_for_a_connection_aborted_meanwhile_is_dropped() -> None:
    """The client left (or a timeout fired) and the upstream connection was aborted before the
    turn's work reached a read that had arrived for it: nothing more is read from it."""
    from sidecar.proxy.upstream import UpstreamPool

    async def answer(_c: int, _n: int, _head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        return True  # the body never comes

    async with RawUpstream(answer) as url:
        port = int(url.rsplit(":", 1)[1])
        pool = UpstreamPool(kernel_stamps=False)  # the read-stamped path ArrivalBatch serves
        exchange = await pool.exchange("127.0.0.1", port, POOL_HEAD, BODY, connect_timeout=5)
        await exchange.response()
        fed: list[bytes] = []
        exchange.stream_body(lambda data, _at: fed.append(data))
        arrivals = exchange.connection.arrivals
        assert arrivals is not None
        chunk = b"%x\r\n%s\r\n" % (len(SSE), SSE)
        arrivals.add(exchange, chunk, 0)  # arrived, not yet worked on
        exchange.connection.abort()  # then the relay let the connection go
        arrivals.run()
        assert fed == []
        pool.close_exchange(exchange)


# -- one whole chunk taken without llhttp (`UpstreamExchange.feed`, `_tokenscan.chunk_payload`)


class _ChunkEvents:
    """An httptools protocol that writes down what llhttp hands over of a chunked body."""

    def __init__(self) -> None:
        self.events: list[object] = []

    def on_chunk_header(self) -> None:
        self.events.append("header")

    def on_body(self, body: bytes) -> None:
        self.events.append(body)

    def on_chunk_complete(self) -> None:
        self.events.append("complete")

    def on_message_complete(self) -> None:
        self.events.append("end")


def llhttp_events(read: bytes) -> list[object] | None:
    """What llhttp makes of ``read`` arriving between two chunks of a chunked body (None: it
    refused the bytes)."""
    import httptools

    recorder = _ChunkEvents()
    parser = httptools.HttpResponseParser(recorder)
    parser.feed_data(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    try:
        parser.feed_data(read)
    except httptools.HttpParserError:
        return None
    return recorder.events


def native_chunk_payload() -> Callable[[bytes], bytes | None]:
    module = require_module("sidecar.protocol._tokenscan", "-e . (with a C compiler: gcc)")
    payload: Callable[[bytes], bytes | None] = module.chunk_payload
    return payload


def as_chunk(payload: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(payload), payload)  # how uvicorn (h11) frames a write


CHUNKS = [as_chunk(SSE), as_chunk(b"x"), as_chunk(b"data: [DONE]\n\n"), as_chunk(b"\r\n" * 40)]
CHUNKS += [as_chunk(bytes(range(256)) * 300)]  # a size with letters in it, 0x12c00


def test_a_whole_chunk_is_read_in_c_exactly_as_llhttp_reads_it() -> None:
    chunk_payload = native_chunk_payload()
    for read in CHUNKS:
        payload = chunk_payload(read)
        assert payload is not None and read == as_chunk(payload)
        assert llhttp_events(read) == ["header", payload, "complete"]
    upper = b"A\r\n0123456789\r\n"
    assert chunk_payload(upper) == b"0123456789" and llhttp_events(upper) is not None


def test_anything_but_one_whole_plain_chunk_is_left_to_llhttp() -> None:
    chunk_payload = native_chunk_payload()
    for read in (
        b"",
        b"0\r\n\r\n",  # the last chunk
        b"05\r\nhello\r\n",  # leading zero
        b"5;name=value\r\nhello\r\n",  # an extension
        b"5 \r\nhello\r\n",
        b"5\r\nhello\r\n5\r\nhello\r\n",  # two chunks
        b"5\r\nhello\r\n0\r\n\r\n",  # with the end of the body
        b"5\r\nhell",  # cut short
        b"5\r\nhelloX\r\n",
        b"5\nhello\r\n",
        b"123456789\r\n",  # more than 8 digits
    ):
        assert chunk_payload(read) is None, read
    with pytest.raises(TypeError):
        chunk_payload(bytearray(CHUNKS[0]))  # type: ignore[arg-type]


def test_a_chunk_cut_or_with_a_byte_out_of_place_is_never_read_otherwise_than_by_llhttp() -> None:
    chunk_payload = native_chunk_payload()
    for chunk in (CHUNKS[1], as_chunk(b"hello"), CHUNKS[2]):
        variants = [chunk[:i] for i in range(len(chunk))] + [chunk[i:] for i in range(len(chunk))]
        for position in range(len(chunk)):
            for byte in b"0aF\r\n; x\x00":
                variants.append(chunk[:position] + bytes([byte]) + chunk[position + 1 :])
                variants.append(chunk[:position] + bytes([byte]) + chunk[position:])
                variants.append(chunk[:position] + chunk[position + 1 :])
        for read in variants:
            payload = chunk_payload(read)
            if payload is not None:
                assert llhttp_events(read) == ["header", payload, "complete"], read


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40), st.binary(max_size=40), st.integers(0, len(CHUNKS) - 2))
def test_junk_spliced_into_a_chunk_never_makes_the_two_disagree(
    head: bytes, tail: bytes, which: int
) -> None:
    chunk = CHUNKS[which]
    cut = len(head) % len(chunk)
    for read in (head + chunk, chunk + tail, chunk[:cut] + head + chunk[cut:], head, tail):
        payload = native_chunk_payload()(read)
        if payload is not None:
            assert llhttp_events(read) == ["header", payload, "complete"]


class _CountingParser:
    """The exchange's httptools parser, counting the reads it is fed."""

    def __init__(self, parser: object) -> None:
        self.parser = parser
        self.fed = 0

    def feed_data(self, data: bytes) -> None:
        self.fed += 1
        self.parser.feed_data(data)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.parser, name)


@contextlib.asynccontextmanager
async def exchange_answered(
    transfer_encoding: bytes, head: bytes | None = None
) -> AsyncIterator[UpstreamExchange]:
    """An exchange with a raw upstream whose answer is only a 200 head with this
    Transfer-Encoding (or this whole ``head``): the body is the test's to feed, read by read
    (`UpstreamExchange.feed`, what the transports call). Needs the C check (fails in CI
    without it)."""
    native_chunk_payload()
    answer_head = head or b"HTTP/1.1 200 OK\r\nTransfer-Encoding: %b\r\n\r\n" % transfer_encoding

    async def answer(_c: int, _n: int, _head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(answer_head)
        return True

    async with RawUpstream(answer) as url:
        port = int(url.rsplit(":", 1)[1])
        pool = UpstreamPool(kernel_stamps=False)
        exchange = await pool.exchange("127.0.0.1", port, POOL_HEAD, BODY, connect_timeout=5)
        await exchange.response()
        try:
            yield exchange
        finally:
            pool.close_exchange(exchange)


async def test_only_a_whole_chunk_read_between_chunks_skips_llhttp() -> None:
    """llhttp's own callbacks say when it is between chunks (and a head that says plainly
    `Transfer-Encoding: chunked` before the first). A read that looks like a whole chunk but
    is the middle of a larger one is body, and goes to llhttp."""
    async with exchange_answered(b"chunked") as exchange:
        counting = _CountingParser(exchange._parser)
        exchange._parser = counting  # type: ignore[assignment]
        fed: list[bytes] = []
        done = exchange.stream_body(lambda data, _at: fed.append(data))
        steps = [
            (b"5\r\nhello\r\n", b"hello", 0),  # the first chunk, after a plain head
            (b"3\r\nabc\r\n", b"abc", 0),  # whole, between chunks: not fed to llhttp
            (b"10\r\n", None, 1),  # a 16-byte chunk begins
            (b"5\r\nhello\r\n", b"5\r\nhello\r\n", 2),  # its first 10 bytes, whatever they say
            (b"abcdef\r\n", b"abcdef", 3),  # its end
            (b"3\r\nxyz\r\n", b"xyz", 3),  # whole, between chunks again
            (b"0\r\n\r\n", None, 4),
        ]
        for read, handed, parser_reads in steps:
            before = len(fed)
            exchange.feed(read, 0)
            assert fed[before:] == ([] if handed is None else [handed])
            assert counting.fed == parser_reads
        await asyncio.wait_for(done, 5)
        assert b"".join(fed) == b"helloabc5\r\nhello\r\nabcdefxyz"


# Heads whose first body chunk may skip llhttp (True) or must not: the head says plainly, once,
# that the body is chunked, or it says something else, or two things, or has no body.
HEADS = [
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", True),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: Chunked\r\nX-A: b\r\n\r\n", True),
    (b"HTTP/1.1 500 Oops\r\nTransfer-Encoding: chunked\r\n\r\n", True),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n", False),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", False),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n", False),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: gzip\r\n\r\n", False),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n", False),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\n\r\n", False),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n", False),
    (b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\n\r\n", False),
    (b"HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n", False),
    (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", True),
]


@pytest.mark.parametrize("head,skips", HEADS, ids=range(len(HEADS)))
async def test_the_first_chunk_skips_llhttp_only_after_a_plain_chunked_head(
    head: bytes, skips: bool
) -> None:
    """The body's first chunk bypasses llhttp only where the head leaves no doubt, and the
    body handed over is then llhttp's own reading of the same bytes, read by read."""
    import httptools

    reads = [b"5\r\nhello\r\n", b"3\r\nabc\r\n", b"0\r\n\r\n"]
    recorder = _ChunkEvents()
    reference = httptools.HttpResponseParser(recorder)
    reference.feed_data(head)
    expected: list[bytes] = []
    for read in reads:
        before = len(recorder.events)
        try:
            reference.feed_data(read)
        except httptools.HttpParserError:
            break
        body = b"".join(e for e in recorder.events[before:] if isinstance(e, bytes))
        if body:
            expected.append(body)
    async with exchange_answered(b"", head) as exchange:
        counting = _CountingParser(exchange._parser)
        exchange._parser = counting  # type: ignore[assignment]
        fed: list[bytes] = []
        exchange.stream_body(lambda data, _at: fed.append(data))
        first_skipped = False  # 204 and 304 end with their head: nothing is fed after it
        for i, read in enumerate(reads):
            if exchange.complete or exchange.failed:
                break
            exchange.feed(read, 0)
            first_skipped = first_skipped or (i == 0 and counting.fed == 0)
        assert first_skipped is skips
        assert fed == expected


async def test_a_body_whose_transfer_coding_does_not_end_in_chunked_stays_raw() -> None:
    """`Transfer-Encoding: chunked, gzip`: for a response, llhttp reads such a body to the
    connection's end, unframed (RFC 9112 6.3). The headers name "chunked", but only llhttp's
    own callbacks open the whole-chunk path, so bytes that look like chunks pass raw; and the
    connection's end is the body's end, not a response cut short."""
    async with exchange_answered(b"chunked, gzip") as exchange:
        fed: list[bytes] = []
        done = exchange.stream_body(lambda data, _at: fed.append(data))
        for read in (b"5\r\nhello\r\n", b"3\r\nabc\r\n", b"0\r\n\r\n"):
            exchange.feed(read, 0)
        assert fed == [b"5\r\nhello\r\n", b"3\r\nabc\r\n", b"0\r\n\r\n"]
        assert not exchange.complete
        exchange.connection_lost(None)  # the upstream closed: that was the body's end
        await asyncio.wait_for(done, 5)
        assert exchange.complete and not exchange.failed


async def test_after_a_malformed_chunk_no_later_read_reaches_the_relay() -> None:
    """A read whose second chunk is malformed fails the exchange although llhttp had just
    said "between chunks" after its first; a whole chunk arriving after that (a read held for
    the same turn) is llhttp's to refuse, not the relay's to take."""
    async with exchange_answered(b"chunked") as exchange:
        fed: list[bytes] = []
        done = exchange.stream_body(lambda data, _at: fed.append(data))
        exchange.feed(b"5\r\nhello\r\nzz\r\n", 0)  # a chunk, then a size that is no number
        assert exchange.failed and fed == []  # a read that failed hands nothing over
        exchange.feed(b"3\r\nabc\r\n", 0)  # looks whole, and llhttp was between chunks
        assert fed == []
        with pytest.raises(UpstreamError):
            await done


@pytest.mark.parametrize(
    "request_head",
    [
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Request-Id: leaver\r\n\r\n",
        (
            f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"X-Request-Id: leaver\r\nContent-Length: {len(BODY)}\r\n\r\n"
        ).encode()
        + BODY,
    ],
    ids=["pass-through", "generation"],
)
async def test_a_client_gone_before_the_upstream_answered_is_one_cancelled_record(
    request_head: bytes,
) -> None:
    """The client leaves while the replica holds back its answer's head: the request ends in
    one client_cancelled record, the upstream connection is closed (the replica sees the
    disconnect) and the replica's outstanding count is back to zero: a request on any path,
    the relayed ones (/v1/models) as the generation ones."""
    answered = asyncio.Event()

    async def hold(_c: int, _n: int, _head: bytes, _writer: asyncio.StreamWriter) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(answered.wait(), 30)
        return False

    upstream = RawUpstream(hold)
    async with upstream as url, proxy_to([url], engine_scrape_interval="0") as p:
        host, port = p.url.split("://")[1].rsplit(":", 1)
        _reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(request_head)
        await until(lambda: upstream.requests == 1, what="the request upstream")
        writer.close()
        (record,) = await settle(p.server, p.records, 1)
        await until(lambda: p.server.proxy.pool.open_connections == 0, what="upstream closed")
        answered.set()
    assert record.request_id == "leaver"
    assert (record.outcome, record.error_type) == (Outcome.CLIENT_CANCELLED, "client_disconnected")
