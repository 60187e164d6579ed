"""The OpenAI / vLLM streaming chunk model, sans-IO (spec/vllm-protocol.md, A1).

`classify_chunk` reads the ``data`` of one SSE event and says what it is to a measuring proxy:
does it carry output tokens (TTFT/ITL count it), is it a role chunk, a usage-only chunk, an
error event, ``[DONE]``, or garbage. It works on chat (``chat.completion.chunk``) and
completions (``text_completion``) chunks alike, ignores unknown keys and accepts older vLLM
shapes. It never raises on a str: whatever it cannot read is MALFORMED.

`TokenCounter` turns the chunks of one response into output tokens per event.

The request-side helpers (`error_body`, `endpoint_for_path`, `stream_usage_options`) are shared
by the proxy and the simulator so both speak the same dialect.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping
from typing import Any, Final, NamedTuple, TypeGuard

ENDPOINT_CHAT: Final = "chat"
ENDPOINT_COMPLETIONS: Final = "completions"
# Builds a NamedTuple without its keyword-handling __new__: a third cheaper on the hot path.
_new_tuple: Final = tuple.__new__
_ENDPOINTS: Final = {
    "/v1/chat/completions": ENDPOINT_CHAT,
    "/v1/completions": ENDPOINT_COMPLETIONS,
}


class ChunkKind(str, enum.Enum):
    """What one streamed event is, as far as latency measurement is concerned."""

    TOKEN = "token"  # carries >= 1 output token: text, content, reasoning or tool calls
    ROLE = "role"  # chat role announcement with no visible output
    EMPTY = "empty"  # choices present, nothing visible (e.g. content "" or a bare finish)
    USAGE = "usage"  # choices == [] with usage: the final accounting chunk
    ERROR = "error"  # {"error": {...}}: vLLM's mid-stream error event
    DONE = "done"  # data: [DONE]
    MALFORMED = "malformed"  # not JSON, not an object, or a field of an unexpected type


# The kinds as module constants, for the per-event code here and in the meter: on CPython 3.10
# and 3.11 reading a member off its class (`ChunkKind.TOKEN`) goes through the slow attribute
# hook that EnumType's __getattr__ installs (~55 ns and ~850 instructions, against ~4 ns for a
# global; 3.12 dropped that __getattr__).
KIND_TOKEN: Final = ChunkKind.TOKEN
KIND_ROLE: Final = ChunkKind.ROLE
KIND_EMPTY: Final = ChunkKind.EMPTY
KIND_USAGE: Final = ChunkKind.USAGE
KIND_ERROR: Final = ChunkKind.ERROR
KIND_DONE: Final = ChunkKind.DONE
KIND_MALFORMED: Final = ChunkKind.MALFORMED


# The largest token count believed: 2**53 - 1, the largest integer every JSON reader keeps
# exactly. No real request comes near it; a larger count is a broken or hostile upstream, and
# trusting it would overflow the record's 64-bit columns (sums of counts included).
MAX_TOKEN_COUNT: Final = 2**53 - 1


class Usage(NamedTuple):
    """Token accounting of a chunk. In a streamed response ``completion_tokens`` is cumulative:
    with continuous usage stats every chunk carries the count so far *for its choice*, and the
    final usage-only chunk the sum over all choices (see `TokenCounter`)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int | None = None  # prompt_tokens_details.cached_tokens, when reported

    @classmethod
    def from_obj(cls, obj: object) -> Usage | None:
        """Read an OpenAI usage object. None unless prompt and completion counts are ints in
        [0, MAX_TOKEN_COUNT]; a missing or out-of-range total is their sum; optional parts of
        a wrong type or out of range are read as absent."""
        if type(obj) is not dict:
            return None
        prompt = obj.get("prompt_tokens")
        completion = obj.get("completion_tokens")
        # `type(...) is int` rejects bool, which JSON true/false would otherwise pass as.
        if not (_is_count(prompt) and _is_count(completion)):
            return None
        total = obj.get("total_tokens")
        if not _is_count(total):
            total = prompt + completion
        cached = None
        details = obj.get("prompt_tokens_details")
        if type(details) is dict:
            value = details.get("cached_tokens")
            if _is_count(value):
                cached = value
        # Called on every chunk with continuous usage: skip NamedTuple's keyword handling.
        return _new_tuple(cls, (prompt, completion, total, cached))


