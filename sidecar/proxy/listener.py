"""The traffic listener: HTTP/1.1 server connections on asyncio Protocols, framed by httptools.

Why not aiohttp's server here: every response write went through two coroutines and the
request-level hooks it offers cannot enforce what a proxy in production traffic must (a deadline
for the request head and for the body, a cap on connections, a record for every request,
malformed ones included). This module owns the client's connection and nothing else: it parses
requests (llhttp, strict: no lenient flags, so the request-smuggling framings are refused), reads
the body (bounded in size and time), hands each complete request to the handler as a task, and
gives the handler a synchronous `ClientExchange.write` that frames the body (chunked, or by the
declared length) straight onto the transport.

Connection hygiene, each with a setting (config.py): the request head must arrive within
``header_timeout`` of its first byte (or of the connection's start), the body within
``body_timeout`` after the head; an idle keep-alive connection closes after
``keepalive_timeout``; at most ``max_connections`` client connections (the next one is answered
503 and closed); at most ``max_header_count`` headers and ``max_header_bytes`` of them (431).
A malformed request gets a 400 and is logged in one line that names the cause, never a header
value. Each of these ends in a `Rejection` handed to ``on_rejected``, which records it.

One request at a time per connection: a pipelined next request waits (parsed, reading paused)
until the response to the current one is complete. Otherwise the connection keeps reading while
its request is handled: a client that closes is seen at once and its handler cancelled (the
upstream request is then closed, and vLLM aborts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Final, cast

import httptools

from sidecar import clock
from sidecar.proxy.headers import NO_HEADERS, HeaderLookup, RequestHeaders
from sidecar.proxy.timeouts import Deadline, alarms_of

# The clock as a C static in compiled code (`clock.monotonic_ns` is a lookup of the module
# global and then of its attribute, at every reading).
_monotonic_ns: Final = clock.monotonic_ns

log = logging.getLogger("sidecar.proxy")

_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
_LAST_CHUNK: Final = b"0\r\n\r\n"
_TASK_NAME: Final = "sidecar-request"  # each request's handler task
# The transport's buffer to the client above which the relay stops reading its upstream, and
# below which it reads again (aiohttp's figures: memory per slow client stays ~64 KiB + a read).
WRITE_HIGH_WATER: Final = 64 * 1024
WRITE_LOW_WATER: Final = 16 * 1024


@dataclass(frozen=True, slots=True)
class ListenerLimits:
    max_body_bytes: int = 16 * 1024 * 1024
    max_header_count: int = 100
    max_header_bytes: int = 60 * 1024  # Envoy's default
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 60.0
    max_connections: int = 10_000


class IncomingRequest:
    """A complete request as parsed (the body read whole). Not frozen for one reason:
    `release`. A plain class, not a dataclass: mypyc compiles a class's own __init__, but a
    dataclass's is generated at import and runs interpreted (36 bytecodes of every request)."""

    __slots__ = (
        "method",
        "target",
        "path",
        "headers",
        "body",
        "http_version",
        "keep_alive",
        "peer",
        "raw_headers",
        "began_ns",
    )

    def __init__(
        self,
        method: str,
        target: str,
        path: str,
        headers: RequestHeaders,
        body: bytes,
        http_version: str,
        keep_alive: bool,
        peer: str | None = None,
        raw_headers: list[tuple[bytes, bytes]] | None = None,
        began_ns: int | None = None,
    ) -> None:
        self.method = method
        self.target = target  # path and query as sent
        self.path = path
        self.headers = headers  # looked up by name; its pairs are ``raw_headers``
        self.body = body
        self.http_version = http_version
        self.keep_alive = keep_alive
        self.peer = peer  # the client's address (IP), for X-Forwarded-For
        # The header pairs as the parser gave them (bytes, in order): the upstream's head is
        # built from these (`headers.upstream_header_block`), ``headers`` is for lookups.
        self.raw_headers: list[tuple[bytes, bytes]] = [] if raw_headers is None else raw_headers
        # Monotonic ns when the request's first byte was parsed (t_arrive: where the client's
        # wait began, its upload included); None for a request not read off a connection.
        self.began_ns = began_ns

    def release(self) -> None:
        """The handler will not read the body or the headers again (the upstream answered):
        let them go, so that a long stream does not hold its prompt for its whole life."""
        self.body = b""
        self.headers = NO_HEADERS
        self.raw_headers = []


