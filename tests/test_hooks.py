from __future__ import annotations

import logging

import pytest

from sidecar.hooks import RecordSink, SinkFanout
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


def record() -> RequestRecord:
    return RequestRecord(request_id="x", wall_time_ns=0, outcome=Outcome.OK, endpoint="chat")


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
    assert sum("disk on fire" in r.getMessage() or r.exc_text is not None
               for r in caplog.records) == 1


def test_sink_names_are_unique_and_protocol_is_structural() -> None:
    fanout = SinkFanout()
    sink = Collecting("a")
    assert isinstance(sink, RecordSink)
    fanout.add(sink)
    with pytest.raises(ValueError, match="already registered"):
        fanout.add(Collecting("a"))


def test_threaded_sink_delivers_everything_in_order_and_drops_when_full() -> None:
    import threading

    from sidecar.hooks import ThreadedSink

    gate = threading.Event()

    class Slow(Collecting):
        def on_record(self, record: RequestRecord) -> None:
            gate.wait(10)
            super().on_record(record)

    inner = Slow("slow")
    threaded = ThreadedSink(inner, queue_size=2)
    records = [RequestRecord(request_id=str(i), wall_time_ns=i, outcome=Outcome.OK,
                             endpoint="chat") for i in range(10)]
    for r in records:
        threaded.on_record(r)  # never blocks: the worker is stuck on the first one
    assert threaded.dropped >= 7
    gate.set()
    threaded.close()
    delivered = [r.request_id for r in inner.records]
    assert len(delivered) + threaded.dropped == 10
    assert delivered == sorted(delivered, key=int) and delivered[0] == "0"


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
        runner.close()
    assert tid != threading.get_native_id()  # not on the event loop's thread
    assert nice == os.getpriority(os.PRIO_PROCESS, 0) + SCRAPE_NICE or nice == 19
    assert locked
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < nice  # ours unchanged


async def test_an_inline_scrape_runner_runs_on_the_loop() -> None:
    import threading

    from sidecar.hooks import ScrapeRunner

    runner = ScrapeRunner()
    assert runner.lock is None
    assert await runner.run(threading.get_native_id) == threading.get_native_id()
    runner.close()
