"""Plan a replay's load and send it: the functions `sidecar replay`, `sidecar sweep`, `sidecar
demo` and scripts call alike, with a `ReplayOptions` (replay/options.py) rather than a command
line.

    plan = load.plan(requests, options, model)
    sent = await load.run(plan, options)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from sidecar import clock
from sidecar.record import RequestRecord
from sidecar.replay.live import ReplayCounters
from sidecar.replay.options import ReplayOptions, UsageError
from sidecar.replay.payload import DEFAULT_TOKEN_IDS, TokenCalibration, TokenIds, build_body
from sidecar.replay.progress import Counts, ProgressDisplay
from sidecar.replay.runner import (
    PlannedRequest,
    Sender,
    SentRequest,
    closed_loop,
    open_loop,
    out_of_collection,
)
from sidecar.replay.schedule import gamma_schedule, trace_schedule
from sidecar.tracefile import TraceRequest


@dataclass(frozen=True)
class Plan:
    """Requests with their send instants, and how they are sent: "open" (each at its instant)
    or "closed" (at most a concurrency outstanding, instants ignored)."""

    requests: Sequence[PlannedRequest]
    mode: str


def plan(
    requests: Sequence[TraceRequest],
    options: ReplayOptions,
    model: str,
    calibration: TokenCalibration | None = None,
    token_ids: TokenIds = DEFAULT_TOKEN_IDS,
    *,
    trace_origin: float | None = None,
) -> Plan:
    """The requests as bodies to send and their instants: closed loop with
    ``max_concurrency``, a Gamma process with ``rate``, else the trace's own times (scaled by
    ``time_scale``, relative to ``trace_origin`` when given: a shard's t = 0 is the trace's)."""
    ordered = sorted(requests, key=lambda r: r.t)
    if options.max_concurrency is not None:
        if options.max_concurrency < 1:
            raise UsageError("--max-concurrency must be >= 1")
        times = [0.0] * len(ordered)
        mode = "closed"
    elif options.rate is not None:
        times = gamma_schedule(len(ordered), options.rate, options.burstiness, options.seed)
        mode = "open"
    else:
        # Times stay relative to the trace's own t = 0 (not this shard's first request), so
        # shards started at one instant interleave as in the trace.
        times = trace_schedule([r.t for r in ordered], options.time_scale)
        if trace_origin is not None and ordered:
            offset = (ordered[0].t - trace_origin) / options.time_scale
            times = [t + offset for t in times]
        mode = "open"
    planned = []
    for index, (at, request) in enumerate(zip(times, ordered, strict=True)):
        path, body = build_body(
            request,
            index=index,
            model=model,
            run_seed=options.seed,
            calibration=calibration,
            use_captured_body=not options.no_captured_bodies,
            endpoint=options.endpoint,
            token_ids=token_ids,
        )
        if body.get("stream") is True:
            # The replayer is the client: it asks for usage itself to count tokens exactly.
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        planned.append(PlannedRequest(index, at, path, body))
    return Plan(planned, mode)


def needs_token_ids(requests: Sequence[TraceRequest], options: ReplayOptions) -> bool:
    """Whether some request will get a rebuilt token-id prompt (completions, no body used)."""
    return any(
        (options.endpoint or r.endpoint) != "chat"
        and (r.body is None or options.no_captured_bodies)
        for r in requests
    )


async def run(
    plan: Plan,
    options: ReplayOptions,
    *,
    concurrency: int | None = None,
    workers: int | None = None,
    label: str = "",
    quiet: bool = False,
    request_id_prefix: str = "replay",
    counters: ReplayCounters | None = None,
) -> list[SentRequest]:
    """Send ``plan`` to ``options.target`` and measure it. ``concurrency`` (closed loop) and
    ``workers`` (sender processes, open loop) default to the options'. Unless ``quiet`` (or
    ``options.quiet``), a progress display on stderr reads the sender's counters from a thread
    of its own while it runs; a quiet run (a warm-up) also ignores ``options.start_at``."""
    concurrency = options.max_concurrency if concurrency is None else concurrency
    workers = options.workers if workers is None else workers
    show = not (quiet or options.quiet)
    start_at = options.start_at if not quiet else None
    progress = _Progress(show, label or "replay", len(plan.requests), start_at)
    if workers > 1 and plan.mode == "open":
        if show and counters is None:
            counters = ReplayCounters()  # the workers' numbers, for the display
        return await _run_in_workers(plan, options, workers, request_id_prefix, counters, progress)
    return await _run_here(plan, options, concurrency, request_id_prefix, counters, progress)


@dataclass(frozen=True)
class _Progress:
    """What a run's progress display shows: whether there is one, its label, the request
    count and the --start-at it waits for."""

    show: bool
    label: str
    total: int
    start_at: float | None

    def display(
        self, read: Callable[[], Counts], starts_at: float | None
    ) -> ProgressDisplay | None:
        """The display reading ``read``, or None when not shown."""
        if not self.show:
            return None
        waiting_for = (
            "the start"
            if self.start_at is None
            else time.strftime("--start-at (%Y-%m-%d %H:%M:%S UTC)", time.gmtime(self.start_at))
        )
        return ProgressDisplay(
            self.label, self.total, read, starts_at=starts_at, waiting_for=waiting_for
        )


async def _run_in_workers(
    plan: Plan,
    options: ReplayOptions,
    workers: int,
    request_id_prefix: str,
    counters: ReplayCounters | None,
    progress: _Progress,
) -> list[SentRequest]:
    """An open-loop plan sent by ``workers`` processes (run_workers), shown from the shared
    counters."""
    display = None
    if progress.show and counters is not None:
        base = counters.totals()
        shared = counters

        def read_shared() -> Counts:
            sent, finished, failed = shared.totals()
            return Counts(sent - base[0], finished - base[1], failed - base[2])

        start_at = progress.start_at
        starts_at = time.monotonic() + start_at - time.time() if start_at is not None else None
        display = progress.display(read_shared, starts_at)
    with display or contextlib.nullcontext():
        return await asyncio.to_thread(
            run_workers,
            plan.requests,
            options.target,
            workers,
            options,
            request_id_prefix,
            counters,
        )


async def _run_here(
    plan: Plan,
    options: ReplayOptions,
    concurrency: int | None,
    request_id_prefix: str,
    counters: ReplayCounters | None,
    progress: _Progress,
) -> list[SentRequest]:
    """``plan`` sent from this process: open loop at its instants, or closed loop with
    ``concurrency`` outstanding."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        sender = Sender(
            options.target,
            session,
            request_timeout_s=options.request_timeout,
            request_id_prefix=request_id_prefix,
            counters=counters,
        )
        with out_of_collection():  # before the start instant is chosen: it collects first
            start = clock.monotonic_ns() + 50_000_000  # a moment to get every task ready
            if progress.start_at is not None:
                start = _monotonic_start(progress.start_at)
                if start < clock.monotonic_ns():
                    raise UsageError(f"--start-at {progress.start_at} is in the past")

            def read() -> Counts:
                return Counts(sender.done + sender.in_flight, sender.done, sender.failed)

            starts_at = time.monotonic() + (start - clock.monotonic_ns()) / 1e9
            with progress.display(read, starts_at) or contextlib.nullcontext():
                if plan.mode == "closed":
                    return await closed_loop(sender, plan.requests, concurrency or 1, start)
                return await open_loop(sender, plan.requests, start)