@dataclass(frozen=True, slots=True)
class Rejection:
    """A request refused by the listener itself, before any handler saw it."""

    status: int
    error_type: str  # the record's short cause
    message: str  # for the client, in vLLM's error shape
    err_type: str
    method: str | None = None
    path: str | None = None
    headers: HeaderLookup | None = None


Handler = Callable[["IncomingRequest", "ClientExchange"], Awaitable[None]]
# Returns the full response bytes to send for the rejection (the proxy renders its error body).
# Records the rejection; returns the answer's body and headers (None: nobody to answer).
RejectHandler = Callable[[Rejection], tuple[bytes, list[tuple[str, str]]] | None]


def reason_phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def header_lines(headers: list[tuple[str, str]]) -> bytes:
    """``Name: value`` and CRLF for each header, as bytes (latin-1)."""
    return "".join([f"{name}: {value}\r\n" for name, value in headers]).encode("latin-1")


def response_head(
    status: int, reason: str | None, header_block: bytes, framing: bytes = b""
) -> bytes:
    """``HTTP/1.1 status reason``, the header lines (bytes, CRLF each; then the framing
    lines), and the blank line."""
    return b"HTTP/1.1 %d %b\r\n%b%b\r\n" % (
        status,
        (reason or reason_phrase(status)).encode("latin-1"),
        header_block,
        framing,
    )


