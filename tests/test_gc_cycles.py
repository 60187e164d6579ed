"""A finished request leaves no reference cycle behind in the proxy.

What a request allocated must be freed by its reference count when it ends. Left in a cycle,
it waits in the oldest generation for a full collection, and that collection stops the loop
(every stream) for as long as it takes to scan all of it: with 256 streams in flight, 2,300
finished requests' worth had piled up and one collection took 105-130 ms, stamped into every
stream's inter-token gaps (benchmarks/RESULTS.md, "Garbage-collection pauses").

Each test runs requests through a real proxy with the collector switched off, then asks the
collector what it would have had to free (``gc.DEBUG_SAVEALL``), and counts the objects of
the proxy's own classes among them. The simulator and the test's client run in this process
too; their garbage is not the proxy's and is not counted.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import aiohttp
import pytest
from proxy_stack import Stack, stack
from reliability_helpers import until

from sidecar.proxy import gcpolicy
from sidecar.proxy.upstream import ArrivalBatch, UpstreamConnection, UpstreamExchange
from sidecar.record import Outcome
from sidecar.sim.engine import EngineConfig
from sidecar.sim.faults import FAULT_HEADER
from sidecar.sim.server import SimConfig

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
# The measuring proxy's modules; the simulator (sidecar.sim) is the upstream, not under test.
PROXY_MODULES = ("sidecar.proxy.", "sidecar.meter", "sidecar.protocol.", "sidecar.record")


@contextmanager
def collector_off() -> Iterator[None]:
    gc.collect()  # what came before is not these requests'
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def proxy_objects_in_cycles() -> Counter[str]:
    """The proxy's objects that only the cycle collector could free, by class."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return Counter(
            f"{type(obj).__module__}.{type(obj).__qualname__}"
            for obj in gc.garbage
            if type(obj).__module__.startswith(PROXY_MODULES)
        )
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


@asynccontextmanager
async def requests_then_count(
    sim: SimConfig | None = None, **settings: str
) -> AsyncIterator[tuple[Stack, Counter[str]]]:
    """A stack; the body of the ``async with`` sends requests with the collector off; on exit
    (every record in, the client connections closed) the counter is filled."""
    found: Counter[str] = Counter()
    async with stack(1, sim, **settings) as s:
        await _warm(s)  # first-use allocations (caches, pools) are not per request
        with collector_off():
            yield s, found
            await asyncio.sleep(0.05)  # connection_lost callbacks of the closed connections
            found.update(proxy_objects_in_cycles())


async def _warm(s: Stack) -> None:
    async with aiohttp.ClientSession() as session:
        for stream in (True, False):
            async with session.post(
                s.url + "/v1/chat/completions", json={**CHAT, "stream": stream}
            ) as response:
                await response.read()
    await s.records.wait_for(2)
    s.records.records.clear()


