"""The measuring core, sans-IO: one streamed response in, what to forward and what it counted out.

Every path that measures a stream uses this one class: the proxy's streaming relay, its assembled
non-streaming path and the replay sender. It owns no socket and reads no clock: the caller feeds
each read's bytes with the instant they arrived (``time.perf_counter_ns()``, see clock.py) and
writes what `StreamMeter.feed` returns. What it does per read:

- SSE framing (`SSEParser`), every event classified once (`classify_chunk`) and its output
  tokens counted (`TokenCounter`: exact from continuous usage, else one per token event);
- one stamp per token-carrying event, the read's instant (all events of one read arrived
  together), with the event's token count beside it, as offsets from ``origin_ns``;
- usage the proxy asked for on the client's behalf cut back out (`UsagePlan`, rewrite.py): the
  per-chunk ``usage`` member, the usage-only chunk, and the finish chunk held until that usage
  chunk gives back its ``system_fingerprint``;
- the finish rules, in one place: N_in / N_out / N_cached and where they came from, the finish
  reason, the engine's per-request timing, and the failures, mapped to outcomes once
  (`StreamFailure`): an error event, a malformed chunk, an oversized event, a stream cut before
  ``[DONE]`` (mid-event or between events).

Failures come in two strengths. ``failure`` is the first thing that went wrong, for the record
(first cause wins). ``fatal`` is set when the stream cannot go on (an oversized event; with an
assembler, a chunk it cannot use): the caller stops reading, forwards what `feed` returned and
fails the request. A stream that just ends without ``[DONE]`` is found by `close`.
"""

from __future__ import annotations

import json
from array import array
from typing import Any, Final, NamedTuple, Protocol

from sidecar.protocol.fastchunk import TokenScan, cut_span, fast_chunk, scan_token_chunk
from sidecar.protocol.openai import (
    KIND_DONE,
    KIND_ERROR,
    KIND_MALFORMED,
    KIND_TOKEN,
    KIND_USAGE,
    ChunkInfo,
    TokenCounter,
    Usage,
    classify_chunk,
    safe_error_type,
)
from sidecar.protocol.rewrite import NO_CHANGE, UsagePlan, insert_member, without_usage
from sidecar.protocol.sse import DEFAULT_MAX_EVENT_SIZE, SSEError, SSEEvent, SSEParser
from sidecar.record import (
    SOURCE_CHUNK_COUNT,
    SOURCE_NONE,
    SOURCE_USAGE,
    SOURCE_USAGE_TOTAL,
    EngineTiming,
    Outcome,
    TokenSource,
)

_ONE: Final = (1,)
_new_tuple = tuple.__new__


class StreamFailure(NamedTuple):
    """Why a request failed, in every form its consumers need: the record's outcome and short
    cause, the HTTP status, a message for the client and the `type` of the vLLM-shaped error."""

    outcome: Outcome
    error_type: str
    status: int
    message: str
    err_type: str = "BadGateway"


def stream_cut(mid_event: bool) -> StreamFailure:
    where = "mid_event" if mid_event else "without_done"
    return StreamFailure(
        Outcome.UPSTREAM_ERROR,
        f"stream_cut_{where}",
        502,
        "The upstream stream ended before [DONE].",
    )


MALFORMED_CHUNK: Final = StreamFailure(
    Outcome.UPSTREAM_ERROR, "malformed_chunk", 502, "The upstream sent a malformed chunk."
)


# Usage whose counts cannot be believed (see ChunkInfo.usage_malformed). The stream goes on and
# the client's bytes are what they would have been (injected usage is still cut out), but no
# count in it is trusted and the record says why.
MALFORMED_USAGE: Final = StreamFailure(
    Outcome.UPSTREAM_ERROR, "malformed_usage", 502, "The upstream sent a malformed usage object."
)


def too_many_events(limit: int) -> StreamFailure:
    return StreamFailure(
        Outcome.UPSTREAM_ERROR,
        "too_many_events",
        502,
        f"The upstream stream exceeded the sidecar's limit of {limit} events.",
    )


