"""The channel between a worker and the collector: length-prefixed frames on a Unix socketpair.

Each frame is ``u32 payload length | u8 kind | payload`` (little-endian). Records travel in
`recordwire`'s binary form; the few control messages (config, ready, status, health, stop) are
small JSON objects, a handful per second. Both ends read through `FrameProtocol`, which splits
frames in ``data_received`` and hands each to a synchronous callback: no task wake-up and no
coroutine per frame.

Writing is the caller's business, through the asyncio transport: it never blocks. The worker
side checks the transport's write buffer against its bound before each record and drops (and
counts) rather than buffer without end (see worker.py).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import struct
from collections.abc import Callable
from typing import Any, Final, cast

log = logging.getLogger(__name__)

HEADER: Final = struct.Struct("<IB")
# A record with opt-in text holds at most a 16 MiB body and its completion: anything far
# beyond is a corrupt stream, not a frame to buffer.
MAX_FRAME_BYTES: Final = 256 * 1024 * 1024
# Frames queued within this long leave in one write (records reach the collector this much
# later at most; nothing there is per request but the window, read at scrape time). Each write
# wakes the collector, which shares a core with a worker: at 10 ms (a batch of ~2 records at
# 200 records/s) the collector spent 2.7-3.5 µs per relayed event, at 50 ms 1.9-2.5
# (benchmarks/RESULTS.md, "The channel's batches").
FLUSH_DELAY_S = 0.05
# ... or at once, when this much is queued (at high record rates: a write of a size the
# socket's buffer takes whole, and no more than this waiting in the worker).
FLUSH_BYTES = 256 * 1024


class Kind(enum.IntEnum):
    CONFIG = 1  # collector -> worker, first frame: settings, worker id, capture salt
    READY = 2  # worker -> collector: listening (or ERROR instead)
    RECORD = 3  # worker -> collector: one finished record (recordwire)
    STATUS = 4  # worker -> collector: counters, periodic and at exit
    HEALTH = 5  # collector -> worker: replica health after a round of checks
    STOP = 6  # collector -> worker: stop accepting, finish in-flight requests, exit
    ERROR = 7  # worker -> collector: could not start (one line of why), then exit


def frame(kind: Kind, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), kind) + payload


def json_frame(kind: Kind, message: dict[str, Any]) -> bytes:
    return frame(kind, json.dumps(message, separators=(",", ":")).encode())


def parse_json(payload: bytes) -> dict[str, Any]:
    message = json.loads(payload)
    if not isinstance(message, dict):
        raise ValueError("a control message is a JSON object")
    return message


class FrameProtocol(asyncio.Protocol):
    """Splits the byte stream into frames; ``on_frame(kind, payload)`` runs for each, in order,
    synchronously. ``on_lost`` runs once when the other end closed or the stream broke."""

    def __init__(self, on_frame: Callable[[int, bytes], None], on_lost: Callable[[], None]) -> None:
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        # Kept: each get_running_loop() is a getpid() syscall on CPython 3.11.
        self._loop = asyncio.get_running_loop()
        self.closed = self._loop.create_future()
        self.handler_errors = 0
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._flush_handle: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; they have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        pos = 0
        size = len(buffer)
        while size - pos >= HEADER.size:
            length, kind = HEADER.unpack_from(buffer, pos)
            if length > MAX_FRAME_BYTES:
                log.error("channel: a frame of %d bytes: the stream is corrupt; closing it", length)
                self._buffer = bytearray()
                if self.transport is not None:
                    self.transport.close()
                return
            end = pos + HEADER.size + length
            if end > size:
                break
            payload = bytes(buffer[pos + HEADER.size : end])
            pos = end
            try:
                self._on_frame(kind, payload)
            except Exception:
                # One bad frame must not close the channel (asyncio would, on an exception
                # escaping data_received): count it, say it once in a while, go on.
                self.handler_errors += 1
                if self.handler_errors == 1 or self.handler_errors % 1000 == 0:
                    log.exception(
                        "channel: a frame of kind %d failed (%d so far)", kind, self.handler_errors
                    )
        if pos:
            del buffer[:pos]

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        self._pending = []
        self._pending_bytes = 0
        if not self.closed.done():
            self.closed.set_result(None)
        self._on_lost()

    def send(self, data: bytes) -> bool:
        """Queue a frame; False when the channel is closed (nothing queued). Frames leave in
        order, together, at most ``FLUSH_DELAY_S`` later (at once from ``FLUSH_BYTES`` queued):
        one write (and one wake-up of the other process) per batch instead of per record. With
        the other end on the same core, a write per record cost a worker 13% of its CPU at 240
        records/s."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        self._pending.append(data)
        self._pending_bytes += len(data)
        if self._pending_bytes >= FLUSH_BYTES:
            self.flush()
        elif self._flush_handle is None:
            self._flush_handle = self._loop.call_later(FLUSH_DELAY_S, self.flush)
        return True

    def flush(self) -> None:
        """Write what is queued now."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        pending, self._pending = self._pending, []
        self._pending_bytes = 0
        transport = self.transport
        if pending and transport is not None and not transport.is_closing():
            transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def buffered(self) -> int:
        """Bytes queued or written but not yet taken by the kernel."""
        transport = self.transport
        in_transport = transport.get_write_buffer_size() if transport is not None else 0
        return in_transport + self._pending_bytes
