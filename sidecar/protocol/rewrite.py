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
from typing import Any, Final

from sidecar.protocol.openai import stream_usage_options

_DATA_PREFIX: Final = b"data: "
_EVENT_END: Final = b"\n\n"


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


NO_CHANGE: Final = UsagePlan(False, False, False, False)


def plan_usage(body: dict[str, Any], inject: bool) -> UsagePlan:
    """Decide which usage options to add to a streaming request ``body``.

    ``continuous_usage_stats`` means nothing without ``include_usage`` (vLLM ignores it), so a
    client that sent only the former is treated as having asked for neither.
    """
    _stream, include, continuous = stream_usage_options(body)
    return usage_plan(include, continuous, inject)


def usage_plan(include: bool, continuous: bool, inject: bool) -> UsagePlan:
    """The plan for a stream whose client asked for usage (``include``) and for it on every
    chunk (``continuous``), as `stream_usage_options` reads them: with ``inject``, the proxy
    adds what the client did not ask for."""
    return _PLANS[include, continuous, inject]


# Every plan there is, made once: a plan is immutable, and constructing a frozen dataclass
# cost ~6k instructions of every stream's request (benchmarks/RESULTS.md, "Session 27").
_PLANS: Final = {
    (include, continuous, inject): UsagePlan(
        include, continuous, inject and not include, inject and not continuous
    )
    for include in (False, True)
    for continuous in (False, True)
    for inject in (False, True)
}


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


_USAGE_OPTIONS_MEMBER: Final = (
    b'"stream_options":{"include_usage":true,"continuous_usage_stats":true}'
)
_JSON_SPACE_BYTES: Final = b" \t\r\n"


def request_with_usage(raw: bytes, body: dict[str, Any], plan: UsagePlan) -> bytes:
    """The upstream request body for ``plan``: the client's bytes unchanged when the plan adds
    nothing; with the options appended as one member when the client sent no
    ``stream_options`` (its bytes otherwise untouched: no re-encoding of a long prompt, no change
    to its escapes or number spellings); re-encoded from ``raw`` decoded whole only when an
    existing ``stream_options`` has to be edited. ``body`` is ``raw`` decoded, whole or only its
    top-level members that the plan reads (proxy.requesthead.read_head)."""
    if not plan.modifies:
        return raw
    if "stream_options" not in body and body:
        start = len(raw) - len(raw.lstrip(_JSON_SPACE_BYTES))
        end = len(raw.rstrip(_JSON_SPACE_BYTES))
        # An object in an ASCII-compatible encoding (UTF-8): '{' first, '}' last. Anything
        # else json.loads accepted (UTF-16/32, a byte-order mark) takes the re-encoding path.
        if raw[start : start + 1] == b"{" and raw[end - 1 : end] == b"}":
            return raw[: end - 1] + b"," + _USAGE_OPTIONS_MEMBER + raw[end - 1 :]
    try:
        whole = json.loads(raw)
    except ValueError:
        # Invalid UTF-8 in a string read_head skipped: not JSON to vLLM either (it decodes
        # bodies with the same json.loads), which refuses it as the client sent it.
        return raw
    return json.dumps(
        apply_usage_plan(whole, plan), ensure_ascii=False, separators=(",", ":")
    ).encode("utf-8")


# A usage object holds keys, numbers, null and at most one level of nested objects
# (prompt_tokens_details, completion_tokens_details). Strings (its keys) are matched whole and
# may hold neither a brace nor a backslash, so a brace inside a string is never taken for the
# object's end (anything else is left to the re-encoding fallback). Unrolled (no alternation
# inside the repeats): as fast as matching braces alone, ~0.6-0.8 µs on a vLLM usage object.
_NO_BRACE: Final = rb'[^{}"\\]*(?:"[^"\\{}]*"[^{}"\\]*)*'
_USAGE_VALUE: Final = re.compile(
    rb"\s*:\s*(\{" + _NO_BRACE + rb"(?:\{" + _NO_BRACE + rb"\}" + _NO_BRACE + rb")*\}|null)"
)
_USAGE_KEY: Final = b'"usage"'


