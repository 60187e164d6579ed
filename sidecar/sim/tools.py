"""Tool calls as vLLM 0.32's OpenAI server answers them, for the simulator.

vLLM serves tools only when started with ``--enable-auto-tool-choice --tool-call-parser NAME``
(without both, ``ParserManager.get_tool_parser`` gives no parser and the renderer refuses every
``tool_choice`` but "none": vllm/parser/parser_manager.py 36-37, vllm/renderers/
online_renderer.py 253-280). With them:

- named (``{"type": "function", "function": {"name": N}}``) and ``"required"`` force a call:
  structured outputs constrain the model to JSON fitting the tool's ``parameters``
  (named: the parameters object itself; required: an array of ``{"name", "parameters"}``
  objects; vllm/tool_parsers/utils.py 425-490, abstract_tool_parser.py 122-178). The
  simulator's "model" writes a deterministic synthetic value for the schema (`synthetic_value`)
  in compact JSON, one tokenizer piece per token, then EOS.
- "auto": the model may call a tool or answer in text; the simulated model answers in text
  (what the tiny random model does too), so the answer is the plain one.
- "none": the plain answer.

Streamed (vllm/entrypoints/openai/chat_completion/serving.py 660-800, and
vllm/tool_parsers/streaming.py):

- named: every token's text becomes a ``delta.tool_calls`` entry, even an empty one (the EOS
  token's): the first with ``id``, ``type``, ``index`` and ``function.name`` and
  ``function.arguments``, later ones ``{"index":0,"function":{"arguments":...}}``
  (``extract_named_tool_call_streaming``); finish_reason stays "stop".
- required: the text is scanned as the JSON array (``extract_required_tool_call_streaming``):
  nothing is sent until the call's name is complete and its parameters have begun; the first
  entry then carries id, type, index, name and the parameters' text so far, later ones only new
  parameter text, with an explicit ``"name":null``; text outside the parameters value (the
  array's closing ``}]``, EOS) sends nothing, so the finish chunk's delta is ``{}``, and a call
  that streamed and stopped finishes "tool_calls".

Whole answers (serving.py 965-1130, vllm/parser/abstract_parser.py 384-484): the message has
``"content":""`` and ``tool_calls`` (``{"id","type","function":{"name","arguments"}}``) after
``function_call``, the key left out when no call was found. Named: the arguments are the text
as generated; required: the array is parsed and each call's parameters re-serialised with
``json.dumps`` (so ``", "`` and ``": "`` separators), finish_reason "tool_calls" whenever the
model stopped (even if the array did not parse); a truncated array ("length") has no calls.

What the simulator leaves out (docs/real-vllm.md): stop strings and logprobs on tool-call
chunks, more than one call for "required" (its model calls the first tool once), and the
shapes of parsers that constrain with structural tags by default (hermes, llama3_json, ...:
``content: null`` on their deltas), for which see docs/real-vllm.md.
"""

from __future__ import annotations

import json
import uuid
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sidecar.sim import tokenizer
from sidecar.sim.requests import bad_request

__all__ = [
    "ToolCallOutput",
    "ToolChoice",
    "ToolRequest",
    "read_tool_request",
    "synthetic_value",
    "tool_refusal",
]

_CORRECT_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


@dataclass(frozen=True, slots=True)
class ToolChoice:
    kind: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the function, for "named"


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A chat body's ``tools`` (their ``function`` objects), ``tool_choice`` and
    ``parallel_tool_calls``, as ``ChatCompletionRequest.check_tool_usage`` leaves them."""

    functions: tuple[Mapping[str, Any], ...]
    choice: ToolChoice
    parallel_tool_calls: bool = True

    @property
    def forces_call(self) -> bool:
        return self.choice.kind in ("named", "required")

    def function(self) -> Mapping[str, Any]:
        """The function the forced call calls: the named one, or for "required" the first
        (the simulated model's pick)."""
        if self.choice.kind == "named":
            for function in self.functions:
                if function.get("name") == self.choice.name:
                    return function
        return self.functions[0] if self.functions else {"name": ""}


def read_tool_request(body: Mapping[str, Any]) -> ToolRequest | None:
    """``tools``/``tool_choice`` of a chat body, validated as vLLM's ``check_tool_usage``
    validates them (vllm/entrypoints/openai/chat_completion/protocol.py 937-1019): its
    VLLMValidationErrors are BadRequestErrors naming the parameter. None: no tools and no
    tool_choice (a plain request)."""
    tools = body.get("tools")
    if tools == []:
        raise bad_request(
            "`tools` must not be an empty array. Either provide at least one "
            "tool or omit the field entirely.",
            "tools",
        )
    raw_choice = body.get("tool_choice", "auto" if tools else None)
    functions = tuple(
        tool["function"]
        for tool in tools or ()
        if isinstance(tool, Mapping) and isinstance(tool.get("function"), Mapping)
    )
    parallel = body.get("parallel_tool_calls", True) is not False
    if raw_choice is None or raw_choice == "none":
        if tools is None:
            return None
        return ToolRequest(functions, ToolChoice("none"), parallel)
    if tools is None:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if raw_choice in ("auto", "required"):
        return ToolRequest(functions, ToolChoice(raw_choice), parallel)
    if not isinstance(raw_choice, Mapping):
        raise bad_request(
            f"Invalid value for `tool_choice`: {raw_choice}! Only named tools, "
            '"none", "auto" or "required" are supported.',
            "tool_choice",
        )
    function = raw_choice.get("function")
    if not isinstance(function, Mapping):
        raise bad_request(
            f"Invalid value for `function`: `{function}` in `tool_choice`! {_CORRECT_USAGE}",
            "tool_choice.function",
        )
    if "name" not in function:
        raise bad_request(
            f"Expected field `name` in `function` in `tool_choice`! {_CORRECT_USAGE}",
            "tool_choice.function.name",
        )
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise bad_request(
            f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_CORRECT_USAGE}",
            "tool_choice.function.name",
        )
    if not any(candidate.get("name") == name for candidate in functions):
        raise bad_request(
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            "tool_choice",
        )
    return ToolRequest(functions, ToolChoice("named", name), parallel)


