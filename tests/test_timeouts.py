"""The relay's per-request timeouts share one lazy timer (`proxy/timeouts.py`): whichever
deadline passes first cancels the handler task and is named in `fired`."""

from __future__ import annotations

import asyncio
import functools
import gc
import weakref
from collections.abc import Callable

import pytest

from sidecar import clock
from sidecar.proxy.timeouts import Alarms, Deadline, Timeouts, alarms_of


async def _until_cancelled(make: Callable[[], Timeouts]) -> Timeouts:
    """Makes the timeouts inside a task, as the handler does (they cancel the task that made
    them), and returns them once one of them cancelled it (fails if none does within 5 s)."""
    holder: list[Timeouts] = []

    async def handler() -> None:
        holder.append(make())
        await asyncio.sleep(5)

    task = asyncio.ensure_future(handler())
    with pytest.raises(asyncio.CancelledError):
        await task
    return holder[0]


async def test_the_ttft_deadline_fires_first_when_it_is_the_earliest() -> None:
    def make() -> Timeouts:
        timeouts = Timeouts(total_s=10, ttft_s=0.05, idle_s=10)
        timeouts.start_idle()
        return timeouts

    timeouts = await _until_cancelled(make)
    assert timeouts.fired == "ttft_timeout"


async def test_after_the_first_token_the_idle_deadline_fires() -> None:
    def make() -> Timeouts:
        # The timer was set for the TTFT deadline (0.05 s); the first token moves it away,
        # the idle one (0.1 s after the last read) is next.
        timeouts = Timeouts(total_s=10, ttft_s=0.05, idle_s=0.1)
        timeouts.start_idle()
        timeouts.first_token()
        return timeouts

    timeouts = await _until_cancelled(make)
    assert timeouts.fired == "idle_timeout"


async def test_reads_postpone_the_idle_deadline_until_the_total_one_passes() -> None:
    reads: list[int] = []

    def make() -> Timeouts:
        timeouts = Timeouts(total_s=0.3, total_name="nonstream_timeout", idle_s=0.1)
        timeouts.start_idle()

        async def read_every_20ms() -> None:
            while timeouts.fired is None:
                timeouts.last_ns = clock.monotonic_ns()  # what the relay does per read
                reads.append(timeouts.last_ns)
                await asyncio.sleep(0.02)

        asyncio.get_running_loop().create_task(read_every_20ms())
        return timeouts

    timeouts = await _until_cancelled(make)
    assert timeouts.fired == "nonstream_timeout"
    assert len(reads) > 5  # the idle timer woke, saw a recent read, and slept again


class LaneReads:
    """What the idle timeout reads of a stream's C lane: the instant of its last read."""

    def __init__(self) -> None:
        self.last_read_ns = 0


async def test_reads_the_c_lane_takes_postpone_the_idle_deadline_too() -> None:
    """The lane keeps its reads' instants itself (nothing stored per read here); the timer
    reads the later of its own and the lane's when it wakes, and fires once neither moves."""
    lane_reads: list[int] = []

    def make() -> Timeouts:
        timeouts = Timeouts(total_s=10, idle_s=0.1)
        timeouts.start_idle()
        lane = timeouts.lane = LaneReads()  # type: ignore[assignment]

        async def lane_reads_for_300ms() -> None:
            end = clock.monotonic_ns() + 300_000_000
            while clock.monotonic_ns() < end:
                lane.last_read_ns = clock.monotonic_ns()
                lane_reads.append(lane.last_read_ns)
                await asyncio.sleep(0.02)

        asyncio.get_running_loop().create_task(lane_reads_for_300ms())
        return timeouts

    started = clock.monotonic_ns()
    timeouts = await _until_cancelled(make)
    assert timeouts.fired == "idle_timeout"
    # Not before the lane's last read + 0.1 s: the lane's reads kept it off for ~0.3 s.
    assert clock.monotonic_ns() - started >= 300_000_000
    assert clock.monotonic_ns() >= lane_reads[-1] + 100_000_000
    assert timeouts.last_ns < lane_reads[0]  # its own instant never moved


