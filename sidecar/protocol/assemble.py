"""Assemble a non-streaming answer from a stream (the proxy's opt-in `assemble_nonstream` mode).

A non-streaming client sees only E2E. With this mode on, the proxy asks the upstream for a
stream anyway, so the server side gets TTFT and ITL, and hands the client the JSON body vLLM
would have returned for ``stream: false`` (spec/vllm-protocol.md, "Non-streaming responses"):
the same keys in the same order, nulls included. What cannot be rebuilt from chunks exactly
(``prompt_logprobs``, ``prompt_token_ids``) is left null and is documented in the README; the
record says the answer was assembled. Tool calls are rebuilt from their streamed deltas as vLLM
0.32's whole answer has them (vllm/parser/abstract_parser.py, the chat serving's full
generator): the call's id, type and name from its first delta, the arguments as streamed for a
named tool choice, re-serialised by ``json.dumps`` for ``tool_choice: "required"``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class _Choice:
    index: int
    role: str | None = None
    text_parts: list[str] = field(default_factory=list)
    reasoning_parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Any = None
    logprobs: dict[str, list[Any]] | None = None
    token_ids: list[int] | None = None
    # vLLM >= 0.33 puts `weight_versions` on its choices, streamed and whole; 0.32 nowhere.
    # The assembled body has the key when the stream had it: the upstream's own version.
    has_weight_versions: bool = False
    weight_versions: Any = None
    # Tool calls by their index: [id, type, name, argument pieces].
    tool_calls: dict[int, list[Any]] = field(default_factory=dict)


class StreamAssembler:
    """Fed every parsed chunk object of a stream, builds the non-streaming response body."""

    def __init__(self, endpoint: str, *, tool_choice_required: bool = False) -> None:
        self.endpoint = endpoint
        # vLLM parses a "required" call's JSON and writes its arguments back with json.dumps
        # in the whole answer; a stream carries them as generated.
        self.tool_choice_required = tool_choice_required
        self.id: str | None = None
        self.created: int | None = None
        self.model: str | None = None
        self.system_fingerprint: str | None = None
        self.usage: dict[str, Any] | None = None
        self.metrics: Any = None
        self.kv_transfer_params: Any = None
        self._choices: dict[int, _Choice] = {}

    def feed(self, chunk: dict[str, Any]) -> None:
        self.id = self.id or _str(chunk.get("id"))
        if self.created is None and isinstance(chunk.get("created"), int):
            self.created = chunk["created"]
        self.model = self.model or _str(chunk.get("model"))
        if isinstance(chunk.get("system_fingerprint"), str):
            self.system_fingerprint = chunk["system_fingerprint"]
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        if chunk.get("metrics") is not None:
            self.metrics = chunk["metrics"]
        if chunk.get("kv_transfer_params") is not None:
            self.kv_transfer_params = chunk["kv_transfer_params"]
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return
        for raw in choices:
            if not isinstance(raw, dict):
                continue
            index = raw.get("index", 0)
            if not isinstance(index, int):
                continue
            choice = self._choices.setdefault(index, _Choice(index))
            self._feed_choice(choice, raw)

    def _feed_choice(self, choice: _Choice, raw: dict[str, Any]) -> None:
        if self.endpoint == "chat":
            delta = raw.get("delta")
            if isinstance(delta, dict):
                if isinstance(delta.get("role"), str):
                    choice.role = delta["role"]
                if isinstance(delta.get("content"), str):
                    choice.text_parts.append(delta["content"])
                reasoning = delta.get("reasoning", delta.get("reasoning_content"))
                if isinstance(reasoning, str):
                    choice.reasoning_parts.append(reasoning)
                calls = delta.get("tool_calls")
                if isinstance(calls, list):
                    _feed_tool_calls(choice, calls)
        elif isinstance(raw.get("text"), str):
            choice.text_parts.append(raw["text"])
        if raw.get("finish_reason") is not None:
            choice.finish_reason = raw["finish_reason"]
            choice.stop_reason = raw.get("stop_reason")
        logprobs = raw.get("logprobs")
        if isinstance(logprobs, dict):
            merged = choice.logprobs if choice.logprobs is not None else {}
            for key, value in logprobs.items():
                if isinstance(value, list):
                    merged.setdefault(key, []).extend(value)
            choice.logprobs = merged
        token_ids = raw.get("token_ids")
        if isinstance(token_ids, list):
            choice.token_ids = (choice.token_ids or []) + token_ids
        if "weight_versions" in raw:
            choice.has_weight_versions = True
            if raw["weight_versions"] is not None:
                choice.weight_versions = raw["weight_versions"]

    def body(self) -> bytes:
        """The assembled response, serialised like vLLM's JSONResponse (compact, UTF-8)."""
        choices = [self._choices[i] for i in sorted(self._choices)]
        if self.endpoint == "chat":
            payload: dict[str, Any] = {
                "id": self.id,
                "object": "chat.completion",
                "created": self.created,
                "model": self.model,
                "choices": [self._chat_choice(c) for c in choices],
                "service_tier": None,
                "system_fingerprint": self.system_fingerprint,
                "usage": self._usage(),
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "prompt_text": None,
                "kv_transfer_params": self.kv_transfer_params,
                "ec_transfer_params": None,
                "metrics": self._metrics(),
            }
        else:
            payload = {
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [self._completion_choice(c) for c in choices],
                "service_tier": None,
                "system_fingerprint": self.system_fingerprint,
                "usage": self._usage(),
                "kv_transfer_params": self.kv_transfer_params,
                "ec_transfer_params": None,
                "metrics": self._metrics(),
            }
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")

    def _metrics(self) -> Any:
        """vLLM's per-request metrics as its whole answer has them. The stream's usage chunk
        leaves out what is None (vLLM 0.32 dumps it with exclude_none); the whole answer has
        every field, null when unknown, and 0.32 also ``speculative_decoding``, which 0.33
        dropped. A stream whose choices carry ``weight_versions`` is 0.33's."""
        metrics = self.metrics
        if not isinstance(metrics, dict):
            return metrics
        whole = {key: metrics.get(key) for key in _TIMING_FIELDS}
        if not any(choice.has_weight_versions for choice in self._choices.values()):
            whole["speculative_decoding"] = metrics.get("speculative_decoding")
        whole.update((key, value) for key, value in metrics.items() if key not in whole)
        return whole

    def _usage(self) -> dict[str, Any] | None:
        if self.usage is None:
            return None
        usage = self.usage
        return {
            "prompt_tokens": usage.get("prompt_tokens"),
            "total_tokens": usage.get("total_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "prompt_tokens_details": usage.get("prompt_tokens_details"),
            "completion_tokens_details": usage.get("completion_tokens_details"),
        }

    def _chat_choice(self, choice: _Choice) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": choice.role or "assistant",
            "content": "".join(choice.text_parts),
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
        }
        calls = [self._tool_call(*choice.tool_calls[index]) for index in sorted(choice.tool_calls)]
        if calls and all(call is not None for call in calls):
            # vLLM's ChatMessage leaves the key out when there is none.
            message["tool_calls"] = calls
        message["reasoning"] = "".join(choice.reasoning_parts) if choice.reasoning_parts else None
        return _versioned(
            choice,
            {
                "index": choice.index,
                "message": message,
                "logprobs": choice.logprobs,
                "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason,
                "token_ids": choice.token_ids,
                "routed_experts": None,
            },
        )

    def _tool_call(
        self, call_id: Any, call_type: Any, name: Any, pieces: list[str]
    ) -> dict[str, Any] | None:
        """One call of the whole answer; None for a "required" call whose arguments are not
        JSON (cut short by max_tokens): vLLM then parses no call at all from the answer."""
        arguments = "".join(pieces)
        if self.tool_choice_required:
            try:
                arguments = json.dumps(json.loads(arguments), ensure_ascii=False)
            except ValueError:
                return None
        return {
            "id": call_id,
            "type": call_type or "function",
            "function": {"name": name, "arguments": arguments},
        }

    @staticmethod
    def _completion_choice(choice: _Choice) -> dict[str, Any]:
        return _versioned(
            choice,
            {
                "index": choice.index,
                "text": "".join(choice.text_parts),
                "logprobs": choice.logprobs,
                "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason,
                "token_ids": choice.token_ids,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "routed_experts": None,
            },
        )


_TIMING_FIELDS = (
    "time_to_first_token_ms",
    "generation_time_ms",
    "queue_time_ms",
    "mean_itl_ms",
    "tokens_per_second",
)


def _feed_tool_calls(choice: _Choice, calls: list[Any]) -> None:
    """One delta's ``tool_calls``: the first delta of a call names it, later ones add pieces of
    its arguments (vLLM's DeltaToolCall)."""
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("index"), int):
            continue
        entry = choice.tool_calls.setdefault(call["index"], [None, None, None, []])
        if entry[0] is None and isinstance(call.get("id"), str):
            entry[0] = call["id"]
        if entry[1] is None and isinstance(call.get("type"), str):
            entry[1] = call["type"]
        function = call.get("function")
        if isinstance(function, dict):
            if entry[2] is None and isinstance(function.get("name"), str):
                entry[2] = function["name"]
            if isinstance(function.get("arguments"), str):
                entry[3].append(function["arguments"])


def _versioned(choice: _Choice, body: dict[str, Any]) -> dict[str, Any]:
    if choice.has_weight_versions:
        body["weight_versions"] = choice.weight_versions
    return body


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None
