"""A JSON request body decoded exactly as Python's ``json`` decodes it, at msgspec's speed.

``json.loads`` of a 580 KB chat body takes ~1 ms on this host, on the event loop of whoever
reads it (the simulator before it stamps the next request's arrival, the proxy when it needs a
prompt). msgspec decodes the same body into the same Python objects in ~0.17 ms. Where the two
differ, msgspec refuses and ``json`` decides: NaN and infinities, numbers out of float range
(json: inf), lone surrogates (escaped or UTF-8-encoded), a byte-order mark, UTF-16/32, control
characters; so a body means the same with either, and a body ``json`` refuses raises ``json``'s
own error (its message and position are what vLLM's 400 quotes).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

_DECODER = msgspec.json.Decoder()


def loads(raw: bytes) -> Any:
    """``json.loads(raw)``: the same value, or the same exception."""
    try:
        return _DECODER.decode(raw)
    except (msgspec.DecodeError, RecursionError):  # msgspec's depth limit is not json's
        return json.loads(raw)
