"""The C lane (`_tokenscan.Lane`): a stream's common read taken whole in one call.

Two parts. The lane on its own, fed vLLM's chunk bytes: what it takes, what it writes, what it
hands back, and every read it must leave untouched for the Python path (a stream's common reads
and its end). Then the proxy in front of the simulator, the same requests with the lane on and
off (`stream_relay.LaneType`): the client's bytes and the records must be the same, and the lane
must have taken most reads and the ends.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
from array import array
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from proxy_stack import stack
from vllm_chunks import CHAT_BANG, CHAT_HELLO, CHAT_ROLE, CHAT_USAGE, COMPLETION_HELLO

from sidecar import clock, meter
from sidecar.meter import StreamMeter
from sidecar.protocol.rewrite import UsagePlan
from sidecar.proxy import stream_relay
from sidecar.proxy.listener import stream_socket_fd
from sidecar.record import Outcome, RequestRecord
from sidecar.sim.engine import EngineConfig
from sidecar.sim.server import SimConfig

try:
    from sidecar.protocol import _tokenscan
    from sidecar.protocol._tokenscan import Lane
except ImportError:  # pragma: no cover - the package is built with its C modules in CI
    pytest.skip("the C lane is not built", allow_module_level=True)

ORIGIN = 1_000_000
HIGH_WATER = 64 * 1024


def event(chunk: str, completion: int | None = None, prompt: int = 12) -> bytes:
    """One SSE event of ``chunk`` (a vLLM token chunk), with vLLM's continuous usage when
    ``completion`` is given (its place in vLLM's member order: before kv_transfer_params)."""
    if completion is not None:
        usage = (
            f',"usage":{{"prompt_tokens":{prompt},"total_tokens":{prompt + completion},'
            f'"completion_tokens":{completion}}}'
        )
        chunk = chunk.replace(',"kv_transfer_params":null}', usage + ',"kv_transfer_params":null}')
    return b"data: " + chunk.encode() + b"\n\n"


def usage_cut(data: bytes) -> bytes:
    return re.sub(rb',"usage":\{[^}]*\}', b"", data)


def chunk(payload: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(payload), payload)


class Client:
    """What the lane calls: the client transport's three methods, and the relay's
    `on_client_full`, `first_in_lane` and `end_in_lane`; recorded."""

    def __init__(self, held: int = 0, closing: bool = False) -> None:
        self.writes: list[bytes] = []
        self.held = held
        self.closing = closing
        self.full_calls = 0
        self.fail_write = False
        self.ends: list[tuple[bytes, int, str, str | None, bool]] = []
        self.firsts: list[tuple[str | None, str | None, int, bool]] = []

    def first_in_lane(
        self, model: str | None, response_id: str | None, other_events: int, first_token: bool
    ) -> None:
        self.firsts.append((model, response_id, other_events, first_token))

    def end_in_lane(
        self, out: bytes, at_ns: int, finish_reason: str, fingerprint: str | None, usage: bool
    ) -> None:
        self.ends.append((out, at_ns, finish_reason, fingerprint, usage))

    def write(self, data: bytes) -> None:
        if self.fail_write:
            raise RuntimeError("write failed")
        self.writes.append(data)

    def get_write_buffer_size(self) -> int:
        return self.held

    def is_closing(self) -> bool:
        return self.closing

    def on_client_full(self) -> None:
        self.full_calls += 1


def new_lane(
    client: Client, strip: bool = True, max_event: int = 1 << 20, drop: bool = False
) -> Lane:
    return Lane(client, client, ORIGIN, HIGH_WATER, max_event, strip, drop)


def offsets(raw: bytes) -> list[int]:
    values = array("q")
    values.frombytes(raw)
    return values.tolist()


def test_a_token_chunk_is_counted_stamped_cut_and_written_as_one_client_chunk() -> None:
    client = Client()
    lane = new_lane(client)
    assert lane.last_read_ns == 0
    lane.arm(100, 4)
    first, second = event(CHAT_HELLO, 5), event(COMPLETION_HELLO, 6)
    before = clock.monotonic_ns()
    assert lane.relay(chunk(first), ORIGIN + 500)
    assert lane.relay(chunk(second), ORIGIN + 900)
    after = clock.monotonic_ns()
    # The usage the proxy asked for is cut back out, and each read leaves as one chunk.
    assert client.writes == [chunk(usage_cut(first)), chunk(usage_cut(second))]
    assert before <= lane.last_read_ns <= after  # the idle timeout's read instant
    taken = lane.take()
    assert taken is not None
    up, down, tokens, gained, last, exact, usage, _, _ = taken
    assert offsets(up) == [500, 900]
    assert all(before - ORIGIN <= d <= after - ORIGIN for d in offsets(down))
    assert (tokens, gained, last, exact, usage) == (None, 2, 6, True, (12, 18, 6))
    assert not lane.armed and lane.take() is None  # taking disarms; nothing counted twice


def test_several_whole_chunks_in_one_read_leave_as_one_client_chunk() -> None:
    client = Client()
    lane = new_lane(client, strip=False)
    lane.arm(100, 0)
    events = [event(CHAT_HELLO, n) for n in (1, 2, 3)]
    assert lane.relay(b"".join(chunk(e) for e in events), ORIGIN + 7)
    assert client.writes == [chunk(b"".join(events))]  # kept whole: not asked to strip
    taken = lane.take()
    assert taken is not None and offsets(taken[0]) == [7, 7, 7] and taken[2:5] == (None, 3, 3)


def test_events_without_usage_count_one_token_each_and_are_not_exact() -> None:
    client = Client()
    lane = new_lane(client)
    lane.arm(100, 2)
    assert lane.relay(chunk(event(CHAT_HELLO)), ORIGIN)
    assert client.writes == [chunk(event(CHAT_HELLO))]
    taken = lane.take()
    assert taken is not None and taken[2:] == (None, 1, 3, False, None, 0, 0)


def test_events_of_several_tokens_or_none_are_counted_as_the_counter_counts_them() -> None:
    """Speculative decoding: an event may carry several tokens (the cumulative count jumps), or
    none (released text, the count unchanged): each event's count is kept, as
    `TokenCounter.token_event` gives it."""
    client = Client()
    lane = new_lane(client)
    lane.arm(100, 3)
    counts = (4, 4, 7, 8)  # cumulative: +1, +0, +3, +1
    assert lane.relay(b"".join(chunk(event(CHAT_HELLO, c)) for c in counts), ORIGIN)
    taken = lane.take()
    assert taken is not None
    _up, _down, tokens, gained, last, exact, _usage, _, _ = taken
    assert tokens is not None and offsets(tokens) == [1, 0, 3, 1]
    assert (gained, last, exact) == (5, 8, True)
    lane.arm(100, 8)
    assert lane.relay(chunk(event(CHAT_HELLO, 9)), ORIGIN)
    taken = lane.take()
    assert taken is not None and taken[2:5] == (None, 1, 9)  # a take starts a new column


READS_LEFT_ALONE: dict[str, bytes] = {
    "half a chunk": chunk(event(CHAT_HELLO, 1))[:-1],
    "a chunk and more": chunk(event(CHAT_HELLO, 1)) + b"2",
    "the last chunk": chunk(event(CHAT_HELLO, 1)) + b"0\r\n\r\n",
    "a chunk extension": chunk(event(CHAT_HELLO, 1)).replace(b"\r\n", b";x=1\r\n", 1),
    "a leading zero": b"0" + chunk(event(CHAT_HELLO, 1)),
    "another choice": chunk(event(CHAT_HELLO.replace('"index":0', '"index":1'), 1)),
    "a finish chunk": chunk(
        event(CHAT_HELLO.replace('"finish_reason":null', '"finish_reason":"stop"'), 1)
    ),
    "two events in one chunk": chunk(event(CHAT_HELLO, 1) + event(CHAT_HELLO, 2)),
    "a token chunk then another shape": chunk(event(CHAT_HELLO, 1)) + chunk(b"data: [DONE]\n\n"),
    "a comment": chunk(b": keep-alive\n\n"),
}


@pytest.mark.parametrize("name", list(READS_LEFT_ALONE))
def test_a_read_it_cannot_take_whole_is_left_untouched(name: str) -> None:
    client = Client()
    lane = new_lane(client)
    lane.arm(100, 0)
    assert not lane.relay(READS_LEFT_ALONE[name], ORIGIN)
    assert client.writes == [] and lane.pending == 0 and lane.last_read_ns == 0
    assert lane.armed  # the caller's Python path takes this read, then `take` disarms


def test_limits_and_a_leaving_client_leave_the_read_to_the_python_path() -> None:
    read = chunk(event(CHAT_HELLO, 1))
    size = len(event(CHAT_HELLO, 1))
    refused = [
        (new_lane(Client(), max_event=size - 1), 100),  # an event over --max-event-bytes
        (new_lane(Client()), 0),  # the stream's event limit reached
        (new_lane(Client(closing=True)), 100),  # the client is going
    ]
    for lane, events_left in refused:
        lane.arm(events_left, 0)
        assert not lane.relay(read, ORIGIN) and lane.pending == 0
    exact = new_lane(Client(), max_event=size)
    exact.arm(1, 0)
    assert exact.relay(read, ORIGIN)
    assert not exact.relay(chunk(event(CHAT_HELLO, 2)), ORIGIN)  # one event left, taken
    failing = Client()
    failing.fail_write = True
    lane = new_lane(failing)
    lane.arm(100, 0)
    assert not lane.relay(read, ORIGIN) and lane.pending == 0  # the Python path writes again
    unarmed = new_lane(Client())
    assert not unarmed.relay(read, ORIGIN)


def test_it_hands_its_counts_over_every_128_events() -> None:
    """A long stream's counts do not pile up in the lane: the read after 128 counted events is
    left to the Python path, which takes them (and the lane frees its buffer)."""
    lane = new_lane(Client())
    lane.arm(10_000, 0)
    for n in range(1, 129):
        assert lane.relay(chunk(event(CHAT_HELLO, n)), ORIGIN + n)
    assert not lane.relay(chunk(event(CHAT_HELLO, 129)), ORIGIN + 129)
    taken = lane.take()
    assert taken is not None and offsets(taken[0]) == list(range(1, 129))
    lane.arm(10_000 - 128, 128)
    assert lane.relay(chunk(event(CHAT_HELLO, 129)), ORIGIN + 129) and lane.pending == 1


def test_a_full_client_buffer_pauses_once_and_disarms() -> None:
    client = Client(held=HIGH_WATER + 1)
    lane = new_lane(client)
    lane.arm(100, 0)
    assert lane.relay(chunk(event(CHAT_HELLO, 1)), ORIGIN)  # written and counted, then full
    assert client.full_calls == 1 and not lane.armed
    assert not lane.relay(chunk(event(CHAT_HELLO, 2)), ORIGIN)
    assert lane.pending == 1


# vLLM's end of a stream when the usage is asked for (continuous usage, as the proxy asks):
# the terminal chunk without its system_fingerprint, which the usage chunk carries instead.
FINISH = CHAT_BANG.replace(',"system_fingerprint":"vllm-0.33.0-1a2b3c4d"', "")
DONE = b"data: [DONE]\n\n"
LAST_CHUNK = b"0\r\n\r\n"
END_OK = meter.LANE_END_OK
FINGERPRINT_KNOWN = meter.LANE_END_FINGERPRINT_KNOWN


def end_read(*events: bytes) -> bytes:
    return b"".join(chunk(e) for e in events) + LAST_CHUNK


def usage_event(payload: str = CHAT_USAGE) -> bytes:
    return b"data: " + payload.encode() + b"\n\n"


def test_the_end_flags_are_the_c_lanes() -> None:
    assert (END_OK, FINGERPRINT_KNOWN) == (
        _tokenscan.LANE_END_OK,
        _tokenscan.LANE_END_FINGERPRINT_KNOWN,
    )


def test_the_end_of_a_stream_whose_usage_the_client_did_not_ask_for() -> None:
    """The proxy asked for usage (continuous): the finish chunk leaves with its usage member
    cut and the usage chunk's fingerprint in its place, which is the terminal chunk vLLM sends
    when nobody asks for usage (byte for byte); the usage chunk is dropped; [DONE] follows.
    One relay call ends the stream with those bytes; the finish chunk is the read's last token
    event, and the usage is the usage chunk's."""
    client = Client()
    lane = new_lane(client, drop=True)
    lane.arm(100, 1, END_OK)
    read = end_read(event(CHAT_HELLO, 2), event(FINISH, 3), usage_event(), DONE)
    before = clock.monotonic_ns()
    assert lane.relay(read, ORIGIN + 40)
    after = clock.monotonic_ns()
    assert client.writes == []  # the relay's end writes, framed and ended
    expected = usage_cut(event(CHAT_HELLO, 2)) + b"data: " + CHAT_BANG.encode() + b"\n\n" + DONE
    assert client.ends == [(expected, ORIGIN + 40, "stop", "vllm-0.33.0-1a2b3c4d", False)]
    assert not lane.armed and not lane.relay(chunk(event(CHAT_HELLO, 4)), ORIGIN)
    taken = lane.take()
    assert taken is not None
    up, down, tokens, gained, last, exact, usage, _, _ = taken
    assert offsets(up) == [40, 40]
    assert all(before - ORIGIN <= d <= after - ORIGIN for d in offsets(down))
    assert (tokens, gained, last, exact, usage) == (None, 2, 3, True, (12, 15, 3))


def test_the_end_of_a_stream_whose_usage_the_client_asked_for() -> None:
    """The client asked for the final usage, the proxy for the continuous one: the finish
    chunk's usage member is cut, the usage chunk goes on as is. Asked for both: all as is."""
    for strip in (True, False):
        client = Client()
        lane = new_lane(client, strip=strip)
        lane.arm(100, 2, END_OK | FINGERPRINT_KNOWN)
        finish = event(FINISH, 3)
        assert lane.relay(end_read(finish, usage_event(), DONE), ORIGIN)
        forwarded = usage_cut(finish) if strip else finish
        assert client.ends == [
            (forwarded + usage_event() + DONE, ORIGIN, "stop", "vllm-0.33.0-1a2b3c4d", True)
        ]
        taken = lane.take()
        assert taken is not None and taken[3:7] == (1, 3, True, (12, 15, 3))


def test_a_dropped_usage_chunk_without_a_fingerprint() -> None:
    """An older vLLM: no fingerprint on the usage chunk. The finish chunk leaves without one
    when none is known; when the meter knows one, the Python path puts it back."""
    bare_usage = usage_event(CHAT_USAGE.replace(',"system_fingerprint":"vllm-0.33.0-1a2b3c4d"', ""))
    read = end_read(event(FINISH, 3), bare_usage, DONE)
    client = Client()
    lane = new_lane(client, drop=True)
    lane.arm(100, 2, END_OK)
    assert lane.relay(read, ORIGIN)
    assert client.ends == [(usage_cut(event(FINISH, 3)) + DONE, ORIGIN, "stop", None, False)]
    client = Client()
    lane = new_lane(client, drop=True)
    lane.arm(100, 2, END_OK | FINGERPRINT_KNOWN)
    assert not lane.relay(read, ORIGIN) and client.ends == [] and lane.pending == 0


FINISH_READ = [event(FINISH, 3), usage_event(), DONE]
ENDS_LEFT_ALONE: dict[str, tuple[bytes, bool, int]] = {
    "a trailer": (end_read(*FINISH_READ)[:-2] + b"X-Tail: t\r\n\r\n", True, END_OK),
    "more after the body": (end_read(*FINISH_READ) + b"HTTP/1.1", True, END_OK),
    "no [DONE]": (end_read(*FINISH_READ[:2]), True, END_OK),
    "no usage chunk": (end_read(FINISH_READ[0], DONE), True, END_OK),
    "the end not allowed": (end_read(*FINISH_READ), True, 0),
    "a finish chunk with a fingerprint": (
        end_read(event(CHAT_BANG, 3), *FINISH_READ[1:]),
        True,
        END_OK,
    ),
    "another choice's finish": (
        end_read(event(FINISH.replace('"index":0', '"index":1'), 3), *FINISH_READ[1:]),
        True,
        END_OK,
    ),
    "a finish chunk without usage, the usage chunk dropped": (
        end_read(event(FINISH), *FINISH_READ[1:]),
        True,
        END_OK,
    ),
    "a fingerprint that is not ASCII": (
        end_read(FINISH_READ[0], usage_event(CHAT_USAGE.replace("1a2b", "1a\u00e9")), DONE),
        False,
        END_OK,
    ),
    "the finish and usage chunks in one chunk": (
        chunk(FINISH_READ[0] + FINISH_READ[1]) + chunk(DONE) + LAST_CHUNK,
        True,
        END_OK,
    ),
}


@pytest.mark.parametrize("name", list(ENDS_LEFT_ALONE))
def test_an_end_it_cannot_take_whole_is_left_untouched(name: str) -> None:
    read, drop, flags = ENDS_LEFT_ALONE[name]
    client = Client()
    lane = new_lane(client, drop=drop)
    lane.arm(100, 2, flags)
    assert not lane.relay(read, ORIGIN)
    assert client.ends == [] and client.writes == [] and lane.pending == 0 and lane.armed


def test_an_end_past_the_streams_event_limit_is_left_to_the_python_path() -> None:
    """The finish, usage and [DONE] events all count against the stream's limit."""
    read = end_read(*FINISH_READ)
    short = new_lane(Client())
    short.arm(2, 2, END_OK)
    assert not short.relay(read, ORIGIN)
    client = Client()
    exact = new_lane(client)
    exact.arm(3, 2, END_OK)
    assert exact.relay(read, ORIGIN) and len(client.ends) == 1


# -- the first read of a stream -----------------------------------------------------------

FIRST = meter.LANE_FIRST


def role_event(completion: int | None = None, prompt: int = 12, role: str = CHAT_ROLE) -> bytes:
    """Chat's role chunk, with vLLM's continuous usage when ``completion`` is given."""
    if completion is not None:
        usage = (
            f',"usage":{{"prompt_tokens":{prompt},"total_tokens":{prompt + completion},'
            f'"completion_tokens":{completion}}}'
        )
        role = role.replace(',"prompt_token_ids":null', usage + ',"prompt_token_ids":null')
    return b"data: " + role.encode() + b"\n\n"


def named(data: bytes, model: str = "M", response_id: str = "chatcmpl-abc123") -> bytes:
    return data.replace(b'"model":"M"', b'"model":"%b"' % model.encode()).replace(
        b'"chatcmpl-abc123"', b'"%b"' % response_id.encode()
    )


# First reads the lane takes: each checked against the Python path (`StreamMeter`).
FIRST_READS: dict[str, list[bytes]] = {
    "chat: the role chunk and the first token": [role_event(0), event(CHAT_HELLO, 1)],
    "chat without usage": [role_event(), event(CHAT_HELLO)],
    "completions: the first token": [event(COMPLETION_HELLO, 1)],
    "several tokens after the role chunk": [
        role_event(0),
        event(CHAT_HELLO, 1),
        event(CHAT_HELLO, 3),
    ],
    "the first token alone (chat's role chunk came first, read by the Python path)": [
        event(CHAT_HELLO, 2)
    ],
    "a model of 256 characters": [named(role_event(0), "m" * 256), event(CHAT_HELLO, 1)],
    "an id the meter does not keep (too long)": [
        named(role_event(0), response_id="c" * 257),
        event(CHAT_HELLO, 1),
    ],
    "an id the meter does not keep (DEL)": [
        named(role_event(0), response_id="c\x7fd"),
        event(CHAT_HELLO, 1),
    ],
    "an empty model": [named(event(CHAT_HELLO, 1), "")],
}


@pytest.mark.parametrize("name", list(FIRST_READS))
@pytest.mark.parametrize("client_usage", [None, "final", "continuous"])
def test_a_streams_first_read_is_taken_as_the_python_path_takes_it(
    name: str, client_usage: str | None
) -> None:
    """Armed before any event (`StreamMeter.lane_start`'s LANE_FIRST), the lane takes the
    first token with chat's role chunk before it: the client's bytes, the counts and what it
    hands the relay (`first_in_lane`: the answer's model and id as the meter keeps them, the
    role chunk as an event without a token) are what the Python path makes of the same read.
    After it, the stream's end may be taken (the model is known)."""
    plan = UsagePlan(client_usage is not None, client_usage == "continuous", True, True)
    events = FIRST_READS[name]
    python = StreamMeter(ORIGIN, plan)
    out, n_events, n_token_events = python.feed(b"".join(events), ORIGIN + 30)
    lane_meter = StreamMeter(ORIGIN, plan)
    start = lane_meter.lane_start()
    assert start is not None and start[2] == FIRST, start
    client = Client()
    lane = Lane(
        client, client, ORIGIN, HIGH_WATER, 1 << 20, plan.strip_chunk_usage, plan.drop_usage_chunk
    )
    lane.arm(*start)
    assert lane.relay(b"".join(chunk(e) for e in events), ORIGIN + 30)
    assert client.writes == [chunk(out)]
    names = (python.response_model, python.response_id)
    assert client.firsts == [(*names, n_events - n_token_events, True)]
    model, response_id, other, _ = client.firsts[0]
    lane_meter.first_in_lane(model, response_id, other)
    taken = lane.take()
    assert taken is not None
    up, _, tokens, gained, last, exact, usage, _, _ = taken
    lane_meter.take_lane(up, tokens, gained, last, exact, usage)
    assert list(lane_meter.offsets) == list(python.offsets) == [30] * n_token_events
    assert lane_meter.events == python.events == n_events
    assert lane_meter.token_totals == python.token_totals
    assert lane_meter.token_counts().tolist() == python.token_counts().tolist()
    assert (lane_meter.response_model, lane_meter.response_id) == (
        python.response_model,
        python.response_id,
    )
    # Both meters now stand where the next reads are the lane's, the end among them: the lane
    # took the first read and may take the end without being armed again.
    assert lane_meter.lane_start() == python.lane_start() is not None
    ender = Client()
    lane = Lane(ender, ender, ORIGIN, HIGH_WATER, 1 << 20, True, False)
    lane.arm(*start)
    assert lane.relay(b"".join(chunk(e) for e in events), ORIGIN)
    assert lane.relay(end_read(event(FINISH, last + 1), usage_event(), DONE), ORIGIN)
    assert len(ender.ends) == 1


def test_the_first_flag_is_the_c_lanes() -> None:
    assert FIRST == _tokenscan.LANE_FIRST and FIRST & (END_OK | FINGERPRINT_KNOWN) == 0


# First reads it leaves to the Python path, armed with LANE_FIRST.
FIRST_READS_LEFT_ALONE: dict[str, list[bytes]] = {
    "a role chunk after a token": [event(CHAT_HELLO, 1), role_event(1)],
    "two role chunks": [role_event(0), role_event(0), event(CHAT_HELLO, 1)],
    "a role chunk with a fingerprint": [
        role_event(0, role=CHAT_ROLE.replace('}],"prompt', '}],"system_fingerprint":"fp","prompt')),
        event(CHAT_HELLO, 1),
    ],
    "a role chunk with completion tokens (carried)": [role_event(1), event(CHAT_HELLO, 2)],
    "an empty role": [
        role_event(0, role=CHAT_ROLE.replace('"assistant"', '""')),
        event(CHAT_HELLO, 1),
    ],
    "another choice's role chunk": [
        role_event(0, role=CHAT_ROLE.replace('"index":0', '"index":1')),
        event(CHAT_HELLO, 1),
    ],
    "a model the meter does not keep (too long)": [named(event(CHAT_HELLO, 1), "m" * 257)],
    "a model the meter does not keep (DEL)": [named(event(CHAT_HELLO, 1), "m\x7f")],
    "a model outside ASCII": [named(event(CHAT_HELLO, 1), "mod\u00e8le")],
    "an id outside ASCII": [named(event(CHAT_HELLO, 1), response_id="\u00e9")],
    "an end at end-of-sequence before any token": [
        role_event(0),
        event(FINISH.replace('"content":"!"', '"content":""'), 1),
        usage_event(),
        DONE,
    ],
}


@pytest.mark.parametrize("name", list(FIRST_READS_LEFT_ALONE))
def test_a_first_read_it_cannot_take_whole_is_left_untouched(name: str) -> None:
    client = Client()
    lane = new_lane(client)
    lane.arm(100, 0, FIRST | END_OK)
    read = b"".join(chunk(e) for e in FIRST_READS_LEFT_ALONE[name])
    assert not lane.relay(read, ORIGIN)
    assert client.writes == [] and client.firsts == [] and client.ends == []
    assert lane.pending == 0
    assert lane.armed and lane.last_read_ns == 0


def test_without_the_first_flag_a_role_chunk_is_left_alone_and_no_names_are_handed() -> None:
    client = Client()
    lane = new_lane(client)
    lane.arm(100, 0)
    assert not lane.relay(chunk(role_event(0)) + chunk(event(CHAT_HELLO, 1)), ORIGIN)
    assert lane.relay(chunk(event(CHAT_HELLO, 1)), ORIGIN)
    assert client.firsts == [] and client.writes == [chunk(usage_cut(event(CHAT_HELLO, 1)))]


def test_the_role_chunk_counts_against_the_streams_event_limit() -> None:
    read = chunk(role_event(0)) + chunk(event(CHAT_HELLO, 1))
    short = new_lane(Client())
    short.arm(1, 0, FIRST)
    assert not short.relay(read, ORIGIN)  # two events, one left
    client = Client()
    lane = new_lane(client)
    lane.arm(3, 0, FIRST)
    assert lane.relay(read, ORIGIN)
    assert lane.relay(chunk(event(CHAT_HELLO, 2)), ORIGIN)  # the third event
    assert not lane.relay(chunk(event(CHAT_HELLO, 3)), ORIGIN)  # a fourth is past the limit
    assert client.firsts == [("M", "chatcmpl-abc123", 1, True)]


def test_a_role_chunk_read_alone_then_the_first_token() -> None:
    """vLLM's role chunk can reach the proxy alone, its first token in the next read: the lane
    takes both, hands the names and the role chunk with the first (no token yet: the TTFT
    deadline stands) and the first token with the second; the role chunk's usage is handed
    over even with no token event to go with it."""
    client = Client()
    lane = new_lane(client, drop=True)
    lane.arm(100, 0, FIRST | FINGERPRINT_KNOWN)
    role = role_event(0, prompt=7)
    assert lane.relay(chunk(role), ORIGIN + 10)
    assert client.firsts == [("M", "chatcmpl-abc123", 1, False)]
    assert client.writes == [chunk(usage_cut(role))]
    assert lane.relay(chunk(event(CHAT_HELLO, 1, prompt=7)), ORIGIN + 20)
    assert client.firsts[1:] == [(None, None, 0, True)]
    assert lane.relay(chunk(event(CHAT_HELLO, 2, prompt=7)), ORIGIN + 30)
    assert len(client.firsts) == 2  # the first token only
    assert lane.relay(end_read(event(FINISH, 3, prompt=7), usage_event(), DONE), ORIGIN + 40)
    assert len(client.ends) == 1
    taken = lane.take()
    assert taken is not None and offsets(taken[0]) == [20, 30, 40]
    # Read alone, then the Python path: the role chunk's usage reaches the meter.
    alone = new_lane(Client())
    alone.arm(100, 0, FIRST)
    assert alone.relay(chunk(role), ORIGIN)
    assert alone.take() == (b"", b"", None, 0, 0, True, (7, 7, 0), 0, 0)
    assert alone.take() is None
    python = StreamMeter(ORIGIN, UsagePlan(False, False, True, True))
    python.feed(role, ORIGIN)
    lane_meter = StreamMeter(ORIGIN, UsagePlan(False, False, True, True))
    lane_meter.first_in_lane("M", "chatcmpl-abc123", 1)
    lane_meter.take_lane(b"", None, 0, 0, True, (7, 7, 0))
    assert lane_meter.token_totals == python.token_totals
    assert lane_meter.events == python.events == 1
    assert lane_meter.lane_start() is python.lane_start() is None  # Python's, to a token


def test_the_role_chunks_usage_is_the_last_seen_when_no_token_chunk_carries_one() -> None:
    lane = new_lane(Client())
    lane.arm(100, 0, FIRST)
    assert lane.relay(chunk(role_event(0, prompt=7)) + chunk(event(CHAT_HELLO)), ORIGIN)
    taken = lane.take()
    assert taken is not None
    assert taken[3:7] == (1, 1, False, (7, 7, 0))  # one token, estimated; the role's usage


class ReentrantClient(Client):
    """A client whose write takes the lane's counts or closes the lane, before returning."""

    def __init__(self, action: str) -> None:
        super().__init__()
        self.action = action
        self.lane: Lane | None = None

    def write(self, data: bytes) -> None:
        super().write(data)
        assert self.lane is not None
        if len(self.writes) == 1:
            return  # the first read is counted as usual: the second one's take frees a buffer
        if self.action == "take":
            self.lane.take()
        else:
            self.lane.close()


@pytest.mark.parametrize("action", ["take", "close"])
def test_a_lane_taken_or_closed_from_inside_its_write_still_counts_the_read(action: str) -> None:
    """Whatever the client's write calls (nothing today) may take the lane's counts or close
    it: the read it was relaying is still counted, and nothing it holds is freed under it."""
    client = ReentrantClient(action)
    lane = client.lane = new_lane(client)
    lane.arm(100, 0)
    assert lane.relay(chunk(event(CHAT_HELLO, 1)), ORIGIN)
    assert lane.relay(chunk(event(CHAT_HELLO, 2)) + chunk(event(CHAT_HELLO, 3)), ORIGIN)
    assert len(client.writes) == 2
    # Taken inside the write: the first read's event went then; the second read's two remain.
    assert lane.pending == (2 if action == "take" else 3)


async def test_a_lane_with_the_clients_socket_sends_on_it_and_keeps_the_order() -> None:
    """A lane given the client's socket (a uvloop transport on a socketpair whose reader does not
    read, the buffers small): it sends the reads itself while the transport holds nothing; the
    kernel then takes part of one and the transport queues the rest, and the later reads go
    behind it through the transport, until past the high-water mark the lane tells the relay.
    Read out, the client's bytes are every read's, whole and in order."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
    fd = stream_socket_fd(transport)
    assert fd == ours.fileno()
    relay = Client()
    high_water = 16 * 1024
    lane = Lane(transport, relay, ORIGIN, high_water, 1 << 20, True, False, fd)
    expected = []
    reads = 0
    while relay.full_calls == 0:
        reads += 1
        assert reads < 10_000, "the client's buffer never filled"
        lane.arm(100, reads - 1)
        data = event(CHAT_HELLO, reads)
        assert lane.relay(chunk(data), ORIGIN + reads)
        expected.append(chunk(usage_cut(data)))
        taken = lane.take()
        assert taken is not None and taken[3:5] == (1, reads)
    assert transport.get_write_buffer_size() > high_water and not lane.armed
    assert relay.full_calls == 1
    # The reader takes some: the kernel has room again, the transport still holds bytes (the
    # loop did not run its write since). The next read must go behind them.
    theirs.setblocking(False)
    received = bytearray(theirs.recv(4096))
    assert received
    lane.arm(100, reads)
    data = event(CHAT_HELLO, reads + 1)
    assert lane.relay(chunk(data), ORIGIN + reads + 1)
    expected.append(chunk(usage_cut(data)))
    assert relay.full_calls == 2
    wanted = sum(map(len, expected))
    while len(received) < wanted:
        received += await asyncio.wait_for(loop.sock_recv(theirs, 1 << 16), 5)
    assert bytes(received) == b"".join(expected)
    transport.close()
    theirs.close()


def test_the_socket_of_a_transport_that_is_not_a_plain_stream_is_not_given() -> None:
    class Transport:
        def __init__(self, extra: dict[str, Any]) -> None:
            self.extra = extra

        def get_extra_info(self, name: str, default: Any = None) -> Any:
            return self.extra.get(name, default)

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as datagram:
        for extra in [{}, {"sslcontext": object()}, {"socket": datagram}]:
            assert stream_socket_fd(Transport(extra)) == -1  # type: ignore[arg-type]


def test_a_closed_lane_takes_nothing_and_cannot_be_armed() -> None:
    """Closed, it still says when its last read came: the request's idle deadline counts
    from it until the request ends (stream_relay keeps it on the timeouts)."""
    lane = new_lane(Client())
    lane.arm(100, 0)
    assert lane.relay(chunk(event(CHAT_HELLO, 1)), ORIGIN)
    last = lane.last_read_ns
    assert last > 0
    lane.close()
    assert not lane.relay(chunk(event(CHAT_HELLO, 2)), ORIGIN)
    with pytest.raises(RuntimeError):
        lane.arm(100, 0)
    assert lane.last_read_ns == last


class SlotsClient:
    """A client transport without an instance dict, as uvloop's is: the lane finds its methods
    once per type (_methodcache.h) instead of by name on every read."""

    __slots__ = ("writes",)

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False

    def on_client_full(self) -> None:  # pragma: no cover - never full here
        raise AssertionError


def test_the_client_methods_it_finds_once_follow_the_type_and_its_changes() -> None:
    """What `client.write(...)` by name would call, every read: the type's current method, the
    other type's after a switch, an instance's own attribute where instances have a dict."""

    class Patched(SlotsClient):
        __slots__ = ()

    first, second = Patched(), SlotsClient()
    lanes = [new_lane(first), new_lane(second)]  # type: ignore[arg-type]
    for lane in lanes:
        lane.arm(100, 0)
    read = chunk(event(CHAT_HELLO, 1))
    for n in range(2):  # the two types take turns through the same cache
        assert lanes[0].relay(read, ORIGIN + n) and lanes[1].relay(read, ORIGIN + n)
    assert len(first.writes) == len(second.writes) == 2
    assert lanes[0].relay(read, ORIGIN + 2) and len(first.writes) == 3  # the cache: Patched's
    redirected: list[bytes] = []
    Patched.write = lambda self, data: redirected.append(data)  # type: ignore[method-assign]
    assert not first.is_closing()  # a lookup on the type: it has a version tag again, a new one
    assert lanes[0].relay(read, ORIGIN + 3)
    assert len(first.writes) == 3 and redirected == [first.writes[0]]
    Patched.is_closing = lambda self: True  # type: ignore[method-assign]
    assert first.is_closing()
    assert not lanes[0].relay(read, ORIGIN + 4)  # left to the Python path: the client is going
    assert lanes[1].relay(read, ORIGIN + 2) and len(second.writes) == 3

    class StaticWrite(SlotsClient):
        """`write` a staticmethod: called by name it takes the data alone."""

        __slots__ = ()
        static_writes: list[bytes] = []

        @staticmethod
        def write(data: bytes) -> None:
            StaticWrite.static_writes.append(data)

    static = StaticWrite()
    lane = new_lane(static)  # type: ignore[arg-type]
    lane.arm(100, 0)
    assert lane.relay(read, ORIGIN) and lane.relay(read, ORIGIN + 1)
    assert len(StaticWrite.static_writes) == 2 and static.writes == []

    own = Client()
    own_writes: list[bytes] = []
    own.write = own_writes.append  # type: ignore[method-assign, assignment]
    lane = new_lane(own)
    lane.arm(100, 0)
    assert lane.relay(read, ORIGIN) and own_writes and not own.writes


def test_an_instant_that_does_not_fit_in_64_bits_is_an_error() -> None:
    lane = new_lane(Client())
    lane.arm(100, 0)
    with pytest.raises(OverflowError):
        lane.relay(chunk(event(CHAT_HELLO, 1)), 1 << 64)
    assert lane.pending == 0
    assert lane.relay(chunk(event(CHAT_HELLO, 1)), (1 << 62) + 3)
    assert offsets(lane.take()[0]) == [(1 << 62) + 3 - ORIGIN]  # type: ignore[index]


# -- the proxy with the lane on and off ------------------------------------------------------

# -- a stream's end over several reads ---------------------------------------------------


def dechunk(read: bytes) -> tuple[bytes, bool, bytes]:
    """The body bytes of the whole HTTP/1.1 chunks a read begins with (what llhttp hands
    `on_read`), whether it ended the body (its last chunk), and the rest (a chunk cut short)."""
    body, at = b"", 0
    while at < len(read):
        line_end = read.find(b"\r\n", at)
        if line_end < 0:
            break
        size = int(read[at:line_end], 16)
        if size == 0:
            assert read[line_end:] == b"\r\n\r\n"
            return body, True, b""
        if line_end + 2 + size + 2 > len(read):
            break
        body += read[line_end + 2 : line_end + 2 + size]
        at = line_end + 2 + size + 2
    return body, False, read[at:]


class Stream:
    """A stream read by read, as `MeteredRead` reads it without its sockets: each read the
    lane takes, or the Python path (`StreamMeter.feed`, after the lane's counts and what it
    took of the end were handed over), the lane armed again after it; the client's bytes,
    events and token writes as the relay counts them."""

    def __init__(self, plan: UsagePlan, lane_on: bool, fingerprint: str | None = None) -> None:
        self.meter = StreamMeter(ORIGIN, plan, fingerprint=fingerprint)
        self.client = Client()
        self.lane = Lane(
            self.client,
            self.client,
            ORIGIN,
            HIGH_WATER,
            1 << 20,
            plan.strip_chunk_usage,
            plan.drop_usage_chunk,
        )
        self.lane_on = lane_on
        self.body = b""  # what the client got, unframed
        self.down_events = 0
        self.down_tokens = 0
        self.lane_reads = 0
        self.ended = False
        self._cut_short = b""  # a chunk the last read cut: the lane waits for its rest
        self._arm()

    def _arm(self) -> None:
        start = self.meter.lane_start()
        if self.lane_on and start is not None and not self._cut_short:
            self.lane.arm(*start)

    def _take(self) -> None:
        taken = self.lane.take()
        if taken is not None:
            up, down, tokens, gained, last, exact, usage, other, carry = taken
            self.meter.take_lane(up, tokens, gained, last, exact, usage, other, carry)
            self.down_events += len(down) // 8 + other
            self.down_tokens += len(down) // 8
        if self.lane.end_stage:
            end = self.lane.take_end()
            assert end is not None
            self.down_events += self.meter.take_end_in_lane(*end)

    def _written(self) -> None:
        for write in self.client.writes:
            self.body += dechunk(write)[0]
        self.client.writes.clear()
        for model, response_id, other, _ in self.client.firsts:
            self.meter.first_in_lane(model, response_id, other)
            self.down_events += other
        self.client.firsts.clear()
        for out, _, reason, fingerprint, usage in self.client.ends:
            self.meter.end_in_lane(reason, fingerprint)
            self.body += out
            self.down_events += 2 if usage else 1
            self.ended = True
        self.client.ends.clear()

    def read(self, read: bytes, at_ns: int) -> None:
        if self.lane.armed and self.lane.relay(read, at_ns):
            self.lane_reads += 1
            self._written()
            return
        self._take()
        body, ended, self._cut_short = dechunk(self._cut_short + read)
        out, n_events, n_token_events = self.meter.feed(body, at_ns)
        if ended:
            tail, n_tail, n_tail_tokens = self.meter.close(at_ns)
            out += tail
            n_events += n_tail
            n_token_events += n_tail_tokens
            self.ended = True
        self.body += out
        self.down_events += n_events
        self.down_tokens += n_token_events
        if not ended:
            self._arm()

    def finish(self) -> dict[str, Any]:
        """The body's end (when no read brought it: the stream was cut), and what it counted."""
        self._take()
        if not self.ended:
            out, n_events, n_token_events = self.meter.close(ORIGIN + 10_000)
            self.body += out
            self.down_events += n_events
            self.down_tokens += n_token_events
        meter = self.meter
        return {
            "body": self.body,
            "events": meter.events,
            "offsets": list(meter.offsets),
            "tokens": meter.token_counts().tolist(),
            "totals": meter.token_totals,
            "finish_reason": meter.finish_reason,
            "fingerprint": meter.fingerprint,
            "saw_done": meter.saw_done,
            "fatal": meter.fatal,
            "down_events": self.down_events,
            "down_tokens": self.down_tokens,
            "names": (meter.response_model, meter.response_id),
        }


def read_both(
    plan: UsagePlan, reads: list[bytes], fingerprint: str | None = None
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """The same reads with the lane on and off: what each counted, and the reads the lane
    took."""
    streams = [Stream(plan, lane_on, fingerprint) for lane_on in (True, False)]
    for stream in streams:
        for i, read in enumerate(reads):
            stream.read(read, ORIGIN + 10 * (i + 1))
    return streams[0].finish(), streams[1].finish(), streams[0].lane_reads


END_PARTS = [event(CHAT_HELLO, 2), event(FINISH, 3), usage_event(), DONE]
PLANS = {
    "the client asked for no usage": UsagePlan(False, False, True, True),
    "the client asked for the final usage": UsagePlan(True, False, False, True),
    "the client asked for continuous usage": UsagePlan(True, True, False, False),
}
# Where a stream's end is split into reads: after the finish chunk (1), the usage chunk (2),
# [DONE] (3); every combination (the empty one: the end in one read).
SPLITS = [tuple(point for point in (1, 2, 3) if mask & (1 << (point - 1))) for mask in range(8)]


def end_reads(splits: tuple[int, ...], parts: list[bytes] = END_PARTS) -> list[bytes]:
    """The stream's first read, then its end (a token chunk, the finish, usage and [DONE]
    chunks, the body's last chunk) split into reads after the parts ``splits`` names."""
    first = chunk(role_event(0)) + chunk(event(CHAT_HELLO, 1))
    reads, current = [first], b""
    for i, part in enumerate(parts):
        current += chunk(part)
        if i in splits:
            reads.append(current)
            current = b""
    return [*reads, current + LAST_CHUNK]


@pytest.mark.parametrize("splits", SPLITS, ids=str)
@pytest.mark.parametrize("plan_name", list(PLANS))
def test_an_end_over_several_reads_is_taken_as_the_python_path_takes_it(
    plan_name: str, splits: tuple[int, ...]
) -> None:
    """Every read of the end the lane's, wherever the end is split: the client's bytes (a held
    finish chunk leaves with the usage chunk's fingerprint), the counts, the finish reason and
    fingerprint, the events the client got and their token writes are the Python path's."""
    reads = end_reads(splits)
    on, off, lane_reads = read_both(PLANS[plan_name], reads)
    assert on == off
    assert lane_reads == len(reads)
    assert on["saw_done"] and on["fatal"] is None and on["finish_reason"] == "stop"
    assert on["fingerprint"] == "vllm-0.33.0-1a2b3c4d"


def test_the_end_stages_are_the_c_lanes() -> None:
    assert (meter.LANE_END_FINISH, meter.LANE_END_USAGE, meter.LANE_END_DONE) == (
        _tokenscan.END_FINISH,
        _tokenscan.END_USAGE,
        _tokenscan.END_DONE,
    )


def test_a_finish_chunk_read_alone_is_held_for_the_fingerprint_then_leaves_with_it() -> None:
    """The client did not ask for usage: the finish chunk read alone is counted (its server
    instant the read's) and held, nothing written; the usage chunk's read writes it with the
    fingerprint, and its client instant is that write's. Handed over before: the meter holds
    it (`take_end`), and `take`'s client instants stop before it."""
    client = Client()
    lane = new_lane(client, drop=True)
    lane.arm(100, 2, END_OK)
    assert lane.relay(chunk(event(FINISH, 3)), ORIGIN + 40)
    assert client.writes == [] and lane.end_stage == _tokenscan.END_FINISH and lane.pending == 1
    before = clock.monotonic_ns()
    assert lane.relay(chunk(usage_event()), ORIGIN + 50)
    after = clock.monotonic_ns()
    finish = b"data: " + CHAT_BANG.encode() + b"\n\n"
    assert client.writes == [chunk(finish)] and lane.end_stage == _tokenscan.END_USAGE
    taken = lane.take()
    assert taken is not None
    up, down, _, gained, last, exact, usage, _, _ = taken
    assert offsets(up) == [40] and before - ORIGIN <= offsets(down)[0] <= after - ORIGIN
    assert (gained, last, exact, usage) == (1, 3, True, (12, 15, 3))
    assert lane.take_end() == (_tokenscan.END_USAGE, "stop", "vllm-0.33.0-1a2b3c4d", None, 0, 0)
    assert lane.end_stage == 0 and lane.take_end() is None

    held = Lane(client, client, ORIGIN, HIGH_WATER, 1 << 20, True, True)
    held.arm(100, 2, END_OK)
    assert held.relay(chunk(event(FINISH, 3)), ORIGIN + 40)
    taken = held.take()
    assert taken is not None and offsets(taken[0]) == [40] and taken[1] == b""
    cut = usage_cut(event(FINISH, 3))
    assert held.take_end() == (_tokenscan.END_FINISH, "stop", None, cut, cut.index(b"}],") + 2, 1)


# Streams whose first token and end come in one read: a short answer written whole before the
# proxy first read its body.
ROLE, FIRST_TOKEN, ONLY_TOKEN = chunk(role_event(0)), chunk(event(CHAT_HELLO, 1)), event(FINISH, 1)
FIRST_AND_END_READS: dict[str, list[bytes]] = {
    "the whole stream": [ROLE + FIRST_TOKEN + end_read(event(FINISH, 2), usage_event(), DONE)],
    "a one-token stream": [ROLE + end_read(ONLY_TOKEN, usage_event(), DONE)],
    "the first read ends with the finish chunk": [
        ROLE + FIRST_TOKEN + chunk(event(FINISH, 2)),
        end_read(usage_event(), DONE),
    ],
    "the role chunk alone, then the rest": [
        ROLE,
        FIRST_TOKEN + end_read(event(FINISH, 2), usage_event(), DONE),
    ],
    "the role chunk alone, then a one-token end": [ROLE, end_read(ONLY_TOKEN, usage_event(), DONE)],
}


@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("name", list(FIRST_AND_END_READS))
def test_a_read_with_the_first_token_may_end_the_stream(name: str, plan_name: str) -> None:
    """The lane takes a read that brings the stream's first token and (a part of) its end:
    the meter learns of the first token and the answer's names (`first_in_lane`) before the
    end; bytes, counts and events are the Python path's."""
    reads = FIRST_AND_END_READS[name]
    on, off, lane_reads = read_both(PLANS[plan_name], reads)
    assert on == off
    assert lane_reads == len(reads)
    assert on["saw_done"] and on["fatal"] is None


# Text chunks whose text is empty (vLLM holds back a character whose UTF-8 bytes span two
# tokens and sends its text with the next token): events without a token, whose tokens the
# meter carries to choice 0's next token event.
CHAT_EMPTY = CHAT_HELLO.replace('"content":"Hello"', '"content":""')
COMPLETION_EMPTY = COMPLETION_HELLO.replace('"text":"Hello"', '"text":""')
COMPLETION_FINISH = COMPLETION_HELLO.replace(
    '"finish_reason":null,"stop_reason":null', '"finish_reason":"length","stop_reason":null'
)
COMPLETION_USAGE = CHAT_USAGE.replace("chatcmpl-", "cmpl-").replace(
    "chat.completion.chunk", "text_completion"
)
CHAT_FIRST = chunk(role_event(0)) + chunk(event(CHAT_HELLO, 1))
CHAT_END = end_read(event(FINISH, 6), usage_event(), DONE)
COMPLETION_END = end_read(event(COMPLETION_FINISH, 6), usage_event(COMPLETION_USAGE), DONE)
EMPTY_TEXT_READS: dict[str, list[bytes]] = {
    "chat: an empty text, then its token, read by read": [
        CHAT_FIRST,
        chunk(event(CHAT_EMPTY, 2)),
        chunk(event(CHAT_HELLO, 3)),
        chunk(event(CHAT_HELLO, 4)),
        CHAT_END,
    ],
    "chat: the empty text and its token in one read": [
        CHAT_FIRST,
        chunk(event(CHAT_EMPTY, 2)) + chunk(event(CHAT_HELLO, 3)) + chunk(event(CHAT_HELLO, 4)),
        CHAT_END,
    ],
    "chat: two empty texts, the finish chunk next": [
        CHAT_FIRST,
        chunk(event(CHAT_HELLO, 2)) + chunk(event(CHAT_EMPTY, 3)),
        chunk(event(CHAT_EMPTY, 4)),
        end_read(event(FINISH, 5), usage_event(), DONE),
    ],
    "chat: an empty text without usage": [
        CHAT_FIRST,
        chunk(event(CHAT_EMPTY)),
        chunk(event(CHAT_HELLO, 3)),
        CHAT_END,
    ],
    "chat: an empty text the Python path's next read follows": [
        CHAT_FIRST,
        chunk(event(CHAT_EMPTY, 2)),
        chunk(b": keep-alive\n\n"),
        chunk(event(CHAT_HELLO, 3)),
        chunk(event(CHAT_HELLO, 4)),
        CHAT_END,
    ],
    "completions: an empty text first, then the first token": [
        chunk(event(COMPLETION_EMPTY, 1)),
        chunk(event(COMPLETION_HELLO, 2)),
        COMPLETION_END,
    ],
    "completions: an empty text and the first token in the first read": [
        chunk(event(COMPLETION_EMPTY, 1)) + chunk(event(COMPLETION_HELLO, 2)),
        COMPLETION_END,
    ],
    "chat: the role chunk, an empty text and the first token in the first read": [
        chunk(role_event(0)) + chunk(event(CHAT_EMPTY, 1)) + chunk(event(CHAT_HELLO, 2)),
        CHAT_END,
    ],
    "completions: empty texts, then the token and the end": [
        chunk(event(COMPLETION_HELLO, 1)),
        chunk(event(COMPLETION_EMPTY, 2)),
        chunk(event(COMPLETION_EMPTY, 3)),
        chunk(event(COMPLETION_HELLO, 5)),
        COMPLETION_END,
    ],
}


@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("name", list(EMPTY_TEXT_READS))
def test_an_empty_text_is_taken_as_the_python_path_takes_it(name: str, plan_name: str) -> None:
    """The lane takes a text chunk whose text is empty as an event without a token: forwarded
    (its usage cut as a token chunk's), counted at the next `take`, and its tokens carried to
    the next token event (handed over with `take` when the Python path reads that one); the
    bytes, counts, events and token writes are the Python path's."""
    reads = EMPTY_TEXT_READS[name]
    on, off, lane_reads = read_both(PLANS[plan_name], reads)
    assert on == off
    python_reads = 2 if "the Python path's next read" in name else 0  # the comment, the token
    assert lane_reads == len(reads) - python_reads


# Streams one of whose token chunks is unlike the others. Its head (the bytes before the
# choices, which the lane keeps from the first chunk it walks; vLLM writes one per answer): a
# chunk that differs must be walked, never taken for the kept head. Or what follows its text.
def headed(data: bytes, old: bytes, new: bytes) -> bytes:
    assert old in data
    return data.replace(old, new, 1)


# name: (bytes replaced, by, whether the Python path must take that read)
UNLIKE: dict[str, tuple[bytes, bytes, bool]] = {
    "another creation second": (b'"created":1700000000', b'"created":1700000001', False),
    "a model the kept one begins": (b'"model":"M"', b'"model":"M2"', False),
    "another id of the same length": (b'"chatcmpl-abc123"', b'"chatcmpl-abc124"', False),
    "a longer id": (b'"chatcmpl-abc123"', b'"chatcmpl-abc1234"', False),
    "an escaped quote in the id": (b'"chatcmpl-abc123"', b'"chatcm\\"l"', True),
    "no usage": (
        b',"usage":{"prompt_tokens":12,"total_tokens":15,"completion_tokens":3}',
        b"",
        False,
    ),
    "another prompt, a longer total": (
        b'"prompt_tokens":12,"total_tokens":15',
        b'"prompt_tokens":9,"total_tokens":1012',
        False,
    ),
    "no kv_transfer_params": (b',"kv_transfer_params":null}', b"}", False),
    "completion_tokens_details": (
        b'"completion_tokens":3}',
        b'"completion_tokens":3,"completion_tokens_details":null}',
        False,
    ),
    "a finish reason": (
        b'"finish_reason":null',
        b'"finish_reason":"length","stop_reason":null',
        True,
    ),
    "a fingerprint": (b',"kv_transfer', b',"system_fingerprint":"f","kv_transfer', True),
    "a completion count of 16 digits": (
        b'"completion_tokens":3}',
        b'"completion_tokens":1000000000000003}',
        True,
    ),
    "a completion count that runs into the rest": (
        b'"completion_tokens":3}',
        b'"completion_tokens":3 }',
        True,
    ),
    "a completions text in a chat stream": (
        b'"delta":{"content":"Hello"},',
        b'"text":"Hello",',
        True,
    ),
}


@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("name", list(UNLIKE))
def test_a_token_chunk_unlike_the_streams_others(name: str, plan_name: str) -> None:
    """Token chunks alike, one unlike them, then the first kind again, then the end: the bytes,
    counts, events and names are the Python path's, and every read the lane can take is taken
    (the unlike one too, unless it is no common token chunk)."""
    old, new, by_python = UNLIKE[name]
    other = chunk(headed(event(CHAT_HELLO, 3), old, new))
    reads = [CHAT_FIRST, chunk(event(CHAT_HELLO, 2)), other, chunk(event(CHAT_HELLO, 4)), CHAT_END]
    on, off, lane_reads = read_both(PLANS[plan_name], reads)
    assert on == off
    assert on["names"] == ("M", "chatcmpl-abc123")
    assert lane_reads == len(reads) - by_python


def test_two_events_in_one_http_chunk_are_walked() -> None:
    """An HTTP chunk whose payload is two token events: their first ends as the stream's token
    chunks end, and bytes follow; the lane leaves it to the Python path, which counts two."""
    two = chunk(event(CHAT_HELLO, 3) + event(CHAT_HELLO, 4))
    reads = [CHAT_FIRST, chunk(event(CHAT_HELLO, 2)), two, chunk(event(CHAT_HELLO, 5)), CHAT_END]
    for plan in PLANS.values():
        on, off, lane_reads = read_both(plan, reads)
        assert on == off
        assert lane_reads == len(reads) - 1


def test_a_chunk_that_begins_with_the_kept_head_and_then_breaks_is_left_alone() -> None:
    client = Client()
    lane = new_lane(client)
    lane.arm(100, 0)
    assert lane.relay(chunk(event(CHAT_HELLO, 1)), ORIGIN)  # its head kept
    head = event(CHAT_HELLO, 2)[: event(CHAT_HELLO, 2).index(b"[") + 1]
    for broken in [
        head + b"\n\n",  # shorter than a chunk, as long as the head and a little
        head,  # the head alone, no end
        head[:-1],  # shorter than the head
        head + b'{"index":0,"delta":{"content":"\x01"},"logprobs":null}\n\n',
    ]:
        assert not lane.relay(chunk(broken), ORIGIN + 5), broken
    assert lane.relay(chunk(event(CHAT_HELLO, 2)), ORIGIN + 9)  # the head still kept, taken
    assert len(client.writes) == 2
    taken = lane.take()
    assert taken is not None and taken[3:5] == (2, 2)


def test_an_empty_text_with_a_finish_reason_or_of_another_choice_is_left_alone() -> None:
    for read, flags in [
        (chunk(event(CHAT_EMPTY.replace('"finish_reason":null', '"finish_reason":"stop"'), 2)), 0),
        (chunk(event(CHAT_EMPTY.replace('"index":0', '"index":1'), 2)), 0),
        (chunk(event(CHAT_EMPTY.replace('"kv_transfer', '"system_fingerprint":"f","kv_t'))), 0),
    ]:
        client = Client()
        lane = new_lane(client)
        lane.arm(100, 1, flags)
        assert not lane.relay(read, ORIGIN) and client.writes == [] and lane.take() is None


def test_an_empty_texts_tokens_are_carried_and_handed_over() -> None:
    client = Client()
    lane = new_lane(client)
    lane.arm(100, 1)
    assert lane.relay(chunk(event(CHAT_EMPTY, 3)), ORIGIN + 10)
    assert client.writes == [chunk(usage_cut(event(CHAT_EMPTY, 3)))]
    assert lane.take() == (b"", b"", None, 0, 3, True, (12, 15, 3), 1, 2)
    lane.arm(100, 3)
    assert lane.relay(chunk(event(CHAT_EMPTY, 4)) + chunk(event(CHAT_HELLO, 6)), ORIGIN + 20)
    taken = lane.take()
    assert taken is not None and taken[2:] == (
        array("q", [3]).tobytes(),  # the empty text's token and its own two
        3,
        6,
        True,
        (12, 18, 6),
        1,
        0,
    )


# An end at the model's end-of-sequence token: the finish chunk's text is empty (an event
# without a token; its token carried, as an empty text's).
EOS_FINISH = event(FINISH.replace('"content":"!"', '"content":""'), 6)
EOS_PARTS = [event(CHAT_HELLO, 5), EOS_FINISH, usage_event(), DONE]


@pytest.mark.parametrize("splits", SPLITS, ids=str)
@pytest.mark.parametrize("plan_name", list(PLANS))
def test_an_end_whose_finish_chunk_has_no_text_is_taken_as_the_python_path_takes_it(
    plan_name: str, splits: tuple[int, ...]
) -> None:
    """The finish chunk of an end at end-of-sequence has no text: the lane takes it as an
    event without a token, wherever the end is split (held for the fingerprint when the
    client did not ask for usage, and counted when it leaves); the same bytes, counts and
    events as the Python path."""
    reads = end_reads(splits, EOS_PARTS)
    on, off, lane_reads = read_both(PLANS[plan_name], reads)
    assert on == off
    assert on["saw_done"] and on["finish_reason"] == "stop" and len(on["offsets"]) == 2
    assert lane_reads == len(reads)


# Reads after a part of the end that the lane leaves to the Python path, which then takes the
# rest of the stream from what `take_end` handed over.
INTERRUPTIONS: dict[str, Any] = {
    "a keep-alive comment": lambda rest: [chunk(b": keep-alive\n\n"), rest],
    "a read that splits a chunk": lambda rest: [rest[: len(rest) // 2], rest[len(rest) // 2 :]],
    "the body's end before the rest (a stream cut short)": lambda rest: [LAST_CHUNK],
    "nothing more (the connection broke)": lambda rest: [],
    "a usage chunk without a fingerprint when one is known": lambda rest: [
        rest.replace(b',"system_fingerprint":"vllm-0.33.0-1a2b3c4d"', b"")
    ],
}


@pytest.mark.parametrize("finish", ["a token", "no text (end-of-sequence)"])
@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize(
    ("interruption", "stage"),
    [
        (interruption, stage)
        for interruption in INTERRUPTIONS
        for stage in (1, 2, 3)
        # (only a read after the finish chunk alone brings the usage chunk)
        if stage == 1 or "when one is known" not in interruption
    ],
)
def test_the_python_path_takes_over_an_end_the_lane_began(
    interruption: str, stage: int, plan_name: str, finish: str
) -> None:
    """After the finish, usage or [DONE] chunk the lane took, a read it does not take: the
    Python path goes on from what the lane handed over (`take_end`: the held finish chunk,
    the usage chunk's fingerprint, [DONE] seen), and the stream ends as it would have without
    the lane: same bytes, counts, failure."""
    # The end read part by part up to the stage (a held finish chunk released on the way).
    reads = end_reads(tuple(range(1, stage + 1)), END_PARTS if finish == "a token" else EOS_PARTS)
    reads += INTERRUPTIONS[interruption](reads.pop())
    known = "fp-known" if "when one is known" in interruption else None
    on, off, lane_reads = read_both(PLANS[plan_name], reads, fingerprint=known)
    assert on == off
    assert lane_reads >= 2  # the first read and the end's first part at least


CREATED = re.compile(rb'"created": ?\d+')
BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": (
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "Tell me a story"}]},
    ),
    "completions": ("/v1/completions", {"model": "m", "prompt": "Once upon a time"}),
}
OPTIONS: list[dict[str, Any] | None] = [
    None,
    {"include_usage": True},
    {"include_usage": True, "continuous_usage_stats": True},
]