class PerRequestMetrics(NamedTuple):
    """vLLM's own per-request timings (``metrics`` in the usage chunk, with
    ``--enable-per-request-metrics``, n == 1 only), in milliseconds as reported. Note that
    ``time_to_first_token_ms`` is measured from scheduling, so it excludes queue time."""

    time_to_first_token_ms: float | None = None
    generation_time_ms: float | None = None
    queue_time_ms: float | None = None
    mean_itl_ms: float | None = None
    tokens_per_second: float | None = None

    @classmethod
    def from_obj(cls, obj: object) -> PerRequestMetrics | None:
        """None unless ``obj`` is a dict; a value that is not a number is read as absent."""
        if type(obj) is not dict:
            return None
        return cls(
            _float_or_none(obj.get("time_to_first_token_ms")),
            _float_or_none(obj.get("generation_time_ms")),
            _float_or_none(obj.get("queue_time_ms")),
            _float_or_none(obj.get("mean_itl_ms")),
            _float_or_none(obj.get("tokens_per_second")),
        )


class ErrorInfo(NamedTuple):
    """The ``error`` object of an error event or error body. vLLM sends an int ``code`` (the HTTP
    status); other OpenAI-style servers may send a string code."""

    message: str
    type: str | None = None
    code: int | str | None = None
    param: str | None = None

    @classmethod
    def from_obj(cls, obj: object) -> ErrorInfo | None:
        """Read ``{"message", "type", "param", "code"}``, or a bare string such as the
        ``{"error": "Unauthorized"}`` body; None for anything else."""
        if type(obj) is str:
            return cls(obj)
        if type(obj) is not dict:
            return None
        message = obj.get("message")
        err_type = obj.get("type")
        code = obj.get("code")
        param = obj.get("param")
        return cls(
            message if type(message) is str else "",
            err_type if type(err_type) is str else None,
            code if type(code) is int or type(code) is str else None,
            param if type(param) is str else None,
        )


class ChunkInfo(NamedTuple):
    """What `classify_chunk` read from one event.

    ``finish_reason`` and ``choice_index`` are those of the first choice in the chunk that has
    one (vLLM sends exactly one choice per chunk, also for n > 1). ``usage`` is set whenever the
    chunk carries usage: on the USAGE chunk, and on every chunk with continuous usage stats, in
    which case ``usage.completion_tokens`` is cumulative for the chunk's choice. ``metrics`` is
    read only from a chunk that carries usage, where vLLM puts it. ``model``, ``id`` and
    ``system_fingerprint`` are None when absent or not strings. Only ``kind`` is set for DONE
    and MALFORMED. ``usage_malformed``: the chunk has a ``usage`` member that is not a usage
    object of believable counts (negative, fractional, a string, NaN, over MAX_TOKEN_COUNT):
    ``usage`` is then None and the rest of the chunk is read as usual.
    """

    kind: ChunkKind
    usage: Usage | None = None
    finish_reason: str | None = None
    choice_index: int | None = None
    metrics: PerRequestMetrics | None = None
    error: ErrorInfo | None = None
    model: str | None = None
    id: str | None = None
    system_fingerprint: str | None = None
    usage_malformed: bool = False


_raw_decode: Final = json.JSONDecoder().raw_decode
_JSON_SPACE: Final = " \t\n\r"
_DONE_INFO: Final = ChunkInfo(KIND_DONE)
_MALFORMED_INFO: Final = ChunkInfo(KIND_MALFORMED)
# Delta keys whose non-empty string value is output text. `reasoning_content` is the older vLLM
# name of `reasoning`; `refusal` is OpenAI's, harmless to accept.
_DELTA_TEXT_KEYS: Final = ("content", "reasoning", "reasoning_content", "refusal")


