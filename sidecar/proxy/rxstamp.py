"""Upstream reads stamped by the kernel: the instant a read's bytes reached the socket.

The server vantage's instants are "on the upstream socket" (docs/metrics.md). Stamped when the
proxy's code gets to a read, they also carry everything that kept the proxy from getting to it:
the host waking an idle core (on the reference VM a loopback message after 20 ms of quiet takes
~120 µs to reach the reader, after 0.5 ms ~40 µs), the loop finishing other streams' work, a
garbage collection (67-96 ms at 128 streams in benchmarks/proxy_accuracy.py). The kernel already
knows the instant: with ``SO_TIMESTAMPNS`` on a TCP socket, ``recvmsg`` returns with each read the
software receive timestamp of the last segment it consumed, taken where the packet entered the
host's network stack (for loopback, inside the sender's ``send``). That instant is what this
transport hands on with the bytes.

uvloop's transports read in C and give no access to ancillary data, so plain-TCP upstream
connections get this small transport over the loop's reader and writer callbacks instead:
``recvmsg_into`` a buffer shared by the loop (no allocation per read beyond the bytes handed
on), one copy out, and the stamp converted to the monotonic clock (`clock.from_realtime_ns`).
Measured against uvloop's own TCP transport reading the same streams (benchmarks/rx_stamps.py,
128 connections): 6.5 µs of CPU per read against 4.5, in exchange for stamps that no longer
depend on the proxy's load (and no `ArrivalBatch` turn for these connections).

Limits, stated: when one read takes several segments (the proxy fell behind), all of them get
the last one's instant, which is still no later than the read; a stamp is never later than the
read nor earlier than the connection's previous stamp. TLS upstreams stay on uvloop's
transport, stamped at the read (`UpstreamConnection` then batches reads per loop turn). Where
the option cannot be set (not Linux, or a kernel that refuses it), reads are stamped when read.
"""

from __future__ import annotations

import asyncio
import atexit
import platform
import socket
import struct
import sys
from collections.abc import Callable
from typing import Any, Protocol

from sidecar import clock

# SO_TIMESTAMPNS (== SCM_TIMESTAMPNS) in asm-generic/socket.h, which x86-64, arm64 and riscv64
# use; other architectures number socket options differently, so they are not guessed at.
_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
SUPPORTED = sys.platform == "linux" and platform.machine() in {"x86_64", "aarch64", "riscv64"}
_TIMESPEC = struct.Struct("@qq")  # struct timespec on a 64-bit Linux: tv_sec, tv_nsec
_TIMESPEC_SIZE = _TIMESPEC.size
_TIMESPEC_UNPACK = _TIMESPEC.unpack
_ANCILLARY_SIZE = socket.CMSG_SPACE(_TIMESPEC.size) if SUPPORTED else 0
_READ_SIZE = 256 * 1024  # uvloop's read size
_WRITE_HIGH = 64 * 1024  # pause the protocol's writing above this many buffered bytes
_WRITE_LOW = 16 * 1024


class StampedProtocol(Protocol):
    """What `StampedTransport` calls: asyncio.Protocol's callbacks, with the read's instant."""

    def connection_made(self, transport: Any) -> None: ...

    def data_received_at(self, data: bytes, at_ns: int) -> None: ...

    def connection_lost(self, exc: Exception | None) -> None: ...

    def pause_writing(self) -> None: ...

    def resume_writing(self) -> None: ...


_HELD: list[socket.socket] = []


def hold_timestamping() -> None:
    """Keep the host's receive timestamping on for this process's life. The kernel stamps
    packets only while some socket asks for it, and switches that on a little after the first
    one does (a deferred job): a process whose upstream connections all closed and a new one
    opened would find the new connection's first reads unstamped (then stamped when read). One
    idle UDP socket with the option set, held open, keeps it on. Idempotent; one descriptor."""
    if _HELD or not SUPPORTED:
        return
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    if enable(sock):
        _HELD.append(sock)
        atexit.register(sock.close)
    else:
        sock.close()


def enable(sock: socket.socket) -> bool:
    """Ask the kernel for receive timestamps on ``sock``; False where it cannot be done."""
    if not SUPPORTED:
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
    except OSError:
        return False
    return True


