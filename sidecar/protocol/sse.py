"""Incremental Server-Sent-Events parser, sans-IO (WHATWG HTML, "Interpreting an event stream").

The parser works on bytes and decodes only complete events, so a UTF-8 character split across two
reads never reaches the decoder half-formed; invalid UTF-8 becomes U+FFFD and parsing goes on.

Each *block* (the lines up to and including the blank line that ends them) becomes one `SSEEvent`
whose ``raw`` holds its exact bytes, so a proxy can forward events one by one byte for byte:
``b"".join(e.raw for e in events) + parser.pending == everything fed``. Two departures from the
browser's behaviour follow from that, and neither changes what a browser would dispatch:

- blocks without a ``data`` field (comments such as ``: keep-alive``, or only ``event:``/``id:``
  lines) are reported too, with ``data=None``; a browser would not dispatch them.
- blank lines before a block's first field dispatch nothing; their bytes (and a leading BOM) are
  carried in the ``raw`` of the next block.

Per the spec an unterminated last block is discarded at end of stream: `close()` never invents a
blank line. `truncated` and `pending_bytes` let the caller record a stream cut mid-event.

A CR at the very end of the data read so far is held back until the next byte (or `close()`), as
it may be the first half of a CRLF; that keeps events identical however the stream is split.
vLLM only ever sends LF, so the hot path never sees it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, NoReturn

BOM = b"\xef\xbb\xbf"
DONE_EVENT = b"data: [DONE]\n\n"
KEEPALIVE_EVENT = b": keep-alive\n\n"
DEFAULT_MAX_EVENT_SIZE = 1 << 20

_LF = 0x0A
_CR = 0x0D
_SPACE = 0x20


class SSEEvent(NamedTuple):
    """One block of the stream.

    ``data``: the ``data`` lines joined with "\\n"; None if the block had no ``data`` field (a
    comment-only block, e.g. a keep-alive). ``comment``: the comment lines' text (one leading
    space dropped, several lines joined with "\\n"), only when ``data`` is None. ``event``/``id``/
    ``retry``: those fields as given in this block (None if absent or, for ``id`` and ``retry``,
    invalid per the spec). ``raw``: the block's exact bytes, terminating blank line included.
    """

    data: str | None
    raw: bytes
    event: str | None = None
    comment: str | None = None
    id: str | None = None
    retry: int | None = None

    @property
    def is_done(self) -> bool:
        return self.data == "[DONE]"


class SSEError(ValueError):
    """The stream cannot be parsed within the parser's bounds (an event over the size limit).

    ``events`` holds the events completed by the failing `SSEParser.feed` call before the failure,
    so that nothing already parsed is lost; the bytes from the failing block onward stay in
    `SSEParser.pending`. The parser refuses further input afterwards.
    """

    def __init__(self, message: str, events: list[SSEEvent] | None = None) -> None:
        super().__init__(message)
        self.events: list[SSEEvent] = events if events is not None else []


def encode_data_event(payload: str) -> bytes:
    """Encode ``payload`` as one data event, the way vLLM does: ``data: <payload>\\n\\n``.

    A payload holding line breaks is split over several ``data:`` lines, which decodes back to
    the same text (vLLM's compact JSON never needs this).
    """
    if "\n" in payload or "\r" in payload:
        lines = payload.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        return "".join(f"data: {line}\n" for line in lines).encode() + b"\n"
    return b"data: " + payload.encode() + b"\n\n"


# Builds an SSEEvent without NamedTuple's keyword-handling __new__: half the cost per event.
_new_tuple = tuple.__new__


def _decode(b: bytes | bytearray) -> str:
    return b.decode("utf-8", "replace")


def data_events(data: bytes, max_event_size: int) -> tuple[list[SSEEvent], int]:
    r"""The whole ``data:<payload>\n\n`` events at the start of ``data``, and where the first
    thing that is not one begins (``len(data)`` when there is none): the common read while the
    parser holds nothing, taken without its general machinery. An event stops the run when its
    LF LF end is not in ``data``, when it holds a CR, or when it is over ``max_event_size``
    bytes. `_tokenscan.data_events` does this in C where the package was built with it (it was
    ~100 bytecodes per event here); this function is what it must agree with."""
    events: list[SSEEvent] = []
    n = len(data)
    pos = 0
    while data.startswith(b"data:", pos):
        nl = data.find(b"\n", pos)
        end = nl + 2
        if (
            nl < 0
            or end > n
            or data[nl + 1] != _LF
            or data.find(b"\r", pos, nl) >= 0
            or end - pos > max_event_size
        ):
            break
        v = pos + 6 if data[pos + 5] == _SPACE else pos + 5
        # data[0:n] is data itself, not a copy, for the usual one-event read.
        raw = data[pos:end]
        events.append(_new_tuple(SSEEvent, (_decode(data[v:nl]), raw, None, None, None, None)))
        pos = end
    return events, pos


_data_events: Callable[[bytes, int], tuple[list[SSEEvent], int]] = data_events
try:
    from sidecar.protocol import _tokenscan

    _tokenscan.configure_events(SSEEvent)
    _data_events = _tokenscan.data_events
except ImportError:  # built without a C compiler
    pass


class SSEParser:
    """Feed bytes as they arrive; get back every event they complete.

    ``max_event_size`` bounds the bytes buffered for one block (its leading blank lines
    included); a block larger than that raises `SSEError` instead of growing without bound.
    """

    __slots__ = (
        "_buf",
        "_line",
        "_scan",
        "_content",
        "_crmode",
        "_at_start",
        "_closed",
        "_failed",
        "max_event_size",
        "last_event_id",
    )

    def __init__(self, max_event_size: int = DEFAULT_MAX_EVENT_SIZE) -> None:
        if max_event_size < 1:
            raise ValueError(f"max_event_size must be positive, got {max_event_size}")
        self.max_event_size = max_event_size
        # Unconsumed bytes; always begins at a block boundary. Empty on the common path, where
        # each read holds whole events and is parsed in place without copying.
        self._buf = bytearray()
        # Scan state of the unfinished block, as offsets into _buf, so that a block arriving in
        # many small reads is scanned once rather than once per read:
        self._line = 0  # start of the first line not yet known to be complete
        self._scan = 0  # bytes in [_line, _scan) hold no line break (bar a CR held at _scan - 1)
        self._content = -1  # start of the block's first non-blank line; -1 if none yet
        self._crmode = False  # the block holds a CR: walk it line by line
        self._at_start = True  # a leading BOM may still be arriving
        self._closed = False
        self._failed = False
        # The spec's "last event ID string": the id in force after the last complete block,
        # persisting across events (unlike SSEEvent.id, which is only this block's field).
        self.last_event_id: str | None = None

    @property
    def between_events(self) -> bool:
        """Nothing pending, past the stream's start, still open: a read that is exactly one
        whole event could be taken by the caller without this parser, and its state would be
        what parsing that event would have left (an event without an ``id`` field)."""
        return not self._buf and not self._at_start and not self._closed and not self._failed

    @property
    def fresh(self) -> bool:
        """Nothing fed yet (or only nothing): the stream's start, where a BOM may come."""
        return self._at_start and not self._buf and not self._closed and not self._failed

    def started_elsewhere(self) -> None:
        """The stream's first events were read by another reader (the proxy's C lane: whole
        `data:` events, which begin with no BOM): from here on, as if it had read them."""
        self._at_start = False

    @property
    def pending_bytes(self) -> int:
        """Bytes received but not part of any returned event."""
        return len(self._buf)

    @property
    def pending(self) -> bytes:
        """The bytes received but not part of any returned event (a copy)."""
        return bytes(self._buf)

    @property
    def truncated(self) -> bool:
        """True if an event has begun but is not complete: after `close()`, the stream was cut
        mid-event. Leftover blank lines alone do not count."""
        return self._content >= 0

    def feed(self, data: bytes | bytearray | memoryview) -> list[SSEEvent]:
        """Parse ``data``, the next bytes of the stream; return the events it completes."""
        if self._closed:
            raise RuntimeError("SSEParser.feed() called after close()")
        if self._failed:
            raise SSEError("SSEParser already failed; it accepts no more input")
        if not data:
            return []
        if type(data) is not bytes:
            data = bytes(data)
        if self._buf:
            self._buf += data
            return self._parse(self._buf, False, 0, [])
        if self._at_start:
            if data[0] == BOM[0]:
                return self._parse(data, False, 0, [])  # maybe a BOM, maybe split
            self._at_start = False
        # Nothing pending: take what vLLM sends, whole `data: <json>\n\n` events, here without
        # the general machinery. At the first thing that is not one (a comment, a CR, an event
        # cut by the read), hand over to _parse from there.
        events, stop = _data_events(data, self.max_event_size)
        if stop == len(data):
            return events
        return self._parse(data, False, stop, events)

    def close(self) -> list[SSEEvent]:
        """Signal the end of the stream. Returns an event only if its final blank line was a CR
        held back by `feed` (see the module doc); an unterminated event is discarded, as the spec
        says, and stays visible through `pending`/`pending_bytes`/`truncated`."""
        if self._closed:
            return []
        self._closed = True
        if self._failed or not self._buf:
            return []
        return self._parse(self._buf, True, 0, [])

    def _parse(
        self, buf: bytes | bytearray, final: bool, begin: int, events: list[SSEEvent]
    ) -> list[SSEEvent]:
        """Parse ``buf`` from offset ``begin`` (a block boundary), appending to ``events``."""
        n = len(buf)
        borrowed = buf is not self._buf  # the caller's bytes, parsed without copying
        start = begin  # where the current block's raw bytes begin
        line = self._line + begin
        scan = self._scan + begin
        content = self._content + begin if self._content >= 0 else -1
        crmode = self._crmode

        if self._at_start:
            if not final and n < 3 and BOM.startswith(buf):
                return self._keep(buf, borrowed, 0, events, line, scan, content, crmode)
            self._at_start = False
            if buf.startswith(BOM):
                line = scan = 3

        while True:
            if content < 0:
                # Blank lines before the first field dispatch nothing (empty data buffer).
                while line < n:
                    c = buf[line]
                    if c == _LF:
                        line += 1
                    elif c == _CR:
                        if line + 1 < n:
                            line += 2 if buf[line + 1] == _LF else 1
                        elif final:
                            line += 1
                        else:
                            break
                    else:
                        content = line
                        break
                if content < 0:
                    break
                scan = line

            if not crmode:
                # LF-only fast path: hop from line break to line break with memchr-backed
                # finds until a line starts with LF (the blank line). Bytes in [line, scan)
                # were searched by earlier calls and hold no line break.
                lo = scan if scan > line else line
                ls = line  # start of the line being looked at
                first_nl = -1
                found = False
                while True:
                    if ls < n and buf[ls] == _LF:
                        found = True
                        break
                    nl = buf.find(b"\n", ls if ls > lo else lo)
                    if nl < 0:
                        break
                    if first_nl < 0:
                        first_nl = nl
                    ls = nl + 1
                # A CR would change the line structure: then walk the block the slow way.
                if buf.find(b"\r", lo, ls if found else n) < 0:
                    if not found:
                        line = ls
                        scan = n
                        break
                    end = ls + 1
                    if end - start > self.max_event_size:
                        self._fail(buf, borrowed, start, events, end - start)
                    raw = buf[start:end]
                    if type(raw) is not bytes:
                        raw = bytes(raw)
                    p = ls - 1  # the LF that ends the block's last field line
                    if line == content and first_nl == p and buf.startswith(b"data:", content):
                        # A single data line: what vLLM sends for every chunk.
                        v = content + 5
                        if buf[v] == _SPACE:
                            v += 1
                        events.append(
                            _new_tuple(SSEEvent, (_decode(buf[v:p]), raw, None, None, None, None))
                        )
                    else:
                        events.append(self._block_event(raw, buf[content:p]))
                    start = line = scan = end
                    content = -1
                    continue
                crmode = True

            # A CR somewhere in this block: walk it line by line with exact line starts.
            pos = scan - 1 if scan - 1 > line else line
            end = -1
            while True:
                lf = buf.find(b"\n", pos)
                cr = buf.find(b"\r", pos, lf if lf >= 0 else n)
                if cr >= 0:
                    eol = cr
                    if cr + 1 < n:
                        nxt = cr + 2 if buf[cr + 1] == _LF else cr + 1
                    elif final:
                        nxt = cr + 1
                    else:
                        break
                elif lf >= 0:
                    eol = lf
                    nxt = lf + 1
                else:
                    break
                if eol == line:
                    end = nxt
                    break
                line = pos = nxt
            if end < 0:
                scan = n
                break
            if end - start > self.max_event_size:
                self._fail(buf, borrowed, start, events, end - start)
            raw = bytes(buf[start:end])
            events.append(self._block_event(raw, buf[content:line]))
            start = line = scan = end
            content = -1
            crmode = False

        if start == n and borrowed:
            return events  # all consumed; the scan state is still the fresh one it began with
        if n - start > self.max_event_size:
            self._fail(buf, borrowed, start, events, n - start)
        return self._keep(buf, borrowed, start, events, line, scan, content, crmode)

    def _keep(
        self,
        buf: bytes | bytearray,
        borrowed: bool,
        start: int,
        events: list[SSEEvent],
        line: int,
        scan: int,
        content: int,
        crmode: bool,
    ) -> list[SSEEvent]:
        """Keep the bytes from ``start`` on as the unfinished block, with its scan state."""
        if borrowed:
            if start < len(buf):
                self._buf += memoryview(buf)[start:]
        elif start:
            del self._buf[:start]
        self._line = line - start
        self._scan = scan - start
        self._content = content - start if content >= 0 else -1
        self._crmode = crmode
        return events

    def _fail(
        self,
        buf: bytes | bytearray,
        borrowed: bool,
        start: int,
        events: list[SSEEvent],
        size: int,
    ) -> NoReturn:
        self._keep(buf, borrowed, start, events, start, start, start, False)
        self._failed = True
        raise SSEError(
            f"SSE event of at least {size} bytes exceeds max_event_size={self.max_event_size}",
            events,
        )

    def _block_event(self, raw: bytes, fields: bytes | bytearray) -> SSEEvent:
        """Build the event of one block from its field lines (``fields``: every line of the
        block up to, not including, the blank line; any line-break style)."""
        data_lines: list[bytes | bytearray] | None = None
        comments: list[bytes | bytearray] | None = None
        event: str | None = None
        event_id: str | None = None
        retry: int | None = None
        # bytes.splitlines breaks on exactly \r\n, \r and \n: the spec's three line endings.
        for ln in fields.splitlines():
            colon = ln.find(b":")
            if colon == 0:
                if comments is None:
                    comments = []
                comments.append(ln[2:] if ln[1:2] == b" " else ln[1:])
                continue
            value: bytes | bytearray
            if colon < 0:
                name = ln
                value = b""
            else:
                name = ln[:colon]
                value = ln[colon + 2 :] if ln[colon + 1 : colon + 2] == b" " else ln[colon + 1 :]
            if name == b"data":
                if data_lines is None:
                    data_lines = []
                data_lines.append(value)
            elif name == b"event":
                event = _decode(value)
            elif name == b"id":
                # The spec ignores an id holding NUL.
                if b"\x00" not in value:
                    event_id = _decode(value)
                    self.last_event_id = event_id
            elif name == b"retry":
                if value.isdigit():
                    retry = int(value)
            # Any other field name is ignored, as the spec says.
        if data_lines is not None:
            return SSEEvent(_decode(b"\n".join(data_lines)), raw, event, None, event_id, retry)
        comment = _decode(b"\n".join(comments)) if comments is not None else None
        return SSEEvent(None, raw, event, comment, event_id, retry)
