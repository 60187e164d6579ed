"""The proxy's logging off the event loop (sidecar/proxy/logs.py): lines leave in order through a
thread; a stream that does not take them costs drops, counted and said, never a wait."""

from __future__ import annotations

import io
import logging
import threading
from collections.abc import Iterator

import pytest

from sidecar.proxy import logs


@pytest.fixture
def bare_root() -> Iterator[logging.Logger]:
    """A logger with no handler, standing for the root logger of a process of its own (pytest
    keeps its capture handlers on the loggers of the hierarchy: this one is outside it)."""
    logger = logging.Logger("sidecar-test-logs")
    try:
        yield logger
    finally:
        for handler in list(logger.handlers):
            logger.removeHandler(handler)


def test_lines_are_written_in_order_by_the_writer_thread(bare_root: logging.Logger) -> None:
    out = io.StringIO()
    queued = logs.install("%(levelname)s %(message)s", stream=out, logger=bare_root)
    assert queued is not None
    for i in range(50):
        bare_root.info("line %d", i)
    queued.close()
    assert out.getvalue().splitlines() == [f"INFO line {i}" for i in range(50)]
    assert queued.dropped == 0 and not bare_root.handlers  # closed: the handler is gone


class BlockedStream(io.StringIO):
    """A stderr nobody reads: a write waits until the test lets it go."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def write(self, text: str) -> int:
        self.entered.set()
        self.release.wait(10)
        return super().write(text)


def test_a_full_queue_drops_and_counts_and_says_so_later(bare_root: logging.Logger) -> None:
    out = BlockedStream()
    queued = logs.install("%(message)s", stream=out, capacity=2, logger=bare_root)
    assert queued is not None
    log = bare_root
    log.warning("first")  # the writer takes it and blocks in write
    assert out.entered.wait(10)
    for i in range(10):
        log.warning("burst %d", i)  # 2 fit in the queue, 8 are dropped: none of them waits
    assert queued.dropped == 8
    log.warning("after")  # still full: dropped too
    assert queued.dropped == 9
    out.release.set()
    queued.close()
    # The drops are said when the writer next writes (before the line it took next).
    assert out.getvalue().splitlines() == [
        "first",
        "9 log lines dropped: the log queue was full (stderr not read fast enough)",
        "burst 0",
        "burst 1",
    ]


def test_logging_set_up_by_someone_else_is_left_alone() -> None:
    root = logging.getLogger()
    root.addHandler(handler := logging.NullHandler())
    try:
        before = list(root.handlers)
        assert logs.install("%(message)s") is None
        assert root.handlers == before
    finally:
        root.removeHandler(handler)
