"""The measuring core, fed bytes as they would arrive: every split point, one byte at a time.

Stamps are hand-worked: an event is stamped with the instant of the read that completed it, as
an offset from the meter's origin. Token counts: from continuous usage when the upstream sent
it (deltas of the cumulative count), else one per token event.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm_chunks import CHAT_BANG, CHAT_HELLO, CHAT_ROLE, CHAT_USAGE, ERROR_COMPACT

from sidecar.meter import StreamMeter
from sidecar.protocol.assemble import StreamAssembler
from sidecar.protocol.rewrite import NO_CHANGE, UsagePlan
from sidecar.protocol.sse import SSEParser
from sidecar.record import Outcome, TokenSource

ORIGIN = 1_000_000
FINGERPRINT = "vllm-0.33.0-1a2b3c4d"


def event(payload: str) -> bytes:
    return b"data: " + payload.encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"


def with_usage(payload: str, completion: int, prompt: int = 12) -> str:
    """A chunk as vLLM sends it with continuous usage: `usage` after `choices`."""
    obj = json.loads(payload)
    usage = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "completion_tokens_details": None,
    }
    out: dict[str, object] = {}
    for key, value in obj.items():
        if key == "system_fingerprint":
            continue  # with include_usage vLLM moves it to the usage chunk
        out[key] = value
        if key == "choices":
            out["usage"] = usage
    return json.dumps(out, separators=(",", ":"))


# The plain stream a client that asked for nothing gets: role, "Hello", "!" (finish + fingerprint).
PLAIN = [event(CHAT_ROLE), event(CHAT_HELLO), event(CHAT_BANG), DONE]
PLAIN_BYTES = b"".join(PLAIN)
# What the upstream sends when the proxy injected include_usage + continuous_usage_stats for
# that client: cumulative usage on every chunk (role 0, Hello 2 tokens, "!" 3), then the usage
# chunk with the fingerprint. "Hello" carrying 2 tokens is a merged delta.
INJECTED = [
    event(with_usage(CHAT_ROLE, 0)),
    event(with_usage(CHAT_HELLO, 2)),
    event(with_usage(CHAT_BANG, 3)),
    event(CHAT_USAGE),
    DONE,
]
INJECTED_BYTES = b"".join(INJECTED)
ADDED_BOTH = UsagePlan(
    client_include_usage=False, client_continuous=False, add_include_usage=True, add_continuous=True
)


def ends(events: list[bytes]) -> list[int]:
    """Byte offset where each event ends."""
    out, pos = [], 0
    for e in events:
        pos += len(e)
        out.append(pos)
    return out


def feed_split(meter: StreamMeter, data: bytes, k: int) -> tuple[bytes, list[int]]:
    """Two reads: data[:k] at t=100 ns after the origin, data[k:] at t=200; then close."""
    forwarded = b""
    written_tokens: list[int] = []
    for part, t in ((data[:k], 100), (data[k:], 200)):
        out, n_events, n_tokens = meter.feed(part, ORIGIN + t)
        forwarded += out
        written_tokens.append(n_tokens)
        assert (n_events == 0) == (out == b"")
    out, _, n_tokens = meter.close()
    forwarded += out
    written_tokens.append(n_tokens)
    return forwarded, written_tokens


def test_plain_stream_split_at_every_byte() -> None:
    for k in range(len(PLAIN_BYTES) + 1):
        check_plain_split(k)


def check_plain_split(k: int) -> None:
    meter = StreamMeter(ORIGIN)
    forwarded, written = feed_split(meter, PLAIN_BYTES, k)
    assert forwarded == PLAIN_BYTES  # relayed byte for byte
    # Token events: "Hello" (event 1) and "!" (event 2), each stamped by the read completing it.
    hello_end, bang_end = ends(PLAIN)[1], ends(PLAIN)[2]
    assert list(meter.offsets) == [100 if hello_end <= k else 200, 100 if bang_end <= k else 200]
    assert list(meter.token_counts()) == [1, 1]  # no usage: one per token event, an estimate
    assert sum(written) == 2
    assert meter.token_totals == (None, 2, None, TokenSource.CHUNK_COUNT)
    assert meter.finish_reason == "stop"
    assert meter.events == 4
    assert meter.failure is None and meter.fatal is None


def test_injected_usage_cut_out_at_every_split() -> None:
    for k in range(len(INJECTED_BYTES) + 1):
        check_injected_split(k)


def check_injected_split(k: int) -> None:
    meter = StreamMeter(ORIGIN, ADDED_BOTH)
    forwarded, written = feed_split(meter, INJECTED_BYTES, k)
    # The client gets exactly the plain stream: usage members cut, the usage chunk dropped,
    # the fingerprint back on the finish chunk.
    assert forwarded == PLAIN_BYTES
    assert list(meter.token_counts()) == [2, 1]  # from the cumulative counts 0 -> 2 -> 3
    hello_end, bang_end = ends(INJECTED)[1], ends(INJECTED)[2]
    assert list(meter.offsets) == [100 if hello_end <= k else 200, 100 if bang_end <= k else 200]
    assert meter.token_totals == (12, 3, None, TokenSource.USAGE)
    # The finish chunk carries a token: whichever write releases it counts it.
    assert sum(written) == 2
    assert meter.rewritten == 0  # every event edited as text, none re-encoded


def test_byte_at_a_time() -> None:
    meter = StreamMeter(ORIGIN, ADDED_BOTH)
    forwarded = b""
    for i in range(len(INJECTED_BYTES)):
        forwarded += meter.feed(INJECTED_BYTES[i : i + 1], ORIGIN + i)[0]
    forwarded += meter.close()[0]
    assert forwarded == PLAIN_BYTES
    # Stamped at the read that held each event's last byte.
    hello_end, bang_end = ends(INJECTED)[1], ends(INJECTED)[2]
    assert list(meter.offsets) == [hello_end - 1, bang_end - 1]


def test_finish_chunk_held_until_the_usage_chunk_then_released_in_its_read() -> None:
    meter = StreamMeter(ORIGIN, ADDED_BOTH)
    out, n_events, n_tokens = meter.feed(b"".join(INJECTED[:3]), ORIGIN + 10)
    assert out == b"".join(PLAIN[:2])  # the finish chunk waits
    assert (n_events, n_tokens) == (2, 1)
    out, n_events, n_tokens = meter.feed(b"".join(INJECTED[3:]), ORIGIN + 20)
    assert out == PLAIN[2] + DONE
    assert (n_events, n_tokens) == (2, 1)
    # Server side: the finish chunk arrived at 10; it reached the client with the usage chunk.
    assert list(meter.offsets) == [10, 10]


def test_client_that_asked_for_usage_gets_it_unchanged() -> None:
    asked = UsagePlan(True, True, False, False)
    meter = StreamMeter(ORIGIN, asked)
    out, _, _ = meter.feed(INJECTED_BYTES, ORIGIN + 5)
    assert out == INJECTED_BYTES
    assert meter.token_totals == (12, 3, None, TokenSource.USAGE)


def test_keepalive_releases_the_held_finish_chunk_first() -> None:
    meter = StreamMeter(ORIGIN, ADDED_BOTH)
    data = INJECTED[0] + INJECTED[1] + INJECTED[2] + KEEPALIVE + INJECTED[3] + DONE
    out, n_events, n_tokens = meter.feed(data, ORIGIN + 1)
    assert (
        out
        == PLAIN[0]
        + PLAIN[1]
        + event(with_usage(CHAT_BANG, 3)).replace(
            b',"usage":{"prompt_tokens":12,"total_tokens":15,"completion_tokens":3,'
            b'"completion_tokens_details":null}',
            b"",
        )
        + KEEPALIVE
        + DONE
    )
    assert (n_events, n_tokens) == (5, 2)
    assert meter.events == 6


def test_error_event_is_the_outcome_but_the_stream_goes_on() -> None:
    meter = StreamMeter(ORIGIN)
    data = event(CHAT_ROLE) + event(CHAT_HELLO) + event(ERROR_COMPACT) + DONE
    out, _, _ = meter.feed(data, ORIGIN + 7)
    meter.close()
    assert out == data
    assert meter.fatal is None
    assert meter.failure is not None
    assert (meter.failure.outcome, meter.failure.error_type, meter.failure.status) == (
        Outcome.HTTP_ERROR,
        "InternalServerError",
        500,
    )
    assert meter.failure.message == "Internal server error"


@pytest.mark.parametrize(
    ("tail", "cause"),
    [
        (b"", "stream_cut_without_done"),
        (b'data: {"id":"chatcmpl-abc123","obj', "stream_cut_mid_event"),
    ],
)
def test_stream_cut_before_done(tail: bytes, cause: str) -> None:
    meter = StreamMeter(ORIGIN, ADDED_BOTH)
    data = INJECTED[0] + INJECTED[1] + INJECTED[2] + tail
    out, _, _ = meter.feed(data, ORIGIN + 3)
    held, n_events, n_tokens = meter.close()
    assert out + held == PLAIN[0] + PLAIN[1] + PLAIN[2].replace(
        b',"system_fingerprint":"' + FINGERPRINT.encode() + b'"', b""
    )
    assert (n_events, n_tokens) == (1, 1)  # the held finish chunk goes out without a fingerprint
    assert meter.fatal is not None and meter.fatal.error_type == cause
    assert meter.failure == meter.fatal
    # A cut stream keeps what usage had arrived: 3 tokens, cumulative, exact.
    assert meter.token_totals == (12, 3, None, TokenSource.USAGE)


def test_cancelled_stream_keeps_the_usage_that_arrived() -> None:
    # A client disconnect: the relay stops feeding and never closes the meter.
    meter = StreamMeter(ORIGIN, ADDED_BOTH)
    meter.feed(INJECTED[0] + INJECTED[1], ORIGIN + 1)
    assert meter.token_totals == (12, 2, None, TokenSource.USAGE)
    assert meter.failure is None


def test_oversized_event_relays_what_came_before_then_is_fatal() -> None:
    meter = StreamMeter(ORIGIN, ADDED_BOTH, max_event_bytes=600)
    huge = b"data: " + b"x" * 2000 + b"\n\n"
    out, _, n_tokens = meter.feed(INJECTED[0] + INJECTED[1] + INJECTED[2] + huge, ORIGIN + 4)
    assert meter.fatal is not None and meter.fatal.error_type == "oversized_event"
    assert meter.fatal.status == 502
    # The finish chunk is not held back behind a failure.
    assert out.startswith(PLAIN[0] + PLAIN[1]) and n_tokens == 2
    assert list(meter.token_counts()) == [2, 1]


def test_malformed_chunk_counts_and_the_stream_goes_on() -> None:
    meter = StreamMeter(ORIGIN)
    data = event(CHAT_HELLO) + b"data: {not json\n\n" + event(CHAT_BANG) + DONE
    out, _, _ = meter.feed(data, ORIGIN + 2)
    meter.close()
    assert out == data
    assert meter.failure is not None and meter.failure.error_type == "malformed_chunk"
    assert meter.fatal is None
    assert meter.token_totals == (None, 2, None, TokenSource.CHUNK_COUNT)


BAD_USAGE_VALUES = [2**63, 2**53, -1, 1.5, "3", None, True, {"n": 1}]


def _with_bad_usage(payload: str, bad: object) -> str:
    # NaN is not JSON; vLLM's encoder never writes it, a hostile one might.
    obj = json.loads(with_usage(payload, 2))
    obj["usage"]["completion_tokens"] = bad
    return (
        json.dumps(obj, separators=(",", ":"))
        if bad == bad
        else json.dumps(obj, separators=(",", ":")).replace(
            '"completion_tokens":null', '"completion_tokens":NaN'
        )
    )


@pytest.mark.parametrize("bad", [*BAD_USAGE_VALUES, float("nan")])
def test_usage_that_cannot_be_believed_is_cut_counted_and_never_trusted(bad: object) -> None:
    """A count of 2**63 once overflowed the record's int64 columns and lost the request. Usage
    out of range, negative, fractional, a string or NaN is malformed usage: the chunk's text is
    still measured and relayed, the injected member still cut out, and no count is trusted."""
    hello = _with_bad_usage(CHAT_HELLO, bad)
    stream = [
        event(with_usage(CHAT_ROLE, 0)),
        event(hello),
        event(with_usage(CHAT_BANG, 3)),
        event(CHAT_USAGE),
        DONE,
    ]
    meter = StreamMeter(ORIGIN, ADDED_BOTH)
    out, _, n_tokens = meter.feed(b"".join(stream), ORIGIN + 5)
    tail, _, tail_tokens = meter.close()
    assert out + tail == PLAIN_BYTES  # the client's bytes, injected usage cut everywhere
    assert n_tokens + tail_tokens == 2
    assert meter.usage_malformed == 1
    assert meter.failure is not None and meter.failure.error_type == "malformed_usage"
    assert meter.fatal is None  # the stream goes on
    # One per token event ("Hello" 1, "!" 2 from its cumulative 3): an estimate, never 2**63.
    n_in, n_out, _, source = meter.token_totals
    assert (n_in, n_out, source) == (None, 3, TokenSource.CHUNK_COUNT)


def test_malformed_usage_is_fatal_when_assembling() -> None:
    meter = StreamMeter(ORIGIN, forward=False, assembler=StreamAssembler("chat"))
    meter.feed(event(_with_bad_usage(CHAT_HELLO, 2**63)) + event(CHAT_BANG), ORIGIN + 2)
    assert meter.fatal is not None and meter.fatal.error_type == "malformed_usage"


def test_malformed_chunk_is_fatal_when_assembling() -> None:
    meter = StreamMeter(ORIGIN, forward=False, assembler=StreamAssembler("chat"))
    meter.feed(event(CHAT_HELLO) + b"data: [1,2\n\n" + event(CHAT_BANG), ORIGIN + 2)
    assert meter.fatal is not None and meter.fatal.error_type == "malformed_chunk"
    assert list(meter.offsets) == [2]  # "!" after the bad chunk was not read


def test_assembler_gets_every_chunk_and_nothing_is_forwarded() -> None:
    assembler = StreamAssembler("chat")
    meter = StreamMeter(ORIGIN, forward=False, assembler=assembler)
    out, n_events, n_tokens = meter.feed(INJECTED_BYTES, ORIGIN + 9)
    meter.close()
    assert (out, n_events, n_tokens) == (b"", 0, 0)
    body = json.loads(assembler.body())
    assert body["choices"][0]["message"]["content"] == "Hello!"
    assert body["usage"]["completion_tokens"] == 3
    assert body["system_fingerprint"] == FINGERPRINT
    assert list(meter.offsets) == [9, 9]


@pytest.mark.parametrize("version", ["0.32", "0.33"])
def test_assembled_body_follows_the_upstreams_version(version: str) -> None:
    """0.33 puts `weight_versions` on every choice, streamed and whole; 0.32 nowhere. The
    assembled body has it exactly when the stream did."""
    stream = (
        INJECTED_BYTES
        if version == "0.33"
        else INJECTED_BYTES.replace(b',"weight_versions":null', b"")
    )
    assembler = StreamAssembler("chat")
    meter = StreamMeter(ORIGIN, forward=False, assembler=assembler)
    meter.feed(stream, ORIGIN)
    (choice,) = json.loads(assembler.body())["choices"]
    assert ("weight_versions" in choice) is (version == "0.33")
    if version == "0.33":
        assert choice["weight_versions"] is None
        assert list(choice)[-2:] == ["routed_experts", "weight_versions"]


@pytest.mark.parametrize("version", ["0.32", "0.33"])
def test_assembled_metrics_have_the_whole_answers_fields(version: str) -> None:
    """The usage chunk carries vLLM's per-request metrics without its None fields (0.32 dumps
    it with exclude_none); the whole answer has every field, null when unknown, and in 0.32
    also speculative_decoding (0.33 dropped it)."""
    metrics = {
        "time_to_first_token_ms": 9.5,
        "generation_time_ms": 4.5,
        "queue_time_ms": 0.03,
        "tokens_per_second": 217.0,
    }  # mean_itl_ms None: left out of the chunk
    usage_chunk = json.loads(CHAT_USAGE)
    usage_chunk["metrics"] = metrics
    stream = INJECTED_BYTES.replace(event(CHAT_USAGE), event(json.dumps(usage_chunk)))
    if version == "0.32":
        stream = stream.replace(b',"weight_versions":null', b"")
    assembler = StreamAssembler("chat")
    StreamMeter(ORIGIN, forward=False, assembler=assembler).feed(stream, ORIGIN)
    whole = json.loads(assembler.body())["metrics"]
    expected = {
        "time_to_first_token_ms": 9.5,
        "generation_time_ms": 4.5,
        "queue_time_ms": 0.03,
        "mean_itl_ms": None,
        "tokens_per_second": 217.0,
    }
    if version == "0.32":
        expected["speculative_decoding"] = None
    assert whole == expected and list(whole) == list(expected)


def test_text_is_kept_only_when_asked() -> None:
    meter = StreamMeter(ORIGIN, keep_text=True)
    meter.feed(PLAIN_BYTES, ORIGIN)
    assert meter.text == "Hello!"
    plain = StreamMeter(ORIGIN)
    plain.feed(PLAIN_BYTES, ORIGIN)
    assert plain.text is None


def test_per_request_metrics_become_engine_timing() -> None:
    usage_with_metrics = json.loads(CHAT_USAGE)
    usage_with_metrics["metrics"] = {
        "time_to_first_token_ms": 12.5,
        "generation_time_ms": 40.0,
        "queue_time_ms": 1.5,
        "mean_itl_ms": 8.0,
        "tokens_per_second": 75.0,
    }
    meter = StreamMeter(ORIGIN, NO_CHANGE)
    meter.feed(event(CHAT_HELLO) + event(json.dumps(usage_with_metrics)) + DONE, ORIGIN)
    assert meter.engine is not None
    assert (
        meter.engine.time_to_first_token_ms,
        meter.engine.queue_time_ms,
        meter.engine.mean_itl_ms,
    ) == (12.5, 1.5, 8.0)
    # The usage chunk's total is authoritative over the per-event estimate (1 token for Hello).
    assert meter.token_totals == (12, 3, None, TokenSource.USAGE_TOTAL)


class CountingParser:
    """Wraps an SSE parser, put in a meter before its first read (which would make one), to
    count the reads it was given."""

    def __init__(self, parser: object) -> None:
        self.parser = parser
        self.reads = 0

    def feed(self, data: bytes) -> object:
        self.reads += 1
        return self.parser.feed(data)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.parser, name)


def long_stream(usage: bool) -> list[bytes]:
    """role, then five "Hello" token events (1 token each), "!" with finish, (usage), [DONE]."""
    events = [event(with_usage(CHAT_ROLE, 0) if usage else CHAT_ROLE)]
    for i in range(1, 6):
        events.append(event(with_usage(CHAT_HELLO, i) if usage else CHAT_HELLO))
    events.append(event(with_usage(CHAT_BANG, 6) if usage else CHAT_BANG))
    if usage:
        events.append(event(CHAT_USAGE))
    return [*events, DONE]


@pytest.mark.parametrize(
    ("usage", "plan"), [(False, NO_CHANGE), (True, ADDED_BOTH), (True, NO_CHANGE)]
)
def test_one_token_event_per_read_skips_the_parser_and_changes_nothing(
    usage: bool, plan: UsagePlan
) -> None:
    """The common read (one whole token event) is taken without the SSE parser: what comes out
    equals the general loop's (a text-keeping meter never takes that lane), stamp for stamp."""
    stream = long_stream(usage)
    lane = StreamMeter(ORIGIN, plan)
    counting = CountingParser(SSEParser())
    lane._parser = counting  # type: ignore[assignment]
    general = StreamMeter(ORIGIN, plan, keep_text=True)
    outs: dict[str, list[tuple[bytes, int, int]]] = {"lane": [], "general": []}
    for i, raw in enumerate(stream):
        outs["lane"].append(lane.feed(raw, ORIGIN + 10 * i))
        outs["general"].append(general.feed(raw, ORIGIN + 10 * i))
    outs["lane"].append(lane.close())
    outs["general"].append(general.close())
    assert outs["lane"] == outs["general"]
    assert list(lane.offsets) == list(general.offsets) == [10, 20, 30, 40, 50, 60]
    assert list(lane.token_counts()) == list(general.token_counts()) == [1] * 6
    assert lane.events == general.events == len(stream)
    assert lane.usage == general.usage and lane.token_totals == general.token_totals
    assert lane.finish_reason == general.finish_reason == "stop"
    # The five "Hello" reads never reached the parser; the role, finish, usage and [DONE] did.
    assert counting.reads == len(stream) - 5
    if plan is ADDED_BOTH:
        assert b"".join(o for o, _, _ in outs["lane"]) == b"".join(long_stream(False))


