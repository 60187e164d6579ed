"""Upstream churn under load: replicas die and come back while clients keep sending, with
active health checks ejecting and restoring them.

Checked from the records themselves: each record names its replica and when it was sent
upstream (t_arrive + the server timeline's start, stamped right after the routing decision).
The instants of ejection and restoration are those of the proxy's own log lines (written in
the same event-loop step as the state change): between them no request may be sent to the
replica; after it is restored it gets traffic again. Every routing decision is also checked as
it is made: the chosen replica was healthy, or none was. Requests caught on a replica as it
died end as upstream errors, each in exactly one record; the rest succeed (a connect failure
is retried on another replica before any byte reached the client).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass, field

import aiohttp
import pytest
from proxy_stack import FAST_ENGINE
from reliability_helpers import assert_json_error, proxy_to, settle, until

from sidecar.record import Outcome, RequestRecord
from sidecar.sim.server import RunningReplica, SimConfig, close_replicas, start_replicas

SIM = SimConfig(model="m", engine=FAST_ENGINE, shutdown_timeout_s=0.2)
HEALTH = {
    "health_interval": "50ms",
    "health_timeout": "200ms",
    "eject_after": "2",
    "ttft_timeout": "1s",
    "idle_timeout": "1s",
    "connect_timeout": "500ms",
}


def label(url: str) -> str:
    return url.split("://", 1)[1]


def sent_at_ns(record: RequestRecord) -> int | None:
    """Wall-clock instant the request went upstream (its routing decision came just before)."""
    if record.server is None:
        return None
    return record.wall_time_ns + record.server.start_ns


@dataclass
class Load:
    """``workers`` clients sending short streams back to back until stopped."""

    url: str
    workers: int = 6
    statuses: list[int] = field(default_factory=list)
    sent: int = 0
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def _worker(self, session: aiohttp.ClientSession, n: int) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            stream = i % 3 != 0
            body = {
                "model": "m",
                "prompt": f"worker {n} request {i}",
                "max_tokens": 6,
                "ignore_eos": True,
                "stream": stream,
            }
            self.sent += 1
            try:
                async with session.post(self.url + "/v1/completions", json=body) as response:
                    await response.read()
                    self.statuses.append(response.status)
            except aiohttp.ClientError:
                self.statuses.append(-1)  # the proxy cut a non-stream mid-body: never expected

    def start(self, session: aiohttp.ClientSession) -> None:
        self._tasks = [asyncio.create_task(self._worker(session, n)) for n in range(self.workers)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def while_loaded(load: Load, seconds: float) -> None:
    """Let the load run for at least ``seconds`` and at least 20 more requests."""
    start = load.sent
    deadline = time.monotonic() + seconds
    await until(
        lambda: load.sent - start >= 20 and time.monotonic() >= deadline, 20, "load progress"
    )


async def restart(port: int) -> RunningReplica:
    (replica,) = await start_replicas(SIM, 1, "127.0.0.1", port)
    return replica


MARGIN_NS = 1_000_000  # wall clock (log lines) vs anchored monotonic offsets (records)


def transitions(caplog: pytest.LogCaptureFixture, replica: str) -> list[tuple[str, int]]:
    """("ejected" | "restored", wall ns) for ``replica``, from the proxy's log lines."""
    out = []
    for entry in caplog.records:
        message = entry.getMessage()
        if entry.name == "sidecar.proxy" and f"replica {replica} " in message:
            kind = "restored" if "healthy again" in message else "ejected"
            out.append((kind, int(entry.created * 1e9)))
    return out


def check_routing(
    records: list[RequestRecord], dead: str, ejected_ns: int, restored_ns: int
) -> None:
    between = [
        r
        for r in records
        if (t := sent_at_ns(r)) is not None and ejected_ns + MARGIN_NS < t < restored_ns - MARGIN_NS
    ]
    assert between, "no traffic while the replica was out"
    wrong = [r.request_id for r in between if r.replica == dead]
    assert wrong == [], f"routed to the ejected replica {dead}: {wrong}"
    after = [r for r in records if (t := sent_at_ns(r)) is not None and t > restored_ns]
    assert any(r.replica == dead and r.ok for r in after), "the restored replica got no traffic"


