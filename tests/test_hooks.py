from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping

import pytest

from sidecar.hooks import (
    SINK_TIMEOUT_S,
    QueuedSink,
    RecordSink,
    Sink,
    SinkFanout,
    ThreadedSink,
    dropped_by_reason,
)
from sidecar.record import Outcome, RequestRecord


class Collecting:
    def __init__(self, name: str) -> None:
        self.name = name
        self.records: list[RequestRecord] = []

    def on_record(self, record: RequestRecord) -> None:
        self.records.append(record)


class Failing:
    name = "broken"

    def on_record(self, record: RequestRecord) -> None:
        raise RuntimeError("disk on fire")


def record(request_id: str = "x") -> RequestRecord:
    return RequestRecord(request_id=request_id, wall_time_ns=0, outcome=Outcome.OK, endpoint="chat")


def test_a_failing_sink_is_counted_and_the_others_still_get_the_record(
    caplog: pytest.LogCaptureFixture,
) -> None:
    first, last = Collecting("first"), Collecting("last")
    fanout = SinkFanout([first, Failing(), last])
    with caplog.at_level(logging.ERROR):
        fanout.on_record(record())
        fanout.on_record(record())
    assert len(first.records) == 2 and len(last.records) == 2
    assert fanout.errors == {"first": 0, "broken": 2, "last": 0}
    assert fanout.records_delivered == 2
    # Logged once, not once per record.
    assert (
        sum("disk on fire" in r.getMessage() or r.exc_text is not None for r in caplog.records) == 1
    )


def test_sink_names_are_unique_and_protocol_is_structural() -> None:
    fanout = SinkFanout()
    sink = Collecting("a")
    assert isinstance(sink, RecordSink)
    fanout.add(sink)
    with pytest.raises(ValueError, match="already registered"):
        fanout.add(Collecting("a"))


def test_threaded_sink_delivers_everything_in_order_and_drops_when_full() -> None:
    gate = threading.Event()

    class Slow(Collecting):
        def on_record(self, record: RequestRecord) -> None:
            gate.wait(10)
            super().on_record(record)

    inner = Slow("slow")
    threaded = ThreadedSink(inner, queue_size=2)
    records = [
        RequestRecord(request_id=str(i), wall_time_ns=i, outcome=Outcome.OK, endpoint="chat")
        for i in range(10)
    ]
    for r in records:
        threaded.on_record(r)  # never blocks: the worker is stuck on the first one
    assert threaded.dropped >= 7
    gate.set()
    threaded.close()
    delivered = [r.request_id for r in inner.records]
    assert len(delivered) + threaded.dropped == 10
    assert delivered == sorted(delivered, key=int) and delivered[0] == "0"
    counters = threaded.counters()
    assert counters["taken"] == 10 and counters["written"] == len(delivered)
    assert dropped_by_reason(counters) == {
        "queue_full": threaded.dropped,
        "closed": 0,
        "write_error": 0,
        "error": 0,
    }


async def test_a_threaded_scrape_runner_runs_below_the_traffic_and_holds_the_sinks_lock() -> None:
    import os
    import threading

    from sidecar.hooks import SCRAPE_NICE, ScrapeRunner

    runner = ScrapeRunner(threaded=True)
    assert runner.lock is not None
    lock = runner.lock

    def work() -> tuple[int, int, bool]:
        tid = threading.get_native_id()
        return tid, os.getpriority(os.PRIO_PROCESS, tid), lock.locked()

    try:
        tid, nice, locked = await runner.run(work)
    finally:
        await asyncio.to_thread(runner.close)  # joins the scrape thread: off the loop
    assert tid != threading.get_native_id()  # not on the event loop's thread
    assert nice == os.getpriority(os.PRIO_PROCESS, 0) + SCRAPE_NICE or nice == 19
    assert locked
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < nice  # ours unchanged


