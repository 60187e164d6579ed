"""How far a long replay or sweep step has got, on stderr, while it runs.

The display never touches the send path: the sender only bumps its counters (as it always
did); a thread of its own reads them on a timer and draws. On a terminal that is a `rich`
progress bar redrawn once a second (one redraw costs about 1 ms of CPU on the 2-core VM of
benchmarks/RESULTS.md); elsewhere (a pipe, a file, a CI log) one plain line every 10 s and one at
the end. Everything goes to stderr, so that stdout stays the report; `--quiet` turns it off.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn
from rich.table import Column

TTY_REFRESH_S = 1.0
PLAIN_EVERY_S = 10.0
BAR_WIDTH = 30  # at most; less on a narrow terminal


@dataclass(frozen=True, slots=True)
class Counts:
    """Requests of the run so far: sent (left the sender), finished (answered, failed or
    not), failed (finished with an outcome other than ok)."""

    sent: int
    finished: int
    failed: int


def clock_text(seconds: float) -> str:
    """0:42, 12:05, 1:02:03."""
    whole = max(0, int(round(seconds)))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class ProgressDisplay:
    """``with ProgressDisplay(label, total, read): ...`` around a run.

    ``read`` returns the run's `Counts` (it is called from the display's thread);
    ``starts_at`` (a `time.monotonic` instant) is when the run's first request is due: until
    then the display counts down to it, naming ``waiting_for``.
    """

    def __init__(
        self,
        label: str,
        total: int,
        read: Callable[[], Counts],
        *,
        stream: TextIO | None = None,
        starts_at: float | None = None,
        waiting_for: str = "the start",
        tty: bool | None = None,
        refresh_s: float = TTY_REFRESH_S,
        plain_every_s: float = PLAIN_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label = label
        self.total = total
        self.read = read
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.starts_at = starts_at if starts_at is not None else clock()
        self.waiting_for = waiting_for
        console = Console(file=self.stream, highlight=False)
        self.tty = (console.is_terminal and not console.is_dumb_terminal) if tty is None else tty
        self.period_s = refresh_s if self.tty else plain_every_s
        self._console = console
        self._progress: Progress | None = None
        self._bar = BarColumn(bar_width=BAR_WIDTH)
        self._task: TaskID | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one drawing at a time (the thread, then stop())

    # -- what is shown ----------------------------------------------------------------------

    def status(self, counts: Counts, now: float, *, final: bool = False) -> str:
        """The numbers after the label: the same words on a terminal and in a log."""
        if now < self.starts_at and not final:
            return f"waiting for {self.waiting_for}, starts in {clock_text(self.starts_at - now)}"
        elapsed = max(now - self.starts_at, 0.0)
        rate = counts.finished / elapsed if elapsed > 0 and counts.finished else None
        parts = [
            f"{counts.finished}/{self.total} finished",
            f"{counts.sent} sent",
            f"{counts.failed} failed",
            f"{rate:.1f} req/s" if rate is not None else "- req/s",
        ]
        if final:
            parts.append(f"in {clock_text(elapsed)}")
            return ", ".join(parts)
        if not self.tty:  # a terminal's line is short: its bar shows how far
            parts.append(f"{clock_text(elapsed)} elapsed")
        left = self.total - counts.finished
        if rate is not None and left > 0:
            parts.append(f"ETA {clock_text(left / rate)}")
        elif left > 0:
            parts.append("ETA -")
        return ", ".join(parts)

    def line(self, counts: Counts, now: float, *, final: bool = False) -> str:
        """One plain line (a log's form)."""
        return f"{self.label}: {self.status(counts, now, final=final)}"

    # -- drawing ----------------------------------------------------------------------------

    def _draw(self, *, final: bool = False) -> None:
        with self._lock:
            counts = self.read()
            now = self.clock()
            if self._progress is not None and self._task is not None:
                status = self.status(counts, now, final=final)
                # The numbers come first: on a narrow terminal the bar shrinks, then goes.
                room = self._console.width - len(self.label) - len(status) - 2
                self._bar.bar_width = max(0, min(BAR_WIDTH, room))
                self._progress.update(self._task, completed=counts.finished, status=status)
                self._progress.refresh()
            else:
                print(self.line(counts, now, final=final), file=self.stream, flush=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self._draw()
            except Exception:  # noqa: BLE001 - a display must never stop a run
                return

    def start(self) -> None:
        if self.tty:
            self._progress = Progress(
                TextColumn(self.label, table_column=Column(no_wrap=True)),
                self._bar,
                TextColumn(
                    "{task.fields[status]}", table_column=Column(no_wrap=True, overflow="ellipsis")
                ),
                console=self._console,
                auto_refresh=False,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self._progress.start()
            self._task = self._progress.add_task(self.label, total=max(self.total, 1), status="")
            self._draw()
        elif self.clock() < self.starts_at - 1.0:
            self._draw()  # a log says at once why nothing happens yet
        self._thread = threading.Thread(target=self._run, name="replay-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._draw(final=True)
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> ProgressDisplay:
        self.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