async def test_a_replica_dies_and_comes_back_under_load(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sidecar.proxy")
    sims = await start_replicas(SIM, 3)
    dead_url, dead_port = sims[1].url, sims[1].port
    replacement: RunningReplica | None = None
    try:
        async with (
            proxy_to([s.url for s in sims], **HEALTH) as p,
            aiohttp.ClientSession() as session,
        ):
            router = p.server.proxy.router
            victim = router.replicas[1]
            load = Load(p.url)
            load.start(session)
            await while_loaded(load, 0.2)
            killing = asyncio.create_task(sims[1].close())  # refuses new connections at once
            await until(lambda: not victim.healthy, 10, "ejection")
            # The proxy counts a request to a replica at its routing decision (relay.py): no
            # decision may pick the ejected replica while the others are healthy.
            routed_while_ejected = victim.requests_total
            await while_loaded(load, 0.3)
            await killing
            assert victim.requests_total == routed_while_ejected and not victim.healthy
            replacement = await restart(dead_port)
            await until(lambda: victim.healthy, 10, "restoration")
            await while_loaded(load, 0.3)
            await load.stop()
            live = [sims[0], sims[2], replacement]
            records = await settle(p.server, p.records, load.sent, live, timeout=20)
    finally:
        await close_replicas([*sims, *([replacement] if replacement else [])])
    assert victim.ejections >= 1 and victim.url == dead_url and victim.healthy
    seen = transitions(caplog, label(dead_url))
    assert seen[0][0] == "ejected" and seen[-1][0] == "restored", seen
    ejected_ns = seen[0][1]
    restored_ns = next(t for kind, t in seen if kind == "restored")
    check_routing(records, label(dead_url), ejected_ns, restored_ns)
    outcomes = {r.outcome for r in records}
    assert outcomes <= {Outcome.OK, Outcome.UPSTREAM_ERROR}, outcomes
    # Failures only where the replica died under them, and only before it was ejected.
    for record in records:
        if not record.ok:
            assert record.replica == label(dead_url), record
            sent = sent_at_ns(record)
            assert sent is not None and sent < ejected_ns, record
    assert set(load.statuses) <= {200, 502}, set(load.statuses)
    assert load.statuses.count(200) >= len(records) - 10


async def test_a_hung_replica_is_ejected_by_health_timeouts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A replica that accepts connections and never answers (a wedged process): requests sent
    there time out (one record each), health checks time out and eject it, and from then on
    nothing is sent to it."""
    caplog.set_level(logging.WARNING, logger="sidecar.proxy")
    sims = await start_replicas(SIM, 2)
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(512)  # the kernel completes handshakes; nobody ever reads
    hole_url = f"http://127.0.0.1:{hole.getsockname()[1]}"
    try:
        async with (
            proxy_to(
                [sims[0].url, hole_url, sims[1].url],
                route_policy="round_robin",
                **{**HEALTH, "ttft_timeout": "300ms", "total_timeout": "600ms"},
            ) as p,
            aiohttp.ClientSession() as session,
        ):
            hung = p.server.proxy.router.replicas[1]
            load = Load(p.url, workers=4)
            load.start(session)
            await until(lambda: not hung.healthy, 10, "ejection")
            routed_while_ejected = hung.requests_total  # counted at the routing decision
            await while_loaded(load, 0.3)
            await load.stop()
            assert hung.requests_total == routed_while_ejected and not hung.healthy
            records = await settle(p.server, p.records, load.sent, sims, timeout=20)
    finally:
        hole.close()
        await close_replicas(sims)
    ((kind, ejected_ns),) = transitions(caplog, label(hole_url))
    assert kind == "ejected"
    after = [r for r in records if (t := sent_at_ns(r)) is not None and t > ejected_ns + MARGIN_NS]
    assert after and all(r.replica != label(hole_url) and r.ok for r in after)
    stuck = [r for r in records if r.replica == label(hole_url)]
    assert all(r.outcome is Outcome.TIMEOUT for r in stuck)


async def test_every_replica_down_then_one_back() -> None:
    """All replicas gone: clients get a 502 in vLLM's shape (one record each), the proxy stays
    up; the first replica to come back is used at once, ejected or not."""
    sims = await start_replicas(SIM, 2)
    ports = [s.port for s in sims]
    back: RunningReplica | None = None
    try:
        async with (
            proxy_to([s.url for s in sims], **HEALTH) as p,
            aiohttp.ClientSession() as session,
        ):
            router = p.server.proxy.router

            async def ask() -> tuple[int, bytes]:
                body = {"model": "m", "prompt": "hi", "max_tokens": 3, "stream": True}
                async with session.post(p.url + "/v1/completions", json=body) as response:
                    return response.status, await response.read()

            assert (await ask())[0] == 200
            await close_replicas(sims)
            await until(lambda: not any(r.healthy for r in router.replicas), 10, "all ejected")
            for _ in range(3):
                status, body = await ask()
                assert_json_error(status, body, 502)
            back = await restart(ports[0])
            # Every replica is ejected, so the router tries them all: the live one answers.
            assert (await ask())[0] == 200
            await until(lambda: router.replicas[0].healthy, 10, "restoration")
            for _ in range(3):
                assert (await ask())[0] == 200
            records = await settle(p.server, p.records, 8, [back])
    finally:
        await close_replicas([*sims, *([back] if back else [])])
    assert [r.outcome.value for r in records].count("upstream_error") == 3
    failed = [r for r in records if not r.ok]
    assert all(
        r.error_type is not None and r.error_type.startswith("connect_failed") for r in failed
    )


async def test_a_request_the_upstream_drops_does_not_eject_a_healthy_replica() -> None:
    """A replica that accepts a request and then drops the connection before answering (here a
    non-streamed request reset mid-generation) is retried elsewhere, but that is the request's
    failure, not the replica's: only failures to connect count towards ejection."""
    sims = await start_replicas(SIM, 2)
    try:
        async with (
            proxy_to([s.url for s in sims], eject_after="1") as p,
            aiohttp.ClientSession() as session,
        ):
            router = p.server.proxy.router
            body = {"model": "m", "prompt": "hi", "max_tokens": 6, "ignore_eos": True}
            for _ in range(3):
                async with session.post(
                    p.url + "/v1/completions", json=body, headers={"X-Sim-Fault": "reset_after=1"}
                ) as response:
                    assert_json_error(response.status, await response.read(), 502)
            assert all(r.healthy and r.consecutive_failures == 0 for r in router.replicas)
            async with session.post(p.url + "/v1/completions", json=body) as response:
                assert response.status == 200
            records = await settle(p.server, p.records, 4, sims)
    finally:
        await close_replicas(sims)
    assert [r.outcome for r in records].count(Outcome.UPSTREAM_ERROR) == 3