def record_view(record: RequestRecord) -> dict[str, Any]:
    """What a record says, less its instants (two runs never share them) and its id."""
    assert record.server is not None
    return {
        "outcome": record.outcome,
        "n_in": record.n_in,
        "n_out": record.n_out,
        "token_source": record.token_source,
        "finish_reason": record.finish_reason,
        "server_tokens": list(record.server.tokens),
        "client_tokens": list(record.client.tokens),
        "server_events": record.server.events_total,
        "client_events": record.client.events_total,
    }


@dataclass
class LaneCensus:
    """Stands for `stream_relay.LaneType` (`watch_lanes`): makes each stream's lane, a real
    one, with a relay in front of the stream's that counts the lane's calls to it, and keeps
    the lanes, whose own counters say what they took."""

    lanes: list[Lane] = field(default_factory=list)
    firsts: int = 0  # the streams' first reads the lanes took (`first_in_lane`)
    ends: int = 0  # the stream ends they took (`end_in_lane`)

    def __call__(self, client: Any, relay: Any, *args: Any) -> Lane:
        lane = Lane(client, CountingRelay(relay, self), *args)
        self.lanes.append(lane)
        return lane

    @property
    def events(self) -> int:
        """The events the lanes handed over (`take`)."""
        return sum(lane.events_handed for lane in self.lanes)

    @property
    def reads(self) -> int:
        """The reads the lanes took whole."""
        return sum(lane.reads_taken for lane in self.lanes)


