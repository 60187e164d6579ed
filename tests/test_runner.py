"""The replay sender's loops (sidecar/replay/runner.py): open loop fires on the schedule and
never waits on a response, closed loop keeps a fixed number outstanding; what each sent
request says of itself. With a stand-in sender (events, no clock) and against a slow
simulator for the real thing."""

from __future__ import annotations

import asyncio
import gc

import aiohttp
import pytest
from factories import MS, build_record, build_sent

from sidecar import clock
from sidecar.record import Outcome
from sidecar.replay.runner import (
    PlannedRequest,
    Sender,
    SentRequest,
    _finish_reason,
    _json,
    _Kept,
    closed_loop,
    open_loop,
    out_of_collection,
)
from sidecar.sim.engine import EngineConfig
from sidecar.sim.server import SimConfig, close_replicas, start_replicas


def plan(n: int, every_s: float = 0.0) -> list[PlannedRequest]:
    return [PlannedRequest(i, i * every_s, "/v1/completions", {"model": "m"}) for i in range(n)]


class HeldSender(Sender):
    """Answers nothing until ``release`` is set; counts what is outstanding (no HTTP)."""

    def __init__(self) -> None:  # no target, no session: `send` is all the loops call
        self.release = asyncio.Event()
        self.in_flight = self.max_in_flight = 0
        self.sent = 0
        self.all_sent = asyncio.Event()
        self.expected = 0

    async def send(
        self, planned: PlannedRequest, run_start_ns: int, scheduled_ns: int | None
    ) -> SentRequest:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.sent += 1
        if self.sent == self.expected:
            self.all_sent.set()
        await self.release.wait()
        self.in_flight -= 1
        at = clock.monotonic_ns() - run_start_ns
        return SentRequest(
            planned.index,
            at if scheduled_ns is None else scheduled_ns,
            at,
            build_record([(1, 1)], request_id=str(planned.index)),
        )


async def test_open_loop_sends_everything_before_any_answer() -> None:
    sender = HeldSender()
    sender.expected = 5
    run = asyncio.create_task(open_loop(sender, plan(5), clock.monotonic_ns()))
    # Every request left while none had been answered: the loop never waits on a response.
    await asyncio.wait_for(sender.all_sent.wait(), 10)
    assert sender.in_flight == 5
    sender.release.set()
    sent = await asyncio.wait_for(run, 10)
    assert [s.index for s in sent] == [0, 1, 2, 3, 4]
    assert [s.scheduled_ns for s in sent] == [0] * 5  # all planned at the run's start


async def test_closed_loop_keeps_its_concurrency_and_sends_the_next_when_one_ends() -> None:
    sender = HeldSender()
    sender.expected = 2
    run = asyncio.create_task(closed_loop(sender, plan(5), 2, clock.monotonic_ns()))
    await asyncio.wait_for(sender.all_sent.wait(), 10)
    assert sender.sent == 2  # the other three wait for an answer
    sender.release.set()
    sent = await asyncio.wait_for(run, 10)
    assert sender.max_in_flight == 2 and [s.index for s in sent] == [0, 1, 2, 3, 4]
    # Closed loop has no schedule: each request's is its send.
    assert all(s.lateness_ns == 0 for s in sent)
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        await closed_loop(sender, plan(1), 0, clock.monotonic_ns())


def test_the_results_a_run_keeps_give_the_cycle_collector_nothing_per_request() -> None:
    """A long replay keeps every finished request until it returns: as objects, each full
    collection scanned them all while sends waited (240 ms pauses at 80,000 requests). Kept
    as arrays and untracked records, they add no tracked object per request, and come back
    as the same requests in the order of their index."""
    kept = _Kept()
    given = [
        SentRequest(i, 10 * i, 10 * i + 3, build_record([(1, 1)], request_id=f"r{i}"))
        for i in (4, 0, 3, 1, 2)
    ]
    for sent in given:
        kept.add(sent)
    assert kept.sent() == sorted(given, key=lambda s: s.index)
    assert all(
        a.record is b.record
        for a, b in zip(kept.sent(), sorted(given, key=lambda s: s.index), strict=True)
    )
    many = _Kept()
    gc.collect()
    before = len(gc.get_objects())
    for i in range(500):  # each request's record and timeline made here, tracked, as a run's are
        many.add(SentRequest(i, i, i, build_record([(1, 1), (2, 1)], request_id=f"many-{i}")))
    gc.collect()
    # Not one per request: kept as objects, each request left 3 (request, record, timeline).
    assert len(gc.get_objects()) - before < 50
    assert not gc.is_tracked(many.records[0]) and not gc.is_tracked(many.records[0].client)


