"""Upstream reads stamped by the kernel (sidecar/proxy/rxstamp.py), on real sockets.

The point of the kernel's receive timestamp is that a read's instant no longer depends on when
the proxy's loop got to it. Each test that shows it keeps the loop busy (a CPU spin, no syscall)
after the peer wrote, and checks the stamp against the instant of the write, not of the read."""

from __future__ import annotations

import asyncio
import errno
import json
import socket
import struct
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from itertools import pairwise
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_helpers import require_module
from proxy_stack import proxy_to, scripted_upstream
from vllm_chunks import CHAT_HELLO

from sidecar import clock
from sidecar.config import build_config
from sidecar.proxy import rxstamp
from sidecar.record import Outcome

pytestmark = pytest.mark.skipif(not rxstamp.SUPPORTED, reason="kernel receive stamps: Linux")

SPIN_NS = 60_000_000  # long enough to tell a read stamp from an arrival stamp under any load


def spin(duration_ns: int) -> None:
    """Keep the loop (and this thread) busy without a syscall: what a long callback or a
    garbage collection does to every stream on the loop."""
    end = clock.monotonic_ns() + duration_ns
    while clock.monotonic_ns() < end:
        pass


class Reader:
    """A StampedProtocol that keeps what it gets."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.reads: list[tuple[bytes, int, int]] = []  # data, stamp, instant of the callback
        self.lost: asyncio.Future[Exception | None] = asyncio.get_running_loop().create_future()
        self.got = asyncio.Event()
        self.pauses = 0
        self.resumes = 0

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received_at(self, data: bytes, at_ns: int) -> None:
        self.reads.append((data, at_ns, clock.monotonic_ns()))
        self.got.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.set_result(exc)

    def pause_writing(self) -> None:
        self.pauses += 1

    def resume_writing(self) -> None:
        self.resumes += 1

    @property
    def data(self) -> bytes:
        return b"".join(d for d, _, _ in self.reads)

    async def wait_for(self, size: int) -> None:
        while len(self.data) < size:
            self.got.clear()
            await asyncio.wait_for(self.got.wait(), 5)


@pytest.fixture(autouse=True, params=["c", "python"])
def reader_callback(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every transport test twice: over the C reader callback (`_recvstamp.Reader`, what the
    proxy runs where it is built) and over the Python one (`_on_readable`, the fallback)."""
    if request.param == "c" and not rxstamp.NATIVE_READER:
        pytest.skip("the C reader is not built")
    monkeypatch.setattr(rxstamp, "NATIVE_READER", request.param == "c")
    return str(request.param)


