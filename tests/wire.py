"""What tests send and read on the wire: one JSON POST, and the events of an SSE body."""

from __future__ import annotations

import json
from typing import Any

import aiohttp


async def post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    """POST ``body`` as JSON; the status and the whole answer's bytes."""
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        return response.status, await response.read()


def events(raw: bytes) -> list[Any]:
    """The ``data:`` events of an SSE body, each parsed ("[DONE]" kept as the string)."""
    out: list[Any] = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            payload = block[len(b"data: ") :]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out
