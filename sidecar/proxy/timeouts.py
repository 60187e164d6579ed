"""The data plane's deadlines: a request's timeouts (total, TTFT, idle; `Timeouts`), a client
connection's head, body and keep-alive deadlines (`Deadline`) and a pooled upstream
connection's idle expiry, all on one loop timer per event loop (`Alarms`)."""

from __future__ import annotations

import asyncio
import heapq
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from sidecar import clock
from sidecar.config import ProxyConfig

# The clock as a C static in compiled code (`clock.monotonic_ns` is a lookup of the module
# global and then of its attribute, at every reading).
_monotonic_ns: Final = clock.monotonic_ns

if TYPE_CHECKING:
    from sidecar.protocol._tokenscan import Lane

# A deadline that never comes (ns; past any monotonic clock this process will read).
NEVER: Final = 1 << 62
# A deadline found passed is confirmed this much later, after at least one poll of the sockets.
CONFIRM_NS: Final = 1_000_000
# An alarm is a list [at (ns), sequence number, callback]: heapq orders lists by their items
# in C, and the sequence number (unique) settles ties before the callback is compared. A
# cancelled or rung alarm's callback is None.
_AT: Final = 0
_CALLBACK: Final = 2
# Cancelled alarms left in the heap before it is rebuilt without them: at least this many, and
# at least as many as the live ones (the heap stays within twice the live alarms, plus this).
_COMPACT_AT: Final = 64

Alarm = list[Any]


class Alarms:
    """Every deadline of one event loop on one loop timer, set for the earliest alarm.

    Each request had three uvloop timers armed and cancelled (its timeouts, its connection's
    keep-alive deadline, its pooled upstream connection's idle expiry): a TimerHandle, a libuv
    timer and its close each time, ~5.3k instructions per deadline against ~2.9k for an alarm
    (`benchmarks/meter_instructions.py --scope timers`). Here adding an alarm is a push on a
    heap, and cancelling one clears its callback: it stays in the heap, ~150 bytes (its list and
    two ints, tracemalloc), until the timer passes it or the heap is rebuilt without the
    cancelled (when they are as many as the live ones). Almost every alarm is cancelled long
    before it is due (a request ends before its timeouts): the loop timer is moved only when an
    alarm comes due sooner than the timer wakes, and on waking it drops the cancelled alarms at
    the top of the heap along with the due ones, so that it sleeps until the next live one, not
    the next cancelled one.

    A callback runs from the loop timer's callback, as a `call_later` callback would; an
    exception in it goes to the loop's exception handler, and the other alarms still ring."""

    __slots__ = ("_loop", "_heap", "_seq", "_cancelled", "_timer", "_wakes_at")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # Weakly: `alarms_of` keeps a loop's alarms for as long as the loop lives, and a value
        # of a WeakKeyDictionary that held its key would keep both forever.
        self._loop = weakref.ref(loop)
        self._heap: list[Alarm] = []
        self._seq = 0
        self._cancelled = 0  # cancelled alarms still in the heap
        self._timer: asyncio.TimerHandle | None = None
        self._wakes_at = NEVER  # when the loop timer (if any) wakes

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop()
        if loop is None:
            raise RuntimeError("the event loop of these alarms is gone")
        return loop

    def __len__(self) -> int:
        """Alarms in the heap, the cancelled ones not yet dropped included."""
        return len(self._heap)

    @property
    def live(self) -> int:
        return len(self._heap) - self._cancelled

    def add(self, at: int, now: int, callback: Callable[[], object]) -> Alarm:
        """Call ``callback`` once the monotonic clock (`clock.monotonic_ns`) reads ``at`` or
        later; ``now`` is its reading the caller already has."""
        self._seq += 1
        alarm: Alarm = [at, self._seq, callback]
        heapq.heappush(self._heap, alarm)
        if at < self._wakes_at:
            self._set_timer(at, now)
        return alarm

    def cancel(self, alarm: Alarm) -> None:
        """The alarm will not ring (one that rang already: nothing to do)."""
        if alarm[_CALLBACK] is None:
            return
        alarm[_CALLBACK] = None
        self._cancelled += 1
        cancelled = self._cancelled
        heap = self._heap
        if cancelled >= _COMPACT_AT and cancelled * 2 >= len(heap):
            heap[:] = [kept for kept in heap if kept[_CALLBACK] is not None]
            heapq.heapify(heap)
            self._cancelled = 0

    def _set_timer(self, at: int, now: int) -> None:
        timer = self._timer
        if timer is not None:
            timer.cancel()
        self._wakes_at = at
        self._timer = self.loop.call_later(max(at - now, 0) / 1e9, self._ring)

    def _ring(self) -> None:
        self._timer = None
        now = _monotonic_ns()
        # While ringing, an alarm a callback adds sets no timer (one is set below, for the
        # earliest left), unless it is due already: then it rings in this pass.
        self._wakes_at = now
        heap = self._heap
        try:
            while heap:
                alarm = heap[0]
                callback = alarm[_CALLBACK]
                if callback is None:
                    heapq.heappop(heap)  # cancelled: dropped, due or not
                    self._cancelled -= 1
                    continue
                if alarm[_AT] > now:
                    break
                heapq.heappop(heap)
                alarm[_CALLBACK] = None  # rung: cancelling it now does nothing
                try:
                    callback()
                except Exception as exc:  # as the loop treats a call_later callback's
                    self.loop.call_exception_handler(
                        {"message": "Exception in an alarm's callback", "exception": exc}
                    )
        finally:
            self._wakes_at = NEVER
            if heap:
                self._set_timer(heap[0][_AT], now)