def strip_usage_member(raw: bytes) -> tuple[bytes, int] | None:
    """Remove the top-level ``,"usage": {...}`` member from one event's bytes.

    Returns (new bytes, index where the member was) or None when the bytes have no such member
    in a shape this function can edit safely (the caller then re-encodes). Looks from the end:
    vLLM places usage after ``choices``, and inside generated text a quote is always escaped,
    so an unescaped ``"usage"`` key there cannot come from the text. The member must close at
    the top level: after it, exactly one more ``}`` than ``{`` (the object's own closing
    brace), so that a ``"usage"`` key nested in a later member is never taken for it.
    """
    key = raw.rfind(_USAGE_KEY)
    if key <= 0:
        return None
    start = key - 1
    while start > 0 and raw[start] in b" \t":
        start -= 1
    if raw[start] != 0x2C:  # the comma before the member
        return None
    match = _USAGE_VALUE.match(raw, key + len(_USAGE_KEY))
    if match is None:
        return None
    end = match.end()
    follower = raw[end : end + 1]
    if follower not in (b",", b"}", b" "):
        return None
    if not _closes_top_level(raw, end):
        return None
    return raw[:start] + raw[end:], start


def _closes_top_level(raw: bytes, end: int) -> bool:
    """True when nothing after ``end`` closes an object before the top-level one ends, i.e. the
    member just matched belongs to the top-level object. Fast path: vLLM's tail
    (``,"kv_transfer_params":null}``) has exactly one brace, the last, and no bracket."""
    stop = len(raw) - len(_EVENT_END)
    if (
        raw.count(b"}", end, stop) == 1
        and raw.find(b"{", end, stop) < 0
        and raw.find(b"]", end, stop) < 0
    ):
        return True
    # Anything else: walk the tail, ignoring braces and brackets inside strings.
    depth = 0
    in_string = escaped = False
    for i in range(end, stop):
        c = raw[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == 0x5C:  # backslash
                escaped = True
            elif c == 0x22:  # quote
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c in (0x7B, 0x5B):  # { [
            depth += 1
        elif c in (0x7D, 0x5D):  # } ]
            if depth == 0:
                return i == stop - 1 and c == 0x7D
            depth -= 1
    return False


def event_payload(raw: bytes) -> str | None:
    """The data of a one-line ``data: ...\\n\\n`` event (vLLM's only shape), else None."""
    if raw.startswith(_DATA_PREFIX) and raw.endswith(_EVENT_END):
        body = raw[len(_DATA_PREFIX) : -len(_EVENT_END)]
        if b"\n" not in body and b"\r" not in body:
            return body.decode("utf-8", errors="surrogateescape")
    return None


def _editable(raw: bytes) -> bool:
    # One `data:` line and nothing else: the first line break is the one ending the line.
    return (
        raw.startswith(_DATA_PREFIX)
        and raw.endswith(_EVENT_END)
        and raw.find(b"\n") == len(raw) - 2
        and b"\r" not in raw
    )


def encode_event(payload: str) -> bytes:
    return _DATA_PREFIX + payload.encode("utf-8", errors="surrogateescape") + _EVENT_END


def _encode_object(obj: Any) -> bytes:
    try:
        return encode_event(json.dumps(obj, ensure_ascii=False, separators=(",", ":")))
    except UnicodeEncodeError:
        # A lone surrogate (an escaped \ud83d without its pair) has no UTF-8 form: keep it
        # escaped, as the upstream sent it.
        return encode_event(json.dumps(obj, separators=(",", ":")))


def without_usage(raw: bytes, data: str) -> tuple[bytes, int | None, bool]:
    """The event minus its ``usage`` member: (bytes, cut position in them, re-encoded).

    ``data`` is the event's parsed data field, used only when the bytes cannot be edited.
    """
    if _editable(raw):
        stripped = strip_usage_member(raw)
        if stripped is not None:
            return stripped[0], stripped[1], False
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return raw, None, False
    if not isinstance(obj, dict) or "usage" not in obj:
        return raw, None, False
    del obj["usage"]
    return _encode_object(obj), None, True


# json.dumps with any argument builds a JSONEncoder per call; this one is built once (a held
# finish chunk gets its fingerprint back through it on every stream whose usage was injected).
_encode_compact = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_encode_compact_ascii = json.JSONEncoder(separators=(",", ":")).encode


def insert_member(raw: bytes, position: int | None, key: str, value: Any) -> bytes:
    """Insert ``"key":value`` into a one-line event's JSON object at byte ``position`` (where a
    member was cut), or before ``,"kv_transfer_params"``, or before the closing brace."""
    if not _editable(raw):
        return raw
    try:
        member = (f',"{key}":' + _encode_compact(value)).encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate (the upstream escaped \ud800 without its pair) has no UTF-8 form:
        # it goes back escaped, as the upstream sent it.
        member = (f',"{key}":' + _encode_compact_ascii(value)).encode("ascii")
    if position is None:
        kv = raw.rfind(b',"kv_transfer_params"')
        position = kv if kv >= 0 else raw.rfind(b"}")
        if position < 0:
            return raw
    return raw[:position] + member + raw[position:]
