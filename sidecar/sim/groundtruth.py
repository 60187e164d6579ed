"""The simulator's ground truth: what it really wrote to each socket, and when.

One JSON line per finished request (any outcome), so a measuring proxy in another process can
be checked against what the replica actually did. Instants are ``time.perf_counter_ns()``
(CLOCK_MONOTONIC on Linux, the same clock in every process of the host), plus one wall-clock
anchor per request (``wall_time_ns``, ``time.time_ns()`` read next to ``received_ns``).

Line format (``"v": 1``)::

    {"v": 1, "request_id": str, "replica": int, "endpoint": "/v1/chat/completions",
     "stream": bool, "status": int, "outcome": str, "finish_reasons": [str|null, ...],
     "n": int, "prompt_tokens": int, "completion_tokens": int, "cached_tokens": int,
     "fault": str|null, "wall_time_ns": int,
     "received_ns": int,          # the request's last bytes reached the replica
     "first_byte_ns": int,        # ... and its first bytes (its upload began); v1 lines
                                  # written before this field existed lack it
     "headers_ns": int|null,      # response headers handed to the socket
     "done_ns": int,              # the handler finished (last write, or the error/reset)
     "chunk_ns": [int, ...],      # right after each write to the socket
     "chunk_tokens": [int, ...],  # output tokens carried by that write
     "chunk_kinds": [str, ...]}   # role|token|usage|done|keepalive|error|malformed|body

``outcome``: ok, http_error (an error status, ``status`` says which), rejected (503 from the
admission limit), error_event (mid-stream error), reset (connection aborted by a fault),
truncated (body ended without ``[DONE]``), client_disconnect.

``received_ns`` is taken when the loop hands the request's last bytes to the replica, before
they are parsed and before any handler runs (`ArrivalStamp`), so it is the request's arrival,
not the end of its own or of another request's parsing. ``first_byte_ns`` is taken the same
way for the request's first bytes: from there to ``received_ns`` is the upload, which a
measuring proxy's server vantage (from its first byte sent upstream) includes.

Writing: stamps are appended to in-memory lists while the request runs; the finished line is
written with one ``write(2)`` on an ``O_APPEND`` descriptor at request end. That costs one small
write into the page cache per request (microseconds, it never waits for the disk), nothing per
chunk, and keeps lines in completion order without a thread or a queue to drain at shutdown.
Several processes (``sidecar sim --replicas N`` runs one per replica) append to one file: each
line is a single append, which Linux does not interleave with another's.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

from aiohttp import web

GROUND_TRUTH_VERSION = 1


class GroundTruthRecord:
    """Mutable per-request stamps; `as_dict` freezes them into one JSONL line."""

    __slots__ = (
        "request_id",
        "replica",
        "endpoint",
        "stream",
        "status",
        "outcome",
        "finish_reasons",
        "n",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "fault",
        "wall_time_ns",
        "received_ns",
        "first_byte_ns",
        "headers_ns",
        "done_ns",
        "chunk_ns",
        "chunk_tokens",
        "chunk_kinds",
    )

    def __init__(
        self,
        *,
        replica: int,
        endpoint: str,
        received_ns: int,
        wall_time_ns: int,
        first_byte_ns: int | None = None,
    ) -> None:
        self.request_id = ""
        self.replica = replica
        self.endpoint = endpoint
        self.stream = False
        self.status = 200
        self.outcome = "ok"
        self.finish_reasons: list[str | None] = []
        self.n = 1
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.fault: str | None = None
        self.wall_time_ns = wall_time_ns
        self.received_ns = received_ns
        self.first_byte_ns = received_ns if first_byte_ns is None else first_byte_ns
        self.headers_ns: int | None = None
        self.done_ns = 0
        self.chunk_ns: list[int] = []
        self.chunk_tokens: list[int] = []
        self.chunk_kinds: list[str] = []

    def stamp(self, tokens: int, kind: str) -> None:
        """One write to the socket, stamped right after it: the output tokens it carried and
        its kind. Every chunk stamp is taken here, so all share one clock and one order."""
        self.chunk_ns.append(time.perf_counter_ns())
        self.chunk_tokens.append(tokens)
        self.chunk_kinds.append(kind)

    def cut_short(self, closing: bool) -> None:
        """The answer ended early with no fault to blame: the replica shutting down (``closing``)
        or else the client gone. An outcome already set (a fault's) is kept."""
        if self.outcome == "ok":
            self.outcome = "shutdown" if closing else "client_disconnect"

    def as_dict(self) -> dict[str, Any]:
        return {"v": GROUND_TRUTH_VERSION, **{name: getattr(self, name) for name in self.__slots__}}


class GroundTruthWriter:
    """Appends finished records to a JSONL file; shared by all replicas of one process."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        self._users = 0

    def acquire(self) -> GroundTruthWriter:
        self._users += 1
        return self

    def release(self) -> None:
        self._users -= 1
        if self._users <= 0:
            self.close()

    def write(self, record: GroundTruthRecord) -> None:
        if self._fd is None:
            return
        line = (json.dumps(record.as_dict(), separators=(",", ":")) + "\n").encode()
        written = os.write(self._fd, line)
        while written < len(line):  # a regular file takes it whole; this is for the odd case
            written += os.write(self._fd, line[written:])

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class ArrivalStamp(asyncio.Protocol):
    """aiohttp's protocol for one connection, plus the instant its latest bytes arrived.

    ``last_data_ns`` is read when the loop hands the bytes over, before aiohttp parses them and
    before any handler runs, so when a request's body is complete it is the arrival instant of
    the body's last bytes, whatever the loop did next (HTTP/1.1 clients do not send the next
    request on a connection before the answer, so no later request's bytes move it).
    """

    __slots__ = ("_inner", "last_data_ns", "first_data_ns")

    def __init__(self, inner: asyncio.Protocol) -> None:
        self._inner = inner
        self.last_data_ns = 0
        self.first_data_ns = 0  # of the request being read; 0 once a handler took it

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter_ns()
        if not self.first_data_ns:
            self.first_data_ns = now
        self.last_data_ns = now
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


def arrival_ns(request: web.Request) -> int:
    """When the request's last bytes reached the replica (now, if that is not known)."""
    transport = request.transport
    protocol = transport.get_protocol() if transport is not None else None
    stamp = protocol.last_data_ns if isinstance(protocol, ArrivalStamp) else 0
    return stamp or time.perf_counter_ns()


def arrival_span_ns(request: web.Request) -> tuple[int, int]:
    """When the request's first and last bytes reached the replica (now, for what is not
    known), read once its body is complete. Taking it makes the connection's next bytes the
    next request's first (an HTTP/1.1 client sends that one after this answer)."""
    last = arrival_ns(request)
    transport = request.transport
    protocol = transport.get_protocol() if transport is not None else None
    first = 0
    if isinstance(protocol, ArrivalStamp):
        first, protocol.first_data_ns = protocol.first_data_ns, 0
    return (first or last), last


async def request_read(request: web.Request, _response: web.StreamResponse) -> None:
    """aiohttp's on_response_prepare hook: whatever the request was, it has been read, so the
    connection's first-byte stamp starts over for the next one."""
    arrival_span_ns(request)