async def raw_exchange(url: str, request: bytes, read_until: bytes | None = None) -> bytes:
    """Send ``request`` on a connection of its own; read up to ``read_until`` (then leave), or
    to the end of the answer's chunked body or the connection's end."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        data = b""
        while True:
            piece = await asyncio.wait_for(reader.read(65536), 10)
            data += piece
            if not piece or data.endswith(b"0\r\n\r\n"):
                return data
            if read_until is not None and read_until in data:
                return data
            if b"Content-Length:" in data and data.rstrip().endswith(b"}"):
                return data
    finally:
        writer.close()


def chat_request(body: dict[str, object], *headers: tuple[str, str]) -> bytes:
    payload = json.dumps(body).encode()
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n"
    head += "Content-Type: application/json\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
    head += f"Content-Length: {len(payload)}\r\n\r\n"
    return head.encode() + payload


async def test_streamed_and_assembled_requests_leave_no_cycles() -> None:
    async with requests_then_count() as (s, found):
        async with aiohttp.ClientSession() as session:
            for stream in (True, False, True, False):  # keep-alive: connections reused
                async with session.post(
                    s.url + "/v1/chat/completions", json={**CHAT, "stream": stream}
                ) as response:
                    assert response.status == 200
                    await response.read()
        for _ in range(3):  # a connection of its own each: the client connection ends too
            assert b"[DONE]" in await raw_exchange(s.url, chat_request({**CHAT, "stream": True}))
        records = await s.records.wait_for(7)
        assert {r.outcome for r in records} == {Outcome.OK}
    assert found == Counter()


async def test_a_client_that_leaves_mid_stream_leaves_no_cycles() -> None:
    slow = SimConfig(model="m", engine=EngineConfig(step_floor_s=0.01, per_token_s=0.0))
    async with requests_then_count(sim=slow) as (s, found):
        for _ in range(4):
            request = chat_request({**CHAT, "stream": True, "max_tokens": 500})
            await raw_exchange(s.url, request, read_until=b'"content"')
        records = await s.records.wait_for(4)
        assert {r.outcome for r in records} == {Outcome.CLIENT_CANCELLED}
    assert found == Counter()


async def test_upstream_failures_and_timeouts_leave_no_cycles() -> None:
    faults = ("reset_after=2", "close_after=2", "error_event_after=1", "error_status=500")
    async with requests_then_count(ttft_timeout="300ms") as (s, found):
        for fault in faults:
            request = chat_request({**CHAT, "stream": True}, (FAULT_HEADER, fault))
            await raw_exchange(s.url, request)
        stalled = chat_request({**CHAT, "stream": True}, (FAULT_HEADER, "stall_ms=3000"))
        await raw_exchange(s.url, stalled)  # the TTFT timeout ends it
        records = await s.records.wait_for(len(faults) + 1)
        assert Outcome.OK not in {r.outcome for r in records}
        assert records[-1].outcome is Outcome.TIMEOUT
    assert found == Counter()


async def test_refused_requests_leave_no_cycles() -> None:
    async with requests_then_count() as (s, found):
        answer = await raw_exchange(s.url, b"NOT HTTP AT ALL\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 400")
        bad_json = chat_request({})[: -len(b"{}")] + b"{n"  # Content-Length 2: the body "{n"
        assert (await raw_exchange(s.url, bad_json)).startswith(b"HTTP/1.1 400")
        await until(lambda: len(s.records.records) >= 2)
    assert found == Counter()


def test_the_count_sees_the_cycles_the_proxy_used_to_leave() -> None:
    """The check itself: an exchange the pool never took back (`UpstreamExchange.detach`)
    is still in a cycle with its parser, and is found; once detached, it is not."""

    async def exchanges() -> None:
        loop = asyncio.get_running_loop()
        connection = UpstreamConnection(("127.0.0.1", 1, False), ArrivalBatch(loop))
        UpstreamExchange(connection, head_method=False)  # dropped as it is
        UpstreamExchange(connection, head_method=False).detach()

    with collector_off():
        asyncio.run(exchanges())
        found = proxy_objects_in_cycles()
    assert found["sidecar.proxy.upstream.UpstreamExchange"] == 1


def settled_in_a_process_of_its_own(environ: dict[str, str]) -> tuple[list[int], int]:
    """`gcpolicy.settle` in a fresh interpreter (this one's collector is left as it is): the
    thresholds it set and how many objects it froze."""
    script = (
        "import gc, json\n"
        "from sidecar.proxy import gcpolicy\n"
        "gcpolicy.settle()\n"
        "print(json.dumps([gc.get_threshold(), gc.get_freeze_count()]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "SIDECAR_GC_THRESHOLDS"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**env, **environ},
    )
    thresholds, frozen = json.loads(done.stdout)
    return thresholds, frozen


def test_a_serving_process_freezes_its_start_up_and_sets_the_thresholds() -> None:
    """`gcpolicy.settle` (every worker, the collector, the proxy in one process): start-up out
    of the collector's reach, and DEFAULT_THRESHOLDS (full collections ten times rarer than
    CPython's, generation-1 collections a fifth as long), or SIDECAR_GC_THRESHOLDS."""
    thresholds, frozen = settled_in_a_process_of_its_own({})
    assert tuple(thresholds) == gcpolicy.DEFAULT_THRESHOLDS == (700, 2, 500)
    assert frozen > 1000  # the interpreter's and the modules' objects
    thresholds, _ = settled_in_a_process_of_its_own({"SIDECAR_GC_THRESHOLDS": " 700,10,10 "})
    assert thresholds == [700, 10, 10]


def test_thresholds_that_are_not_three_positive_integers_are_refused() -> None:
    assert gcpolicy.thresholds({}) == gcpolicy.DEFAULT_THRESHOLDS
    assert gcpolicy.thresholds({"SIDECAR_GC_THRESHOLDS": "1000,5,200"}) == (1000, 5, 200)
    for bad in ("700,2", "700,2,500,1", "700,0,500", "-1,2,3", "a,b,c", "700;2;500"):
        with pytest.raises(ValueError, match="SIDECAR_GC_THRESHOLDS"):
            gcpolicy.thresholds({"SIDECAR_GC_THRESHOLDS": bad})