class CountingRelay:
    """A stream's relay (`stream_relay.MeteredRead`) as its lane sees it: the three methods
    the lane calls, counted in ``census`` and passed on."""

    def __init__(self, relay: Any, census: LaneCensus) -> None:
        self.relay = relay
        self.census = census

    def first_in_lane(self, *args: Any) -> None:
        self.census.firsts += 1
        self.relay.first_in_lane(*args)

    def end_in_lane(self, *args: Any) -> None:
        self.census.ends += 1
        self.relay.end_in_lane(*args)

    def on_client_full(self) -> None:
        self.relay.on_client_full()


def watch_lanes(monkeypatch: pytest.MonkeyPatch) -> LaneCensus:
    """From now on, the proxy's streams get their lanes from a `LaneCensus`, returned."""
    census = LaneCensus()
    monkeypatch.setattr(stream_relay, "LaneType", census)
    return census


async def run_requests(
    lane_on: bool,
    monkeypatch: pytest.MonkeyPatch,
    sim: SimConfig | None = None,
    fault: str | None = None,
    proxy_settings: dict[str, Any] | None = None,
) -> tuple[list[bytes], list[dict[str, Any]], LaneCensus]:
    """Six streams through the proxy (chat and completions, three usage options), with the
    lane on or off: their bodies, records and what the lanes did (none with it off)."""
    census = watch_lanes(monkeypatch)
    if not lane_on:
        monkeypatch.setattr(stream_relay, "LaneType", None)
    bodies: list[bytes] = []
    async with stack(sim=sim, **(proxy_settings or {})) as s, aiohttp.ClientSession() as session:
        n = 0
        for endpoint, (path, base) in BODIES.items():
            for options in OPTIONS:
                body = {**base, "stream": True, "max_tokens": 24, "ignore_eos": True}
                if options is not None:
                    body["stream_options"] = options
                headers = {"X-Request-Id": f"{endpoint}-{n}"}
                if fault is not None:
                    headers["X-Sim-Fault"] = fault
                async with session.post(s.url + path, json=body, headers=headers) as response:
                    assert response.status == 200
                    bodies.append(CREATED.sub(b'"created":0', await response.read()))
                n += 1
        records = await s.records.wait_for(n)
    return bodies, [record_view(r) for r in sorted(records, key=lambda r: r.request_id)], census