class ClientExchange:
    """The response side of one request: head, body writes, end. Writes are synchronous (the
    transport buffers); `drain` waits while the client's buffer is above the high-water mark."""

    __slots__ = (
        "connection",
        "request",
        "prepared",
        "finished",
        "_chunked",
        "_remaining",
        "_close_after",
        "_held_head",
    )

    def __init__(self, connection: ClientConnection, request: IncomingRequest) -> None:
        self.connection = connection
        self.request = request
        self.prepared = False
        self.finished = False
        self._chunked = False
        self._remaining: int | None = None
        self._close_after = not request.keep_alive
        self._held_head: bytes | None = None  # `start(hold=True)`: leaves with the first write

    @property
    def write_buffer_size(self) -> int:
        transport = self.connection.transport
        return transport.get_write_buffer_size() if transport is not None else 0

    @property
    def frames_chunks(self) -> bool:
        """A body write now is exactly one chunk, `<size>\\r\\n<data>\\r\\n`, and nothing else
        (chunked framing, no held head): what the C lane writes in `write`'s stead."""
        return self._chunked and self._held_head is None and not self.finished

    @property
    def client_gone(self) -> bool:
        transport = self.connection.transport
        return transport is None or transport.is_closing()

    def start(
        self,
        status: int,
        reason: str | None,
        headers: list[tuple[str, str]],
        content_length: int | None,
        body: bytes = b"",
        hold: bool = False,
    ) -> None:
        """Send the head (and ``body``, when it is the whole of a sized response). Without a
        length, an HTTP/1.1 client gets chunked framing; an HTTP/1.0 one a body ended by the
        connection's close. ``hold``: keep the head back for the first body write, `end`,
        `abort` or `flush`, whichever comes first; the caller flushes it before it waits on
        anything (a stream whose first events came with the upstream's head then costs one
        write syscall fewer, and the head is not later than the bytes already here)."""
        self.start_block(status, reason, header_lines(headers), content_length, body, hold)

    def start_block(
        self,
        status: int,
        reason: str | None,
        header_block: bytes,
        content_length: int | None,
        body: bytes = b"",
        hold: bool = False,
    ) -> None:
        """`start`, with the header lines already bytes (``Name: value`` and CRLF each, as
        `headers.response_header_block` makes them from the upstream's): the framing lines
        are this method's to add."""
        if self.prepared:
            raise RuntimeError("response already started")
        self.prepared = True
        framing = b""
        if status in (204, 304) or 100 <= status < 200:
            pass  # never a body, never framing (RFC 9110 6.4.1)
        elif self.request.method == "HEAD":
            if content_length is not None:  # the length a GET would have had; no body follows
                framing = b"Content-Length: %d\r\n" % content_length
        elif content_length is not None:
            framing = b"Content-Length: %d\r\n" % content_length
            self._remaining = content_length
        elif self.request.http_version == "1.1":
            framing = b"Transfer-Encoding: chunked\r\n"
            self._chunked = True
        else:
            self._close_after = True
        if self._close_after:
            framing += b"Connection: close\r\n"
        head = response_head(status, reason, header_block, framing)
        transport = self.connection.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client is gone")
        if body:
            transport.write(head + body)
            if self._remaining is not None:
                self._remaining -= len(body)
        elif hold:
            self._held_head = head
        else:
            transport.write(head)

    def flush(self) -> None:
        """Send a held head now (see `start`); nothing if none is held or the client is gone."""
        head = self._held_head
        if head is not None:
            self._held_head = None
            transport = self.connection.transport
            if transport is not None and not transport.is_closing():
                transport.write(head)

    def write(self, data: bytes) -> int:
        """One body write (framed as one chunk). Returns what the client's transport then
        holds unsent (`write_buffer_size`, without a second call). Raises
        ConnectionResetError if the client is gone."""
        transport = self.connection.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client is gone")
        head = self._held_head
        if self._chunked:
            # One small copy beats writelines' three buffers (uvloop 0.23, a socketpair
            # micro-benchmark: 2.4-2.6 against 2.7-3.0 µs per write).
            if head is None:
                transport.write(b"%x\r\n%b\r\n" % (len(data), data))
                return transport.get_write_buffer_size()
            self._held_head = None
            transport.write(b"%b%x\r\n%b\r\n" % (head, len(data), data))
        else:
            if self._remaining is not None:
                self._remaining -= len(data)
            if head is not None:
                self._held_head = None
                data = head + data
            transport.write(data)
        return transport.get_write_buffer_size()

    async def drain(self) -> None:
        self.flush()
        await self.connection.drain()

    def end(self, data: bytes = b"") -> None:
        """The response is complete: the connection serves the next request, or closes.
        ``data``: the body's last bytes, sent in the same write as the end of the framing (one
        syscall fewer per response; raises ConnectionResetError if the client is gone)."""
        if self.finished:
            return
        self.finished = True
        transport = self.connection.transport
        if transport is None or transport.is_closing():
            if data:
                raise ConnectionResetError("the client is gone")
            return
        head, self._held_head = self._held_head, None
        if self._chunked:
            tail = b"%x\r\n%b\r\n%b" % (len(data), data, _LAST_CHUNK) if data else _LAST_CHUNK
            transport.write(tail if head is None else head + tail)
        elif data or head is not None:
            if self._remaining is not None:
                self._remaining -= len(data)
            transport.write(data if head is None else head + data)
        if self._close_after or (self._remaining is not None and self._remaining != 0):
            transport.close()

    def abort(self) -> None:
        """Cut the connection: the only honest signal once a head went out and the body cannot
        be completed."""
        self.finished = True
        self.flush()  # as without `hold`: the client saw the head before the cut
        transport = self.connection.transport
        if transport is not None:
            transport.abort()


def stream_socket_fd(transport: asyncio.BaseTransport) -> int:
    """The socket of a plain stream transport (TCP or Unix, no TLS), which the C lane may send
    on while the transport holds nothing unsent (`_tokenscan.c`, `lane_send`); -1 for any other
    transport: the lane then writes through it."""
    if transport.get_extra_info("sslcontext") is not None:
        return -1
    sock = transport.get_extra_info("socket")
    if sock is None or sock.type != socket.SOCK_STREAM:
        return -1
    try:
        return int(sock.fileno())
    except (OSError, ValueError):
        return -1


