"""The proxy as a library: build it in one process or as workers and their collector, with its
sinks wired, and wait for the signal that stops it. `sidecar proxy` (cli.py), `sidecar demo`,
the tests and the benchmarks build it here alike; no command lives in this module.

`serve` runs it from a `ProxyConfig` until a signal (or the caller's event) stops it, as
`sidecar proxy` does, which is that call with its settings parsed and its lines printed:

    config = build_config({"upstreams": ["http://127.0.0.1:8000"]})
    served = await serve(config, on_ready=lambda proxy: print("listening on", proxy.url))
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, GCCollector, ProcessCollector

import sidecar
from sidecar.config import ConfigError, ProxyConfig, default_workers
from sidecar.hooks import ScrapeRunner, SinkFanout, ThreadedSink
from sidecar.proxy.app import ProxyServer, metrics_route
from sidecar.proxy.collector import Collector, StartError
from sidecar.proxy.gcpolicy import settle
from sidecar.proxy.gcpolicy import thresholds as gc_thresholds
from sidecar.proxy.heap import keep_freed_memory
from sidecar.proxy.heap import wanted as heap_wanted
from sidecar.sinks.capture import CaptureSink
from sidecar.sinks.prometheus import (
    CaptureCollector,
    LiveCollector,
    PrometheusSink,
    ReplicaState,
    StallCollector,
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
    # How late this process's stamps may be, as one worker's would be (worker="0").
    sinks.registry.register(StallCollector(lambda: {"0": server.stalls.snapshot()}))
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
    runner.on_released.append(fanout.drain)

    async def stats_handler(request: web.Request) -> web.Response:
        try:
            selection = Selection.from_query(request.query)  # e.g. ?request_id_prefix=
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        # Encoded where the summaries are computed (a collector's scrape thread, below the
        # traffic), not on the loop, which runs at the workers' priority.
        body = await runner.run(lambda: json.dumps(window.snapshot(slo_policy, selection)))
        return web.Response(text=body, content_type="application/json")

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


class ServeError(Exception):
    """The proxy could not be built or started (a port in use, a worker that did not start, a
    capture directory refused): one line that says which and why."""


@dataclass(frozen=True)
class RunningProxy:
    """A started proxy, as `serve` shows it to its caller once it listens."""

    url: str  # the traffic listener
    admin_url: str  # /metrics, /stats, /replicas, /healthz (and /workers with workers)
    workers: int  # worker processes; 0: everything in this one
    server: ProxyServer | Collector


@dataclass(frozen=True)
class CaptureTotals:
    """What the capture wrote and dropped, counted once it was flushed."""

    directory: str
    written: int
    files: int
    dropped_queue_full: int
    dropped_write_errors: int
    dropped_unwritable: int

    @property
    def dropped(self) -> int:
        return self.dropped_queue_full + self.dropped_write_errors + self.dropped_unwritable


@dataclass(frozen=True)
class Served:
    """How a `serve` ended: ``started`` is False when the stop came while it was starting
    (nothing was served); ``capture`` the capture's totals when it had one."""

    started: bool
    capture: CaptureTotals | None


def effective_workers(config: ProxyConfig) -> int:
    """The worker processes ``config`` asks for (None: the CPUs this process may use); 0
    where the platform cannot share a port between processes (no SO_REUSEPORT)."""
    workers = default_workers() if config.workers is None else config.workers
    if workers > 0 and not hasattr(socket, "SO_REUSEPORT"):  # pragma: no cover - Windows
        logging.getLogger("sidecar").warning(
            "no SO_REUSEPORT on this platform: running in one process (--workers 0)"
        )
        workers = 0
    return workers


async def serve(
    config: ProxyConfig,
    *,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[RunningProxy], None] | None = None,
    on_stopping: Callable[[], None] | None = None,
) -> Served:
    """Run the proxy of ``config`` (one process, or worker processes and their collector by
    ``config.workers``) until ``stop`` is set, by default until SIGINT or SIGTERM; then let
    in-flight requests finish and flush the sinks. ``on_ready`` is called once it listens,
    ``on_stopping`` when the stop came and the closing begins. Raises ServeError when it
    cannot be built or started; a stop while it starts ends the start (``started`` False)."""
    workers = effective_workers(config)
    try:
        gc_thresholds()  # a bad SIDECAR_GC_THRESHOLDS stops the start, not a worker later
        keep_heap = heap_wanted() and bool(workers)  # a bad value stops any start
    except ValueError as exc:
        raise ServeError(str(exc)) from None
    if keep_heap and not keep_freed_memory():
        logging.getLogger("sidecar").info("the collector's heap keeps glibc's defaults (not glibc)")
    models = await upstream_models(config.upstreams) if config.capture_dir else ()
    server: ProxyServer | Collector
    try:
        if workers:
            server, _window = build_collector(config, workers, models=models)
        else:
            server, _window = build_proxy_server(config, models=models)
    except (ValueError, OSError) as exc:
        # A sink that cannot start (the capture directory refused or not made): one line.
        raise ServeError(sink_error(exc, config)) from None
    # Handlers first: a SIGTERM right after the proxy says it listens (an orchestrator that
    # starts and stops quickly) must still be a graceful stop, not the default kill.
    signals: contextlib.AbstractContextManager[asyncio.Event] = (
        shutdown_signals() if stop is None else contextlib.nullcontext(stop)
    )
    with signals as stopping:
        starting = asyncio.ensure_future(server.start())
        stopped = asyncio.ensure_future(stopping.wait())
        # Starting workers takes a moment: a stop meanwhile ends the start (start cleans up
        # after itself when cancelled) rather than waiting for it.
        await asyncio.wait((starting, stopped), return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError, StartError, OSError):
                await starting
            return Served(started=False, capture=None)
        stopped.cancel()
        try:
            starting.result()
        except (StartError, OSError) as exc:
            # A port in use (ListenError names the listener, the address and the cause), a
            # worker that could not start: one line, not a traceback.
            raise ServeError(str(exc)) from None
        fanout = server.fanout if isinstance(server, Collector) else server.proxy.fanout
        capture = next((sink for sink in fanout.sinks if isinstance(sink, CaptureSink)), None)
        try:
            settle()
            if isinstance(server, ProxyServer):
                server.stalls.clear()  # that collection was ours, at start, with no traffic
            if on_ready is not None:
                on_ready(RunningProxy(server.url, server.admin_url, workers, server))
            await stopping.wait()
            if on_stopping is not None:
                on_stopping()
        finally:
            await server.close()
    if capture is None:
        return Served(started=True, capture=None)
    return Served(
        started=True,
        capture=CaptureTotals(
            directory=str(config.capture_dir),
            written=capture.written,
            files=len(capture.files),
            dropped_queue_full=capture.dropped_queue_full,
            dropped_write_errors=capture.dropped_write_errors,
            dropped_unwritable=capture.dropped_unwritable,
        ),
    )
