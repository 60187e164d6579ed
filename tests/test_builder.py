"""RecordBuilder (sidecar/proxy/builder.py), the one mutable piece of timing state: stamps as
offsets from t_arrive, the first failure kept, and `freeze` into the immutable record with one
token column shared by both sides. Every case worked by hand on small integer instants."""

from __future__ import annotations

from array import array

from sidecar.meter import MALFORMED_CHUNK, StreamMeter
from sidecar.protocol.openai import Usage
from sidecar.proxy.builder import RecordBuilder
from sidecar.record import Outcome, RequestShape, TokenSource

ARRIVE = 1_000  # t_arrive on the monotonic clock: every offset counts from it


def builder() -> RecordBuilder:
    return RecordBuilder("r", wall_time_ns=7, arrive_ns=ARRIVE, endpoint="chat")


def meter_with(
    marks: tuple[tuple[int, int], ...],
    choices: tuple[int, ...] | None = None,
    events: int | None = None,
) -> StreamMeter:
    """The upstream's token events as the measuring core hands them over: (offset from the
    builder's t_arrive, tokens) per event, and every event block it read."""
    meter = StreamMeter(ARRIVE)
    for at, n in marks:
        meter.mark(at, n)
    if choices is not None:
        meter.choices = array("q", choices)
    meter.events = len(marks) if events is None else events
    return meter


def test_both_sides_are_offsets_from_t_arrive() -> None:
    b = builder()
    b.up_send_ns = 20  # sent upstream 20 ns after t_arrive
    b.take_stream(meter_with(((100, 1), (200, 2)), events=3))  # and one without tokens
    b.up_end_ns = 210
    b.client_token_writes(ARRIVE + 130, 1)
    b.client_token_writes(ARRIVE + 230, 1)
    b.down_events, b.down_end_ns = 2, 240
    assert b.offset(ARRIVE + 500) == 500
    record = b.freeze()
    assert record.wall_time_ns == 7 and record.outcome is Outcome.OK
    assert record.server is not None
    assert (
        record.server.start_ns,
        tuple(record.server.offsets_ns),
        tuple(record.server.tokens),
        record.server.end_ns,
        record.server.events_total,
    ) == (20, (100, 200), (1, 2), 210, 3)
    assert (
        record.client.start_ns,
        tuple(record.client.offsets_ns),
        tuple(record.client.tokens),
        record.client.end_ns,
        record.client.events_total,
    ) == (0, (130, 230), (1, 2), 240, 2)


def test_one_write_of_several_events_stamps_each_at_its_instant() -> None:
    b = builder()
    b.up_send_ns = 5
    b.take_stream(meter_with(((100, 1), (101, 1), (102, 1))))
    b.client_token_writes(ARRIVE + 150, 3)  # three events left in one write
    assert b.freeze().client.offsets_ns == (150, 150, 150)


def test_a_request_never_sent_upstream_has_no_server_side() -> None:
    b = builder()
    b.fail(Outcome.REJECTED, "max_concurrency", 429)
    b.down_end_ns = 3
    record = b.freeze()
    assert record.server is None and record.client.offsets_ns == ()
    assert (record.outcome, record.error_type, record.http_status) == (
        Outcome.REJECTED,
        "max_concurrency",
        429,
    )


def test_a_frozen_record_shares_one_token_column_between_its_sides() -> None:
    b = builder()
    b.up_send_ns = 5
    b.take_stream(meter_with(((100, 1), (200, 3), (300, 1))))
    b.client_token_writes(ARRIVE + 350, 3)
    record = b.freeze()
    assert record.server is not None and record.client.tokens is record.server.tokens
    assert record.client.offsets_ns == (350, 350, 350) and record.server.offsets_ns == (
        100,
        200,
        300,
    )
    # A client gone after two writes: its column is the first two counts.
    b = builder()
    b.up_send_ns = 5
    b.take_stream(meter_with(((100, 1), (200, 3), (300, 1))))
    b.client_token_writes(ARRIVE + 150, 1)
    b.client_token_writes(ARRIVE + 250, 1)
    assert b.freeze().client.tokens == (1, 3)


def test_with_n_choices_the_client_keeps_the_choices_of_what_it_got() -> None:
    b = builder()
    b.up_send_ns = 5
    b.take_stream(meter_with(((100, 1), (110, 1), (200, 1)), choices=(0, 1, 0)))
    b.client_token_writes(ARRIVE + 120, 2)  # the client left before the third event
    record = b.freeze()
    assert record.server is not None and record.server.choices == (0, 1, 0)
    assert record.client.choices == (0, 1) and record.client.tokens == (1, 1)


def test_the_first_failure_is_the_cause() -> None:
    b = builder()
    b.fail(Outcome.TIMEOUT, "total_timeout", 504)
    b.fail(Outcome.CLIENT_CANCELLED, "client_disconnect")  # the write error that followed
    assert (b.outcome, b.error_type, b.http_status) == (Outcome.TIMEOUT, "total_timeout", 504)
    # An outcome set to OK is no cause: a later failure replaces it, keeping the status seen
    # when it does not bring one.
    b = builder()
    b.outcome, b.http_status = Outcome.OK, 200
    b.fail(Outcome.UPSTREAM_ERROR, "stream_cut_without_done")
    assert (b.outcome, b.error_type, b.http_status) == (
        Outcome.UPSTREAM_ERROR,
        "stream_cut_without_done",
        200,
    )


def test_the_stream_brings_its_counts_and_its_failure() -> None:
    b = builder()
    b.up_send_ns = 5
    meter = meter_with(((100, 1),))
    meter.usage = Usage(prompt_tokens=12, completion_tokens=1, total_tokens=13, cached_tokens=4)
    meter.finish_reason = "length"
    meter.failure = MALFORMED_CHUNK
    b.take_stream(meter)
    assert (b.n_in, b.n_out, b.n_cached, b.token_source) == (12, 1, 4, TokenSource.USAGE)
    assert b.finish_reason == "length"
    assert (b.outcome, b.error_type, b.http_status) == (
        Outcome.UPSTREAM_ERROR,
        "malformed_chunk",
        502,
    )


def test_a_stream_without_counts_keeps_what_the_builder_had() -> None:
    b = builder()
    b.n_in, b.token_source = 9, TokenSource.NONE  # e.g. nothing known yet
    b.take_stream(meter_with(()))  # no usage and no token event: nothing to say
    assert (b.n_in, b.n_out, b.token_source) == (9, None, TokenSource.NONE)


def test_attributes_given_at_freeze_go_to_the_record_only() -> None:
    b = builder()
    b.attributes["slo_class"] = "gold"
    record = b.freeze({"response_model": "m"})
    assert record.attributes == {"slo_class": "gold", "response_model": "m"}
    assert b.attributes == {"slo_class": "gold"} and b.frozen


def test_the_generated_text_joins_the_shape_only_when_kept() -> None:
    b = builder()
    b.shape = RequestShape(max_tokens=4)
    assert b.freeze().shape == RequestShape(max_tokens=4)
    b.text_parts = ["Hel", "lo"]  # opt-in capture of text
    shape = b.freeze().shape
    assert shape is not None and shape.completion_text == "Hello" and shape.max_tokens == 4