@asynccontextmanager
async def connected() -> AsyncIterator[tuple[Reader, rxstamp.StampedTransport, socket.socket]]:
    """A StampedTransport to a plain socket this test drives (blocking calls kept off the loop
    by writing only what the kernel buffers at once)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    loop = asyncio.get_running_loop()
    rxstamp.hold_timestamping()
    reader = Reader()
    accept = asyncio.ensure_future(loop.sock_accept(listener))
    opened = await rxstamp.open_stamped(
        loop, "127.0.0.1", listener.getsockname()[1], reader, rxstamp.ReadBuffer()
    )
    assert isinstance(opened, rxstamp.StampedTransport)
    peer, _ = await accept
    peer.setblocking(False)
    try:
        yield reader, opened, peer
    finally:
        opened.abort()
        peer.close()
        listener.close()


async def until_stamped(reader: Reader, transport: rxstamp.StampedTransport, peer: Any) -> None:
    """Exchange bytes until a read carries the kernel's stamp: the host turns stamping on a
    little after the first socket asks (`rxstamp.hold_timestamping`), and a test may be that
    first socket."""
    for _ in range(200):
        unstamped = transport.unstamped_reads
        size = len(reader.data)
        peer.send(b"w")
        await reader.wait_for(size + 1)
        if transport.unstamped_reads == unstamped:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("no read came with a kernel receive timestamp")


async def test_a_read_is_stamped_when_it_arrived_not_when_the_busy_loop_read_it() -> None:
    async with connected() as (reader, transport, peer):
        await until_stamped(reader, transport, peer)
        unstamped = transport.unstamped_reads
        reader.reads.clear()
        peer.send(b"first")
        await reader.wait_for(5)
        peer.send(b"second")
        sent_ns = clock.monotonic_ns()
        spin(SPIN_NS)
        await reader.wait_for(11)
        assert transport.unstamped_reads == unstamped  # both reads had the kernel's stamp
    (_, first_at, first_read), (data, at_ns, read_ns) = reader.reads
    assert data == b"second"
    assert first_at <= first_read
    # Read after the spin, stamped at its arrival (right after the send, before the spin).
    assert read_ns - sent_ns >= SPIN_NS
    assert at_ns <= read_ns and at_ns - sent_ns < SPIN_NS // 3


async def test_writes_past_what_the_socket_takes_pause_the_writer_and_arrive_whole() -> None:
    payload = bytes(range(256)) * 64 * 1024  # 16 MiB: far past the socket buffers
    async with connected() as (reader, transport, peer):
        transport.write(payload)
        assert reader.pauses == 1 and reader.resumes == 0  # the rest waits in the transport
        loop = asyncio.get_running_loop()
        got = bytearray()
        while len(got) < len(payload):
            got += await loop.sock_recv(peer, 1 << 20)
        assert bytes(got) == payload
        assert reader.resumes == 1


async def test_pause_reading_holds_reads_until_resumed() -> None:
    async with connected() as (reader, transport, peer):
        transport.pause_reading()
        peer.send(b"held")
        await asyncio.sleep(0.05)
        assert reader.reads == []
        transport.resume_reading()
        await reader.wait_for(4)
        assert reader.data == b"held"


async def test_the_peers_orderly_end_and_its_reset_reach_the_protocol() -> None:
    async with connected() as (reader, _transport, peer):
        peer.send(b"bye")
        peer.shutdown(socket.SHUT_WR)
        assert await asyncio.wait_for(reader.lost, 5) is None
        assert reader.data == b"bye"
    async with connected() as (reader, _transport, peer):
        # SO_LINGER 0: close sends a reset (RST), as a server's kernel does for unread data.
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        peer.close()
        assert isinstance(await asyncio.wait_for(reader.lost, 5), ConnectionResetError)


async def test_close_sends_what_was_written_first() -> None:
    payload = b"x" * (4 * 1024 * 1024)
    async with connected() as (reader, transport, peer):
        transport.write(payload)
        transport.close()
        assert transport.is_closing()
        loop = asyncio.get_running_loop()
        got = bytearray()
        while chunk := await loop.sock_recv(peer, 1 << 20):
            got += chunk
        assert len(got) == len(payload)
        assert await asyncio.wait_for(reader.lost, 5) is None


async def test_extra_info_reads_the_sockets_addresses_when_asked() -> None:
    async with connected() as (_reader, transport, peer):
        assert transport.get_extra_info("peername") == peer.getsockname()
        assert transport.get_extra_info("sockname") == peer.getpeername()
        sock = transport.get_extra_info("socket")
        assert isinstance(sock, socket.socket) and sock.getpeername() == peer.getsockname()
        assert transport.get_extra_info("cipher", "none") == "none"
        transport.abort()
        # Closed: the addresses can no longer be read, and the default is what the caller gets.
        assert transport.get_extra_info("peername", "gone") == "gone"
        assert transport.get_extra_info("sockname", "gone") == "gone"


@pytest.mark.parametrize("converted", ["future", "past"])
async def test_a_stamp_is_never_after_its_read_nor_before_the_previous_one(
    monkeypatch: pytest.MonkeyPatch, converted: str, reader_callback: str
) -> None:
    """A step of the calendar clock between the kernel's stamp and the conversion (simulated:
    the converted instant lands a second after the read, or at 0) is clamped."""
    if reader_callback == "c":
        pytest.skip("the step is simulated by replacing clock.from_realtime_ns: Python only")
    async with connected() as (reader, transport, peer):
        await until_stamped(reader, transport, peer)
        reader.reads.clear()
        peer.send(b"a")
        await reader.wait_for(1)
        shift = 10**9 if converted == "future" else None
        monkeypatch.setattr(
            clock, "from_realtime_ns", lambda real, now: now + shift if shift else 0
        )
        peer.send(b"b")
        await reader.wait_for(2)
    (_, first_at, _), (_, at_ns, read_ns) = reader.reads
    if converted == "future":
        assert read_ns - 50_000_000 < at_ns <= read_ns  # clamped to the read, not 1 s later
    else:
        assert at_ns == first_at  # clamped to the previous stamp


def chat_chunk(content: str, tokens: int) -> bytes:
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
        "usage": {"prompt_tokens": 3, "total_tokens": 3 + tokens, "completion_tokens": tokens},
    }
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


@pytest.mark.parametrize("server_stamps", ["kernel", "read"])
async def test_the_server_vantage_keeps_the_arrival_while_the_proxy_was_busy(
    server_stamps: str,
) -> None:
    """Through a running proxy: the replica writes a token, then the proxy's loop is held for
    60 ms before it can read it. Server-side ITL is the gap the replica made (kernel stamps);
    the client's side, written after the hold, shows the hold, as the client lived it. With
    ``--server-stamps read`` the server side shows the hold too: what kernel stamps remove."""
    written: list[int] = []

    async def scripted(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(3):
            await response.write(chat_chunk(str(i), i + 1))
            written.append(clock.monotonic_ns())
            if i == 1:
                spin(SPIN_NS)  # the whole loop, the proxy's reading included, is held
            await asyncio.sleep(0.05)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async with (
        scripted_upstream("/v1/chat/completions", scripted) as upstream,
        proxy_to(upstream, server_stamps=server_stamps) as (server, collected),
        aiohttp.ClientSession() as session,
    ):
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
        async with session.post(server.url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200
            await response.read()
        records = await collected.wait_for(1)
    (record,) = records
    assert record.outcome is Outcome.OK and record.n_out == 3
    assert record.server is not None
    truth = [b - a for a, b in pairwise(written)]
    server_gaps = [b - a for a, b in pairwise(record.server.offsets_ns)]
    client_gaps = [b - a for a, b in pairwise(record.client.offsets_ns)]
    # The hold came after token 1 was written: token 1 is read late, token 2 is not.
    assert client_gaps[0] - truth[0] >= SPIN_NS * 0.9
    if server_stamps == "kernel":
        assert all(abs(s - t) < SPIN_NS // 3 for s, t in zip(server_gaps, truth, strict=True))
    else:
        assert server_gaps[0] - truth[0] >= SPIN_NS * 0.9


def test_the_start_line_says_where_server_stamps_come_from() -> None:
    from sidecar.cli import server_stamps_text

    def text(**values: str) -> str:
        return server_stamps_text(build_config({"upstreams": ["http://127.0.0.1:1"], **values}, {}))

    assert text() == "the kernel's receive timestamps (SO_TIMESTAMPNS)"
    assert text(server_stamps="read") == "when the proxy reads them (--server-stamps read)"
    mixed = server_stamps_text(
        build_config({"upstreams": ["http://127.0.0.1:1", "https://10.0.0.1:443"]}, {})
    )
    assert mixed.endswith("; when read for the TLS upstreams https://10.0.0.1:443")


@contextmanager
def loop_exceptions() -> Iterator[list[dict[str, Any]]]:
    """What reaches the running loop's exception handler meanwhile, kept in the list given."""
    loop = asyncio.get_running_loop()
    logged: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: logged.append(context))
    try:
        yield logged
    finally:
        loop.set_exception_handler(previous)


