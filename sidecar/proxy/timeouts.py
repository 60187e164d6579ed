"""A request's timeouts (total, TTFT, idle) on one lazy timer; see `Timeouts`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from sidecar import clock
from sidecar.config import ProxyConfig

if TYPE_CHECKING:
    from sidecar.protocol._tokenscan import Lane

# A deadline that never comes (ns; past any monotonic clock this process will read).
NEVER: Final = 1 << 62
# A deadline found passed is confirmed this much later, after at least one poll of the sockets.
CONFIRM_S: Final = 0.001


class Timeouts:
    """The timeouts of one request (total, TTFT, idle) on one timer: the first to pass
    cancels the handler task, and `fired` names it (a client disconnect cancels with none).

    One timer per request, not one per timeout: arming and cancelling a uvloop timer costs
    ~2 µs, and each one waiting holds ~0.5 KiB (a TimerHandle and its libuv timer) for the
    whole stream. The timer is lazy: it wakes at the earliest deadline known when it was set,
    and a deadline that moved since (the first token came, a read happened) only means it
    sleeps again until the next one. A read costs one attribute store (`last_ns`), the first
    token one more (`ttft_at`); a read the stream's C lane takes costs nothing here: the lane
    keeps its last read's instant (`lane`, `Lane.last_read_ns`), and the timer reads it when
    it wakes.
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
        "_handle",
        "_wake_at",
        "_loop",
        "_confirming",
    )

    def __init__(
        self,
        *,
        total_s: float = 0.0,
        total_name: str = "total_timeout",
        ttft_s: float = 0.0,
        idle_s: float = 0.0,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        now = clock.monotonic_ns()
        # Given by the caller where it has it, else looked up once: every
        # asyncio.get_running_loop() is a getpid() syscall on CPython 3.11 (its fork check),
        # ~1 % of a worker's CPU at short streams (py-spy).
        self._loop = loop or asyncio.get_running_loop()
        self.task = asyncio.current_task(self._loop)
        self.total_at = now + int(total_s * 1e9) if total_s > 0 else NEVER
        self.total_name = total_name
        self.ttft_at = now + int(ttft_s * 1e9) if ttft_s > 0 else NEVER
        self.idle_ns = int(idle_s * 1e9) if idle_s > 0 else 0
        # The last upstream read; the idle deadline counts from it once `start_idle` ran.
        self.last_ns = NEVER
        # The stream's C lane while it has one (stream_relay): its reads count as reads.
        self.lane: Lane | None = None
        self.fired: str | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._wake_at = NEVER
        self._confirming = False
        # The idle deadline begins at `start_idle` (the answer's head), no sooner than now, so
        # it is never before now + idle_s: a timer set to wake by then at the latest is one
        # `start_idle` finds waking first, and leaves as it is (one timer armed per request
        # instead of two and a cancel; waking early costs a look and a re-arm, after idle_s).
        self._arm(now, now + self.idle_ns if self.idle_ns else NEVER)

    @classmethod
    def for_generation(
        cls,
        config: ProxyConfig,
        streaming: bool,
        loop: asyncio.AbstractEventLoop | None = None,
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
            loop=loop,
        )

    def start_idle(self) -> None:
        """From now on, a gap of ``idle_s`` between two reads (`last_ns`) ends the request."""
        if self.idle_ns:
            now = clock.monotonic_ns()
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
        if self._handle is not None:
            if self._wake_at <= when:
                return  # it wakes first and looks again
            self._handle.cancel()
        self._wake_at = when
        self._handle = self._loop.call_later(max(when - now, 0) / 1e9, self._check)

    def _check(self) -> None:
        self._handle = None
        self._wake_at = NEVER
        now = clock.monotonic_ns()
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
            self._wake_at = now
            self._handle = self._loop.call_later(CONFIRM_S, self._check)
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
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
            self._wake_at = NEVER

    def absorb(self) -> None:
        """Our own cancellation was handled: clear it so that later awaits work (3.11+)."""
        uncancel = getattr(self.task, "uncancel", None)
        if uncancel is not None:
            uncancel()


class Deadline:
    """One deadline on one loop timer, for a deadline that moves more often than it passes: a
    client connection's head, body and keep-alive deadlines. Arming and cancelling a uvloop
    timer costs ~2 µs (a TimerHandle and a libuv timer each time); here the timer is lazy, as
    in `Timeouts`: a deadline set no earlier than the instant the timer wakes at only moves a
    number (the timer wakes, finds the deadline later and sleeps again until it), and a
    deadline cleared leaves the timer to wake for nothing. `close` cancels the timer: while a
    request is handled there is no deadline, and a timer left waiting would hold its ~0.5 KiB
    for the stream's first seconds (measured: +0.5 KiB per in-flight stream at 9,900 streams,
    `proxy_memory.py`). A connection serving back-to-back requests then arms one timer per
    request (its keep-alive deadline's, made to wake within the head's timeout so that the
    next request's head deadline keeps it) and cancels one, where it armed and cancelled
    three."""

    __slots__ = ("_loop", "_handle", "_wake_at", "_at", "_callback")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._handle: asyncio.TimerHandle | None = None
        self._wake_at = NEVER  # when the timer (if any) wakes
        self._at = NEVER  # the deadline; NEVER: none
        self._callback: Callable[[], object] | None = None

    @property
    def armed(self) -> bool:
        return self._at != NEVER

    def set(
        self, delay_s: float, callback: Callable[[], object], wake_within_s: float = 0.0
    ) -> None:
        """Call ``callback`` ``delay_s`` from now, instead of whatever was set before. A new
        timer is made to wake within ``wake_within_s`` (when positive and sooner than the
        deadline): a shorter deadline set before then keeps it."""
        now = clock.monotonic_ns()
        at = now + int(delay_s * 1e9)
        self._at = at
        self._callback = callback
        handle = self._handle
        if handle is not None:
            if self._wake_at <= at:
                return  # it wakes first and looks again
            handle.cancel()
        if 0 < wake_within_s < delay_s:
            delay_s = wake_within_s
            at = now + int(wake_within_s * 1e9)
        self._wake_at = at
        self._handle = self._loop.call_later(max(delay_s, 0.0), self._wake)

    def clear(self) -> None:
        """No deadline (the timer, if any, wakes for nothing: cheaper than cancelling it)."""
        self._at = NEVER
        self._callback = None

    def close(self) -> None:
        """No deadline, and no timer left waiting."""
        self.clear()
        handle, self._handle = self._handle, None
        self._wake_at = NEVER
        if handle is not None:
            handle.cancel()

    def _wake(self) -> None:
        self._handle = None
        self._wake_at = NEVER
        at = self._at
        if at == NEVER:
            return
        now = clock.monotonic_ns()
        if now < at:  # moved since the timer was set, or the loop's clock woke us early
            self._wake_at = at
            self._handle = self._loop.call_later((at - now) / 1e9, self._wake)
            return
        callback = self._callback
        self.clear()
        if callback is not None:
            callback()
