"""A full measuring stack on 127.0.0.1 for tests: simulated replicas <- proxy <- clients."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web

from sidecar.config import build_config
from sidecar.proxy.app import ProxyServer
from sidecar.record import RequestRecord
from sidecar.serve import build_proxy_server
from sidecar.sim.engine import EngineConfig
from sidecar.sim.server import RunningReplica, SimConfig, close_replicas, start_replicas
from sidecar.sinks.window import WindowSink

FAST_ENGINE = EngineConfig(step_floor_s=0.002, per_token_s=0.0)


class Collect:
    name = "collect"

    def __init__(self) -> None:
        self.records: list[RequestRecord] = []
        self.arrived = asyncio.Event()

    def on_record(self, record: RequestRecord) -> None:
        self.records.append(record)
        self.arrived.set()

    async def wait_for(self, count: int, timeout: float = 10.0) -> list[RequestRecord]:
        async def until() -> None:
            while len(self.records) < count:
                self.arrived.clear()
                await self.arrived.wait()

        await asyncio.wait_for(until(), timeout)
        return self.records


class Stack:
    def __init__(
        self,
        replicas: list[RunningReplica],
        server: ProxyServer,
        window: WindowSink,
        records: Collect,
    ) -> None:
        self.replicas = replicas
        self.server = server
        self.window = window
        self.records = records
        self.spare: RunningReplica = replicas[0]

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def direct(self) -> str:
        """A replica of its own, not behind the proxy, that has seen the same sequence of
        requests as the proxied one: the simulator's output depends on a per-replica request
        counter, so comparisons send the same requests in the same order to both."""
        return self.spare.url


@asynccontextmanager
async def stack(
    n_replicas: int = 1, sim: SimConfig | None = None, **settings: Any
) -> AsyncIterator[Stack]:
    sim_config = sim or SimConfig(model="m", engine=FAST_ENGINE)
    replicas = await start_replicas(sim_config, n_replicas)
    # Started on its own so that it is "replica 0" too, with replica 0's seed.
    (spare,) = await start_replicas(sim_config, 1)
    try:
        async with running_proxy([r.url for r in replicas], settings) as (server, window, records):
            stack = Stack(replicas, server, window, records)
            stack.spare = spare
            yield stack
    finally:
        await close_replicas([*replicas, spare])


@asynccontextmanager
async def running_proxy(
    upstreams: list[str], settings: dict[str, Any]
) -> AsyncIterator[tuple[ProxyServer, WindowSink, Collect]]:
    """A proxy in this process (health checks off unless set), its live window, its records."""
    flags = {
        "upstreams": upstreams,
        "listen": "127.0.0.1:0",
        "metrics_listen": "127.0.0.1:0",
        "health_interval": "0",
        **settings,
    }
    server, window = build_proxy_server(build_config(flags, {}))
    records = Collect()
    server.proxy.fanout.add(records)
    await server.start()
    try:
        yield server, window, records
    finally:
        await server.close()


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@asynccontextmanager
async def scripted_upstream(path: str, handler: Handler) -> AsyncIterator[str]:
    """A replica that answers POSTs to ``path`` with ``handler`` (bodies up to 4 MiB): its URL."""
    app = web.Application(client_max_size=4 << 20)
    app.router.add_post(path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server: Any = site._server
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def proxy_to(upstream: str, **settings: Any) -> AsyncIterator[tuple[ProxyServer, Collect]]:
    """A proxy in this process in front of one upstream, with its records collected."""
    async with running_proxy([upstream], settings) as (server, _window, records):
        yield server, records