async def test_disarmed_timeouts_never_fire() -> None:
    timeouts = Timeouts(total_s=0.02, ttft_s=0.01, idle_s=0.01)
    timeouts.start_idle()
    timeouts.disarm()
    await asyncio.sleep(0.1)
    assert timeouts.fired is None


async def test_no_deadline_means_no_alarm() -> None:
    timeouts = Timeouts()
    timeouts.start_idle()
    assert timeouts._alarm is None


async def test_a_stream_adds_one_alarm_for_its_ttft_and_idle_deadlines() -> None:
    """The idle deadline begins at the answer's head (`start_idle`), never sooner than the
    timeouts were made: the one alarm is set to ring by then, and `start_idle` keeps it. A
    stream whose first token never comes is still cut at its TTFT deadline, after the idle
    wake found nothing due."""
    holder: list[Timeouts] = []
    timers: list[object] = []

    def make() -> Timeouts:
        made_at = clock.monotonic_ns()
        timeouts = Timeouts(total_s=10, ttft_s=0.25, idle_s=0.1)
        alarm = timeouts._alarm
        assert alarm is not None and alarm[0] <= made_at + 100_000_000 + 1_000_000
        timers.append(alarm)
        timeouts.start_idle()
        timers.append(timeouts._alarm)
        holder.append(timeouts)
        return timeouts

    async def reading() -> None:
        timeouts = make()
        while True:  # a read every 20 ms: the idle deadline never passes
            await asyncio.sleep(0.02)
            timeouts.last_ns = clock.monotonic_ns()

    task = asyncio.ensure_future(reading())
    with pytest.raises(asyncio.CancelledError):
        await task
    assert timers[0] is not None and timers[1] is timers[0]
    assert holder[0].fired == "ttft_timeout"


async def _wait_for(fired: list[int], timeout_s: float = 5.0) -> None:
    deadline = clock.monotonic_ns() + int(timeout_s * 1e9)
    while not fired and clock.monotonic_ns() < deadline:
        await asyncio.sleep(0.005)


async def test_a_deadline_fires_once_at_its_time() -> None:
    fired: list[int] = []
    deadline = Deadline(alarms_of(asyncio.get_running_loop()))
    set_at = clock.monotonic_ns()
    deadline.set(0.03, lambda: fired.append(clock.monotonic_ns()))
    assert deadline.armed
    await _wait_for(fired)
    assert len(fired) == 1 and fired[0] - set_at >= 30_000_000
    assert not deadline.armed
    await asyncio.sleep(0.05)
    assert len(fired) == 1


async def test_a_deadline_moved_later_keeps_its_timer_and_fires_at_the_new_time() -> None:
    fired: list[tuple[str, int]] = []
    deadline = Deadline(alarms_of(asyncio.get_running_loop()))
    deadline.set(0.02, lambda: fired.append(("first", clock.monotonic_ns())))
    alarm = deadline._alarm
    moved_at = clock.monotonic_ns()
    deadline.set(0.08, lambda: fired.append(("second", clock.monotonic_ns())))
    assert deadline._alarm is alarm  # no new alarm: the old one rings first and looks again
    while not fired:
        await asyncio.sleep(0.005)
    # The alarm rang at 20 ms, found the deadline moved, and was added again for it.
    assert [name for name, _ in fired] == ["second"] and fired[0][1] - moved_at >= 80_000_000


async def test_a_deadline_moved_earlier_gets_an_earlier_alarm() -> None:
    fired: list[int] = []
    deadline = Deadline(alarms_of(asyncio.get_running_loop()))
    deadline.set(10.0, lambda: fired.append(1))
    alarm = deadline._alarm
    deadline.set(0.01, lambda: fired.append(2))
    assert deadline._alarm is not alarm and alarm is not None and alarm[2] is None
    await _wait_for(fired)
    assert fired == [2]
    deadline.close()


