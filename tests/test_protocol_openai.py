"""The OpenAI/vLLM chunk model: classification, usage, token counting, request helpers."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from vllm_chunks import (
    CHAT_BANG,
    CHAT_HELLO,
    CHAT_ROLE,
    CHAT_USAGE,
    COMPLETION_HELLO,
    ERROR_COMPACT,
    ERROR_SPACED,
)

from sidecar.protocol import (
    ChunkInfo,
    ChunkKind,
    ErrorInfo,
    PerRequestMetrics,
    TokenCounter,
    Usage,
    classify_chunk,
    endpoint_for_path,
    error_body,
    stream_usage_options,
)

FP = "vllm-0.33.0-1a2b3c4d"
INTERNAL = ErrorInfo("Internal server error", "InternalServerError", 500, None)


def chat(delta: str, *, finish: str = "null", index: int = 0, usage: str = "") -> str:
    """A chat chunk in vLLM's shape (continuous usage appended when ``usage`` is given)."""
    tail = f',"usage":{usage}' if usage else ""
    return (
        '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"M",'
        f'"choices":[{{"index":{index},"delta":{delta},"logprobs":null,'
        f'"finish_reason":{finish}}}]{tail}}}'
    )


def cont_usage(completion: int, prompt: int = 12) -> str:
    return (
        f'{{"prompt_tokens":{prompt},"total_tokens":{prompt + completion},'
        f'"completion_tokens":{completion},"completion_tokens_details":null}}'
    )


# --- classification of the spec's literal chunks -------------------------------------------


def test_chat_role_chunk() -> None:
    assert classify_chunk(CHAT_ROLE) == ChunkInfo(
        ChunkKind.ROLE, choice_index=0, model="M", id="chatcmpl-abc123"
    )


def test_chat_token_chunk() -> None:
    assert classify_chunk(CHAT_HELLO) == ChunkInfo(
        ChunkKind.TOKEN, choice_index=0, model="M", id="chatcmpl-abc123"
    )


def test_chat_terminal_chunk_with_fingerprint() -> None:
    assert classify_chunk(CHAT_BANG) == ChunkInfo(
        ChunkKind.TOKEN,
        finish_reason="stop",
        choice_index=0,
        model="M",
        id="chatcmpl-abc123",
        system_fingerprint=FP,
    )


def test_chat_usage_chunk() -> None:
    assert classify_chunk(CHAT_USAGE) == ChunkInfo(
        ChunkKind.USAGE,
        usage=Usage(prompt_tokens=12, completion_tokens=3, total_tokens=15, cached_tokens=None),
        model="M",
        id="chatcmpl-abc123",
        system_fingerprint=FP,
    )


def test_done() -> None:
    assert classify_chunk("[DONE]") == ChunkInfo(ChunkKind.DONE)
    assert classify_chunk(" [DONE]\n").kind is ChunkKind.DONE


@pytest.mark.parametrize("data", [ERROR_COMPACT, ERROR_SPACED], ids=["chat", "completions"])
def test_mid_stream_error_event(data: str) -> None:
    assert classify_chunk(data) == ChunkInfo(ChunkKind.ERROR, error=INTERNAL)


def test_other_error_shapes() -> None:
    retry = classify_chunk(
        '{"error":{"message":"try again","type":"ServiceUnavailableError","param":null,"code":503}}'
    )
    assert retry.error == ErrorInfo("try again", "ServiceUnavailableError", 503, None)
    assert classify_chunk('{"error":"Unauthorized"}').error == ErrorInfo("Unauthorized")
    openai_style = classify_chunk(
        '{"error":{"message":"bad key","type":"invalid_request_error","param":"model",'
        '"code":"invalid_api_key"}}'
    )
    assert openai_style.error == ErrorInfo(
        "bad key", "invalid_request_error", "invalid_api_key", "model"
    )


# --- completions ----------------------------------------------------------------------------


def test_completions_token_chunk() -> None:
    assert classify_chunk(COMPLETION_HELLO) == ChunkInfo(
        ChunkKind.TOKEN, choice_index=0, model="M", id="cmpl-abc123"
    )


