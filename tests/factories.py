"""Records and replay results built by hand for hand-worked tests, and the units they are
written in: one place, so that every test module builds them the same way.

Times are given in milliseconds (floats allowed) and stored as the records store them, integer
nanoseconds. A module whose cases share other defaults states them once, with
``functools.partial(build_record, ...)``, rather than writing a factory of its own. For random
but well-formed records, see random_records.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sidecar.record import ChunkMark, Outcome, RequestRecord, Timeline, TokenSource
from sidecar.replay.runner import SentRequest

US = 1_000  # ns in a microsecond
MS = 1_000_000  # ns in a millisecond
S = 1_000_000_000  # ns in a second

# (ms since the vantage's start, tokens) per token-carrying event.
MarksMs = Iterable[tuple[float, int]]


class _LastMark:
    """The default end of a timeline: its last token event (no end without one)."""

    def __repr__(self) -> str:
        return "LAST_MARK"


LAST_MARK: Any = _LastMark()


def ns(ms: float) -> int:
    return int(ms * MS)


def marks(*pairs: tuple[float, int]) -> tuple[ChunkMark, ...]:
    """``(ms, tokens)`` pairs as chunk marks (offsets in ns)."""
    return tuple(ChunkMark(ns(at_ms), n) for at_ms, n in pairs)


def build_timeline(
    marks_ms: MarksMs = (),
    *,
    start_ms: float = 0.0,
    end_ms: float | None = LAST_MARK,
    events_total: int | None = None,
) -> Timeline:
    """One vantage's timeline from ``(ms, tokens)`` events. ``end_ms``: the stream's end,
    by default the last event's instant (None: it never ended); ``events_total``: by default
    one event per mark (every event carried tokens)."""
    pairs = marks(*marks_ms)
    if end_ms is LAST_MARK:
        end_ns = pairs[-1].offset_ns if pairs else None
    else:
        end_ns = None if end_ms is None else ns(end_ms)
    return Timeline.from_marks(
        start_ns=ns(start_ms),
        marks=pairs,
        end_ns=end_ns,
        events_total=len(pairs) if events_total is None else events_total,
    )


def build_record(
    client_ms: MarksMs = (),
    *,
    request_id: str = "r",
    wall_ms: float = 0.0,
    outcome: Outcome = Outcome.OK,
    endpoint: str = "chat",
    end_ms: float | None = LAST_MARK,
    server: Timeline | None = None,
    n_in: int | None = None,
    n_out: int | None = None,
    token_source: TokenSource | None = None,
    **fields: Any,
) -> RequestRecord:
    """A record whose client saw the ``(ms, tokens)`` events ``client_ms`` and ended at
    ``end_ms`` (`build_timeline`). ``token_source``: by default USAGE when ``n_out`` is given
    (the upstream's usage said so), else NONE. Any other `RequestRecord` field by keyword
    (``wall_time_ns`` for an exact wall clock: ``wall_ms`` goes through a float)."""
    if token_source is None:
        token_source = TokenSource.NONE if n_out is None else TokenSource.USAGE
    fields.setdefault("wall_time_ns", ns(wall_ms))
    return RequestRecord(
        request_id=request_id,
        outcome=outcome,
        endpoint=endpoint,
        client=build_timeline(client_ms, end_ms=end_ms),
        server=server,
        n_in=n_in,
        n_out=n_out,
        token_source=token_source,
        **fields,
    )


def build_sent(
    index: int, at_ms: float, rec: RequestRecord, scheduled_ms: float | None = None
) -> SentRequest:
    """A replayed request: ``rec`` sent ``at_ms`` after the run's start, scheduled for
    ``scheduled_ms`` (by default on time)."""
    at = ns(at_ms)
    return SentRequest(index, at if scheduled_ms is None else ns(scheduled_ms), at, rec)
