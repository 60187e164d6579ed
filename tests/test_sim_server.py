"""The simulated replica over real sockets: vLLM 0.33's bytes, errors, endpoints, faults, truth.

Byte-exact checks compare against the literal examples of spec/vllm-protocol.md; the parts a
test cannot pin (the ``created`` clock, the fingerprint hash, the pseudo-words) are substituted
by the spec's values before comparing, everything else must match byte for byte.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.sim import tokenizer
from sidecar.sim.faults import FaultSpecError, parse_fault_spec
from sidecar.sim.metrics import (
    ITERATION_BUCKETS,
    ITL_BUCKETS,
    LATENCY_BUCKETS,
    N_BUCKETS,
    PREEMPTION_BUCKETS,
    TTFT_BUCKETS,
    one_two_five_buckets,
)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SPEC_FINGERPRINT = "vllm-0.33.0-1a2b3c4d"
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]

# spec/vllm-protocol.md A1, "Chat, n=1, no usage (default)".
SPEC_CHAT_STREAM = (
    'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1700000000,'
    '"model":"M","choices":[{"index":0,"delta":{"role":"assistant","content":""},'
    '"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}\n\n'
    'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1700000000,'
    '"model":"M","choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,'
    '"finish_reason":null,"token_ids":null}],"kv_transfer_params":null}\n\n'
    'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1700000000,'
    '"model":"M","choices":[{"index":0,"delta":{"content":"!"},"logprobs":null,'
    '"finish_reason":"stop","stop_reason":null,"token_ids":null,"weight_versions":null}],'
    '"system_fingerprint":"vllm-0.33.0-1a2b3c4d","kv_transfer_params":null}\n\n'
    "data: [DONE]\n\n"
)
# A1, the usage chunk of include_usage.
SPEC_CHAT_USAGE_CHUNK = (
    'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1700000000,'
    '"model":"M","choices":[],"usage":{"prompt_tokens":12,"total_tokens":15,'
    '"completion_tokens":3},"system_fingerprint":"vllm-0.33.0-1a2b3c4d"}\n\n'
)
# A1, "Completions".
SPEC_COMPLETION_CHUNK = (
    'data: {"id":"cmpl-abc123","object":"text_completion","created":1700000000,"model":"M",'
    '"choices":[{"index":0,"text":"Hello","logprobs":null,"finish_reason":null,'
    '"stop_reason":null,"prompt_token_ids":null,"token_ids":null,"weight_versions":null}],'
    '"kv_transfer_params":null}\n\n'
)
# A1, "Non-streaming responses".
SPEC_CHAT_RESPONSE = (
    '{"id":"chatcmpl-abc","object":"chat.completion","created":1700000000,"model":"M",'
    '"choices":[{"index":0,"message":{"role":"assistant","content":"Hello world!",'
    '"refusal":null,"annotations":null,"audio":null,"function_call":null,"reasoning":null},'
    '"logprobs":null,"finish_reason":"stop","stop_reason":null,"token_ids":null,'
    '"routed_experts":null,"weight_versions":null}],"service_tier":null,'
    '"system_fingerprint":"vllm-0.33.0-1a2b3c4d","usage":{"prompt_tokens":12,"total_tokens":15,'
    '"completion_tokens":3,"prompt_tokens_details":null,"completion_tokens_details":null},'
    '"prompt_logprobs":null,"prompt_token_ids":null,"prompt_text":null,'
    '"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}'
)

_CREATED_RE = re.compile(r'"created":\d+')
_FINGERPRINT_RE = re.compile(r"vllm-0\.33\.0-[0-9a-f]{8}")


def pin_clock_and_fingerprint(text: str) -> str:
    text = _CREATED_RE.sub('"created":1700000000', text)
    return _FINGERPRINT_RE.sub(SPEC_FINGERPRINT, text)


def sse_events(body: bytes) -> list[str]:
    """The events of a complete SSE body, without their blank-line terminators."""
    text = body.decode()
    assert text.endswith("\n\n"), text[-200:]
    return text[:-2].split("\n\n")


def data_payloads(body: bytes) -> list[Any]:
    """Decoded JSON of each data event ([DONE] kept as the string)."""
    out: list[Any] = []
    for event in sse_events(body):
        if event.startswith(":"):
            continue
        assert event.startswith("data: "), event
        payload = event[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


async def post(
    session: aiohttp.ClientSession,
    url: str,
    body: Any,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes, Any]:
    async with session.post(url, json=body, headers=headers) as response:
        return response.status, await response.read(), response.headers


@pytest.fixture
async def session() -> Any:
    async with aiohttp.ClientSession() as client:
        yield client


# ---------------------------------------------------------------- byte-exact stream shapes


def spec_chat_stream_ending_at_eos() -> str:
    """The spec's example as a model that stops by EOS streams it: "Hello", "!", then EOS.

    vLLM (chat_completion/serving.py, completion/serving.py) sends one chunk per engine output;
    the EOS token's output has token ids but no text (the detokenizer skips the stop token), so
    the finish rides on a last chunk of its own with empty content: the spec's terminal chunk
    with ``"content":""``, after "!" in the shape of a content chunk.
    """
    role, hello, finish, done = SPEC_CHAT_STREAM[:-2].split("\n\n")
    bang = hello.replace('"Hello"', '"!"')
    eos = finish.replace('"content":"!"', '"content":""')
    return "\n\n".join([role, hello, bang, eos, done]) + "\n\n"


async def test_chat_stream_is_the_spec_example_byte_for_byte(
    start_sim: Any, session: aiohttp.ClientSession
) -> None:
    # Two words and EOS: the spec's example, its finish on an empty EOS chunk (vLLM's shape).
    (replica,) = await start_sim(engine_natural_length_median=3.0, engine_natural_length_sigma=0.0)
    status, body, headers = await post(
        session,
        replica.url + CHAT,
        {"model": "M", "messages": HELLO, "stream": True},
        headers={"X-Request-Id": "abc123"},
    )
    assert status == 200
    assert headers["Content-Type"] == "text/event-stream; charset=utf-8"
    texts = [p["choices"][0]["delta"]["content"] for p in data_payloads(body)[1:-1]]
    assert all(texts[:2]) and texts[2] == "" and len(texts) == 3
    normalized = pin_clock_and_fingerprint(body.decode())
    for text, spec_text in zip(texts[:2], ["Hello", "!"], strict=True):
        normalized = normalized.replace(json.dumps(text), json.dumps(spec_text), 1)
    assert normalized == spec_chat_stream_ending_at_eos()


async def test_chat_stream_with_include_usage(
    start_sim: Any, session: aiohttp.ClientSession
) -> None:
    (replica,) = await start_sim(engine_natural_length_median=3.0, engine_natural_length_sigma=0.0)
    status, body, _ = await post(
        session,
        replica.url + CHAT,
        {"messages": HELLO, "stream": True, "stream_options": {"include_usage": True}},
        headers={"X-Request-Id": "abc123"},
    )
    assert status == 200
    events = sse_events(body)
    prompt_tokens = len(tokenizer.apply_chat_template([tokenizer.ChatMessage(**HELLO[0])]))
    # The terminal content chunk loses system_fingerprint; the usage chunk carries it.
    assert '"finish_reason":"stop"' in events[-3] and "system_fingerprint" not in events[-3]
    assert events[-3].endswith('"weight_versions":null}],"kv_transfer_params":null}')
    expected_usage = SPEC_CHAT_USAGE_CHUNK.replace(
        '"prompt_tokens":12,"total_tokens":15',
        f'"prompt_tokens":{prompt_tokens},"total_tokens":{prompt_tokens + 3}',
    )
    assert pin_clock_and_fingerprint(events[-2] + "\n\n") == expected_usage
    assert events[-1] == "data: [DONE]"


async def test_chat_continuous_usage_on_every_chunk(
    start_sim: Any, session: aiohttp.ClientSession
) -> None:
    (replica,) = await start_sim()
    _, body, _ = await post(
        session,
        replica.url + CHAT,
        {
            "messages": HELLO,
            "stream": True,
            "max_tokens": 4,
            "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
        headers={"X-Request-Id": "abc123"},
    )
    events = sse_events(body)
    payloads = data_payloads(body)
    prompt = payloads[0]["usage"]["prompt_tokens"]
    # Role chunk: cumulative usage with zero completion tokens, before prompt_token_ids.
    assert events[0].endswith(
        f'"finish_reason":null}}],"usage":{{"prompt_tokens":{prompt},"total_tokens":{prompt},'
        '"completion_tokens":0,"completion_tokens_details":null},"prompt_token_ids":null,'
        '"prompt_text":null}'
    )
    completions = [p["usage"]["completion_tokens"] for p in payloads[1:5]]
    assert completions == [1, 2, 3, 4]
    assert events[1].endswith(
        f'"usage":{{"prompt_tokens":{prompt},"total_tokens":{prompt + 1},"completion_tokens":1,'
        '"completion_tokens_details":null},"kv_transfer_params":null}'
    )
    assert payloads[5]["choices"] == [] and payloads[5]["usage"]["completion_tokens"] == 4
    assert payloads[6] == "[DONE]"


async def test_continuous_usage_is_ignored_without_include_usage(
    sim_url: str, session: aiohttp.ClientSession
) -> None:
    _, body, _ = await post(
        session,
        sim_url + CHAT,
        {"messages": HELLO, "stream": True, "stream_options": {"continuous_usage_stats": True}},
    )
    assert b'"usage"' not in body


async def test_completion_stream_shapes(start_sim: Any, session: aiohttp.ClientSession) -> None:
    (replica,) = await start_sim()
    _, body, _ = await post(
        session,
        replica.url + COMPLETIONS,
        {
            "model": "M",
            "prompt": "Once upon a time",
            "stream": True,
            "max_tokens": 3,
            "ignore_eos": True,
        },
        headers={"X-Request-Id": "abc123"},
    )
    events = sse_events(body)
    payloads = data_payloads(body)
    assert len(events) == 4  # no role chunk, three tokens, [DONE]
    first_text = payloads[0]["choices"][0]["text"]
    first = pin_clock_and_fingerprint(events[0] + "\n\n").replace(json.dumps(first_text), '"Hello"')
    assert first == SPEC_COMPLETION_CHUNK
    last = pin_clock_and_fingerprint(events[2])
    assert last.endswith(
        '"finish_reason":"length","stop_reason":null,"prompt_token_ids":null,"token_ids":null,'
        '"weight_versions":null}],"system_fingerprint":"vllm-0.33.0-1a2b3c4d",'
        '"kv_transfer_params":null}'
    )
    assert events[3] == "data: [DONE]"


async def test_completion_usage_chunk_and_continuous_usage(
    sim_url: str, session: aiohttp.ClientSession
) -> None:
    _, body, _ = await post(
        session,
        sim_url + COMPLETIONS,
        {
            "prompt": "Once upon a time",
            "stream": True,
            "max_tokens": 2,
            "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
        headers={"X-Request-Id": "abc123"},
    )
    events = sse_events(body)
    prompt = len(tokenizer.encode("Once upon a time"))
    assert events[0].endswith(
        f'"usage":{{"prompt_tokens":{prompt},"total_tokens":{prompt + 1},"completion_tokens":1}},'
        '"kv_transfer_params":null}'
    )
    assert "system_fingerprint" not in events[1]
    assert pin_clock_and_fingerprint(events[2]) == (
        'data: {"id":"cmpl-abc123","object":"text_completion","created":1700000000,"model":"M",'
        f'"choices":[],"usage":{{"prompt_tokens":{prompt},"total_tokens":{prompt + 2},'
        '"completion_tokens":2},"system_fingerprint":"vllm-0.33.0-1a2b3c4d"}'
    )


async def test_force_include_usage(start_sim: Any, session: aiohttp.ClientSession) -> None:
    (replica,) = await start_sim(enable_force_include_usage=True)
    _, body, _ = await post(
        session, replica.url + CHAT, {"messages": HELLO, "stream": True, "max_tokens": 2}
    )
    payloads = data_payloads(body)
    assert all("usage" in p for p in payloads[:-1])
    assert payloads[-2]["choices"] == []


async def test_per_request_metrics_in_the_usage_chunk(
    start_sim: Any, session: aiohttp.ClientSession
) -> None:
    (replica,) = await start_sim(
        enable_per_request_metrics=True, engine_step_floor_s=0.005, engine_saturation_tokens=4096
    )
    _, body, _ = await post(
        session,
        replica.url + CHAT,
        {
            "messages": HELLO,
            "stream": True,
            "max_tokens": 5,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        },
    )
    usage_event = sse_events(body)[-2]
    metrics = data_payloads(body)[-2]["metrics"]
    assert list(metrics) == [
        "time_to_first_token_ms",
        "generation_time_ms",
        "queue_time_ms",
        "mean_itl_ms",
        "tokens_per_second",
    ]
    assert usage_event.index('"system_fingerprint"') < usage_event.index('"metrics"')
    # vLLM's TTFT here is first token - scheduled: one 5 ms prefill step, no queue.
    assert metrics["time_to_first_token_ms"] == pytest.approx(5.0, abs=0.01)
    assert metrics["generation_time_ms"] == pytest.approx(20.0, abs=0.01)
    assert metrics["mean_itl_ms"] == pytest.approx(5.0, abs=0.01)
    assert metrics["queue_time_ms"] >= 0
    assert metrics["tokens_per_second"] == pytest.approx(5 / 0.025, rel=1e-6)
    # n > 1: suppressed.
    _, body, _ = await post(
        session,
        replica.url + CHAT,
        {
            "messages": HELLO,
            "stream": True,
            "n": 2,
            "max_tokens": 2,
            "stream_options": {"include_usage": True},
        },
    )
    assert "metrics" not in data_payloads(body)[-2]


async def test_prompt_tokens_details_report_prefix_cache_hits(
    start_sim: Any, session: aiohttp.ClientSession
) -> None:
    (replica,) = await start_sim(enable_prompt_tokens_details=True)
    long_prompt = "word " * 100  # many 16-token blocks
    request = {
        "prompt": long_prompt,
        "stream": True,
        "max_tokens": 2,
        "stream_options": {"include_usage": True},
    }
    _, first, _ = await post(session, replica.url + COMPLETIONS, request)
    _, second, _ = await post(session, replica.url + COMPLETIONS, request)
    assert data_payloads(first)[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    prompt_len = len(tokenizer.encode(long_prompt))
    cached = data_payloads(second)[-2]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == ((prompt_len - 1) // 16) * 16
    # Non-streaming: the three-key details object.
    whole = {"prompt": long_prompt, "max_tokens": 2}
    _, body, _ = await post(session, replica.url + COMPLETIONS, whole)
    details = json.loads(body)["usage"]["prompt_tokens_details"]
    assert details == {
        "cached_tokens": cached,
        "created_cache_tokens": None,
        "multimodal_tokens": None,
    }


# ---------------------------------------------------------------- non-streaming shapes


async def test_non_stream_chat_is_the_spec_example(
    start_sim: Any, session: aiohttp.ClientSession
) -> None:
    (replica,) = await start_sim(engine_natural_length_median=3.0, engine_natural_length_sigma=0.0)
    status, body, headers = await post(
        session, replica.url + CHAT, {"messages": HELLO}, headers={"X-Request-Id": "abc"}
    )
    assert status == 200 and headers["Content-Type"] == "application/json"
    response = json.loads(body)
    prompt = response["usage"]["prompt_tokens"]
    text = response["choices"][0]["message"]["content"]
    # Three completion tokens: two words, then EOS, which counts but shows no text (as in vLLM).
    assert len(text.split()) == 2
    expected = SPEC_CHAT_RESPONSE.replace('"Hello world!"', json.dumps(text)).replace(
        '"prompt_tokens":12,"total_tokens":15',
        f'"prompt_tokens":{prompt},"total_tokens":{prompt + 3}',
    )
    assert pin_clock_and_fingerprint(body.decode()) == expected


async def test_non_stream_completion_keys(sim_url: str, session: aiohttp.ClientSession) -> None:
    _, body, _ = await post(
        session, sim_url + COMPLETIONS, {"prompt": "Hi", "max_tokens": 3, "ignore_eos": True}
    )
    response = json.loads(body)
    assert list(response) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "service_tier",
        "system_fingerprint",
        "usage",
        "kv_transfer_params",
        "ec_transfer_params",
        "metrics",
    ]
    assert response["object"] == "text_completion" and response["id"].startswith("cmpl-")
    assert list(response["choices"][0]) == [
        "index",
        "text",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "token_ids",
        "prompt_logprobs",
        "prompt_token_ids",
        "routed_experts",
        "weight_versions",
    ]
    assert response["choices"][0]["finish_reason"] == "length"
    assert response["usage"]["completion_tokens"] == 3


async def test_non_stream_per_request_metrics_keep_nulls(
    start_sim: Any, session: aiohttp.ClientSession
) -> None:
    (replica,) = await start_sim(enable_per_request_metrics=True)
    _, body, _ = await post(session, replica.url + CHAT, {"messages": HELLO, "max_tokens": 1})
    metrics = json.loads(body)["metrics"]
    assert metrics["mean_itl_ms"] is None and metrics["time_to_first_token_ms"] > 0


# ---------------------------------------------------------------- sampling knobs


async def test_n2_stream_interleaves_one_choice_per_chunk(
    sim_url: str, session: aiohttp.ClientSession
) -> None:
    _, body, _ = await post(
        session,
        sim_url + CHAT,
        {
            "messages": HELLO,
            "n": 2,
            "stream": True,
            "max_tokens": 3,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        },
    )
    payloads = data_payloads(body)
    chunks = payloads[:-2]
    assert all(len(p["choices"]) == 1 for p in chunks)
    assert [p["choices"][0]["index"] for p in chunks[:2]] == [0, 1]
    assert all(p["choices"][0]["delta"].get("role") == "assistant" for p in chunks[:2])
    finishes = [p["choices"][0]["index"] for p in chunks if p["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1]
    assert payloads[-2]["usage"]["completion_tokens"] == 6


async def test_list_prompts_and_token_id_prompts(
    sim_url: str, session: aiohttp.ClientSession
) -> None:
    _, body, _ = await post(
        session,
        sim_url + COMPLETIONS,
        {
            "prompt": [[300, 301, 302], [400, 401]],
            "n": 2,
            "max_tokens": 2,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    payloads = data_payloads(body)
    indices = {p["choices"][0]["index"] for p in payloads[:-2]}
    assert indices == {0, 1, 2, 3}  # output.index + prompt_idx * n
    assert payloads[-2]["usage"] == {"prompt_tokens": 5, "total_tokens": 13, "completion_tokens": 8}
    _, body, _ = await post(
        session, sim_url + COMPLETIONS, {"prompt": [7, 8, 9, 10], "max_tokens": 1}
    )
    assert json.loads(body)["usage"]["prompt_tokens"] == 4
    _, body, _ = await post(
        session, sim_url + COMPLETIONS, {"prompt": ["a b c", "d"], "max_tokens": 1}
    )
    assert [c["index"] for c in json.loads(body)["choices"]] == [0, 1]


async def test_chat_content_parts_and_max_completion_tokens_wins(
    sim_url: str, session: aiohttp.ClientSession
) -> None:
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}],
        }
    ]
    _, body, _ = await post(
        session,
        sim_url + CHAT,
        {"messages": parts, "max_tokens": 9, "max_completion_tokens": 2, "ignore_eos": True},
    )
    response = json.loads(body)
    assert response["usage"]["completion_tokens"] == 2
    joined = tokenizer.apply_chat_template([tokenizer.ChatMessage("user", "Hello\nthere")])
    assert response["usage"]["prompt_tokens"] == len(joined)


async def test_chat_default_cap_is_context_left(
    start_sim: Any, session: aiohttp.ClientSession
) -> None:
    (replica,) = await start_sim(engine_max_model_len=64)
    _, body, _ = await post(session, replica.url + CHAT, {"messages": HELLO, "ignore_eos": True})
    usage = json.loads(body)["usage"]
    assert usage["total_tokens"] == 64
    assert json.loads(body)["choices"][0]["finish_reason"] == "length"


async def test_completions_default_max_tokens_is_16(
    sim_url: str, session: aiohttp.ClientSession
) -> None:
    _, body, _ = await post(session, sim_url + COMPLETIONS, {"prompt": "x", "ignore_eos": True})
    assert json.loads(body)["usage"]["completion_tokens"] == 16


async def test_min_tokens_blocks_early_stop(start_sim: Any, session: aiohttp.ClientSession) -> None:
    (replica,) = await start_sim(engine_natural_length_median=2.0, engine_natural_length_sigma=0.0)
    _, body, _ = await post(
        session, replica.url + CHAT, {"messages": HELLO, "max_tokens": 50, "min_tokens": 7}
    )
    response = json.loads(body)
    assert response["usage"]["completion_tokens"] == 7
    assert response["choices"][0]["finish_reason"] == "stop"


async def test_per_request_stream_interval_groups_tokens(
    sim_url: str, session: aiohttp.ClientSession
) -> None:
    _, body, _ = await post(
        session,
        sim_url + COMPLETIONS,
        {
            "prompt": "x",
            "max_tokens": 10,
            "ignore_eos": True,
            "stream": True,
            "stream_interval": 4,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    )
    counts = [p["usage"]["completion_tokens"] for p in data_payloads(body)[:-2]]
    assert counts == [1, 5, 9, 10]  # first token at once, then every 4, then the rest


async def test_response_role_and_last_role_without_generation_prompt(
    start_sim: Any, session: aiohttp.ClientSession
) -> None:
    (replica,) = await start_sim(response_role="bot")
    _, body, _ = await post(
        session, replica.url + CHAT, {"messages": HELLO, "stream": True, "max_tokens": 1}
    )
    assert data_payloads(body)[0]["choices"][0]["delta"]["role"] == "bot"
    _, body, _ = await post(
        session,
        replica.url + CHAT,
        {"messages": HELLO, "max_tokens": 1, "add_generation_prompt": False},
    )
    assert json.loads(body)["choices"][0]["message"]["role"] == "user"


async def test_request_id_header_and_body_request_id(
    start_sim: Any, session: aiohttp.ClientSession
) -> None:
    (replica,) = await start_sim(enable_request_id_headers=True)
    _, body, headers = await post(
        session, replica.url + CHAT, {"messages": HELLO, "max_tokens": 1}, {"X-Request-Id": "r-1"}
    )
    assert headers["X-Request-Id"] == "r-1" and json.loads(body)["id"] == "chatcmpl-r-1"
    _, body, headers = await post(
        session, replica.url + CHAT, {"messages": HELLO, "max_tokens": 1, "request_id": "b-2"}
    )
    assert json.loads(body)["id"] == "chatcmpl-b-2" and headers["X-Request-Id"]
    _, _, headers = await post(session, replica.url + CHAT, {"messages": HELLO, "max_tokens": 1})
    assert re.fullmatch(r"[0-9a-f]{32}", headers["X-Request-Id"])


async def test_no_request_id_header_by_default(
    sim_url: str, session: aiohttp.ClientSession
) -> None:
    _, _, headers = await post(
        session, sim_url + CHAT, {"messages": HELLO, "max_tokens": 1}, {"X-Request-Id": "q"}
    )
    assert "X-Request-Id" not in headers


async def test_minimal_profile_drops_newer_keys(
    start_sim: Any, session: aiohttp.ClientSession
) -> None:
    (replica,) = await start_sim(profile="minimal")
    _, body, _ = await post(
        session,
        replica.url + CHAT,
        {
            "messages": HELLO,
            "stream": True,
            "max_tokens": 2,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        },
        headers={"X-Request-Id": "abc123"},
    )
    for key in (
        "prompt_token_ids",
        "kv_transfer_params",
        "system_fingerprint",
        "token_ids",
        "weight_versions",
    ):
        assert key.encode() not in body
    events = sse_events(body)
    assert events[1].endswith(
        '"delta":{"content":'
        + json.dumps(data_payloads(body)[1]["choices"][0]["delta"]["content"])
        + '},"logprobs":null,"finish_reason":null}]}'
    )
    assert events[2].endswith('"finish_reason":"length","stop_reason":null}]}')
    _, body, _ = await post(session, replica.url + COMPLETIONS, {"prompt": "x", "max_tokens": 1})
    assert "system_fingerprint" not in json.loads(body)


# ---------------------------------------------------------------- errors


def error_of(body: bytes) -> dict[str, Any]:
    error: dict[str, Any] = json.loads(body)["error"]
    assert list(error) == ["message", "type", "param", "code"]
    return error


@pytest.mark.parametrize(
    ("path", "raw", "param", "fragment"),
    [
        (CHAT, b"{not json", "body.1", "'type': 'json_invalid'"),
        (CHAT, b"[1, 2]", "body", "'type': 'model_attributes_type'"),
        (
            CHAT,
            b'{"max_tokens": 3}',
            "body.messages",
            # As vLLM 0.32/0.33 render it: loc dotted, the request never echoed.
            "'type': 'missing', 'loc': 'body.messages', 'msg': 'Field required', "
            "'input': '<dict of 1 items>'}",
        ),
        (CHAT, b'{"messages": "hi"}', "body.messages", "'type': 'list_type'"),
        (
            CHAT,
            b'{"messages": [], "max_tokens": "lots"}',
            "body.max_tokens",
            "'type': 'int_parsing'",
        ),
        (CHAT, b'{"messages": [], "n": 1.5}', "body.n", "'type': 'int_from_float'"),
        (CHAT, b'{"messages": [], "stream": "maybe"}', "body.stream", "'type': 'bool_parsing'"),
        (
            COMPLETIONS,
            b'{"max_tokens": 3}',
            "body",
            "Either prompt or prompt_embeds must be provided",
        ),
    ],
)
async def test_body_validation_errors_are_bad_request(
    sim_url: str, session: aiohttp.ClientSession, path: str, raw: bytes, param: str, fragment: str
) -> None:
    async with session.post(
        sim_url + path, data=raw, headers={"Content-Type": "application/json"}
    ) as response:
        assert response.status == 400
        error = error_of(await response.read())
    assert error["type"] == "Bad Request" and error["code"] == 400
    assert error["param"] == param
    assert error["message"].startswith("1 validation error:\n  {")
    assert fragment in error["message"]


@pytest.mark.parametrize(
    ("path", "body", "message", "param"),
    [
        (
            COMPLETIONS,
            {"prompt": "word " * 60, "max_tokens": 10},
            "You passed 62 input tokens and requested 10 output tokens. However, the model's "
            "context length is only 64 tokens, resulting in a maximum input length of 54 tokens. "
            "Please reduce the length of the input prompt. (parameter=input_tokens, value=62)",
            "input_tokens",
        ),
        (
            CHAT,
            {"messages": HELLO, "max_completion_tokens": 100},
            "max_completion_tokens=100 cannot be greater than max_model_len=64. "
            "Please request fewer output tokens. (parameter=max_completion_tokens, value=100)",
            "max_completion_tokens",
        ),
        (
            CHAT,
            {"messages": HELLO, "max_tokens": 5, "min_tokens": 9},
            "min_tokens must be less than or equal to max_tokens=5, got 9. "
            "(parameter=min_tokens, value=9)",
            "min_tokens",
        ),
        (
            CHAT,
            {"messages": HELLO, "max_tokens": 0},
            "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
            "max_tokens",
        ),
        (
            CHAT,
            {"messages": HELLO, "n": 0},
            "n must be at least 1, got 0. (parameter=n, value=0)",
            "n",
        ),
        (
            CHAT,
            {"messages": HELLO, "stream": True, "use_beam_search": True},
            "Streaming is not currently supported with beam search",
            None,
        ),
        (COMPLETIONS, {"prompt": [5, 99999]}, "Token id 99999 is out of vocabulary", None),
        # 0.32 answers it as a BadRequestError, not a schema error (seen on the real server).
        (
            CHAT,
            {"messages": HELLO, "stream_options": {"include_usage": True}},
            "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
            "stream_options",
        ),
    ],
)
async def test_semantic_errors_are_bad_request_error(
    start_sim: Any,
    session: aiohttp.ClientSession,
    path: str,
    body: dict[str, Any],
    message: str,
    param: str | None,
) -> None:
    (replica,) = await start_sim(engine_max_model_len=64)
    status, raw, _ = await post(session, replica.url + path, body)
    assert status == 400
    assert error_of(raw) == {
        "message": message,
        "type": "BadRequestError",
        "param": param,
        "code": 400,
    }


async def test_unknown_model_is_404(start_sim: Any, session: aiohttp.ClientSession) -> None:
    (replica,) = await start_sim(served_model_names=("M", "alias"))
    status, raw, _ = await post(session, replica.url + CHAT, {"model": "nope", "messages": HELLO})
    assert status == 404
    assert error_of(raw) == {
        "message": "The model `nope` does not exist. Valid aliases: M, alias.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    status, raw, _ = await post(
        session, replica.url + CHAT, {"model": "alias", "messages": HELLO, "max_tokens": 1}
    )
    assert status == 200 and json.loads(raw)["model"] == "alias"


async def test_api_key_guards_v1_only(start_sim: Any, session: aiohttp.ClientSession) -> None:
    (replica,) = await start_sim(api_key="sekret")
    status, raw, _ = await post(session, replica.url + CHAT, {"messages": HELLO})
    assert (status, raw) == (401, b'{"error":"Unauthorized"}')
    async with session.get(replica.url + "/v1/models") as response:
        assert response.status == 401
    async with session.get(replica.url + "/health") as response:
        assert response.status == 200
    status, _, _ = await post(
        session,
        replica.url + CHAT,
        {"messages": HELLO, "max_tokens": 1},
        {"Authorization": "Bearer sekret"},
    )
    assert status == 200


async def test_admission_limit_answers_503_and_counts(
    start_sim: Any, session: aiohttp.ClientSession
) -> None:
    (replica,) = await start_sim(
        max_num_queued_reqs=1, engine_max_num_seqs=1, engine_step_floor_s=0.01
    )
    slow = {"messages": HELLO, "max_tokens": 30, "ignore_eos": True}
    running = asyncio.ensure_future(post(session, replica.url + CHAT, slow))
    await asyncio.sleep(0.05)
    waiting = asyncio.ensure_future(post(session, replica.url + CHAT, slow))
    await asyncio.sleep(0.05)
    status, raw, _ = await post(session, replica.url + CHAT, slow)
    assert status == 503
    assert error_of(raw) == {
        "message": "The server is overloaded: the request queue is full "
        "(max_num_queued_reqs=1). Please retry later.",
        "type": "Service Unavailable",
        "param": None,
        "code": 503,
    }
    assert [s for s, _, _ in await asyncio.gather(running, waiting)] == [200, 200]
    families = await scrape(session, replica.url)
    rejections = {
        s.labels["reason"]: s.value
        for s in families["vllm:admission_rejections"]
        if s.name.endswith("_total") and s.labels["model_name"] == "M"
    }
    assert rejections == {"max_num_queued_reqs": 1, "max_num_queued_tokens": 0}


async def test_unknown_route_and_method_use_fastapi_shape(
    sim_url: str, session: aiohttp.ClientSession
) -> None:
    async with session.get(sim_url + "/v1/nothing") as response:
        assert response.status == 404 and await response.read() == b'{"detail":"Not Found"}'
    async with session.get(sim_url + CHAT) as response:
        assert response.status == 405
        assert await response.read() == b'{"detail":"Method Not Allowed"}'


# ---------------------------------------------------------------- other endpoints


async def test_tokenize_counts_match_usage(sim_url: str, session: aiohttp.ClientSession) -> None:
    status, raw, _ = await post(session, sim_url + "/tokenize", {"messages": HELLO})
    assert status == 200
    tokenized = json.loads(raw)
    assert list(tokenized) == ["count", "max_model_len", "tokens", "token_strs"]
    assert tokenized["token_strs"] is None and tokenized["max_model_len"] == 32768
    _, raw, _ = await post(session, sim_url + CHAT, {"messages": HELLO, "max_tokens": 1})
    assert json.loads(raw)["usage"]["prompt_tokens"] == tokenized["count"]

    _, raw, _ = await post(
        session, sim_url + "/tokenize", {"prompt": "The quick brown fox", "return_token_strs": True}
    )
    tokenized = json.loads(raw)
    assert "".join(tokenized["token_strs"][1:]) == "The quick brown fox"
    assert tokenized["count"] == len(tokenized["tokens"])
    _, raw, _ = await post(
        session, sim_url + COMPLETIONS, {"prompt": "The quick brown fox", "max_tokens": 1}
    )
    assert json.loads(raw)["usage"]["prompt_tokens"] == tokenized["count"]

    status, raw, _ = await post(session, sim_url + "/tokenize", {"model": "other", "prompt": "x"})
    assert status == 404
    status, raw, _ = await post(session, sim_url + "/tokenize", {"nothing": 1})
    assert status == 400 and error_of(raw)["param"] == "body.prompt"


async def test_detokenize(sim_url: str, session: aiohttp.ClientSession) -> None:
    status, raw, _ = await post(session, sim_url + "/detokenize", {"tokens": [1, 300, 301]})
    assert status == 200
    assert json.loads(raw) == {"prompt": "<s>" + tokenizer.decode([300, 301])}
    status, raw, _ = await post(session, sim_url + "/detokenize", {"tokens": "x"})
    assert status == 400


async def test_models_endpoint(start_sim: Any, session: aiohttp.ClientSession) -> None:
    (replica,) = await start_sim(engine_max_model_len=4096)
    async with session.get(replica.url + "/v1/models") as response:
        models = json.loads(await response.read())
    assert models["object"] == "list"
    (card,) = models["data"]
    assert list(card) == [
        "id",
        "object",
        "created",
        "owned_by",
        "root",
        "parent",
        "max_model_len",
        "permission",
    ]
    assert (card["id"], card["object"], card["owned_by"], card["root"], card["parent"]) == (
        "M",
        "model",
        "vllm",
        "M",
        None,
    )
    assert card["max_model_len"] == 4096
    (permission,) = card["permission"]
    assert permission["object"] == "model_permission" and permission["id"].startswith("modelperm-")


async def test_health_ping_version_load(start_sim: Any, session: aiohttp.ClientSession) -> None:
    (replica,) = await start_sim(enable_server_load_tracking=True)
    for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
        async with session.request(method, replica.url + path) as response:
            assert response.status == 200 and await response.read() == b""
    async with session.get(replica.url + "/version") as response:
        assert await response.read() == b'{"version":"0.33.0"}'
    async with session.get(replica.url + "/load") as response:
        assert json.loads(await response.read()) == {"server_load": 0}


# ---------------------------------------------------------------- /metrics


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, list[Any]]:
    async with session.get(url + "/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=")
        text = await response.text()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def buckets_of(samples: list[Any]) -> list[float]:
    return [
        float(s.labels["le"])
        for s in samples
        if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"
    ]


async def test_metrics_after_traffic(start_sim: Any, session: aiohttp.ClientSession) -> None:
    (replica,) = await start_sim(engine_max_model_len=1000)
    for _ in range(3):
        await post(
            session,
            replica.url + CHAT,
            {"messages": HELLO, "max_tokens": 4, "ignore_eos": True, "stream": True},
        )
    families = await scrape(session, replica.url)
    labels = {"model_name": "M", "engine": "0"}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:num_preemptions",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
    ):
        assert families[name][0].labels == labels, name
    assert families["vllm:generation_tokens"][0].value == 12
    assert families["vllm:prompt_tokens"][0].value == 3 * len(
        tokenizer.apply_chat_template([tokenizer.ChatMessage(**HELLO[0])])
    )
    success = {
        s.labels["finished_reason"]: s.value
        for s in families["vllm:request_success"]
        if s.name.endswith("_total")
    }
    assert success["length"] == 3 and success["abort"] == 0
    info = families["vllm:cache_config_info"][0]
    assert info.labels["block_size"] == "16" and info.labels["engine"] == "0" and info.value == 1
    expected_buckets = {
        "vllm:time_to_first_token_seconds": TTFT_BUCKETS,
        "vllm:inter_token_latency_seconds": ITL_BUCKETS,
        "vllm:request_time_per_output_token_seconds": ITL_BUCKETS,
        "vllm:e2e_request_latency_seconds": LATENCY_BUCKETS,
        "vllm:request_queue_time_seconds": LATENCY_BUCKETS,
        "vllm:request_prefill_time_seconds": LATENCY_BUCKETS,
        "vllm:request_decode_time_seconds": LATENCY_BUCKETS,
        "vllm:request_inference_time_seconds": LATENCY_BUCKETS,
        "vllm:iteration_tokens_total": ITERATION_BUCKETS,
        "vllm:request_params_n": N_BUCKETS,
        "vllm:request_num_preemptions": PREEMPTION_BUCKETS,
        "vllm:request_prompt_tokens": one_two_five_buckets(1000),
        "vllm:request_generation_tokens": one_two_five_buckets(1000),
        "vllm:request_params_max_tokens": one_two_five_buckets(1000),
    }
    for name, buckets in expected_buckets.items():
        assert buckets_of(families[name]) == [float(b) for b in buckets], name
        count = next(s.value for s in families[name] if s.name.endswith("_count"))
        assert count >= 3, name
    assert one_two_five_buckets(1000) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    # One inter-token observation per engine step after the first token: 3 per request.
    itl_count = next(
        s.value for s in families["vllm:inter_token_latency_seconds"] if s.name.endswith("_count")
    )
    assert itl_count == 9
    assert TTFT_BUCKETS[:3] == (0.001, 0.005, 0.01) and ITERATION_BUCKETS[-1] == 16384


async def test_metrics_vllm_0_32_engine_families(
    start_sim: Any, session: aiohttp.ClientSession
) -> None:
    """The families vLLM 0.32 added, derived from the engine's totals (no KV connector, no
    multi-modal input, no sleep): a repeated prompt is served partly from the prefix cache."""
    (replica,) = await start_sim(engine_max_model_len=1000)
    long_prompt = [{"role": "user", "content": "hello there " * 40}]
    for _ in range(2):
        await post(
            session,
            replica.url + CHAT,
            {"messages": long_prompt, "max_tokens": 2, "ignore_eos": True},
        )
    families = await scrape(session, replica.url)

    def values(name: str, label: str) -> dict[str, float]:
        return {s.labels[label]: s.value for s in families[name] if not s.name.endswith("_created")}

    def value(name: str) -> float:
        (sample,) = [s for s in families[name] if not s.name.endswith("_created")]
        assert sample.labels == {"model_name": "M", "engine": "0"}, name
        return float(sample.value)

    prompt_tokens = value("vllm:prompt_tokens")
    cached = value("vllm:prompt_tokens_cached")
    hits = value("vllm:prefix_cache_hits")
    assert 0 < cached < prompt_tokens and hits > 0
    assert values("vllm:prompt_tokens_by_source", "source") == {
        "local_compute": prompt_tokens - cached,
        "local_cache_hit": cached,
        "external_kv_transfer": 0,
    }
    assert values("vllm:prompt_tokens_cached_by_source", "source") == {
        "device": hits,
        "host": 0,
        "p2p": 0,
        "disk": 0,
        "external_unspecified": 0,
    }
    assert values("vllm:num_requests_waiting_by_reason", "reason") == {
        "capacity": 0,
        "deferred": 0,
    }
    assert values("vllm:engine_sleep_state", "sleep_state") == {
        "awake": 1,
        "weights_offloaded": 0,
        "discard_all": 0,
    }
    for name in (
        "vllm:external_prefix_cache_queries",
        "vllm:external_prefix_cache_hits",
        "vllm:mm_cache_queries",
        "vllm:mm_cache_hits",
    ):
        assert value(name) == 0, name
    info = families["vllm:cache_config_info"][0].labels
    assert info["kv_cache_size_tokens"] == str(16 * int(info["num_gpu_blocks"]))
    assert info["effective_attention_block_size"] == info["block_size"] == "16"
    assert "swap_space" not in info and "_block_size_resolved" in info


async def test_legacy_metric_names(start_sim: Any, session: aiohttp.ClientSession) -> None:
    (replica,) = await start_sim(legacy_metric_names=True)
    await post(
        session, replica.url + CHAT, {"messages": HELLO, "max_tokens": 3, "ignore_eos": True}
    )
    families = await scrape(session, replica.url)
    for old, new in (
        ("vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds"),
        ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"),
        ("vllm:gpu_prefix_cache_queries", "vllm:prefix_cache_queries"),
        ("vllm:gpu_prefix_cache_hits", "vllm:prefix_cache_hits"),
    ):
        assert old in families and new not in families
    # A 0.10-era server: its CacheConfig labels, none of the families vLLM added since.
    assert "swap_space" in families["vllm:cache_config_info"][0].labels
    assert "vllm:prompt_tokens_by_source" not in families


async def test_client_disconnect_aborts_the_request(
    start_sim: Any, session: aiohttp.ClientSession
) -> None:
    (replica,) = await start_sim(engine_step_floor_s=0.01)
    async with session.post(
        replica.url + CHAT,
        json={"messages": HELLO, "stream": True, "max_tokens": 1000, "ignore_eos": True},
    ) as response:
        await response.content.readuntil(b"\n\n")
        await response.content.readuntil(b"\n\n")
        response.close()  # drop the connection mid-stream
    for _ in range(200):
        families = await scrape(session, replica.url)
        success = {
            s.labels["finished_reason"]: s.value
            for s in families["vllm:request_success"]
            if s.name.endswith("_total")
        }
        if success["abort"] == 1:
            break
        await asyncio.sleep(0.01)
    assert success["abort"] == 1
    assert families["vllm:num_requests_running"][0].value == 0


# ---------------------------------------------------------------- keep-alive, replicas


async def test_keep_alive_comments_while_idle(
    start_sim: Any, session: aiohttp.ClientSession
) -> None:
    (replica,) = await start_sim(sse_keep_alive_interval=0.02, engine_step_floor_s=0.09)
    _, body, _ = await post(
        session,
        replica.url + CHAT,
        {"messages": HELLO, "stream": True, "max_tokens": 2, "ignore_eos": True},
    )
    events = sse_events(body)
    assert events.count(": keep-alive") >= 3
    assert [p for p in data_payloads(body) if p != "[DONE]"]  # data still flows around them


async def test_two_replicas_on_consecutive_ports(
    start_sim: Any, session: aiohttp.ClientSession
) -> None:
    for _ in range(20):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base >= 65535:
            continue
        try:
            replicas = await start_sim(n=2, port=base)
        except OSError:
            continue
        break
    else:
        pytest.skip("no two consecutive free ports found")
    assert [r.port for r in replicas] == [base, base + 1]
    assert [r.url for r in replicas] == [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
    for replica in replicas:
        status, raw, _ = await post(
            session, replica.url + CHAT, {"messages": HELLO, "max_tokens": 1}
        )
        assert status == 200


# ---------------------------------------------------------------- faults


def test_fault_spec_syntax() -> None:
    spec = parse_fault_spec(" stall_ms=250@after=2 ; error_event_after=5;slow_headers_ms=10 ")
    assert (spec.stall_ms, spec.stall_after, spec.error_event_after, spec.slow_headers_ms) == (
        250.0,
        2,
        5,
        10.0,
    )
    assert parse_fault_spec("split_end_ms=2.5").split_end_ms == 2.5
    assert parse_fault_spec("none").is_empty and parse_fault_spec("").is_empty
    for bad in (
        "bogus=1",
        "reset_after",
        "reset_after=-1",
        "error_status=200",
        "stall_ms=5@before=1",
    ):
        with pytest.raises(FaultSpecError):
            parse_fault_spec(bad)


def fault(spec: str) -> dict[str, str]:
    return {"X-Sim-Fault": spec}


async def test_fault_error_status(sim_url: str, session: aiohttp.ClientSession) -> None:
    status, raw, _ = await post(
        session, sim_url + CHAT, {"messages": HELLO}, fault("error_status=500")
    )
    assert status == 500
    assert error_of(raw) == {
        "message": "The server had an error while processing your request.",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
    status, raw, _ = await post(
        session, sim_url + CHAT, {"messages": HELLO}, fault("error_status=429")
    )
    assert status == 429 and error_of(raw)["type"] == "Too Many Requests"
    status, raw, _ = await post(session, sim_url + CHAT, {"messages": HELLO}, fault("explode=1"))
    assert status == 400 and "unknown fault" in error_of(raw)["message"]


async def test_fault_error_event_chat_and_completions(
    sim_url: str, session: aiohttp.ClientSession
) -> None:
    request = {"stream": True, "max_tokens": 20, "ignore_eos": True}
    status, body, _ = await post(
        session, sim_url + CHAT, {**request, "messages": HELLO}, fault("error_event_after=3")
    )
    events = sse_events(body)
    assert status == 200
    assert events[-2] == (
        'data: {"error":{"message":"Internal server error","type":"InternalServerError",'
        '"param":null,"code":500}}'
    )
    assert events[-1] == "data: [DONE]"
    assert len(events) == 1 + 3 + 2  # role, 3 tokens, error, [DONE]
    _, body, _ = await post(
        session, sim_url + COMPLETIONS, {**request, "prompt": "x"}, fault("error_event_after=2")
    )
    events = sse_events(body)
    assert events[-2] == (
        'data: {"error": {"message": "Internal server error", "type": "InternalServerError", '
        '"param": null, "code": 500}}'
    )
    status, raw, _ = await post(
        session,
        sim_url + CHAT,
        {"messages": HELLO, "max_tokens": 5, "ignore_eos": True},
        fault("error_event_after=2"),
    )
    assert status == 500 and error_of(raw)["message"] == "Internal server error"
    families = await scrape(session, sim_url)
    errors = next(
        s.value for s in families["vllm:request_success"] if s.labels["finished_reason"] == "error"
    )
    assert errors == 3


async def test_fault_reset_aborts_the_connection(
    sim_url: str, session: aiohttp.ClientSession
) -> None:
    received = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async with session.post(
            sim_url + CHAT,
            json={"messages": HELLO, "stream": True, "max_tokens": 20, "ignore_eos": True},
            headers=fault("reset_after=2"),
        ) as response:
            assert response.status == 200
            async for chunk in response.content.iter_any():
                received += chunk
    assert received.count(b'"content"') == 3  # role chunk + 2 token chunks
    with pytest.raises(aiohttp.ClientError):
        await post(
            session, sim_url + CHAT, {"messages": HELLO, "max_tokens": 5}, fault("reset_after=0")
        )


async def test_fault_close_truncates_without_done(
    sim_url: str, session: aiohttp.ClientSession
) -> None:
    status, body, _ = await post(
        session,
        sim_url + COMPLETIONS,
        {"prompt": "x", "stream": True, "max_tokens": 20, "ignore_eos": True},
        fault("close_after=4"),
    )
    assert status == 200
    payloads = data_payloads(body)
    assert len(payloads) == 4 and "[DONE]" not in payloads


async def test_fault_stall_delays_and_merges(
    start_sim: Any, session: aiohttp.ClientSession
) -> None:
    (replica,) = await start_sim(engine_step_floor_s=0.005)
    arrivals: list[float] = []
    async with session.post(
        replica.url + COMPLETIONS,
        json={
            "prompt": "x",
            "stream": True,
            "max_tokens": 40,
            "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
        headers=fault("stall_ms=100@after=2"),
    ) as response:
        body = b""
        while True:
            line = await response.content.readuntil(b"\n\n")
            if not line:
                break
            arrivals.append(time.perf_counter())
            body += line
            if line == b"data: [DONE]\n\n":
                break
    counts = [p["usage"]["completion_tokens"] for p in data_payloads(body)[:-2]]
    gaps = [b - a for a, b in zip(arrivals[:-1], arrivals[1:], strict=True)]
    assert gaps[1] >= 0.09  # the silence before token chunk 3
    assert counts[2] - counts[1] > 5  # what piled up came merged


async def test_fault_malformed_event_then_stream_goes_on(
    sim_url: str, session: aiohttp.ClientSession
) -> None:
    _, body, _ = await post(
        session,
        sim_url + CHAT,
        {"messages": HELLO, "stream": True, "max_tokens": 3, "ignore_eos": True},
        fault("malformed_after=1"),
    )
    events = sse_events(body)
    with pytest.raises(json.JSONDecodeError):
        json.loads(events[2][len("data: ") :])
    assert events[-1] == "data: [DONE]" and len(events) == 1 + 3 + 1 + 1


async def test_fault_slow_headers(sim_url: str, session: aiohttp.ClientSession) -> None:
    started = time.perf_counter()
    async with session.post(
        sim_url + CHAT,
        json={"messages": HELLO, "stream": True, "max_tokens": 2},
        headers=fault("slow_headers_ms=150"),
    ) as response:
        headers_after = time.perf_counter() - started
        body = await response.read()
    assert headers_after >= 0.14
    assert data_payloads(body)[-1] == "[DONE]"


async def test_fault_split_end(sim_url: str, session: aiohttp.ClientSession) -> None:
    """The stream's last token chunk, usage chunk, [DONE] and the body's end leave in four
    turns, ``split_end_ms`` apart (each arrives as a chunk of its own, after the pause)."""
    body = {
        "messages": HELLO,
        "stream": True,
        "max_tokens": 3,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    arrivals: list[tuple[float, bytes]] = []
    async with session.post(
        sim_url + CHAT, json=body, headers=fault("split_end_ms=60")
    ) as response:
        async for data, _ in response.content.iter_chunks():
            arrivals.append((time.perf_counter(), data))
        ended = time.perf_counter()
    last_token, usage, done = (
        next(at for at, data in arrivals if marker in data)
        for marker in (b'"finish_reason":"length"', b'"choices":[]', b"[DONE]")
    )
    assert usage - last_token >= 0.05 and done - usage >= 0.05 and ended - done >= 0.05
    assert data_payloads(b"".join(data for _, data in arrivals))[-1] == "[DONE]"


async def test_global_fault_rate_is_seeded(start_sim: Any, session: aiohttp.ClientSession) -> None:
    (replica,) = await start_sim(
        fault=parse_fault_spec("error_status=503"), fault_rate=0.5, fault_seed=7
    )
    statuses = []
    for _ in range(40):
        status, _, _ = await post(
            session, replica.url + COMPLETIONS, {"prompt": "x", "max_tokens": 1}
        )
        statuses.append(status)
    assert 5 < statuses.count(503) < 35 and statuses.count(200) + statuses.count(503) == 40
    # The header wins over the global plan ("none" disables it for this request).
    for _ in range(5):
        status, _, _ = await post(
            session, replica.url + COMPLETIONS, {"prompt": "x", "max_tokens": 1}, fault("none")
        )
        assert status == 200


# ---------------------------------------------------------------- ground truth


async def test_ground_truth_matches_what_the_client_received(
    start_sim: Any, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    truth = tmp_path / "truth.jsonl"
    (replica,) = await start_sim(ground_truth_path=str(truth))
    _, body, _ = await post(
        session,
        replica.url + CHAT,
        {
            "messages": HELLO,
            "stream": True,
            "max_tokens": 5,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        },
        headers={"X-Request-Id": "gt-1"},
    )
    _, raw, _ = await post(
        session, replica.url + COMPLETIONS, {"prompt": "x", "max_tokens": 3, "ignore_eos": True}
    )
    await post(session, replica.url + CHAT, {"messages": HELLO}, fault("error_status=500"))
    await post(
        session,
        replica.url + CHAT,
        {"messages": HELLO, "stream": True, "max_tokens": 9, "ignore_eos": True},
        fault("error_event_after=2"),
    )
    lines = [json.loads(line) for line in truth.read_text().splitlines()]
    assert len(lines) == 4
    stream_line, whole_line, error_line, event_line = lines

    payloads = data_payloads(body)
    assert stream_line["request_id"] == "gt-1" and stream_line["stream"] is True
    assert stream_line["endpoint"] == CHAT and stream_line["outcome"] == "ok"
    assert stream_line["chunk_kinds"] == ["role"] + ["token"] * 5 + ["usage", "done"]
    assert len(stream_line["chunk_ns"]) == len(payloads)
    assert sum(stream_line["chunk_tokens"]) == stream_line["completion_tokens"] == 5
    assert stream_line["chunk_tokens"] == [0, 1, 1, 1, 1, 1, 0, 0]
    assert stream_line["prompt_tokens"] == payloads[-2]["usage"]["prompt_tokens"]
    assert stream_line["finish_reasons"] == ["length"]
    stamps = [
        stream_line["received_ns"],
        stream_line["headers_ns"],
        *stream_line["chunk_ns"],
        stream_line["done_ns"],
    ]
    assert stamps == sorted(stamps)
    assert abs(stream_line["wall_time_ns"] - time.time_ns()) < 60e9

    assert whole_line["stream"] is False and whole_line["chunk_kinds"] == ["body"]
    assert whole_line["chunk_tokens"] == [3] and json.loads(raw)["usage"]["completion_tokens"] == 3
    assert (error_line["status"], error_line["outcome"], error_line["fault"]) == (
        500,
        "http_error",
        "error_status=500",
    )
    assert event_line["outcome"] == "error_event"
    assert event_line["chunk_kinds"] == ["role", "token", "token", "error", "done"]
    assert event_line["finish_reasons"] == ["error"]


async def test_ground_truth_records_client_disconnect(
    start_sim: Any, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    truth = tmp_path / "truth.jsonl"
    (replica,) = await start_sim(ground_truth_path=str(truth), engine_step_floor_s=0.01)
    async with session.post(
        replica.url + CHAT,
        json={"messages": HELLO, "stream": True, "max_tokens": 500, "ignore_eos": True},
    ) as response:
        await response.content.readuntil(b"\n\n")
        await response.content.readuntil(b"\n\n")
        response.close()
    for _ in range(200):
        if truth.exists() and truth.read_text():
            break
        await asyncio.sleep(0.01)
    (line,) = [json.loads(text) for text in truth.read_text().splitlines()]
    assert line["outcome"] == "client_disconnect" and line["finish_reasons"] == ["abort"]


# ---------------------------------------------------------------- timing and engine driving


async def test_headers_go_out_at_admission_before_the_first_token(
    start_sim: Any, session: aiohttp.ClientSession
) -> None:
    (replica,) = await start_sim(engine_step_floor_s=0.15)
    started = time.perf_counter()
    async with session.post(
        replica.url + CHAT, json={"messages": HELLO, "stream": True, "max_tokens": 1}
    ) as response:
        headers_at = time.perf_counter() - started
        await response.content.readuntil(b"\n\n")  # role chunk, sent with the first token
        first_chunk_at = time.perf_counter() - started
        await response.read()
    assert headers_at < 0.1 <= first_chunk_at


async def test_chunks_follow_the_step_time_without_drift(
    start_sim: Any, session: aiohttp.ClientSession
) -> None:
    (replica,) = await start_sim(engine_step_floor_s=0.02)
    arrivals: list[float] = []
    async with session.post(
        replica.url + COMPLETIONS,
        json={"prompt": "x", "stream": True, "max_tokens": 25, "ignore_eos": True},
    ) as response:
        started = time.perf_counter()
        while True:
            event = await response.content.readuntil(b"\n\n")
            arrivals.append(time.perf_counter() - started)
            if event == b"data: [DONE]\n\n":
                break
    token_arrivals = arrivals[:-1]
    assert len(token_arrivals) == 25
    # 24 steps between the first and the last token: deadlines are absolute, so timer slack
    # on each step does not add up.
    assert token_arrivals[-1] - token_arrivals[0] == pytest.approx(24 * 0.02, abs=0.03)
    gaps = sorted(b - a for a, b in zip(token_arrivals[:-1], token_arrivals[1:], strict=True))
    assert gaps[len(gaps) // 2] == pytest.approx(0.02, abs=0.005)


async def test_inter_token_latency_is_observed_per_engine_step(
    start_sim: Any, session: aiohttp.ClientSession
) -> None:
    (replica,) = await start_sim(engine_stream_interval=4)
    _, body, _ = await post(
        session,
        replica.url + COMPLETIONS,
        {"prompt": "x", "stream": True, "max_tokens": 9, "ignore_eos": True},
    )
    assert len(data_payloads(body)) - 1 == 3  # chunks of 1, 4 and 4 tokens
    families = await scrape(session, replica.url)
    itl = next(
        s.value for s in families["vllm:inter_token_latency_seconds"] if s.name.endswith("_count")
    )
    assert itl == 8  # one per engine step after the first token, not one per chunk


async def test_engine_failure_ends_streams_and_fails_health(
    start_sim: Any, session: aiohttp.ClientSession
) -> None:
    (running,) = await start_sim(engine_step_floor_s=0.01)
    replica = running.replica
    real_step = replica.engine.step
    steps = 0

    def failing_step(now_s: float) -> Any:
        nonlocal steps
        steps += 1
        if steps > 3:
            raise RuntimeError("simulated engine crash")
        return real_step(now_s)

    replica.engine.step = failing_step
    status, body, _ = await post(
        session,
        running.url + CHAT,
        {"messages": HELLO, "stream": True, "max_tokens": 50, "ignore_eos": True},
    )
    assert status == 200
    events = sse_events(body)
    assert events[-2] == (
        'data: {"error":{"message":"The server had an error while processing your request.",'
        '"type":"InternalServerError","param":null,"code":500}}'
    )
    assert events[-1] == "data: [DONE]"
    async with session.get(running.url + "/health") as response:
        assert response.status == 503
    status, raw, _ = await post(session, running.url + CHAT, {"messages": HELLO})
    assert status == 500 and error_of(raw)["type"] == "InternalServerError"


async def test_server_load_counts_requests_in_flight(
    start_sim: Any, session: aiohttp.ClientSession
) -> None:
    (replica,) = await start_sim(enable_server_load_tracking=True, engine_step_floor_s=0.01)
    body = {"messages": HELLO, "max_tokens": 20, "ignore_eos": True}
    pending = [asyncio.ensure_future(post(session, replica.url + CHAT, body)) for _ in range(3)]
    await asyncio.sleep(0.05)
    async with session.get(replica.url + "/load") as response:
        assert json.loads(await response.read()) == {"server_load": 3}
    await asyncio.gather(*pending)


async def test_non_streaming_client_disconnect_aborts_too(
    start_sim: Any, session: aiohttp.ClientSession
) -> None:
    (replica,) = await start_sim(engine_step_floor_s=0.01)
    body = {"messages": HELLO, "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(post(session, replica.url + CHAT, body), 0.1)
    for _ in range(200):
        families = await scrape(session, replica.url)
        aborted = next(
            s.value
            for s in families["vllm:request_success"]
            if s.labels["finished_reason"] == "abort" and s.name.endswith("_total")
        )
        if aborted == 1:
            break
        await asyncio.sleep(0.01)
    assert aborted == 1
    assert families["vllm:num_requests_running"][0].value == 0


# ---------------------------------------------------------------- version profiles


def _without_volatile(payload: str) -> str:
    """A chunk with its id, created, model and text made constant."""
    obj = json.loads(payload)
    obj["id"], obj["created"], obj["model"] = "X", 0, "M"
    for choice in obj.get("choices", []):
        if "delta" in choice and "content" in choice["delta"]:
            choice["delta"]["content"] = "t"
        if "text" in choice:
            choice["text"] = "t"
    return json.dumps(obj, separators=(",", ":"))


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_vllm_version_032_speaks_032s_shapes(
    start_sim: Any, session: aiohttp.ClientSession, path: str
) -> None:
    """--vllm-version 0.32.0: token chunks as vLLM 0.32.0 itself sent them (copied from the
    real server: no kv_transfer_params, no weight_versions); whole answers' choices without
    weight_versions and their metrics with speculative_decoding. 0.33 (the default) keeps both."""
    from vllm_chunks import CHAT_TOKEN_032, COMPLETION_TOKEN_032

    real = CHAT_TOKEN_032 if path == CHAT else COMPLETION_TOKEN_032
    body: dict[str, Any] = {"model": "M", "max_tokens": 3, "ignore_eos": True, "stream": True}
    body.update({"messages": HELLO} if path == CHAT else {"prompt": "hello"})
    for version in ("0.32.0", "0.33.0"):
        (replica,) = await start_sim(vllm_version=version, enable_per_request_metrics=True)
        status, raw, _ = await post(session, replica.url + path, body)
        assert status == 200
        payloads = [e[len("data: ") :] for e in raw.decode().split("\n\n") if e]
        token = _without_volatile(payloads[1 if path == CHAT else 0])
        if version == "0.32.0":
            assert token == _without_volatile(real)
        else:
            assert '"kv_transfer_params":null' in token
        status, raw, _ = await post(session, replica.url + path, {**body, "stream": False})
        whole = json.loads(raw)
        assert ("weight_versions" in whole["choices"][0]) is (version == "0.33.0")
        assert ("speculative_decoding" in whole["metrics"]) is (version == "0.32.0")


async def test_vllms_refusals_that_the_simulator_gives_alike(
    sim_url: str, session: aiohttp.ClientSession
) -> None:
    """As vLLM 0.32.0 answered them (tests/conformance holds the shapes to the real server)."""
    status, raw, _ = await post(
        session, sim_url + CHAT, {"model": "M", "messages": HELLO, "n": 2, "temperature": 0}
    )
    assert status == 400 and error_of(raw) == {
        "message": "n must be 1 when using greedy sampling, got 2.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    status, raw, _ = await post(
        session, sim_url + CHAT, {"model": "M", "messages": HELLO, "temperature": "hot"}
    )
    error = error_of(raw)
    assert status == 400 and error["param"] == "body.temperature"
    assert "'type': 'float_parsing', 'loc': 'body.temperature'" in error["message"]
    status, raw, _ = await post(
        session, sim_url + COMPLETIONS, {"model": "M", "prompt": [1, 2, 99_999_999]}
    )
    assert status == 400 and error_of(raw)["param"] is None
    # Streamed, vLLM finds the bad id after its head went out: 200, an error event, [DONE].
    status, raw, _ = await post(
        session, sim_url + COMPLETIONS, {"model": "M", "prompt": [1, 2, 99_999_999], "stream": True}
    )
    assert status == 200 and raw == (
        b'data: {"error": {"message": "Token id 99999999 is out of vocabulary", "type": '
        b'"BadRequestError", "param": null, "code": 400}}\n\ndata: [DONE]\n\n'
    )


# ---------------------------------------------------------------- end of a stream (EOS)


async def test_a_stream_ending_at_eos_sends_an_empty_final_chunk(
    start_sim: Any, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    # vLLM streams the EOS token's output like any other: no text (the detokenizer skips the
    # stop token), the finish reason, and the token counted in usage.
    truth = tmp_path / "truth.jsonl"
    (replica,) = await start_sim(
        engine_natural_length_median=3.0,
        engine_natural_length_sigma=0.0,
        ground_truth_path=str(truth),
    )
    options = {"include_usage": True}
    for path, field in ((CHAT, "delta"), (COMPLETIONS, "text")):
        body: dict[str, Any] = {"stream": True, "stream_options": options}
        body.update({"messages": HELLO} if path == CHAT else {"prompt": "Hi"})
        _, raw, _ = await post(session, replica.url + path, body)
        payloads = data_payloads(raw)
        usage, content = payloads[-2], [p for p in payloads[:-2] if p["choices"]]
        if path == CHAT:
            content = content[1:]  # the role chunk
        texts = [
            p["choices"][0]["delta"]["content"] if field == "delta" else p["choices"][0]["text"]
            for p in content
        ]
        reasons = [p["choices"][0]["finish_reason"] for p in content]
        assert all(texts[:2]) and texts[2:] == [""]
        assert reasons == [None, None, "stop"]
        assert content[-1]["choices"][0]["stop_reason"] is None
        assert usage["usage"]["completion_tokens"] == 3
    lines = [json.loads(line) for line in truth.read_text().splitlines()]
    for line in lines:
        tokens = [
            n
            for n, kind in zip(line["chunk_tokens"], line["chunk_kinds"], strict=True)
            if kind == "token"
        ]
        assert tokens == [1, 1, 1] and line["finish_reasons"] == ["stop"]
    # A whole answer: two words of text, three completion tokens.
    _, raw, _ = await post(session, replica.url + COMPLETIONS, {"prompt": "Hi"})
    answer = json.loads(raw)
    assert len(answer["choices"][0]["text"].split()) == 2
    assert answer["usage"]["completion_tokens"] == 3
    assert answer["choices"][0]["finish_reason"] == "stop"


async def test_a_stream_ending_at_its_length_has_no_empty_chunk(
    start_sim: Any, session: aiohttp.ClientSession
) -> None:
    (replica,) = await start_sim(engine_natural_length_median=50.0, engine_natural_length_sigma=0.0)
    for extra in ({"ignore_eos": True}, {}):  # ignore_eos, and an EOS the length cap pre-empts
        _, raw, _ = await post(
            session,
            replica.url + COMPLETIONS,
            {"prompt": "Hi", "max_tokens": 3, "stream": True, **extra},
        )
        choices = [p["choices"][0] for p in data_payloads(raw)[:-1]]
        assert all(choice["text"] for choice in choices) and len(choices) == 3
        assert [choice["finish_reason"] for choice in choices] == [None, None, "length"]


async def test_eos_merges_into_the_last_delta_when_tokens_are_held_back(
    start_sim: Any, session: aiohttp.ClientSession
) -> None:
    # stream_interval 2: the first token at once, then the second with EOS in one delta, as
    # vLLM's output processor groups them: the finish then rides on a chunk with text.
    (replica,) = await start_sim(engine_natural_length_median=3.0, engine_natural_length_sigma=0.0)
    _, raw, _ = await post(
        session, replica.url + COMPLETIONS, {"prompt": "Hi", "stream": True, "stream_interval": 2}
    )
    choices = [p["choices"][0] for p in data_payloads(raw)[:-1]]
    assert [bool(choice["text"]) for choice in choices] == [True, True]
    assert [choice["finish_reason"] for choice in choices] == [None, "stop"]


# ---------------------------------------------------------------- large prompts, warm start


async def test_received_stamp_is_the_arrival_of_the_last_bytes_not_the_handlers_turn(
    start_sim: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the loop runs between a request's arrival and its handler (here a blocker that
    stands for another replica parsing a large prompt) is not in the request's stamps."""
    from aiohttp import web_protocol

    truth = tmp_path / "truth.jsonl"
    (replica,) = await start_sim(ground_truth_path=str(truth))
    loop = asyncio.get_running_loop()
    blockers: list[tuple[int, int]] = []

    def blocker() -> None:
        entered = time.perf_counter_ns()
        while time.perf_counter_ns() == entered:  # distinct instants, nothing more
            pass
        blockers.append((entered, time.perf_counter_ns()))

    original = web_protocol.RequestHandler.data_received

    def data_received(self: Any, data: bytes) -> None:
        # Queued before aiohttp feeds the bytes, so it runs before the handler resumes (aiohttp
        # also calls this itself with b"" to reparse what it buffered: no bytes arrived then).
        if data:
            loop.call_soon(blocker)
        original(self, data)

    monkeypatch.setattr(web_protocol.RequestHandler, "data_received", data_received)
    payload = json.dumps({"prompt": "x", "max_tokens": 2, "ignore_eos": True}).encode()
    reader, writer = await asyncio.open_connection(replica.host, replica.port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(payload) + payload
    )
    sent_ns = time.perf_counter_ns()
    await writer.drain()
    answer = await reader.read()
    writer.close()
    assert answer.startswith(b"HTTP/1.1 200")
    monkeypatch.undo()
    await replica.close()
    (line,) = [json.loads(text) for text in truth.read_text().splitlines()]
    # The stamp is taken as the last bytes are handed over, before the blocker they queued.
    assert sent_ns <= line["received_ns"] <= blockers[-1][0]
    assert line["received_ns"] < line["headers_ns"]