def test_completions_terminal_and_usage_chunks() -> None:
    terminal = classify_chunk(
        '{"id":"cmpl-abc123","object":"text_completion","created":1700000000,"model":"M",'
        '"choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"length",'
        '"stop_reason":null,"prompt_token_ids":null,"token_ids":null,"weight_versions":null}],'
        '"system_fingerprint":"vllm-0.33.0-1a2b3c4d","kv_transfer_params":null}'
    )
    assert (terminal.kind, terminal.finish_reason, terminal.system_fingerprint) == (
        ChunkKind.EMPTY,
        "length",
        FP,
    )
    last_words = classify_chunk(
        '{"id":"cmpl-1","object":"text_completion","created":1,"model":"M","choices":'
        '[{"index":3,"text":" end","logprobs":null,"finish_reason":"length","stop_reason":null}]}'
    )
    assert (last_words.kind, last_words.finish_reason, last_words.choice_index) == (
        ChunkKind.TOKEN,
        "length",
        3,
    )
    usage = classify_chunk(
        '{"id":"cmpl-abc123","object":"text_completion","created":1700000000,"model":"M",'
        '"choices":[],"usage":{"prompt_tokens":5,"total_tokens":21,"completion_tokens":16},'
        '"system_fingerprint":"vllm-0.33.0-1a2b3c4d"}'
    )
    assert usage.kind is ChunkKind.USAGE
    assert usage.usage == Usage(5, 16, 21)


def test_completions_continuous_usage() -> None:
    info = classify_chunk(
        '{"id":"cmpl-1","object":"text_completion","created":1,"model":"M","choices":[{"index":0,'
        '"text":"Hi","logprobs":null,"finish_reason":null,"stop_reason":null}],'
        '"usage":{"prompt_tokens":4,"total_tokens":6,"completion_tokens":2}}'
    )
    assert (info.kind, info.usage) == (ChunkKind.TOKEN, Usage(4, 2, 6))


# --- chat variants --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("delta", "kind"),
    [
        ('{"content":"Hi"}', ChunkKind.TOKEN),
        ('{"reasoning":"Let me think"}', ChunkKind.TOKEN),
        ('{"reasoning_content":"Let me think"}', ChunkKind.TOKEN),  # older vLLM
        ('{"content":null,"reasoning":"x"}', ChunkKind.TOKEN),
        (
            '{"tool_calls":[{"index":0,"id":"call_1","type":"function",'
            '"function":{"name":"get_weather","arguments":""}}]}',
            ChunkKind.TOKEN,
        ),
        ('{"role":"assistant","content":"Hi"}', ChunkKind.TOKEN),  # role and text together
        ('{"role":"assistant","content":""}', ChunkKind.ROLE),
        ('{"role":"assistant"}', ChunkKind.ROLE),
        ('{"content":""}', ChunkKind.EMPTY),  # a special token: no visible text
        ('{"tool_calls":[]}', ChunkKind.EMPTY),
        ("{}", ChunkKind.EMPTY),
    ],
)
def test_chat_delta_kinds(delta: str, kind: ChunkKind) -> None:
    assert classify_chunk(chat(delta)).kind is kind


def test_finish_only_chat_chunk_is_empty_with_finish_reason() -> None:
    info = classify_chunk(chat("{}", finish='"tool_calls"'))
    assert (info.kind, info.finish_reason) == (ChunkKind.EMPTY, "tool_calls")


def test_older_vllm_minimal_shape() -> None:
    # Before ~0.10.2: no token_ids, kv_transfer_params or system_fingerprint keys.
    info = classify_chunk(
        '{"id":"chatcmpl-9","object":"chat.completion.chunk","created":1,"model":"llama",'
        '"choices":[{"index":0,"delta":{"reasoning_content":"hmm"},"logprobs":null,'
        '"finish_reason":null}]}'
    )
    assert info == ChunkInfo(ChunkKind.TOKEN, choice_index=0, model="llama", id="chatcmpl-9")


def test_unknown_keys_are_ignored() -> None:
    info = classify_chunk(
        '{"id":"x","future":{"a":[1,2]},"choices":[{"index":0,"delta":{"content":"a",'
        '"audio":{"id":"q"}},"new_field":true}],"created":"not-an-int"}'
    )
    assert info.kind is ChunkKind.TOKEN


