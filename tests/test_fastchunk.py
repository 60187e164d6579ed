"""The fast path for vLLM's common chunks (the token chunk, and the finish, role and usage-only
chunks every stream has) says exactly what the general path says: the same `ChunkInfo`, and the
same bytes once the injected usage is cut, or nothing at all; and its C scanners (`_tokenscan.c`:
`scan`, the token chunk alone, for the lanes; `scan_chunk`, all of them) say exactly what the
regexes they stand for say, on every input."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_helpers import require_module
from vllm_chunks import (
    CHAT_BANG,
    CHAT_FINISH_032,
    CHAT_FINISH_USAGE_032,
    CHAT_HELLO,
    CHAT_ROLE,
    CHAT_ROLE_USAGE_032,
    CHAT_TOKEN_032,
    CHAT_USAGE,
    CHAT_USAGE_032,
    COMPLETION_FINISH_032,
    COMPLETION_HELLO,
    COMPLETION_TOKEN_032,
)

from sidecar.protocol.fastchunk import (
    NATIVE_SCAN,
    ChunkScan,
    TokenScan,
    cut_with_slices,
    fast_chunk,
    fast_chunk_from_scan,
    scan_common_chunk,
    scan_common_with_regex,
    scan_token_chunk,
    scan_with_regex,
)
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
    if NATIVE_SCAN:  # the scanners the data path runs on say what their specifications say
        assert scan_token_chunk(raw) == scan_with_regex(raw)
        assert scan_common_chunk(raw) == scan_common_with_regex(raw)
        assert fast_chunk(raw) == fast_chunk_from_scan(raw)
    token, common = scan_with_regex(raw), scan_common_with_regex(raw)
    if token is not None:  # a token chunk is a common chunk, read the same
        assert common is not None and common[:10] == (0, *token) and common[10:] == (-1,) * 4
    fast = fast_chunk(raw)
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


def test_vllms_chunks_take_the_fast_path_and_agree() -> None:
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
    # The other chunks of every stream: role, finish (with usage or with the fingerprint),
    # usage-only, in 0.33's shapes (spec/vllm-protocol.md A1) and 0.32's (the real server).
    for payload in (
        CHAT_ROLE,
        with_usage(CHAT_ROLE, 0),
        CHAT_ROLE_USAGE_032,
        CHAT_BANG,
        with_usage(CHAT_BANG.replace(',"system_fingerprint":"vllm-0.33.0-1a2b3c4d"', ""), 3),
        CHAT_FINISH_032,
        CHAT_FINISH_USAGE_032,
        COMPLETION_FINISH_032,
        CHAT_USAGE,
        CHAT_USAGE_032,
        CHAT_BANG.replace('"!"', '""'),  # a finish without text: an EMPTY event
        CHAT_BANG.replace('"stop_reason":null', '"stop_reason":128009'),  # a stop token
        CHAT_BANG.replace('"stop_reason":null', '"stop_reason":"</s>"'),  # a stop string
        CHAT_ROLE.replace('"assistant"', '""'),  # no role: EMPTY
    ):
        assert check(payload), payload


def test_the_common_chunks_are_read_by_hand() -> None:
    """Hand-worked: what the fast path says of each of 0.32's chunks."""
    kinds = {
        CHAT_ROLE_USAGE_032: (ChunkKind.ROLE, None, 0, 0, None),
        CHAT_FINISH_032: (ChunkKind.TOKEN, "length", 0, None, "vllm-0.32.0-0384aa49"),
        CHAT_FINISH_USAGE_032: (ChunkKind.TOKEN, "length", 0, 3, None),
        COMPLETION_FINISH_032: (ChunkKind.TOKEN, "length", 0, None, "vllm-0.32.0-0384aa49"),
        CHAT_USAGE_032: (ChunkKind.USAGE, None, None, 3, "vllm-0.32.0-0384aa49"),
        CHAT_BANG.replace('"!"', '""'): (ChunkKind.EMPTY, "stop", 0, None, "vllm-0.33.0-1a2b3c4d"),
    }
    for payload, (kind, reason, index, completion, fingerprint) in kinds.items():
        fast = fast_chunk(event(payload))
        assert fast is not None, payload
        info = fast[0]
        assert (info.kind, info.finish_reason, info.choice_index) == (kind, reason, index)
        assert (None if info.usage is None else info.usage.completion_tokens) == completion
        assert info.system_fingerprint == fingerprint


