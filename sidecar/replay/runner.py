"""Sending a replay: open loop on a schedule, or closed loop at a fixed concurrency.

Open loop means open loop: the sender fires each request at its scheduled instant and never
waits on responses (each request is its own task); a slow server shows up as latency and as
concurrency, not as a lower offered rate. For every request it records the scheduled and the
actual send instant: lateness = actual - scheduled is the sender's own error, reported beside
every result. Pacing sleeps until ~1.5 ms before the instant (uvloop timers have millisecond
granularity), then yields to the loop until the instant has come.

The replayer is a client: it measures each request from the client vantage by the same
definitions as the proxy (spec/metrics.md), and builds the same `RequestRecord`s.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import uuid
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

from sidecar import clock, stats
from sidecar.meter import StreamFailure, StreamMeter
from sidecar.protocol.openai import ErrorInfo, Usage, safe_error_type
from sidecar.record import (
    Int64s,
    Outcome,
    RequestRecord,
    Timeline,
    TokenSource,
    untrack_finished,
)

if TYPE_CHECKING:
    from sidecar.replay.live import ReplayCounters

SPIN_NS = 1_500_000  # sleep until this close to the instant, then yield until it comes


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    index: int
    at_s: float  # scheduled send, seconds from the run's start (ignored in closed loop)
    path: str
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class SentRequest:
    index: int
    scheduled_ns: int  # offset from the run's start (closed loop: = actual)
    actual_ns: int  # offset from the run's start, taken just before the request is sent
    record: RequestRecord

    @property
    def lateness_ns(self) -> int:
        return self.actual_ns - self.scheduled_ns

    @property
    def end_ns(self) -> int:
        """When the request ended (`stats.end_offset_ns`), as an offset from the run's
        start."""
        return self.actual_ns + stats.end_offset_ns(self.record)


@contextlib.contextmanager
def out_of_collection() -> Iterator[None]:
    """While a replay sends: what exists already (the plan above all: a body dict, its
    messages and the planned request, ~5 tracked objects per request) left out of CPython's
    cycle collector, after one collection of what is garbage now (`gc.freeze`), and given
    back after (`gc.unfreeze`, unless the process had frozen objects of its own before).
    A full collection scans every tracked object, and stops the sender meanwhile: over a
    40 s replay of 80,000 requests at 2,000/s, eight took up to 240 ms each, every send due
    then went late by as much (benchmarks/RESULTS.md, "Session 30"). Call it before the
    run's start instant is chosen: the collection here took 0.1 s for 80,000 planned
    requests. The results a run keeps are out of reach too (`_Kept`)."""
    frozen_before = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:
            gc.unfreeze()


class _Kept:
    """The finished requests a run keeps until it returns, with no object per request that
    the cycle collector would scan: their instants in arrays, their records untracked
    (`record.untrack_finished`). `SentRequest`s are made again at the end, when nothing is
    being sent."""

    __slots__ = ("index", "scheduled_ns", "actual_ns", "records")

    def __init__(self) -> None:
        self.index = array("q")
        self.scheduled_ns = array("q")
        self.actual_ns = array("q")
        self.records: list[RequestRecord] = []

    def add(self, sent: SentRequest) -> None:
        untrack_finished(sent.record)
        self.index.append(sent.index)
        self.scheduled_ns.append(sent.scheduled_ns)
        self.actual_ns.append(sent.actual_ns)
        self.records.append(sent.record)

    def sent(self) -> list[SentRequest]:
        """The requests kept, in the order of their index."""
        order = sorted(range(len(self.records)), key=self.index.__getitem__)
        return [
            SentRequest(self.index[i], self.scheduled_ns[i], self.actual_ns[i], self.records[i])
            for i in order
        ]


async def sleep_until(deadline_ns: int) -> None:
    while True:
        remaining = deadline_ns - clock.monotonic_ns()
        if remaining <= 0:
            return
        if remaining > SPIN_NS + 500_000:
            await asyncio.sleep((remaining - SPIN_NS) / 1e9)
        else:
            await asyncio.sleep(0)


class Sender:
    """Sends planned requests to ``target`` and measures them (client vantage)."""

    def __init__(
        self,
        target: str,
        session: aiohttp.ClientSession,
        *,
        request_timeout_s: float = 600.0,
        request_id_prefix: str = "replay",
        counters: ReplayCounters | None = None,
    ) -> None:
        self.target = target.rstrip("/")
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s or None)
        # Every request is sent as X-Request-Id "<prefix>-<index>-<random>"; a measuring proxy
        # keeps that id, so its view of one run can be selected by the prefix.
        self.request_id_prefix = request_id_prefix
        self.in_flight = 0
        self.max_in_flight = 0
        self.done = 0
        self.failed = 0
        self.counters = counters  # live numbers for --metrics-listen (shared between workers)

    async def send(
        self, planned: PlannedRequest, run_start_ns: int, scheduled_ns: int | None
    ) -> SentRequest:
        stream = planned.body.get("stream") is True
        request_id = f"{self.request_id_prefix}-{planned.index}-{uuid.uuid4().hex[:12]}"
        answer = _Answer()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        wall, start = clock.anchor()
        if self.counters is not None:
            self.counters.sent(
                None if scheduled_ns is None else start - run_start_ns - scheduled_ns
            )
        try:
            async with self.session.post(
                self.target + planned.path,
                json=planned.body,
                headers={"X-Request-Id": request_id},
                timeout=self.timeout,
            ) as response:
                answer.status = response.status
                if answer.status != 200 or not stream:
                    answer.read_body(answer.status, await response.read())
                else:
                    answer.meter = await _metered(response, start)
        except asyncio.TimeoutError:
            answer.failure = StreamFailure(Outcome.TIMEOUT, "request_timeout", 504, "")
        except (aiohttp.ClientError, OSError) as exc:
            answer.failure = StreamFailure(Outcome.UPSTREAM_ERROR, type(exc).__name__, 502, "")
        finally:
            self.in_flight -= 1
        record = answer.record(planned, request_id, wall, clock.monotonic_ns() - start, self.target)
        self.done += 1
        self.failed += record.outcome is not Outcome.OK
        if self.counters is not None:
            self.counters.completed(record.outcome)
        actual = start - run_start_ns
        return SentRequest(
            planned.index, actual if scheduled_ns is None else scheduled_ns, actual, record
        )


async def _metered(response: aiohttp.ClientResponse, start: int) -> StreamMeter:
    """A streamed answer read through the same measuring core as the proxy's: the client
    vantage here."""
    meter = StreamMeter(start, forward=False)
    async for chunk in response.content.iter_any():
        meter.feed(chunk, clock.monotonic_ns())
        if meter.fatal is not None:
            break
    meter.close(clock.monotonic_ns())
    return meter


class _Answer:
    """What one request got back: a metered stream, or a whole body's usage, or a failure."""

    __slots__ = ("failure", "finish_reason", "meter", "status", "usage")

    def __init__(self) -> None:
        self.meter: StreamMeter | None = None
        self.usage: Usage | None = None  # of a non-streamed answer
        self.failure: StreamFailure | None = None
        self.status: int | None = None
        self.finish_reason: str | None = None

    def read_body(self, status: int, data: bytes) -> None:
        """A whole (non-streamed or error) body: its usage, or the error it names."""
        obj = _json(data)
        if status != 200:
            error = ErrorInfo.from_obj(obj.get("error")) if isinstance(obj, dict) else None
            self.failure = StreamFailure(
                Outcome.HTTP_ERROR, safe_error_type(error, status), status, ""
            )
        elif isinstance(obj, dict):
            self.usage = Usage.from_obj(obj.get("usage"))
            self.finish_reason = _finish_reason(obj)

    def record(
        self, planned: PlannedRequest, request_id: str, wall: int, elapsed_ns: int, target: str
    ) -> RequestRecord:
        """The request's record, ended ``elapsed_ns`` after it was sent."""
        stream = planned.body.get("stream") is True
        failure = self.failure
        meter = self.meter
        finish_reason = self.finish_reason
        if meter is not None:
            # The first thing that went wrong is the cause: a stream failure read before a
            # transport error or a timeout.
            failure = meter.failure or failure
            n_in, n_out, n_cached, source = meter.token_totals
            finish_reason = meter.finish_reason
            client = Timeline(
                start_ns=0,
                offsets_ns=Int64s(meter.offsets),
                tokens=Int64s(meter.token_counts()),
                end_ns=elapsed_ns,
                events_total=meter.events,
            )
            engine = meter.engine
        else:
            usage = self.usage
            n_in = usage.prompt_tokens if usage else None
            n_out = usage.completion_tokens if usage else None
            n_cached = usage.cached_tokens if usage else None
            source = TokenSource.USAGE_TOTAL if usage else TokenSource.NONE
            client = Timeline(start_ns=0, end_ns=elapsed_ns)
            engine = None
        return RequestRecord(
            request_id=request_id,
            wall_time_ns=wall,
            outcome=failure.outcome if failure is not None else Outcome.OK,
            endpoint="chat" if planned.path.endswith("/chat/completions") else "completions",
            model=planned.body.get("model"),
            client_stream=stream,
            upstream_stream=stream,
            client=client,
            engine=engine,
            n_in=n_in,
            n_out=n_out,
            n_cached=n_cached,
            token_source=source,
            finish_reason=finish_reason,
            http_status=self.status,
            error_type=failure.error_type if failure is not None else None,
            replica=target.split("://", 1)[-1],
        )