_ALARMS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Alarms] = weakref.WeakKeyDictionary()


def alarms_of(loop: asyncio.AbstractEventLoop) -> Alarms:
    """The loop's alarms (made at the first call): one heap and one timer per loop."""
    alarms = _ALARMS.get(loop)
    if alarms is None:
        alarms = _ALARMS[loop] = Alarms(loop)
    return alarms


class Timeouts:
    """The timeouts of one request (total, TTFT, idle) on one alarm (`Alarms`): the first to
    pass cancels the handler task, and `fired` names it (a client disconnect cancels with
    none).

    One alarm per request, not one per timeout. The alarm is lazy: it rings at the earliest
    deadline known when it was added, and a deadline that moved since (the first token came, a
    read happened) only means it is added again for the next one. A read costs one attribute
    store (`last_ns`), the first token one more (`ttft_at`); a read the stream's C lane takes
    costs nothing here: the lane keeps its last read's instant (`lane`,
    `Lane.last_read_ns`), and the alarm's callback reads it.
    """

    __slots__ = (
        "task",
        "total_at",
        "total_name",
        "ttft_at",
        "idle_ns",
        "last_ns",
        "lane",
        "fired",
        "_alarm",
        "_alarms",
        "_confirming",
    )

    def __init__(
        self,
        *,
        total_s: float = 0.0,
        total_name: str = "total_timeout",
        ttft_s: float = 0.0,
        idle_s: float = 0.0,
        alarms: Alarms | None = None,
    ) -> None:
        now = _monotonic_ns()
        # Given by the caller where it has them (its connection's), else looked up: every
        # asyncio.get_running_loop() is a getpid() syscall on CPython 3.11 (its fork check),
        # ~1 % of a worker's CPU at short streams (py-spy).
        if alarms is None:
            alarms = alarms_of(asyncio.get_running_loop())
        self._alarms = alarms
        self.task = asyncio.current_task(alarms.loop)
        self.total_at = now + int(total_s * 1e9) if total_s > 0 else NEVER
        self.total_name = total_name
        self.ttft_at = now + int(ttft_s * 1e9) if ttft_s > 0 else NEVER
        self.idle_ns = int(idle_s * 1e9) if idle_s > 0 else 0
        # The last upstream read; the idle deadline counts from it once `start_idle` ran.
        self.last_ns = NEVER
        # The stream's C lane while it has one (stream_relay): its reads count as reads.
        self.lane: Lane | None = None
        self.fired: str | None = None
        self._alarm: Alarm | None = None  # [when it wakes, _, callback]; None: not armed
        self._confirming = False
        # The idle deadline begins at `start_idle` (the answer's head), no sooner than now, so
        # it is never before now + idle_s: an alarm set to ring by then at the latest is one
        # `start_idle` finds ringing first, and leaves as it is (one alarm per request instead
        # of two and a cancel; ringing early costs a look and another alarm, after idle_s).
        self._arm(now, now + self.idle_ns if self.idle_ns else NEVER)

    @classmethod
    def for_generation(
        cls,
        config: ProxyConfig,
        streaming: bool,
        alarms: Alarms | None = None,
    ) -> Timeouts:
        total, name = config.total_timeout, "total_timeout"
        limit = config.nonstream_timeout
        if not streaming and limit > 0 and (total <= 0 or limit < total):
            total, name = limit, "nonstream_timeout"
        # `Timeouts(...)`, not `cls(...)`: compiled, the class's own constructor is a direct
        # call, where ``cls`` is any type to mypyc and its keyword arguments are parsed at run
        # time (~7k instructions a request).
        return Timeouts(
            total_s=total,
            total_name=name,
            ttft_s=config.ttft_timeout if streaming else 0.0,
            idle_s=config.idle_timeout if streaming else 0.0,
            alarms=alarms,
        )

    def start_idle(self) -> None:
        """From now on, a gap of ``idle_s`` between two reads (`last_ns`) ends the request."""
        if self.idle_ns:
            now = _monotonic_ns()
            self.last_ns = now
            self._arm(now)

    def first_token(self) -> None:
        self.ttft_at = NEVER

    def _deadline(self) -> tuple[int, str]:
        when, name = self.total_at, self.total_name
        if self.ttft_at < when:
            when, name = self.ttft_at, "ttft_timeout"
        last = self.last_ns
        if self.idle_ns and last != NEVER:
            lane = self.lane
            if lane is not None and lane.last_read_ns > last:
                last = lane.last_read_ns
            if last + self.idle_ns < when:
                when, name = last + self.idle_ns, "idle_timeout"
        return when, name

    def _arm(self, now: int, wake_by: int = NEVER) -> None:
        when = min(self._deadline()[0], wake_by)
        if when >= NEVER or self.task is None or self.fired is not None:
            return
        alarm = self._alarm
        if alarm is not None:
            if alarm[_AT] <= when:
                return  # it wakes first and looks again
            self._alarms.cancel(alarm)
        self._alarm = self._alarms.add(when, now, self._check)

    def _check(self) -> None:
        self._alarm = None
        now = _monotonic_ns()
        when, name = self._deadline()
        if when > now:
            self._confirming = False
            self._arm(now)  # a deadline moved, or the loop's clock woke us a little early
            return
        if not self._confirming:
            # Due; look once more after the loop has polled its sockets. After a stall (a
            # long callback, a garbage collection) libuv runs due timers before it reads, so
            # the token or read that would have moved this deadline may be waiting unread.
            self._confirming = True
            self._alarm = self._alarms.add(now + CONFIRM_NS, now, self._check)
            return
        if self.fired is None and self.task is not None:
            self.fired = name
            self.task.cancel()

    def disarm(self) -> None:
        self._confirming = False
        # Let go of the task: a handler that ends in an exception (a client that left, an
        # upstream that broke) keeps it in its traceback, whose frames hold these timeouts,
        # and the task held here would close a reference cycle around the whole request.
        self.task = None
        alarm = self._alarm
        if alarm is not None:
            self._alarms.cancel(alarm)
            self._alarm = None

    def absorb(self) -> None:
        """Our own cancellation was handled: clear it so that later awaits work (3.11+)."""
        uncancel = getattr(self.task, "uncancel", None)
        if uncancel is not None:
            uncancel()