async def test_records_that_come_during_a_threaded_scrape_wait_for_it_without_blocking() -> None:
    """The scrape thread (nice +19) can hold the sinks' lock for seconds on a busy core; the
    loop's deliveries meanwhile wait in order in a backlog instead of blocking the loop (a
    collector at saturation: /metrics 15 s, /stats > 45 s, every record and health check
    behind them). Delivered before the next record, or when the scrape lets go."""
    from sidecar.hooks import ScrapeRunner

    runner = ScrapeRunner(threaded=True)
    sink = Collecting("window")
    fanout = SinkFanout([sink], lock=runner.lock)
    runner.on_released.append(fanout.drain)
    holding, release = threading.Event(), threading.Event()
    finished = threading.Event()

    def slow_scrape() -> int:
        holding.set()
        release.wait(10)
        finished.set()
        return len(sink.records)

    def made(i: int) -> RequestRecord:
        return RequestRecord(
            request_id=f"r{i}", wall_time_ns=i, outcome=Outcome.OK, endpoint="chat"
        )

    try:
        fanout.on_record(made(0))
        scrape = asyncio.ensure_future(runner.run(slow_scrape))
        assert await asyncio.to_thread(holding.wait, 10)
        fanout.on_record(made(1))
        fanout.on_record(made(2))
        # Returned while the scrape still held the sinks: the loop did not wait for it.
        assert not finished.is_set()
        assert fanout.waiting == 2 and [r.request_id for r in sink.records] == ["r0"]
        release.set()
        assert await scrape == 1  # the scrape saw what was delivered before it
        # Drained when the scrape let go, in order, with no record after it.
        assert [r.request_id for r in sink.records] == ["r0", "r1", "r2"]
        assert fanout.waiting == 0
        # And a backlog left by a scrape goes first when the next record comes.
        for event in (holding, release, finished):
            event.clear()
        runner.on_released.clear()
        scrape = asyncio.ensure_future(runner.run(slow_scrape))
        assert await asyncio.to_thread(holding.wait, 10)
        fanout.on_record(made(3))
        release.set()
        await scrape
        fanout.on_record(made(4))
        assert [r.request_id for r in sink.records][-2:] == ["r3", "r4"]
    finally:
        release.set()
        await asyncio.to_thread(runner.close)


