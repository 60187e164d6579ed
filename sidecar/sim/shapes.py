"""vLLM's response shapes, byte for byte (spec/vllm-protocol.md A1), for the simulator.

Two profiles, and within ``vllm`` the version (``--vllm-version``):

- ``vllm`` (default): vLLM 0.33.0, or 0.32 when the version says so (`Era`): 0.32 has no
  ``kv_transfer_params`` on streamed chunks and no ``weight_versions`` on choices, and its whole
  answers' per-request ``metrics`` also carry ``speculative_decoding`` (checked against vLLM
  0.32.0 itself, tests/conformance). Streamed chunks are pydantic ``model_dump_json`` output, so
  compact JSON with keys in model-field order and the spec's inclusion rules (explicit ``null``s
  for fields the server sets, omitted fields it leaves unset). Non-streaming bodies are
  Starlette ``JSONResponse`` renders of ``model_dump()``: compact, every field present.
- ``minimal``: an older vLLM (before ~0.10.2): no ``prompt_token_ids``, ``prompt_text``,
  ``kv_transfer_params``, ``system_fingerprint``, ``token_ids``, ``weight_versions`` or
  per-request ``metrics`` keys; the core shape is the same.

Streamed chunks are assembled from per-request prefixes and small string pieces rather than by
``json.dumps`` of a dict per chunk: the id, created and model parts are serialised once per
request, and only the token text is escaped per chunk (``json.dumps`` of one string). Tests
compare the result with the spec's literal examples.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring
from typing import Any

from sidecar.protocol import DONE_EVENT, KEEPALIVE_EVENT, error_body
from sidecar.sim.sampling import Position

__all__ = [
    "DONE_EVENT",
    "KEEPALIVE_EVENT",
    "ChoiceResult",
    "Profile",
    "RequestTimings",
    "StreamFormatter",
    "WholeAnswer",
    "chat_completion_body",
    "chat_logprobs",
    "completion_logprobs",
    "prompt_logprobs_json",
    "compact_json",
    "completion_body",
    "error_body",
    "models_body",
]


class Profile(str, enum.Enum):
    VLLM = "vllm"
    MINIMAL = "minimal"


@dataclass(frozen=True, slots=True)
class Era:
    """What changed between the vLLM versions the simulator speaks."""

    kv_on_chunks: bool  # streamed chunks end with "kv_transfer_params":null (0.33)
    weight_versions: bool  # choices carry "weight_versions":null (0.33)
    speculative_decoding: bool  # a whole answer's metrics has "speculative_decoding" (0.32)

    @classmethod
    def of(cls, version: str) -> Era:
        """0.33 and later, or 0.32 and earlier (down to the ``minimal`` profile's era)."""
        try:
            major, minor = (int(part) for part in version.split(".")[:2])
        except ValueError:
            raise ValueError(f"not a vLLM version: {version!r} (e.g. 0.32.0)") from None
        new = (major, minor) >= (0, 33)
        return cls(kv_on_chunks=new, weight_versions=new, speculative_decoding=not new)


ERA_033 = Era.of("0.33.0")


def compact_json(value: Any) -> str:
    """Serialise like Starlette's JSONResponse and pydantic's model_dump_json (compact, UTF-8)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


# The C string escaper json.dumps(..., ensure_ascii=False) itself uses: same output, a fraction
# of the cost of a json.dumps call per chunk.
_text: Callable[[str], str] = encode_basestring


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """vLLM's per-request timing metrics (``build_per_request_timing_metrics``), in ms.

    TTFT here is first token - first scheduled: queue time is excluded (unlike Prometheus TTFT).
    """

    time_to_first_token_ms: float | None
    generation_time_ms: float | None
    queue_time_ms: float | None
    mean_itl_ms: float | None
    tokens_per_second: float | None

    @classmethod
    def from_instants(
        cls,
        *,
        arrival_s: float,
        scheduled_s: float | None,
        first_token_s: float | None,
        last_token_s: float | None,
        num_generation_tokens: int,
    ) -> RequestTimings:
        ttft = generation = queue = mean_itl = tokens_per_second = None
        if scheduled_s is not None and first_token_s is not None:
            ttft = (first_token_s - scheduled_s) * 1000
        if first_token_s is not None and last_token_s is not None:
            generation = (last_token_s - first_token_s) * 1000
            if num_generation_tokens > 1:
                mean_itl = generation / (num_generation_tokens - 1)
        if scheduled_s is not None:
            queue = (scheduled_s - arrival_s) * 1000
            if last_token_s is not None:
                inference_ms = (last_token_s - scheduled_s) * 1000
                if inference_ms > 0:
                    tokens_per_second = num_generation_tokens / inference_ms * 1000
        return cls(ttft, generation, queue, mean_itl, tokens_per_second)

    def as_dict(self, drop_none: bool) -> dict[str, float | None]:
        values: dict[str, float | None] = {
            "time_to_first_token_ms": self.time_to_first_token_ms,
            "generation_time_ms": self.generation_time_ms,
            "queue_time_ms": self.queue_time_ms,
            "mean_itl_ms": self.mean_itl_ms,
            "tokens_per_second": self.tokens_per_second,
        }
        if drop_none:
            return {key: value for key, value in values.items() if value is not None}
        return values


class StreamFormatter:
    """Builds the SSE events of one streamed request (chat or completions).

    ``usage`` arguments are ``(prompt_tokens, completion_tokens)`` when the chunk carries
    continuous usage stats, else None. Every method returns the complete event bytes.
    """

    __slots__ = (
        "chat",
        "minimal",
        "era",
        "fingerprint",
        "include_usage",
        "_head",
        "_usage_details",
        "_role_tail",
        "_token_tail",
        "_final_tail",
        "_choices_open",
    )

    def __init__(
        self,
        *,
        chat: bool,
        response_id: str,
        created: int,
        model: str,
        profile: Profile,
        fingerprint: str,
        include_usage: bool,
        era: Era = ERA_033,
    ) -> None:
        self.chat = chat
        self.minimal = profile is Profile.MINIMAL
        self.era = era
        self.fingerprint = fingerprint
        self.include_usage = include_usage
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._head = (
            f'data: {{"id":{_text(response_id)},"object":"{obj}","created":{created},'
            f'"model":{_text(model)},"choices":['
        )
        # Chat continuous usage carries an explicit completion_tokens_details null (vLLM 0.33).
        self._usage_details = (
            ',"completion_tokens_details":null' if chat and not self.minimal else ""
        )
        if self.minimal:
            self._role_tail = "}\n\n"
            self._token_tail = "}\n\n"
            self._final_tail = "}\n\n"
        else:
            self._role_tail = ',"prompt_token_ids":null,"prompt_text":null}\n\n'
            kv = ',"kv_transfer_params":null' if era.kv_on_chunks else ""
            self._token_tail = kv + "}\n\n"
            if include_usage:
                self._final_tail = kv + "}\n\n"
            else:
                self._final_tail = f',"system_fingerprint":{_text(fingerprint)}{kv}}}\n\n'

    @property
    def _weight_versions(self) -> str:
        return ',"weight_versions":null' if self.era.weight_versions else ""

    def _usage(self, usage: tuple[int, int] | None) -> str:
        if usage is None:
            return ""
        prompt, completion = usage
        return (
            f',"usage":{{"prompt_tokens":{prompt},"total_tokens":{prompt + completion},'
            f'"completion_tokens":{completion}{self._usage_details}}}'
        )

    def role_chunk(self, index: int, role: str, usage: tuple[int, int] | None = None) -> bytes:
        return (
            f'{self._head}{{"index":{index},"delta":{{"role":{_text(role)},"content":""}},'
            f'"logprobs":null,"finish_reason":null}}]{self._usage(usage)}{self._role_tail}'
        ).encode()

    def token_chunk(
        self,
        index: int,
        text: str,
        finish_reason: str | None = None,
        usage: tuple[int, int] | None = None,
        logprobs: dict[str, Any] | None = None,
        stop_reason: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        delta: str | None = None,
    ) -> bytes:
        """A token delta; ``logprobs`` as `chat_logprobs` / `completion_logprobs` make it,
        ``stop_reason`` the stop string that ended the choice, ``prompt_token_ids`` on a
        completion's echoed first chunk. ``delta`` (chat): the delta object's JSON in place of
        ``{"content": text}`` (a tool call's, sidecar.sim.tools)."""
        logprobs_json = "null" if logprobs is None else compact_json(logprobs)
        prompt_ids = "null" if prompt_token_ids is None else compact_json(list(prompt_token_ids))
        if self.chat:
            if delta is None:
                delta = f'{{"content":{_text(text)}}}'
            body = f'{{"index":{index},"delta":{delta},"logprobs":{logprobs_json},'
        else:
            body = f'{{"index":{index},"text":{_text(text)},"logprobs":{logprobs_json},'
        if finish_reason is None:
            if self.minimal:
                body += '"finish_reason":null' + ("}" if self.chat else ',"stop_reason":null}')
            elif self.chat:
                body += '"finish_reason":null,"token_ids":null}'
            else:
                body += (
                    f'"finish_reason":null,"stop_reason":null,"prompt_token_ids":{prompt_ids},'
                    '"token_ids":null' + self._weight_versions + "}"
                )
            tail = self._token_tail
        else:
            stop_json = "null" if stop_reason is None else _text(stop_reason)
            body += f'"finish_reason":"{finish_reason}","stop_reason":{stop_json}'
            if self.minimal:
                body += "}"
            elif self.chat:
                body += ',"token_ids":null' + self._weight_versions + "}"
            else:
                body += (
                    f',"prompt_token_ids":{prompt_ids},"token_ids":null'
                    + self._weight_versions
                    + "}"
                )
            tail = self._final_tail
        return f"{self._head}{body}]{self._usage(usage)}{tail}".encode()

    def usage_chunk(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int | None = None,
        timings: RequestTimings | None = None,
    ) -> bytes:
        """The final usage-only chunk (``choices:[]``; all nulls dropped)."""
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        }
        if cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        text = f'{self._head}],"usage":{compact_json(usage)}'
        if not self.minimal:
            text += f',"system_fingerprint":{_text(self.fingerprint)}'
            if timings is not None:
                text += f',"metrics":{compact_json(timings.as_dict(drop_none=True))}'
        return (text + "}\n\n").encode()

    def error_event(self, message: str, err_type: str, code: int) -> bytes:
        """A mid-stream error: chat uses compact JSON, completions ``json.dumps`` with spaces."""
        body = error_body(message, err_type, code)
        payload = compact_json(body) if self.chat else json.dumps(body)
        return f"data: {payload}\n\n".encode()

    def malformed_event(self, index: int) -> bytes:
        """A data event whose JSON is cut short (fault injection)."""
        return f'{self._head}{{"index":{index},"del\n\n'.encode()


@dataclass(frozen=True, slots=True)
class ChoiceResult:
    index: int
    text: str
    finish_reason: str
    stop_reason: str | None = None
    logprobs: dict[str, Any] | None = None  # chat_logprobs / completion_logprobs
    # Completions: the prompt's logprobs (prompt_logprobs_json), per choice.
    prompt_logprobs: list[Any] | None = None
    # Chat: the message's tool calls (sidecar.sim.tools); the key is left out when empty.
    tool_calls: list[dict[str, Any]] | None = None


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(positions: Sequence[Position], top_logprobs: int) -> dict[str, Any]:
    """A chat choice's ``logprobs`` (``_create_chat_logprobs``): per token its text, logprob
    and UTF-8 bytes, and the first ``top_logprobs`` entries of its position (the sampled token
    first) in the same form."""
    content: list[dict[str, Any]] = []
    for position in positions:
        sampled = position[0]
        token = sampled.token
        content.append(
            {
                "token": token,
                "logprob": sampled.logprob,
                "bytes": _token_bytes(token),
                "top_logprobs": [
                    {
                        "token": (alt := entry.token),
                        "logprob": entry.logprob,
                        "bytes": _token_bytes(alt),
                    }
                    for entry in position[:top_logprobs]
                ],
            }
        )
    return {"content": content}


def completion_logprobs(
    positions: Sequence[Position | None],
    tokens: Sequence[str],
    num_logprobs: int,
    initial_text_offset: int,
) -> dict[str, Any]:
    """A completion choice's ``logprobs`` (``_create_completion_logprobs``): the tokens'
    strings, their character offsets from ``initial_text_offset``, their logprobs and the first
    ``num_logprobs + 1`` entries of each position keyed by token string (None where a prompt's
    first token has no logprob). ``tokens[i]`` names the position's own token (a prompt token's
    own piece of text)."""
    offsets: list[int] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    last_len = 0
    for i, position in enumerate(positions):
        token = tokens[i]
        if position is None:
            token_logprobs.append(None)
            top.append(None)
        else:
            token_logprobs.append(position[0].logprob)
            entries: dict[str, float] = {token: position[0].logprob}
            for entry in position[1 : num_logprobs + 1]:
                entries[entry.token] = entry.logprob
            top.append(entries)
        offsets.append(initial_text_offset if not offsets else offsets[-1] + last_len)
        last_len = len(token)
    return {
        "text_offset": offsets,
        "token_logprobs": token_logprobs,
        "tokens": list(tokens),
        "top_logprobs": top,
    }


def prompt_logprobs_json(positions: Sequence[Position | None], tokens: Sequence[str]) -> list[Any]:
    """``prompt_logprobs``: per prompt token (None for the first) vLLM's dict of Logprob
    objects keyed by token id, the prompt's own token first with its rank."""
    out: list[Any] = []
    for i, position in enumerate(positions):
        if position is None:
            out.append(None)
            continue
        entries: dict[str, Any] = {}
        for j, entry in enumerate(position):
            entries[str(entry.token_id)] = {
                "logprob": entry.logprob,
                "rank": entry.rank,
                "decoded_token": tokens[i] if j == 0 else entry.token,
            }
        out.append(entries)
    return out


@dataclass(frozen=True, slots=True)
class WholeAnswer:
    """What a whole (non-streaming) answer reports besides its id, chat or text completion
    alike: `chat_completion_body` and `completion_body` render it in their kind's shape."""

    created: int
    model: str
    choices: Sequence[ChoiceResult]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    timings: RequestTimings | None
    fingerprint: str
    profile: Profile
    era: Era = ERA_033

    @property
    def minimal(self) -> bool:
        return self.profile is Profile.MINIMAL


def _usage_body(answer: WholeAnswer) -> dict[str, Any]:
    minimal = answer.minimal
    details: dict[str, Any] | None = None
    if answer.cached_tokens is not None:
        details = {"cached_tokens": answer.cached_tokens}
        if not minimal:
            details["created_cache_tokens"] = None
            details["multimodal_tokens"] = None
    usage: dict[str, Any] = {
        "prompt_tokens": answer.prompt_tokens,
        "total_tokens": answer.prompt_tokens + answer.completion_tokens,
        "completion_tokens": answer.completion_tokens,
        "prompt_tokens_details": details,
    }
    if not minimal:
        usage["completion_tokens_details"] = None
    return usage


def _choice_head(choice: ChoiceResult, key: str, content: Any) -> dict[str, Any]:
    """The fields every whole choice starts with, ``key`` (``message`` or ``text``) second."""
    return {
        "index": choice.index,
        key: content,
        "logprobs": choice.logprobs,
        "finish_reason": choice.finish_reason,
        "stop_reason": choice.stop_reason,
    }


def _end_choice(out: dict[str, Any], era: Era) -> dict[str, Any]:
    """The fields that end a whole choice in the ``vllm`` profile."""
    out["routed_experts"] = None
    if era.weight_versions:
        out["weight_versions"] = None
    return out


def _chat_choice(choice: ChoiceResult, role: str, minimal: bool, era: Era) -> dict[str, Any]:
    """One choice of a whole chat answer, in the profile's field order."""
    if minimal:
        message: dict[str, Any] = {
            "role": role,
            "content": choice.text,
            "tool_calls": choice.tool_calls or [],
        }
        return _choice_head(choice, "message", message)
    message = {
        "role": role,
        "content": choice.text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
    }
    if choice.tool_calls:
        message["tool_calls"] = choice.tool_calls
    message["reasoning"] = None
    out = _choice_head(choice, "message", message)
    out["token_ids"] = None
    return _end_choice(out, era)


def _completion_choice(choice: ChoiceResult, minimal: bool, era: Era) -> dict[str, Any]:
    """One choice of a whole text completion, in the profile's field order."""
    out = _choice_head(choice, "text", choice.text)
    if minimal:
        out["prompt_logprobs"] = choice.prompt_logprobs
        return out
    out["token_ids"] = None
    out["prompt_logprobs"] = choice.prompt_logprobs
    out["prompt_token_ids"] = None
    return _end_choice(out, era)


def _whole_metrics(timings: RequestTimings | None, era: Era) -> dict[str, Any] | None:
    """A whole answer's per-request metrics: every field (0.32: and speculative_decoding)."""
    if timings is None:
        return None
    metrics: dict[str, Any] = timings.as_dict(drop_none=False)
    if era.speculative_decoding:
        metrics["speculative_decoding"] = None
    return metrics


def _answer_body(
    answer: WholeAnswer,
    *,
    kind: str,
    response_id: str,
    choices: list[dict[str, Any]],
    after_usage: Mapping[str, Any],
) -> bytes:
    """The envelope both whole answers share; ``after_usage`` is the kind's own fields that
    follow ``usage`` (chat: the prompt's logprobs, ids and text)."""
    minimal = answer.minimal
    body: dict[str, Any] = {
        "id": response_id,
        "object": kind,
        "created": answer.created,
        "model": answer.model,
        "choices": choices,
    }
    if not minimal:
        body["service_tier"] = None
        body["system_fingerprint"] = answer.fingerprint
    body["usage"] = _usage_body(answer)
    body.update(after_usage)
    if not minimal:
        body["kv_transfer_params"] = None
        body["ec_transfer_params"] = None
        body["metrics"] = _whole_metrics(answer.timings, answer.era)
    return compact_json(body).encode()


def chat_completion_body(
    answer: WholeAnswer,
    *,
    response_id: str,
    role: str,
    prompt_logprobs: list[Any] | None = None,
) -> bytes:
    """A whole ``chat.completion`` answer."""
    minimal, era = answer.minimal, answer.era
    after_usage: dict[str, Any] = {"prompt_logprobs": prompt_logprobs}
    if not minimal:
        after_usage["prompt_token_ids"] = None
        after_usage["prompt_text"] = None
    return _answer_body(
        answer,
        kind="chat.completion",
        response_id=response_id,
        choices=[_chat_choice(choice, role, minimal, era) for choice in answer.choices],
        after_usage=after_usage,
    )


def completion_body(answer: WholeAnswer, *, response_id: str) -> bytes:
    """A whole ``text_completion`` answer."""
    minimal, era = answer.minimal, answer.era
    return _answer_body(
        answer,
        kind="text_completion",
        response_id=response_id,
        choices=[_completion_choice(choice, minimal, era) for choice in answer.choices],
        after_usage={},
    )


def models_body(
    *,
    served_model_names: Sequence[str],
    root: str,
    max_model_len: int,
    created: int,
    permission_id: str,
) -> bytes:
    """``GET /v1/models`` (ModelList of ModelCards with one default ModelPermission each)."""
    data: list[Mapping[str, Any]] = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": root,
            "parent": None,
            "max_model_len": max_model_len,
            "permission": [
                {
                    "id": permission_id,
                    "object": "model_permission",
                    "created": created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        for name in served_model_names
    ]
    return compact_json({"object": "list", "data": data}).encode()
