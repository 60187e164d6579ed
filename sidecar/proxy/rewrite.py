"""Request and event rewriting: only what the proxy itself added is ever taken out again.

When the client did not ask for usage, the proxy asks the upstream for it (``include_usage`` and
``continuous_usage_stats``) so that token counts are exact, then removes from each event exactly
the bytes those options added: the per-chunk ``"usage"`` member, and the final usage-only chunk.
Everything else in an event is forwarded byte for byte: events are edited as text, never
re-encoded, so float formatting, key order and non-ASCII text reach the client as the upstream
wrote them. Only an event whose shape we cannot edit safely is re-encoded (and counted).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from sidecar.protocol.openai import stream_usage_options

_USAGE_MEMBER = re.compile(r',\s*"usage"\s*:\s*')
_DECODER = json.JSONDecoder()
_DATA_PREFIX = b"data: "
_EVENT_END = b"\n\n"


@dataclass(frozen=True, slots=True)
class UsagePlan:
    """What the client asked for, and what the proxy adds on top of it."""

    client_include_usage: bool
    client_continuous: bool
    add_include_usage: bool
    add_continuous: bool

    @property
    def modifies(self) -> bool:
        return self.add_include_usage or self.add_continuous

    @property
    def strip_chunk_usage(self) -> bool:
        """Remove `usage` from content chunks (the client did not ask for per-chunk usage)."""
        return self.add_continuous

    @property
    def drop_usage_chunk(self) -> bool:
        """Drop the usage-only chunk (the client did not ask for usage at all)."""
        return self.add_include_usage


NO_CHANGE = UsagePlan(False, False, False, False)


def plan_usage(body: dict[str, Any], inject: bool) -> UsagePlan:
    """Decide which usage options to add to a streaming request ``body``.

    ``continuous_usage_stats`` means nothing without ``include_usage`` (vLLM ignores it), so a
    client that sent only the former is treated as having asked for neither.
    """
    _stream, include, continuous = stream_usage_options(body)
    if not inject:
        return UsagePlan(include, continuous, False, False)
    return UsagePlan(include, continuous, not include, not continuous)


def apply_usage_plan(body: dict[str, Any], plan: UsagePlan) -> dict[str, Any]:
    """A copy of ``body`` with the plan's options added (the client's dict is not touched)."""
    if not plan.modifies:
        return body
    new_body = dict(body)
    options = body.get("stream_options")
    new_options = dict(options) if isinstance(options, dict) else {}
    new_options["include_usage"] = True
    new_options["continuous_usage_stats"] = True
    new_body["stream_options"] = new_options
    return new_body


def strip_usage_member(payload: str) -> tuple[str, int] | None:
    """Remove the top-level ``"usage": {...}`` member from a JSON object's text.

    Returns (new text, index where the member was) or None if the text has no such member in
    a shape this function can edit safely. Looks from the end: vLLM places usage after
    ``choices``, so a match there cannot be inside generated text (where quotes are escaped
    anyway).
    """
    match = None
    for found in _USAGE_MEMBER.finditer(payload):
        match = found
    if match is None:
        return None
    try:
        _value, end = _DECODER.raw_decode(payload, match.end())
    except json.JSONDecodeError:
        return None
    rest = payload[end:].lstrip()
    if not rest or rest[0] not in ",}":
        return None
    return payload[: match.start()] + payload[end:], match.start()


def event_payload(raw: bytes) -> str | None:
    """The data of a one-line ``data: ...\\n\\n`` event (vLLM's only shape), else None."""
    if raw.startswith(_DATA_PREFIX) and raw.endswith(_EVENT_END):
        body = raw[len(_DATA_PREFIX) : -len(_EVENT_END)]
        if b"\n" not in body and b"\r" not in body:
            return body.decode("utf-8", errors="surrogateescape")
    return None


def encode_event(payload: str) -> bytes:
    return _DATA_PREFIX + payload.encode("utf-8", errors="surrogateescape") + _EVENT_END


def without_usage(raw: bytes, data: str) -> tuple[bytes, int | None, bool]:
    """The event minus its ``usage`` member: (bytes, cut position in the payload, re-encoded).

    ``data`` is the event's parsed data field (used when the raw bytes cannot be edited).
    """
    payload = event_payload(raw)
    if payload is not None:
        stripped = strip_usage_member(payload)
        if stripped is not None:
            return encode_event(stripped[0]), stripped[1], False
    try:
        obj = json.loads(data)
    except json.JSONDecodeError:
        return raw, None, False
    if not isinstance(obj, dict) or "usage" not in obj:
        return raw, None, False
    del obj["usage"]
    return encode_event(json.dumps(obj, ensure_ascii=False, separators=(",", ":"))), None, True


def insert_member(raw: bytes, position: int | None, key: str, value: Any) -> bytes:
    """Insert ``"key":value`` into a one-line event's JSON object at ``position`` (where a member
    was cut), or before ``,"kv_transfer_params"``, or before the closing brace."""
    payload = event_payload(raw)
    if payload is None:
        return raw
    member = f',"{key}":{json.dumps(value, ensure_ascii=False, separators=(",", ":"))}'
    if position is None:
        kv = payload.rfind(',"kv_transfer_params"')
        position = kv if kv >= 0 else payload.rstrip().rfind("}")
        if position < 0:
            return raw
    return encode_event(payload[:position] + member + payload[position:])