def test_n_greater_than_one_reports_the_choice_index() -> None:
    info = classify_chunk(chat('{"content":"b"}', index=1))
    assert (info.kind, info.choice_index) == (ChunkKind.TOKEN, 1)
    # OpenAI-style chunk holding several choices: TOKEN wins over ROLE over EMPTY.
    several = classify_chunk(
        '{"choices":[{"index":0,"delta":{"content":""},"finish_reason":null},'
        '{"index":1,"delta":{"role":"assistant"}},'
        '{"index":2,"delta":{"content":"x"},"finish_reason":"stop"}]}'
    )
    assert (several.kind, several.choice_index, several.finish_reason) == (
        ChunkKind.TOKEN,
        0,
        "stop",
    )
    roles = classify_chunk('{"choices":[{"index":0,"delta":{}},{"index":1,"delta":{"role":"a"}}]}')
    assert roles.kind is ChunkKind.ROLE


def test_continuous_usage_on_token_and_role_chunks() -> None:
    role = classify_chunk(chat('{"role":"assistant","content":""}', usage=cont_usage(0)))
    assert (role.kind, role.usage) == (ChunkKind.ROLE, Usage(12, 0, 12))
    token = classify_chunk(chat('{"content":"Hello"}', usage=cont_usage(1)))
    assert (token.kind, token.usage) == (ChunkKind.TOKEN, Usage(12, 1, 13))


def test_usage_chunk_with_cached_tokens_and_per_request_metrics() -> None:
    info = classify_chunk(
        '{"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1700000000,'
        '"model":"M","choices":[],"usage":{"prompt_tokens":12,"total_tokens":15,'
        '"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":8}},'
        '"metrics":{"time_to_first_token_ms":41.5,"generation_time_ms":120,'
        '"queue_time_ms":2.25,"mean_itl_ms":39.5,"tokens_per_second":25.0}}'
    )
    assert info.kind is ChunkKind.USAGE
    assert info.usage == Usage(12, 3, 15, cached_tokens=8)
    assert info.metrics == PerRequestMetrics(
        time_to_first_token_ms=41.5,
        generation_time_ms=120.0,
        queue_time_ms=2.25,
        mean_itl_ms=39.5,
        tokens_per_second=25.0,
    )


def test_usage_from_obj() -> None:
    assert Usage.from_obj({"prompt_tokens": 3, "completion_tokens": 4}) == Usage(3, 4, 7)
    with_details = {"prompt_tokens": 3, "completion_tokens": 4, "prompt_tokens_details": None}
    assert Usage.from_obj({**with_details, "total_tokens": 7}) == Usage(3, 4, 7, None)
    assert Usage.from_obj(
        {"prompt_tokens": 3, "completion_tokens": 4, "prompt_tokens_details": {"x": 1}}
    ) == Usage(3, 4, 7, None)
    bad_usages: list[object] = [
        None,
        [],
        "u",
        {"prompt_tokens": 3},
        {"prompt_tokens": True, "completion_tokens": 1},
        {"prompt_tokens": -1, "completion_tokens": 1},
        {"prompt_tokens": 1.0, "completion_tokens": 1},
    ]
    for bad in bad_usages:
        assert Usage.from_obj(bad) is None, bad


def test_per_request_metrics_from_obj() -> None:
    assert PerRequestMetrics.from_obj(None) is None
    assert PerRequestMetrics.from_obj({"mean_itl_ms": 3, "queue_time_ms": "x"}) == (
        PerRequestMetrics(mean_itl_ms=3.0)
    )


def test_empty_choices_without_usage_is_empty() -> None:
    assert classify_chunk('{"choices":[]}').kind is ChunkKind.EMPTY


