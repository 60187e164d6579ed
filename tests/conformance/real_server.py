"""What the conformance tests share about the real server: `RealVLLM` (what the session
fixture ``real_vllm`` yields), how it is identified, and small raw-HTTP helpers (the suite
compares bytes, so it speaks HTTP itself rather than through an SDK)."""

from __future__ import annotations

import http.client
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from sidecar.realvllm import SERVED_MODEL, RealVLLMError, ServerHandle
from sidecar.realvllm.server import http_get


@dataclass(frozen=True)
class RealVLLM:
    """The real server the suite talks to."""

    base_url: str
    model: str
    version: str
    # The server this session started (--real-vllm=start), None for one given by URL.
    handle: ServerHandle | None = None
    # The port on 127.0.0.1 the server exports its spans to (OTLP/HTTP), when it does.
    otlp_port: int | None = None


def describe_server(base_url: str) -> RealVLLM:
    """Version and model of the server at ``base_url``; RealVLLMError when it does not answer
    or does not serve the tiny model."""
    try:
        status, body = http_get(base_url + "/version", timeout=10)
        version = json.loads(body).get("version") if status == 200 else None
        status, body = http_get(base_url + "/v1/models", timeout=10)
        served = [card.get("id") for card in json.loads(body).get("data", [])]
    except (OSError, ValueError, AttributeError) as exc:
        raise RealVLLMError(f"no vLLM answering at {base_url}: {exc}") from exc
    if not isinstance(version, str):
        raise RealVLLMError(f"{base_url}/version did not answer a version")
    if SERVED_MODEL not in served:
        raise RealVLLMError(
            f"{base_url} serves {served}, not {SERVED_MODEL!r}: start it with `sidecar vllm up`"
        )
    return RealVLLM(base_url=base_url, model=SERVED_MODEL, version=version)


def post_json(
    base_url: str, path: str, body: dict[str, Any], timeout: float = 60
) -> tuple[int, bytes]:
    """POST ``body`` as JSON; the status and the whole response body (streamed or not)."""
    parts = urlsplit(base_url)
    connection = http.client.HTTPConnection(
        parts.hostname or "127.0.0.1", parts.port, timeout=timeout
    )
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def sse_data(raw: bytes) -> list[str]:
    """The data of each event of an SSE body, in order."""
    events: list[str] = []
    for block in raw.decode().replace("\r\n", "\n").split("\n\n"):
        lines = [
            line[len("data:") :].lstrip(" ")
            for line in block.split("\n")
            if line.startswith("data:")
        ]
        if lines:
            events.append("\n".join(lines))
    return events
