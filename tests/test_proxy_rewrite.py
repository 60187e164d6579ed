from __future__ import annotations

import json

import pytest

from sidecar.protocol.rewrite import (
    UsagePlan,
    apply_usage_plan,
    event_payload,
    insert_member,
    plan_usage,
    request_with_usage,
    strip_usage_member,
    usage_plan,
    without_usage,
)

CHAT_WITH_USAGE = (
    '{"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1700000000,"model":"M",'
    '"choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null,'
    '"token_ids":null}],"usage":{"prompt_tokens":12,"total_tokens":13,"completion_tokens":1,'
    '"completion_tokens_details":null},"kv_transfer_params":null}'
)
CHAT_WITHOUT_USAGE = (
    '{"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1700000000,"model":"M",'
    '"choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null,'
    '"token_ids":null}],"kv_transfer_params":null}'
)


@pytest.mark.parametrize(
    ("body", "include", "continuous", "add_include", "add_continuous"),
    [
        ({"stream": True}, False, False, True, True),
        ({"stream": True, "stream_options": {"include_usage": True}}, True, False, False, True),
        (
            {
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
            True,
            True,
            False,
            False,
        ),
        # continuous without include_usage means nothing to vLLM: treated as neither.
        (
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            False,
            False,
            True,
            True,
        ),
    ],
)
def test_plan_adds_only_what_the_client_did_not_ask(
    body: dict[str, object],
    include: bool,
    continuous: bool,
    add_include: bool,
    add_continuous: bool,
) -> None:
    original = json.loads(json.dumps(body))
    plan = plan_usage(body, inject=True)
    assert (plan.client_include_usage, plan.client_continuous) == (include, continuous)
    assert (plan.add_include_usage, plan.add_continuous) == (add_include, add_continuous)
    assert plan.drop_usage_chunk == add_include
    new_body = apply_usage_plan(body, plan)
    assert new_body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert body == original  # the client's request object is never edited in place


def test_usage_options_are_appended_to_the_clients_own_bytes() -> None:
    # Escapes, spacing, number spellings and a trailing newline as the client wrote them.
    raw = b'{ "model": "m", "stream": true, "prompt": "caf\\u00e9 \xc3\xa9", "top_p": 1.0e0 }\n'
    body = json.loads(raw)
    plan = plan_usage(body, inject=True)
    sent = request_with_usage(raw, body, plan)
    assert sent == (
        b'{ "model": "m", "stream": true, "prompt": "caf\\u00e9 \xc3\xa9", '
        b'"top_p": 1.0e0 ,"stream_options":{"include_usage":true,'
        b'"continuous_usage_stats":true}}\n'
    )
    assert json.loads(sent) == {
        **body,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


@pytest.mark.parametrize(
    "raw",
    [
        # stream_options to edit: re-encoded from the parsed body.
        b'{"model":"m","stream":true,"stream_options":{"include_usage":true}}',
        b'{"model":"m","stream":true,"stream_options":null}',
        # Not plain UTF-8 (json.loads reads UTF-16 and a byte-order mark): re-encoded too.
        '{"model":"m","stream":true}'.encode("utf-16-le"),
        b'\xef\xbb\xbf{"model":"m","stream":true}',
    ],
)
def test_usage_options_are_re_encoded_when_the_bytes_cannot_be_extended(raw: bytes) -> None:
    body = json.loads(raw)
    plan = plan_usage(body, inject=True)
    sent = request_with_usage(raw, body, plan)
    assert json.loads(sent) == apply_usage_plan(body, plan)
    assert json.loads(sent)["stream_options"] == {
        "include_usage": True,
        "continuous_usage_stats": True,
    }


def test_a_body_that_needs_nothing_is_sent_as_is() -> None:
    raw = (
        b'{"model":"m","stream":true,"stream_options":{"include_usage":true,'
        b'"continuous_usage_stats":true}}'
    )
    body = json.loads(raw)
    assert request_with_usage(raw, body, plan_usage(body, inject=True)) is raw


@pytest.mark.parametrize(
    "include,continuous,inject,add_include,add_continuous",
    [
        # (the client's include_usage, its continuous_usage_stats, the proxy injects) ->
        # what the proxy adds.
        (False, False, True, True, True),
        (True, False, True, False, True),
        (True, True, True, False, False),
        (False, True, True, True, False),  # not read so (continuous needs include), but total
        (False, False, False, False, False),
        (True, False, False, False, False),
        (True, True, False, False, False),
        (False, True, False, False, False),
    ],
)
def test_the_plan_for_each_reading_of_a_request(
    include: bool, continuous: bool, inject: bool, add_include: bool, add_continuous: bool
) -> None:
    plan = usage_plan(include, continuous, inject)
    assert plan == UsagePlan(include, continuous, add_include, add_continuous)
    assert plan is usage_plan(include, continuous, inject)  # made once, shared


def test_plan_without_injection_changes_nothing() -> None:
    body = {"stream": True}
    plan = plan_usage(body, inject=False)
    assert not plan.modifies and apply_usage_plan(body, plan) is body


def event(payload: str) -> bytes:
    return f"data: {payload}\n\n".encode()


def test_strip_usage_restores_the_exact_bytes() -> None:
    stripped = strip_usage_member(event(CHAT_WITH_USAGE))
    assert stripped is not None
    out, position = stripped
    assert out == event(CHAT_WITHOUT_USAGE)
    assert event(CHAT_WITH_USAGE)[position:].startswith(b',"usage"')


def test_strip_ignores_usage_words_inside_text() -> None:
    tricky = CHAT_WITH_USAGE.replace(
        '"content":"Hello"', '"content":"say \\",\\"usage\\":{} to me"'
    )
    stripped = strip_usage_member(event(tricky))
    assert stripped is not None
    obj = json.loads(stripped[0][len(b"data: ") :])
    assert obj["choices"][0]["delta"]["content"] == 'say ","usage":{} to me'
    assert "usage" not in obj


def test_spaced_json_and_nested_details() -> None:
    spaced = (
        '{"id": "cmpl-1", "choices": [{"text": "x"}], "usage": {"prompt_tokens": 1, '
        '"prompt_tokens_details": {"cached_tokens": 0}, "completion_tokens": 1}, "z": 1}'
    )
    stripped = strip_usage_member(event(spaced))
    assert stripped is not None
    assert json.loads(stripped[0][len(b"data: ") :]) == {
        "id": "cmpl-1",
        "choices": [{"text": "x"}],
        "z": 1,
    }


@pytest.mark.parametrize(
    "payload",
    [
        '{"usage":{"prompt_tokens":1}}',  # first member: no comma before it
        '{"a":1,"usage":{"x":{"y":{"z":1}}}}',  # nested deeper than vLLM's usage ever is
        '{"a":1,"usage":[1,2]}',  # not an object
    ],
)
def test_shapes_that_cannot_be_edited_as_text_are_left_to_the_fallback(payload: str) -> None:
    assert strip_usage_member(event(payload)) is None
    out, _, reencoded = without_usage(event(payload), payload)
    assert reencoded and "usage" not in json.loads(out[len(b"data: ") :])


def test_without_usage_on_a_raw_event_and_the_fallback() -> None:
    raw = f"data: {CHAT_WITH_USAGE}\n\n".encode()
    out, cut, reencoded = without_usage(raw, CHAT_WITH_USAGE)
    assert out == f"data: {CHAT_WITHOUT_USAGE}\n\n".encode() and cut is not None
    assert not reencoded
    # An event split over two data lines cannot be edited as text: re-encoded compactly.
    multi = (
        b'data: {"choices":[],\ndata: "usage":{"prompt_tokens":1,"completion_tokens":2,'
        b'"total_tokens":3}}\n\n'
    )
    data = '{"choices":[],\n"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}'
    out, cut, reencoded = without_usage(multi, data)
    assert out == b'data: {"choices":[]}\n\n' and reencoded and cut is None
    assert event_payload(multi) is None


def test_insert_fingerprint_where_usage_was() -> None:
    finish_with_usage = CHAT_WITH_USAGE.replace('"finish_reason":null', '"finish_reason":"stop"')
    raw = f"data: {finish_with_usage}\n\n".encode()
    out, cut, _ = without_usage(raw, finish_with_usage)
    restored = insert_member(out, cut, "system_fingerprint", "vllm-0.33.0-1a2b3c4d")
    payload = event_payload(restored)
    assert payload is not None
    assert payload.endswith(
        '}],"system_fingerprint":"vllm-0.33.0-1a2b3c4d","kv_transfer_params":null}'
    )
    # Without a cut position: before kv_transfer_params, else before the closing brace.
    assert insert_member(b'data: {"a":1}\n\n', None, "k", "v") == b'data: {"a":1,"k":"v"}\n\n'
    # Non-ASCII goes back as UTF-8; a lone surrogate (no UTF-8 form: a hostile upstream's
    # "\ud800") escaped as the upstream wrote it, where it once raised mid-stream.
    one = b'data: {"a":1}\n\n'
    assert insert_member(one, None, "k", "é") == 'data: {"a":1,"k":"é"}\n\n'.encode()
    assert insert_member(one, None, "k", "\ud800") == b'data: {"a":1,"k":"\\ud800"}\n\n'


@pytest.mark.parametrize(
    "payload",
    [
        # Found by the fuzzer: a nested "usage" whose object is followed by a brace in a string.
        '{"choices": {"choices": null, "usage": {"a": 1}}, "id": "{"}',
        '{"a": [{"x": 1, "usage": {"prompt_tokens": 1}}], "b": "]}"}',
    ],
)
def test_a_nested_usage_is_never_taken_for_the_top_level_one(payload: str) -> None:
    assert strip_usage_member(event(payload)) is None
