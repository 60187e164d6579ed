"""What tests send and read on the wire: one JSON POST, the events of an SSE body, and the
tool-call request members that the simulator's tests and the conformance suite both send."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

# One tool, and tool_choice naming it. A schema whose every value is bounded (an enum, a
# boolean): structured outputs leave vLLM's random tiny model nothing unbounded to fill
# max_tokens with, so its calls complete (with a free string it writes characters until
# max_tokens); the simulator's answers are checked against that model's (test_sim_tools.py).
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": ["Paris", "Oslo"]},
                    "celsius": {"type": "boolean"},
                },
                "required": ["city", "celsius"],
            },
        },
    }
]
NAMED: dict[str, Any] = {"type": "function", "function": {"name": "weather"}}


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
