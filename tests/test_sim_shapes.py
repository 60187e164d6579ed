"""The simulator's logprobs, echo, stop strings, tool refusals and merged deltas, over real
sockets, against shapes checked by hand on vLLM 0.32.0's own answers (the conformance suite,
tests/conformance/test_relay.py, holds them to the live server) and vLLM's source.

Greedy requests (temperature 0) are answered as a function of the prompt, so a test can ask
once without and once with a feature and compare the two answers.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from proxy_stack import FAST_ENGINE, stack
from wire import events, post

from sidecar.record import Outcome
from sidecar.sim import tokenizer
from sidecar.sim.faults import FAULT_HEADER
from sidecar.sim.sampling import LogprobSource, StopChecker, check_stop_strings
from sidecar.sim.server import RunningReplica, SimConfig, close_replicas, start_replicas

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture
async def sim() -> AsyncIterator[RunningReplica]:
    config = SimConfig(model="tiny", vllm_version="0.32.0", engine=FAST_ENGINE)
    (replica,) = await start_replicas(config, 1)
    try:
        yield replica
    finally:
        await close_replicas([replica])


def completion(**extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": "Once upon a time",
        "max_tokens": 4,
        "ignore_eos": True,
        "temperature": 0,
        **extra,
    }


def chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 3,
        "ignore_eos": True,
        "temperature": 0,
        **extra,
    }


# ---------------------------------------------------------------- the pieces


def test_stop_strings_are_found_as_vllm_finds_them() -> None:
    # The real server's "mplate" with stop ["e", "a"]: "a" completes first (index 3), so the
    # text is cut to "mpl" (with include_stop_str_in_output: to "mpla").
    assert check_stop_strings("mplate", 6, ["e", "a"], False) == ("a", 3)
    assert check_stop_strings("mplate", 6, ["e", "a"], True) == ("a", 4)
    assert check_stop_strings("mplate", 6, ["e"], True) == ("e", -1)  # ends the text: no cut
    assert check_stop_strings("mplate", 0, ["e"], False) is None  # nothing new to search
    # Only the new text (and a stop string's length before it) is searched.
    assert check_stop_strings("a kalo", 3, ["a "], False) is None


def test_a_long_stop_string_holds_back_the_text_that_may_begin_it() -> None:
    checker = StopChecker(["kalo mi"], include=False, min_tokens=0)
    assert checker.buffer_length == 6
    ids = [t for t in range(256, 4096) if tokenizer.token_text(t) == " kalo"][:1]
    assert ids, "a token that decodes to ' kalo'"
    assert checker.update(ids) is None
    assert checker.next_text(finished=False) == ""  # " kalo" is 5 characters, all held back
    assert checker.next_text(finished=True) == " kalo"  # the finish releases it


def test_synthetic_logprobs_look_like_a_models() -> None:
    source = LogprobSource(seed=1, greedy=True, vocab_size=32000)
    position = source.sampled(300, 3)
    assert [entry.rank for entry in position] == [1, 2, 3]  # greedy: the sampled is the best
    assert position[0].token_id == 300
    values = [entry.logprob for entry in position]
    assert values == sorted(values, reverse=True) and values[0] < 0
    again = LogprobSource(seed=1, greedy=True, vocab_size=32000).sampled(300, 3)
    assert again == position  # the same seed, the same numbers
    sampled = LogprobSource(seed=2, greedy=False, vocab_size=32000)
    for _ in range(50):
        entries = sampled.sampled(400, 2)
        # The sampled token first; k alternatives besides it when it is not among the top k.
        assert entries[0].token_id == 400
        assert len(entries) == (2 if entries[0].rank <= 2 else 3)


# ---------------------------------------------------------------- logprobs


async def test_completion_logprobs_stream_in_vllms_shape(sim: RunningReplica) -> None:
    status, raw = await post(sim.url + COMPLETIONS, completion(logprobs=2, stream=True))
    assert status == 200
    chunks = events(raw)[:-1]
    assert len(chunks) == 4
    text = ""
    for chunk in chunks:
        (choice,) = chunk["choices"]
        logprobs = choice["logprobs"]
        # vLLM 0.32: text_offset, token_logprobs, tokens, top_logprobs; one token a chunk.
        assert list(logprobs) == ["text_offset", "token_logprobs", "tokens", "top_logprobs"]
        (token,) = logprobs["tokens"]
        assert token == choice["text"]
        assert logprobs["text_offset"] == [len(text)]
        (top,) = logprobs["top_logprobs"]
        assert len(top) == 2 and next(iter(top)) == token  # the sampled token first
        assert top[token] == logprobs["token_logprobs"][0] < 0
        text += choice["text"]
        assert list(choice)[:3] == ["index", "text", "logprobs"]


async def test_chat_logprobs_whole_and_streamed_agree(sim: RunningReplica) -> None:
    status, raw = await post(sim.url + CHAT, chat(logprobs=True, top_logprobs=2))
    assert status == 200
    whole = json.loads(raw)["choices"][0]
    content = whole["logprobs"]["content"]
    assert len(content) == 3
    first = content[0]
    assert list(first) == ["token", "logprob", "bytes", "top_logprobs"]
    assert first["bytes"] == list(first["token"].encode())
    assert [list(alt) for alt in first["top_logprobs"]] == [["token", "logprob", "bytes"]] * 2
    assert first["top_logprobs"][0]["token"] == first["token"]
    assert "".join(entry["token"] for entry in content) == whole["message"]["content"]
    # Streamed, the same request gives the same entries, one token a chunk; top_logprobs
    # absent means none (vLLM: an empty list).
    status, raw = await post(sim.url + CHAT, chat(logprobs=True, top_logprobs=2, stream=True))
    streamed = [c["choices"][0]["logprobs"] for c in events(raw)[:-1]]
    assert streamed[0] is None  # the role chunk
    assert [entry for lp in streamed[1:] for entry in lp["content"]] == content
    status, raw = await post(sim.url + CHAT, chat(logprobs=True, stream=True))
    assert all(
        entry["top_logprobs"] == []
        for c in events(raw)[1:-1]
        for entry in c["choices"][0]["logprobs"]["content"]
    )


@pytest.mark.parametrize(
    "body,message,param",
    [
        (
            chat(top_logprobs=2),
            "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)",
            "top_logprobs",
        ),
        (
            completion(logprobs=50),
            "Requested sample logprobs of 50, which is greater than max "
            "allowed: 20 (parameter=logprobs, value=50)",
            "logprobs",
        ),
        (
            completion(prompt_logprobs=1, stream=True),
            "`prompt_logprobs` are not available when `stream=True`. (parameter=prompt_logprobs)",
            "prompt_logprobs",
        ),
    ],
)
async def test_logprobs_refusals_are_vllms(
    sim: RunningReplica, body: dict[str, Any], message: str, param: str
) -> None:
    status, raw = await post(sim.url + (CHAT if "messages" in body else COMPLETIONS), body)
    assert status == 400
    assert json.loads(raw) == {
        "error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}
    }


# ---------------------------------------------------------------- echo


async def test_echo_puts_the_prompt_before_the_completion(sim: RunningReplica) -> None:
    _, plain = await post(sim.url + COMPLETIONS, completion())
    _, echoed = await post(sim.url + COMPLETIONS, completion(echo=True))
    completion_text = json.loads(plain)["choices"][0]["text"]
    assert json.loads(echoed)["choices"][0]["text"] == "Once upon a time" + completion_text
    # Streamed: the first chunk has the prompt's text before its delta and its token ids;
    # later chunks have prompt_token_ids null (vLLM 0.32's bytes).
    _, raw = await post(sim.url + COMPLETIONS, completion(echo=True, stream=True))
    chunks = [c["choices"][0] for c in events(raw)[:-1]]
    ids = tokenizer.encode("Once upon a time")
    assert chunks[0]["prompt_token_ids"] == ids
    assert chunks[0]["text"].startswith("Once upon a time")
    assert [c["prompt_token_ids"] for c in chunks[1:]] == [None] * 3
    assert "".join(c["text"] for c in chunks) == "Once upon a time" + completion_text
    # Token ids as the prompt: their decoded text is echoed.
    _, raw = await post(sim.url + COMPLETIONS, completion(prompt=[300, 301], echo=True))
    assert json.loads(raw)["choices"][0]["text"].startswith(tokenizer.decode([300, 301]))


async def test_echo_with_logprobs_scores_the_prompt_too(sim: RunningReplica) -> None:
    _, raw = await post(sim.url + COMPLETIONS, completion(echo=True, logprobs=1, max_tokens=2))
    choice = json.loads(raw)["choices"][0]
    logprobs = choice["logprobs"]
    prompt_len = len(tokenizer.encode("Once upon a time"))
    assert len(logprobs["tokens"]) == prompt_len + 2
    # The prompt's first token has no logprob (nothing came before it).
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    # prompt_logprobs: None first, then per token a dict keyed by token id, the prompt's own
    # token first with its rank (vLLM 0.32's bytes: {"1049":{"logprob":...,"rank":6184,
    # "decoded_token":"nce"},"6106":{...,"rank":1,...}}).
    prompt_logprobs = choice["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == prompt_len
    ids = tokenizer.encode("Once upon a time")
    for token_id, entries in zip(ids[1:], prompt_logprobs[1:], strict=True):
        first_key, first = next(iter(entries.items()))
        assert first_key == str(token_id) and list(first) == ["logprob", "rank", "decoded_token"]


# ---------------------------------------------------------------- stop strings


async def test_a_stop_string_ends_the_text_before_it(sim: RunningReplica) -> None:
    _, plain = await post(sim.url + COMPLETIONS, completion(max_tokens=8))
    words = json.loads(plain)["choices"][0]["text"].split(" ")[1:]
    stop = " " + words[2]  # the third token's word (every pseudo-word has a leading space)
    assert stop not in " " + " ".join(words[:2]), "pick a word not seen before it"
    _, raw = await post(sim.url + COMPLETIONS, completion(max_tokens=8, stop=[stop]))
    body = json.loads(raw)
    choice = body["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
        " " + " ".join(words[:2]),
        "stop",
        stop,
    )
    assert body["usage"]["completion_tokens"] == 3  # the token that held it counts
    _, raw = await post(
        sim.url + COMPLETIONS,
        completion(max_tokens=8, stop=[stop], include_stop_str_in_output=True),
    )
    assert json.loads(raw)["choices"][0]["text"] == " " + " ".join(words[:3])
    # Streamed: one chunk per token, each holding back the last len(stop) - 1 characters (a
    # stop string may be under way), so the first is empty (vLLM's detokenizer: a delta of
    # "" still goes out, its token counted); the stop string's chunk carries the rest.
    _, raw = await post(
        sim.url + COMPLETIONS,
        completion(max_tokens=8, stop=[stop], stream=True, stream_options={"include_usage": True}),
    )
    chunks = events(raw)
    texts = [c["choices"][0]["text"] for c in chunks[:3]]
    assert texts[0] == "" and "".join(texts) == " " + " ".join(words[:2])
    assert (chunks[2]["choices"][0]["finish_reason"], chunks[2]["choices"][0]["stop_reason"]) == (
        "stop",
        stop,
    )
    assert chunks[3]["usage"]["completion_tokens"] == 3


async def test_a_stop_string_in_the_first_token_streams_vllms_single_chunk(
    sim: RunningReplica,
) -> None:
    """vLLM 0.32 with stop ["e", "a"] on "Once upon a time": one chunk, text "mpl",
    finish_reason "stop", stop_reason "a", the fingerprint, then [DONE]. Every simulator word
    begins with a space."""
    _, raw = await post(sim.url + COMPLETIONS, completion(stop=[" "], stream=True))
    (chunk, done) = events(raw)
    assert done == "[DONE]"
    assert chunk["choices"] == [
        {
            "index": 0,
            "text": "",
            "logprobs": None,
            "finish_reason": "stop",
            "stop_reason": " ",
            "prompt_token_ids": None,
            "token_ids": None,
        }
    ]
    assert chunk["system_fingerprint"].startswith("vllm-0.32.0-")
    assert sim.replica.engine.stats().request_success_total["stop"] == 1


# ---------------------------------------------------------------- tools


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
            {"tool_choice": {"type": "function", "function": {"name": "weather"}}, "stream": True},
            'tool_choice=function "weather" requires --tool-call-parser to be set',
        ),
    ],
)
async def test_tool_use_is_refused_as_by_vllm_without_a_tool_parser(
    sim: RunningReplica, extra: dict[str, Any], message: str
) -> None:
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    status, raw = await post(sim.url + CHAT, chat(tools=tools, **extra))
    assert status == 400
    assert (
        raw
        == json.dumps(
            {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}},
            separators=(",", ":"),
        ).encode()
    )
    status, raw = await post(sim.url + CHAT, chat(tools=tools, tool_choice="none"))
    assert status == 200


# ---------------------------------------------------------------- merged deltas, counted


async def test_the_proxy_counts_every_token_when_the_simulator_merges_them() -> None:
    """A stalled writer (the fault) lets the engine run ahead: what piled up goes out as one
    delta of many tokens, as vLLM's RequestOutputCollector merges for a slow consumer. The
    proxy's record still counts each token, from the usage it asked for."""
    async with stack() as proxied:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                proxied.url + COMPLETIONS,
                json={"prompt": "x", "stream": True, "max_tokens": 40, "ignore_eos": True},
                headers={FAULT_HEADER: "stall_ms=100@after=2"},
            ) as response,
        ):
            raw = await response.read()
        (record,) = await proxied.records.wait_for(1)
    chunks = [c for c in events(raw) if c != "[DONE]"]
    token_chunks = [c for c in chunks if c["choices"]]
    assert len(token_chunks) < 40  # merged: fewer deltas than tokens
    assert all("usage" not in c for c in chunks)  # the injected usage is cut back out
    assert record.outcome is Outcome.OK
    assert record.n_out == 40