def test_lane_waits_for_the_parser_to_be_between_events() -> None:
    """A read that completes an event split across reads, or holds two events, goes through the
    parser; so does one arriving while a finish chunk is held."""
    hello = event(CHAT_HELLO)
    meter = StreamMeter(ORIGIN)
    counting = CountingParser(SSEParser())
    meter._parser = counting  # type: ignore[assignment]
    forwarded = meter.feed(event(CHAT_ROLE), ORIGIN)[0]
    forwarded += meter.feed(hello[:7], ORIGIN + 1)[0]
    forwarded += meter.feed(hello[7:], ORIGIN + 2)[0]  # completes a buffered event
    forwarded += meter.feed(hello + hello, ORIGIN + 3)[0]
    forwarded += meter.feed(hello, ORIGIN + 4)[0]  # the lane
    assert counting.reads == 4
    assert forwarded == event(CHAT_ROLE) + hello * 4
    assert list(meter.offsets) == [2, 3, 3, 4]


def choice(payload: str, index: int) -> str:
    """The chunk as it would be for choice ``index`` of an n > 1 request."""
    obj = json.loads(payload)
    obj["choices"][0]["index"] = index
    return json.dumps(obj, separators=(",", ":"))


def test_n2_finish_chunk_that_must_leave_early_gets_the_fingerprint_known() -> None:
    """n = 2: choice 0 finishes while choice 1 still streams. Its finish chunk cannot wait for the
    usage chunk (choice 1's events follow it), so it leaves with the fingerprint the replica
    sent before; choice 1's gets the one of the usage chunk. Without one known, it leaves as
    vLLM sent it (no fingerprint): the first such request a replica serves."""
    plain = [
        event(choice(CHAT_HELLO, 0)),
        event(choice(CHAT_BANG, 0)),
        event(choice(CHAT_HELLO, 1)),
        event(choice(CHAT_BANG, 1)),
        DONE,
    ]
    injected = [
        event(with_usage(choice(CHAT_HELLO, 0), 1)),
        event(with_usage(choice(CHAT_BANG, 0), 2)),
        event(with_usage(choice(CHAT_HELLO, 1), 1)),
        event(with_usage(choice(CHAT_BANG, 1), 2)),
        event(
            CHAT_USAGE.replace('"completion_tokens":3', '"completion_tokens":4').replace(
                '"total_tokens":15', '"total_tokens":16'
            )
        ),
        DONE,
    ]
    for hint, first_finish in (
        (FINGERPRINT, plain[1]),
        (
            None,
            event(with_usage(choice(CHAT_BANG, 0), 2)).replace(
                b',"usage":{"prompt_tokens":12,"total_tokens":14,'
                b'"completion_tokens":2,"completion_tokens_details":null}',
                b"",
            ),
        ),
    ):
        meter = StreamMeter(ORIGIN, ADDED_BOTH, fingerprint=hint)
        forwarded = b"".join(meter.feed(raw, ORIGIN + i)[0] for i, raw in enumerate(injected))
        forwarded += meter.close()[0]
        assert forwarded == plain[0] + first_finish + b"".join(plain[2:])
        assert meter.fingerprint == "vllm-0.33.0-1a2b3c4d"  # for the next request
        assert meter.token_totals == (12, 4, None, TokenSource.USAGE)


