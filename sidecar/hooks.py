"""The sink interface, and fan-out of finished records to sinks with per-sink failure isolation.

A sink's ``on_record`` runs on the event loop right after a request ends, so it must be
synchronous and cheap; a sink that does I/O owns a bounded queue and a task or thread of its own.
A sink that raises is counted and logged (rate-limited) and the other sinks still get the record:
a passive measurement tool drops a measurement rather than hurt the traffic it measures.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar, runtime_checkable

from sidecar.record import RequestRecord

log = logging.getLogger(__name__)

LOG_EVERY_S = 10.0  # a failure repeated on every request must not flood the log


class LogThrottle:
    """Says when a repeated failure may be logged again: at most once per ``every_s``."""

    __slots__ = ("every_s", "_last")

    def __init__(self, every_s: float = LOG_EVERY_S) -> None:
        self.every_s = every_s
        self._last = float("-inf")

    def ready(self) -> bool:
        now = time.monotonic()
        if now - self._last < self.every_s:
            return False
        self._last = now
        return True


@runtime_checkable
class RecordSink(Protocol):
    """Receives every finished record. ``name`` labels its error counter."""

    name: str

    def on_record(self, record: RequestRecord) -> None: ...


class SinkFanout:
    """Delivers each record to every sink; failures are isolated per sink and counted.

    ``lock``: held while a record is delivered, when another thread reads the sinks (a
    `ScrapeRunner` with a thread of its own)."""

    def __init__(self, sinks: Iterable[RecordSink] = (),
                 lock: threading.Lock | None = None) -> None:
        self._sinks: list[RecordSink] = list(sinks)
        self.lock = lock
        self.errors: dict[str, int] = {sink.name: 0 for sink in self._sinks}
        self.records_delivered = 0
        self._throttles: dict[str, LogThrottle] = {}

    @property
    def sinks(self) -> tuple[RecordSink, ...]:
        return tuple(self._sinks)

    def add(self, sink: RecordSink) -> None:
        if any(existing.name == sink.name for existing in self._sinks):
            raise ValueError(f"a sink named {sink.name!r} is already registered")
        self._sinks.append(sink)
        self.errors[sink.name] = 0

    def on_record(self, record: RequestRecord) -> None:
        if self.lock is None:
            self._deliver(record)
        else:
            with self.lock:
                self._deliver(record)

    def _deliver(self, record: RequestRecord) -> None:
        self.records_delivered += 1
        for sink in self._sinks:
            try:
                sink.on_record(record)
            except Exception:
                self.errors[sink.name] += 1
                if self._throttles.setdefault(sink.name, LogThrottle()).ready():
                    log.exception(
                        "sink %r failed on a record (%d failures so far); serving goes on",
                        sink.name,
                        self.errors[sink.name],
                    )


class ThreadedSink:
    """Runs a sink's ``on_record`` on a worker thread behind a bounded queue.

    For sinks whose per-record cost is too high for the event loop (the OpenTelemetry SDK
    spends a few microseconds per measurement, one measurement per streamed chunk): the loop only
    enqueues. When the queue is full the record is dropped and counted, never waited for. The
    work still costs CPU in this process; it just no longer delays other requests' chunks.
    """

    def __init__(self, sink: RecordSink, queue_size: int = 10_000) -> None:
        self.inner = sink
        self.name = sink.name
        self.dropped = 0
        self.failed = 0
        self._queue: queue.Queue[RequestRecord | None] = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._run, name=f"sink-{sink.name}",
                                        daemon=True)
        self._thread.start()

    def on_record(self, record: RequestRecord) -> None:
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while True:
            record = self._queue.get()
            if record is None:
                return
            try:
                self.inner.on_record(record)
            except Exception:
                self.failed += 1
                if self.failed == 1 or self.failed % 1000 == 0:
                    log.exception("sink %r failed on its worker thread (%d failures)",
                                  self.name, self.failed)

    def close(self, timeout_s: float = 30.0) -> None:
        """Deliver what is queued, then stop the thread (blocking: call it off the loop)."""
        if self._thread.is_alive():
            self._queue.put(None, timeout=timeout_s)
            self._thread.join(timeout_s)


T = TypeVar("T")

# How much lower than the traffic the scrape thread runs (nice increment, Linux): the
# lowest, so that a busy worker preempts a scrape at once; it still gets ~1.5 % of a core
# when the core is saturated (CFS weight 15 vs 1024), so scrapes are slow then, not lost.
SCRAPE_NICE = 19


class ScrapeRunner:
    """Where the work a scrape triggers (the live window's summaries, the Prometheus
    exposition) runs.

    Inline on the event loop by default: in one process there is nothing to gain from a thread
    that shares the GIL with the relay. A collector (`sidecar proxy --workers N`) runs it on a
    thread of its own at a lower CPU priority (nice +19 on Linux; the rest of the process keeps
    its own): the workers share the machine's cores with the collector, and a scrape of a full
    window must yield the CPU to traffic, not compete with it. The thread holds ``lock`` while it
    reads the sinks; the fan-out takes the same lock to deliver a record.
    """

    def __init__(self, threaded: bool = False) -> None:
        self.lock: threading.Lock | None = threading.Lock() if threaded else None
        self._executor = (ThreadPoolExecutor(1, thread_name_prefix="scrape",
                                             initializer=_lower_priority)
                          if threaded else None)

    async def run(self, work: Callable[[], T]) -> T:
        if self._executor is None or self.lock is None:
            return work()
        lock = self.lock

        def locked() -> T:
            with lock:
                return work()

        return await asyncio.get_running_loop().run_in_executor(self._executor, locked)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SCRAPE_NICE)
    except (AttributeError, OSError) as exc:  # pragma: no cover - not Linux
        log.info("scrape thread runs at normal priority (%s)", exc)
