"""The channel between a worker and the collector: length-prefixed frames on a Unix socketpair.

Each frame is ``u32 payload length | u8 kind | payload`` (little-endian). Records travel in
`recordwire`'s binary form; the few control messages (config, ready, status, health, stop) are
small JSON objects, a handful per second. Both ends read through `FrameProtocol`, which splits
frames in ``data_received`` and hands each to a synchronous callback: no task wake-up and no
coroutine per frame.

Writing is the caller's business, through the asyncio transport: it never blocks. The worker
side (`ChannelSink`, at the end) checks the transport's write buffer against its bound before
each record and drops (and counts) rather than buffer without end. The sink is here, compiled
with the request path (setup.py), rather than in worker.py: a record's hand-off ran two
interpreted frames of every request there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import json
import logging
import struct
import time
from collections.abc import Callable
from typing import Any, Final, cast

from sidecar.hooks import SINK_TIMEOUT_S, TAKEN, WRITTEN, LogThrottle
from sidecar.proxy.recordwire import encode_record, native_encoder
from sidecar.record import RequestRecord

log = logging.getLogger(__name__)

HEADER: Final = struct.Struct("<IB")
# A record with opt-in text holds at most a 16 MiB body and its completion: anything far
# beyond is a corrupt stream, not a frame to buffer.
MAX_FRAME_BYTES: Final = 256 * 1024 * 1024
# Frames queued within this long leave in one write (records reach the collector this much
# later at most; nothing there is per request but the window, read at scrape time). Each write
# wakes the collector, which shares a core with a worker: at 10 ms (a batch of ~2 records at
# 200 records/s) the collector spent 2.7-3.5 µs per relayed event, at 50 ms 1.9-2.5
# (benchmarks/RESULTS.md, "The channel's batches"); at 250 ms the collector up to 0.5 µs less
# than at 50 (median 0.22, lower in 8 of 9 paired runs: "Session 29: the channel's batches every
# 250 ms"). Control frames do not wait (`send(..., now=True)`), nor does a worker's status
# (every 0.25 s), which takes the records queued before it along: at the status interval,
# records mostly leave with a status, one write and one wake-up for both.
FLUSH_DELAY_S = 0.25
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

    def send(self, data: bytes, *, now: bool = False) -> bool:
        """Queue a frame; False when the channel is closed (nothing queued). Frames leave in
        order, together, at most ``FLUSH_DELAY_S`` later (at once from ``FLUSH_BYTES`` queued):
        one write (and one wake-up of the other process) per batch instead of per record. With
        the other end on the same core, a write per record cost a worker 13% of its CPU at 240
        records/s. ``now``: a control frame (configuration, readiness, health, stop) that the
        other side waits for; it leaves at once, with whatever was queued before it."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        self._pending.append(data)
        self._pending_bytes += len(data)
        if now or self._pending_bytes >= FLUSH_BYTES:
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


# -- the worker's sink ---------------------------------------------------------------------------

_NATIVE_ENCODE: Final = native_encoder()


class ChannelSink:
    """Sends each finished record to the collector; synchronous, never waits.

    Over ``bound`` bytes already waiting in the transport (the collector is slow or stopped),
    the record is dropped and counted in ``dropped_full``; with the channel closed (or this
    sink), in ``dropped_closed``; a record the wire format cannot hold, in ``encode_errors``.
    So at every instant ``taken == sent + dropped_full + dropped_closed + encode_errors``.

    A `hooks.Sink`: ``flush`` hands what the channel holds to the transport and waits (off the
    loop's thread only) until the kernel took it; ``close`` flushes, then refuses later records.
    The channel itself is the worker's: it still carries the final status after this closes.
    """

    name = "channel"

    def __init__(self, protocol: FrameProtocol, bound: int) -> None:
        self.protocol = protocol
        self.bound = bound
        self.sent = 0
        self.dropped_full = 0
        self.dropped_closed = 0
        self.encode_errors = 0
        self._closed = False
        self._log_throttle = LogThrottle()
        # The loop the channel's transport runs on: flush and close may be called from another
        # thread (the sinks close in one, `asyncio.to_thread`), and a transport is not
        # thread-safe.
        self._loop = asyncio.get_running_loop()

    @property
    def taken(self) -> int:
        return self.sent + self.dropped_full + self.dropped_closed + self.encode_errors

    def on_record(self, record: RequestRecord) -> None:
        if self._closed:
            self.dropped_closed += 1
            return
        if self.protocol.buffered() > self.bound:
            self.dropped_full += 1
            return
        payload: bytes | None = None
        if _NATIVE_ENCODE is not None:
            # The C encoder straight from here (encode_record is interpreted); whatever it
            # leaves or refuses goes through encode_record, which says why in a ValueError.
            try:
                payload = _NATIVE_ENCODE(record)
            except Exception:
                payload = None
        try:
            if payload is None:
                payload = encode_record(record)
        except ValueError:
            self.encode_errors += 1
            if self._log_throttle.ready():
                log.exception(
                    "a record could not be encoded for the collector (%d so far)",
                    self.encode_errors,
                )
            return
        if self.protocol.send(frame(Kind.RECORD, payload)):
            self.sent += 1
        else:
            self.dropped_closed += 1

    def counters(self) -> dict[str, int]:
        # The reasons as sidecar_channel_dropped_records_total names them.
        return {
            TAKEN: self.taken,
            WRITTEN: self.sent,
            "dropped_channel_full": self.dropped_full,
            "dropped_channel_closed": self.dropped_closed,
            "dropped_encode_error": self.encode_errors,
        }

    def flush(self, timeout_s: float = SINK_TIMEOUT_S) -> bool:
        """Write what the channel holds. On the loop's thread this cannot wait for the kernel
        (the loop does the writing): True when nothing is left in the transport already.
        From another thread: True once the kernel took everything, within ``timeout_s``."""
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop or self._loop.is_closed():
            self.protocol.flush()
            return self.protocol.buffered() == 0
        waiting = asyncio.run_coroutine_threadsafe(self._drain(timeout_s), self._loop)
        try:
            return waiting.result(timeout_s + 1.0)
        except (TimeoutError, concurrent.futures.TimeoutError):
            waiting.cancel()
            return False

    async def _drain(self, timeout_s: float) -> bool:
        self.protocol.flush()
        deadline = time.monotonic() + timeout_s
        # No event says "the kernel took it" (asyncio's pause/resume_writing only fire at the
        # transport's high-water marks): polled, as `Worker._drain` does at exit.
        while self.protocol.buffered() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self.protocol.buffered() == 0

    def close(self, timeout_s: float = SINK_TIMEOUT_S) -> None:
        if self._closed:
            return
        self._closed = True
        self.flush(timeout_s)