def _monotonic_start(start_at: float) -> int:
    """A wall-clock instant (--start-at, shared by every shard) as a monotonic one here."""
    return clock.monotonic_ns() + int((start_at - time.time()) * 1e9)


# -- several sender processes ---------------------------------------------------------------


def _worker_main(
    plan: list[PlannedRequest],
    target: str,
    timeout_s: float,
    out_path: str,
    ready: Any,
    go: Any,
    start_value: Any,
    request_id_prefix: str,
    shared_counters: Any | None,
) -> None:
    async def main() -> list[SentRequest]:
        connector = aiohttp.TCPConnector(limit=0)
        counters = None if shared_counters is None else ReplayCounters(shared_counters)
        async with aiohttp.ClientSession(connector=connector) as session:
            sender = Sender(
                target,
                session,
                request_timeout_s=timeout_s,
                request_id_prefix=request_id_prefix,
                counters=counters,
            )
            # Everything is imported and set up: report ready, then wait for the common start.
            with out_of_collection():
                await asyncio.to_thread(ready.wait)
                await asyncio.to_thread(go.wait)
                return await open_loop(sender, plan, int(start_value.value))

    try:
        import uvloop

        sent = uvloop.run(main())
    except ImportError:  # pragma: no cover - Windows
        sent = asyncio.run(main())
    with open(out_path, "w") as handle:
        for s in sent:
            handle.write(
                json.dumps(
                    {
                        "index": s.index,
                        "scheduled_ns": s.scheduled_ns,
                        "actual_ns": s.actual_ns,
                        "record": s.record.to_dict(),
                    }
                )
                + "\n"
            )


def _read_sent(path: str) -> list[SentRequest]:
    """The requests a worker sent, from the JSON lines it wrote (_worker_main)."""
    sent = []
    with open(path) as handle:
        for line in handle:
            data = json.loads(line)
            sent.append(
                SentRequest(
                    data["index"],
                    data["scheduled_ns"],
                    data["actual_ns"],
                    RequestRecord.from_dict(data["record"]),
                )
            )
    return sent


def run_workers(
    plan: Sequence[PlannedRequest],
    target: str,
    workers: int,
    options: ReplayOptions,
    request_id_prefix: str = "replay",
    counters: ReplayCounters | None = None,
) -> list[SentRequest]:
    """Split the schedule round-robin over ``workers`` processes. They start together: each
    reports ready once set up, then the parent sets one start instant for all (perf_counter
    is CLOCK_MONOTONIC, the same clock in every process of the host)."""
    context = multiprocessing.get_context("spawn")
    ready = context.Barrier(workers + 1)
    go = context.Event()
    start_value = context.Value("q", 0)
    with tempfile.TemporaryDirectory(prefix="sidecar-replay-") as tmp:
        processes = []
        for w in range(workers):
            share = [p for i, p in enumerate(plan) if i % workers == w]
            path = os.path.join(tmp, f"worker{w}.jsonl")
            proc = context.Process(
                target=_worker_main,
                args=(
                    share,
                    target,
                    options.request_timeout,
                    path,
                    ready,
                    go,
                    start_value,
                    request_id_prefix,
                    None if counters is None else counters.shared,
                ),
            )
            proc.start()
            processes.append((proc, path))
        try:
            ready.wait(timeout=120)
        except threading.BrokenBarrierError:
            for proc, _ in processes:
                proc.kill()
            raise RuntimeError("replay workers did not get ready within 120 s") from None
        start_value.value = clock.monotonic_ns() + 100_000_000
        if options.start_at is not None:
            start_value.value = _monotonic_start(options.start_at)
        go.set()
        sent: list[SentRequest] = []
        for proc, path in processes:
            proc.join()
            if proc.exitcode != 0:
                raise RuntimeError(f"a replay worker failed (exit code {proc.exitcode})")
            sent.extend(_read_sent(path))
    return sorted(sent, key=lambda s: s.index)