def test_a_last_event_ended_by_a_lone_cr_is_taken_at_close() -> None:
    """``data: [DONE]\\r\\r``: the parser waits on the last CR (a LF may follow), so [DONE]
    comes only at close. Once the close result was ignored and such a stream was reported cut,
    with an error event injected after the client's own [DONE]."""
    data = event(CHAT_HELLO) + b"data: [DONE]\r\r"
    meter = StreamMeter(ORIGIN)
    out, _, _ = meter.feed(data, ORIGIN + 5)
    tail, n_events, n_tokens = meter.close(ORIGIN + 9)
    assert out + tail == data and (n_events, n_tokens) == (1, 0)
    assert meter.saw_done and meter.failure is None and meter.fatal is None


def test_events_after_done_are_neither_counted_nor_relayed() -> None:
    data = event(CHAT_HELLO) + DONE + event(CHAT_BANG) + DONE
    for k in range(len(data) + 1):
        meter = StreamMeter(ORIGIN)
        forwarded, _ = feed_split(meter, data, k)
        assert forwarded == event(CHAT_HELLO) + DONE
        assert list(meter.token_counts()) == [1] and meter.after_done == 2 and meter.events == 2
        assert meter.failure is None


def test_n2_events_keep_their_choice_and_n1_keeps_none() -> None:
    """The choice column starts at the first event of a choice other than 0 (0 for the
    events before it); n = 1 streams never build one."""
    second = CHAT_HELLO.replace('"index":0', '"index":1')
    meter = StreamMeter(ORIGIN)
    meter.feed(event(CHAT_HELLO), ORIGIN + 1)
    meter.feed(event(CHAT_HELLO), ORIGIN + 2)  # one whole token event: the lane
    meter.feed(event(second), ORIGIN + 3)
    meter.feed(event(CHAT_HELLO) + event(second), ORIGIN + 4)  # the general path
    assert meter.choices is not None and list(meter.choices) == [0, 0, 1, 0, 1]
    plain = StreamMeter(ORIGIN)
    plain.feed(PLAIN_BYTES, ORIGIN + 1)
    assert plain.choices is None