@pytest.mark.parametrize(
    "data",
    [
        "",
        "not json",
        "{",
        "[1, 2]",
        '"a string"',
        "null",
        "42",
        "NaN",
        "{}",
        '{"id":"x"}',
        '{"choices": "x"}',
        '{"choices": {"0": {}}}',
        '{"choices": [1]}',
        '{"choices": [null]}',
        '{"choices": [{"delta": "x"}]}',
        '{"choices": [{"delta": ["content"]}]}',
        '{"choices": [{"delta": {"content": 5}}]}',
        '{"choices": [{"delta": {"reasoning": {"a": 1}}}]}',
        '{"choices": [{"delta": {"tool_calls": {"a": 1}}}]}',
        '{"choices": [{"delta": {"role": 7}}]}',
        '{"choices": [{"text": 5}]}',
        '{"choices": [{"text": ["a"]}]}',
        '{"choices": [{"index": "0", "text": "a"}]}',
        '{"choices": [{"index": true, "text": "a"}]}',
        '{"choices": [{"index": 0, "text": "a", "finish_reason": 1}]}',
        '{"error": 5}',
        '{"error": ["x"]}',
        "[" * 100_000,
        '{"a":' * 50_000 + "1" + "}" * 50_000,
        "1" * 5000,  # beyond Python's int digit limit
        "\ud800",
    ],
)
def test_malformed_inputs(data: str) -> None:
    assert classify_chunk(data) == ChunkInfo(ChunkKind.MALFORMED)


@pytest.mark.parametrize(
    "data,kind",
    [
        ('{"choices": [], "usage": 5}', ChunkKind.USAGE),
        (
            '{"choices": [], "usage": {"prompt_tokens": "12", "completion_tokens": 3}}',
            ChunkKind.USAGE,
        ),
        ('{"usage": {"prompt_tokens": -1, "completion_tokens": 3}}', ChunkKind.USAGE),
        ('{"choices": [{"text": "a"}], "usage": {"completion_tokens": 3}}', ChunkKind.TOKEN),
        (
            '{"choices": [{"text": "a"}], "usage": {"prompt_tokens": 1, "completion_tokens": '
            + str(2**63)
            + "}}",
            ChunkKind.TOKEN,
        ),
        (
            '{"choices": [{"text": "a"}], "usage": {"prompt_tokens": 1, "completion_tokens": '
            + str(2**53)
            + "}}",
            ChunkKind.TOKEN,
        ),
        (
            '{"choices": [{"text": "a"}], "usage": {"prompt_tokens": 1.0, "completion_tokens": 1}}',
            ChunkKind.TOKEN,
        ),
        (
            '{"choices": [{"text": "a"}], "usage": {"prompt_tokens": NaN, "completion_tokens": 1}}',
            ChunkKind.TOKEN,
        ),
    ],
)
def test_usage_that_cannot_be_believed_leaves_the_rest_of_the_chunk(
    data: str, kind: ChunkKind
) -> None:
    info = classify_chunk(data)
    assert (info.kind, info.usage, info.usage_malformed) == (kind, None, True)


def test_the_largest_believed_count_is_2_pow_53_minus_1() -> None:
    top = 2**53 - 1
    info = classify_chunk(
        f'{{"choices": [], "usage": {{"prompt_tokens": {top}, '
        f'"completion_tokens": {top}, "total_tokens": {2**60}}}}}'
    )
    assert info.usage is not None and not info.usage_malformed
    # An out-of-range total is read as absent: the sum, as for a missing one.
    assert (info.usage.prompt_tokens, info.usage.completion_tokens, info.usage.total_tokens) == (
        top,
        top,
        2 * top,
    )


def test_surrounding_json_whitespace_is_accepted_trailing_text_is_not() -> None:
    assert classify_chunk(" \t" + COMPLETION_HELLO + "\r\n").kind is ChunkKind.TOKEN
    assert classify_chunk(CHAT_USAGE + " ").kind is ChunkKind.USAGE
    assert classify_chunk(CHAT_HELLO + " x").kind is ChunkKind.MALFORMED
    assert classify_chunk(CHAT_HELLO + CHAT_HELLO).kind is ChunkKind.MALFORMED
    assert classify_chunk(" ").kind is ChunkKind.MALFORMED


def test_wrong_types_in_side_fields_are_read_as_absent() -> None:
    info = classify_chunk(
        '{"id":5,"model":["M"],"system_fingerprint":1,"metrics":"x",'
        '"choices":[{"index":0,"delta":{"content":"a"}}]}'
    )
    assert info == ChunkInfo(ChunkKind.TOKEN, choice_index=0)


# --- token counting -------------------------------------------------------------------------


def observe_all(chunks: list[str]) -> tuple[list[int], TokenCounter]:
    counter = TokenCounter()
    return [counter.observe(classify_chunk(c)) for c in chunks], counter


