"""Shared pieces of the reliability and security tests (faults, soak, churn, security).

- `settle`: the accounting invariant every test ends with: requests in == records out, nothing
  left in flight in the proxy, no request outstanding on any replica (proxy's view and the
  simulator's own), polled with a deadline (the record is emitted right after the last byte
  went out, so a client can see its answer a moment before the record exists).
- `ScriptedUpstream`: a vLLM-shaped upstream that misbehaves in ways the simulator has no fault
  for (a huge event, junk SSE fields, a body arriving in pieces, an oversized body).
- `proxy_to`: the proxy with its real sinks (as `sidecar proxy` wires them) in front of any
  upstream URLs, with a record collector.
- helpers to read what a client got: SSE data payloads, the vLLM error shape.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from proxy_stack import Collect, running_proxy

from sidecar.proxy.app import ProxyServer
from sidecar.record import RequestRecord
from sidecar.sim.server import RunningReplica
from sidecar.sinks.window import WindowSink

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
PATHS = {"chat": CHAT_PATH, "completions": COMPLETIONS_PATH}


async def until(
    predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition"
) -> None:
    """Poll ``predicate`` every 10 ms until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        await asyncio.sleep(0.01)


async def settle(
    server: ProxyServer,
    records: Collect,
    expected: int,
    sims: Sequence[RunningReplica] = (),
    timeout: float = 10.0,
) -> list[RequestRecord]:
    """The accounting invariant: ``expected`` requests in, exactly as many records out, and
    nothing left in flight anywhere. Returns the records."""
    proxy = server.proxy

    def state() -> tuple[Any, ...]:
        return (
            proxy.requests_total,
            proxy.records_total,
            len(records.records),
            proxy.in_flight,
            [r.outstanding for r in proxy.router.replicas],
            [s.replica.in_flight for s in sims],
        )

    def settled() -> bool:
        return state() == (
            expected,
            expected,
            expected,
            0,
            [0] * len(proxy.router.replicas),
            [0] * len(sims),
        )

    try:
        await until(settled, timeout, "settled accounting")
    except AssertionError:
        raise AssertionError(
            "accounting did not settle: (requests_total, records_total, collected, in_flight, "
            f"outstanding per replica, simulator in-flight) = {state()}, expected {expected}"
        ) from None
    # And it stays settled: no late duplicate record.
    await asyncio.sleep(0.02)
    assert settled(), state()
    ids = [r.request_id for r in records.records]
    assert len(set(ids)) == len(ids), "a request produced two records"
    return records.records


def sse_payloads(body: bytes) -> list[str]:
    """The data of each event of an SSE body (vLLM's one-line events)."""
    out = []
    for block in body.split(b"\n\n"):
        if block.startswith(b"data: "):
            out.append(block[len(b"data: ") :].decode("utf-8", "replace"))
    return out