def tool_refusal(tools: ToolRequest | None, enabled: bool) -> str | None:
    """The renderer's refusal of a tool_choice the server cannot serve (vLLM started without
    ``--enable-auto-tool-choice --tool-call-parser``: online_renderer.py 258-280), or None."""
    if enabled or tools is None or tools.choice.kind == "none":
        return None
    if tools.choice.kind == "auto":
        return (
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        )
    if tools.choice.kind == "named":
        return f'tool_choice=function "{tools.choice.name}" requires --tool-call-parser to be set'
    return f'tool_choice="{tools.choice.kind}" requires --tool-call-parser to be set'


# ------------------------------------------------------------------ the simulated model's call

_WORDS = ("kalo", "mire", "tosa", "vine", "dupa", "rigo", "lema", "shitu")


def _word(key: str) -> str:
    return _WORDS[zlib.crc32(key.encode()) % len(_WORDS)]


def synthetic_value(schema: Any, key: str = "") -> Any:
    """A deterministic value that fits a (simple) JSON schema: ``const``, the first ``enum``
    member, the first branch of ``anyOf``/``oneOf``, objects with every declared property in
    declaration order (required ones among them), arrays of ``minItems`` (at least one) items,
    strings of ``minLength``..``maxLength`` pseudo-words, numbers within their bounds, true for
    booleans. ``key`` (the property's path) varies the strings, so that two fields differ."""
    if not isinstance(schema, Mapping):
        return _word(key)
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    for combinator in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(combinator)
        if isinstance(branches, list) and branches:
            return synthetic_value(branches[0], key)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "string"
    if kind == "object":
        properties = schema.get("properties")
        if not isinstance(properties, Mapping):
            properties = {}
        names = list(properties)
        required = schema.get("required")
        if isinstance(required, list):
            names += [name for name in required if isinstance(name, str) and name not in names]
        return {name: synthetic_value(properties.get(name, {}), f"{key}.{name}") for name in names}
    if kind == "array":
        low = schema.get("minItems")
        count = low if isinstance(low, int) and low > 0 else 1
        return [synthetic_value(schema.get("items", {}), f"{key}[{i}]") for i in range(count)]
    if kind == "integer" or kind == "number":
        return _number(schema, integer=kind == "integer")
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return _string(schema, key)


def _number(schema: Mapping[str, Any], integer: bool) -> int | float:
    value: float = 1
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    high = schema.get("maximum", schema.get("exclusiveMaximum"))
    if isinstance(low, (int, float)) and not isinstance(low, bool):
        value = low + (1 if "minimum" not in schema else 0)
    if isinstance(high, (int, float)) and not isinstance(high, bool) and value > high:
        value = high
    return int(value) if integer else float(value) + (0.5 if value == int(value) else 0.0)


def _string(schema: Mapping[str, Any], key: str) -> str:
    text = _word(key)
    low, high = schema.get("minLength"), schema.get("maxLength")
    if isinstance(low, int):
        while len(text) < low:
            text += _word(text)
    if isinstance(high, int) and high >= 0:
        text = text[:high]
    return text