def test_a_run_leaves_what_exists_before_it_out_of_collection_and_gives_it_back() -> None:
    gc.unfreeze()  # a known start: an in-process proxy of an earlier test may have frozen
    plan_bodies = [{"messages": [{"role": "user", "content": f"p{i}"}]} for i in range(100)]
    with out_of_collection():
        # Frozen: no collection scans them while the run sends.
        assert gc.get_freeze_count() >= len(plan_bodies)
    assert gc.get_freeze_count() == 0  # given back
    gc.freeze()  # a process that froze objects of its own (the proxy's start-up does)
    try:
        frozen = gc.get_freeze_count()
        with out_of_collection():
            pass
        assert gc.get_freeze_count() >= frozen  # theirs stay frozen
    finally:
        gc.unfreeze()
    del plan_bodies


def test_a_sent_request_ends_at_its_send_plus_its_records_end() -> None:
    # Sent 12 ms into the run, 2 ms behind its schedule; the client's end 30 ms after the send.
    sent = build_sent(0, 12, build_record([(20, 1)], end_ms=30), scheduled_ms=10)
    assert sent.lateness_ns == 2 * MS and sent.end_ns == 42 * MS
    # Without a client end, the last token is the end.
    assert build_sent(0, 12, build_record([(20, 1)], end_ms=None)).end_ns == 32 * MS


def test_non_streamed_answers_are_read_leniently() -> None:
    assert _json(b'{"a": 1}') == {"a": 1}
    assert _json(b"not json") is None and _json(b"[" * 100_000) is None
    assert _finish_reason({"choices": [{"finish_reason": "length"}]}) == "length"
    assert _finish_reason({"choices": [{"finish_reason": 3}]}) is None
    assert _finish_reason({"choices": []}) is None and _finish_reason({}) is None


SLOW = SimConfig(model="m", engine=EngineConfig(step_floor_s=0.05, per_token_s=0.0))


@pytest.mark.slow
async def test_open_loop_keeps_its_schedule_against_a_slow_upstream() -> None:
    replicas = await start_replicas(SLOW, 1)
    try:
        plan = [
            PlannedRequest(
                i,
                i * 0.02,
                "/v1/completions",
                {
                    "model": "m",
                    "prompt": [5, 6, 7],
                    "max_tokens": 20,
                    "ignore_eos": True,
                    "stream": True,
                },
            )
            for i in range(20)
        ]
        async with aiohttp.ClientSession() as session:
            sender = Sender(replicas[0].url, session)
            start = clock.monotonic_ns() + 20_000_000
            opened = await open_loop(sender, plan, start)
            # Each request takes ~1 s (20 steps of 50 ms), yet the 20 sends kept the 0.38 s
            # schedule: the sender never waited on a response. (The lateness itself is a
            # timing figure: measured in benchmarks/replay_pacing.py, not asserted here.)
            assert all(s.record.outcome is Outcome.OK for s in opened)
            assert max(s.actual_ns for s in opened) / 1e9 < 1.0
            assert min(s.record.client.end_ns or 0 for s in opened) / 1e9 > 0.9
            assert sender.max_in_flight >= 15
            sender = Sender(replicas[0].url, session)
            start = clock.monotonic_ns() + 20_000_000
            # Closed loop, two at a time: six of the same requests (each still ~1 s) are enough.
            closed = await closed_loop(sender, plan[:6], 2, start)
        # Closed loop: the 6th request could only leave after 2 rounds of >= 1 s each (an open
        # loop would have sent it 0.1 s in).
        assert len(closed) == 6 and all(s.record.outcome is Outcome.OK for s in closed)
        assert max(s.actual_ns for s in closed) / 1e9 > 1.8, [s.actual_ns / 1e9 for s in closed]
        assert sender.max_in_flight == 2
    finally:
        await close_replicas(replicas)