def test_token_counter_continuous_usage_with_speculative_decoding() -> None:
    counts, counter = observe_all(
        [
            chat('{"role":"assistant","content":""}', usage=cont_usage(0)),
            chat('{"content":"Hello"}', usage=cont_usage(1)),
            chat('{"content":","}', usage=cont_usage(2)),
            chat('{"content":" world!"}', finish='"stop"', usage=cont_usage(5)),  # 3 accepted
            CHAT_USAGE.replace('"completion_tokens":3', '"completion_tokens":5'),
            "[DONE]",
        ]
    )
    assert counts == [0, 1, 1, 3, 0, 0]
    assert counter.exact is True
    assert (counter.total, counter.unattributed) == (5, 0)


def test_token_counter_without_usage_estimates_one_per_token_chunk() -> None:
    counts, counter = observe_all([CHAT_ROLE, CHAT_HELLO, CHAT_BANG, CHAT_USAGE, "[DONE]"])
    assert counts == [0, 1, 1, 0, 0]
    assert counter.exact is False
    assert counter.total == 2


def test_token_counter_carries_tokens_from_non_token_events() -> None:
    counts, counter = observe_all(
        [
            chat('{"role":"assistant","content":""}', usage=cont_usage(1)),  # edge: count >= 1
            chat('{"content":"A"}', usage=cont_usage(2)),
            chat('{"content":""}', usage=cont_usage(3)),  # a special token, no text
            chat('{"content":"B"}', usage=cont_usage(4)),
            chat("{}", finish='"stop"', usage=cont_usage(5)),  # a hidden token at the end
        ]
    )
    assert counts == [0, 2, 0, 2, 0]
    assert counter.exact is True
    assert (counter.total, counter.unattributed) == (4, 1)


def test_token_counter_usage_corrects_earlier_estimates() -> None:
    counts, counter = observe_all(
        [chat('{"content":"A"}'), chat('{"content":"BCD"}', usage=cont_usage(4))]
    )
    assert counts == [1, 3]
    assert (counter.total, counter.exact) == (4, False)


def test_token_counter_keeps_a_baseline_per_choice() -> None:
    # n=2 with continuous usage: each choice's count is its own (vLLM previous_num_tokens[i]).
    counts, counter = observe_all(
        [
            chat('{"role":"assistant","content":""}', index=0, usage=cont_usage(0)),
            chat('{"role":"assistant","content":""}', index=1, usage=cont_usage(0)),
            chat('{"content":"a"}', index=0, usage=cont_usage(1)),
            chat('{"content":"b"}', index=1, usage=cont_usage(1)),
            chat('{"content":"cd"}', index=1, usage=cont_usage(3)),
            chat('{"content":"e"}', index=0, usage=cont_usage(2)),
        ]
    )
    assert counts == [0, 0, 1, 1, 2, 1]
    assert counter.total == 5


def test_token_counter_ignores_non_output_events() -> None:
    counts, counter = observe_all([ERROR_COMPACT, "garbage", "[DONE]", '{"choices":[]}'])
    assert counts == [0, 0, 0, 0]
    assert (counter.total, counter.exact) == (0, True)


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=30))
def test_property_token_counter_matches_the_attribution_rule(
    events: list[tuple[bool, int]],
) -> None:
    # (is_token_chunk, tokens it produced); a token chunk has at least one token.
    chunks: list[str] = []
    expected: list[int] = []
    cumulative = carried = 0
    for is_token, produced in events:
        produced = max(produced, 1) if is_token else produced
        cumulative += produced
        delta = '{"content":"x"}' if is_token else '{"content":""}'
        chunks.append(chat(delta, usage=cont_usage(cumulative)))
        if is_token:
            expected.append(produced + carried)
            carried = 0
        else:
            expected.append(0)
            carried += produced
    counts, counter = observe_all(chunks)
    assert counts == expected
    assert counter.exact is True
    assert counter.total + counter.unattributed == cumulative


# --- request-side helpers -------------------------------------------------------------------


