"""The sink contract, and fan-out of finished records to sinks with per-sink failure isolation.

A sink's ``on_record`` runs on the event loop right after a request ends, so it must be
synchronous and cheap; a sink that does I/O owns a bounded queue and a thread of its own
(`QueuedSink`). A sink that raises is counted and logged (rate-limited) and the other sinks still
get the record: a passive measurement tool drops a measurement rather than hurt the traffic it
measures.

Every sink of this package has one lifecycle, as exporters have in the OpenTelemetry SDK
(`Sink`): ``on_record``, ``flush(timeout_s)``, ``close(timeout_s)`` and ``counters()``. Whoever
serves closes the sinks through their fan-out only (`SinkFanout.close`); nobody reaches into a
sink to shut it down, or guesses its counters from its attributes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar, runtime_checkable

from sidecar.record import RequestRecord, approx_record_bytes

log = logging.getLogger(__name__)

LOG_EVERY_S = 10.0  # a failure repeated on every request must not flood the log
# How long flushing or closing may take, all sinks together, unless the caller says otherwise:
# long enough for a capture to write a full queue and an OTLP exporter to send its last batch,
# short enough that an orchestrator's grace period (30 s by default in Kubernetes) is not
# spent waiting on a dead collector.
SINK_TIMEOUT_S = 25.0
# Records that may wait for a scrape (SinkFanout), and their memory (record.approx_record_bytes);
# past either a record is dropped and counted. At ~1,000 records/s, 50 s of them (a scrape of a
# full window on a saturated host took 12-64 s, benchmarks/RESULTS.md "Session 33"); the bytes
# bound holds when streams are long (50,000 records of 2,000 tokens would be ~2.3 GiB): a quarter
# of the live window's default cap.
BACKLOG_MAX = 50_000
BACKLOG_MAX_BYTES = 64 * 1024 * 1024

# The vocabulary of `Sink.counters()`, so that /metrics reads every sink alike. A sink reports
# the names that apply to it, and may add its own (the window's ``evicted_over_cap``).
TAKEN = "taken"  # records the sink accepted: each ends written, dropped, or still queued
WRITTEN = "written"  # records handed on to where the sink sends them (a file, a thread, a pipe)
SKIPPED = "skipped"  # records outside what the sink handles (pass-through paths): not lost
DROPPED = "dropped_"  # + reason: records lost, e.g. ``dropped_queue_full``


def dropped_by_reason(counters: Mapping[str, int]) -> dict[str, int]:
    """``{reason: records}`` from a sink's counters (the ``dropped_<reason>`` ones)."""
    return {
        name[len(DROPPED) :]: count for name, count in counters.items() if name.startswith(DROPPED)
    }


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
    """Receives every finished record. ``name`` labels its error counter.

    The least a sink can be: a list a test or a script keeps. `SinkFanout` takes it as a `Sink`
    with nothing to flush or close and no counters."""

    name: str

    def on_record(self, record: RequestRecord) -> None: ...


@runtime_checkable
class Sink(RecordSink, Protocol):
    """The contract every sink of this package keeps (the OpenTelemetry SDK's exporters keep
    the same one: export, force_flush, shutdown).

    ``flush``: deliver what was taken so far (written to its file, exported), within
    ``timeout_s``; True when nothing taken is still pending (each record written, or dropped
    and counted). ``close``: flush, then release what the sink holds
    (join its thread within ``timeout_s``, close its file, shut its SDK down); idempotent, and
    a record given afterwards is dropped and counted, never an error. Both block: call them
    off the event loop (``asyncio.to_thread``); a sink with async work does it inside.
    ``counters``: the sink's own counts, by name (`TAKEN`, `WRITTEN`, `SKIPPED`,
    ``dropped_<reason>``, and its own), read by /metrics."""

    def flush(self, timeout_s: float = SINK_TIMEOUT_S) -> bool: ...

    def close(self, timeout_s: float = SINK_TIMEOUT_S) -> None: ...

    def counters(self) -> Mapping[str, int]: ...