def test_everything_else_takes_the_general_path() -> None:
    for payload in (
        CHAT_HELLO.replace('"Hello"', '""'),  # empty content and no finish: not a token
        CHAT_HELLO.replace('"model":"M"', '"model":"a\\/b"'),  # an escaped name
        CHAT_HELLO.replace('"index":0', '"index":01'),  # not JSON
        CHAT_HELLO.replace('"Hello"', '"a\\qb"'),  # an escape JSON lacks
        with_usage(CHAT_HELLO, 10**19),  # beyond int64
        CHAT_HELLO + " ",
        CHAT_USAGE.replace(
            '"completion_tokens":3',
            '"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":4}',
        ),  # cached tokens
        CHAT_USAGE.replace(
            '"system_fingerprint"', '"metrics":{"queue_time_ms":1.5},"system_fingerprint"'
        ),  # vLLM's per-request metrics
        CHAT_USAGE.replace(
            ',"usage":{"prompt_tokens":12,"total_tokens":15,"completion_tokens":3}', ""
        ),  # no choice, no usage
        CHAT_BANG.replace('"stop_reason":null', '"stop_reason":"a\\"b"'),  # an escaped stop
        CHAT_BANG.replace('"stop"', '"st\\u006fp"'),  # an escaped finish reason
        CHAT_BANG.replace('"logprobs":null', '"logprobs":{"content":[]}'),
        CHAT_ROLE.replace('"content":""', '"content":"x"'),  # a role chunk with text
        CHAT_ROLE.replace(',"content":""', ""),
        CHAT_HELLO.replace(
            '"delta":{"content":"Hello"}',
            '"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{"}}]}',
        ),
    ):
        assert not check(payload), payload


TEXT = st.text(alphabet=st.characters(codec="utf-8"), min_size=0, max_size=12)


