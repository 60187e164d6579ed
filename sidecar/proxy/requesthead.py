"""The top-level members of a generation request that the proxy reads, without decoding the prompt.

The proxy needs a handful of members of a request body (model, stream, stream_options, the
token limits, user, tool_choice, use_beam_search) before it can route and rewrite it, but not
the prompt, which is nearly all of the bytes. ``json.loads`` builds every string of a 580 KB
chat body (894 µs on this host) on the proxy's event loop, and every stream waiting on that
loop has the wait written into its server-side stamps. msgspec decoding into a struct of those
members skips the rest without building it (138 µs for the same body; 0.9 µs instead of 3.0
for a 200-byte one: `benchmarks/hot_paths.py`).

What the proxy reads is kept exactly as before: whatever msgspec refuses and Python's ``json``
accepts (NaN and infinities, a byte-order mark, UTF-16, a top-level array, lone surrogate
escapes) is read by ``json.loads`` instead, and a duplicated member is the last one in both.
One difference remains by design: msgspec does not check the UTF-8 of strings it skips, so a
body with invalid UTF-8 inside its prompt is read as an object where ``json`` refused it. vLLM
refuses such a body (400) and the proxy then asks again with the client's own bytes, as it does
for any body the replica refused after a rewrite; the client reads vLLM's answer either way.
"""

from __future__ import annotations

from typing import Any

import msgspec

from sidecar.protocol import jsonbody

_UNSET = msgspec.UNSET


class _Head(msgspec.Struct):
    # Any: values are taken as JSON gives them; what each means is decided by the readers
    # (protocol.openai.stream_usage_options reads booleans as vLLM's pydantic does).
    model: Any = _UNSET
    stream: Any = _UNSET
    stream_options: Any = _UNSET
    max_tokens: Any = _UNSET
    max_completion_tokens: Any = _UNSET
    user: Any = _UNSET
    tool_choice: Any = _UNSET
    use_beam_search: Any = _UNSET


HEAD_MEMBERS: tuple[str, ...] = _Head.__struct_fields__
_DECODER = msgspec.json.Decoder(_Head)


def read_head(raw: bytes) -> Any:
    """The members of ``raw`` named in ``HEAD_MEMBERS`` that it has, as a dict, when ``raw`` is
    a JSON object; otherwise what ``json.loads`` makes of it (a list, a number, ...), or None
    when it is not JSON at all. A member absent from the body is absent from the dict (a
    ``null`` is kept as None), so ``"stream_options" in head`` says what it says of the body."""
    try:
        head = _DECODER.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return read_whole(raw)
    # msgspec leaves the members that are UNSET out of the dict (its values are JSON's already).
    return msgspec.to_builtins(head)


def read_whole(raw: bytes) -> Any:
    """``raw`` decoded whole by Python's ``json`` (None when it is not JSON): for the paths that
    need the prompt (capture, prefix routing, assembling, editing stream_options)."""
    try:
        return jsonbody.loads(raw)
    except (ValueError, RecursionError):
        return None