def _parameters(function: Mapping[str, Any]) -> Mapping[str, Any]:
    """The schema vLLM constrains to: the tool's parameters, or an empty object schema when
    it has none (``_params_or_empty_object``)."""
    parameters = function.get("parameters")
    return parameters if isinstance(parameters, Mapping) else {"type": "object", "properties": {}}


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def tool_call_id() -> str:
    """``make_tool_call_id``'s default: "chatcmpl-tool-" and 16 random hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().int & (1 << 64) - 1:016x}"


class ToolCallOutput:
    """One choice's forced tool call: the text the simulated model generates for it, cut into
    per-token pieces, and how vLLM's serving code turns that text into deltas and messages."""

    __slots__ = (
        "named",
        "name",
        "output",
        "pieces",
        "text",
        "position",
        "streamed",
        "_announced",
        "_seen",
        "_args_start",
        "_args_end",
        "_name_end",
    )

    def __init__(self, request: ToolRequest) -> None:
        function = request.function()
        self.named = request.choice.kind == "named"
        self.name = str(function.get("name", ""))
        arguments = synthetic_value(_parameters(function), self.name)
        if self.named:
            self.output = _compact(arguments)
            self._args_start, self._args_end, self._name_end = 0, len(self.output), 0
        else:
            # The required array, one element: where its name ends and its parameters lie.
            head = '[{"name":' + _compact(self.name)
            self._name_end = len(head)
            head += ',"parameters":'
            body = _compact(arguments)
            self.output = head + body + "}]"
            self._args_start, self._args_end = len(head), len(head) + len(body)
        self.pieces = tokenizer.split_pieces(self.output)
        self.text = ""  # generated so far
        self.position = 0  # tokens generated so far
        self.streamed = False  # a delta with tool_calls went out
        self._announced = False
        # How much of `text` has been turned into deltas: the stream may lag the engine, which
        # goes on adding text meanwhile.
        self._seen = 0

    @property
    def natural_length(self) -> int:
        """Tokens until the model stops: the call's pieces, then EOS (structured outputs allow
        nothing else once the JSON is complete)."""
        return len(self.pieces) + 1

    def next_text(self, token_ids: Sequence[int]) -> str:
        """The text of the next generated tokens: the call's pieces, then (past them, only with
        ``ignore_eos``, as vLLM goes on generating past the grammar's end) the tokens' own
        text; EOS is empty."""
        parts: list[str] = []
        for token_id in token_ids:
            if self.position < len(self.pieces):
                parts.append(self.pieces[self.position])
            else:
                parts.append(tokenizer.decode((token_id,)))
            self.position += 1
        text = "".join(parts)
        self.text += text
        return text

    def delta(self, new_text: str) -> str | None:
        """The streamed ``delta`` (JSON) for ``new_text``, the text that follows what earlier
        calls were given; None when vLLM sends nothing for it."""
        previous = self._seen
        current = self._seen = previous + len(new_text)
        if self.named:
            # extract_named_tool_call_streaming: every delta, empty text included.
            if not self._announced:
                self._announced = True
                self.streamed = True
                return self._first_entry(new_text)
            return (
                f'{{"tool_calls":[{{"index":0,"function":{{"arguments":{_compact(new_text)}}}}}]}}'
            )
        # extract_required_tool_call_streaming over previous and current text.
        if not self._ready_at(current):
            return None
        end = min(self._args_end, current)
        if not self._ready_at(previous):
            self._announced = self.streamed = True
            return self._first_entry(self.text[self._args_start : end])
        new_arguments = self.text[min(end, previous) : end]
        if not new_arguments:
            return None
        return (
            '{"tool_calls":[{"index":0,"function":{"name":null,"arguments":'
            f"{_compact(new_arguments)}}}}}]}}"
        )

    def _ready_at(self, length: int) -> bool:
        return self._name_end <= length and self._args_start < length

    def _first_entry(self, arguments: str) -> str:
        return (
            f'{{"tool_calls":[{{"id":"{tool_call_id()}","type":"function","index":0,'
            f'"function":{{"name":{_compact(self.name)},"arguments":{_compact(arguments)}}}'
            "}]}"
        )

    def stream_finish_reason(self, finish_reason: str) -> str:
        """A streamed choice's finish: "tool_calls" for a non-named call that streamed and
        stopped (serving.py 764-778)."""
        if self.streamed and not self.named and finish_reason == "stop":
            return "tool_calls"
        return finish_reason

    def whole(self, finish_reason: str) -> tuple[str, list[dict[str, Any]], str]:
        """A whole answer's (content, tool_calls, finish_reason) for the text generated."""
        calls: list[dict[str, Any]] = []
        text = self.text
        if self.named:
            if text.strip():
                calls.append(self._call(self.name, text))
            return "", calls, finish_reason
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        if isinstance(parsed, list) and all(
            isinstance(item, dict) and isinstance(item.get("name"), str) for item in parsed
        ):
            calls = [
                self._call(item["name"], json.dumps(item.get("parameters"), ensure_ascii=False))
                for item in parsed
            ]
        return "", calls, "tool_calls" if finish_reason == "stop" else finish_reason

    @staticmethod
    def _call(name: str, arguments: str) -> dict[str, Any]:
        return {
            "id": tool_call_id(),
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
