"""The relay's per-request timeouts share one lazy timer (`proxy/timeouts.py`): whichever
deadline passes first cancels the handler task and is named in `fired`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from sidecar import clock
from sidecar.proxy.timeouts import Deadline, Timeouts


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


async def test_no_deadline_means_no_timer() -> None:
    timeouts = Timeouts()
    timeouts.start_idle()
    assert timeouts._handle is None


async def test_a_stream_arms_one_timer_for_its_ttft_and_idle_deadlines() -> None:
    """The idle deadline begins at the answer's head (`start_idle`), never sooner than the
    timeouts were made: the one timer is set to wake by then, and `start_idle` keeps it. A
    stream whose first token never comes is still cut at its TTFT deadline, after the idle
    wake found nothing due."""
    holder: list[Timeouts] = []
    timers: list[object] = []

    def make() -> Timeouts:
        made_at = clock.monotonic_ns()
        timeouts = Timeouts(total_s=10, ttft_s=0.25, idle_s=0.1)
        assert timeouts._wake_at <= made_at + 100_000_000 + 1_000_000
        timers.append(timeouts._handle)
        timeouts.start_idle()
        timers.append(timeouts._handle)
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
    deadline = Deadline(asyncio.get_running_loop())
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
    deadline = Deadline(asyncio.get_running_loop())
    deadline.set(0.02, lambda: fired.append(("first", clock.monotonic_ns())))
    timer = deadline._handle
    moved_at = clock.monotonic_ns()
    deadline.set(0.08, lambda: fired.append(("second", clock.monotonic_ns())))
    assert deadline._handle is timer  # no new timer: the old one wakes first and looks again
    while not fired:
        await asyncio.sleep(0.005)
    # The timer woke at 20 ms, found the deadline moved, and slept again until it.
    assert [name for name, _ in fired] == ["second"] and fired[0][1] - moved_at >= 80_000_000


async def test_a_deadline_moved_earlier_gets_an_earlier_timer() -> None:
    fired: list[int] = []
    deadline = Deadline(asyncio.get_running_loop())
    deadline.set(10.0, lambda: fired.append(1))
    timer = deadline._handle
    deadline.set(0.01, lambda: fired.append(2))
    assert deadline._handle is not timer and timer is not None and timer.cancelled()
    await _wait_for(fired)
    assert fired == [2]
    deadline.close()


async def test_a_cleared_deadline_never_fires_and_a_closed_one_holds_no_timer() -> None:
    fired: list[int] = []
    deadline = Deadline(asyncio.get_running_loop())
    deadline.set(0.01, lambda: fired.append(1))
    deadline.clear()
    assert not deadline.armed and deadline._handle is not None  # left to wake for nothing
    await asyncio.sleep(0.05)
    assert fired == [] and deadline._handle is None
    deadline.set(0.01, lambda: fired.append(2))
    timer = deadline._handle
    deadline.close()
    assert deadline._handle is None and timer is not None and timer.cancelled()
    await asyncio.sleep(0.05)
    assert fired == []


async def test_a_deadline_timer_made_to_wake_early_is_kept_by_a_shorter_deadline() -> None:
    """A connection's keep-alive deadline (long) wakes within the head's timeout (short), so
    that the next request's head deadline, set no earlier than that, keeps the same timer;
    and the long deadline still passes only at its own time."""
    fired: list[tuple[str, int]] = []
    deadline = Deadline(asyncio.get_running_loop())
    set_at = clock.monotonic_ns()
    deadline.set(0.08, lambda: fired.append(("idle", clock.monotonic_ns())), wake_within_s=0.02)
    timer = deadline._handle
    assert timer is not None and deadline._wake_at - set_at <= 20_000_000 + 1_000_000
    deadline.set(0.05, lambda: fired.append(("head", clock.monotonic_ns())))
    assert deadline._handle is timer  # the head's deadline is after the wake: timer kept
    deadline.set(0.08, lambda: fired.append(("idle", clock.monotonic_ns())), wake_within_s=0.02)
    while not fired:
        await asyncio.sleep(0.005)
    assert [name for name, _ in fired] == ["idle"] and fired[0][1] - set_at >= 80_000_000
