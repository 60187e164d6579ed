"""The real server is there and speaks as expected: the suite's first case."""

from __future__ import annotations

import json

from sidecar.realvllm import VLLM_VERSION
from sidecar.realvllm.server import http_get

from .real_server import RealVLLM, post_json, sse_data


def test_version_is_the_pinned_one(real_vllm: RealVLLM) -> None:
    status, body = http_get(real_vllm.base_url + "/version", timeout=10)
    assert status == 200
    assert json.loads(body) == {"version": VLLM_VERSION}
    assert real_vllm.version == VLLM_VERSION


def test_streamed_chat_completion_counts_its_tokens(real_vllm: RealVLLM) -> None:
    status, raw = post_json(
        real_vllm.base_url,
        "/v1/chat/completions",
        {
            "model": real_vllm.model,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert status == 200, raw[:500]
    events = sse_data(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(data) for data in events[:-1]]
    assert chunks and all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert all(chunk["model"] == real_vllm.model for chunk in chunks)
    finishes = [
        choice["finish_reason"]
        for chunk in chunks
        for choice in chunk["choices"]
        if choice.get("finish_reason")
    ]
    assert finishes == ["length"]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["completion_tokens"] == 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + 8