# The default of --max-stream-events (config.py says why).
DEFAULT_MAX_STREAM_EVENTS: Final = 1_000_000
# `StreamMeter.lane_start`'s end flags, as the C lane reads them (_tokenscan.c's LANE_END_*;
# tests/test_lane.py holds the two to the same values).
LANE_END_OK: Final = 1
LANE_END_FINGERPRINT_KNOWN: Final = 2
LANE_FIRST: Final = 4  # ... and the stream's first read (no event yet): `first_in_lane`
# How far the C lane took a stream's end that came over several reads (its END_*):
# `take_end_in_lane`.
LANE_END_FINISH: Final = 1
LANE_END_USAGE: Final = 2
LANE_END_DONE: Final = 3


def oversized_event(exc: SSEError) -> StreamFailure:
    return StreamFailure(
        Outcome.UPSTREAM_ERROR,
        "oversized_event",
        502,
        f"The upstream sent an unparseable stream: {exc}",
    )


def error_event_failure(info: ChunkInfo) -> StreamFailure:
    """A mid-stream ``{"error": ...}`` event: the upstream's own error, with its code."""
    error = info.error
    status = error.code if error is not None and type(error.code) is int else 500
    message = error.message if error is not None else ""
    err_type = (error.type if error is not None and error.type else None) or "InternalServerError"
    return StreamFailure(
        Outcome.HTTP_ERROR, safe_error_type(error, status), status, message, err_type
    )


class ChunkConsumer(Protocol):
    """Takes every parsed chunk object of a stream (the non-streaming assembler)."""

    def feed(self, chunk: dict[str, Any]) -> None: ...


