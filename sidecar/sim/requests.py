"""Reading and validating request bodies the way vLLM's pydantic models do.

Body-schema problems (bad JSON, a field of the wrong type, a missing required field) become
vLLM's 400 ``"Bad Request"`` errors, whose message lists pydantic-style error dicts
(``1 validation error:\\n  {'type': 'missing', 'loc': 'body.messages', 'msg': 'Field required',
'input': '<dict of 2 items>'}``) and whose ``param`` is the dotted location. As vLLM renders
them (0.32 and 0.33, ``validation_exception_handler``): ``loc`` dotted, ``input`` summarised
(a container by its size, a long string cut at 200 characters: never the request echoed), at
most 10 errors reported, each cut at 1,000 characters. Semantic problems found later (context
length, min_tokens) are the server's 400 ``"BadRequestError"`` (`RequestError` with that type).

Types are read in pydantic's lax mode: an int field takes ``5``, ``5.0``, ``"5"`` or a bool;
a bool field takes ``true``, ``1``, ``"yes"``...; anything else is an error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sidecar.protocol import jsonbody
from sidecar.sim.tokenizer import ChatMessage

if TYPE_CHECKING:
    from sidecar.sim.tools import ToolRequest

BAD_REQUEST = "Bad Request"
# vLLM's _SAMPLING_EPS: a temperature below it is greedy sampling.
GREEDY_EPS = 1e-5
# vLLM's default --max-logprobs: more alternatives per token than this are refused.
MAX_LOGPROBS = 20
BAD_REQUEST_ERROR = "BadRequestError"
# vLLM's message for a dead engine (500), and for a generation that failed mid-way.
ENGINE_DEAD_MESSAGE = "The server had an error while processing your request."
GENERATION_ERROR_MESSAGE = "Internal server error"

_MISSING: Any = object()
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


class RequestError(Exception):
    """An error answer in vLLM's shape: HTTP ``status`` with ``{"error": {...}}``."""

    def __init__(self, status: int, message: str, err_type: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param


def bad_request(message: str, param: str | None = None, value: Any = None) -> RequestError:
    """A semantic validation failure: BadRequestError. With ``param``, vLLM's
    VLLMValidationError, whose message ends ``(parameter=P, value=V)`` (``value`` when known);
    without, a plain ValueError's message."""
    if param is not None:
        message += f" (parameter={param}" + ("" if value is None else f", value={value}") + ")"
    return RequestError(400, message, BAD_REQUEST_ERROR, param)


def _loc_param(loc: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in loc)


_MAX_REPORTED_ERRORS = 10
_MAX_ERROR_INPUT_CHARS = 200
_MAX_ERROR_CHARS = 1000


def _summarize_input(value: object) -> object:
    """vLLM's bounded stand-in for an error's ``input`` (``_summarize_error_input``)."""
    if isinstance(value, str):
        if len(value) > _MAX_ERROR_INPUT_CHARS:
            return value[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]"
        return value
    if isinstance(value, (bytes, bytearray)):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    if len(text) > _MAX_ERROR_INPUT_CHARS:
        return text[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]"
    return text


def _format_issue(issue: dict[str, Any]) -> str:
    shown = dict(issue)
    if "input" in shown:
        shown["input"] = _summarize_input(shown["input"])
    shown["loc"] = _loc_param(tuple(shown["loc"]))
    text = str(shown)
    if len(text) > _MAX_ERROR_CHARS:
        text = text[:_MAX_ERROR_CHARS] + "...[truncated]"
    return text


def validation_error(issues: list[dict[str, Any]]) -> RequestError:
    """Body-schema errors, rendered like vLLM's RequestValidationError handler."""
    count = len(issues)
    label = "error" if count == 1 else "errors"
    reported = issues[:_MAX_REPORTED_ERRORS]
    message = f"{count} validation {label}:\n" + "".join(
        f"  {_format_issue(issue)}\n" for issue in reported
    )
    if count > len(reported):
        message += f"  ...and {count - len(reported)} more {label}\n"
    return RequestError(400, message.rstrip(), BAD_REQUEST, _loc_param(issues[0]["loc"]))


def _issue(kind: str, loc: tuple[Any, ...], msg: str, value: Any) -> dict[str, Any]:
    return {"type": kind, "loc": loc, "msg": msg, "input": value}


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Decode a request body that must be a JSON object."""
    try:
        # As json.loads, ~6x faster on a long prompt: this runs on the replica's loop, before
        # it can stamp another request's arrival (protocol/jsonbody.py).
        body = jsonbody.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        position = getattr(exc, "pos", 0)
        reason = getattr(exc, "msg", str(exc))
        issue = _issue("json_invalid", ("body", position), "JSON decode error", {})
        issue["ctx"] = {"error": reason}
        raise validation_error([issue]) from None
    if not isinstance(body, dict):
        raise validation_error(
            [
                _issue(
                    "model_attributes_type",
                    ("body",),
                    "Input should be a valid dictionary or object to extract fields from",
                    body,
                )
            ]
        )
    return body


class FieldReader:
    """Reads typed fields from a body, collecting every problem before failing once."""

    def __init__(self, body: Mapping[str, Any]) -> None:
        self.body = body
        self.issues: list[dict[str, Any]] = []

    def fail_if_any(self) -> None:
        if self.issues:
            raise validation_error(self.issues)

    def int_(self, name: str, default: int | None = None) -> int | None:
        value = self.body.get(name, _MISSING)
        if value is _MISSING or value is None:
            return default
        loc = ("body", name)
        if type(value) is int or type(value) is bool:
            return int(value)
        if type(value) is float:
            if value.is_integer():
                return int(value)
            self.issues.append(
                _issue(
                    "int_from_float",
                    loc,
                    "Input should be a valid integer, got a number with a fractional part",
                    value,
                )
            )
            return default
        if type(value) is str:
            try:
                return int(value.strip())
            except ValueError:
                self.issues.append(
                    _issue(
                        "int_parsing",
                        loc,
                        "Input should be a valid integer, unable to parse string as an integer",
                        value,
                    )
                )
                return default
        self.issues.append(_issue("int_type", loc, "Input should be a valid integer", value))
        return default

    def float_(self, name: str) -> float | None:
        """A float field in pydantic's lax mode: a number, a bool or a numeric string."""
        value = self.body.get(name, _MISSING)
        if value is _MISSING or value is None:
            return None
        if type(value) in (int, float, bool):
            return float(value)
        if type(value) is str:
            try:
                return float(value.strip())
            except ValueError:
                self.issues.append(
                    _issue(
                        "float_parsing",
                        ("body", name),
                        "Input should be a valid number, unable to parse string as a number",
                        value,
                    )
                )
                return None
        self.issues.append(
            _issue("float_type", ("body", name), "Input should be a valid number", value)
        )
        return None

    def bool_(self, name: str, default: bool, source: Mapping[str, Any] | None = None) -> bool:
        mapping = self.body if source is None else source
        value = mapping.get(name, _MISSING)
        if value is _MISSING or value is None:
            return default
        loc: tuple[Any, ...] = (
            ("body", name) if source is None else ("body", "stream_options", name)
        )
        parsed = lax_bool(value)
        if parsed is None:
            kind = "bool_parsing" if isinstance(value, str) else "bool_type"
            msg = "Input should be a valid boolean"
            if kind == "bool_parsing":
                msg += ", unable to interpret input"
            self.issues.append(_issue(kind, loc, msg, value))
            return default
        return parsed

    def str_(self, name: str) -> str | None:
        value = self.body.get(name, _MISSING)
        if value is _MISSING or value is None:
            return None
        if isinstance(value, str):
            return value
        self.issues.append(
            _issue("string_type", ("body", name), "Input should be a valid string", value)
        )
        return None


def lax_bool(value: Any) -> bool | None:
    """pydantic's lax bool: True/False, 0/1, and the usual strings; None if not a bool."""
    if value is True or value is False:
        return bool(value)
    if type(value) is int and value in (0, 1):
        return value == 1
    if type(value) is float and value in (0.0, 1.0):
        return value == 1.0
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    return None


@dataclass(frozen=True, slots=True)
class StreamOptions:
    include_usage: bool
    continuous_usage_stats: bool


@dataclass(frozen=True, slots=True)
class GenerateParams:
    """What the server needs from a chat or completions body, before tokenization."""

    chat: bool
    model: str | None
    # Chat: the conversation. Completions: one entry per prompt, text or token ids.
    messages: tuple[ChatMessage, ...]
    prompts: tuple[str | tuple[int, ...], ...]
    add_generation_prompt: bool
    add_special_tokens: bool
    n: int
    max_tokens: int | None
    max_tokens_param: str
    min_tokens: int
    ignore_eos: bool
    stream: bool
    stream_options: StreamOptions | None
    stream_interval: int | None
    use_beam_search: bool
    request_id: str | None
    temperature: float | None = None  # None: the model's default (1.0 here)
    # Logprobs of sampled tokens: None (not asked) or how many alternatives per token (chat:
    # ``top_logprobs`` when ``logprobs`` is true; completions: ``logprobs``).
    logprobs: int | None = None
    echo: bool = False  # completions: the prompt's text before the completion
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    seed: int | None = None
    prompt_logprobs: int | None = None
    # Chat: ``tools`` / ``tool_choice`` as vLLM's check_tool_usage leaves them (None: neither).
    tools: ToolRequest | None = None

    @property
    def greedy(self) -> bool:
        """Temperature 0: vLLM samples the most likely token, the same for the same prompt."""
        return self.temperature is not None and self.temperature < GREEDY_EPS


def _read_stream_options(reader: FieldReader) -> StreamOptions | None:
    raw = reader.body.get("stream_options")
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        reader.issues.append(
            _issue(
                "model_type",
                ("body", "stream_options"),
                "Input should be a valid dictionary or instance of StreamOptions",
                raw,
            )
        )
        return None
    include = reader.bool_("include_usage", False, source=raw)
    continuous = reader.bool_("continuous_usage_stats", False, source=raw)
    return StreamOptions(include_usage=include, continuous_usage_stats=continuous)


def _message_text(content: Any, loc: tuple[Any, ...], reader: FieldReader) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                reader.issues.append(
                    _issue("model_type", (*loc, i), "Input should be a valid content part", part)
                )
                continue
            part_type = part["type"]
            if part_type not in ("text", "input_text"):
                # vLLM would load the media; the simulator has no encoder to charge it to.
                raise bad_request(
                    f"Content part type {part_type!r} is not supported by the simulator "
                    "(text parts only)"
                )
            text = part.get("text")
            if not isinstance(text, str):
                reader.issues.append(
                    _issue("string_type", (*loc, i, "text"), "Input should be a valid string", text)
                )
                continue
            texts.append(text)
        # vLLM's "string" content format joins text parts with newlines.
        return "\n".join(texts)
    reader.issues.append(_issue("string_type", loc, "Input should be a valid string", content))
    return ""


def read_messages(reader: FieldReader) -> tuple[ChatMessage, ...]:
    raw = reader.body.get("messages", _MISSING)
    if raw is _MISSING:
        reader.issues.append(
            _issue("missing", ("body", "messages"), "Field required", dict(reader.body))
        )
        return ()
    if not isinstance(raw, list):
        reader.issues.append(
            _issue("list_type", ("body", "messages"), "Input should be a valid list", raw)
        )
        return ()
    messages: list[ChatMessage] = []
    for i, message in enumerate(raw):
        loc = ("body", "messages", i)
        if not isinstance(message, Mapping):
            reader.issues.append(
                _issue("model_type", loc, "Input should be a valid dictionary", message)
            )
            continue
        role = message.get("role", _MISSING)
        if role is _MISSING:
            reader.issues.append(_issue("missing", (*loc, "role"), "Field required", dict(message)))
            continue
        if not isinstance(role, str):
            reader.issues.append(
                _issue("string_type", (*loc, "role"), "Input should be a valid string", role)
            )
            continue
        text = _message_text(message.get("content"), (*loc, "content"), reader)
        messages.append(ChatMessage(role=role, content=text))
    return tuple(messages)


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(type(item) is int for item in value)


def _read_prompts(reader: FieldReader) -> tuple[str | tuple[int, ...], ...]:
    raw = reader.body.get("prompt")
    if raw is None or (isinstance(raw, list) and not raw):
        issue = _issue(
            "value_error",
            ("body",),
            "Value error, Either prompt or prompt_embeds must be provided and non-empty.",
            dict(reader.body),
        )
        issue["ctx"] = {
            "error": ValueError("Either prompt or prompt_embeds must be provided and non-empty.")
        }
        reader.issues.append(issue)
        return ()
    if isinstance(raw, str):
        return (raw,)
    if _is_token_list(raw):
        return (tuple(raw),)
    if isinstance(raw, list):
        prompts: list[str | tuple[int, ...]] = []
        for i, item in enumerate(raw):
            if isinstance(item, str):
                prompts.append(item)
            elif _is_token_list(item) and item:
                prompts.append(tuple(item))
            else:
                reader.issues.append(
                    _issue(
                        "union_type",
                        ("body", "prompt", i),
                        "Input should be a valid string or a list of integers",
                        item,
                    )
                )
        return tuple(prompts)
    reader.issues.append(
        _issue("union_type", ("body", "prompt"), "Input should be a valid string or list", raw)
    )
    return ()


def _read_input(
    reader: FieldReader, chat: bool
) -> tuple[tuple[ChatMessage, ...], tuple[str | tuple[int, ...], ...], int | None, str]:
    """The messages (chat) or prompts (completions), and the output budget with the name of
    the field that gave it."""
    if not chat:
        return (), _read_prompts(reader), reader.int_("max_tokens", 16), "max_tokens"
    messages = read_messages(reader)
    max_completion_tokens = reader.int_("max_completion_tokens")
    legacy_max_tokens = reader.int_("max_tokens")
    if max_completion_tokens is not None:
        return messages, (), max_completion_tokens, "max_completion_tokens"
    return messages, (), legacy_max_tokens, "max_tokens"


def _check_prompt_logprobs(prompt_logprobs: int | None, stream: bool) -> None:
    """The request models' check of ``prompt_logprobs`` (check_logprobs, its first part)."""
    if prompt_logprobs is None:
        return
    if stream and (prompt_logprobs > 0 or prompt_logprobs == -1):
        raise bad_request(
            "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
        )
    if prompt_logprobs < 0 and prompt_logprobs != -1:
        raise bad_request(
            "`prompt_logprobs` must be a positive value or -1.",
            "prompt_logprobs",
            prompt_logprobs,
        )


def _chat_logprobs(wants_logprobs: bool, top_logprobs: int | None) -> int | None:
    """A chat request's alternatives per token (None: no logprobs), checked as vLLM does."""
    if top_logprobs is not None and top_logprobs < 0 and top_logprobs != -1:
        raise bad_request(
            "`top_logprobs` must be a positive value or -1.", "top_logprobs", top_logprobs
        )
    if top_logprobs and not wants_logprobs:
        raise bad_request(
            "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
        )
    return (top_logprobs or 0) if wants_logprobs else None


def _completion_logprobs(logprobs: int | None) -> int | None:
    """A completion request's ``logprobs``, checked as vLLM does."""
    if logprobs is not None and logprobs < 0 and logprobs != -1:
        raise bad_request("`logprobs` must be a positive value or -1.", "logprobs", logprobs)
    return logprobs


def read_generate_params(body: Mapping[str, Any], chat: bool) -> GenerateParams:
    """Validate a /v1/chat/completions or /v1/completions body (raises RequestError)."""
    reader = FieldReader(body)
    model = reader.str_("model")
    request_id = reader.str_("request_id")
    messages, prompts, max_tokens, max_tokens_param = _read_input(reader, chat)
    n = reader.int_("n", 1)
    temperature = reader.float_("temperature")
    min_tokens = reader.int_("min_tokens", 0)
    stream_interval = reader.int_("stream_interval")
    ignore_eos = reader.bool_("ignore_eos", False)
    stream = reader.bool_("stream", False)
    use_beam_search = reader.bool_("use_beam_search", False)
    add_generation_prompt = reader.bool_("add_generation_prompt", True)
    add_special_tokens = reader.bool_("add_special_tokens", not chat)
    stream_options = _read_stream_options(reader)
    echo = reader.bool_("echo", False)
    include_stop = reader.bool_("include_stop_str_in_output", False)
    seed = reader.int_("seed")
    stop = _read_stop(reader)
    if chat:
        wants_logprobs = reader.bool_("logprobs", False)
        top_logprobs = reader.int_("top_logprobs", 0)
    else:
        completion_logprobs = reader.int_("logprobs")
    prompt_logprobs = reader.int_("prompt_logprobs")
    reader.fail_if_any()
    # The request models' "before" validators (check_logprobs), in their order.
    _check_prompt_logprobs(prompt_logprobs, stream)
    logprobs = (
        _chat_logprobs(wants_logprobs, top_logprobs)
        if chat
        else _completion_logprobs(completion_logprobs)
    )
    if stream_options is not None and not stream:
        # vLLM 0.32: a VLLMValidationError from the request's validator, answered as a
        # BadRequestError (checked against the real server), not a schema error.
        raise bad_request(
            "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    tools: ToolRequest | None = None
    if chat:
        # Here, not at the top: sidecar.sim.tools builds its errors with this module's helpers.
        from sidecar.sim.tools import read_tool_request

        tools = read_tool_request(reader.body)
    if chat and prompt_logprobs is None and echo:
        # Chat with echo asks for the prompt's logprobs with top_logprobs alternatives
        # (ChatCompletionRequest.to_sampling_params).
        prompt_logprobs = logprobs or 0
    if not chat and prompt_logprobs is None and echo:
        prompt_logprobs = logprobs  # CompletionRequest.to_sampling_params
    return GenerateParams(
        chat=chat,
        model=model,
        messages=messages,
        prompts=prompts,
        add_generation_prompt=add_generation_prompt,
        add_special_tokens=add_special_tokens,
        n=1 if n is None else n,
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        min_tokens=0 if min_tokens is None else min_tokens,
        ignore_eos=ignore_eos,
        stream=stream,
        stream_options=stream_options,
        stream_interval=stream_interval,
        use_beam_search=use_beam_search,
        request_id=request_id,
        temperature=temperature,
        logprobs=logprobs,
        echo=echo and not chat,
        stop=stop,
        include_stop_str_in_output=include_stop,
        seed=seed,
        prompt_logprobs=prompt_logprobs,
        tools=tools,
    )


def _read_stop(reader: FieldReader) -> tuple[str, ...]:
    """``stop``: a string or a list of strings (empty strings never match and are dropped)."""
    raw = reader.body.get("stop")
    if raw is None:
        return ()
    if isinstance(raw, str):
        return (raw,) if raw else ()
    if isinstance(raw, list) and all(isinstance(item, str) for item in raw):
        return tuple(item for item in raw if item)
    reader.issues.append(
        _issue("union_type", ("body", "stop"), "Input should be a valid string or list", raw)
    )
    return ()


def read_token_ids(body: Mapping[str, Any], name: str) -> list[int]:
    """A required list-of-int field (``/detokenize``'s ``tokens``)."""
    value = body.get(name, _MISSING)
    if value is _MISSING:
        raise validation_error([_issue("missing", ("body", name), "Field required", dict(body))])
    if not _is_token_list(value):
        raise validation_error(
            [_issue("list_type", ("body", name), "Input should be a valid list of integers", value)]
        )
    return list(value)