def test_error_body_matches_vllm_byte_for_byte() -> None:
    body = error_body("Internal server error", "InternalServerError", 500)
    assert list(body["error"]) == ["message", "type", "param", "code"]
    assert json.dumps(body, separators=(",", ":")) == ERROR_COMPACT
    assert json.dumps(body) == ERROR_SPACED
    assert error_body("The model `X` does not exist.", "NotFoundError", 404, "model") == {
        "error": {
            "message": "The model `X` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    assert classify_chunk(json.dumps(body)).error == INTERNAL


@pytest.mark.parametrize(
    ("path", "endpoint"),
    [
        ("/v1/chat/completions", "chat"),
        ("/v1/completions", "completions"),
        ("/v1/models", None),
        ("/v1/chat/completions/", None),
        ("/chat/completions", None),
        ("/metrics", None),
        ("", None),
    ],
)
def test_endpoint_for_path(path: str, endpoint: str | None) -> None:
    assert endpoint_for_path(path) == endpoint


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({}, (False, False, False)),
        ({"stream": True}, (True, False, False)),
        ({"stream": True, "stream_options": {"include_usage": True}}, (True, True, False)),
        (
            {
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
            (True, True, True),
        ),
        # continuous_usage_stats is ignored unless include_usage is on
        (
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            (True, False, False),
        ),
        # stream_options without a stream is a 400 upstream: no usage will come
        ({"stream": False, "stream_options": {"include_usage": True}}, (False, False, False)),
        ({"stream": None, "stream_options": None}, (False, False, False)),
        ({"stream": True, "stream_options": None}, (True, False, False)),
        ({"stream": True, "stream_options": ["include_usage"]}, (True, False, False)),
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, (True, True, False)),
        ({"stream": "true"}, (True, False, False)),
        ({"stream": 1}, (True, False, False)),
        ({"stream": 2}, (False, False, False)),
        ({"stream": "maybe"}, (False, False, False)),
        ({"stream": [True]}, (False, False, False)),
        ([("stream", True)], (False, False, False)),
        (None, (False, False, False)),
        ("stream", (False, False, False)),
    ],
)
def test_stream_usage_options(body: object, expected: tuple[bool, bool, bool]) -> None:
    assert stream_usage_options(body) == expected


# --- never raises ---------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
chunk_keys = st.sampled_from(
    ["choices", "usage", "error", "metrics", "model", "id", "system_fingerprint", "object"]
)
choice_keys = st.sampled_from(["index", "delta", "text", "finish_reason", "logprobs"])
delta_keys = st.sampled_from(["role", "content", "reasoning", "reasoning_content", "tool_calls"])
usage_keys = st.sampled_from(
    ["prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"]
)
near_chunks = st.fixed_dictionaries(
    {},
    optional={
        "choices": st.lists(
            st.dictionaries(
                choice_keys,
                json_values | st.dictionaries(delta_keys, json_values, max_size=4),
                max_size=5,
            ),
            max_size=3,
        )
        | json_values,
        "usage": st.dictionaries(usage_keys, json_values | st.integers(0, 99), max_size=4)
        | json_values,
        "error": st.dictionaries(
            st.sampled_from(["message", "type", "code", "param"]), json_values, max_size=4
        )
        | json_values,
        "metrics": st.dictionaries(st.text(max_size=3), json_values, max_size=3) | json_values,
    },
).flatmap(lambda d: st.dictionaries(chunk_keys, json_values, max_size=2).map(lambda e: {**e, **d}))


@given(st.text())
def test_property_classify_never_raises_on_text(data: str) -> None:
    assert isinstance(classify_chunk(data).kind, ChunkKind)


@given(json_values)
def test_property_classify_never_raises_on_json_values(value: object) -> None:
    info = classify_chunk(json.dumps(value))
    assert isinstance(info.kind, ChunkKind)
    if not isinstance(value, dict):
        assert info.kind is ChunkKind.MALFORMED


@given(near_chunks)
def test_property_classify_never_raises_on_near_vllm_chunks(chunk: dict[str, object]) -> None:
    info = classify_chunk(json.dumps(chunk))
    assert isinstance(info.kind, ChunkKind)
    counter = TokenCounter()
    assert counter.observe(info) >= 0


def test_safe_error_type_keeps_identifiers_only() -> None:
    from sidecar.protocol.openai import ErrorInfo, safe_error_type

    assert safe_error_type(ErrorInfo("m", "BadRequestError"), 400) == "BadRequestError"
    assert safe_error_type(ErrorInfo("m", "free text, with spaces"), 400) == "http_400"
    assert safe_error_type(ErrorInfo("m", "x" * 65), 500) == "http_500"
    assert safe_error_type(None, 502) == "http_502"