class Deadline:
    """One deadline on one alarm, for a deadline that moves more often than it passes: a client
    connection's head, body and keep-alive deadlines. The alarm is lazy, as in `Timeouts`: a
    deadline set no earlier than the instant the alarm rings at only moves a number (the alarm
    rings, finds the deadline later and is added again for it), and a deadline cleared leaves
    the alarm to ring for nothing. `close` cancels the alarm (no deadline while a request is
    handled). A connection serving back-to-back requests adds one alarm per request (its
    keep-alive deadline's, made to ring within the head's timeout so that the next request's
    head deadline keeps it) and cancels one."""

    __slots__ = ("_alarms", "_alarm", "_at", "_callback")

    def __init__(self, alarms: Alarms) -> None:
        self._alarms = alarms
        self._alarm: Alarm | None = None  # [when it rings, _, callback]; None: none
        self._at = NEVER  # the deadline; NEVER: none
        self._callback: Callable[[], object] | None = None

    @property
    def armed(self) -> bool:
        return self._at != NEVER

    def set(
        self, delay_s: float, callback: Callable[[], object], wake_within_s: float = 0.0
    ) -> None:
        """Call ``callback`` ``delay_s`` from now, instead of whatever was set before. A new
        alarm is made to ring within ``wake_within_s`` (when positive and sooner than the
        deadline): a shorter deadline set before then keeps it."""
        now = _monotonic_ns()
        at = now + int(delay_s * 1e9)
        self._at = at
        self._callback = callback
        alarm = self._alarm
        if alarm is not None:
            if alarm[_AT] <= at:
                return  # it rings first and looks again
            self._alarms.cancel(alarm)
        if 0 < wake_within_s < delay_s:
            at = now + int(wake_within_s * 1e9)
        self._alarm = self._alarms.add(at, now, self._wake)

    def clear(self) -> None:
        """No deadline (the alarm, if any, rings for nothing)."""
        self._at = NEVER
        self._callback = None

    def close(self) -> None:
        """No deadline, and no alarm left."""
        self.clear()
        alarm, self._alarm = self._alarm, None
        if alarm is not None:
            self._alarms.cancel(alarm)

    def _wake(self) -> None:
        self._alarm = None
        at = self._at
        if at == NEVER:
            return
        now = _monotonic_ns()
        if now < at:  # moved since the alarm was added
            self._alarm = self._alarms.add(at, now, self._wake)
            return
        callback = self._callback
        self.clear()
        if callback is not None:
            callback()