async def test_the_proxy_relays_and_counts_the_same_with_the_lane_on_and_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bodies_on, records_on, on = await run_requests(True, monkeypatch)
    bodies_off, records_off, _ = await run_requests(False, monkeypatch)
    assert bodies_on == bodies_off
    assert records_on == records_off
    assert all(r["n_out"] == 24 and len(r["server_tokens"]) == 24 for r in records_on)
    # Six streams of 24 token events in 24 reads, each taken by the lane: the first (chat's
    # role chunk and the first token; the simulator's head leaves before its prefill, alone),
    # the token chunks, and the end (finish, usage and [DONE] chunks, the body's last chunk:
    # the simulator runs on the proxy's loop and writes a stream's end in one turn, which the
    # proxy then reads as one read).
    # (A read that split a chunk, which loopback does not do to these, would be the Python
    # path's: one in each stream is allowed for.)
    assert (on.ends, on.firsts) == (6, 6) and on.events >= 6 * 23 and on.reads >= 6 * 23, on


async def test_the_lane_takes_an_end_that_comes_over_several_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The simulator writes each stream's end in four turns (`split_end_ms`), as a real vLLM's
    often reaches the proxy: the lane takes all four reads (the Python path reads none of
    them), and the bodies and records are those of the Python path."""
    bodies_on, records_on, on = await run_requests(True, monkeypatch, fault="split_end_ms=5")
    bodies_off, records_off, _ = await run_requests(False, monkeypatch, fault="split_end_ms=5")
    assert bodies_on == bodies_off
    assert records_on == records_off
    assert all(r["n_out"] == 24 and r["outcome"] is Outcome.OK for r in records_on)
    # Each stream's end came in four reads (27 reads a stream, where an end in one read makes
    # 24: the test above), and the lane took them all (but, as above, one read a stream that
    # split a chunk, which would be the Python path's).
    assert (on.ends, on.firsts) == (6, 6) and on.reads >= 6 * 26, on


async def test_a_stream_that_times_out_in_the_middle_of_its_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The simulator pauses 400 ms after each part of a stream's end; the idle timeout is
    150 ms: every stream times out after its finish chunk, which the lane took (and held, for a
    client that did not ask for usage). The Python path ends it from what the lane handed over:
    the same bodies (the held finish chunk and the error event) and records as without the
    lane."""
    fault, settings = "split_end_ms=400", {"idle_timeout": "150ms"}
    bodies_on, records_on, on = await run_requests(True, monkeypatch, None, fault, settings)
    bodies_off, records_off, _ = await run_requests(False, monkeypatch, None, fault, settings)
    assert bodies_on == bodies_off
    assert records_on == records_off
    assert all(r["outcome"] is Outcome.TIMEOUT and r["n_out"] == 24 for r in records_on)
    assert all(r["finish_reason"] == "length" for r in records_on)
    assert on.ends == 0 and on.events >= 6 * 23, on  # no end was the lane's


