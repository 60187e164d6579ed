"""The proxy's log lines leave the event loop through a bounded queue and a thread of their own.

`logging`'s stream handler writes to stderr in the caller's thread: on the event loop, a log
line costs a write syscall, and a stderr nobody reads (a full pipe, a stopped log collector)
blocks the write, and with it every stream the loop relays and every stamp it takes. Here a
record is put on a bounded queue (no I/O on the loop) and one daemon thread writes it. When the
queue is full the record is dropped and counted (`dropped`), never waited for; the first drop
of a run of drops is said on stderr by the writer thread once the queue has room again.
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import queue
import sys
from typing import TextIO

QUEUE_RECORDS = 10_000  # log lines waiting at the most
CLOSE_WAIT_S = 5.0


class DroppingQueueHandler(logging.handlers.QueueHandler):
    """A `QueueHandler` that drops (and counts) what a full queue cannot take."""

    def __init__(self, records: queue.Queue[logging.LogRecord | None]) -> None:
        super().__init__(records)
        self.dropped = 0
        self._said = 0  # drops already reported

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1

    def unreported_drops(self) -> int:
        """Drops since the last call (the writer says them, off the loop)."""
        new = self.dropped - self._said
        self._said = self.dropped
        return new


class _Writer(logging.handlers.QueueListener):
    def __init__(
        self,
        records: queue.Queue[logging.LogRecord | None],
        handler: logging.Handler,
        source: DroppingQueueHandler,
    ) -> None:
        super().__init__(records, handler, respect_handler_level=True)
        self._records = records
        self._source = source
        self._out = handler

    def enqueue_sentinel(self) -> None:
        # At close, off the loop: wait for room (the queue may be full), but not forever: a
        # stderr that never drains must not hold the process's exit (the thread is a daemon).
        with contextlib.suppress(queue.Full):
            self._records.put(None, timeout=CLOSE_WAIT_S)  # QueueListener's sentinel

    def stop(self) -> None:
        thread = self._thread
        if thread is None:
            return
        self.enqueue_sentinel()
        thread.join(CLOSE_WAIT_S)
        self._thread = None

    def handle(self, record: logging.LogRecord) -> None:
        dropped = self._source.unreported_drops()
        if dropped:
            note = logging.LogRecord(
                "sidecar.logs",
                logging.WARNING,
                __file__,
                0,
                "%d log lines dropped: the log queue was full (stderr not read fast enough)",
                (dropped,),
                None,
            )
            self._out.handle(note)
        super().handle(record)


class QueuedLogging:
    """Installed on the root logger by `install`; `close` writes what is queued and stops."""

    def __init__(
        self, handler: DroppingQueueHandler, writer: _Writer, logger: logging.Logger
    ) -> None:
        self.handler = handler
        self._writer = writer
        self._logger = logger

    @property
    def dropped(self) -> int:
        return self.handler.dropped

    def close(self) -> None:
        """Idempotent: the handler is removed, the writer stopped (once)."""
        self._logger.removeHandler(self.handler)
        self._writer.stop()  # writes what is queued, then joins the thread


def install(
    fmt: str,
    level: int = logging.INFO,
    stream: TextIO | None = None,
    capacity: int = QUEUE_RECORDS,
    logger: logging.Logger | None = None,
) -> QueuedLogging | None:
    """Route the root logger through a bounded queue to ``stream`` (stderr), where
    `logging.basicConfig` would have set up a stream handler: like it, only when the root
    logger has no handler yet (None then: whoever configured logging keeps it). ``logger``:
    another logger than the root one."""
    root = logger if logger is not None else logging.getLogger()
    if root.handlers:
        return None
    records: queue.Queue[logging.LogRecord | None] = queue.Queue(capacity)
    out = logging.StreamHandler(stream if stream is not None else sys.stderr)
    out.setFormatter(logging.Formatter(fmt))
    handler = DroppingQueueHandler(records)
    root.addHandler(handler)
    root.setLevel(level)
    writer = _Writer(records, out, handler)
    writer.start()
    return QueuedLogging(handler, writer, root)
