"""The request head reader (sidecar/proxy/requesthead.py): the proxy reads the members it
needs as Python's json would, without decoding the prompt; and a proxy that read only the head
still sends the upstream the body it sent before (appended usage options, a re-encoded
stream_options with the whole prompt in it)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from proxy_stack import proxy_to, scripted_upstream

from sidecar.protocol.rewrite import plan_usage, request_with_usage
from sidecar.proxy.requesthead import HEAD_MEMBERS, read_head, read_whole


def test_only_the_members_present_are_read_and_null_is_kept() -> None:
    raw = (
        b'{"model":"m","messages":[{"role":"user","content":"a long prompt"}],'
        b'"stream":true,"stream_options":null,"max_tokens":7,"temperature":0.5}'
    )
    assert read_head(raw) == {
        "model": "m",
        "stream": True,
        "stream_options": None,
        "max_tokens": 7,
    }


def test_the_last_of_a_duplicated_member_and_escaped_names_read_as_json_reads_them() -> None:
    raw = b'{"model":"first","mod\\u0065l":"second","stream":"yes"}'
    assert read_head(raw) == {"model": "second", "stream": "yes"}
    assert json.loads(raw)["model"] == "second"


def test_what_msgspec_refuses_is_read_by_json() -> None:
    # NaN in the prompt, a byte-order mark, UTF-16, a lone surrogate escape: json reads them
    # (vLLM too), so the proxy reads them whole, as before.
    nan = b'{"model":"m","stream":true,"messages":[{"content":"x","weight":NaN}]}'
    assert read_head(nan)["model"] == "m" and read_head(nan)["stream"] is True
    assert read_head(b'\xef\xbb\xbf{"model":"m"}') == {"model": "m"}
    assert read_head('{"model":"m"}'.encode("utf-16")) == {"model": "m"}
    assert read_head(b'{"model":"m\\ud800"}') == {"model": "m\ud800"}
    # Not an object: what json makes of it, and None when it is not JSON.
    assert read_head(b"[1, 2]") == [1, 2]
    assert read_head(b"7") == 7
    assert read_head(b'{"model":"m"} trailing') is None
    assert read_head(b"") is None
    assert read_head(b"[" * 100_000) is None  # too deep for both readers
    assert read_whole(b"not json") is None


_JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.text(max_size=8)
_JSON = st.recursive(
    _JSON_SCALARS | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.sampled_from([*HEAD_MEMBERS, "messages", "prompt", "n"]), _JSON),
    st.booleans(),
)
def test_the_head_is_the_whole_body_restricted_to_its_members(
    body: dict[str, Any], ascii_only: bool
) -> None:
    raw = json.dumps(body, ensure_ascii=ascii_only).encode("utf-8")
    whole = json.loads(raw)
    assert read_head(raw) == {k: v for k, v in whole.items() if k in HEAD_MEMBERS}


def test_a_stream_options_edit_keeps_the_whole_body() -> None:
    raw = (
        b'{"model":"m","messages":[{"role":"user","content":"caf\xc3\xa9"}],"stream":true,'
        b'"stream_options":{"include_usage":true}}'
    )
    head = read_head(raw)
    sent = json.loads(request_with_usage(raw, head, plan_usage(head, inject=True)))
    assert sent == {
        "model": "m",
        "messages": [{"role": "user", "content": "café"}],
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


def test_invalid_utf8_in_a_skipped_prompt_is_sent_as_the_client_sent_it() -> None:
    raw = b'{"model":"m","stream":true,"stream_options":{},"messages":[{"content":"\xff"}]}'
    head = read_head(raw)  # msgspec does not check the strings it skips
    assert head["stream"] is True
    assert request_with_usage(raw, head, plan_usage(head, inject=True)) == raw


async def test_the_upstream_gets_the_body_it_got_before_through_a_running_proxy() -> None:
    """Three bodies through a real proxy to an upstream that keeps what it received: options
    appended to the client's bytes, an existing stream_options edited with the long prompt kept,
    and a non-streaming body sent as it came."""
    received: list[bytes] = []
    done = (
        b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
        b'"choices":[{"index":0,"delta":{"content":"x"},"logprobs":null,"finish_reason":"stop"}]'
        b',"usage":{"prompt_tokens":1,"total_tokens":2,"completion_tokens":1}}\n\n'
        b"data: [DONE]\n\n"
    )

    async def keep(request: web.Request) -> web.StreamResponse:
        received.append(await request.read())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(done)
        await response.write_eof()
        return response

    prompt = "é" + "word " * 100_000  # ~500 KB, not ASCII
    appended = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": prompt}], "stream": True}
    ).encode()
    edited = json.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": prompt}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    whole = json.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}]}).encode()
    async with (
        scripted_upstream("/v1/chat/completions", keep) as upstream,
        proxy_to(upstream) as (server, _records),
        aiohttp.ClientSession() as session,
    ):
        for raw in (appended, edited, whole):
            async with session.post(
                server.url + "/v1/chat/completions",
                data=raw,
                headers={"Content-Type": "application/json"},
            ) as response:
                assert response.status == 200
                await response.read()
    usage = b'"stream_options":{"include_usage":true,"continuous_usage_stats":true}'
    assert received[0] == appended[:-1] + b"," + usage + b"}"
    assert json.loads(received[1]) == {
        **json.loads(edited),
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    assert received[2] == whole
