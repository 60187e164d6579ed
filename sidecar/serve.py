"""The proxy as a library: build it in one process or as workers and their collector, with its
sinks wired, and wait for the signal that stops it. `sidecar proxy` (cli.py), `sidecar demo`,
the tests and the benchmarks build it here alike; no command lives in this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, GCCollector, ProcessCollector

import sidecar
from sidecar.config import ConfigError, ProxyConfig
from sidecar.hooks import ScrapeRunner, SinkFanout, ThreadedSink
from sidecar.proxy.app import ProxyServer, metrics_route
from sidecar.proxy.collector import Collector
from sidecar.sinks.capture import CaptureSink
from sidecar.sinks.prometheus import (
    CaptureCollector,
    LiveCollector,
    PrometheusSink,
    ReplicaState,
    WorkerCollector,
    WorkerState,
)
from sidecar.sinks.window import Selection, WindowSink
from sidecar.stats import SLO, SLOPolicy
from sidecar.tracefile import TraceHeader


def check_capture_dir(directory: str) -> None:
    """--capture's directory is one, or can be made, and this user may write there: checked at
    start, so that a file in its place or a read-only mount is one line (ConfigError), not a
    traceback. Nothing is created here: the capture sink makes the directory, with its mode."""
    path = Path(directory)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None:  # pragma: no cover - the root always exists
        return
    if not existing.is_dir():
        where = "" if existing == path else f" ({existing} is a file)"
        raise ConfigError(f"--capture {directory}: not a directory{where or ' (a file is there)'}")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "write there" if existing == path else f"create it in {existing}"
        raise ConfigError(f"--capture {directory}: this user cannot {what}")


def sink_error(exc: ValueError | OSError, config: ProxyConfig) -> str:
    """An error of building the sinks as one line, naming the flag when it is the capture's."""
    if not isinstance(exc, OSError):
        return str(exc)
    text = f"{exc.filename}: {exc.strerror}" if exc.filename else (exc.strerror or str(exc))
    capture = config.capture_dir
    if capture and exc.filename and str(exc.filename).startswith(str(capture)):
        return f"--capture {capture}: {exc.strerror}"
    return text


def settle_gc() -> None:
    """Move everything alive after start-up (modules, classes, the app) out of the collector's
    reach, so that collections scan only what traffic created. A pause stalls every stream and
    is stamped into every event behind it: in the accuracy benchmark (benchmarks/proxy.md) GC
    time at 128 streams fell from 166 to 89 ms in 8 s, and a 14.5 ms full collection at one
    stream went away."""
    gc.collect()
    gc.freeze()


def capture_key_notes(key_id: str | None, shared: bool) -> dict[str, str]:
    """What a capture says of the key behind its prefix hashes and session pseudonyms:
    captures with the same id can be merged (`sidecar trace merge`)."""
    if key_id is None:
        return {}
    return {
        "capture_key_id": key_id,
        "capture_key": "shared (--capture-key-file)" if shared else "this process only",
    }


def slo_policy_of(config: ProxyConfig) -> SLOPolicy | None:
    classes = {name: SLO(**spec.slo_arguments()) for name, spec in config.slo_specs().items()}
    return SLOPolicy(classes) if classes else None


async def upstream_models(upstreams: Sequence[str]) -> tuple[str, ...]:
    """Model ids the upstreams serve (GET /v1/models), best effort, for a capture's header."""
    import aiohttp

    found: list[str] = []
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for url in upstreams:
            try:
                async with session.get(url + "/v1/models") as response:
                    body = await response.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                continue
            for card in body.get("data", []) if isinstance(body, dict) else []:
                if isinstance(card, dict) and isinstance(card.get("id"), str):
                    if card["id"] not in found:
                        found.append(card["id"])
    return tuple(found)


def otel_enabled(config: ProxyConfig) -> bool:
    """OpenTelemetry export is on with --otel-endpoint or the standard OTLP variables."""
    return bool(
        config.otel_endpoint
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
    )


class _Host(Protocol):
    """What the sink wiring needs of the process that serves: `ProxyServer` (one process) or
    `Collector` (worker mode)."""

    def add_admin_routes(self, routes: Sequence[web.RouteDef]) -> None: ...

    def on_close(self, hook: Callable[[], Coroutine[Any, Any, None]]) -> None: ...


@dataclass
class _Sinks:
    slo_policy: SLOPolicy | None
    window: WindowSink
    registry: CollectorRegistry
    fanout: SinkFanout


def _core_sinks(config: ProxyConfig) -> _Sinks:
    slo_policy = slo_policy_of(config)
    window = WindowSink(config.window_s, config.window_max_records, config.window_max_bytes)
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    GCCollector(registry=registry)
    prometheus = PrometheusSink(
        registry, slo_policy, label_cap=config.label_cap, histogram_buckets=config.histogram_buckets
    )
    return _Sinks(slo_policy, window, registry, SinkFanout([window, prometheus]))