async def test_the_ground_truth_has_the_requests_first_byte_too(
    start_sim: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``first_byte_ns`` is when the request's first bytes arrived, ``received_ns`` its last:
    a request written in two parts has its second write between them, and the next request on
    the same connection starts its own first byte (the stamp starts over once answered)."""
    from aiohttp import web_protocol

    truth = tmp_path / "truth.jsonl"
    (replica,) = await start_sim(ground_truth_path=str(truth))
    arrived = asyncio.Event()
    original = web_protocol.RequestHandler.data_received

    def data_received(self: Any, data: bytes) -> None:
        if data:
            arrived.set()
        original(self, data)

    monkeypatch.setattr(web_protocol.RequestHandler, "data_received", data_received)
    payload = json.dumps({"prompt": "x", "max_tokens": 2, "ignore_eos": True}).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json"
        b"\r\nContent-Length: %d\r\n\r\n" % len(payload)
    )
    reader, writer = await asyncio.open_connection(replica.host, replica.port)
    middles: list[int] = []
    for _ in range(2):
        arrived.clear()
        writer.write(head + payload[:5])
        await arrived.wait()  # the replica has the first part
        middles.append(time.perf_counter_ns())
        writer.write(payload[5:])
        status = await reader.readline()
        assert status.startswith(b"HTTP/1.1 200")
        length = 0
        while (line := await reader.readline()) != b"\r\n":
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        await reader.readexactly(length)
    writer.close()
    monkeypatch.undo()
    await replica.close()
    first, second = [json.loads(text) for text in truth.read_text().splitlines()]
    for line, middle in ((first, middles[0]), (second, middles[1])):
        assert line["first_byte_ns"] <= middle <= line["received_ns"]
    assert first["received_ns"] < second["first_byte_ns"]


async def test_a_large_prompt_is_tokenized_off_the_loop_in_slices(
    start_sim: Any, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sidecar.sim import planning

    (replica,) = await start_sim(
        engine_max_model_len=200_000, engine_max_num_batched_tokens=200_000
    )
    calls: list[tuple[str, int]] = []
    encode = tokenizer.encode

    def spy(text: str, add_special_tokens: bool = True, slice_chars: int = 0) -> list[int]:
        import threading

        calls.append((threading.current_thread().name, slice_chars))
        return encode(text, add_special_tokens, slice_chars)

    monkeypatch.setattr(tokenizer, "encode", spy)
    small = "a small prompt"
    large = " ".join(f"w{i % 977}x" for i in range(planning.OFFLOAD_BODY_BYTES // 3))
    for prompt in (small, large):
        _, raw, _ = await post(
            session, replica.url + COMPLETIONS, {"prompt": prompt, "max_tokens": 1}
        )
        assert json.loads(raw)["usage"]["prompt_tokens"] == len(encode(prompt))
    (small_thread, small_slices), (large_thread, large_slices) = calls
    assert small_thread == "MainThread" and small_slices == 0
    assert large_thread.startswith("sim-tokenizer-0") and large_slices > 0


def test_tokenizing_in_slices_gives_the_same_ids() -> None:
    import random

    rng = random.Random(7)
    alphabet = " \t\n\u00a0\u2003ab.,\u00e9\u6f22"
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 120)))
        whole = tokenizer.encode(text)
        for slice_chars in (1, 2, 5, 33):
            assert tokenizer.encode(text, slice_chars=slice_chars) == whole
        assert whole == [tokenizer.BOS_ID] + [
            tokenizer.piece_id(piece) for piece in tokenizer.split_pieces(text)
        ]


async def test_a_replica_is_warm_at_start_and_the_warm_up_leaves_no_trace(
    start_sim: Any, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    truth = tmp_path / "truth.jsonl"
    (replica,) = await start_sim(ground_truth_path=str(truth))
    assert tokenizer._WORDS is not None  # the decode table a first answer would build
    assert replica.replica.planner.tokenizer_thread is not None  # and the tokenizer thread
    families = await scrape(session, replica.url)
    assert all(sample.value == 0 for sample in families["vllm:request_success"])
    assert truth.read_text() == ""