@pytest.mark.parametrize("failing", ["protocol", "lane"])
async def test_a_protocol_or_lane_that_fails_on_a_read_ends_its_connection(failing: str) -> None:
    """The read's exception fails the transport (its connection closed, the protocol told) and
    goes on to the loop, whether the protocol or the stream's lane raised it."""
    loop = asyncio.get_running_loop()
    with loop_exceptions() as logged:
        async with connected() as (reader, transport, peer):
            if failing == "lane":
                transport.lane = FakeLane(fail=True)
            else:

                def broken(data: bytes, at_ns: int) -> None:
                    raise ValueError("cannot take this")

                reader.data_received_at = broken  # type: ignore[method-assign]
            peer.send(b"x")
            lost = await asyncio.wait_for(reader.lost, 5)
            assert isinstance(lost, ValueError) and transport.is_closing()
            assert reader.reads == []
            assert await loop.sock_recv(peer, 10) == b""  # the connection was closed
    assert any(isinstance(c.get("exception"), ValueError) for c in logged)


class FakeLane:
    """A stream's lane as the transport sees it: takes the reads that start with "L"."""

    def __init__(self, fail: bool = False) -> None:
        self.taken: list[tuple[bytes, int]] = []
        self.fail = fail

    def relay(self, data: bytes, at_ns: int) -> bool:
        if self.fail:
            raise ValueError("the lane broke")
        if data.startswith(b"L"):
            self.taken.append((data, at_ns))
            return True
        return False