async def test_a_cleared_deadline_never_fires_and_a_closed_one_holds_no_alarm() -> None:
    fired: list[int] = []
    deadline = Deadline(alarms_of(asyncio.get_running_loop()))
    deadline.set(0.01, lambda: fired.append(1))
    deadline.clear()
    assert not deadline.armed and deadline._alarm is not None  # left to ring for nothing
    await asyncio.sleep(0.05)
    assert fired == [] and deadline._alarm is None
    deadline.set(0.01, lambda: fired.append(2))
    alarm = deadline._alarm
    deadline.close()
    assert deadline._alarm is None and alarm is not None and alarm[2] is None
    await asyncio.sleep(0.05)
    assert fired == []


async def test_a_deadline_timer_made_to_wake_early_is_kept_by_a_shorter_deadline() -> None:
    """A connection's keep-alive deadline (long) wakes within the head's timeout (short), so
    that the next request's head deadline, set no earlier than that, keeps the same timer;
    and the long deadline still passes only at its own time."""
    fired: list[tuple[str, int]] = []
    deadline = Deadline(alarms_of(asyncio.get_running_loop()))
    set_at = clock.monotonic_ns()
    deadline.set(0.08, lambda: fired.append(("idle", clock.monotonic_ns())), wake_within_s=0.02)
    alarm = deadline._alarm
    assert alarm is not None and alarm[0] - set_at <= 20_000_000 + 1_000_000
    deadline.set(0.05, lambda: fired.append(("head", clock.monotonic_ns())))
    assert deadline._alarm is alarm  # the head's deadline is after the ring: alarm kept
    deadline.set(0.08, lambda: fired.append(("idle", clock.monotonic_ns())), wake_within_s=0.02)
    while not fired:
        await asyncio.sleep(0.005)
    assert [name for name, _ in fired] == ["idle"] and fired[0][1] - set_at >= 80_000_000


# ---------------------------------------------------------------------------------------------
# Alarms: every deadline of a loop on one loop timer


async def test_alarms_ring_in_order_of_their_instants_once_each() -> None:
    alarms = Alarms(asyncio.get_running_loop())
    now = clock.monotonic_ns()
    rang: list[str] = []
    # Added out of order; two at one instant ring in the order they were added.
    for name, after_ms in (("c", 40), ("a", 10), ("b1", 25), ("b2", 25)):
        alarms.add(now + after_ms * 1_000_000, now, functools.partial(rang.append, name))
    while len(rang) < 4:
        await asyncio.sleep(0.005)
    assert rang == ["a", "b1", "b2", "c"]
    assert clock.monotonic_ns() - now >= 40_000_000
    await asyncio.sleep(0.03)
    assert rang == ["a", "b1", "b2", "c"] and len(alarms) == 0 and alarms._timer is None


async def test_a_cancelled_alarm_never_rings_and_the_timer_skips_it() -> None:
    """A cancelled alarm stays in the heap until the timer passes it; the timer, on waking,
    drops the cancelled ones at the top, due or not, and sleeps until the next live one."""
    alarms = Alarms(asyncio.get_running_loop())
    now = clock.monotonic_ns()
    rang: list[str] = []
    late_at = now + 5_000_000_000  # far enough that no stall of this host reaches it
    early = alarms.add(now + 10_000_000, now, lambda: rang.append("early"))
    cancelled_later = alarms.add(now + 20_000_000, now, lambda: rang.append("cancelled"))
    late = alarms.add(late_at, now, lambda: rang.append("late"))
    alarms.cancel(cancelled_later)
    alarms.cancel(cancelled_later)  # twice: nothing more
    assert alarms.live == 2 and len(alarms) == 3
    while not rang:
        await asyncio.sleep(0.002)
    # "early" rang; the cancelled one (20 ms) went with it, and the timer waits for "late".
    assert rang == ["early"] and len(alarms) == 1 and alarms._wakes_at == late_at
    alarms.cancel(early)  # rang already: nothing to do
    assert alarms.live == 1
    alarms.cancel(late)
    assert alarms.live == 0 and rang == ["early"]
    assert alarms._timer is not None
    alarms._timer.cancel()