class ReadBuffer:
    """One receive buffer per loop: reads are handled one at a time, each copied out. It also
    counts the reads of all its transports that came without the kernel's stamp."""

    __slots__ = ("buffers", "view", "unstamped_reads")

    def __init__(self) -> None:
        self.view = memoryview(bytearray(_READ_SIZE))
        self.buffers = [self.view]
        self.unstamped_reads = 0


def receive_with_python(sock: socket.socket, read: ReadBuffer) -> tuple[bytes, int]:
    """One read of ``sock`` into ``read``'s buffer: (a copy of the bytes read, b"" at the
    peer's orderly end; the kernel's SO_TIMESTAMPNS stamp of them in CLOCK_REALTIME
    nanoseconds, -1 without one). What `_recvstamp.c` does in C, where it is not built."""
    size, ancillary, _flags, _address = sock.recvmsg_into(read.buffers, _ANCILLARY_SIZE)
    # The one message asked for.
    if (
        ancillary
        and ancillary[0][0] == socket.SOL_SOCKET
        and ancillary[0][1] == _SO_TIMESTAMPNS
        and len(ancillary[0][2]) == _TIMESPEC_SIZE
    ):
        seconds, nanoseconds = _TIMESPEC_UNPACK(ancillary[0][2])
        return read.view[:size].tobytes(), seconds * 1_000_000_000 + nanoseconds
    return read.view[:size].tobytes(), -1


# The same read in C where the package was built with it (`_recvstamp.c`: none of the objects
# `recvmsg_into` makes per read), else `receive_with_python`.
_native_receive: Callable[[int, memoryview], tuple[bytes, int]] | None
try:
    from sidecar.proxy._recvstamp import receive as _native_receive
except ImportError:  # built without a C compiler: correct, slower
    _native_receive = None
NATIVE_RECEIVE = _native_receive is not None

# The whole reader callback in C (`_recvstamp.Reader`: `_on_readable` without a Python frame per
# read), where built. A module setting rather than a constant so that tests can run the
# transport over the Python callback too.
_NativeReader: Any
try:
    from sidecar.proxy import _recvstamp

    _NativeReader = _recvstamp.Reader
except ImportError:  # built without a C compiler: `_on_readable`
    _NativeReader = None
NATIVE_READER = _NativeReader is not None


