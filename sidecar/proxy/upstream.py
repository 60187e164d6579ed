"""The proxy's HTTP/1.1 client to the replicas: asyncio Protocols, httptools framing, a keep-alive
pool, and a body delivered by callback.

Why not aiohttp's client here: its body arrives through a StreamReader, so every upstream read
wakes the handler's task and goes through a coroutine per chunk. Here the body of a streamed
response is handed to a callback from ``data_received`` itself, stamped once per read, so that
the relay can parse, measure and write to the client in that same callback: no task switch per
chunk. A plain-TCP connection reads through `rxstamp.StampedTransport`, so each read's instant
is the kernel's receive timestamp (`data_received_at`); a TLS one through uvloop's transport,
stamped when read (`data_received`, batched per loop turn by `ArrivalBatch`). HTTP framing
(status line, headers, chunked decoding, content length) is llhttp's, through httptools, never
hand-written; de-chunked pieces of one read are delivered joined, as one read.

An `UpstreamExchange` is one request on one connection. The caller awaits its response head,
then either `read_body` (whole bodies) or `stream_body` (a callback per read, completion as a
future). `release` returns a connection that finished its response cleanly to the pool;
`close` drops it (the upstream sees the disconnect: vLLM aborts the request).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Callable
from typing import Final, cast

import httptools

from sidecar import clock
from sidecar.proxy import rxstamp
from sidecar.proxy.headers import first_value
from sidecar.proxy.timeouts import Alarm, alarms_of

# The clock as a C static in compiled code (`clock.monotonic_ns` is a lookup of the module
# global and then of its attribute, at every reading).
_monotonic_ns: Final = clock.monotonic_ns

BodySink = Callable[[bytes, int], None]

# An idle pooled connection is closed after this. vLLM's API server (uvicorn) closes idle
# keep-alive connections after 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE): closing ours first keeps
# the race where both sides act at once (a request sent on a connection the server is closing)
# out of the way of ordinary gaps in traffic.
_KEEPALIVE_S: Final = 4.0


# One whole HTTP chunk recognised in C (`feed`); where the package was built without its C
# extensions, every read goes through httptools.
_chunk_payload: Callable[[bytes], bytes | None] | None
try:
    from sidecar.protocol._tokenscan import chunk_payload as _chunk_payload
except ImportError:  # built without a C compiler: correct, slower
    _chunk_payload = None


class UpstreamError(Exception):
    """The exchange failed at the connection level. ``kind``: connect_refused, connect_timeout,
    tls_certificate (the upstream's certificate did not verify), tls_handshake (no connection:
    the request never left), disconnected (the connection closed before or
    during the answer), protocol_error (the answer was not valid HTTP/1.1), too_large (a body
    over the caller's limit). ``before_response``: no byte of the answer's head had arrived.
    ``reset``: the connection ended with a reset (RST), not an orderly close: what a server's
    kernel answers when the server closed its socket without reading what we sent."""

    def __init__(
        self, message: str, *, kind: str, before_response: bool, reset: bool = False
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.before_response = before_response
        self.reset = reset


class ArrivalBatch:
    """(Connections without kernel receive stamps: TLS, ``--server-stamps read``.)
    Upstream reads stamped when they arrive, handed to their exchanges once every socket that
    was ready in this turn of the loop has been read and stamped.

    Why: the loop reads the ready sockets one after another, and a read's stamp is the server
    vantage's instant of its tokens. Handled in its own callback, each read waits for all the
    work on the reads before it (parse, count, write to the client: ~50 µs of CPU per event at
    128 streams), so when vLLM ends an engine step and many streams get a token at once, the
    last ones were stamped milliseconds late (benchmarks/proxy_accuracy.py: p90 1.6-1.7 ms at
    128 streams). Stamped in the callback and worked on after the turn's reads, each waits only
    for the reads before it (a recv each): p90 1.0-1.1 ms (benchmarks/RESULTS.md).
    Both asyncio's loop and uvloop run the I/O callbacks of one poll before any callback
    scheduled by them (`call_soon`), so one scheduled `run` per turn sees the turn's reads, in
    the order they were read. The cost: a tuple and an append per read, a `call_soon` per turn.
    """

    __slots__ = ("loop", "_reads", "_scheduled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._reads: list[tuple[UpstreamExchange, bytes, int]] = []
        self._scheduled = False

    def add(self, exchange: UpstreamExchange, data: bytes, at_ns: int) -> None:
        self._reads.append((exchange, data, at_ns))
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self.run)

    def run(self) -> None:
        reads, self._reads = self._reads, []
        self._scheduled = False
        for exchange, data, at_ns in reads:
            connection = exchange.connection
            if connection.aborted:
                continue  # aborted meanwhile (the client left, a timeout): nothing more is read
            # A connection the upstream closed after this read still owes it to its exchange:
            # an answer ended by the close (`Connection: close`), or a TLS upstream whose
            # close_notify came in the same read as its last bytes (uvloop then calls
            # eof_received, and the transport is closing, in the callback that read them).
            if connection.exchange is exchange:
                exchange.feed(data, at_ns)
            elif connection.exchange is not None:
                # The read belonged to an exchange that ended before its turn came (the
                # connection went back to the pool and took a new request meanwhile): bytes
                # after a response, as `UpstreamExchange.feed` would have refused them.
                connection.abort()

    def flush(self, connection: UpstreamConnection) -> None:
        """Hand ``connection``'s waiting reads to its exchange now: the connection is ending,
        and what it read comes before its end."""
        reads = self._reads
        if not any(read[0].connection is connection for read in reads):
            return
        self._reads = [read for read in reads if read[0].connection is not connection]
        for exchange, data, at_ns in reads:
            if exchange.connection is connection and connection.exchange is exchange:
                exchange.feed(data, at_ns)


class UpstreamConnection(asyncio.Protocol):
    """One TCP connection to one replica; one exchange at a time."""

    __slots__ = (
        "loop",
        "key",
        "transport",
        "exchange",
        "reusable",
        "arrivals",
        "alarms",
        "_idle_alarm",
        "_on_expire",
        "_closed",
        "_write_ready",
        "aborted",
    )

    def __init__(self, key: tuple[str, int, bool], arrivals: ArrivalBatch) -> None:
        # Made on the loop (UpstreamPool._connect). Kept: each get_running_loop() is a getpid()
        # syscall on CPython 3.11, and a pooled connection serves many requests.
        self.loop = asyncio.get_running_loop()
        self.alarms = alarms_of(self.loop)
        self.arrivals = arrivals
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.exchange: UpstreamExchange | None = None
        self.reusable = False
        # Parked in the pool: the alarm that expires it, and what it calls then.
        self._idle_alarm: Alarm | None = None
        self._on_expire: Callable[[UpstreamConnection], None] | None = None
        self._closed = False
        self._write_ready: asyncio.Future[None] | None = None
        self.aborted = False  # by the proxy (`abort`): whatever it still reads is not wanted

    # -- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None:
            # Bytes nobody asked for (a pooled connection): the connection cannot be trusted.
            self.abort()
            return
        self.arrivals.add(exchange, data, _monotonic_ns())

    def data_received_at(self, data: bytes, at_ns: int) -> None:
        """A read from `rxstamp.StampedTransport`, stamped by the kernel when it arrived:
        worked on at once, as the stamp no longer depends on when the loop gets to it."""
        exchange = self.exchange
        if exchange is None:
            self.abort()
            return
        exchange.feed(data, at_ns)

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.aborted and self.exchange is not None:
            self.arrivals.flush(self)  # its last reads, should the end come before their turn
        self._closed = True
        self.reusable = False
        self.unpark()
        if self._write_ready is not None and not self._write_ready.done():
            self._write_ready.set_exception(ConnectionResetError("upstream connection lost"))
        exchange, self.exchange = self.exchange, None
        if exchange is not None:
            exchange.connection_lost(exc)
        # The transport holds this protocol, and we hold it: let go, as asyncio's transports
        # let go of their protocol, so that a closed connection is freed by its reference count.
        self.transport = None

    def pause_writing(self) -> None:
        self._write_ready = self.loop.create_future()

    def resume_writing(self) -> None:
        ready, self._write_ready = self._write_ready, None
        if ready is not None and not ready.done():
            ready.set_result(None)

    # -- used by the pool and the exchange ------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed or self.transport is None or self.transport.is_closing()

    async def drain(self) -> None:
        if self._write_ready is not None:
            await self._write_ready

    def abort(self) -> None:
        self.reusable = False
        self.aborted = True
        if self.transport is not None:
            self.transport.abort()

    def park(self, idle_s: float, on_expire: Callable[[UpstreamConnection], None]) -> None:
        self.exchange = None
        now = _monotonic_ns()
        self._on_expire = on_expire
        self._idle_alarm = self.alarms.add(now + int(idle_s * 1e9), now, self._expire)

    def unpark(self) -> None:
        self._on_expire = None
        alarm = self._idle_alarm
        if alarm is not None:
            self.alarms.cancel(alarm)
            self._idle_alarm = None

    def _expire(self) -> None:
        on_expire = self._on_expire
        self._idle_alarm = self._on_expire = None
        if on_expire is not None:
            on_expire(self)


class UpstreamExchange:
    """One request and its response on one connection (the httptools parser's callbacks)."""

    __slots__ = (
        "connection",
        "head_method",
        "status",
        "reason",
        "raw_headers",
        "_parser",
        "_head",
        "_done",
        "_pending",
        "_parts",
        "_sink",
        "complete",
        "_eof_body",
        "_error",
        "paused",
        "_header_bytes",
        "max_header_bytes",
        "_interim",
        "_keep_alive",
        "reused",
        "_between_chunks",
    )

    def __init__(
        self, connection: UpstreamConnection, head_method: bool, max_header_bytes: int = 256 * 1024
    ) -> None:
        self.connection = connection
        self.head_method = head_method
        self.status = 0
        self.reason = ""
        # The response's header pairs as llhttp gave them (the final response's, once its
        # head is complete): looked up by `header`, filtered into the client's head as bytes
        # (`headers.response_header_block`), never made into a multidict.
        self.raw_headers: list[tuple[bytes, bytes]] = []
        # The parser holds bound methods of this exchange (a cycle), and the sink is usually a
        # bound method of an object that holds the exchange (another): `detach` breaks both
        # when the pool takes the exchange back, so that it is freed by its reference count.
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        loop = connection.loop
        self._head: asyncio.Future[None] = loop.create_future()
        self._done: asyncio.Future[None] = loop.create_future()
        # Body reads not yet taken by a sink; None while there are none (the common case: a
        # list per stream in flight for nothing).
        self._pending: list[tuple[bytes, int]] | None = None
        self._parts: list[bytes] = []  # de-chunked pieces of the read being parsed
        self._sink: BodySink | None = None
        self.complete = False
        self._eof_body = False  # body delimited by the connection's end (no length, no chunks)
        self._error: UpstreamError | None = None
        self.paused = False
        self._header_bytes = 0
        self.max_header_bytes = max_header_bytes
        self._interim = False
        self._keep_alive = False
        self.reused = False  # sent on a pooled connection (which the server may have closed)
        # llhttp is between two chunks of a chunked body: a read that is exactly one whole
        # chunk may then skip it (`feed`). llhttp's own on_chunk_complete says so, and the head
        # only where it cannot be read two ways (`on_headers_complete`): with
        # `Transfer-Encoding: chunked, gzip` a response's body is not chunked at all (it runs
        # to the connection's end), and its bytes must stay raw.
        self._between_chunks = False

    # -- httptools callbacks --------------------------------------------------------------

    def on_status(self, status: bytes) -> None:
        self.reason = status.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > self.max_header_bytes:
            raise UpstreamError(
                "the upstream's response headers are too large",
                kind="protocol_error",
                before_response=True,
            )
        if not self._head.done():  # not a chunked body's trailer: the client never sees those
            self.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self._parser
        assert parser is not None  # callbacks run inside `feed`
        status = parser.get_status_code()
        if 100 <= status < 200:
            # An interim response (100 Continue, 103 Early Hints): the final one follows.
            self._interim = True
            self.raw_headers = []
            return
        self.status = status
        chunked = False
        has_length = False
        codings = 0
        for name, value in self.raw_headers:
            lower = name.lower()
            if lower == b"content-length":
                has_length = True
            elif lower == b"transfer-encoding":
                # The final coding decides, as llhttp reads it (RFC 9112 6.3): a response with
                # `chunked, gzip` has no chunked body; it runs to the connection's end.
                chunked = value.rsplit(b",", 1)[-1].strip().lower() == b"chunked"
                codings += 1 if value.lower() == b"chunked" else 2
        no_body = self.head_method or self.status in (204, 304)
        self._eof_body = not (has_length or chunked or no_body)
        # A head that says plainly, once, that the body is chunked (`Transfer-Encoding:
        # chunked`, as uvicorn writes it, without a Content-Length) leaves llhttp where it is
        # between two chunks: the body's first chunk may skip it too (`feed`, the C lane).
        # Any other head (two codings, a coding after `chunked`, a length beside it, no body)
        # keeps llhttp on the first chunk, which then says so itself (`on_chunk_complete`).
        self._between_chunks = codings == 1 and not has_length and not no_body
        if not self._head.done():
            self._head.set_result(None)
        if self.head_method:
            # llhttp cannot be told the request was HEAD: the message ends here.
            self._finish()

    def on_body(self, body: bytes) -> None:
        self._parts.append(body)

    def on_chunk_header(self) -> None:
        self._between_chunks = False

    def on_chunk_complete(self) -> None:
        self._between_chunks = True

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        # Asked here: once the callback returns, llhttp has reset for the next message and
        # says "no" whatever the response's headers said.
        parser = self._parser
        assert parser is not None
        self._keep_alive = parser.should_keep_alive()
        self._finish()

    # -- fed by the connection ------------------------------------------------------------

    def feed(self, data: bytes, now_ns: int) -> None:
        parser = self._parser
        if self.complete or parser is None:
            # Bytes after the response, or for an exchange the pool took back (a read of the
            # same turn, `ArrivalBatch`): not a connection to reuse.
            self.connection.abort()
            return
        body: bytes | None = None
        if self._between_chunks and _chunk_payload is not None:
            # The read that makes up almost every read of a stream: one whole chunk, arriving
            # while llhttp is between chunks. Fed to it, it would hand over exactly this payload
            # and end where it began (`_tokenscan.chunk_payload` says why): taken here without
            # its three callbacks into Python.
            body = _chunk_payload(data)
        if body is None:
            try:
                parser.feed_data(data)
            except UpstreamError as exc:
                self._fail(exc)
                return
            except httptools.HttpParserError as malformed:
                self._fail(
                    UpstreamError(
                        f"the upstream sent a malformed HTTP response ({malformed})",
                        kind="protocol_error",
                        before_response=not self._head.done(),
                    )
                )
                return
            parts = self._parts
            if parts:
                body = parts[0] if len(parts) == 1 else b"".join(parts)
                parts.clear()
        if body is not None:
            sink = self._sink
            if sink is not None and not self._pending and not self.paused:
                sink(body, now_ns)  # `_deliver`'s common case, inlined: this is per read
            else:
                self._deliver(body, now_ns)
        if self.complete:
            self._end()

    def _deliver(self, body: bytes, now_ns: int) -> None:
        sink = self._sink
        # Paused: a read of the same turn that came before the pause took effect (ArrivalBatch)
        # waits for `resume` like one that came before the sink.
        if sink is None or self._pending or self.paused:
            if self._pending is None:
                self._pending = [(body, now_ns)]
            else:
                self._pending.append((body, now_ns))
        else:
            sink(body, now_ns)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.complete:
            return
        if self._eof_body and self._head.done():
            self.complete = True  # the connection's end was the body's end
            self._end()
            return
        before = not self._head.done()
        detail = f": {exc}" if exc else ""
        self._fail(
            UpstreamError(
                (
                    "the upstream closed the connection before answering"
                    if before
                    else "the upstream closed the connection mid-response"
                )
                + detail,
                kind="disconnected",
                before_response=before,
                reset=isinstance(exc, ConnectionResetError),
            )
        )

    def end_in_lane(self) -> None:
        """The body's last chunk (``0`` and no trailer) was taken by the stream's C lane with
        the last events (stream_relay.MeteredRead.end_in_lane): llhttp never saw it. The
        message is complete, and the connection kept alive as llhttp would have said at its
        end (its flags, from the head, do not change within a chunked body)."""
        parser = self._parser
        self._keep_alive = parser is not None and parser.should_keep_alive()
        self._between_chunks = False
        self.complete = True
        self._end()

    def _finish(self) -> None:
        self.complete = True

    def _end(self) -> None:
        conn = self.connection
        conn.reusable = not self._eof_body and self._keep_alive and not conn.closed
        if self._sink is not None and not self._pending and not self._done.done():
            self._done.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        # Closed first, whatever else: a read still on its way (`ArrivalBatch`) goes to llhttp,
        # which refuses it again, never around it to the sink.
        self._between_chunks = False
        if self._error is not None:
            return
        self._error = error
        self.connection.abort()
        if not self._head.done():
            self._head.set_exception(error)
        if not self._done.done():
            self._done.set_exception(error)
            self._done.exception()  # retrieved: a failure nobody awaits is not a warning

    # -- the caller's side ----------------------------------------------------------------

    async def response(self) -> None:
        """Wait for the response head (status and headers)."""
        await self._head

    @property
    def between_whole_chunks(self) -> bool:
        """The body is chunked, llhttp is between two chunks, and a read now goes straight to
        the sink: a whole chunk read now may bypass the parser (`feed`; the C lane)."""
        return (
            self._between_chunks
            and not self.complete
            and not self.paused
            and not self._pending
            and self._sink is not None
        )

    @property
    def last_read(self) -> bool:
        """True inside the sink's call for the body's last read: the body ended, and no read
        that arrived earlier is still waiting to be handed over (`stream_body`)."""
        return self.complete and not self._pending

    def header(self, name: bytes) -> str | None:
        """The response's first ``name`` header (``name`` lower-case), as text; None if none."""
        value = first_value(self.raw_headers, name)
        return None if value is None else value.decode("latin-1")

    @property
    def content_length(self) -> int | None:
        value = self.header(b"content-length")
        if value is None or not value.isdigit():
            return None
        return int(value)

    def stream_body(self, sink: BodySink) -> asyncio.Future[None]:
        """Hand every body read to ``sink(data, arrival_ns)`` as it comes, from the
        connection's callback; the future ends with the body (or fails with `UpstreamError`).
        Reads that arrived before this call are handed over first, in order."""
        self._sink = sink
        while self._pending and not self.paused:
            body, at = self._pending.pop(0)
            sink(body, at)
        if self.complete and not self._pending and not self._done.done():
            self._done.set_result(None)
        return self._done

    async def read_body(self, limit: int) -> bytes:
        """The whole body; `UpstreamError` kind ``too_large`` past ``limit`` bytes."""
        parts: list[bytes] = []
        size = 0

        def take(data: bytes, _at: int) -> None:
            nonlocal size
            size += len(data)
            if size > limit:
                self._fail(UpstreamError("body too large", kind="too_large", before_response=False))
                return
            parts.append(data)

        declared = self.content_length
        if declared is not None and declared > limit:
            self._fail(UpstreamError("body too large", kind="too_large", before_response=False))
        await self.stream_body(take)
        return b"".join(parts)

    def pause(self) -> None:
        """Stop reading from the upstream (the client is slow): TCP pushes back."""
        if not self.paused:
            self.paused = True
            transport = self.connection.transport
            if transport is not None and not transport.is_closing():
                transport.pause_reading()

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            sink = self._sink
            while self._pending and sink is not None and not self.paused:
                body, at = self._pending.pop(0)
                sink(body, at)
            if not self.paused:
                transport = self.connection.transport
                if transport is not None and not transport.is_closing():
                    transport.resume_reading()
                if self.complete and not self._pending and not self._done.done():
                    self._done.set_result(None)

    @property
    def failed(self) -> bool:
        return self._error is not None

    def detach(self) -> None:
        """The pool took the exchange back (`UpstreamPool.release`, `close_exchange`): drop
        the parser and the sink, the two reference cycles through this exchange. Every
        in-flight stream's objects would otherwise outlive it as cyclic garbage until a full
        collection, and that collection's pause grows with them (105 ms measured with only
        256 streams in flight: 2,300 finished requests' worth of objects were waiting)."""
        self._parser = None
        self._sink = None
        self._pending = None
        error = self._error
        if error is not None:
            # The failure was raised through the handler's coroutines, whose frames (kept by
            # its traceback) hold this exchange, which holds the failure: a cycle. Handled by
            # the time the pool has the exchange back; its frames are not needed any more.
            error.__traceback__ = None


class UpstreamPool:
    """Keep-alive connections per replica address; a connection is reused only after it
    finished a response cleanly."""

    def __init__(
        self,
        keepalive_s: float = _KEEPALIVE_S,
        max_idle_per_host: int = 1024,
        kernel_stamps: bool = True,
    ) -> None:
        self.keepalive_s = keepalive_s
        self.max_idle_per_host = max_idle_per_host
        self._idle: dict[tuple[str, int, bool], list[UpstreamConnection]] = {}
        self._all: set[UpstreamConnection] = set()
        self._ssl: ssl.SSLContext | None = None
        self._arrivals: ArrivalBatch | None = None  # the loop's, made at the first connection
        self._read_buffer: rxstamp.ReadBuffer | None = None  # likewise, for stamped transports
        self.kernel_stamps = kernel_stamps and rxstamp.SUPPORTED
        if self.kernel_stamps:
            rxstamp.hold_timestamping()

    async def exchange(
        self,
        host: str,
        port: int,
        head: bytes,
        body: bytes,
        *,
        connect_timeout: float | None,
        head_method: bool = False,
        tls: bool = False,
        reuse: bool = True,
    ) -> UpstreamExchange:
        """Send one request (``head`` already serialized) and return its exchange once the
        request is written, on a pooled connection when one is idle (``reuse``), else on a new
        one. `UpstreamExchange.reused` says which."""
        key = (host, port, tls)
        connection = self._take_idle(key) if reuse else None
        reused = connection is not None
        if connection is None:
            connection = await self._connect(key, connect_timeout)
        exchange = UpstreamExchange(connection, head_method)
        exchange.reused = reused
        connection.exchange = exchange
        transport = connection.transport
        assert transport is not None
        if body and len(body) < 65536:
            transport.write(head + body)
        else:
            transport.write(head)
            if body:
                transport.write(body)
        if connection._write_ready is not None:
            await connection.drain()
        return exchange

    def prepare_tls(self) -> None:
        """Make the TLS context now (at start-up) rather than at the first TLS connection:
        reading the system's CA bundle takes ~35-40 ms, and on the event loop every stream
        would wait for it."""
        self._tls_context()

    def _tls_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def _take_idle(self, key: tuple[str, int, bool]) -> UpstreamConnection | None:
        idle = self._idle.get(key)
        while idle:
            connection = idle.pop()
            connection.unpark()
            if not connection.closed:
                return connection
            self._all.discard(connection)
        return None

    async def _connect(
        self, key: tuple[str, int, bool], connect_timeout: float | None
    ) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        if self._arrivals is None or self._arrivals.loop is not loop:
            self._arrivals = ArrivalBatch(loop)
        connection = UpstreamConnection(key, self._arrivals)
        try:
            if key[2]:
                await asyncio.wait_for(
                    loop.create_connection(
                        lambda: connection,
                        key[0],
                        key[1],
                        ssl=self._tls_context(),
                        server_hostname=key[0],
                    ),
                    connect_timeout or None,
                )
            elif self.kernel_stamps:
                if self._read_buffer is None:
                    self._read_buffer = rxstamp.ReadBuffer()
                opened = await asyncio.wait_for(
                    rxstamp.open_stamped(loop, key[0], key[1], connection, self._read_buffer),
                    connect_timeout or None,
                )
                if isinstance(opened, socket.socket):  # the kernel gives no stamps on it
                    await loop.create_connection(lambda: connection, sock=opened)
            else:
                await asyncio.wait_for(
                    loop.create_connection(lambda: connection, key[0], key[1]),
                    connect_timeout or None,
                )
        except asyncio.TimeoutError:
            raise UpstreamError(
                f"timed out connecting to {key[0]}:{key[1]}",
                kind="connect_timeout",
                before_response=True,
            ) from None
        except ssl.SSLError as tls_error:  # an OSError too: told apart, the operator's to fix
            raise UpstreamError(
                f"TLS with {key[0]}:{key[1]} failed: {tls_error.reason or tls_error}",
                kind=(
                    "tls_certificate"
                    if isinstance(tls_error, ssl.SSLCertVerificationError)
                    else "tls_handshake"
                ),
                before_response=True,
            ) from None
        except OSError as exc:
            raise UpstreamError(
                f"could not connect to {key[0]}:{key[1]}: {exc.strerror or exc}",
                kind="connect_refused",
                before_response=True,
            ) from None
        self._all.add(connection)
        return connection

    def release(self, exchange: UpstreamExchange) -> None:
        """The caller is done: pool the connection if its response ended cleanly, else drop
        it (an unfinished response cannot be skipped; closing tells the upstream to abort)."""
        connection = exchange.connection
        if connection.exchange is exchange:
            connection.exchange = None
        exchange.detach()
        if not (
            exchange.complete
            and connection.reusable
            and not connection.closed
            and not exchange.failed
            and not exchange.paused
        ):
            self._drop(connection)
            return
        idle = self._idle.setdefault(connection.key, [])
        if len(idle) >= self.max_idle_per_host:
            self._drop(connection)
            return
        connection.park(self.keepalive_s, self._expire)
        idle.append(connection)

    def close_exchange(self, exchange: UpstreamExchange) -> None:
        """Drop the connection at once (the upstream sees the disconnect)."""
        connection = exchange.connection
        if connection.exchange is exchange:
            connection.exchange = None
        exchange.detach()
        self._drop(connection)

    def _expire(self, connection: UpstreamConnection) -> None:
        idle = self._idle.get(connection.key)
        if idle and connection in idle:
            idle.remove(connection)
        self._drop(connection)

    def _drop(self, connection: UpstreamConnection) -> None:
        self._all.discard(connection)
        connection.unpark()
        transport = connection.transport
        if transport is not None and not transport.is_closing():
            transport.close()

    @property
    def open_connections(self) -> int:
        return len(self._all)

    @property
    def unstamped_reads(self) -> int:
        """Reads of kernel-stamped connections that came without the kernel's stamp (stamped
        when read instead): a few right after start, many where the platform drops them."""
        return self._read_buffer.unstamped_reads if self._read_buffer is not None else 0

    async def close(self) -> None:
        for connection in list(self._all):
            self._drop(connection)
        self._idle.clear()
        # Let the transports' close callbacks run before the loop goes away.
        with contextlib.suppress(Exception):
            await asyncio.sleep(0)


def serialize_request_head(
    method: str, target: str, host_header: str, header_block: bytes, content_length: int
) -> bytes:
    """``method target HTTP/1.1`` with Host, the header lines given (`headers.
    upstream_header_block`) and Content-Length. Header names and values were checked by the
    listener's parser (no CR/LF can be in them)."""
    length = (
        b"Content-Length: %d\r\n" % content_length
        if content_length or method not in ("GET", "HEAD", "DELETE", "OPTIONS")
        else b""
    )
    start = f"{method} {target} HTTP/1.1\r\nHost: {host_header}\r\n".encode("latin-1")
    return b"".join((start, header_block, length, b"\r\n"))