class ClientConnection(asyncio.Protocol):
    """One client connection: parse, bound, dispatch, one request at a time."""

    def __init__(self, server: TrafficServer) -> None:
        # Made by the server's protocol factory, on its loop. Kept: each get_running_loop()
        # is a getpid() syscall on CPython 3.11, and a connection serves many requests.
        self.loop = asyncio.get_running_loop()
        # The loop's deadlines, this connection's and its requests' (`Timeouts`).
        self.alarms = alarms_of(self.loop)
        self.server = server
        self.limits = server.limits
        self.transport: asyncio.Transport | None = None
        # The transport's socket, for the C lane's own sends (`stream_relay`); -1: none.
        self.fd = -1
        # The parser holds bound methods of this connection, and it holds the parser: a cycle,
        # which `connection_lost` breaks (None), so that a closed connection is freed at once
        # by its reference count, not by a full collection (tests/test_gc_cycles.py).
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self._url = bytearray()
        self._target = "/"  # the request's target in origin form, once its head is read
        self._headers: list[tuple[bytes, bytes]] = []
        # The request's header pairs from its head's end until the request is made.
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._header_bytes = 0
        # The body's pieces while a request is read; None between requests (a list per
        # connection held for a whole stream otherwise), as is `_writable_callbacks` until a
        # caller waits for the client's buffer.
        self._body: list[bytes] | None = None
        self._body_size = 0
        self._in_message = False
        self._headers_done = False
        self._task: asyncio.Task[None] | None = None
        self._exchange: ClientExchange | None = None  # the one `_task` answers
        # Complete requests not yet handled: a list, not a deque, since there is rarely more
        # than one (pipelining) and an empty deque costs ~0.7 KiB per connection.
        self._queue: list[IncomingRequest] = []
        # The head's, the body's or the idle keep-alive's deadline, whichever applies now.
        self._deadline = Deadline(self.alarms)
        self._write_ready: asyncio.Future[None] | None = None
        self._writable_callbacks: list[Callable[[], None]] | None = None
        self._rejected = False
        self._request_headers: RequestHeaders | None = None
        self._method: str | None = None
        self._client_address: str | None = None
        self._began_ns: int | None = None

    # -- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(WRITE_HIGH_WATER, WRITE_LOW_WATER)
        self.fd = stream_socket_fd(self.transport)
        peername = self.transport.get_extra_info("peername")
        if isinstance(peername, tuple) and peername:
            self._client_address = str(peername[0])
        server = self.server
        server.connections.add(self)
        if len(server.connections) > self.limits.max_connections:
            self._reject(
                Rejection(
                    503,
                    "max_connections",
                    f"The sidecar is at its limit of "
                    f"{self.limits.max_connections} client connections; retry "
                    "later.",
                    "ServiceUnavailable",
                )
            )
            return
        # The first request's head must come within the header timeout.
        self._arm(self.limits.header_timeout_s, self._head_timed_out)

    def data_received(self, data: bytes) -> None:
        if not self._rejected:
            self._feed(data)

    def _feed(self, data: bytes) -> None:
        parser = self.parser
        if parser is None:
            return  # closed (asyncio delivers no data after connection_lost; a guard anyway)
        try:
            parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if not isinstance(exc.__context__, _Refused):
                # A bug in a callback here: the request still ends in an answer and a record.
                log.error(
                    "reading a request from %s failed inside the sidecar: %s",
                    self._peer(),
                    type(exc.__context__).__name__,
                )
                self._reject(
                    Rejection(
                        500,
                        "proxy_error:request_parsing",
                        "The sidecar failed while reading this request.",
                        "InternalServerError",
                        self._method,
                        self._path_or_none(),
                        self._request_headers,
                    )
                )
        except httptools.HttpParserUpgrade:
            self._reject(
                Rejection(
                    400,
                    "upgrade_not_supported",
                    "The sidecar does not relay protocol upgrades.",
                    "BadRequest",
                    self._method,
                    self._path_or_none(),
                    self._request_headers,
                )
            )
        except httptools.HttpParserError as malformed:
            cause = str(malformed).split(":")[0][:80] or type(malformed).__name__
            log.warning("malformed request from %s refused (400): %s", self._peer(), cause)
            self._reject(
                Rejection(
                    400,
                    "malformed_http",
                    "The request is not valid HTTP/1.1.",
                    "BadRequest",
                    self._method,
                    self._path_or_none(),
                    self._request_headers,
                )
            )
        if self._queue and not self._rejected:
            if self._task is None:
                self._dispatch()
            if self._queue and self.transport is not None:
                # One request at a time (see the module doc): a pipelined request waits, and
                # nothing more is read until it is handled. Otherwise reading goes on while a
                # request is handled, so that a client that leaves is noticed at once.
                self.transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.parser = None  # the cycle through its callbacks (see __init__)
        self._disarm()
        ready, self._write_ready = self._write_ready, None
        if ready is not None and not ready.done():
            ready.set_exception(ConnectionResetError("the client is gone"))
            ready.exception()
        callbacks, self._writable_callbacks = self._writable_callbacks, None
        for callback in callbacks or ():
            callback()
        exchange = self._exchange
        if (
            self._task is not None
            and not self._task.done()
            and not (exchange is not None and exchange.finished)
        ):
            # The client went away: its handler stops now (and closes the upstream request).
            # Not once its answer was complete: a client that read all of it and closed has
            # been served (the end can leave from the upstream's callback, before the handler
            # has resumed to record it).
            self._task.cancel()
        # Requests that reached us and will never be handled still end in one record each.
        gone: list[tuple[str | None, str | None, RequestHeaders | None]] = [
            (r.method, r.path, r.headers) for r in self._queue
        ]
        self._queue.clear()
        if self._in_message and not self._rejected:
            gone.append((self._method, self._path_or_none(), self._request_headers))
        self._in_message = False
        for method, path, headers in gone:
            self.server.on_rejected(
                Rejection(499, "client_disconnected", "", "", method, path, headers)
            )

    def pause_writing(self) -> None:
        if self._write_ready is None:
            self._write_ready = self.loop.create_future()

    def resume_writing(self) -> None:
        ready, self._write_ready = self._write_ready, None
        if ready is not None and not ready.done():
            ready.set_result(None)
        callbacks, self._writable_callbacks = self._writable_callbacks, None
        for callback in callbacks or ():
            callback()

    # -- httptools callbacks --------------------------------------------------------------

    def on_message_begin(self) -> None:
        # Called from feed_data on the read that brought the request's first byte.
        self._began_ns = _monotonic_ns()
        self._in_message = True
        self._headers_done = False
        self._url.clear()
        self._headers = []
        self._header_bytes = 0
        self._body = []
        self._body_size = 0
        self._request_headers = None
        self._method = None
        # The head's deadline runs from its first byte (a keep-alive connection's idle
        # deadline is replaced); a pipelined request's deadlines start when its turn comes.
        if self._task is None:
            self._arm(self.limits.header_timeout_s, self._head_timed_out)

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._header_bytes += len(url)
        if self._header_bytes > self.limits.max_header_bytes:
            self._refuse_headers()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        self._headers.append((name, value))
        if (
            self._header_bytes > self.limits.max_header_bytes
            or len(self._headers) > self.limits.max_header_count
        ):
            self._refuse_headers()

    def on_headers_complete(self) -> None:
        self._headers_done = True
        parser = self.parser
        assert parser is not None  # callbacks run inside `_feed`
        self._method = parser.get_method().decode("ascii", "replace")
        self._raw_headers, self._headers = self._headers, []
        headers = self._request_headers = RequestHeaders(self._raw_headers)
        target = _origin_form(self._url.decode("latin-1"))
        if target is None:
            log.warning(
                "request from %s with a target that is not a path refused (400)", self._peer()
            )
            self._reject(
                Rejection(
                    400,
                    "malformed_http",
                    "The request target must be a path (this is not a forward proxy).",
                    "BadRequest",
                    self._method,
                    None,
                    self._request_headers,
                )
            )
            raise _Refused
        self._target = target  # the URL is whole at the head's end: read once, here
        declared = headers.get("Content-Length")
        limit = self.limits.max_body_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            self._reject(
                Rejection(
                    413,
                    "body_too_large",
                    f"Request body of {int(declared)} bytes exceeds the "
                    f"sidecar's limit of {limit} bytes.",
                    "RequestEntityTooLarge",
                    self._method,
                    self._path_or_none(),
                    self._request_headers,
                )
            )
            raise _Refused
        if headers.get("Expect", "").lower() == "100-continue" and self.transport is not None:
            self.transport.write(_CONTINUE)
        if self._task is None:
            self._arm(self.limits.body_timeout_s, self._body_timed_out)

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        if self._body_size > self.limits.max_body_bytes:
            self._reject(
                Rejection(
                    413,
                    "body_too_large",
                    f"Request body exceeds the sidecar's limit of "
                    f"{self.limits.max_body_bytes} bytes.",
                    "RequestEntityTooLarge",
                    self._method,
                    self._path_or_none(),
                    self._request_headers,
                )
            )
            raise _Refused
        assert self._body is not None  # set by on_message_begin
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._task is None:
            self._disarm()
        self._in_message = False
        parser = self.parser
        assert parser is not None and self._request_headers is not None and self._method is not None
        target = self._target
        self._queue.append(
            IncomingRequest(
                method=self._method,
                target=target,
                path=target.split("?", 1)[0],
                headers=self._request_headers,
                raw_headers=self._raw_headers,
                body=b"".join(self._body) if self._body else b"",
                http_version=parser.get_http_version(),
                keep_alive=parser.should_keep_alive(),
                peer=self._client_address,
                began_ns=self._began_ns,
            )
        )
        self._body = None
        self._request_headers = None  # the request has them; a rejection now is not of it
        self._raw_headers = []

    # -- dispatch and keep-alive ----------------------------------------------------------

    def _dispatch(self) -> None:
        request = self._queue.pop(0)
        exchange = ClientExchange(self, request)
        self._exchange = exchange
        # The Task uvloop's create_task would make, named as it is made: create_task names it
        # afterwards, and the default name, "Task-<n>", is formatted for every task first.
        self._task = asyncio.Task(self._run(request, exchange), loop=self.loop, name=_TASK_NAME)

    async def _run(self, request: IncomingRequest, exchange: ClientExchange) -> None:
        try:
            await self.server.handler(request, exchange)
        finally:
            self._task = None
            self._exchange = None
            if not exchange.finished:
                exchange.abort()
            self._next()

    def _next(self) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self._queue:
            self._dispatch()
            if not self._queue:
                # The request that waited is handled now like one that came alone: reading
                # goes on, so that a client that leaves during it is noticed at once (paused,
                # its close went unseen until the answer was written).
                transport.resume_reading()
            return
        if self._in_message:
            # A pipelined request is half here: its deadlines start now.
            self._arm(
                self.limits.body_timeout_s if self._headers_done else self.limits.header_timeout_s,
                self._body_timed_out if self._headers_done else self._head_timed_out,
            )
        else:
            # Rung within the head's timeout: the next request's head deadline, set when its
            # first byte comes, then keeps this alarm instead of replacing it.
            self._arm(
                self.limits.keepalive_timeout_s,
                self._idle_timed_out,
                self.limits.header_timeout_s,
            )
        transport.resume_reading()

    # -- refusals and deadlines -----------------------------------------------------------

    def _refuse_headers(self) -> None:
        self._reject(
            Rejection(
                431,
                "headers_too_large",
                f"The request's headers exceed the sidecar's limits "
                f"({self.limits.max_header_count} headers, "
                f"{self.limits.max_header_bytes} bytes).",
                "RequestHeaderFieldsTooLarge",
                self._method,
                None,
                None,
            )
        )
        raise _Refused

    def _reject(self, rejection: Rejection) -> None:
        """Answer (when the head has not gone out) and close: the connection's framing can no
        longer be trusted, or the request was refused before its body was read."""
        if self._rejected:
            return
        self._rejected = True
        self._in_message = False
        self._disarm()
        answer = self.server.on_rejected(rejection)
        transport = self.transport
        if transport is not None and not transport.is_closing():
            if answer is not None:
                body, headers = answer
                transport.write(
                    response_head(
                        rejection.status,
                        None,
                        header_lines(headers),
                        b"Content-Length: %d\r\nConnection: close\r\n" % len(body),
                    )
                    + body
                )
            transport.close()

    def _arm(
        self, delay_s: float, callback: Callable[[], None], wake_within_s: float = 0.0
    ) -> None:
        if delay_s > 0:
            self._deadline.set(delay_s, callback, wake_within_s)
        else:
            self._deadline.clear()

    def _disarm(self) -> None:
        """No deadline while a request is handled (or once refused): no alarm either."""
        self._deadline.close()

    def _head_timed_out(self) -> None:
        if not self._in_message:
            # Connected and sent nothing: not a request, no record; just close.
            if self.transport is not None:
                self.transport.close()
            return
        log.warning(
            "request head from %s not complete within %.0f s: refused (408)",
            self._peer(),
            self.limits.header_timeout_s,
        )
        self._reject(
            Rejection(
                408,
                "header_timeout",
                "The request's head did not arrive in time.",
                "RequestTimeout",
                self._method,
                self._path_or_none(),
                self._request_headers,
            )
        )

    def _body_timed_out(self) -> None:
        log.warning(
            "request body from %s not complete within %.0f s: refused (408)",
            self._peer(),
            self.limits.body_timeout_s,
        )
        self._reject(
            Rejection(
                408,
                "body_timeout",
                "The request's body did not arrive in time.",
                "RequestTimeout",
                self._method,
                self._path_or_none(),
                self._request_headers,
            )
        )

    def _idle_timed_out(self) -> None:
        if self.transport is not None and self._task is None and not self._in_message:
            self.transport.close()

    def _path_or_none(self) -> str | None:
        return _path_of(self._url.decode("latin-1")) if self._url else None

    def _peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport else None
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "a client"

    async def drain(self) -> None:
        if self._write_ready is not None:
            await self._write_ready

    def when_writable(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the client's buffer drained below the low-water mark (or the
        connection is gone)."""
        if self._write_ready is None:
            callback()
        elif self._writable_callbacks is None:
            self._writable_callbacks = [callback]
        else:
            self._writable_callbacks.append(callback)


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a refused request."""