async def test_the_loop_timer_moves_only_for_an_earlier_alarm() -> None:
    alarms = Alarms(asyncio.get_running_loop())
    now = clock.monotonic_ns()
    alarms.add(now + 5_000_000_000, now, lambda: None)
    timer = alarms._timer
    alarms.add(now + 6_000_000_000, now, lambda: None)  # later: the same timer
    assert alarms._timer is timer and alarms._wakes_at == now + 5_000_000_000
    alarms.add(now + 1_000_000_000, now, lambda: None)  # earlier: a new one, the old cancelled
    assert alarms._timer is not timer and timer is not None and timer.cancelled()
    assert alarms._wakes_at == now + 1_000_000_000
    assert alarms._timer is not None
    alarms._timer.cancel()


async def test_cancelled_alarms_are_compacted_so_the_heap_stays_bounded() -> None:
    """A million requests each add an alarm due in minutes and cancel it within a millisecond:
    the heap holds the live ones and at most as many cancelled ones (plus 64), not every
    alarm of the last minutes."""
    alarms = Alarms(asyncio.get_running_loop())
    now = clock.monotonic_ns()
    live = [alarms.add(now + 600_000_000_000 + i, now, lambda: None) for i in range(10)]
    most = 0
    for i in range(20_000):
        alarm = alarms.add(now + 300_000_000_000 + i, now, lambda: None)
        alarms.cancel(alarm)
        most = max(most, len(alarms))
    assert alarms.live == 10
    assert most <= 2 * 10 + 64, most
    assert all(alarm[2] is not None for alarm in live)
    assert sorted(a[0] for a in alarms._heap if a[2] is not None) == [a[0] for a in live]
    assert alarms._timer is not None
    alarms._timer.cancel()


async def test_a_failing_callback_is_reported_and_the_other_alarms_still_ring() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        alarms = Alarms(loop)
        now = clock.monotonic_ns()
        rang: list[str] = []

        def fail() -> None:
            raise ValueError("broken callback")

        alarms.add(now + 5_000_000, now, fail)
        alarms.add(now + 5_000_000, now, lambda: rang.append("same instant"))
        alarms.add(now + 15_000_000, now, lambda: rang.append("later"))
        while len(rang) < 2:
            await asyncio.sleep(0.005)
        assert rang == ["same instant", "later"]
        assert len(reported) == 1 and isinstance(reported[0]["exception"], ValueError)
    finally:
        loop.set_exception_handler(None)


async def test_an_alarm_added_while_ringing_rings_at_its_own_time() -> None:
    alarms = Alarms(asyncio.get_running_loop())
    now = clock.monotonic_ns()
    rang: list[tuple[str, int]] = []

    def first() -> None:
        rang.append(("first", clock.monotonic_ns()))
        at = clock.monotonic_ns()
        alarms.add(at + 20_000_000, at, lambda: rang.append(("added", clock.monotonic_ns())))

    alarms.add(now + 5_000_000, now, first)
    last = alarms.add(now + 5_000_000_000, now, lambda: rang.append(("last", 0)))
    while len(rang) < 2:
        await asyncio.sleep(0.005)
    assert [name for name, _ in rang] == ["first", "added"]
    assert rang[1][1] - rang[0][1] >= 20_000_000
    assert alarms._wakes_at == now + 5_000_000_000  # then the timer waits for the last
    alarms.cancel(last)
    assert alarms._timer is not None
    alarms._timer.cancel()


def test_a_loops_alarms_are_one_and_go_with_the_loop() -> None:
    loop = asyncio.new_event_loop()
    try:
        alarms = alarms_of(loop)
        assert alarms_of(loop) is alarms and alarms.loop is loop
    finally:
        loop.close()
    gone = weakref.ref(loop)
    del loop
    gc.collect()
    assert gone() is None  # the alarms did not keep their loop alive
    with pytest.raises(RuntimeError, match="loop of these alarms is gone"):
        _ = alarms.loop
