"""Serving: the traffic listener and the separate admin listener.

The admin listener (metrics port) is never the traffic port: what it shows (per-replica state,
live statistics) stays off the path clients use. Routes for it are added by whoever wires the
sinks (cli.py), since the proxy itself knows no sink.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from sidecar.config import ProxyConfig
from sidecar.engine_metrics import merge_views
from sidecar.hooks import ScrapeRunner, SinkFanout
from sidecar.proxy.listener import ListenerLimits, TrafficServer, raise_open_files_limit
from sidecar.proxy.relay import Proxy
from sidecar.proxy.stalls import StallMonitor


def build_traffic_server(proxy: Proxy) -> TrafficServer:
    """The traffic listener (listener.py) serving ``proxy``, with the config's limits. Raises
    this process's open-files soft limit to its hard limit first: under the usual default of
    1,024 a few hundred idle clients exhaust it and every accept fails."""
    config = proxy.config
    open_files = raise_open_files_limit()
    # Each client connection may hold an upstream connection too; keep room for the rest.
    max_connections = config.max_connections or max(64, (open_files - 64) // 2)
    limits = ListenerLimits(
        max_body_bytes=config.max_body_bytes,
        max_header_count=config.max_header_count,
        max_header_bytes=config.max_header_bytes,
        header_timeout_s=config.header_timeout,
        body_timeout_s=config.body_timeout,
        keepalive_timeout_s=config.keepalive_timeout,
        max_connections=max_connections,
    )
    return TrafficServer(proxy.handle, proxy.reject, limits)


def readiness(healthy: Sequence[bool], *, workers_alive: bool = True) -> web.Response:
    """/readyz: 200 when at least one upstream replica is healthy (and, in worker mode, a
    worker relays), else 503. For a gateway's readiness probe: a sidecar whose every replica
    is ejected can only answer 502. /healthz stays the liveness probe (the process serves)."""
    ready = workers_alive and any(healthy)
    status = "ready" if ready else ("no_workers" if not workers_alive else "no_healthy_replica")
    return web.json_response(
        {"status": status, "healthy_replicas": sum(healthy), "replicas": len(healthy)},
        status=200 if ready else 503,
    )


def build_admin_app(proxy: Proxy, extra_routes: Sequence[web.RouteDef] = ()) -> web.Application:
    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "in_flight": proxy.in_flight})

    async def readyz(_request: web.Request) -> web.Response:
        return readiness([r.healthy for r in proxy.router.replicas])

    async def replicas(_request: web.Request) -> web.Response:
        return web.json_response(
            {
                "route_policy": proxy.config.route_policy.value,
                "replicas": [
                    {
                        "url": r.url,
                        "healthy": r.healthy,
                        "outstanding": r.outstanding,
                        "requests_total": r.requests_total,
                        "ejections": r.ejections,
                        "consecutive_failures": r.consecutive_failures,
                        "engine": r.engine.to_dict(),
                    }
                    for r in proxy.router.replicas
                ],
                "engine_totals": merge_views(r.engine for r in proxy.router.replicas),
                "requests_total": proxy.requests_total,
                "records_total": proxy.records_total,
                "sink_errors": proxy.fanout.errors,
                "rewritten_events": proxy.rewritten_events,
                "upstream_reads_unstamped": proxy.pool.unstamped_reads,
            }
        )

    app = web.Application(middlewares=[admin_auth(proxy.config.admin_token)])
    app.on_response_prepare.append(plain_server_header)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/replicas", replicas)
    app.add_routes(list(extra_routes))
    return app


def metrics_route(registry: CollectorRegistry, scrape: ScrapeRunner) -> web.RouteDef:
    """GET /metrics: ``registry`` as prometheus_client's own exposition writes it, in the
    format the scraper asks for (``choose_encoder`` on its Accept header): OpenMetrics text
    when asked (Prometheus asks for it first), the classic text format otherwise (curl,
    promtool). The work runs where ``scrape`` says (hooks.ScrapeRunner: off the loop in worker
    mode)."""

    async def metrics(request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        body = await scrape.run(lambda: encoder(registry))
        return web.Response(body=body, headers={"Content-Type": content_type})

    return web.get("/metrics", metrics)


# Open without the token: probes carry no secret, and these reveal nothing but up or ready.
PROBE_PATHS: Final = frozenset({"/healthz", "/readyz"})


def admin_auth(token: str | None) -> Any:
    """Require ``Authorization: Bearer <token>`` on the admin listener, the probe paths
    excepted. The scheme is case-insensitive (RFC 9110); the token is compared in constant
    time, without surrounding whitespace (a Secret made from a file often ends in a newline),
    and never logged."""
    expected = token.strip().encode() if token else None  # config refuses a blank token

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        if expected is not None and request.path not in PROBE_PATHS:
            scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
            given = credentials.strip().encode("utf-8", "replace")
            # Both comparisons run whatever the scheme says: no early exit to time.
            matches = hmac.compare_digest(given, expected)
            if not (scheme.lower() == "bearer" and matches):
                return web.json_response(
                    {"error": "the sidecar's admin endpoints need a bearer token"},
                    status=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
        response: web.StreamResponse = await handler(request)
        return response

    return middleware


async def plain_server_header(_request: web.Request, response: web.StreamResponse) -> None:
    """aiohttp would say ``Server: Python/3.11 aiohttp/3.x``: a version list for scanners."""
    response.headers["Server"] = "vllm-sidecar"


class ProxyServer:
    """Both listeners of one proxy. ``port`` 0 in the config means an ephemeral port."""

    def __init__(
        self,
        config: ProxyConfig,
        fanout: SinkFanout | None = None,
        admin_routes: Sequence[web.RouteDef] = (),
    ) -> None:
        self.config = config
        self.proxy = Proxy(config, fanout)
        self._admin_routes: list[web.RouteDef] = list(admin_routes)
        self._runners: list[web.AppRunner] = []
        self.traffic: TrafficServer | None = None
        # Loop lag and GC pauses of this process's loop, which stamps every chunk (stalls.py),
        # measured while it serves (start to close). Exported by `sinks.prometheus.StallCollector`
        # as worker "0": the one process is the only data plane, as worker 0 of one.
        self.stalls = StallMonitor()
        self._close_hooks: list[Callable[[], Awaitable[None]]] = []
        self.url = ""
        self.admin_url = ""

    def on_close(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Run ``hook`` after the listeners stopped and in-flight requests ended (e.g. flush a
        capture: every record is in by then)."""
        self._close_hooks.append(hook)

    def add_admin_routes(self, routes: Sequence[web.RouteDef]) -> None:
        """Routes for the admin listener (before `start`): /stats, /metrics, ..."""
        self._admin_routes.extend(routes)

    async def start(self) -> None:
        await self.proxy.start()
        admin = web.AppRunner(build_admin_app(self.proxy, self._admin_routes), access_log=None)
        try:
            # A client that disconnects cancels its handler at once (listener.py), so the
            # upstream request is closed (and vLLM aborts it) even while waiting for a token.
            self.traffic = build_traffic_server(self.proxy)
            config = self.config
            try:
                host, port = await self.traffic.start(config.listen_host, config.listen_port)
            except OSError as exc:
                raise ListenError(
                    "traffic, --listen", config.listen_host, config.listen_port, exc
                ) from None
            self.url = _url_of(host, port)
            try:
                self.admin_url = await self._serve(admin, config.metrics_host, config.metrics_port)
            except OSError as exc:
                raise ListenError(
                    "admin, --metrics-listen", config.metrics_host, config.metrics_port, exc
                ) from None
        except BaseException:
            await self.close()
            raise
        self.stalls.install()

    async def _serve(self, runner: web.AppRunner, host: str, port: int) -> str:
        await runner.setup()
        self._runners.append(runner)
        site = web.TCPSite(runner, host, port, reuse_address=True)
        await site.start()
        server: Any = site._server  # aiohttp keeps the bound socket here; needed for port 0
        bound = server.sockets[0].getsockname()
        return _url_of(bound[0], bound[1])

    async def close(self) -> None:
        if self.traffic is not None:
            await self.traffic.close()
            self.traffic = None
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()
        await self.proxy.close()
        self.stalls.uninstall()
        hooks, self._close_hooks = self._close_hooks, []
        for hook in hooks:
            await hook()


class ListenError(OSError):
    """A listener that could not bind, in one line: which one, where and why (the event loop's
    own message repeats the address as a tuple and lower-cases the cause)."""

    def __init__(self, listener: str, host: str, port: int, cause: OSError) -> None:
        # A resolver error (socket.gaierror) has a negative errno: its own text says it.
        reason = (
            os.strerror(cause.errno)
            if cause.errno and cause.errno > 0
            else (cause.strerror or str(cause))
        )
        shown = f"[{host}]" if ":" in host else host
        super().__init__(cause.errno, f"cannot listen on {shown}:{port} ({listener}): {reason}")

    def __str__(self) -> str:
        return str(self.strerror)


def _url_of(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"