async def test_an_upstream_connection_whose_stream_the_lane_ended_is_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """llhttp never sees the body's last chunk when the lane takes it: the exchange is still
    complete, and the connection goes back to the pool as keep-alive (one connection for
    five streams in a row), the client's too."""
    census = watch_lanes(monkeypatch)
    path, base = BODIES["chat"]
    body = {**base, "stream": True, "max_tokens": 8, "ignore_eos": True}
    async with stack() as s, aiohttp.ClientSession() as session:
        for _ in range(5):
            async with session.post(s.url + path, json=body) as response:
                assert (await response.read()).endswith(b"data: [DONE]\n\n")
        records = await s.records.wait_for(5)
        assert s.server.proxy.pool.open_connections == 1
    assert census.ends == 5, census
    assert all(r.outcome is Outcome.OK and r.n_out == 8 for r in records)


SPECULATIVE = SimConfig(
    model="m",
    engine=EngineConfig(step_floor_s=0.002, per_token_s=0.0, num_speculative_tokens=3),
)


async def test_speculative_decoding_streams_go_through_the_lane_and_count_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Events of several tokens (drafts accepted): the lane keeps each event's count, and the
    records and bytes are those of the Python path."""
    bodies_on, records_on, on = await run_requests(True, monkeypatch, SPECULATIVE)
    bodies_off, records_off, _ = await run_requests(False, monkeypatch, SPECULATIVE)
    assert bodies_on == bodies_off
    assert records_on == records_off
    # The usage-carrying streams (the proxy asks for it on all of them) count exactly 24.
    assert all(r["n_out"] == 24 == sum(r["server_tokens"]) for r in records_on)
    assert any(n > 1 for r in records_on for n in r["server_tokens"])  # drafts were accepted
    events = sum(len(r["server_tokens"]) for r in records_on)
    # Every read, the first and the end too (bar one read a stream, as above).
    assert (on.ends, on.firsts) == (6, 6) and on.events >= events - 6, (on, events)


async def test_records_hold_their_stamps_in_order_whichever_path_took_each_read() -> None:
    async with stack() as s, aiohttp.ClientSession() as session:
        path, base = BODIES["chat"]
        body = {**base, "stream": True, "max_tokens": 40, "ignore_eos": True}
        async with session.post(s.url + path, json=body) as response:
            text = await response.text()
        (record,) = await s.records.wait_for(1)
    assert text.count("data: ") == 1 + 40 + 1  # role, tokens (the last one finishes), [DONE]
    assert record.server is not None
    server, client = list(record.server.offsets_ns), list(record.client.offsets_ns)
    for instants in (server, client):
        assert len(instants) == 40 and instants == sorted(instants)
    # Both columns are offsets from the request's arrival: each token left after it came.
    assert all(down >= up for down, up in zip(client, server, strict=True))
    assert json.loads(text.split("data: ")[1])["choices"][0]["delta"]["role"] == "assistant"


PACED = SimConfig(model="m", engine=EngineConfig(step_floor_s=0.02, per_token_s=0.0))


async def test_the_idle_timeout_counts_the_reads_the_lane_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream whose reads the lane takes, ~0.5 s long at a read every 20 ms, lives through
    a 150 ms idle timeout (the timer reads the lane's last read when it wakes); a stream that
    stalls after such reads is still cut by it."""
    census = watch_lanes(monkeypatch)
    path, base = BODIES["chat"]
    body = {**base, "stream": True, "max_tokens": 24, "ignore_eos": True}
    async with (
        stack(sim=PACED, idle_timeout="150ms") as s,
        aiohttp.ClientSession() as session,
    ):
        async with session.post(s.url + path, json=body) as response:
            assert response.status == 200
            assert (await response.read()).endswith(b"data: [DONE]\n\n")
        stalled = {"X-Sim-Fault": "stall_ms=1000@after=10", "X-Request-Id": "stalled"}
        async with session.post(s.url + path, json=body, headers=stalled) as response:
            await response.read()
        records = await s.records.wait_for(2)
    ok, cut = sorted(records, key=lambda r: r.request_id == "stalled")
    assert ok.outcome is Outcome.OK and ok.n_out == 24
    assert cut.outcome is Outcome.TIMEOUT and cut.error_type == "idle_timeout"
    assert census.events >= 20 + 5, census  # most of both streams' reads went through the lane