class StampedTransport:
    """A TCP transport (the part of asyncio.Transport the upstream client uses) whose reads
    carry the kernel's receive instant. Made by `open_stamped`, reading at once."""

    __slots__ = (
        "_loop",
        "_sock",
        "_fd",
        "_protocol",
        "_read",
        "_out",
        "_reading",
        "_writing",
        "_write_paused",
        "_closing",
        "_closed",
        "_last_ns",
        "unstamped_reads",
        "_lane",
        "_reader",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        protocol: StampedProtocol,
        read_buffer: ReadBuffer,
    ) -> None:
        self._loop = loop
        self._sock = sock
        self._fd = sock.fileno()
        self._protocol = protocol
        self._read = read_buffer
        self._out = bytearray()
        self._reading = False
        self._writing = False
        self._write_paused = False
        self._closing = False
        self._closed = False
        self._last_ns = 0
        self.unstamped_reads = 0  # reads that came without the kernel's stamp: stamped when read
        # The C lane of the stream this connection carries now (`lane`).
        self._lane: Any = None
        # What the loop calls when the socket is readable: the C reader, or None for
        # `_on_readable`.
        self._reader: Any = (
            _NativeReader(self._fd, read_buffer.view, self, protocol)
            if NATIVE_READER and _NativeReader is not None
            else None
        )
        protocol.connection_made(self)
        self.resume_reading()

    # -- reading ---------------------------------------------------------------------------

    @property
    def lane(self) -> Any:
        """The C lane of the stream this connection carries now (`_tokenscan.Lane`, set and
        cleared by stream_relay.MeteredRead), offered each read before the protocol; None."""
        return self._lane

    @lane.setter
    def lane(self, lane: Any) -> None:
        self._lane = lane
        if self._reader is not None and not self._closed:
            self._reader.lane = lane

    def _count_unstamped(self) -> None:
        """A read that came without the kernel's stamp (stamped when read): counted."""
        self.unstamped_reads += 1
        self._read.unstamped_reads += 1

    def _on_readable(self) -> None:
        read = self._read
        try:
            if _native_receive is not None:
                data, realtime_ns = _native_receive(self._fd, read.view)
            else:
                data, realtime_ns = receive_with_python(self._sock, read)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as broken:
            self._fail(broken)
            return
        now_ns = clock.monotonic_ns()
        if not data:
            self.close()  # the upstream's orderly end: connection_lost(None) follows
            return
        # A socket without stamps (or a read the kernel did not stamp) has none (-1), and is
        # stamped when read.
        if realtime_ns >= 0:
            at_ns = clock.from_realtime_ns(realtime_ns, now_ns)
            # Never after the read, never before the connection's previous stamp (a step of the
            # calendar clock between the two readings would otherwise show).
            if at_ns > now_ns:
                at_ns = now_ns
            elif at_ns < self._last_ns:
                at_ns = self._last_ns
        else:
            at_ns = now_ns
            self._count_unstamped()
        self._last_ns = at_ns
        lane = self._lane
        try:
            if lane is not None and lane.relay(data, at_ns):
                return  # taken whole: parsed, counted, stamped and written to the client
            self._protocol.data_received_at(data, at_ns)
        except Exception as exc:
            # As uvloop's transports do: a protocol that failed on a read ends its connection
            # (its exchange fails, so its request is still recorded); the loop logs the error.
            self._fail(exc)
            raise

    def pause_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._fd)

    def resume_reading(self) -> None:
        if not self._reading and not self._closing:
            self._reading = True
            self._loop.add_reader(self._fd, self._reader or self._on_readable)

    # -- writing ---------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if self._closing:
            return
        if not self._out:
            try:
                sent = self._sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self._fail(exc)
                return
            if sent == len(data):
                return
            data = data[sent:]
        self._out += data
        if not self._writing:
            self._writing = True
            self._loop.add_writer(self._fd, self._on_writable)
        if not self._write_paused and len(self._out) > _WRITE_HIGH:
            self._write_paused = True
            self._protocol.pause_writing()

    def _on_writable(self) -> None:
        try:
            sent = self._sock.send(self._out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._fail(exc)
            return
        del self._out[:sent]
        if self._write_paused and len(self._out) <= _WRITE_LOW:
            self._write_paused = False
            self._protocol.resume_writing()
        if not self._out:
            self._writing = False
            self._loop.remove_writer(self._fd)
            if self._closing:
                self._finish(None)

    # -- ending ----------------------------------------------------------------------------

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        """Stop reading; end the connection once what was written has left."""
        if self._closing:
            return
        self._closing = True
        self.pause_reading()
        if not self._out:
            self._finish(None)

    def abort(self) -> None:
        """End the connection now, unsent bytes dropped."""
        self._closing = True
        self._finish(None)

    def _fail(self, exc: Exception) -> None:
        self._closing = True
        self._finish(exc)

    def _finish(self, exc: Exception | None) -> None:
        if self._closed:
            return
        self._closed = True
        self._out.clear()
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._fd)
        if self._writing:
            self._writing = False
            self._loop.remove_writer(self._fd)
        self._sock.close()
        self._lane = None
        if self._reader is not None:
            self._reader.close()  # it holds this transport and the protocol
        # Later, as asyncio's transports do: the protocol may be inside a call of its own.
        self._loop.call_soon(self._protocol.connection_lost, exc)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """The socket, or its addresses read when asked (not kept: a dict and its address
        tuples were ~0.4 KiB per connection, one connection per stream in flight); the
        default once the socket is closed."""
        try:
            if name == "socket":
                return self._sock
            if name == "peername":
                return self._sock.getpeername()
            if name == "sockname":
                return self._sock.getsockname()
        except OSError:
            pass
        return default


async def open_stamped(
    loop: asyncio.AbstractEventLoop,
    host: str,
    port: int,
    protocol: StampedProtocol,
    read_buffer: ReadBuffer,
) -> StampedTransport | socket.socket:
    """Connect to ``host:port`` (each address in turn, as `loop.create_connection` does). A
    `StampedTransport` when the kernel gives receive timestamps on the socket, else the
    connected socket, for the caller to hand to uvloop. `OSError` when no address answered."""
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    error: OSError | None = None
    for family, kind, proto, _name, address in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        except BaseException:
            sock.close()
            raise
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not enable(sock):
            return sock
        return StampedTransport(loop, sock, protocol, read_buffer)
    raise error or OSError(f"no address for {host}:{port}")