def assert_vllm_error(obj: Any, status: int | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` with a non-empty message and type,
    and code == status when given. Returns the inner error object."""
    assert isinstance(obj, dict) and set(obj) == {"error"}, obj
    error: dict[str, Any] = obj["error"]
    assert list(error) == ["message", "type", "param", "code"], error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if status is not None:
        assert error["code"] == status, error
    return error


def assert_json_error(status: int, body: bytes, expected_status: int) -> dict[str, Any]:
    assert status == expected_status, (status, body[:300])
    return assert_vllm_error(json.loads(body), expected_status)


def assert_stream_error(
    status: int, body: bytes, expected_code: int | None = None
) -> dict[str, Any]:
    """A stream that failed after it began: 200, an error event in vLLM's shape, then [DONE]
    as the very last event."""
    assert status == 200, (status, body[:300])
    payloads = sse_payloads(body)
    assert payloads and payloads[-1] == "[DONE]", body[-300:]
    errors = [json.loads(p) for p in payloads if p.startswith('{"error"')]
    assert errors, body[-500:]
    return assert_vllm_error(errors[-1], expected_code)


# -- a scripted, vLLM-shaped upstream --------------------------------------------------------


def chunk_bytes(
    endpoint: str, text: str | None, finish: str | None = None, role: bool = False
) -> bytes:
    """One streamed event shaped like vLLM's (compact chat, spaced completions)."""
    if endpoint == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": text}
        obj = {
            "id": "chatcmpl-s",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
    obj = {
        "id": "cmpl-s",
        "object": "text_completion",
        "created": 0,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": text or "",
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
        ],
    }
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def whole_body(endpoint: str, text: str, n_out: int) -> bytes:
    usage = {"prompt_tokens": 3, "total_tokens": 3 + n_out, "completion_tokens": n_out}
    if endpoint == "chat":
        obj: dict[str, Any] = {
            "id": "chatcmpl-s",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": usage,
        }
    else:
        obj = {
            "id": "cmpl-s",
            "object": "text_completion",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}],
            "usage": usage,
        }
    return json.dumps(obj).encode()


RawAnswer = Callable[[int, int, bytes, asyncio.StreamWriter], Awaitable[bool]]


class RawUpstream:
    """Reads whole requests (Content-Length bodies) and lets ``answer(connection number,
    request number on it, head, writer)`` reply; False closes the connection."""

    def __init__(self, answer: RawAnswer) -> None:
        self.answer = answer
        self.connections = 0
        self.requests = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *_: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        on_connection = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                self.requests += 1
                on_connection += 1
                if not await self.answer(number, on_connection, head, writer):
                    break
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the peer left, or the server is closing (a handler still waiting)
        finally:
            writer.close()


@dataclass
class ScriptedUpstream:
    """A replica that answers like vLLM unless the request's ``X-Script`` header names a
    misbehaviour. ``huge_bytes`` sizes the huge event / body; ``tokens`` the normal answer."""

    huge_bytes: int = 64 * 1024
    tokens: int = 5
    seen: list[str] = field(default_factory=list)  # X-Script of each generation request
    _runner: web.AppRunner | None = None
    url: str = ""

    async def start(self) -> ScriptedUpstream:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post(CHAT_PATH, self._generate)
        app.router.add_post(COMPLETIONS_PATH, self._generate)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server: Any = site._server
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        endpoint = "chat" if request.path == CHAT_PATH else "completions"
        script = request.headers.get("X-Script", "ok")
        self.seen.append(script)
        if body.get("stream") is True:
            return await self._stream(request, endpoint, script)
        return await self._whole(request, endpoint, script)

    async def _whole(self, request: web.Request, endpoint: str, script: str) -> web.StreamResponse:
        text = " tok" * self.tokens
        if script == "huge_event":
            text = "x" * self.huge_bytes
        data = whole_body(endpoint, text, self.tokens)
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.content_length = len(data)
        await response.prepare(request)
        if script == "split_body":
            # The body in three writes, apart in time: a reader that takes one read for the
            # whole body gets a third of it.
            third = len(data) // 3
            for piece in (data[:third], data[third : 2 * third], data[2 * third :]):
                await response.write(piece)
                await asyncio.sleep(0.03)
        else:
            await response.write(data)
        await response.write_eof()
        return response

    async def _stream(self, request: web.Request, endpoint: str, script: str) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        head = chunk_bytes(endpoint, None, role=True) if endpoint == "chat" else b""
        tokens = [chunk_bytes(endpoint, f" t{i}") for i in range(self.tokens)]
        tail = chunk_bytes(endpoint, "", finish="length") + b"data: [DONE]\n\n"
        if script == "huge_event":
            # Two token events and a huge one, in one write: the tokens must still reach the
            # client before the error event.
            huge = chunk_bytes(endpoint, "x" * self.huge_bytes)
            await response.write(head + tokens[0] + tokens[1] + huge)
            await asyncio.sleep(0.01)
            await response.write(b"".join(tokens[2:]) + tail)
        elif script == "junk_sse":
            junk = (
                b"garbage line without a colon\n\n"
                b"event: weird\nid: 7\nretry: soon\n\n"
                b"data: \xff\xfe\xfd not utf-8\n\n"
                b'data: {"choices": [\n\n'
                b"data: [1, 2, 3]\n\n"
                b": a comment\r\n\r\n"
            )
            await response.write(head + tokens[0] + junk + b"".join(tokens[1:]) + tail)
        elif script == "split_events":
            # Every event cut in two, written apart in time.
            for event in [head, *tokens, tail]:
                if event:
                    half = len(event) // 2
                    await response.write(event[:half])
                    await asyncio.sleep(0.005)
                    await response.write(event[half:])
        else:
            for event in [head, *tokens]:
                if event:
                    await response.write(event)
                    await asyncio.sleep(0.002)
            await response.write(tail)
        await response.write_eof()
        return response


@dataclass
class Proxied:
    server: ProxyServer
    window: WindowSink
    records: Collect

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def admin(self) -> str:
        return self.server.admin_url


@asynccontextmanager
async def proxy_to(upstreams: Sequence[str], **settings: Any) -> AsyncIterator[Proxied]:
    """`sidecar proxy`'s wiring (build_proxy_server) on ephemeral ports, plus a collector."""
    async with running_proxy(list(upstreams), settings) as (server, window, records):
        yield Proxied(server, window, records)