class StreamMeter:
    """Measures one streamed response; see the module docstring.

    ``forward``: build the bytes to send on (the proxy's streaming relay); off for consumers
    that only measure (the replay sender, the assembler). ``plan``: what the proxy added to the
    request, to be cut out again. ``keep_text``: collect the visible text (opt-in capture only).
    ``assembler``: fed every chunk object; a chunk it cannot take is then fatal.
    """

    __slots__ = (
        "origin_ns",
        "offsets",
        "_counts",
        "events",
        "_parser",
        "_began_elsewhere",
        "_between",
        "_max_event_bytes",
        "_counter",
        "_forward",
        "_strip",
        "_drop_usage_chunk",
        "_held",
        "_held_cut",
        "_held_tokens",
        "_usage",
        "_lane_usage",
        "saw_done",
        "finish_reason",
        "engine",
        "failure",
        "fatal",
        "rewritten",
        "text_parts",
        "assembler",
        "_closed",
        "_lane",
        "fingerprint",
        "usage_malformed",
        "_max_events",
        "after_done",
        "response_model",
        "response_id",
        "choices",
    )

    def __init__(
        self,
        origin_ns: int,
        plan: UsagePlan = NO_CHANGE,
        *,
        forward: bool = True,
        max_event_bytes: int = DEFAULT_MAX_EVENT_SIZE,
        max_events: int = DEFAULT_MAX_STREAM_EVENTS,
        keep_text: bool = False,
        assembler: ChunkConsumer | None = None,
        fingerprint: str | None = None,
    ) -> None:
        self.origin_ns = origin_ns
        self.offsets = array("q")  # token-carrying events: arrival offsets from origin_ns
        # ... and the output tokens each carried (`token_counts`), from the first event that
        # did not carry exactly one; None while every event carried one (one token per decode
        # step, what vLLM streams unless it decodes speculatively): a stream in flight then
        # holds one column fewer (8 bytes per event), and the common event costs a test
        # instead of an append.
        self._counts: array[int] | None = None
        # ... and the choice each belongs to, from the first event of a choice other than 0
        # (n > 1); None while every event is choice 0, so n = 1 costs one test per event.
        self.choices: array[int] | None = None
        self.events = 0  # every event block read, comments included
        self._max_events = max_events  # more: fatal (the record's arrays grow per event)
        if max_event_bytes < 1:
            raise ValueError(f"max_event_bytes must be positive, got {max_event_bytes}")
        # Made by the first read the Python path parses (`feed`): a stream whose reads the C
        # lane takes, the common one, never makes it (an interpreted object, ~25 attributes).
        self._parser: SSEParser | None = None
        self._began_elsewhere = False  # `first_in_lane` before there was a parser
        self._max_event_bytes = max_event_bytes
        self._between = False  # `_parser.between_events`, as of the parser's last feed
        self._counter = TokenCounter()
        self._forward = forward
        self._strip = plan.strip_chunk_usage
        self._drop_usage_chunk = plan.drop_usage_chunk
        self._held: bytes | None = None  # a finish chunk waiting for the fingerprint
        self._held_cut: int | None = None
        self._held_tokens = 0
        self._usage: Usage | None = None  # the last usage seen (cumulative, then final)
        # ... or, when the lane saw it last, that event's scan (`usage` makes the Usage from
        # it when asked): a stream's every token event carries usage (the proxy asks for it),
        # and only the last is ever read.
        self._lane_usage: TokenScan | None = None
        self.saw_done = False
        self.finish_reason: str | None = None
        self.engine: EngineTiming | None = None
        self.failure: StreamFailure | None = None  # first failure, for the record
        self.fatal: StreamFailure | None = None  # the stream cannot go on
        self.rewritten = 0  # events re-encoded because they could not be edited as text
        self.text_parts: list[str] | None = [] if keep_text else None
        self.assembler = assembler
        self._closed = False
        # The one-token-event read may skip the general loop (see `feed`) when nothing but
        # forwarding and counting is asked of it.
        self._lane = forward and assembler is None and not keep_text
        # The upstream's system_fingerprint: given (what this replica sent last time), then
        # the one this stream carries. It goes back on a held finish chunk that must leave
        # before the usage chunk (n > 1: another choice's event follows it).
        self.fingerprint = fingerprint
        self.usage_malformed = 0  # events whose usage member could not be believed
        self.after_done = 0  # events after [DONE]: dropped, not counted
        # The answer's `model` and `id` (OpenTelemetry's gen_ai.response.*), from the first
        # chunk that has them. Read off the general path only: every stream has chunks there
        # (a chat role chunk, a finish chunk, the usage chunk), so the lane stays as it is.
        self.response_model: str | None = None
        self.response_id: str | None = None

    # -- per read: the hot path -----------------------------------------------------------

    def feed(self, data: bytes, now_ns: int) -> tuple[bytes, int, int]:
        """One upstream read that arrived at ``now_ns``. Returns the bytes to forward now (one
        write), how many events they hold, and how many of those carry tokens (each is stamped
        with that write's instant on the client side)."""
        # The read that makes up almost every read of a stream: exactly one vLLM token event
        # (`scan_token_chunk`'s shape, which holds no control byte but its last two, `\n\n`:
        # the scan itself says the read is one whole event), with the parser between events
        # and no finish chunk held. It is taken here, with what the general loop below would
        # do to it and nothing else: no event object, no payload decoded to text.
        if (
            self._lane
            and self._held is None
            and self.fatal is None
            and self._between
            and len(data) <= self._max_event_bytes
            and self.events < self._max_events
        ):
            scan = scan_token_chunk(data)
            if scan is not None:
                # What `fast_chunk` and `_consume` would do with it, without the ChunkInfo
                # and the names the lane does not use (`response_model` is read off the
                # general path): the lane's cost is mostly this block.
                choice, prompt, total, cumulative, start, end, _, _, _ = scan
                self.events += 1
                self.offsets.append(now_ns - self.origin_ns)
                if prompt is None:
                    n_tokens = self._counter.token_event(choice, None)
                else:
                    self._lane_usage = scan
                    n_tokens = self._counter.token_event(choice, cumulative)
                if n_tokens != 1 or self._counts is not None:
                    self._note_count(n_tokens)
                if choice or self.choices is not None:
                    self._note_choice(choice)
                if prompt is not None and self._strip:
                    return cut_span(data, start, end), 1, 1
                return data, 1, 1
        parser = self._parser
        if parser is None:
            if self._closed:  # as a parser closed with the meter would say
                raise RuntimeError("StreamMeter.feed() called after close()")
            parser = self._parser = SSEParser(max_event_size=self._max_event_bytes)
            if self._began_elsewhere:
                parser.started_elsewhere()
        try:
            events = parser.feed(data)
        except SSEError as exc:
            # Measure and relay the events completed before the oversized one, then stop.
            events = exc.events
            self.fatal = oversized_event(exc)
        # The parser's state changes only when it is fed or closed: kept here, the lane tests
        # an attribute instead of calling the parser's property on every read.
        self._between = parser.between_events
        return self._consume(events, now_ns)

    def lane_settings(self) -> tuple[int, bool, bool] | None:
        """(the largest event, whether usage is cut out, whether the usage chunk is dropped)
        for a C lane, when this meter may ever have one: forwarding only, no text kept, no
        assembler (see `lane_start`)."""
        if not self._lane:
            return None
        return self._max_event_bytes, self._strip, self._drop_usage_chunk

    def lane_start(self) -> tuple[int, int, int] | None:
        """(events the stream may still take, choice 0's cumulative count, flags) when the C
        lane (`_tokenscan.Lane`, armed by stream_relay.MeteredRead) may take reads for this
        meter: in the state where `feed`'s own one-event lane would take them, with every event
        so far of choice 0, nothing carried and a token seen; or before any event (LANE_FIRST:
        the lane may take the first read, `first_in_lane`); else None. The end flags
        (LANE_END_*) say whether the lane may take the stream's end too (`end_in_lane`): once
        the answer's model is known (the finish chunk would not give it), and whether a
        fingerprint is known already (a dropped usage chunk without one then leaves the finish
        chunk to get this one back, on the Python path)."""
        if not self._lane or self._held is not None or self.fatal is not None or self._closed:
            return None
        known = LANE_END_FINGERPRINT_KNOWN if self.fingerprint is not None else 0
        if self.offsets:
            if self._between and self.choices is None:
                last = self._counter.lane_state()
                if last is not None and self.events < self._max_events:
                    flags = 0 if self.response_model is None else LANE_END_OK | known
                    return self._max_events - self.events, last, flags
        elif self.events == 0 and self._max_events and self._fresh():
            return self._max_events, 0, LANE_FIRST | known
        return None

    def _fresh(self) -> bool:
        """Nothing parsed yet: the stream's start (`SSEParser.fresh`)."""
        parser = self._parser
        return not self._began_elsewhere if parser is None else parser.fresh

    def first_in_lane(self, model: str | None, response_id: str | None, other_events: int) -> None:
        """The C lane took the stream's first read (`_tokenscan.c`, "The first read"): what
        `_consume` reads off it besides the counts `take_lane` brings: the answer's model and
        id (from its first chunk, kept as `_bounded_name` keeps them; None: handed with an
        earlier read), and the events that carried no token (chat's role chunk)."""
        self.events += other_events
        if model is not None:
            self.response_model = model
            self.response_id = response_id
            if self._parser is None:
                self._began_elsewhere = True
            else:
                self._parser.started_elsewhere()
            self._between = True  # as a feed of those whole events would have left the parser

    def end_in_lane(self, finish_reason: str, fingerprint: str | None) -> None:
        """The C lane took the stream's end (`_tokenscan.c`, "The end of a stream"): choice 0's
        finish chunk (a token event, handed over with the lane's counts by `take_lane`), the
        usage-only chunk (its usage too) and ``[DONE]``. What `_consume` and `close` leave
        after those three events, but what `take_lane` brings: the finish reason, the usage
        chunk's fingerprint when it had one, two events more, ``[DONE]`` seen, closed."""
        self.events += 2
        self.finish_reason = finish_reason
        if fingerprint is not None:
            self.fingerprint = fingerprint
        self.saw_done = True
        self._lane = False
        self._closed = True
        self._between = False

    def take_end_in_lane(
        self,
        stage: int,
        finish_reason: str,
        fingerprint: str | None,
        held: bytes | None,
        held_cut: int,
        held_token: int = 1,
    ) -> int:
        """The C lane took a part of the stream's end, read by read, and the Python path takes
        the rest (`_tokenscan.c`, "An end over several reads"; after `take_lane`, which brought
        the finish chunk's event, a token event or, its text empty, one without a token, and
        the usage chunk's usage): what `_consume` leaves
        after the finish chunk (``stage`` LANE_END_FINISH), the usage chunk (LANE_END_USAGE)
        and ``[DONE]`` (LANE_END_DONE), with ``held`` the finish chunk it holds for the usage
        chunk's fingerprint (its usage member cut at ``held_cut``: `_release_held` puts the
        fingerprint there), a token event (``held_token``: `take_lane` brought it) or, its
        text empty, an event without a token (counted here). Returns how many of those events
        without a token were forwarded to the client (the usage chunk when not dropped,
        ``[DONE]``)."""
        self.finish_reason = finish_reason
        if held is not None:
            self._held, self._held_cut, self._held_tokens = held, held_cut, held_token
            if not held_token:
                self.events += 1
        forwarded = 0
        if stage >= LANE_END_USAGE:
            self.events += 1
            if fingerprint is not None:
                self.fingerprint = fingerprint
            forwarded += not self._drop_usage_chunk
        if stage >= LANE_END_DONE:
            self.events += 1
            self.saw_done = True
            self._lane = False
            forwarded += 1
        return forwarded

    def take_lane(
        self,
        up_offsets: bytes,
        tokens: bytes | None,
        gained: int,
        last_cumulative: int,
        exact: bool,
        usage: tuple[int, int, int] | None,
        other_events: int = 0,
        carry: int = 0,
    ) -> int:
        """What the C lane counted since it was armed (`Lane.take`): its token events' offsets
        and output tokens (native int64; None: one each), their sum, choice 0's cumulative
        count after them, whether each carried usage, the last usage, (prompt, total,
        completion), its events without a token (empty texts) and the tokens they carry to
        the next token event. Leaves the meter as `feed` would have. Returns the number of
        token events."""
        n_events = len(up_offsets) // 8
        if tokens is not None or self._counts is not None:
            if self._counts is None:  # the column starts, with 1 for the events before
                self._counts = array("q", _ONE) * len(self.offsets)
            if tokens is None:
                self._counts.extend(array("q", _ONE) * n_events)
            else:
                self._counts.frombytes(tokens)
        self.offsets.frombytes(up_offsets)
        self.events += n_events + other_events
        self._counter.take_lane(gained, last_cumulative, exact, carry)
        if usage is not None:
            prompt, total, completion = usage
            self._usage = _new_tuple(Usage, (prompt, completion, total, None))
            self._lane_usage = None
        return n_events

    def _consume(self, events: list[SSEEvent], now_ns: int) -> tuple[bytes, int, int]:
        """What `feed` does with the events one read completed (see `feed`)."""
        forward = self._forward
        out: list[bytes] = []
        out_tokens = 0
        offset = now_ns - self.origin_ns
        counter = self._counter
        for event in events:
            if self.saw_done:
                # vLLM writes nothing after [DONE], and a client stops reading there: what a
                # broken upstream sends after it is neither counted nor relayed.
                self.after_done += 1
                continue
            if self.events >= self._max_events:
                self.fatal = too_many_events(self._max_events)
                break
            self.events += 1
            payload = event.data
            if payload is None:  # a comment (keep-alive): forwarded as is, in order
                if forward:
                    if self._held is not None:
                        out.append(self._release_held(self.fingerprint))
                        out_tokens += self._held_tokens
                    out.append(event.raw)
                continue
            fast = fast_chunk(event.raw)
            if fast is None:
                info = classify_chunk(payload)
                usage_at = -1
            else:
                info, usage_at, usage_end = fast
            kind = info.kind
            n_tokens = counter.observe(info)
            if kind is KIND_TOKEN:
                self.offsets.append(offset)
                if n_tokens != 1 or self._counts is not None:
                    self._note_count(n_tokens)
                index = info.choice_index
                if index or self.choices is not None:
                    self._note_choice(index)
                if self.text_parts is not None:
                    self.text_parts.append(chunk_text(payload))
            elif kind is KIND_DONE:
                self.saw_done = True
                self._lane = False  # every later read must meet the check below
            elif kind is KIND_USAGE:
                self.engine = engine_timing(info) or self.engine
            elif kind is KIND_ERROR:
                if self.failure is None:
                    self.failure = error_event_failure(info)
            elif kind is KIND_MALFORMED:
                if self.failure is None:
                    self.failure = MALFORMED_CHUNK
                if self.assembler is not None:
                    self.fatal = MALFORMED_CHUNK
                    break
            if info.usage_malformed:
                self.usage_malformed += 1
                if self.failure is None:
                    self.failure = MALFORMED_USAGE
                if self.assembler is not None:
                    self.fatal = MALFORMED_USAGE
                    break
            if info.finish_reason is not None:
                self.finish_reason = info.finish_reason
            if self.response_model is None and info.model is not None:
                self.response_model = _bounded_name(info.model)
                self.response_id = None if info.id is None else _bounded_name(info.id)
            if info.usage is not None:
                self._usage, self._lane_usage = info.usage, None
            if info.system_fingerprint is not None:
                self.fingerprint = info.system_fingerprint
            if self.assembler is not None and kind is not KIND_DONE:
                chunk = json.loads(payload)
                if type(chunk) is dict:
                    self.assembler.feed(chunk)
            if not forward:
                continue
            raw = event.raw
            cut: int | None = None
            if (
                (info.usage is not None or info.usage_malformed)
                and self._strip
                and kind is not KIND_USAGE
            ):
                if usage_at >= 0:  # the fast path found the member: cut it as text
                    raw, cut = cut_span(raw, usage_at, usage_end), usage_at
                else:
                    raw, cut, reencoded = without_usage(raw, payload)
                    self.rewritten += reencoded
            if self._held is not None:
                # The usage chunk gives the fingerprint back; any other event comes first
                # (another choice's, n > 1) and the finish chunk leaves with the one known.
                out.append(self._release_held(self.fingerprint))
                out_tokens += self._held_tokens
            if self._drop_usage_chunk:
                if kind is KIND_USAGE:
                    continue  # the client did not ask for usage: it never sees this chunk
                if info.finish_reason is not None:
                    # Without include_usage vLLM puts system_fingerprint on every finish chunk;
                    # with it, on the usage chunk only. Hold the finish chunk until the usage
                    # chunk (sent right after it for n = 1) gives the fingerprint back.
                    self._held, self._held_cut = raw, cut
                    self._held_tokens = 1 if kind is KIND_TOKEN else 0
                    continue
            out.append(raw)
            out_tokens += kind is KIND_TOKEN
        if self.fatal is not None:
            self.failure = self.failure or self.fatal
            if self._held is not None:
                out.append(self._release_held(self.fingerprint))
                out_tokens += self._held_tokens
        if not out:
            return b"", 0, 0
        return (out[0] if len(out) == 1 else b"".join(out)), len(out), out_tokens

    # -- end of the upstream stream -------------------------------------------------------

    def close(self, now_ns: int | None = None) -> tuple[bytes, int, int]:
        """The upstream's stream ended (at ``now_ns``; default: the origin, for callers that
        do not stamp). Returns what is still to forward as `feed` does: the last event, when
        its final blank line was a lone CR the parser had to wait on (``data: [DONE]\r\r``),
        and a held finish chunk. A stream that ended without ``[DONE]`` sets `fatal` (and
        `failure`, unless something failed before)."""
        if self._closed:
            return b"", 0, 0
        self._closed = True
        out, n_events, n_tokens = b"", 0, 0
        parser = self._parser
        last = parser.close() if parser is not None else []
        self._between = False
        if last and self.fatal is None:
            out, n_events, n_tokens = self._consume(
                last, self.origin_ns if now_ns is None else now_ns
            )
        if not self.saw_done and self.fatal is None:
            self.fatal = stream_cut(parser is not None and parser.truncated)
            self.failure = self.failure or self.fatal
        if self._held is not None:
            out += self._release_held(self.fingerprint)
            n_events += 1
            n_tokens += self._held_tokens
        return out, n_events, n_tokens

    def token_counts(self) -> array[int]:
        """The output tokens of each token-carrying event, in `offsets`' order (a new array
        of ones when every event carried one)."""
        if self._counts is None:
            return array("q", _ONE) * len(self.offsets)
        return self._counts

    def mark(self, offset_ns: int, n_tokens: int) -> None:
        """One token event at ``offset_ns`` from the origin carrying ``n_tokens`` (what `feed`
        records per token event, inlined there; for callers that build a timeline by hand)."""
        self.offsets.append(offset_ns)
        if n_tokens != 1 or self._counts is not None:
            self._note_count(n_tokens)

    def _note_count(self, n_tokens: int) -> None:
        """The count of the token event just appended, once one was not 1 (the column starts
        then, with 1 for the events before it)."""
        if self._counts is None:
            self._counts = array("q", _ONE) * (len(self.offsets) - 1)
        self._counts.append(n_tokens)

    def _note_choice(self, index: int | None) -> None:
        """The choice of the token event just appended (the first one other than 0 starts
        the column, with 0 for the events before it)."""
        if self.choices is None:
            self.choices = array("q", bytes(8 * (len(self.offsets) - 1)))
        self.choices.append(index or 0)

    def _release_held(self, fingerprint: str | None) -> bytes:
        held, self._held = self._held, None
        assert held is not None
        if fingerprint is None:
            return held
        return insert_member(held, self._held_cut, "system_fingerprint", fingerprint)

    # -- the finish rules -----------------------------------------------------------------

    @property
    def usage(self) -> Usage | None:
        """The last usage the stream carried (cumulative, then the final one), if any."""
        scan = self._lane_usage
        if scan is not None:
            _, prompt, total, completion, _, _, _, _, _ = scan
            self._usage = _new_tuple(Usage, (prompt, completion, total, None))
            self._lane_usage = None
        return self._usage

    @usage.setter
    def usage(self, usage: Usage | None) -> None:
        self._usage, self._lane_usage = usage, None

    @property
    def token_totals(self) -> tuple[int | None, int | None, int | None, TokenSource]:
        """(N_in, N_out, N_cached, where they came from). The last usage is authoritative
        (the final usage chunk, else the last cumulative count, which is all a cut or
        cancelled stream has); without usage, or when any usage could not be believed, one
        token per token event, an estimate."""
        usage = self.usage
        counter = self._counter
        if usage is not None and not self.usage_malformed:
            source = SOURCE_USAGE if counter.exact else SOURCE_USAGE_TOTAL
            return usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens, source
        if counter.total:
            return None, counter.total, None, SOURCE_CHUNK_COUNT
        return None, None, None, SOURCE_NONE

    @property
    def text(self) -> str | None:
        return None if self.text_parts is None else "".join(self.text_parts)