def _origin_form(target: str) -> str | None:
    """The request target as a path and query (what goes upstream), or None when it is not one:
    the absolute form (a client that takes us for a forward proxy) is reduced to its path and
    query, since the upstream is always ours; the authority form (CONNECT) and ``*`` are
    refused."""
    if target.startswith("/"):
        return target
    if target.startswith(("http://", "https://")):
        rest = target.split("://", 1)[1]
        cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=-1)
        if cut < 0:
            return "/"
        tail = rest[cut:]
        return tail if tail.startswith("/") else "/" + tail
    return None


def _path_of(target: str) -> str:
    """The path of a target (absolute form allowed), without its query."""
    origin = _origin_form(target)
    return (origin or target).split("?", 1)[0]


class TrafficServer:
    """The listening socket(s) and the live client connections."""

    def __init__(
        self, handler: Handler, on_rejected: RejectHandler, limits: ListenerLimits
    ) -> None:
        self.handler = handler
        self.on_rejected = on_rejected
        self.limits = limits
        self.connections: set[ClientConnection] = set()
        self._servers: list[asyncio.AbstractServer] = []

    async def start(self, host: str, port: int, *, backlog: int = 1024) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: ClientConnection(self), host, port, reuse_address=True, backlog=backlog
        )
        self._servers.append(server)
        # uvloop's `sockets` is a list where typeshed says tuple: read untyped, as compiled
        # code (setup.py) would check the type it is declared as.
        bound = cast(Any, server).sockets[0].getsockname()
        return bound[0], bound[1]

    async def start_on_socket(self, sock: socket.socket, backlog: int = 1024) -> None:
        """Serve on a socket bound elsewhere (a worker given the shared traffic port)."""
        loop = asyncio.get_running_loop()
        self._servers.append(
            await loop.create_server(lambda: ClientConnection(self), sock=sock, backlog=backlog)
        )

    def stop_accepting(self) -> None:
        for server in self._servers:
            server.close()

    async def close(self, grace_s: float = 5.0) -> None:
        """Stop accepting, let in-flight requests finish (up to ``grace_s``), then close every
        connection."""
        self.stop_accepting()
        deadline = asyncio.get_running_loop().time() + grace_s
        while any(c._task is not None for c in self.connections):
            if asyncio.get_running_loop().time() >= deadline:
                break
            await asyncio.sleep(0.01)
        for connection in list(self.connections):
            if connection._task is not None and not connection._task.done():
                connection._task.cancel()
            if connection.transport is not None:
                connection.transport.close()
        tasks = [c._task for c in self.connections if c._task is not None]
        if tasks:
            with contextlib.suppress(BaseException):
                await asyncio.wait(tasks, timeout=1.0)
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1.0)
        self._servers = []


def raise_open_files_limit(ceiling: int = 1 << 20) -> int:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit (at most ``ceiling``); returns the
    soft limit in force afterwards."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = ceiling if hard == resource.RLIM_INFINITY else min(hard, ceiling)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return ceiling if soft == resource.RLIM_INFINITY else soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft
    return target