def test_past_the_backlog_a_record_is_dropped_and_counted_not_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A scrape that holds the sinks while the backlog is full (a host out of CPU: the scrape
    thread starves at nice +19) costs the records past the bound, each counted and said so by
    `on_record`'s answer; the caller never waits for the lock. (It used to wait, and the
    collector's loop froze behind a starved scrape, `/healthz` with it.) What waited is
    delivered, in order, once the scrape lets go."""
    import sidecar.hooks as hooks

    monkeypatch.setattr(hooks, "BACKLOG_MAX", 3)
    lock = threading.Lock()
    sink = Collecting("window")
    fanout = SinkFanout([sink], lock=lock)
    scrape_holds, scrape_may_end = threading.Event(), threading.Event()

    def scrape() -> None:  # another thread, as the scrape runner's
        with lock:
            scrape_holds.set()
            scrape_may_end.wait(10)

    holder = threading.Thread(target=scrape)
    holder.start()
    try:
        assert scrape_holds.wait(10)
        answers = [fanout.on_record(record(f"r{i}")) for i in range(5)]
        # Returned while the scrape still held the sinks: nothing waited for it.
        assert holder.is_alive()
        assert answers == [True, True, True, False, False]
        assert fanout.waiting == 3 and fanout.records_dropped_backlog == 2
        assert sink.records == []
    finally:
        scrape_may_end.set()
        holder.join(10)
    assert fanout.on_record(record("r5"))
    assert [r.request_id for r in sink.records] == ["r0", "r1", "r2", "r5"]
    assert fanout.waiting == 0 and fanout.records_dropped_backlog == 2


def test_the_backlog_is_bounded_by_memory_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Records of long streams are large (~8 KiB at 256 tokens, tens at thousands): the
    backlog also holds at most `BACKLOG_MAX_BYTES` of them by `approx_record_bytes`, however
    few they are, and its account starts over once what waited was delivered."""
    import sidecar.hooks as hooks
    from sidecar.record import RECORD_BASE_BYTES, approx_record_bytes

    one = approx_record_bytes(record())
    assert one == RECORD_BASE_BYTES  # no instants: the fixed part only
    monkeypatch.setattr(hooks, "BACKLOG_MAX_BYTES", 2 * one + one // 2)  # room for two
    lock = threading.Lock()
    sink = Collecting("window")
    fanout = SinkFanout([sink], lock=lock)
    with lock:  # a scrape holds the sinks (this thread: acquire(blocking=False) fails)
        answers = [fanout.on_record(record(f"a{i}")) for i in range(4)]
    assert answers == [True, True, False, False]
    assert fanout.waiting == 2 and fanout.records_dropped_backlog == 2
    assert fanout.on_record(record("a4"))  # the scrape let go: what waited goes first
    assert [r.request_id for r in sink.records] == ["a0", "a1", "a4"]
    with lock:
        answers = [fanout.on_record(record(f"b{i}")) for i in range(3)]
    assert answers == [True, True, False]  # room for two again, not zero
    fanout.drain()
    assert [r.request_id for r in sink.records][-2:] == ["b0", "b1"]
    assert fanout.records_dropped_backlog == 3


def test_flush_and_close_deliver_what_waited_for_a_scrape() -> None:
    lock = threading.Lock()
    sink = Collecting("window")
    fanout = SinkFanout([sink], lock=lock)
    with lock:  # a scrape holds the sinks
        fanout.on_record(record())
    assert fanout.waiting == 1 and sink.records == []
    assert fanout.flush()
    assert fanout.waiting == 0 and len(sink.records) == 1
    with lock:
        fanout.on_record(record())
    fanout.close()
    assert len(sink.records) == 2


async def test_an_inline_scrape_runner_runs_on_the_loop() -> None:
    import threading

    from sidecar.hooks import ScrapeRunner

    runner = ScrapeRunner()
    assert runner.lock is None
    assert await runner.run(threading.get_native_id) == threading.get_native_id()
    runner.close()


# -- the lifecycle: flush, close, counters ---------------------------------------------------


class Lifecycle(Collecting):
    """A sink that keeps the whole contract and notes every close in a shared journal."""

    def __init__(self, name: str, journal: list[str]) -> None:
        super().__init__(name)
        self.journal = journal
        self.closes = 0
        self.flushes = 0

    def flush(self, timeout_s: float = SINK_TIMEOUT_S) -> bool:
        self.flushes += 1
        return True

    def close(self, timeout_s: float = SINK_TIMEOUT_S) -> None:
        self.closes += 1
        self.journal.append(self.name)

    def counters(self) -> Mapping[str, int]:
        return {"taken": len(self.records)}


class FailsToClose(Lifecycle):
    def close(self, timeout_s: float = SINK_TIMEOUT_S) -> None:
        super().close(timeout_s)
        raise OSError("the export endpoint is gone")


def test_the_fanout_closes_each_sink_once_last_registered_first(
    caplog: pytest.LogCaptureFixture,
) -> None:
    journal: list[str] = []
    first, broken, last = (
        Lifecycle("first", journal),
        FailsToClose("broken", journal),
        Lifecycle("last", journal),
    )
    bare = Collecting("bare")  # only name and on_record: nothing to close, no counters
    fanout = SinkFanout([first, broken, bare])
    fanout.add(last)
    assert all(isinstance(sink, Sink) for sink in (first, broken, last))
    assert not isinstance(bare, Sink)
    fanout.on_record(record())
    assert fanout.counters() == {
        "first": {"taken": 1},
        "broken": {"taken": 1},
        "bare": {},
        "last": {"taken": 1},
    }
    with caplog.at_level(logging.ERROR):
        failed = fanout.close(timeout_s=5)
    # Reverse order; the failure is logged and said, and the sink before it still closes.
    assert journal == ["last", "broken", "first"]
    assert failed == ["broken"] == fanout.close_failures
    assert any("'broken' failed to close" in r.getMessage() for r in caplog.records)
    assert any("1 of 4 sinks failed to close: broken" in r.getMessage() for r in caplog.records)
    # Once: a second close closes nothing again and reports nothing.
    assert fanout.close() == [] and journal == ["last", "broken", "first"]
    assert (first.closes, broken.closes, last.closes) == (1, 1, 1)
    # A record after close reaches no sink; it is counted.
    fanout.on_record(record())
    assert len(first.records) == 1 and len(bare.records) == 1
    assert fanout.records_after_close == 1 and fanout.records_delivered == 1
    with pytest.raises(RuntimeError, match="closed"):
        fanout.add(Collecting("late"))


def test_the_fanout_flushes_every_sink_and_says_when_one_failed() -> None:
    journal: list[str] = []

    class FailsToFlush(Lifecycle):
        def flush(self, timeout_s: float = SINK_TIMEOUT_S) -> bool:
            raise RuntimeError("flush failed")

    good, bad = Lifecycle("good", journal), FailsToFlush("bad", journal)
    assert SinkFanout([good, Collecting("bare")]).flush(1) is True
    fanout = SinkFanout([bad, good])
    assert fanout.flush(1) is False
    assert good.flushes == 2  # the one after the failure still flushed


class Held(QueuedSink):
    """A queued sink whose thread waits at each batch until ``gate`` opens."""

    def __init__(self, queue_size: int = 10) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.batches: list[list[str]] = []
        self.finished = False
        super().__init__("held", queue_size=queue_size)

    def _write_batch(self, batch: list[RequestRecord]) -> None:
        self.entered.set()
        assert self.gate.wait(10)
        self.batches.append([r.request_id for r in batch])
        self.written += len(batch)

    def _finish(self) -> None:
        self.finished = True


def numbered(i: int) -> RequestRecord:
    return RequestRecord(request_id=str(i), wall_time_ns=i, outcome=Outcome.OK, endpoint="chat")


def test_a_queued_sink_flushes_what_it_took_and_closes_once_joining_its_thread() -> None:
    sink = Held()
    sink.on_record(numbered(0))
    assert sink.entered.wait(5)  # the thread holds record 0
    sink.on_record(numbered(1))
    # Held at the gate: nothing is done yet, so a flush runs out of time and says so.
    assert sink.flush(timeout_s=0.05) is False
    sink.gate.set()
    assert sink.flush(timeout_s=10) is True
    assert [r for batch in sink.batches for r in batch] == ["0", "1"]
    assert sink.counters()["written"] == 2 and sink.queued == 0
    sink.on_record(numbered(2))
    sink.close(timeout_s=10)
    assert not sink._thread.is_alive() and sink.finished  # joined, after its last batch
    assert sink.written == 3
    sink.close(timeout_s=10)  # idempotent
    sink.on_record(numbered(3))  # after close: dropped and counted, not an error
    counters = sink.counters()
    assert counters["taken"] == 4 and counters["dropped_closed"] == 1
    assert counters["taken"] == counters["written"] + sum(dropped_by_reason(counters).values())
    assert sink.flush(timeout_s=1) is True  # nothing pending


def test_a_threaded_sink_closes_its_inner_sink_after_its_queue() -> None:
    journal: list[str] = []
    inner = Lifecycle("inner", journal)
    threaded = ThreadedSink(inner)
    for i in range(5):
        threaded.on_record(numbered(i))
    assert threaded.flush(timeout_s=10) and inner.flushes == 1
    threaded.on_record(numbered(5))
    fanout = SinkFanout([threaded])
    assert fanout.close(timeout_s=10) == []
    # Everything queued reached the inner sink before it was closed, once.
    assert [r.request_id for r in inner.records] == [str(i) for i in range(6)]
    assert inner.closes == 1 and not threaded._thread.is_alive()
    counters = fanout.counters()["inner"]
    assert counters["taken"] == counters["written"] == 6
    assert sum(dropped_by_reason(counters).values()) == 0


def test_a_threaded_sink_counts_what_its_inner_sink_fails_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    threaded = ThreadedSink(Failing())
    with caplog.at_level(logging.ERROR):
        threaded.on_record(record())
        threaded.on_record(record())
        threaded.close(timeout_s=10)
    counters = threaded.counters()
    assert counters["taken"] == 2 and counters["written"] == 0
    assert dropped_by_reason(counters)["error"] == 2