class _RecordOnly:
    """The lifecycle of a `RecordSink` that has none: nothing to flush, close or count."""

    def __init__(self, sink: RecordSink) -> None:
        self.name = sink.name
        self.on_record = sink.on_record

    def flush(self, timeout_s: float = SINK_TIMEOUT_S) -> bool:
        return True

    def close(self, timeout_s: float = SINK_TIMEOUT_S) -> None:
        return None

    def counters(self) -> Mapping[str, int]:
        return {}


class SinkFanout:
    """Delivers each record to every sink; failures are isolated per sink and counted.

    ``lock``: held while a record is delivered, when another thread reads the sinks (a
    `ScrapeRunner` with a thread of its own). A record that comes while that thread holds it
    waits in a backlog, delivered in order before the next one or when the scrape ends
    (`drain`): the scrape thread runs at the lowest CPU priority, and on a busy core it can
    hold the lock for seconds; the loop that delivers records (and answers health checks)
    must not wait that long behind it. Past `BACKLOG_MAX` waiting records, or
    `BACKLOG_MAX_BYTES` of them, a record is dropped and counted (`on_record` says so,
    `records_dropped_backlog`), as memory must stay bounded: the loop never waits for the lock.
    (It once did, and a scrape starved on a saturated host then froze the collector's loop,
    `/healthz` with it, for as long as the scrape took.)

    `close` closes every sink once, the last registered first: the sinks that export (OTel,
    capture, added last) drain while the window and Prometheus, registered first, still hold
    what they were given. A sink that fails to close is logged and the others still close."""

    def __init__(
        self, sinks: Iterable[RecordSink] = (), lock: threading.Lock | None = None
    ) -> None:
        self._sinks: list[RecordSink] = []
        self._lifecycles: list[Sink] = []  # the same sinks, as `Sink`s (`_RecordOnly`)
        self.lock = lock
        self.errors: dict[str, int] = {}
        self.records_delivered = 0
        self.records_after_close = 0
        self.records_dropped_backlog = 0  # a scrape held the sinks past BACKLOG_MAX records
        self.close_failures: list[str] = []  # names of the sinks that raised in close
        self._throttles: dict[str, LogThrottle] = {}
        self._closed = False
        self._close_lock = threading.Lock()
        self._backlog: deque[RequestRecord] = deque()  # appended on the loop only
        self._backlog_bytes = 0  # their approx_record_bytes
        for sink in sinks:
            self.add(sink)

    @property
    def sinks(self) -> tuple[RecordSink, ...]:
        return tuple(self._sinks)

    @property
    def closed(self) -> bool:
        return self._closed

    def add(self, sink: RecordSink) -> None:
        if any(existing.name == sink.name for existing in self._sinks):
            raise ValueError(f"a sink named {sink.name!r} is already registered")
        if self._closed:
            raise RuntimeError("the sinks are closed: no sink can be added")
        self._sinks.append(sink)
        # Checked once here, not per call: a sink keeps the contract or has no lifecycle.
        self._lifecycles.append(sink if isinstance(sink, Sink) else _RecordOnly(sink))
        self.errors[sink.name] = 0

    def on_record(self, record: RequestRecord) -> bool:
        """Deliver ``record`` (or keep it for after a scrape): False when it was dropped
        instead, a scrape holding the sinks with the backlog full (`BACKLOG_MAX` records, or
        `BACKLOG_MAX_BYTES` of them)."""
        lock = self.lock
        if lock is None:
            self._deliver(record)
            return True
        backlog = self._backlog
        if not lock.acquire(blocking=False):
            size = approx_record_bytes(record)
            if len(backlog) >= BACKLOG_MAX or self._backlog_bytes + size > BACKLOG_MAX_BYTES:
                self.records_dropped_backlog += 1
                return False
            backlog.append(record)  # a scrape holds the sinks: delivered after it
            self._backlog_bytes += size
            return True
        try:
            if backlog:
                self._deliver_backlog()
            self._deliver(record)
        finally:
            lock.release()
        return True

    @property
    def waiting(self) -> int:
        """Records waiting for a scrape to let go of the sinks."""
        return len(self._backlog)

    def drain(self, blocking: bool = False) -> None:
        """Deliver the records that waited for a scrape; ``blocking``: wait for the lock (off
        the loop: `flush`, `close`), else only if it is free now (after a scrape, on the
        loop, where the next scrape may already hold it)."""
        lock, backlog = self.lock, self._backlog
        if lock is None or not backlog or not lock.acquire(blocking=blocking):
            return
        try:
            self._deliver_backlog()
        finally:
            lock.release()

    def _deliver_backlog(self) -> None:
        """What waited for a scrape, in order (the sinks' lock held)."""
        backlog = self._backlog
        while backlog:
            record = backlog.popleft()
            # Per record, not a reset at the end: `flush` and `close` drain from another
            # thread while the loop may still add to the backlog.
            self._backlog_bytes -= approx_record_bytes(record)
            self._deliver(record)

    def _deliver(self, record: RequestRecord) -> None:
        if self._closed:
            # Not expected (whoever serves closes the sinks after the last request), but a
            # closed sink must not be written to: counted, not delivered.
            self.records_after_close += 1
            return
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

    def counters(self) -> dict[str, dict[str, int]]:
        """Every sink's own counters, by sink name (empty for a sink with none)."""
        return {sink.name: dict(sink.counters()) for sink in self._lifecycles}

    def flush(self, timeout_s: float = SINK_TIMEOUT_S) -> bool:
        """Flush every sink, within ``timeout_s`` in all; True when every one delivered all it
        took. A sink that raises is logged and counts as not flushed. Blocking."""
        self.drain(blocking=True)
        deadline = time.monotonic() + timeout_s
        flushed = True
        for sink in self._lifecycles:
            try:
                flushed = sink.flush(_remaining(deadline)) and flushed
            except Exception:
                flushed = False
                log.exception("sink %r failed to flush", sink.name)
        return flushed

    def close(self, timeout_s: float = SINK_TIMEOUT_S) -> list[str]:
        """Close every sink once, the last registered first, within ``timeout_s`` in all.
        A sink that raises is logged and the others still close. Returns the names of those
        that failed (also in ``close_failures``); a second call does nothing and returns [].
        Blocking: call it off the event loop."""
        self.drain(blocking=True)  # before the sinks close: what waited is theirs
        with self._close_lock:
            if self._closed:
                return []
            self._closed = True
        deadline = time.monotonic() + timeout_s
        failed: list[str] = []
        for sink in reversed(self._lifecycles):
            try:
                sink.close(_remaining(deadline))
            except Exception:
                failed.append(sink.name)
                log.exception("sink %r failed to close; closing the others", sink.name)
        if failed:
            log.error(
                "%d of %d sinks failed to close: %s",
                len(failed),
                len(self._lifecycles),
                ", ".join(failed),
            )
        self.close_failures = failed
        return list(failed)