def classify_chunk(data: str) -> ChunkInfo:
    """Classify the ``data`` of one SSE event. Never raises on a str."""
    if data == "[DONE]":
        return _DONE_INFO
    try:
        # raw_decode skips json.loads' wrapper layers (a third of its cost on a typical chunk);
        # the price is checking for trailing text here and retrying leading whitespace below.
        obj, end = _raw_decode(data)
    except (ValueError, RecursionError, TypeError):
        # ValueError covers JSONDecodeError and ints over Python's digit limit; RecursionError
        # very deep nesting.
        if type(data) is not str:
            return _MALFORMED_INFO
        stripped = data.strip(_JSON_SPACE)
        if stripped == "[DONE]":
            return _DONE_INFO
        if not stripped or stripped == data:
            return _MALFORMED_INFO
        return classify_chunk(stripped)
    if end != len(data) and data[end:].strip(_JSON_SPACE):
        return _MALFORMED_INFO
    if type(obj) is not dict:
        return _MALFORMED_INFO
    return _classify_object(obj)


def _classify_object(obj: dict[str, Any]) -> ChunkInfo:
    model = obj.get("model")
    chunk_id = obj.get("id")
    fingerprint = obj.get("system_fingerprint")
    if type(model) is not str:
        model = None
    if type(chunk_id) is not str:
        chunk_id = None
    if type(fingerprint) is not str:
        fingerprint = None

    err = obj.get("error")
    if err is not None:
        info = ErrorInfo.from_obj(err)
        if info is None:
            return _MALFORMED_INFO
        return ChunkInfo(KIND_ERROR, None, None, None, None, info, model, chunk_id, fingerprint)

    usage = None
    metrics = None
    usage_obj = obj.get("usage")
    # A usage member that cannot be believed is not a reason to drop the chunk's text: the
    # chunk is read without it, and the caller counts it and cuts it out as it would good usage.
    usage_malformed = False
    if usage_obj is not None:
        usage = Usage.from_obj(usage_obj)
        if usage is None:
            usage_malformed = True
        else:
            # vLLM sends its per-request metrics only beside the usage.
            metrics = PerRequestMetrics.from_obj(obj.get("metrics"))
    has_usage = usage_obj is not None

    choices = obj.get("choices")
    if type(choices) is not list:
        if choices is None and has_usage:
            # A usage chunk without the (empty) choices list: not vLLM, but unambiguous.
            return ChunkInfo(
                KIND_USAGE,
                usage,
                None,
                None,
                metrics,
                None,
                model,
                chunk_id,
                fingerprint,
                usage_malformed,
            )
        return _MALFORMED_INFO
    if not choices:
        kind = KIND_USAGE if has_usage else KIND_EMPTY
        return ChunkInfo(
            kind, usage, None, None, metrics, None, model, chunk_id, fingerprint, usage_malformed
        )

    kind = KIND_EMPTY
    finish_reason: str | None = None
    choice_index: int | None = None
    for choice in choices:
        if type(choice) is not dict:
            return _MALFORMED_INFO
        index = choice.get("index")
        if index is not None:
            if type(index) is not int:
                return _MALFORMED_INFO
            if choice_index is None:
                choice_index = index
        reason = choice.get("finish_reason")
        if reason is not None:
            if type(reason) is not str:
                return _MALFORMED_INFO
            if finish_reason is None:
                finish_reason = reason
        if kind is KIND_TOKEN:
            continue
        delta = choice.get("delta")
        if type(delta) is dict:
            content = delta.get("content")
            if content and type(content) is str:
                kind = KIND_TOKEN  # the common chat chunk, decided without a call
                continue
        choice_kind = _choice_kind(choice)
        if choice_kind is None:
            return _MALFORMED_INFO
        if choice_kind is KIND_TOKEN or choice_kind is KIND_ROLE:
            kind = choice_kind
    return _new_tuple(
        ChunkInfo,
        (
            kind,
            usage,
            finish_reason,
            choice_index,
            metrics,
            None,
            model,
            chunk_id,
            fingerprint,
            usage_malformed,
        ),
    )