def _bounded_name(value: str) -> str | None:
    """An upstream's name as records may carry it: short and printable, else not at all."""
    return value if len(value) <= 256 and value.isprintable() else None


def engine_timing(info: ChunkInfo) -> EngineTiming | None:
    """vLLM's per-request metrics (sent beside usage) as the record's engine timing."""
    metrics = info.metrics
    if metrics is None:
        return None
    return EngineTiming(
        time_to_first_token_ms=metrics.time_to_first_token_ms,
        generation_time_ms=metrics.generation_time_ms,
        queue_time_ms=metrics.queue_time_ms,
        mean_itl_ms=metrics.mean_itl_ms,
        tokens_per_second=metrics.tokens_per_second,
    )


def choices_text(choices: list[Any]) -> str:
    """The visible text of OpenAI choices (chat deltas or messages, or completion text)."""
    parts: list[str] = []
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        holder = choice.get("delta") or choice.get("message")
        if isinstance(holder, dict):
            for key in ("reasoning", "reasoning_content", "content"):
                if isinstance(holder.get(key), str):
                    parts.append(holder[key])
        elif isinstance(choice.get("text"), str):
            parts.append(choice["text"])
    return "".join(parts)


def chunk_text(payload: str) -> str:
    """The text of one streamed chunk (opt-in text capture only: parses the JSON again)."""
    try:
        obj = json.loads(payload)
    except (ValueError, RecursionError):
        return ""
    choices = obj.get("choices") if isinstance(obj, dict) else None
    return choices_text(choices) if isinstance(choices, list) else ""