def _json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def _finish_reason(obj: dict[str, Any]) -> str | None:
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        reason = choices[0].get("finish_reason")
        return reason if isinstance(reason, str) else None
    return None


async def open_loop(
    sender: Sender,
    plan: Sequence[PlannedRequest],
    start_ns: int,
    on_done: Callable[[SentRequest], None] | None = None,
) -> list[SentRequest]:
    """Fire each request at ``start_ns + at_s``; never wait on responses while sending."""
    results = _Kept()
    tasks: set[asyncio.Task[SentRequest]] = set()

    def finished(task: asyncio.Task[SentRequest]) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is None:
            result = task.result()
            results.add(result)
            if on_done is not None:
                on_done(result)

    for planned in sorted(plan, key=lambda p: p.at_s):
        scheduled = int(planned.at_s * 1e9)
        await sleep_until(start_ns + scheduled)
        task = asyncio.create_task(sender.send(planned, start_ns, scheduled))
        tasks.add(task)
        task.add_done_callback(finished)
    while tasks:
        await asyncio.wait(set(tasks))
    return results.sent()


async def closed_loop(
    sender: Sender,
    plan: Sequence[PlannedRequest],
    concurrency: int,
    start_ns: int,
    on_done: Callable[[SentRequest], None] | None = None,
) -> list[SentRequest]:
    """At most ``concurrency`` requests outstanding; the next leaves when one finishes. The
    first ``concurrency`` leave at ``start_ns``, the instant every offset counts from (sending
    earlier made their offsets negative and the run's duration short)."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    await sleep_until(start_ns)
    queue = list(plan)
    queue.reverse()
    results = _Kept()

    async def worker() -> None:
        while queue:
            planned = queue.pop()
            result = await sender.send(planned, start_ns, None)
            results.add(result)
            if on_done is not None:
                on_done(result)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(plan)))))
    return results.sent()