@pytest.mark.parametrize("one_read", [False, True])
def test_the_token_column_starts_at_the_first_event_of_more_than_one_token(
    one_read: bool,
) -> None:
    """Every event carried one token: no column is kept, and `token_counts` gives ones. The
    first event with another count starts it, with 1 for the events before: cumulative
    usage 1, 2, 4, 5 is [1, 1, 2, 1], on the one-event lane and in the general loop alike."""
    ones = [event(with_usage(CHAT_HELLO, i)) for i in (1, 2, 3)]
    meter = StreamMeter(ORIGIN, ADDED_BOTH)
    for i, raw in enumerate(ones):
        meter.feed(raw, ORIGIN + 10 * (i + 1))
    assert meter._counts is None and list(meter.token_counts()) == [1, 1, 1]

    stream = [event(with_usage(CHAT_HELLO, i)) for i in (1, 2, 4, 5)]
    meter = StreamMeter(ORIGIN, ADDED_BOTH)
    if one_read:
        meter.feed(b"".join(stream), ORIGIN + 10)
    else:
        for i, raw in enumerate(stream):
            meter.feed(raw, ORIGIN + 10 * (i + 1))
    assert list(meter.token_counts()) == [1, 1, 2, 1]
    assert len(meter.offsets) == 4
    assert meter.token_totals[1] == 5


