"""The relay's per-request timeouts share one lazy timer (`proxy/timeouts.py`): whichever
deadline passes first cancels the handler task and is named in `fired`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from sidecar import clock
from sidecar.proxy.timeouts import Timeouts


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