def build_proxy_server(
    config: ProxyConfig, models: Sequence[str] = ()
) -> tuple[ProxyServer, WindowSink]:
    """The proxy in one process with its sinks wired: the one place that knows both."""
    sinks = _core_sinks(config)
    server = ProxyServer(config, sinks.fanout)
    router = server.proxy.router
    _wire_sinks(
        config,
        sinks,
        server,
        models,
        server.proxy.capture_key_id,
        lambda: [ReplicaState(r.label, r.outstanding, r.healthy) for r in router.replicas],
    )
    fanout = sinks.fanout

    async def close_sinks() -> None:
        # After the listeners stopped and the last request ended (ProxyServer.close runs its
        # hooks then): every record is in. One call closes them all (hooks.SinkFanout.close);
        # in a thread, so that an OTLP receiver on this loop can take the last export.
        await asyncio.to_thread(fanout.close)

    server.on_close(close_sinks)
    return server, sinks.window


def build_collector(
    config: ProxyConfig, workers: int, models: Sequence[str] = ()
) -> tuple[Collector, WindowSink]:
    """The proxy as ``workers`` worker processes and this process as their collector, which
    holds the same sinks as `build_proxy_server` (fed by every worker's records) and closes
    them when it closes (Collector.close)."""
    sinks = _core_sinks(config)
    collector = Collector(config, sinks.fanout, workers)
    sinks.registry.register(
        WorkerCollector(lambda: [WorkerState(**state) for state in collector.worker_states()])
    )
    # Scrapes on a thread of lower CPU priority: the workers share the cores (hooks.py).
    _wire_sinks(
        config,
        sinks,
        collector,
        models,
        collector.capture_key_id,
        lambda: [
            ReplicaState(label, outstanding, healthy)
            for label, outstanding, healthy in collector.replica_states()
        ],
        ScrapeRunner(threaded=True),
    )
    return collector, sinks.window


def _wire_sinks(
    config: ProxyConfig,
    sinks: _Sinks,
    host: _Host,
    models: Sequence[str],
    capture_key_id: str | None,
    replicas: Callable[[], Sequence[ReplicaState]],
    scrape: ScrapeRunner | None = None,
) -> None:
    slo_policy, window, registry, fanout = (
        sinks.slo_policy,
        sinks.window,
        sinks.registry,
        sinks.fanout,
    )
    registry.register(LiveCollector(window, fanout, slo_policy, replicas))
    runner = scrape or ScrapeRunner()
    fanout.lock = runner.lock

    async def stats_handler(request: web.Request) -> web.Response:
        try:
            selection = Selection.from_query(request.query)  # e.g. ?request_id_prefix=
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response(await runner.run(lambda: window.snapshot(slo_policy, selection)))

    async def close_scrape() -> None:
        await asyncio.to_thread(runner.close)

    # Registered before the host closes the sinks: no scrape reads a sink being closed.
    host.on_close(close_scrape)

    host.add_admin_routes([web.get("/stats", stats_handler), metrics_route(registry, runner)])
    if otel_enabled(config):
        from sidecar.sinks.otel import build_otel_sink

        otel = build_otel_sink(
            endpoint=config.otel_endpoint,
            slo_policy=slo_policy,
            provider_name=config.otel_provider_name,
            exponential_histograms=config.otel_exponential_histograms,
            export_interval_s=config.otel_export_interval,
            traces=config.otel_traces,
            max_models=config.label_cap,
            server_chunks=config.otel_server_chunks,
        )
        # The SDK costs microseconds per measurement (one per chunk): off the event loop.
        # Closing it drains its queue, then shuts the SDK down (the last export).
        fanout.add(ThreadedSink(otel, queue_size=config.capture_queue))
    if config.capture_dir:
        capture = CaptureSink(
            config.capture_dir,
            TraceHeader(
                source="capture",
                start_wall_ns=time.time_ns(),
                sidecar_version=sidecar.__version__,
                models=tuple(models),
                route_policy=config.route_policy.value,
                slos=config.slo_thresholds(),
                text_included=config.capture_text,
                notes=capture_key_notes(capture_key_id, config.capture_key_file is not None),
            ),
            compress=config.capture_compress,
            rotate_bytes=config.capture_rotate_bytes,
            rotate_s=config.capture_rotate_s,
            queue_size=config.capture_queue,
        )
        fanout.add(capture)
        registry.register(CaptureCollector(capture))


@contextlib.contextmanager
def shutdown_signals() -> Iterator[asyncio.Event]:
    """An event set on SIGINT or SIGTERM, with the handlers installed for the block's duration
    (graceful stop: in-flight requests get to finish)."""
    import signal

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - Windows
            pass
    try:
        yield stop
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)


async def wait_for_shutdown_signal() -> None:
    """Return on SIGINT or SIGTERM."""
    with shutdown_signals() as stop:
        await stop.wait()
