"""The only place that reads clocks.

Intervals use ``time.perf_counter_ns()`` (CLOCK_MONOTONIC on Linux: nanosecond resolution,
shared by every process on the host, so a proxy and a simulator can compare stamps). uvloop's
``loop.time()`` is only millisecond-accurate and is not used for measurement. Calendar time is
read once per request, together with a monotonic reading, to anchor that request's offsets.
"""

from __future__ import annotations

import time

monotonic_ns = time.perf_counter_ns
wall_ns = time.time_ns


def anchor() -> tuple[int, int]:
    """(wall_ns, mono_ns): a wall-clock instant and the monotonic instant read right after it.
    A plain tuple: read once per request, where a named tuple's constructor, an interpreted
    function, cost more than both clock reads."""
    return time.time_ns(), time.perf_counter_ns()


def from_realtime_ns(realtime_ns: int, now_mono_ns: int) -> int:
    """A CLOCK_REALTIME instant (a kernel receive timestamp) on the monotonic clock, by the
    offset between the two clocks now; ``now_mono_ns`` was read just before. Exact up to the
    calendar clock's slewing since the instant (<= 0.5 µs per ms under NTP)."""
    return realtime_ns - (time.time_ns() - now_mono_ns)
