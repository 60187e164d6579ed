"""Fuzzing the relay's per-event code, bounded for CI.

- A seeded random-input run of benchmarks/fuzz_long.py (20 000 inputs here; the long run, 1M,
  is recorded in that file): arbitrary and mutated vLLM streams through SSEParser,
  classify_chunk, TokenCounter and the usage rewrite, split into arbitrary reads; no exception
  escapes, the parser's buffer stays within max_event_size, no byte is lost or invented, and the
  usage edit removes exactly the top-level member.
- Property tests (hypothesis, fixed max_examples, derandomized so that CI is repeatable) of the
  usage rewrite on generated JSON objects, which tests/test_proxy_rewrite.py checks on fixed
  examples only, and of the parser's bound on arbitrary bytes.
  (Parser split-invariance and classify-never-raises are tests/test_protocol_*.py's.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.meter import StreamMeter
from sidecar.protocol.openai import MAX_TOKEN_COUNT
from sidecar.protocol.rewrite import (
    UsagePlan,
    insert_member,
    strip_usage_member,
    without_usage,
)
from sidecar.protocol.sse import SSEError, SSEParser
from sidecar.record import TokenSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fuzz_long  # noqa: E402  (benchmarks/fuzz_long.py: the generator and the checks)

CI = settings(max_examples=300, derandomize=True, deadline=None)


def test_random_input_fuzz_bounded_run() -> None:
    result = fuzz_long.run(inputs=20_000, seed=2024)
    assert result.failures == []
    assert result.inputs == 20_000 and result.events > 20_000


def test_the_fuzzer_notices_a_wrong_edit() -> None:
    """The semantic check is live: an edit that removed a nested "usage" instead of the
    top-level one is reported."""
    data = '{"usage":{"prompt_tokens":1,"completion_tokens":1},"kv":{"a":1,"usage":null}}'
    wrongly_edited = b'data: {"usage":{"prompt_tokens":1,"completion_tokens":1},"kv":{"a":1}}\n\n'
    with pytest.raises(fuzz_long.FuzzFailure, match="wrong member"):
        fuzz_long._check_semantics(data, wrongly_edited)
    fuzz_long._check_semantics(data, b'data: {"kv":{"a":1,"usage":null}}\n\n')


# -- properties of the usage rewrite ---------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
keys = st.one_of(
    st.sampled_from(["usage", "choices", "id", "kv_transfer_params", "a"]), st.text(max_size=6)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
    max_leaves=12,
)
usage_objects = st.fixed_dictionaries(
    {
        "prompt_tokens": st.integers(0, 10**6),
        "total_tokens": st.integers(0, 10**6),
        "completion_tokens": st.integers(0, 10**6),
    },
    optional={
        "prompt_tokens_details": st.one_of(
            st.none(), st.fixed_dictionaries({"cached_tokens": st.integers(0, 999)})
        ),
        "completion_tokens_details": st.none(),
    },
)
chunks = st.tuples(
    st.dictionaries(keys, json_values, max_size=4),
    usage_objects,
    st.dictionaries(keys, json_values, max_size=3),
    st.booleans(),
    st.booleans(),
)


def _event(obj: dict[str, Any], compact: bool, ascii_only: bool) -> tuple[bytes, str]:
    payload = json.dumps(
        obj, separators=(",", ":") if compact else (", ", ": "), ensure_ascii=ascii_only
    )
    return b"data: " + payload.encode() + b"\n\n", payload


@CI
@given(chunks)
def test_property_without_usage_removes_exactly_the_top_level_usage(
    parts: tuple[dict[str, Any], dict[str, Any], dict[str, Any], bool, bool],
) -> None:
    before, usage, after, compact, ascii_only = parts
    obj = {k: v for k, v in before.items() if k != "usage"}
    obj["usage"] = usage
    obj.update({k: v for k, v in after.items() if k != "usage"})
    raw, payload = _event(obj, compact, ascii_only)
    out, cut, reencoded = without_usage(raw, payload)
    expected = {k: v for k, v in obj.items() if k != "usage"}
    assert json.loads(out[len(b"data: ") : -2]) == expected
    if cut is not None:
        # A text edit: the event byte for byte, minus one slice.
        assert not reencoded and raw.startswith(out[:cut]) and raw.endswith(out[cut:])
        # The fingerprint goes back exactly where usage was.
        restored = insert_member(out, cut, "system_fingerprint", "fp")
        assert json.loads(restored[len(b"data: ") : -2]) == {**expected, "system_fingerprint": "fp"}


@CI
@given(st.dictionaries(keys, json_values, max_size=5), st.booleans())
def test_property_events_without_top_level_usage_are_never_edited(
    obj: dict[str, Any], compact: bool
) -> None:
    """Nested "usage" keys (in choices, in kv_transfer_params) are not the proxy's to remove."""
    obj.pop("usage", None)
    raw, payload = _event(obj, compact, ascii_only=True)
    stripped = strip_usage_member(raw)
    assert stripped is None or json.loads(stripped[0][len(b"data: ") : -2]) == obj
    out, cut, reencoded = without_usage(raw, payload)
    assert (out, cut, reencoded) == (raw, None, False)