def _choice_kind(choice: dict[str, Any]) -> ChunkKind | None:
    """TOKEN, ROLE or EMPTY for one choice; None if a field that decides it has a wrong type.
    Stops at the first sign of output, so later fields are not type-checked."""
    text = choice.get("text")  # completions
    if text is not None:
        if type(text) is not str:
            return None
        if text:
            return KIND_TOKEN
    delta = choice.get("delta")  # chat
    if delta is None:
        return KIND_EMPTY
    if type(delta) is not dict:
        return None
    for key in _DELTA_TEXT_KEYS:
        value = delta.get(key)
        if value is not None:
            if type(value) is not str:
                return None
            if value:
                return KIND_TOKEN
    tool_calls = delta.get("tool_calls")
    if tool_calls is not None:
        if type(tool_calls) is not list:
            return None
        if tool_calls:
            return KIND_TOKEN
    role = delta.get("role")
    if role is not None:
        if type(role) is not str:
            return None
        if role:
            return KIND_ROLE
    return KIND_EMPTY


def _is_count(value: object) -> TypeGuard[int]:
    # `type(...) is int` rejects bool, which JSON true/false would otherwise pass as.
    return type(value) is int and 0 <= value <= MAX_TOKEN_COUNT


def _float_or_none(value: object) -> float | None:
    if type(value) is float or type(value) is int:
        return float(value)
    return None


class TokenCounter:
    """Output tokens carried by each event of one streamed response.

    `observe` returns, per event:

    - with usage on the chunk (continuous usage stats): the increase of the cumulative
      ``completion_tokens`` since the previous chunk of the same choice. Tokens are attributed
      to the event where the cumulative count increases; when a non-TOKEN event (a role chunk,
      an empty-text chunk from special tokens) raises it, the increase is carried to the next
      TOKEN event of that choice, since that is the event a client sees. A TOKEN event can thus
      carry 0 tokens in the rare case where held-back text is released with no new token.
    - without usage: 1 for a TOKEN event (an estimate: a chunk may hold several tokens, and
      `exact` turns False), 0 for anything else. The estimate also advances the baseline, so a
      later cumulative count corrects the total instead of counting tokens twice.
    - 0 for USAGE, ERROR, DONE and MALFORMED events. The final usage chunk's total is the
      caller's to take as the request's N_out; `total` plus `unattributed` match it when every
      chunk carried usage.

    Baselines are kept per choice index because vLLM's continuous counts are per choice
    (``previous_num_tokens[i]`` in its serving code); counts are summed across choices, and
    per-choice counting for n > 1 is out of scope here.
    """

    __slots__ = ("_last", "_carry", "_exact", "total")

    def __init__(self) -> None:
        self._last: dict[int | None, int] = {}
        self._carry: dict[int | None, int] = {}
        self._exact = True
        self.total = 0  # sum of all counts returned so far

    @property
    def exact(self) -> bool:
        """True while every token count so far came from usage (vacuously so before any)."""
        return self._exact

    @property
    def unattributed(self) -> int:
        """Tokens counted on non-TOKEN events and not yet handed to a TOKEN event."""
        return sum(self._carry.values())

    def observe(self, info: ChunkInfo) -> int:
        """Return the number of output tokens the event described by ``info`` carried."""
        kind = info.kind
        usage = info.usage
        if kind is KIND_TOKEN:
            return self.token_event(
                info.choice_index, None if usage is None else usage.completion_tokens
            )
        if (kind is not KIND_ROLE and kind is not KIND_EMPTY) or usage is None:
            return 0
        key = info.choice_index
        cumulative = usage.completion_tokens
        last = self._last.get(key, 0)
        if cumulative > last:
            self._last[key] = cumulative
            self._carry[key] = self._carry.get(key, 0) + cumulative - last
        return 0

    def lane_state(self) -> int | None:
        """Choice 0's cumulative count so far, when the C lane (`_tokenscan.Lane`) may count on
        from it: nothing is carried, and no other choice has counted; else None."""
        if self._carry or (self._last and self._last.keys() != {0}):
            return None
        return self._last.get(0, 0)

    def take_lane(self, gained: int, last_cumulative: int, exact: bool, carry: int = 0) -> None:
        """Token events of choice 0 the C lane counted, ``gained`` tokens in all, ending at
        ``last_cumulative``, and ``carry`` tokens of its empty texts after the last of them:
        what `token_event` and `observe` would have left."""
        self._last[0] = last_cumulative
        self.total += gained
        if not exact:
            self._exact = False
        if carry:
            self._carry[0] = carry

    def token_event(self, key: int | None, cumulative: int | None) -> int:
        """`observe` for a TOKEN event of choice ``key`` whose usage says ``cumulative``
        completion tokens (None: no usage on it). Called as is by the meter's one-event lane,
        which has the two numbers without a ChunkInfo."""
        if cumulative is not None:
            last = self._last.get(key, 0)
            gained = 0
            if cumulative > last:
                gained = cumulative - last
                self._last[key] = cumulative
        else:
            self._exact = False
            self._last[key] = self._last.get(key, 0) + 1
            gained = 1
        if self._carry:
            gained += self._carry.pop(key, 0)
        self.total += gained
        return gained


