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
import json
import uuid
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

from sidecar import clock
from sidecar.protocol.openai import (
    ChunkKind,
    ErrorInfo,
    TokenCounter,
    Usage,
    classify_chunk,
    safe_error_type,
)
from sidecar.protocol.sse import SSEError, SSEParser
from sidecar.record import (
    EngineTiming,
    Int64s,
    Outcome,
    RequestRecord,
    Timeline,
    TokenSource,
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

    def __init__(self, target: str, session: aiohttp.ClientSession, *,
                 request_timeout_s: float = 600.0, request_id_prefix: str = "replay",
                 counters: ReplayCounters | None = None) -> None:
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

    async def send(self, planned: PlannedRequest, run_start_ns: int,
                   scheduled_ns: int | None) -> SentRequest:
        endpoint = "chat" if planned.path.endswith("/chat/completions") else "completions"
        stream = planned.body.get("stream") is True
        request_id = f"{self.request_id_prefix}-{planned.index}-{uuid.uuid4().hex[:12]}"
        offsets = array("q")  # token-carrying events: when (ns since start) and how many
        tokens = array("q")
        events = 0
        usage: Usage | None = None
        engine: EngineTiming | None = None
        counter = TokenCounter()
        outcome = Outcome.OK
        status: int | None = None
        error_type: str | None = None
        finish_reason: str | None = None
        saw_done = False
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        wall, start = clock.anchor()
        if self.counters is not None:
            self.counters.sent(None if scheduled_ns is None
                               else start - run_start_ns - scheduled_ns)
        try:
            async with self.session.post(self.target + planned.path, json=planned.body,
                                         headers={"X-Request-Id": request_id},
                                         timeout=self.timeout) as response:
                status = response.status
                if status != 200 or not stream:
                    data = await response.read()
                    obj = _json(data)
                    if status != 200:
                        outcome = Outcome.HTTP_ERROR
                        error = ErrorInfo.from_obj(obj.get("error")) if isinstance(
                            obj, dict) else None
                        error_type = safe_error_type(error, status)
                    elif isinstance(obj, dict):
                        usage = Usage.from_obj(obj.get("usage"))
                        finish_reason = _finish_reason(obj)
                else:
                    parser = SSEParser()
                    async for chunk in response.content.iter_any():
                        now = clock.monotonic_ns()
                        for event in parser.feed(chunk):
                            if event.data is None:
                                continue
                            events += 1
                            info = classify_chunk(event.data)
                            n_tokens = counter.observe(info)
                            kind = info.kind
                            if kind is ChunkKind.TOKEN:
                                offsets.append(now - start)
                                tokens.append(n_tokens)
                            elif kind is ChunkKind.DONE:
                                saw_done = True
                            elif kind is ChunkKind.ERROR:
                                outcome = Outcome.HTTP_ERROR
                                error_type = safe_error_type(info.error, 500)
                            elif kind is ChunkKind.MALFORMED and outcome is Outcome.OK:
                                outcome, error_type = Outcome.UPSTREAM_ERROR, "malformed_chunk"
                            if info.usage is not None:
                                usage = info.usage
                            if info.metrics is not None:
                                m = info.metrics
                                engine = EngineTiming(m.time_to_first_token_ms,
                                                      m.generation_time_ms, m.queue_time_ms,
                                                      m.mean_itl_ms, m.tokens_per_second)
                            if info.finish_reason is not None:
                                finish_reason = info.finish_reason
                    if not saw_done and outcome is Outcome.OK:
                        outcome, error_type = Outcome.UPSTREAM_ERROR, "stream_cut"
        except asyncio.TimeoutError:
            outcome, error_type = Outcome.TIMEOUT, "request_timeout"
        except SSEError:
            outcome, error_type = Outcome.UPSTREAM_ERROR, "oversized_event"
        except (aiohttp.ClientError, OSError) as exc:
            outcome, error_type = Outcome.UPSTREAM_ERROR, type(exc).__name__
        finally:
            self.in_flight -= 1
        end = clock.monotonic_ns()
        self.done += 1
        self.failed += outcome is not Outcome.OK
        if self.counters is not None:
            self.counters.completed(outcome)
        n_out: int | None
        if usage is not None:
            # Per-event counts are exact only when every chunk carried cumulative usage.
            exact_events = stream and counter.exact and bool(offsets)
            source = TokenSource.USAGE if exact_events else TokenSource.USAGE_TOTAL
            n_out = usage.completion_tokens
        elif counter.total:
            source, n_out = TokenSource.CHUNK_COUNT, counter.total
        else:
            source, n_out = TokenSource.NONE, None
        record = RequestRecord(
            request_id=request_id,
            wall_time_ns=wall,
            outcome=outcome,
            endpoint=endpoint,
            model=planned.body.get("model"),
            client_stream=stream,
            upstream_stream=stream,
            client=Timeline(start_ns=0, offsets_ns=Int64s(offsets), tokens=Int64s(tokens),
                            end_ns=end - start,
                            events_total=events),
            engine=engine,
            n_in=usage.prompt_tokens if usage else None,
            n_out=n_out,
            n_cached=usage.cached_tokens if usage else None,
            token_source=source,
            finish_reason=finish_reason,
            http_status=status,
            error_type=error_type,
            replica=self.target.split("://", 1)[-1],
        )
        actual = start - run_start_ns
        return SentRequest(planned.index, actual if scheduled_ns is None else scheduled_ns,
                           actual, record)


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


async def open_loop(sender: Sender, plan: Sequence[PlannedRequest], start_ns: int,
                    on_done: Callable[[SentRequest], None] | None = None) -> list[SentRequest]:
    """Fire each request at ``start_ns + at_s``; never wait on responses while sending."""
    results: list[SentRequest] = []
    tasks: set[asyncio.Task[SentRequest]] = set()

    def finished(task: asyncio.Task[SentRequest]) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is None:
            result = task.result()
            results.append(result)
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
    return sorted(results, key=lambda r: r.index)


async def closed_loop(sender: Sender, plan: Sequence[PlannedRequest], concurrency: int,
                      start_ns: int,
                      on_done: Callable[[SentRequest], None] | None = None) -> list[SentRequest]:
    """At most ``concurrency`` requests outstanding; the next leaves when one finishes."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    queue = list(plan)
    queue.reverse()
    results: list[SentRequest] = []

    async def worker() -> None:
        while queue:
            planned = queue.pop()
            result = await sender.send(planned, start_ns, None)
            results.append(result)
            if on_done is not None:
                on_done(result)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(plan)))))
    return sorted(results, key=lambda r: r.index)