@CI
@given(st.binary(max_size=300))
def test_property_rewrite_functions_never_raise_on_bytes(raw: bytes) -> None:
    data = raw.decode("utf-8", "replace")
    out, cut, _ = without_usage(raw, data)
    assert isinstance(out, bytes)
    assert isinstance(insert_member(out, cut, "system_fingerprint", "x"), bytes)
    stripped = strip_usage_member(raw)
    assert stripped is None or len(stripped[0]) < len(raw)


@CI
@given(st.lists(st.binary(max_size=200), max_size=12), st.sampled_from([1, 16, 100, 1000]))
def test_property_the_parser_buffer_is_bounded_by_max_event_size(
    reads: list[bytes], limit: int
) -> None:
    parser = SSEParser(max_event_size=limit)
    for data in reads:
        try:
            parser.feed(data)
        except SSEError:
            # Refuses everything after, and keeps no more than the limit's overflow read.
            try:
                parser.feed(b"data: more\n\n")
            except SSEError:
                return
            raise AssertionError("a failed parser accepted input") from None
        assert parser.pending_bytes <= limit


def test_a_lone_surrogate_in_an_uneditable_event_is_re_encoded_not_raised() -> None:
    """Found by the fuzzer: JSON may escape half a surrogate pair (\\ud83d alone); it has no
    UTF-8 form, so the re-encoded event keeps it escaped instead of raising mid-stream."""
    payload = '{"choices":[{"text":"\\ud83d"}],"usage":{"x":{"y":{"z":1}}}}'  # not text-editable
    out, cut, reencoded = without_usage(f"data: {payload}\n\n".encode(), payload)
    assert reencoded and cut is None
    assert json.loads(out[len(b"data: ") : -2]) == {"choices": [{"text": "\ud83d"}]}


def test_a_brace_inside_a_usage_string_is_not_taken_for_its_end() -> None:
    """Found by the long fuzz run: the text edit matched `{...}` up to a brace inside a key, and
    cut the event into invalid JSON. Such an event is now re-encoded instead."""
    payload = (
        '{"id": "c", "choices": [], "usage": {"prompt_tokens": 628, "tota} { l": 236, '
        '"completion_tokens": 244}}'
    )
    raw = f"data: {payload}\n\n".encode()
    assert strip_usage_member(raw) is None
    out, cut, reencoded = without_usage(raw, payload)
    assert reencoded and json.loads(out[len(b"data: ") : -2]) == {"id": "c", "choices": []}


# -- usage counts a hostile upstream can send (issue 16) ---------------------------------------

any_count = st.one_of(
    st.integers(),
    st.floats(),
    st.text(max_size=4),
    st.none(),
    st.booleans(),
    st.sampled_from([2**63, 2**64, -(2**63) - 1, 2**53, 2**53 - 1, 10**4000]),
)


@CI
@given(st.lists(st.tuples(any_count, any_count), min_size=1, max_size=6))
def test_property_no_usage_count_breaks_a_stream_or_survives_into_the_clients_bytes(
    counts: list[tuple[Any, Any]],
) -> None:
    """Whatever numbers the usage carries, the meter never raises, the injected member never
    reaches the client, every token event is counted, and no count above 2**53 - 1 (where the
    record's int64 columns would overflow) is believed."""
    plan = UsagePlan(
        client_include_usage=False,
        client_continuous=False,
        add_include_usage=True,
        add_continuous=True,
    )
    meter = StreamMeter(0, plan)
    out = b""
    for i, (prompt, completion) in enumerate(counts):
        usage = (
            '{"prompt_tokens":' + _number(prompt) + ',"total_tokens":1,'
            '"completion_tokens":' + _number(completion) + "}"
        )
        event = (
            'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
            '"choices":[{"index":0,"delta":{"content":"t' + str(i) + '"},"logprobs":null,'
            '"finish_reason":null}],"usage":' + usage + "}\n\n"
        ).encode()
        out += meter.feed(event, i)[0]
    out += meter.feed(b"data: [DONE]\n\n", 99)[0] + meter.close(100)[0]
    assert b'"usage"' not in out
    assert len(meter.token_counts()) == len(counts)
    n_in, n_out, _, source = meter.token_totals
    for count in (n_in, n_out, *meter.token_counts()):
        assert count is None or 0 <= count < 2**63  # fits the record's int64 columns
    if source in (TokenSource.USAGE, TokenSource.USAGE_TOTAL):
        assert n_out is not None and n_out <= MAX_TOKEN_COUNT  # believed only when believable


def _number(value: Any) -> str:
    if isinstance(value, float) and value != value:
        return "NaN"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return "Infinity" if value > 0 else "-Infinity"
    return json.dumps(value)