async def test_the_ttft_deadline_is_met_by_a_first_token_the_lane_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream whose first read the lane takes (`first_in_lane` clears the TTFT deadline)
    outlives a 150 ms TTFT timeout by far (~0.5 s at a read every 20 ms); a stream whose first
    token is late is still cut by it, the lane armed and waiting."""
    census = watch_lanes(monkeypatch)
    path, base = BODIES["chat"]
    body = {**base, "stream": True, "max_tokens": 24, "ignore_eos": True}
    async with (
        stack(sim=PACED, ttft_timeout="150ms") as s,
        aiohttp.ClientSession() as session,
    ):
        async with session.post(s.url + path, json=body) as response:
            assert response.status == 200
            assert (await response.read()).endswith(b"data: [DONE]\n\n")
        late = {"X-Sim-Fault": "stall_ms=1000", "X-Request-Id": "late"}
        async with session.post(s.url + path, json=body, headers=late) as response:
            await response.read()
        records = await s.records.wait_for(2)
    ok, cut = sorted(records, key=lambda r: r.request_id == "late")
    assert ok.outcome is Outcome.OK and ok.n_out == 24
    assert cut.outcome is Outcome.TIMEOUT and cut.error_type == "ttft_timeout"
    assert cut.server is not None and len(cut.server.offsets_ns) == 0
    # The first stream's first read and end were the lane's.
    assert (census.ends, census.firsts) == (1, 1), census
