"""The fast path for the common token chunk says exactly what the general path says: the same
`ChunkInfo`, and the same bytes once the injected usage is cut, or nothing at all."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from vllm_chunks import (
    CHAT_BANG,
    CHAT_HELLO,
    CHAT_ROLE,
    CHAT_TOKEN_032,
    CHAT_USAGE,
    COMPLETION_HELLO,
    COMPLETION_TOKEN_032,
)

from sidecar.protocol.fastchunk import fast_token_chunk
from sidecar.protocol.openai import ChunkKind, classify_chunk
from sidecar.protocol.rewrite import without_usage
from sidecar.protocol.sse import SSEParser


def event_of(payload: str) -> tuple[bytes, str]:
    (event,) = SSEParser().feed(b"data: " + payload.encode("utf-8", "surrogatepass") + b"\n\n")
    assert event.data is not None
    return event.raw, event.data


def check(payload: str) -> bool:
    """Fast path == general path whenever the fast path answers; True if it answered."""
    raw, data = event_of(payload)
    fast = fast_token_chunk(raw)
    if fast is None:
        return False
    info, start, end = fast
    assert info == classify_chunk(data)
    if info.usage is None:
        assert (start, end) == (-1, -1)
    else:
        stripped, cut, reencoded = without_usage(raw, data)
        assert not reencoded and (raw[:start] + raw[end:], start) == (stripped, cut)
    return True


def with_usage(payload: str, completion: int, details: bool = True) -> str:
    obj = json.loads(payload)
    usage: dict[str, Any] = {
        "prompt_tokens": 12,
        "total_tokens": 12 + completion,
        "completion_tokens": completion,
    }
    if details:
        usage["completion_tokens_details"] = None
    out: dict[str, Any] = {}
    for key, value in obj.items():
        out[key] = value
        if key == "choices":
            out["usage"] = usage
    return json.dumps(out, separators=(",", ":"), ensure_ascii=False)


def test_vllms_token_chunks_take_the_fast_path_and_agree() -> None:
    assert check(CHAT_HELLO)
    assert check(with_usage(CHAT_HELLO, 2))
    assert check(COMPLETION_HELLO)
    assert check(with_usage(COMPLETION_HELLO, 1, details=False))  # completions: no details
    # vLLM 0.32.0, as the real server sends them (no kv_transfer_params, no weight_versions):
    # before this was seen, every 0.32 token chunk took the general path.
    assert check(CHAT_TOKEN_032)
    assert check(with_usage(CHAT_TOKEN_032, 1))
    assert check(COMPLETION_TOKEN_032)
    assert check(with_usage(COMPLETION_TOKEN_032, 1, details=False))


def test_everything_else_takes_the_general_path() -> None:
    for payload in (
        CHAT_ROLE,
        CHAT_BANG,
        CHAT_USAGE,
        with_usage(CHAT_BANG, 3),
        CHAT_HELLO.replace('"Hello"', '""'),  # empty content: not a token
        CHAT_HELLO.replace('"model":"M"', '"model":"a\\/b"'),  # an escaped name
        CHAT_HELLO.replace('"index":0', '"index":01'),  # not JSON
        CHAT_HELLO.replace('"Hello"', '"a\\qb"'),  # an escape JSON lacks
        with_usage(CHAT_HELLO, 10**19),  # beyond int64
        CHAT_HELLO + " ",
    ):
        assert not check(payload), payload


TEXT = st.text(alphabet=st.characters(codec="utf-8"), min_size=0, max_size=12)


@settings(max_examples=400, deadline=None)
@given(
    content=TEXT,
    model=TEXT,
    rid=TEXT,
    index=st.integers(0, 2**40),
    completion=st.one_of(st.none(), st.integers(0, 2**70)),
    chat=st.booleans(),
    ascii_only=st.booleans(),
)
def test_generated_chunks_agree(
    content: str,
    model: str,
    rid: str,
    index: int,
    completion: int | None,
    chat: bool,
    ascii_only: bool,
) -> None:
    choice: dict[str, Any] = (
        {
            "index": index,
            "delta": {"content": content},
            "logprobs": None,
            "finish_reason": None,
            "token_ids": None,
        }
        if chat
        else {
            "index": index,
            "text": content,
            "logprobs": None,
            "finish_reason": None,
            "stop_reason": None,
            "prompt_token_ids": None,
            "token_ids": None,
            "weight_versions": None,
        }
    )
    obj: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": 1,
        "model": model,
        "choices": [choice],
    }
    if completion is not None:
        obj["usage"] = {
            "prompt_tokens": 3,
            "total_tokens": 3 + completion,
            "completion_tokens": completion,
            "completion_tokens_details": None,
        }
    obj["kv_transfer_params"] = None
    payload = json.dumps(obj, separators=(",", ":"), ensure_ascii=ascii_only)
    answered = check(payload)
    if answered:
        assert classify_chunk(event_of(payload)[1]).kind is ChunkKind.TOKEN


@settings(max_examples=400, deadline=None)
@given(position=st.integers(0, 400), byte=st.integers(0, 255))
def test_a_byte_out_of_place_never_makes_the_paths_disagree(position: int, byte: int) -> None:
    raw = bytearray(with_usage(CHAT_HELLO, 7).encode())
    raw[position % len(raw)] = byte
    payload = raw.decode("utf-8", "replace")
    if "\n" in payload or "\r" in payload:
        return  # no longer one event
    check(payload)
