"""The simulator's tool calls, over real sockets, in the shapes vLLM 0.32.0 answers them with a
tool parser (checked against the real server: tests/conformance/test_relay.py, the chat-tool-*
cases; source lines cited in sidecar/sim/tools.py), its refusals without one, and the proxy
measuring tool-call streams.

The real server's answers these tests were written from (tiny model, `sidecar vllm up
--tool-calls`, tool `weather` with parameters city: enum ["Paris", "Oslo"], celsius: boolean):
named streamed ``{"tool_calls":[{"id":"chatcmpl-tool-<16 hex>","type":"function","index":0,
"function":{"name":"weather","arguments":"{"}}]}``, then ``{"tool_calls":[{"index":0,
"function":{"arguments":"\\""}}]}``..., the EOS token's ``"arguments":""`` with
finish_reason "stop"; required streamed the same first entry, later ones with
``"name":null``, a finish chunk with ``"delta":{}`` and "tool_calls"; whole answers
``"content":""`` and ``tool_calls`` after ``function_call``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from proxy_stack import FAST_ENGINE, stack
from wire import NAMED, TOOLS, events, post

from sidecar.protocol.openai import ChunkKind, classify_chunk
from sidecar.record import Outcome, TokenSource
from sidecar.sim import tokenizer
from sidecar.sim.cli import add_arguments, config_from_args
from sidecar.sim.faults import FAULT_HEADER
from sidecar.sim.server import RunningReplica, SimConfig, close_replicas, start_replicas
from sidecar.sim.tools import ToolCallOutput, read_tool_request, synthetic_value

CHAT = "/v1/chat/completions"
ARGUMENTS = '{"city":"Paris","celsius":true}'  # what the real tiny model wrote, greedily
TOOL_SIM = SimConfig(
    model="tiny",
    vllm_version="0.32.0",
    engine=FAST_ENGINE,
    tool_call_parser="pythonic",
    enable_auto_tool_choice=True,
)


@pytest.fixture
async def sim() -> AsyncIterator[RunningReplica]:
    (replica,) = await start_replicas(TOOL_SIM, 1)
    try:
        yield replica
    finally:
        await close_replicas([replica])


def chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 60,
        "temperature": 0,
        "tools": TOOLS,
        **extra,
    }


def error(message: str, param: str | None = None) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}},
        separators=(",", ":"),
    ).encode()


# ---------------------------------------------------------------- the synthetic arguments


def test_synthetic_arguments_fit_the_schema_and_never_change() -> None:
    schema = {
        "type": "object",
        "required": ["n", "unit"],
        "properties": {
            "n": {"type": "integer", "minimum": 3, "maximum": 9},
            "x": {"type": "number", "exclusiveMinimum": 0},
            "unit": {"enum": ["c", "f"]},
            "on": {"type": "boolean"},
            "tag": {"const": "v1"},
            "name": {"type": "string", "maxLength": 3},
            "long": {"type": "string", "minLength": 10},
            "list": {"type": "array", "items": {"type": "integer"}, "minItems": 2},
            "either": {"anyOf": [{"type": "null"}, {"type": "string"}]},
            "maybe": {"type": ["null", "integer"]},
            "inner": {"type": "object", "properties": {"deep": {"type": "boolean"}}},
        },
    }
    value = synthetic_value(schema)
    assert value == synthetic_value(schema)
    assert list(value) == [
        "n",
        "x",
        "unit",
        "on",
        "tag",
        "name",
        "long",
        "list",
        "either",
        "maybe",
        "inner",
    ]  # declaration order, required ones included
    assert value["n"] == 3 and value["x"] > 0 and value["unit"] == "c" and value["on"] is True
    assert value["tag"] == "v1" and len(value["name"]) <= 3 and len(value["long"]) >= 10
    assert value["list"] == [1, 1] and value["either"] is None and value["maybe"] == 1
    assert value["inner"] == {"deep": True}
    # A tool without parameters: vLLM constrains to an empty object (_params_or_empty_object).
    request = read_tool_request(
        {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        }
    )
    assert request is not None and ToolCallOutput(request).output == "{}"


def test_the_call_is_the_compact_json_cut_into_tokenizer_pieces() -> None:
    named = read_tool_request({"tools": TOOLS, "tool_choice": NAMED})
    required = read_tool_request({"tools": TOOLS, "tool_choice": "required"})
    assert named is not None and required is not None
    call = ToolCallOutput(named)
    assert call.output == ARGUMENTS
    assert "".join(call.pieces) == ARGUMENTS == "".join(tokenizer.split_pieces(ARGUMENTS))
    assert call.natural_length == len(call.pieces) + 1  # then EOS
    assert ToolCallOutput(required).output == f'[{{"name":"weather","parameters":{ARGUMENTS}}}]'


# ---------------------------------------------------------------- named and required, streamed


async def test_a_named_call_streams_in_vllms_shape(sim: RunningReplica) -> None:
    status, raw = await post(
        sim.url + CHAT, chat(tool_choice=NAMED, stream=True, stream_options={"include_usage": True})
    )
    assert status == 200
    chunks = events(raw)
    assert chunks[-1] == "[DONE]"
    role, first, *rest, finish, usage, _done = chunks
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    (entry,) = first["choices"][0]["delta"]["tool_calls"]
    assert list(entry) == ["id", "type", "index", "function"]
    assert entry["id"].startswith("chatcmpl-tool-") and len(entry["id"]) == 14 + 16
    assert (entry["type"], entry["index"], entry["function"]["name"]) == ("function", 0, "weather")
    arguments = entry["function"]["arguments"]
    for chunk in rest:
        choice = chunk["choices"][0]
        assert choice["finish_reason"] is None
        assert choice["delta"] == {
            "tool_calls": [
                {
                    "index": 0,
                    "function": {
                        "arguments": choice["delta"]["tool_calls"][0]["function"]["arguments"]
                    },
                }
            ]
        }
        arguments += choice["delta"]["tool_calls"][0]["function"]["arguments"]
    assert arguments == ARGUMENTS
    # The EOS token's delta: empty arguments, and a named call finishes "stop".
    assert finish["choices"][0]["delta"] == {
        "tool_calls": [{"index": 0, "function": {"arguments": ""}}]
    }
    assert finish["choices"][0]["finish_reason"] == "stop"
    pieces = len(tokenizer.split_pieces(ARGUMENTS))
    assert len(rest) == pieces - 1
    assert usage["usage"]["completion_tokens"] == pieces + 1


async def test_a_required_call_streams_only_its_parameters(sim: RunningReplica) -> None:
    status, raw = await post(
        sim.url + CHAT,
        chat(
            tool_choice="required",
            parallel_tool_calls=False,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        ),
    )
    assert status == 200
    role, first, *rest, finish, usage, _done = events(raw)
    assert role["usage"]["completion_tokens"] == 0
    (entry,) = first["choices"][0]["delta"]["tool_calls"]
    assert list(entry) == ["id", "type", "index", "function"]
    assert entry["function"]["name"] == "weather"
    # Announced with the token that begins the parameters: the name and the array's head
    # were generated before it, without events (extract_required_tool_call_streaming).
    assert first["usage"]["completion_tokens"] > 1
    arguments = entry["function"]["arguments"]
    assert ARGUMENTS.startswith(arguments)
    for chunk in rest:
        (later,) = chunk["choices"][0]["delta"]["tool_calls"]
        assert later["function"]["name"] is None and list(later) == ["index", "function"]
        arguments += later["function"]["arguments"]
    assert arguments == ARGUMENTS  # the parameters' text only, never the array's "}]"
    assert finish["choices"][0]["delta"] == {}
    assert finish["choices"][0]["finish_reason"] == "tool_calls"
    output = f'[{{"name":"weather","parameters":{ARGUMENTS}}}]'
    completion = len(tokenizer.split_pieces(output)) + 1
    assert finish["usage"]["completion_tokens"] == usage["usage"]["completion_tokens"] == completion


async def test_a_truncated_required_call_sends_nothing_but_its_finish(sim: RunningReplica) -> None:
    status, raw = await post(
        sim.url + CHAT, chat(tool_choice="required", max_tokens=3, stream=True)
    )
    assert status == 200
    role, finish, done = events(raw)
    assert finish["choices"][0]["delta"] == {} and finish["choices"][0]["finish_reason"] == "length"
    assert done == "[DONE]"


# ---------------------------------------------------------------- whole answers


async def test_whole_answers_carry_the_calls_in_the_message(sim: RunningReplica) -> None:
    status, raw = await post(sim.url + CHAT, chat(tool_choice=NAMED))
    assert status == 200
    body = json.loads(raw)
    (choice,) = body["choices"]
    message = choice["message"]
    assert list(message) == [
        "role",
        "content",
        "refusal",
        "annotations",
        "audio",
        "function_call",
        "tool_calls",
        "reasoning",
    ]
    assert message["content"] == ""
    (call,) = message["tool_calls"]
    assert list(call) == ["id", "type", "function"] and call["type"] == "function"
    assert call["function"] == {"name": "weather", "arguments": ARGUMENTS}
    assert choice["finish_reason"] == "stop"

    _, raw = await post(sim.url + CHAT, chat(tool_choice="required", parallel_tool_calls=False))
    choice = json.loads(raw)["choices"][0]
    # Parsed and re-serialised with json.dumps: spaces after ',' and ':' (as the real server).
    assert (
        choice["message"]["tool_calls"][0]["function"]["arguments"]
        == '{"city": "Paris", "celsius": true}'
    )
    assert choice["finish_reason"] == "tool_calls"

    # Cut short: a named call keeps what was generated, a required array that does not parse
    # has no calls (and no tool_calls key).
    _, raw = await post(sim.url + CHAT, chat(tool_choice=NAMED, max_tokens=3))
    choice = json.loads(raw)["choices"][0]
    assert choice["finish_reason"] == "length"
    assert ARGUMENTS.startswith(choice["message"]["tool_calls"][0]["function"]["arguments"])
    _, raw = await post(sim.url + CHAT, chat(tool_choice="required", max_tokens=3))
    choice = json.loads(raw)["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == ""


async def test_auto_and_none_answer_in_text(sim: RunningReplica) -> None:
    for extra in ({}, {"tool_choice": "auto"}, {"tool_choice": "none"}):
        status, raw = await post(sim.url + CHAT, chat(max_tokens=4, ignore_eos=True, **extra))
        assert status == 200
        message = json.loads(raw)["choices"][0]["message"]
        assert message["content"] and "tool_calls" not in message


async def test_ignore_eos_runs_on_past_the_call_into_its_arguments(sim: RunningReplica) -> None:
    """vLLM with ignore_eos goes on generating after the grammar's end, and the named parser
    streams all of it as arguments (seen on the real server: `...true} RE RE`)."""
    _, raw = await post(sim.url + CHAT, chat(tool_choice=NAMED, max_tokens=20, ignore_eos=True))
    choice = json.loads(raw)["choices"][0]
    arguments = choice["message"]["tool_calls"][0]["function"]["arguments"]
    assert arguments.startswith(ARGUMENTS) and len(arguments) > len(ARGUMENTS)
    assert choice["finish_reason"] == "length"


async def test_with_a_parser_empty_text_gets_no_delta(sim: RunningReplica) -> None:
    """A server with a tool parser passes every chat delta through it, and under tool_choice
    "none" (a request without tools too) an empty text makes no delta: the EOS token's finish
    chunk has ``"delta":{}`` where a server without a parser sends ``{"content":""}`` (seen on
    the real server: the chat-stop-first-token-stream case)."""
    plain = SimConfig(model="tiny", vllm_version="0.32.0", engine=FAST_ENGINE)
    (without,) = await start_replicas(plain, 1)
    try:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Hi."}],
            "max_tokens": 500,
            "temperature": 0,
            "stream": True,
        }
        finishes = []
        for replica in (sim, without):
            _, raw = await post(replica.url + CHAT, body)
            *_, finish, _done = events(raw)
            finishes.append(finish["choices"][0])
    finally:
        await close_replicas([without])
    ours, theirs = finishes
    assert ours["finish_reason"] == theirs["finish_reason"] == "stop"  # at EOS
    assert (ours["delta"], theirs["delta"]) == ({}, {"content": ""})


async def test_the_tool_parser_metric_counts_auto_answers(sim: RunningReplica) -> None:
    await post(sim.url + CHAT, chat(max_tokens=3, ignore_eos=True, stream=True))
    await post(sim.url + CHAT, chat(max_tokens=3, ignore_eos=True, n=2, temperature=1))
    await post(sim.url + CHAT, chat(tool_choice=NAMED))  # forced: not the parser's to read
    async with aiohttp.ClientSession() as session, session.get(sim.url + "/metrics") as response:
        text = await response.text()
    (family,) = [
        f
        for f in text_string_to_metric_families(text)
        if f.name == "vllm:tool_call_parser_invocations"
    ]
    totals = {
        (sample.labels["mode"], sample.labels["outcome"]): sample.value
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels["request_type"] == "chat_completions"
    }
    assert len([s for s in family.samples if s.name.endswith("_total")]) == 12  # from start
    assert totals[("streaming", "no_tool_call")] == 3  # one per delta
    assert totals[("non_streaming", "no_tool_call")] == 2  # one per choice
    assert sum(s.value for s in family.samples if s.name.endswith("_total")) == 5


# ---------------------------------------------------------------- refusals and validation


@pytest.mark.parametrize("flags", [{}, {"tool_call_parser": "pythonic"}])
@pytest.mark.parametrize(
    "extra,message",
    [
        (
            {},
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
            "set",
        ),
        (
            {"tool_choice": "required"},
            'tool_choice="required" requires --tool-call-parser to be set',
        ),
        (
            {"tool_choice": NAMED, "stream": True},
            'tool_choice=function "weather" requires --tool-call-parser to be set',
        ),
    ],
)
async def test_without_auto_tool_choice_tool_use_is_refused_as_by_vllm(
    flags: dict[str, Any], extra: dict[str, Any], message: str
) -> None:
    """vLLM has no tool parser unless started with both flags (ParserManager.get_tool_parser:
    vllm/parser/parser_manager.py 36-37), and its renderer then refuses every tool_choice but
    "none" (vllm/renderers/online_renderer.py 258-280), with these words."""
    config = SimConfig(model="tiny", vllm_version="0.32.0", engine=FAST_ENGINE, **flags)
    (replica,) = await start_replicas(config, 1)
    try:
        status, raw = await post(replica.url + CHAT, chat(**extra))
        assert (status, raw) == (400, error(message))
        status, _ = await post(replica.url + CHAT, chat(tool_choice="none"))
        assert status == 200
    finally:
        await close_replicas([replica])


def test_auto_tool_choice_needs_a_parser_as_vllms_flags_do() -> None:
    import argparse

    with pytest.raises(ValueError, match="--enable-auto-tool-choice requires --tool-call-parser"):
        SimConfig(enable_auto_tool_choice=True)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(
        parser.parse_args(["--tool-call-parser", "hermes", "--enable-auto-tool-choice"])
    )
    assert config.serves_tools and config.tool_call_parser == "hermes"
    assert not config_from_args(parser.parse_args(["--tool-call-parser", "x"])).serves_tools


USAGE = (
    'Correct usage: `{\\"type\\": \\"function\\", \\"function\\": {\\"name\\": \\"my_function\\"}}`'
)


@pytest.mark.parametrize(
    "extra,body",
    [
        # The real server's bodies (check_tool_usage, chat_completion/protocol.py 937-1019).
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            b'{"error":{"message":"The tool specified in `tool_choice` does not match any of the '
            b'specified `tools` (parameter=tool_choice)","type":"BadRequestError","param":'
            b'"tool_choice","code":400}}',
        ),
        (
            {"tools": [], "tool_choice": "auto"},
            b'{"error":{"message":"`tools` must not be an empty array. Either provide at least one '
            b'tool or omit the field entirely. (parameter=tools)","type":"BadRequestError","param":'
            b'"tools","code":400}}',
        ),
        (
            {"tool_choice": "sometimes"},
            b'{"error":{"message":"Invalid value for `tool_choice`: sometimes! Only named tools, '
            b'\\"none\\", \\"auto\\" or \\"required\\" are supported. (parameter=tool_choice)",'
            b'"type":"BadRequestError","param":"tool_choice","code":400}}',
        ),
        (
            {"tools": None, "tool_choice": "required"},
            b'{"error":{"message":"When using `tool_choice`, `tools` must be set. '
            b'(parameter=tool_choice)","type":"BadRequestError","param":"tool_choice","code":400}}',
        ),
        (
            {"tool_choice": {"type": "function"}},
            b'{"error":{"message":"Invalid value for `function`: `None` in `tool_choice`! '
            + USAGE.encode()
            + b' (parameter=tool_choice.function)","type":"BadRequestError",'
            b'"param":"tool_choice.function","code":400}}',
        ),
        (
            {"tool_choice": {"type": "function", "function": {}}},
            b'{"error":{"message":"Expected field `name` in `function` in `tool_choice`! '
            + USAGE.encode()
            + b' (parameter=tool_choice.function.name)","type":"BadRequestError",'
            b'"param":"tool_choice.function.name","code":400}}',
        ),
    ],
)
async def test_tool_usage_is_validated_as_vllm_validates_it(
    sim: RunningReplica, extra: dict[str, Any], body: bytes
) -> None:
    request = chat(**extra)
    if request["tools"] is None:
        del request["tools"]
    assert await post(sim.url + CHAT, request) == (400, body)


# ---------------------------------------------------------------- the proxy measuring them


def test_the_proxy_counts_a_tool_call_delta_as_a_token_event() -> None:
    """protocol/openai.py classify_chunk: a delta whose tool_calls list is not empty carries
    output (a token event, TTFT and ITL taken from it); the required call's finish delta {}
    carries none; the EOS token's empty arguments still count as its token's event."""
    head = '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"tiny",'
    first = head + (
        '"choices":[{"index":0,"delta":{"tool_calls":[{"id":"chatcmpl-tool-1",'
        '"type":"function","index":0,"function":{"name":"weather","arguments":'
        '"{"}}]},"logprobs":null,"finish_reason":null,"token_ids":null}]}'
    )
    later = head + (
        '"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":'
        '{"name":null,"arguments":"x"}}]},"logprobs":null,"finish_reason":null,'
        '"token_ids":null}]}'
    )
    finish = head + (
        '"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":'
        '"tool_calls","stop_reason":null,"token_ids":null}]}'
    )
    assert classify_chunk(first).kind is ChunkKind.TOKEN
    assert classify_chunk(later).kind is ChunkKind.TOKEN
    info = classify_chunk(finish)
    assert info.kind is ChunkKind.EMPTY and info.finish_reason == "tool_calls"


@pytest.mark.parametrize("choice", [NAMED, "required"])
async def test_the_proxy_relays_and_counts_tool_call_streams(choice: Any, tmp_path: Path) -> None:
    """Through the proxy: the client gets the simulator's events (ids aside), the record
    counts the call's tokens from usage (those the required call sent no event for
    included), and the simulator's ground truth puts every token in some write."""
    truth = tmp_path / "truth.jsonl"
    config = SimConfig(
        model="tiny",
        vllm_version="0.32.0",
        engine=FAST_ENGINE,
        tool_call_parser="pythonic",
        enable_auto_tool_choice=True,
        ground_truth_path=str(truth),
    )
    body = chat(tool_choice=choice, stream=True)
    async with stack(sim=config) as proxied:
        status, raw = await post(proxied.url + CHAT, body)
        (record,) = await proxied.records.wait_for(1)
        _, direct = await post(proxied.direct + CHAT, body)
    assert status == 200
    assert _without_ids(events(raw)) == _without_ids(events(direct))
    assert record.outcome is Outcome.OK and record.token_source is TokenSource.USAGE
    lines = [json.loads(line) for line in truth.read_text().splitlines()]
    assert record.n_out == lines[0]["completion_tokens"] > len(events(raw)) - 3
    for line in lines:
        assert sum(line["chunk_tokens"]) == line["completion_tokens"]


