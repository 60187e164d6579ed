"""The per-read hot path of a streamed answer (`MeteredRead`) and the paced client write."""

from __future__ import annotations

import asyncio
import os
from typing import Final

from sidecar import clock
from sidecar.meter import StreamMeter
from sidecar.proxy.builder import RecordBuilder
from sidecar.proxy.listener import WRITE_HIGH_WATER, ClientExchange
from sidecar.proxy.rxstamp import StampedTransport
from sidecar.proxy.timeouts import NEVER, Timeouts
from sidecar.proxy.upstream import UpstreamError, UpstreamExchange

# The clock as a C static in compiled code (`clock.monotonic_ns` is a lookup of the module
# global and then of its attribute, at every reading).
_monotonic_ns: Final = clock.monotonic_ns

# The C lane (`_tokenscan.Lane`): the whole per-read path of a stream's common read in one call,
# where the package was built with it. SIDECAR_C_LANE=off leaves every read to the Python path
# (what the lane must agree with: tests/test_lane.py; an A/B of the two in the benchmarks).
LaneType: type[Lane] | None
try:
    from sidecar.protocol._tokenscan import Lane

    LaneType = Lane
except ImportError:  # built without a C compiler: the Python path takes every read
    LaneType = None
if os.environ.get("SIDECAR_C_LANE", "on") == "off":
    LaneType = None