async def test_each_read_is_offered_to_the_lane_first_and_the_rest_reach_the_protocol() -> None:
    async with connected() as (reader, transport, peer):
        await until_stamped(reader, transport, peer)
        before = len(reader.data)
        lane = FakeLane()
        transport.lane = lane
        for block in (b"L1", b"p2", b"L3", b"p4"):
            peer.send(block)
            sent = len(lane.taken) + len(reader.data)
            for _ in range(500):  # one read per block: wait for each before the next
                if len(lane.taken) + len(reader.data) > sent:
                    break
                await asyncio.sleep(0.002)
        assert [d for d, _ in lane.taken] == [b"L1", b"L3"]
        assert reader.data[before:] == b"p2p4"
        # One clock for both: the lane's stamps sit between the protocol's, in read order.
        stamps = [reader.reads[-2][1], lane.taken[1][1], reader.reads[-1][1]]
        assert lane.taken[0][1] <= stamps[0] <= stamps[1] <= stamps[2]
        transport.lane = None
        peer.send(b"L5")
        await reader.wait_for(len(reader.data) + 2)
        assert reader.data.endswith(b"L5") and len(lane.taken) == 2


class LaneClient:
    """The client transport and relay a real C lane writes to, recorded; ``broken``: its
    buffer size cannot be read (the lane fails after its write)."""

    def __init__(self, broken: bool = False) -> None:
        self.writes: list[bytes] = []
        self.broken = broken

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def get_write_buffer_size(self) -> int:
        if self.broken:
            raise AttributeError("no buffer")
        return 0

    def is_closing(self) -> bool:
        return False

    def on_client_full(self) -> None:  # pragma: no cover - never full here
        raise AssertionError


def token_read(n: int) -> bytes:
    """One read of a stream in vLLM's shape, as it comes off the upstream: a whole HTTP chunk
    holding one token event with continuous usage."""
    event = CHAT_HELLO.replace(
        ',"kv_transfer_params":null}',
        f',"usage":{{"prompt_tokens":3,"total_tokens":{3 + n},"completion_tokens":{n}}}'
        ',"kv_transfer_params":null}',
    )
    payload = b"data: " + event.encode() + b"\n\n"
    return b"%x\r\n%b\r\n" % (len(payload), payload)


@pytest.mark.parametrize("failing", [False, True])
async def test_a_c_lane_takes_its_reads_as_a_stand_in_does(failing: bool) -> None:
    """The real lane (`_tokenscan.Lane`), which the C reader calls without the read's bytes
    object: it takes the token reads, stamped on the reader's clock, and leaves the others to
    the protocol; an exception it raises fails the connection as a stand-in's does."""
    lane_type = pytest.importorskip("sidecar.protocol._tokenscan").Lane
    with loop_exceptions() as logged:
        async with connected() as (reader, transport, peer):
            await until_stamped(reader, transport, peer)
            before = len(reader.reads)
            client = LaneClient(broken=failing)
            lane = lane_type(client, client, 0, 1 << 16, 1 << 20, True)
            lane.arm(100, 0)
            transport.lane = lane
            if failing:
                peer.send(token_read(1))
                lost = await asyncio.wait_for(reader.lost, 5)
                assert isinstance(lost, AttributeError) and transport.is_closing()
                assert len(client.writes) == 1 and len(reader.reads) == before
            else:
                for n, block in enumerate([token_read(1), b"p2", token_read(2), b"p4"]):
                    peer.send(block)
                    for _ in range(500):  # one read per block: wait for each before the next
                        if len(client.writes) + len(reader.reads) > n + before:
                            break
                        await asyncio.sleep(0.002)
                assert [d for d, _, _ in reader.reads[before:]] == [b"p2", b"p4"]
                assert len(client.writes) == 2
                assert all(b'"usage"' not in write for write in client.writes)  # cut out
                taken = lane.take()
                assert taken is not None
                up = struct.unpack("2q", taken[0])
                # One clock: the lane's stamps sit between the protocol's, in read order.
                p2, p4 = reader.reads[-2][1], reader.reads[-1][1]
                assert up[0] <= p2 <= up[1] <= p4
    if failing:
        assert any(isinstance(c.get("exception"), AttributeError) for c in logged)