# One event of a generated stream: (choice, completion tokens so far or None, kind).
_STEP = st.tuples(
    st.integers(0, 2),
    st.one_of(st.none(), st.integers(0, 40)),
    st.sampled_from(["token", "token", "token", "role"]),
)


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(_STEP, max_size=12), strip=st.booleans())
def test_the_lane_counts_and_forwards_as_the_general_loop_does(
    steps: list[tuple[int, int | None, str]], strip: bool
) -> None:
    """Token events in vLLM's shape, one per read (the lane), against the same events through
    the general loop (a text-keeping meter never takes the lane): choices other than 0, usage
    that jumps, stands still or goes back, a role chunk whose usage is carried to the next
    token event, usage on some events only. Forwarded bytes, stamps, counts, choices and
    totals agree."""
    stream: list[bytes] = []
    for choice, completion, kind in steps:
        payload = CHAT_HELLO if kind == "token" else CHAT_ROLE
        if completion is not None:
            payload = with_usage(payload, completion)
        stream.append(event(payload.replace('"index":0', f'"index":{choice}')))
    stream.append(DONE)
    plan = ADDED_BOTH if strip else NO_CHANGE
    lane = StreamMeter(ORIGIN, plan)
    general = StreamMeter(ORIGIN, plan, keep_text=True)
    for i, raw in enumerate(stream):
        assert lane.feed(raw, ORIGIN + 10 * i) == general.feed(raw, ORIGIN + 10 * i)
    assert lane.close() == general.close()
    assert list(lane.offsets) == list(general.offsets)
    assert list(lane.token_counts()) == list(general.token_counts())
    assert (lane.choices is None) == (general.choices is None)
    assert list(lane.choices or ()) == list(general.choices or ())
    assert lane.token_totals == general.token_totals and lane.usage == general.usage
    assert lane.events == general.events and lane.failure == general.failure


def test_a_stream_the_c_lane_began_parses_on_as_one_past_its_start() -> None:
    """The meter makes its SSE parser at the first read it parses itself, which may come after
    the C lane took the stream's first read (`first_in_lane`): that parser starts past the
    stream's start, as one that had read the first events would. A byte-order mark is then
    data, not the stream's (WHATWG: only a stream's first bytes may be one), so an event behind
    it has no `data` field; at a fresh meter's start it is dropped and the event counts."""
    bom_event = b"\xef\xbb\xbf" + event(CHAT_HELLO)
    fresh = StreamMeter(ORIGIN)
    fresh.feed(bom_event, ORIGIN + 1)
    began = StreamMeter(ORIGIN)
    began.first_in_lane("m", "chatcmpl-1", 0)
    began.feed(bom_event, ORIGIN + 1)
    assert (list(fresh.offsets), list(began.offsets)) == ([1], [])
    assert began.response_model == "m" and fresh.events == began.events == 1