class MeteredRead:
    """The per-read hot path of a streamed answer, run inside the upstream connection's
    ``data_received`` (`on_read`): the measuring core (`StreamMeter`) parses, classifies,
    counts and stamps each read (its instant is the server-side stamp of every event in it),
    and what the read yields for the client is written at once (``exchange``; None: the meter
    forwards nothing). No task wakes up per read; the caller only waits for the end of the
    body (`start`), then `end` closes the meter (a stream cut short sets ``meter.fatal``) and
    raises a failure from inside the callback. Whatever happens, `settle` gives the builder
    what the meter counted.

    An object with slots rather than closures in a coroutine: a stream in flight holds it
    for its whole life, and this is ~0.8 KiB smaller per stream (tracemalloc).
    """

    __slots__ = (
        "upstream",
        "meter",
        "builder",
        "timeouts",
        "exchange",
        "trouble",
        "ended",
        "lane",
    )

    def __init__(
        self,
        upstream: UpstreamExchange,
        meter: StreamMeter,
        builder: RecordBuilder,
        timeouts: Timeouts,
        exchange: ClientExchange | None,
    ) -> None:
        self.upstream = upstream
        self.meter = meter
        self.builder = builder
        self.timeouts = timeouts
        self.exchange = exchange
        self.trouble: BaseException | None = None  # what went wrong inside the callback
        self.ended = False  # the meter was closed in the callback (`_end_in_read`)
        # The C lane, when this stream may have one (`start`): armed for the stream's first
        # read, and again whenever a read of the Python path left the stream in the state it
        # takes reads in, it takes the common read whole in the upstream transport's callback
        # (`rxstamp.StampedTransport`) instead of `on_read`; what it counted comes back
        # (`_take_lane`) before the Python path handles any read or ends the stream.
        self.lane: Lane | None = None

    def on_read(self, data: bytes, t_up: int) -> None:
        lane = self.lane
        if lane is not None:
            self._take_lane(lane)
        timeouts = self.timeouts
        # The idle deadline counts from when the proxy got to the read, not from ``t_up``
        # (the kernel's arrival stamp): a loop that fell behind must not time out a stream
        # whose bytes were waiting for it.
        timeouts.last_ns = _monotonic_ns()
        meter = self.meter
        try:
            out, n_events, n_token_events = meter.feed(data, t_up)
            if timeouts.ttft_at != NEVER and meter.offsets:
                timeouts.ttft_at = NEVER  # first_token(), inlined: this is per read
            upstream = self.upstream
            # `complete` first: a plain attribute, false for every read but the body's last.
            if (
                upstream.complete
                and upstream.last_read
                and meter.fatal is None
                and self.exchange is not None
            ):
                self._end_in_read(t_up, out, n_events, n_token_events)
                return
            if out and self.exchange is not None:
                self._deliver(out, n_events, n_token_events)
            if meter.fatal is not None:
                self.upstream.connection.abort()  # stop reading; `end` raises the failure
            elif lane is not None:
                self._arm_lane(lane)
        except BaseException as exc:  # never let a failure escape into the transport
            if self.trouble is None:
                self.trouble = exc
            self.upstream.connection.abort()

    def _deliver(self, out: bytes, n_events: int, n_token_events: int) -> None:
        exchange = self.exchange
        assert exchange is not None
        # `write_paced`, inlined: this is per read.
        if exchange.write(out) > WRITE_HIGH_WATER and not self.upstream.complete:
            self.upstream.pause()
            exchange.connection.when_writable(self.upstream.resume)
        builder = self.builder
        builder.down_events += n_events
        if n_token_events:
            builder.client_token_writes(_monotonic_ns(), n_token_events)

    def _end_in_read(self, t_up: int, out: bytes, n_events: int, n_token_events: int) -> None:
        """The upstream's body ended in this read (vLLM's [DONE] and the end of the chunked
        body usually arrive together): close the meter here, and when the stream ended well,
        the client's last events and the end of its response leave in one write instead of
        two (strace of a short stream: five writes per request became four)."""
        meter, builder, exchange = self.meter, self.builder, self.exchange
        assert exchange is not None
        self.ended = True
        builder.up_end_ns = builder.offset(t_up)
        tail, n_tail, n_tail_tokens = meter.close(t_up)
        if tail:
            out = out + tail if out else tail
            n_events += n_tail
            n_token_events += n_tail_tokens
        if meter.fatal is not None:  # no [DONE]: the relay fails the request on `meter.fatal`
            if out:
                self._deliver(out, n_events, n_token_events)
            return
        exchange.end(out)
        builder.down_events += n_events
        if n_token_events:
            builder.client_token_writes(_monotonic_ns(), n_token_events)

    def _arm_lane(self, lane: Lane) -> None:
        """Let the C lane take the next reads, when the stream is where it can: the upstream
        between whole chunks and read straight to us, the client framed chunk by chunk with
        nothing held, and the meter before its first event or where its own one-event lane
        would take a read (`StreamMeter.lane_start`)."""
        exchange = self.exchange
        if (
            self.trouble is None
            and exchange is not None
            and exchange.frames_chunks
            and self.upstream.between_whole_chunks
        ):
            start = self.meter.lane_start()
            if start is not None:
                lane.arm(*start)

    def _take_lane(self, lane: Lane) -> None:
        """Disarm the C lane and give the meter and the builder what it counted meanwhile,
        and what it took of a stream's end that came over several reads."""
        taken = lane.take()
        if taken is not None:
            up, down, tokens, gained, last_cumulative, exact, usage, other, carry = taken
            self.meter.take_lane(up, tokens, gained, last_cumulative, exact, usage, other, carry)
            self.builder.client_token_offsets(down)
            self.builder.down_events += other
        if lane.end_stage:
            end = lane.take_end()
            assert end is not None
            self.builder.down_events += self.meter.take_end_in_lane(*end)

    def first_in_lane(
        self, model: str | None, response_id: str | None, other_events: int, first_token: bool
    ) -> None:
        """The C lane took the stream's first read (its first token, chat's role chunk before
        it or alone; `_tokenscan.c`, "The first read"), or after a role chunk alone the read of
        the first token (``model`` None): the meter gets what it would have read off the read
        besides the counts (`StreamMeter.first_in_lane`), ``other_events`` (the role chunk) were
        forwarded too, and with the ``first_token`` the TTFT deadline is met. Called after the
        lane's write, before it returns."""
        try:
            if first_token:
                self.timeouts.ttft_at = NEVER
            self.meter.first_in_lane(model, response_id, other_events)
            self.builder.down_events += other_events
        except BaseException as exc:  # never let a failure escape into the transport
            if self.trouble is None:
                self.trouble = exc
            self.upstream.connection.abort()

    def end_in_lane(
        self, out: bytes, at_ns: int, finish_reason: str, fingerprint: str | None, usage: bool
    ) -> None:
        """The C lane took the read that ends the stream (the finish, usage and [DONE] chunks
        and the end of the chunked body, `_tokenscan.c`; or the last of the reads they came
        in, the lane having written the others): what `on_read` and `_end_in_read` do with
        it. ``out``: the read's events for the client, as `StreamMeter` would have made them
        (they leave with the end of the client's answer, in one write; none when [DONE] came
        in an earlier read); ``at_ns``: the read's instant; ``usage``: the client gets the
        usage chunk (it asked for usage). The lane counts the read's token events (the finish
        chunk's among them) once this returns, with their client-side instant after the
        write."""
        try:
            self.ended = True
            self.meter.end_in_lane(finish_reason, fingerprint)
            builder = self.builder
            builder.up_end_ns = builder.offset(at_ns)
            exchange = self.exchange
            assert exchange is not None  # the lane writes to it
            exchange.end(out)
            builder.down_events += 2 if usage else 1  # the usage chunk, [DONE]
            self.upstream.end_in_lane()
        except BaseException as exc:  # never let a failure escape into the transport
            if self.trouble is None:
                self.trouble = exc
            self.upstream.connection.abort()

    def on_client_full(self) -> None:
        """The C lane's write left more than the high-water mark in the client's buffer: what
        `_deliver` does then (the lane has disarmed itself)."""
        exchange = self.exchange
        assert exchange is not None
        self.upstream.pause()
        exchange.connection.when_writable(self.upstream.resume)

    def _open_lane(self, exchange: ClientExchange) -> None:
        """The C lane for this stream, when it may have one: the package built with it, an
        upstream read by `StampedTransport` (TLS and ``--server-stamps read`` are not), and a
        meter that only forwards and counts."""
        upstream_transport = self.upstream.connection.transport
        client = exchange.connection.transport
        settings = self.meter.lane_settings()
        if (
            LaneType is None
            or settings is None
            or client is None
            or not isinstance(upstream_transport, StampedTransport)
        ):
            return
        max_event_bytes, strip, drop_usage_chunk = settings
        self.lane = LaneType(
            client,
            self,
            self.meter.origin_ns,
            WRITE_HIGH_WATER,
            max_event_bytes,
            strip,
            drop_usage_chunk,
            exchange.connection.fd,
        )
        upstream_transport.lane = self.lane
        self.timeouts.lane = self.lane  # the idle timeout reads its reads' instants
        self._arm_lane(self.lane)

    def start(self) -> asyncio.Future[None]:
        """Hand the upstream's reads to `on_read` (those already here first) and release the
        client's held head; returns the future of the body's end, for the caller to await and
        then call `end` (and `settle` in any case). Awaited by the relay itself rather than
        inside a coroutine of this object: a stream in flight holds one coroutine less
        (~0.3 KiB)."""
        done = self.upstream.stream_body(self.on_read)
        if self.exchange is not None:
            # Its head was held for them (`ClientExchange.start`), and waits no longer.
            self.exchange.flush()
            if not done.done():
                self._open_lane(self.exchange)
        return done

    def end(self, failure: UpstreamError | None) -> None:
        """The body ended (``failure``: how the upstream's connection failed, if it did).
        Raises a failure of our own making (a read's trouble) or the upstream's; else closes
        the meter (a stream cut short sets ``meter.fatal``) and forwards what it still held."""
        meter = self.meter
        if self.lane is not None:
            self._take_lane(self.lane)
        if failure is not None and not (self.trouble is not None or meter.fatal is not None):
            raise failure  # otherwise we aborted the upstream ourselves: the cause is below
        if self.trouble is not None:
            raise self.trouble
        if self.ended:
            return
        self.builder.up_end_ns = self.builder.offset(_monotonic_ns())
        if meter.fatal is None:
            out, n_events, n_token_events = meter.close(_monotonic_ns())
            if out and self.exchange is not None:
                self._deliver(out, n_events, n_token_events)

    def settle(self) -> None:
        """However the stream ended (`end` raised, the caller was cancelled): the builder
        takes what the meter counted."""
        lane, self.lane = self.lane, None
        try:
            if lane is not None:
                self._take_lane(lane)
        finally:
            self.builder.take_stream(self.meter)
            # Not kept once raised (or overtaken by a cancellation): its traceback holds
            # `on_read`'s frame, which holds this object, a cycle around the whole request that
            # only a full collection would free.
            self.trouble = None
            if lane is not None:
                # `self.timeouts.lane` is kept: the closed lane still says when its last read
                # came, and the idle deadline counts from it until the request ends (a
                # client's drain, an error's answer).
                lane.close()  # its references (this object among them) let go
                transport = self.upstream.connection.transport
                if isinstance(transport, StampedTransport) and transport.lane is lane:
                    transport.lane = None

    async def body(self) -> None:
        """`start`, await, `end`, `settle`, for a caller with nothing to do around them."""
        try:
            try:
                await self.start()
            except UpstreamError as exc:
                self.end(exc)
            else:
                self.end(None)
        finally:
            self.settle()


def write_paced(exchange: ClientExchange, upstream: UpstreamExchange, data: bytes) -> None:
    """Write to the client; past the high-water mark of its buffer, stop reading the upstream
    until the client drained (TCP back-pressure to the upstream, bounded memory here)."""
    if exchange.write(data) > WRITE_HIGH_WATER and not upstream.complete:
        upstream.pause()
        exchange.connection.when_writable(upstream.resume)