async def test_an_ended_transport_lets_go_of_its_reader_lane_and_protocol(
    reader_callback: str,
) -> None:
    async with connected() as (reader, transport, _peer):
        lane = FakeLane()
        transport.lane = lane
        native = transport._reader
        transport.abort()
        assert transport.lane is None
        if reader_callback == "c":
            assert native.lane is None
            with pytest.raises(RuntimeError):
                native.lane = lane  # closed: nothing to hold any more
            native()  # a callback the loop still had queued: nothing happens
        else:
            assert native is None
        await asyncio.wait_for(reader.lost, 5)


async def test_reads_without_the_kernels_stamp_are_stamped_when_read_and_counted() -> None:
    """A socket without the option (as on a platform that drops the stamps): each read gets the
    instant it was read, and the shared buffer counts it for the proxy's status."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    loop = asyncio.get_running_loop()
    reader, buffer = Reader(), rxstamp.ReadBuffer()
    accept = asyncio.ensure_future(loop.sock_accept(listener))
    sock = socket.create_connection(listener.getsockname())
    sock.setblocking(False)
    transport = rxstamp.StampedTransport(loop, sock, reader, buffer)  # no rxstamp.enable
    peer, _ = await accept
    try:
        for i in range(3):
            peer.send(b"x")
            sent_ns = clock.monotonic_ns()
            spin(SPIN_NS // 6)
            await reader.wait_for(i + 1)
            _, at_ns, _read_ns = reader.reads[-1]
            assert at_ns - sent_ns >= SPIN_NS // 6  # the read's instant, after the hold
        assert transport.unstamped_reads == buffer.unstamped_reads == 3
    finally:
        transport.abort()
        peer.close()
        listener.close()


async def test_a_deadline_that_passed_during_a_stall_waits_for_the_bytes_that_came_meanwhile() -> (
    None
):
    """The proxy's loop is held for 400 ms (in an I/O callback) right after the first token,
    while the replica (a thread of its own) keeps sending every 100 ms: the 200 ms idle
    deadline passed during the hold, but the tokens were in the socket. On the next turn libuv
    runs due timers before it polls, so the deadline is confirmed after one poll: the stream
    ends well, not in an idle timeout (it did before)."""
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def replica() -> None:
        conn, _ = listener.accept()
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:
                request += conn.recv(65536)
            head, _, body = request.partition(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            while len(body) < length:
                body += conn.recv(65536)
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            events = [chat_chunk(str(i), i + 1) for i in range(4)] + [b"data: [DONE]\n\n"]
            for i, event in enumerate(events):
                conn.sendall(b"%x\r\n%b\r\n" % (len(event), event))
                if i < 3:
                    clock_sleep(0.1)
            conn.sendall(b"0\r\n\r\n")

    def clock_sleep(seconds: float) -> None:
        threading.Event().wait(seconds)  # this thread runs no loop

    thread = threading.Thread(target=replica, daemon=True)
    thread.start()
    upstream = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        async with (
            proxy_to(
                upstream, idle_timeout="200ms", ttft_timeout="5s", engine_scrape_interval="0"
            ) as (server, collected),
            aiohttp.ClientSession() as session,
        ):
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
            async with session.post(server.url + "/v1/chat/completions", json=body) as response:
                assert response.status == 200
                await response.content.readuntil(b"\n\n")  # the first token
                # The loop is held inside an I/O callback (as a long read's work or a garbage
                # collection there would hold it); the replica goes on.
                loop = asyncio.get_running_loop()
                trigger, held = socket.socketpair()

                def hold() -> None:
                    loop.remove_reader(held.fileno())
                    spin(400_000_000)

                loop.add_reader(held.fileno(), hold)
                trigger.send(b"x")
                rest = await response.read()
                trigger.close()
                held.close()
            (record,) = await collected.wait_for(1)
    finally:
        await asyncio.to_thread(thread.join, 10)
        listener.close()
    assert rest.endswith(b"data: [DONE]\n\n"), rest[-200:]
    assert record.outcome is Outcome.OK and record.n_out == 4, (record.outcome, record.error_type)


# -- the C read (`_recvstamp.c`) against the Python one -----------------------------------------


def connected_pair(stamped: bool) -> tuple[socket.socket, socket.socket]:
    """(sender, receiver) over TCP on 127.0.0.1, the receiver non-blocking and, if
    ``stamped``, with SO_TIMESTAMPNS on."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        sender = socket.create_connection(server.getsockname())
        receiver, _ = server.accept()
    sender.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if stamped:
        assert rxstamp.enable(receiver)
    receiver.setblocking(False)
    if stamped:
        # The kernel turns stamping on a little after it is first asked (rxstamp's
        # `hold_timestamping`): read until a stamp comes, so that the reads compared are.
        rxstamp.hold_timestamping()
        read = rxstamp.ReadBuffer()
        for _ in range(200):
            sender.send(b"warm-up")
            wait_readable(receiver)
            if rxstamp.receive_with_python(receiver, read)[1] >= 0:
                break
            time.sleep(0.01)
        else:
            pytest.fail("the kernel never stamped a read")
    return sender, receiver


