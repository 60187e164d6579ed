"""The only mutable timing state: built while a request is in flight, frozen once at the end.

Per-event stamps go into ``array('q')`` buffers (8 bytes per stamp, no object per event), so a
long stream costs little memory while in flight and appending is cheap on the per-chunk path.
``freeze()`` turns them into the immutable `RequestRecord`.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from dataclasses import replace
from typing import Final

from sidecar.meter import StreamMeter
from sidecar.record import (
    OUTCOME_OK,
    SOURCE_NONE,
    EngineTiming,
    Int64s,
    Outcome,
    RequestRecord,
    RequestShape,
    Timeline,
    new_record,
    new_timeline,
)

# What `freeze` calls for every record, as C statics: an imported name read in compiled code is
# a lookup in this module's dict each time (seven per record).
_PACK: Final = Int64s
_NEW_TIMELINE: Final = new_timeline
_NEW_RECORD: Final = new_record
_OK: Final = OUTCOME_OK


class RecordBuilder:
    __slots__ = (
        "request_id",
        "wall_time_ns",
        "arrive_ns",
        "endpoint",
        "model",
        "client_stream",
        "upstream_stream",
        "up_send_ns",
        "up_headers_ns",
        "up_end_ns",
        "down_end_ns",
        "_up_offsets",
        "_down_offsets",
        "_tokens",
        "up_events",
        "down_events",
        "n_in",
        "n_out",
        "n_cached",
        "token_source",
        "finish_reason",
        "http_status",
        "error_type",
        "outcome",
        "replica",
        "route_policy",
        "engine",
        "attributes",
        "frozen",
        "shape",
        "text_parts",
        "request_read_ns",
        "_choices",
    )

    def __init__(self, request_id: str, wall_time_ns: int, arrive_ns: int, endpoint: str) -> None:
        self.request_id = request_id
        self.wall_time_ns = wall_time_ns
        self.arrive_ns = arrive_ns  # monotonic ns of t_arrive: every offset is relative to it
        self.endpoint = endpoint
        self.model: str | None = None
        self.client_stream = False
        self.upstream_stream = False
        self.up_send_ns: int | None = None
        self.request_read_ns: int | None = None  # t_read, offset from arrive_ns
        self.up_headers_ns: int | None = None
        self.up_end_ns: int | None = None
        self.down_end_ns: int | None = None
        # The server-side columns are the meter's (`take_stream`); until then none (a request
        # that streamed nothing keeps these), and no empty arrays held for a stream's life.
        self._up_offsets: array[int] | bytes = b""
        self._down_offsets = array("q")
        self._tokens: array[int] | bytes = b""
        self._choices: array[int] | None = None  # per token event, with n > 1 (the meter's)
        self.up_events = 0
        self.down_events = 0
        self.n_in: int | None = None
        self.n_out: int | None = None
        self.n_cached: int | None = None
        self.token_source = SOURCE_NONE
        self.finish_reason: str | None = None
        self.http_status: int | None = None
        self.error_type: str | None = None
        self.outcome: Outcome | None = None
        self.replica: str | None = None
        self.route_policy: str | None = None
        self.engine: EngineTiming | None = None
        self.attributes: dict[str, str] = {}
        self.frozen = False
        self.shape: RequestShape | None = None
        self.text_parts: list[str] | None = None  # only when the operator opted in to text

    # -- per write: keep it tiny (server-side stamps come from the meter, `take_stream`) --

    def client_token_writes(self, now_ns: int, count: int) -> None:
        """``count`` token events that left in one write: all of them at its instant."""
        offset = now_ns - self.arrive_ns
        if count == 1:
            self._down_offsets.append(offset)
        else:
            self._down_offsets.extend([offset] * count)

    def client_token_offsets(self, offsets: bytes) -> None:
        """Token events that left one per event, at these offsets (native int64; the C lane's
        client-side stamps, `Lane.take`)."""
        self._down_offsets.frombytes(offsets)
        self.down_events += len(offsets) // 8

    def take_stream(self, meter: StreamMeter) -> None:
        """What the measuring core counted on the upstream stream: the server-side stamps and
        token column, the token totals, finish reason, engine timing and the first failure.
        Called once when the stream ends, however it ends (a cancelled stream keeps the usage
        that had arrived)."""
        self._up_offsets = meter.offsets
        self._tokens = meter.token_counts()
        self._choices = meter.choices
        self.up_events = meter.events
        n_in, n_out, n_cached, source = meter.token_totals
        if source is not SOURCE_NONE:
            self.n_in, self.n_out, self.n_cached, self.token_source = (
                n_in,
                n_out,
                n_cached,
                source,
            )
        if meter.finish_reason is not None:
            self.finish_reason = meter.finish_reason
        if meter.response_model is not None:
            self.attributes["response_model"] = meter.response_model
        if meter.response_id is not None:
            self.attributes["response_id"] = meter.response_id
        if meter.engine is not None:
            self.engine = meter.engine
        if meter.failure is not None:
            failure = meter.failure
            self.fail(failure.outcome, failure.error_type, failure.status)
        if self.text_parts is not None and meter.text_parts is not None:
            self.text_parts.extend(meter.text_parts)

    # -- outcome ---------------------------------------------------------------------------

    def fail(self, outcome: Outcome, error_type: str, http_status: int | None = None) -> None:
        """Record the first failure; later ones (e.g. a write error after a timeout) don't
        overwrite the cause."""
        if self.outcome is None or self.outcome is OUTCOME_OK:
            self.outcome = outcome
            self.error_type = error_type
            if http_status is not None:
                self.http_status = http_status

    def offset(self, now_ns: int) -> int:
        return now_ns - self.arrive_ns

    def freeze(self, extra_attributes: Mapping[str, str] | None = None) -> RequestRecord:
        self.frozen = True
        tokens = _PACK(self._tokens)
        choices = None if self._choices is None else _PACK(self._choices)
        server: Timeline | None = None
        if self.up_send_ns is not None:
            server = _NEW_TIMELINE(
                start_ns=self.up_send_ns,
                offsets_ns=_PACK(self._up_offsets),
                tokens=tokens,
                end_ns=self.up_end_ns,
                events_total=self.up_events,
                choices=choices,
            )
        written = len(self._down_offsets)
        client = _NEW_TIMELINE(
            start_ns=0,
            offsets_ns=_PACK(self._down_offsets),
            # The same events on both sides share one column; the client saw fewer when it left
            # mid-stream.
            tokens=tokens if written == len(tokens) else tokens[:written],
            end_ns=self.down_end_ns,
            events_total=self.down_events,
            choices=(
                None
                if choices is None or not written
                else choices
                if written == len(choices)
                else choices[:written]
            ),
        )
        attributes = self.attributes
        if extra_attributes:
            attributes = {**attributes, **extra_attributes}
        return _NEW_RECORD(
            request_id=self.request_id,
            wall_time_ns=self.wall_time_ns,
            outcome=self.outcome or _OK,
            endpoint=self.endpoint,
            model=self.model,
            client_stream=self.client_stream,
            upstream_stream=self.upstream_stream,
            client=client,
            server=server,
            engine=self.engine,
            n_in=self.n_in,
            n_out=self.n_out,
            n_cached=self.n_cached,
            token_source=self.token_source,
            finish_reason=self.finish_reason,
            http_status=self.http_status,
            error_type=self.error_type,
            replica=self.replica,
            route_policy=self.route_policy,
            attributes=attributes,
            shape=self._final_shape(),
            request_read_ns=self.request_read_ns,
        )

    def _final_shape(self) -> RequestShape | None:
        if self.shape is None or self.text_parts is None:
            return self.shape
        return replace(self.shape, completion_text="".join(self.text_parts))