def _remaining(deadline: float) -> float:
    """Seconds left until ``deadline``, never negative (a timeout of 0 still tries once)."""
    return max(0.0, deadline - time.monotonic())


_STOP = object()  # tells a QueuedSink's thread to finish


class QueuedSink:
    """The base of a sink whose work runs on a thread of its own behind a bounded queue.

    ``on_record`` (the event loop) only enqueues: when the queue is full (``queue_size``
    records, or ``queue_bytes`` by `_record_bytes`), the record is dropped and counted, never
    waited for. The thread takes records in batches of up to ``batch_max`` and hands each
    batch to `_write_batch`; the work still costs CPU in this process, it just no longer delays
    other requests' chunks. The thread survives any batch (an exception drops that batch,
    counted as ``dropped_write_error``, logged); a thread that died anyway is started again by
    the next record (``writer_restarts``, logged). With ``idle_s`` the thread also wakes up
    that often when idle (`_idle`: rotate a file by age).

    Counters: every record taken (``taken``) ends ``written`` or ``dropped_<reason>``, or is
    still queued (`queued`).
    """

    name: str

    def __init__(
        self,
        name: str,
        *,
        queue_size: int = 10_000,
        queue_bytes: int | None = None,
        batch_max: int = 1000,
        idle_s: float | None = None,
        thread_name: str | None = None,
    ) -> None:
        self.name = name
        self.queue_bytes = queue_bytes
        self.batch_max = batch_max
        self.idle_s = idle_s
        self.taken = 0
        self.skipped = 0
        self.written = 0
        self.dropped_queue_full = 0
        self.dropped_closed = 0
        self.dropped_write_errors = 0
        self.writer_restarts = 0
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_size)
        self._queued_bytes = 0  # estimate of what the queue holds (`_record_bytes`)
        self._bytes_lock = threading.Lock()
        # Records the thread is done with (written or dropped), to wait on in `flush`.
        self._enqueued = 0
        self._done = 0
        self._progress = threading.Condition()
        self._closed = False
        self._close_lock = threading.Lock()
        self._thread_name = thread_name or f"sink-{name}"
        self._thread = self._start_thread()

    # -- what a subclass provides -------------------------------------------------------------

    def _write_batch(self, batch: list[RequestRecord]) -> None:
        """Deliver a batch (the sink's thread); count each record ``written`` or dropped."""
        raise NotImplementedError

    def _accepts(self, record: RequestRecord) -> bool:
        """Whether the sink handles this record at all (else it is counted ``skipped``)."""
        return True

    def _record_bytes(self, record: RequestRecord) -> int:
        """What a queued record holds in memory, by estimate (only with ``queue_bytes``)."""
        return 0

    def _idle(self) -> None:
        """After each batch, and every ``idle_s`` without one (the sink's thread)."""

    def _finish(self) -> None:
        """The last thing the sink's thread does, after the last batch (close a file)."""

    def _flush_output(self, timeout_s: float) -> bool:
        """After the queue is drained: push what the sink itself buffers (`flush`)."""
        return True

    def _release(self, timeout_s: float) -> None:
        """After the thread finished: release what else the sink holds (`close`)."""

    def _extra_counters(self) -> dict[str, int]:
        return {}

    # -- the event loop's side ---------------------------------------------------------------

    def _start_thread(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
        thread.start()
        return thread

    def on_record(self, record: RequestRecord) -> None:
        if not self._accepts(record):
            self.skipped += 1
            return
        self.taken += 1
        if self._closed:
            self.dropped_closed += 1
            return
        if not self._thread.is_alive():
            # Not expected (the thread catches everything), but a dead thread would let the
            # queue fill and every later record drop unseen: start another, say so.
            self.writer_restarts += 1
            log.error(
                "sink %r: its thread had stopped; restarted (%d so far)",
                self.name,
                self.writer_restarts,
            )
            self._thread = self._start_thread()
        size = 0
        if self.queue_bytes is not None:
            size = self._record_bytes(record)
            with self._bytes_lock:
                if self._queued_bytes + size > self.queue_bytes:
                    self.dropped_queue_full += 1
                    return
                self._queued_bytes += size
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            if size:
                with self._bytes_lock:
                    self._queued_bytes -= size
            self.dropped_queue_full += 1
            return
        self._enqueued += 1

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def counters(self) -> dict[str, int]:
        counters = {
            TAKEN: self.taken,
            SKIPPED: self.skipped,
            WRITTEN: self.written,
            "dropped_queue_full": self.dropped_queue_full,
            "dropped_closed": self.dropped_closed,
            "dropped_write_error": self.dropped_write_errors,
            "writer_restarts": self.writer_restarts,
        }
        counters.update(self._extra_counters())
        return counters

    def flush(self, timeout_s: float = SINK_TIMEOUT_S) -> bool:
        """Wait until the thread is done with every record taken so far, then flush what the
        sink buffers; True when all of it went out within ``timeout_s``. Blocking."""
        deadline = time.monotonic() + timeout_s
        target = self._enqueued
        with self._progress:
            drained = self._progress.wait_for(
                lambda: self._done >= target or not self._thread.is_alive(), timeout_s
            )
            drained = drained and self._done >= target
        return self._flush_output(_remaining(deadline)) and drained

    def close(self, timeout_s: float = SINK_TIMEOUT_S) -> None:
        """Deliver what is queued, stop the thread (joined within ``timeout_s``), release the
        rest. Idempotent. Blocking: call it off the event loop or at shutdown."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + timeout_s
        if self._thread.is_alive():
            try:
                self._queue.put(_STOP, timeout=timeout_s)
            except queue.Full:
                log.error(
                    "sink %r: its queue stayed full for %g s; closing without it",
                    self.name,
                    timeout_s,
                )
            self._thread.join(_remaining(deadline))
        if self._thread.is_alive():
            log.error(
                "sink %r: its thread did not finish within %g s; %d records left undelivered",
                self.name,
                timeout_s,
                self.queued,
            )
        else:
            # A record enqueued after the stop (a race with the loop) is lost: counted.
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP:
                    self.dropped_closed += 1
        self._release(_remaining(deadline))

    # -- the sink's thread ---------------------------------------------------------------------

    def _run(self) -> None:
        stopping = False
        while not stopping:
            try:
                item = self._queue.get(timeout=self.idle_s)
            except queue.Empty:
                self._safely(self._idle)
                continue
            batch: list[RequestRecord] = []
            while True:
                if item is _STOP:
                    stopping = True
                    break
                assert isinstance(item, RequestRecord)
                batch.append(item)
                if len(batch) >= self.batch_max:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch:
                if self.queue_bytes is not None:
                    released = sum(self._record_bytes(r) for r in batch)
                    with self._bytes_lock:
                        self._queued_bytes -= released
                try:
                    self._write_batch(batch)
                except Exception:  # noqa: BLE001 - the thread must outlive any batch
                    self.dropped_write_errors += len(batch)
                    log.exception(
                        "sink %r: a batch of %d records could not be written; it goes on",
                        self.name,
                        len(batch),
                    )
                with self._progress:
                    self._done += len(batch)
                    self._progress.notify_all()
            self._safely(self._idle)
        self._safely(self._finish)
        with self._progress:
            self._progress.notify_all()  # a flush waiting on a finished thread returns

    def _safely(self, step: Callable[[], None]) -> None:
        try:
            step()
        except Exception:  # noqa: BLE001 - the thread must outlive its housekeeping
            log.exception("sink %r: %s failed; it goes on", self.name, step.__name__)


class ThreadedSink(QueuedSink):
    """Runs a sink's ``on_record`` on a thread of its own behind a bounded queue.

    For sinks whose per-record cost is too high for the event loop (the OpenTelemetry SDK
    spends a few microseconds per measurement, one measurement per streamed chunk): the loop only
    enqueues. Flushing and closing it flush and close the inner sink too, after the queue is
    drained. A record the inner sink raises on is counted (``dropped_error``) and logged now
    and then; the thread goes on.
    """

    def __init__(self, sink: RecordSink, queue_size: int = 10_000) -> None:
        self.inner = sink
        self._inner: Sink = sink if isinstance(sink, Sink) else _RecordOnly(sink)
        self.failed = 0
        super().__init__(sink.name, queue_size=queue_size, thread_name=f"sink-{sink.name}")

    @property
    def dropped(self) -> int:
        """Records that never reached the inner sink's ``on_record`` (queue full, closed)."""
        return self.dropped_queue_full + self.dropped_closed

    def _write_batch(self, batch: list[RequestRecord]) -> None:
        for record in batch:
            try:
                self.inner.on_record(record)
            except Exception:
                self.failed += 1
                if self.failed == 1 or self.failed % 1000 == 0:
                    log.exception(
                        "sink %r failed on its worker thread (%d failures)", self.name, self.failed
                    )
            else:
                self.written += 1

    def _flush_output(self, timeout_s: float) -> bool:
        return self._inner.flush(timeout_s)

    def _release(self, timeout_s: float) -> None:
        self._inner.close(timeout_s)

    def _extra_counters(self) -> dict[str, int]:
        # The inner sink's own counts too (the OTel sink's ``skipped``), where they do not
        # say something else under the same name.
        extra = {
            name: count
            for name, count in self._inner.counters().items()
            if name not in (TAKEN, WRITTEN) and not name.startswith(DROPPED)
        }
        extra["dropped_error"] = self.failed
        return extra


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
        # Called on the loop once a threaded scrape let go of the lock (SinkFanout.drain).
        self.on_released: list[Callable[[], None]] = []
        self._executor = (
            ThreadPoolExecutor(1, thread_name_prefix="scrape", initializer=_lower_priority)
            if threaded
            else None
        )

    async def run(self, work: Callable[[], T]) -> T:
        if self._executor is None or self.lock is None:
            return work()
        lock = self.lock

        def locked() -> T:
            with lock:
                return work()

        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, locked)
        finally:
            for released in self.on_released:
                released()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SCRAPE_NICE)
    except (AttributeError, OSError) as exc:  # pragma: no cover - not Linux
        log.info("scrape thread runs at normal priority (%s)", exc)