async def test_merged_deltas_still_stream_the_whole_call() -> None:
    """A stalled writer lets the engine run ahead: several tokens' text goes out in one delta,
    and the required call's scan still sends exactly its parameters."""
    async with (
        stack(sim=TOOL_SIM) as proxied,
        aiohttp.ClientSession() as session,
        session.post(
            proxied.url + CHAT,
            json=chat(tool_choice="required", stream=True),
            headers={FAULT_HEADER: "stall_ms=100@after=1"},
        ) as response,
    ):
        raw = await response.read()
    chunks = [c for c in events(raw) if c != "[DONE]" and c["choices"]]
    arguments = "".join(
        call["function"]["arguments"]
        for c in chunks
        for call in c["choices"][0]["delta"].get("tool_calls", [])
    )
    assert arguments == ARGUMENTS
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_assemble_nonstream_keeps_the_tool_calls() -> None:
    async with stack(sim=TOOL_SIM, assemble_nonstream="true") as proxied:
        status, raw = await post(proxied.url + CHAT, chat(tool_choice=NAMED))
    assert status == 200
    message = json.loads(raw)["choices"][0]["message"]
    assert message.get("tool_calls", [{}])[0].get("function") == {
        "name": "weather",
        "arguments": ARGUMENTS,
    }


def _without_ids(chunks: list[Any]) -> list[Any]:
    """Events with their ids and clocks taken out (they differ per request)."""
    out: list[Any] = []
    for chunk in chunks:
        if isinstance(chunk, dict):
            chunk = {key: value for key, value in chunk.items() if key not in ("id", "created")}
            for choice in chunk.get("choices", []):
                for call in choice.get("delta", {}).get("tool_calls", []):
                    call.pop("id", None)
        out.append(chunk)
    return out