_SAFE_ERROR_TYPE: Final = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def safe_error_type(error: ErrorInfo | None, status: int) -> str:
    """The error's ``type`` when it is a short identifier (records and metric labels carry it),
    else ``http_<status>``: free text from a body never reaches records or metrics."""
    if error is not None and error.type and _SAFE_ERROR_TYPE.fullmatch(error.type):
        return error.type
    return f"http_{status}"


def error_body(
    message: str, err_type: str, code: int, param: str | None = None
) -> dict[str, dict[str, Any]]:
    """vLLM's error body, keys in its order: ``{"error": {"message","type","param","code"}}``.
    The same object is sent mid-stream as a ``data:`` event."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def endpoint_for_path(path: str) -> str | None:
    """``"chat"`` for /v1/chat/completions, ``"completions"`` for /v1/completions, else None.
    Exact match: the path as routed, without query string."""
    return _ENDPOINTS.get(path)


def stream_usage_options(body: object) -> tuple[bool, bool, bool]:
    """``(stream, include_usage, continuous_usage_stats)`` as the request body asks for them,
    with vLLM's precedence: usage options count only on a stream (vLLM answers 400 otherwise),
    and continuous stats only with include_usage. Values are read the way vLLM's pydantic models
    read booleans (true/false, 0/1, "true"/"yes"/"on"...); anything else, or a body that is not
    an object, reads as False."""
    # dict first: a request's body always is one (the ABC check: 166 ns, this: 25; timeit).
    if not (type(body) is dict or isinstance(body, Mapping)):
        return False, False, False
    stream = _lax_bool(body.get("stream"))
    options = body.get("stream_options")
    if not stream or not (type(options) is dict or isinstance(options, Mapping)):
        return stream, False, False
    include_usage = _lax_bool(options.get("include_usage"))
    continuous = include_usage and _lax_bool(options.get("continuous_usage_stats"))
    return stream, include_usage, continuous


_TRUE_STRINGS: Final = frozenset({"1", "on", "t", "true", "y", "yes"})


def _lax_bool(value: object) -> bool:
    if value is True or value is False:
        return value
    if type(value) is int:
        return value == 1
    if type(value) is str:
        return value.strip().lower() in _TRUE_STRINGS
    return False