def wait_readable(sock: socket.socket) -> None:
    import select

    assert select.select([sock], [], [], 5)[0], "nothing arrived"


def both_receivers(sock: socket.socket) -> list[Any]:
    module = require_module("sidecar.proxy._recvstamp", "-e . (with a C compiler: gcc)")
    read = rxstamp.ReadBuffer()
    return [
        lambda: module.receive(sock.fileno(), read.view),
        lambda: rxstamp.receive_with_python(sock, read),
    ]


@pytest.mark.parametrize("stamped", [True, False])
def test_the_c_read_gives_what_the_python_read_gives(stamped: bool) -> None:
    if stamped and not rxstamp.SUPPORTED:
        pytest.skip("no SO_TIMESTAMPNS on this platform")
    sender, receiver = connected_pair(stamped)
    with sender, receiver:
        for n, receive in enumerate(both_receivers(receiver)):
            payload = bytes([65 + n]) * (300 + n)
            before = time.time_ns()
            sender.send(payload)
            wait_readable(receiver)
            data, realtime_ns = receive()
            assert data == payload and type(data) is bytes
            if stamped:  # the kernel's stamp of the arrival, on the calendar clock
                assert before - 10**9 < realtime_ns <= time.time_ns()
            else:
                assert realtime_ns == -1


def test_the_c_read_fails_as_the_python_read_does() -> None:
    sender, receiver = connected_pair(True)
    with sender, receiver:
        for receive in both_receivers(receiver):  # nothing there yet
            with pytest.raises(BlockingIOError):
                receive()
    for which in range(2):  # the peer resets the connection (SO_LINGER 0)
        sender, receiver = connected_pair(True)
        with receiver:
            sender.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sender.close()
            wait_readable(receiver)
            with pytest.raises(ConnectionResetError):
                both_receivers(receiver)[which]()
    sender, receiver = connected_pair(True)
    with receiver:
        sender.close()  # the orderly end: b"" for both
        wait_readable(receiver)
        for receive in both_receivers(receiver):
            assert receive() == (b"", -1)
    module = require_module("sidecar.proxy._recvstamp", "-e . (with a C compiler: gcc)")
    with pytest.raises(ValueError, match="not a file descriptor"):
        module.receive(receiver.fileno(), bytearray(16))  # closed: fileno() is -1
    with open("/dev/null", "rb") as not_a_socket, pytest.raises(OSError) as failed:
        module.receive(not_a_socket.fileno(), bytearray(16))
    assert failed.value.errno == errno.ENOTSOCK
    with pytest.raises((TypeError, BufferError)):
        module.receive(0, b"read-only")
    with pytest.raises(TypeError):
        module.receive(0)