@settings(max_examples=600, deadline=None)
@given(
    content=TEXT,
    model=TEXT,
    rid=TEXT,
    index=st.integers(0, 2**40),
    completion=st.one_of(st.none(), st.integers(0, 2**70)),
    chat=st.booleans(),
    ascii_only=st.booleans(),
    shape=st.sampled_from(["token", "finish", "role", "usage_only"]),
    finish=TEXT,
    stop=st.one_of(st.none(), st.integers(0, 2**70), TEXT),
    fingerprint=st.one_of(st.none(), TEXT),
)
@example(  # DEL escaped by ensure_ascii: no fast path (found by this test)
    content="0", model="\x7f", rid="", index=0, completion=None, chat=False, ascii_only=True,
    shape="token", finish="", stop=None, fingerprint=None,
)  # fmt: skip
def test_generated_chunks_agree(
    content: str,
    model: str,
    rid: str,
    index: int,
    completion: int | None,
    chat: bool,
    ascii_only: bool,
    shape: str,
    finish: str,
    stop: int | str | None,
    fingerprint: str | None,
) -> None:
    """vLLM's shapes with generated names, texts and numbers: the fast path answers only what
    the general path answers the same."""
    reason = finish if shape == "finish" else None
    choice: dict[str, Any] = (
        {
            "index": index,
            "delta": {"content": content},
            "logprobs": None,
            "finish_reason": reason,
            **({"stop_reason": stop} if reason is not None else {}),
            "token_ids": None,
            **({"weight_versions": None} if reason is not None else {}),
        }
        if chat
        else {
            "index": index,
            "text": content,
            "logprobs": None,
            "finish_reason": reason,
            "stop_reason": stop if reason is not None else None,
            "prompt_token_ids": None,
            "token_ids": None,
            "weight_versions": None,
        }
    )
    if shape == "role":
        choice = {
            "index": index,
            "delta": {"role": content, "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    obj: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": 1,
        "model": model,
        "choices": [] if shape == "usage_only" else [choice],
    }
    if completion is not None:
        obj["usage"] = {
            "prompt_tokens": 3,
            "total_tokens": 3 + completion,
            "completion_tokens": completion,
            "completion_tokens_details": None,
        }
    if fingerprint is not None:
        obj["system_fingerprint"] = fingerprint
    if shape == "role":
        obj["prompt_token_ids"] = obj["prompt_text"] = None
    obj["kv_transfer_params"] = None
    payload = json.dumps(obj, separators=(",", ":"), ensure_ascii=ascii_only)
    answered = check(payload)

    def plain(name: str) -> bool:  # written without an escape: the fast path reads it
        # ensure_ascii escapes DEL (0x7f) too: json's ASCII escaping keeps " " to "~" only.
        return not any(c in '"\\' or c < " " or (ascii_only and c > "~") for c in name)

    # Whatever the fast path does not take must be something it is meant to leave alone.
    expected = (
        plain(rid)
        and plain(model)
        and index < 10**18
        and (completion is None or completion < 10**15 - 3)
        and (fingerprint is None or plain(fingerprint))
    )
    if shape == "token":
        expected = expected and content != ""
    elif shape == "finish":
        expected = expected and plain(finish)
        if isinstance(stop, int):
            expected = expected and stop < 10**18
        elif stop is not None:
            expected = expected and plain(stop)
    elif shape == "role":
        expected = expected and plain(content)
    else:
        expected = expected and completion is not None
    assert answered == expected, payload


@settings(max_examples=400, deadline=None)
@given(position=st.integers(0, 400), byte=st.integers(0, 255))
def test_a_byte_out_of_place_never_makes_the_paths_disagree(position: int, byte: int) -> None:
    raw = bytearray(with_usage(CHAT_HELLO, 7).encode())
    raw[position % len(raw)] = byte
    payload = raw.decode("utf-8", "replace")
    if "\n" in payload or "\r" in payload:
        return  # no longer one event
    check(payload)


# -- the C scanner against the regex ---------------------------------------------------------


def native_scan() -> Callable[[bytes], TokenScan | None]:
    """The C scanner: built by `pip install -e .` wherever a C compiler is (fails in CI, skips
    elsewhere without it)."""
    module = require_module("sidecar.protocol._tokenscan", "-e . (with a C compiler: gcc)")
    scan: Callable[[bytes], TokenScan | None] = module.scan
    return scan


Scanner = Callable[[bytes], "TokenScan | ChunkScan | None"]


def native_and_regex(wide: bool) -> tuple[Scanner, Scanner]:
    """A C scanner and the regex it stands for: the token chunk's (``scan``, the lanes'), or
    the common chunks' (``scan_chunk``, the general path's fast path)."""
    module = require_module("sidecar.protocol._tokenscan", "-e . (with a C compiler: gcc)")
    if wide:
        return module.scan_chunk, scan_common_with_regex
    return module.scan, scan_with_regex


SCANNERS = pytest.mark.parametrize("wide", [False, True], ids=["scan", "scan_chunk"])


def event(payload: str) -> bytes:
    return b"data: " + payload.encode("utf-8", "surrogatepass") + b"\n\n"


BASES = [
    event(payload)
    for payload in (
        CHAT_HELLO,
        with_usage(CHAT_HELLO, 7),
        with_usage(CHAT_HELLO, 123456, details=False),
        COMPLETION_HELLO,
        with_usage(COMPLETION_HELLO, 1, details=False),
        CHAT_TOKEN_032,
        COMPLETION_TOKEN_032,
        CHAT_HELLO.replace('"Hello"', '"a\\u00e9\\n\\"b\\\\"'),  # every kind of escape
        CHAT_HELLO.replace('"model":"M"', '"model":""').replace('"chatcmpl-abc123"', '""'),
        CHAT_ROLE,
        CHAT_ROLE_USAGE_032,
        CHAT_BANG,
        CHAT_FINISH_USAGE_032,
        COMPLETION_FINISH_032,
        CHAT_USAGE_032,
        CHAT_BANG.replace('"!"', '""').replace('"stop_reason":null', '"stop_reason":"</s>"'),
        COMPLETION_FINISH_032.replace('"stop_reason":null', '"stop_reason":7'),
    )
]


def test_the_native_scanner_reads_vllms_chunks_as_the_regex_does() -> None:
    scan, regex = native_and_regex(wide=False)
    wide, wide_regex = native_and_regex(wide=True)
    for data in BASES:
        answer = wide(data)
        assert answer is not None, data
        assert answer == wide_regex(data), data
        assert scan(data) == regex(data), data
    assert sum(scan(data) is not None for data in BASES) == 9  # the token chunks
    # Hand-worked: where each part is in a chunk with usage.
    data = event(with_usage(CHAT_HELLO, 7))
    index, prompt, total, completion, start, end, id_end, model_start, model_end = scan(data)  # type: ignore[misc]
    assert (index, prompt, total, completion) == (0, 12, 19, 7)
    assert data[start:end] == (
        b',"usage":{"prompt_tokens":12,"total_tokens":19,"completion_tokens":7,'
        b'"completion_tokens_details":null}'
    )
    assert data[13:id_end] == b"chatcmpl-abc123"
    assert data[model_start:model_end] == b"M"
    assert scan(event(CHAT_HELLO))[1:6] == (None, None, None, -1, -1)  # type: ignore[index]


@pytest.mark.parametrize(
    "payload",
    [
        CHAT_HELLO.replace('"index":0', '"index":' + "9" * 18),  # the longest index
        CHAT_HELLO.replace('"index":0', '"index":' + "9" * 19),  # one digit too many
        CHAT_HELLO.replace('"index":0', '"index":00'),
        CHAT_HELLO.replace('"index":0', '"index":-1'),
        CHAT_HELLO.replace('"created":1700000000', '"created":' + "1" * 18),
        CHAT_HELLO.replace('"created":1700000000', '"created":' + "1" * 19),
        CHAT_HELLO.replace('"created":1700000000', '"created":0'),
        with_usage(CHAT_HELLO, 10**14),  # 15 digits: taken
        with_usage(CHAT_HELLO, 10**15),  # 16: not
        with_usage(CHAT_HELLO, 0),
        CHAT_HELLO.replace('"Hello"', '""'),
        CHAT_HELLO.replace('"Hello"', '"\\u00zz"'),
        CHAT_HELLO.replace('"Hello"', '"\\u00e"'),
        CHAT_HELLO.replace('"Hello"', '"\\x"'),
        CHAT_HELLO.replace('"Hello"', '"\\"'),
        CHAT_HELLO.replace('"Hello"', '"a\tb"'),  # a raw control byte
        CHAT_HELLO.replace('"Hello"', '"\x7f\u00ff"'),  # DEL and UTF-8: plain bytes
        CHAT_HELLO.replace('"model":"M"', '"model":"M\\/"'),
        CHAT_HELLO.replace('"chat.completion.chunk"', '"text_completion"'),
        CHAT_HELLO.replace('"chat.completion.chunk"', '"chat.completion"'),
        CHAT_HELLO.replace(',"kv_transfer_params":null', ""),
        CHAT_HELLO.replace(',"kv_transfer_params":null', ',"kv_transfer_params":{}'),
        COMPLETION_HELLO.replace(',"weight_versions":null', ""),
        COMPLETION_HELLO.replace('"text":"Hello"', '"delta":{"content":"Hello"}'),
        # the other common chunks (scan_chunk's; scan refuses them all)
        CHAT_BANG.replace('"stop"', '""'),
        CHAT_BANG.replace('"stop_reason":null', '"stop_reason":' + "9" * 18),
        CHAT_BANG.replace('"stop_reason":null', '"stop_reason":' + "9" * 19),
        CHAT_BANG.replace('"stop_reason":null', '"stop_reason":-1'),
        CHAT_BANG.replace('"stop_reason":null', '"stop_reason":""'),
        CHAT_BANG.replace('"stop_reason":null', '"stop_reason":"\\n"'),
        CHAT_BANG.replace(',"weight_versions":null', ""),
        CHAT_BANG.replace(',"token_ids":null', ""),
        CHAT_BANG.replace('"vllm-0.33.0-1a2b3c4d"', '""'),
        CHAT_BANG.replace('"vllm-0.33.0-1a2b3c4d"', '"a\\/b"'),
        CHAT_BANG.replace('"vllm-0.33.0-1a2b3c4d"', "null"),
        CHAT_HELLO.replace('"finish_reason":null', '"finish_reason":"stop"'),  # no stop_reason
        COMPLETION_HELLO.replace('"finish_reason":null', '"finish_reason":"length"'),
        COMPLETION_HELLO.replace(
            '"finish_reason":null,"stop_reason":null', '"finish_reason":"length","stop_reason":3'
        ),
        COMPLETION_FINISH_032.replace('"eature"', '""'),
        CHAT_ROLE.replace('"assistant"', '"a\\u0062"'),
        CHAT_ROLE.replace(',"prompt_token_ids":null,"prompt_text":null', ""),
        CHAT_ROLE.replace(',"prompt_text":null', ""),
        CHAT_ROLE_USAGE_032.replace('"completion_tokens":0', '"completion_tokens":' + "9" * 15),
        CHAT_USAGE_032.replace('"choices":[]', '"choices":[ ]'),
        CHAT_USAGE_032.replace(',"system_fingerprint":"vllm-0.32.0-0384aa49"', ""),
        CHAT_USAGE_032.replace(
            '"completion_tokens":3}', '"completion_tokens":3,"completion_tokens_details":null}'
        ),
        CHAT_USAGE_032.replace(
            ',"usage":{"prompt_tokens":17,"total_tokens":20,"completion_tokens":3}', ""
        ),
    ],
)
@SCANNERS
def test_the_native_scanner_agrees_on_the_edges(payload: str, wide: bool) -> None:
    data = event(payload)
    scan, regex = native_and_regex(wide)
    assert scan(data) == regex(data)


@SCANNERS
def test_the_native_scanner_agrees_at_every_cut_and_every_byte_out_of_place(wide: bool) -> None:
    """Every prefix and suffix of each base, every single byte deleted, and every position
    overwritten with each byte the grammar cares about: the two scanners give one answer."""
    scan, scan_with_regex = native_and_regex(wide)
    specials = b'"\\/{}[],:0123456789-eE.nul tabfrx\x00\x1f\n\x7f\x80\xff'
    for data in BASES:
        variants = [data[:n] for n in range(len(data))] + [data[n:] for n in range(1, 40)]
        variants += [data[:n] + data[n + 1 :] for n in range(len(data))]
        for n in range(len(data)):
            for byte in specials:
                variants.append(data[:n] + bytes((byte,)) + data[n + 1 :])
        for variant in variants:
            assert scan(variant) == scan_with_regex(variant), variant
            if wide:  # and the ChunkInfo built from it, in C and in Python
                assert fast_chunk(variant) == fast_chunk_from_scan(variant), variant


@settings(max_examples=300, deadline=None)
@given(
    st.binary(max_size=64), st.binary(max_size=64), st.integers(0, len(BASES) - 1), st.booleans()
)
def test_the_native_scanner_agrees_with_junk_spliced_in(
    head: bytes, tail: bytes, which: int, wide: bool
) -> None:
    scan, regex = native_and_regex(wide)
    data = BASES[which]
    cut = len(head) % len(data)
    for variant in (head + data, data + tail, data[:cut] + head + data[cut:], head, tail):
        assert scan(variant) == regex(variant)


def test_the_native_scanner_takes_any_bytes_like_and_refuses_the_rest() -> None:
    native_scan()
    from sidecar.protocol._tokenscan import scan, scan_chunk

    data = BASES[1]
    assert scan(data) is not None
    assert scan(bytearray(data)) == scan(memoryview(data)) == scan(data)
    assert scan_chunk(bytearray(data)) == scan_chunk(memoryview(data)) == scan_chunk(data)
    with pytest.raises(TypeError):
        scan("data: {}")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        scan_chunk("data: {}")  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 300), st.integers(0, 300))
def test_the_native_cut_is_the_slices(data: bytes, a: int, b: int) -> None:
    native_scan()
    from sidecar.protocol._tokenscan import cut

    start, end = sorted((a % (len(data) + 1), b % (len(data) + 1)))
    assert cut(data, start, end) == cut_with_slices(data, start, end) == data[:start] + data[end:]


def test_the_native_cut_refuses_a_span_outside_the_bytes() -> None:
    native_scan()
    from sidecar.protocol._tokenscan import cut

    for start, end in ((-1, 2), (3, 2), (0, 6), (6, 6)):
        with pytest.raises(ValueError, match="not within"):
            cut(b"hello", start, end)
    with pytest.raises(TypeError):
        cut(bytearray(b"hello"), 0, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        cut(b"hello", 0)  # type: ignore[call-arg]
