"""A worker process: one complete data plane on the shared traffic port.

Started by the collector (collector.py) as ``python -m sidecar.proxy.worker --channel-fd N``:
a fresh interpreter, never a fork of a running event loop. Everything else comes over the
channel (channel.py) on that inherited socket, the settings first: nothing secret on the
command line or in the environment, and the admin token never reaches a worker (it serves no
admin listener).

A worker runs the relay (`Proxy` behind `build_traffic_server`) and nothing else on its loop:
no health checks, no engine scrapes (the collector runs those once for all workers and
pushes replica health here), no window, no Prometheus. Its only sink, `ChannelSink`
(channel.py, compiled with the request path), encodes
each finished record (recordwire.py) and hands it to the channel's transport; when more than
``channel_buffer_bytes`` wait for the collector, the record is dropped and counted. Every
``status_interval`` (and once more at exit) it reports its counters, and its own stalls
(stalls.py: loop lag and GC pauses, how late its stamps may be).

Stops on the collector's STOP frame, on SIGTERM, or when the channel closes (the collector is
gone): stop accepting, let in-flight requests finish, send the last records and status, exit.
SIGINT is ignored: a terminal's Ctrl-C reaches the whole process group, and the collector
decides how its workers stop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import logging
import os
import resource
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import fields, replace
from typing import Any

from sidecar.config import ProxyConfig, RoutePolicy
from sidecar.hooks import SinkFanout
from sidecar.proxy import gcpolicy, logs
from sidecar.proxy.app import build_traffic_server
from sidecar.proxy.channel import ChannelSink, FrameProtocol, Kind, json_frame, parse_json
from sidecar.proxy.listener import TrafficServer
from sidecar.proxy.relay import Proxy
from sidecar.proxy.stalls import StallMonitor

log = logging.getLogger("sidecar.worker")

DRAIN_TIMEOUT_S = 10.0  # at exit: how long the last records may take to reach the collector

Address = tuple[int, str, int]  # (address family, host, port) of one traffic listener


# -- settings over the channel ----------------------------------------------------------------


def config_to_wire(config: ProxyConfig) -> dict[str, Any]:
    """The settings as a JSON object (every field, exactly: floats survive JSON)."""
    out: dict[str, Any] = {}
    for f in fields(config):
        value = getattr(config, f.name)
        if isinstance(value, enum.Enum):
            value = value.value
        elif isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, Mapping):
            value = dict(value)
        out[f.name] = value
    return out


def config_from_wire(data: Mapping[str, Any]) -> ProxyConfig:
    values = dict(data)
    values["upstreams"] = tuple(values["upstreams"])
    values["route_policy"] = RoutePolicy(values["route_policy"])
    return ProxyConfig(**values)


def worker_config(config: ProxyConfig, port: int) -> ProxyConfig:
    """What a worker runs with: the traffic port as reserved, no health checks or engine
    scrapes (the collector's), no admin token (no admin listener here; open_admin only keeps
    the settings' own check quiet), no key file (the key itself comes over the channel)."""
    return replace(
        config,
        listen_port=port,
        health_interval=0.0,
        engine_scrape_interval=0.0,
        admin_token=None,
        allow_open_admin=True,
        capture_key_file=None,
        workers=0,
    )


# -- the traffic sockets ------------------------------------------------------------------------


def traffic_socket(family: int, host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """A TCP socket bound to (host, port), not listening. With ``reuse_port`` it joins the
    SO_REUSEPORT group of that port: the kernel spreads new connections over the group's
    listening sockets, one per worker."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            # As asyncio's create_server does: an IPv6 listener does not take IPv4 too.
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def reserve_traffic_port(host: str, port: int) -> tuple[list[socket.socket], list[Address]]:
    """Bind (without listening) the traffic address(es) with SO_REUSEPORT, so that the port is
    known (``port`` 0: an ephemeral one) and held while workers come and go; workers then bind
    and listen on the same port.

    A probe without SO_REUSEPORT goes first, so that a port already in use is an error
    (EADDRINUSE), even when its holder is another sidecar of the same user, which SO_REUSEPORT
    would otherwise let us share silently."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    targets: list[tuple[int, str]] = []
    for info in infos:
        target = (int(info[0]), str(info[4][0]))
        if target not in targets:
            targets.append(target)
    chosen = port
    probes: list[socket.socket] = []
    try:
        for family, address in targets:
            probe = traffic_socket(family, address, chosen, reuse_port=False)
            probes.append(probe)
            if chosen == 0:
                chosen = int(probe.getsockname()[1])
    finally:
        for probe in probes:
            probe.close()
    reserved: list[socket.socket] = []
    try:
        for family, address in targets:
            reserved.append(traffic_socket(family, address, chosen, reuse_port=True))
    except BaseException:
        for sock in reserved:
            sock.close()
        raise
    return reserved, [(family, address, chosen) for family, address in targets]


# -- the worker -----------------------------------------------------------------------------------


def own_cpu() -> dict[str, int]:
    """This process's CPU (µs, user and system: every thread, from the kernel's own
    accounting) and its context switches since it started: voluntary, each a sleep that ended
    (in epoll_wait, between reads: what a relay pays per wake-up, benchmarks/wakeup_cost.py),
    and involuntary, each a preemption. A status's counters, as `requests_total` is."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "cpu_user_us": round(usage.ru_utime * 1e6),
        "cpu_system_us": round(usage.ru_stime * 1e6),
        "context_switches_voluntary": usage.ru_nvcsw,
        "context_switches_involuntary": usage.ru_nivcsw,
    }


class Worker:
    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.hello: asyncio.Future[dict[str, Any]] = loop.create_future()
        self.stop = asyncio.Event()
        self.channel_lost = False
        self.protocol = FrameProtocol(self._on_frame, self._on_lost)
        self.proxy: Proxy | None = None
        self.sink: ChannelSink | None = None
        self.index = -1
        # Loop lag and GC pauses of this process (stalls.py): how late its stamps may be.
        self.stalls = StallMonitor()
        self.logs: logs.QueuedLogging | None = None
        self._early_health: Mapping[str, Any] | None = None

    def _on_frame(self, kind: int, payload: bytes) -> None:
        if kind == Kind.CONFIG:
            if not self.hello.done():
                self.hello.set_result(parse_json(payload))
        elif kind == Kind.HEALTH:
            self.apply_health(parse_json(payload))
        elif kind == Kind.STOP:
            self.stop.set()

    def _on_lost(self) -> None:
        self.channel_lost = True
        if not self.hello.done():
            self.hello.set_exception(ConnectionError("the collector closed the channel"))
        self.stop.set()

    def apply_health(self, message: Mapping[str, Any]) -> None:
        """Replica health as the collector's checks found it. A replica that passed is back
        in rotation with its failure count reset (what a passed check does in one process);
        one the collector holds unhealthy is taken out; otherwise this worker's own view
        (its connect failures) stands."""
        if self.proxy is None:
            self._early_health = message  # before the relay exists: applied when it does
            return
        passed = message.get("passed", [])
        healthy = message.get("healthy", [])
        for replica, ok, up in zip(self.proxy.router.replicas, passed, healthy, strict=False):
            if ok:
                replica.record_success()
            elif not up:
                replica.healthy = False

    def status(self, final: bool = False) -> dict[str, Any]:
        proxy, sink = self.proxy, self.sink
        assert proxy is not None and sink is not None
        return {
            "worker": self.index,
            "pid": os.getpid(),
            "final": final,
            "in_flight": proxy.in_flight,
            "requests_total": proxy.requests_total,
            "records_total": proxy.records_total,
            "sent": sink.sent,
            "dropped_full": sink.dropped_full,
            "dropped_closed": sink.dropped_closed,
            "encode_errors": sink.encode_errors,
            "buffered_bytes": self.protocol.buffered(),
            "rewritten_events": proxy.rewritten_events,
            "upstream_reads_unstamped": proxy.pool.unstamped_reads,
            "sink_errors": dict(proxy.fanout.errors),
            # Per replica: outstanding, requests_total, ejections, consecutive_failures, healthy.
            "replicas": [
                [r.outstanding, r.requests_total, r.ejections, r.consecutive_failures, r.healthy]
                for r in proxy.router.replicas
            ],
            # Cumulative since this process started; the collector adds up incarnations.
            "stalls": self.stalls.snapshot(),
            **own_cpu(),
        }

    async def _report(self, interval_s: float, bound: int) -> None:
        while True:
            await asyncio.sleep(interval_s)
            # Over the bound the collector is not reading: this status would only queue behind
            # records; the next one says the same and more.
            if self.protocol.buffered() <= bound:
                # At once, with the records queued before it: the collector's view of the
                # workers (in flight, ejections) is as fresh as the interval, and the batch
                # of records rides along (one write, one wake-up of the collector).
                self.protocol.send(json_frame(Kind.STATUS, self.status()), now=True)

    async def run(self, hello: Mapping[str, Any]) -> int:
        config = config_from_wire(hello["config"])
        self.index = int(hello["worker"])
        # Off the loop: a stderr nobody reads must not stall the traffic (logs.py).
        self.logs = logs.install(
            f"%(asctime)s %(levelname)s %(name)s[worker {self.index}]: %(message)s"
        )
        bound = config.channel_buffer_bytes
        self.sink = ChannelSink(self.protocol, bound)
        salt = hello.get("capture_salt")
        # Every worker hashes prefixes and pseudonymises sessions with the collector's key, so
        # that one capture holds comparable hashes whichever worker served.
        proxy = self.proxy = Proxy(
            config,
            SinkFanout([self.sink]),
            capture_salt=None if salt is None else bytes.fromhex(str(salt)),
        )
        self.apply_health(hello.get("health", {}))
        if self._early_health is not None:  # newer than the hello's
            self.apply_health(self._early_health)
        # The traffic listener as one process runs it (app.py), on the shared port: one
        # server per address (a host name may resolve to an IPv4 and an IPv6 one).
        servers: list[TrafficServer] = []
        try:
            await proxy.start()
            for family, host, port in hello["addresses"]:
                sock = traffic_socket(int(family), str(host), int(port), reuse_port=True)
                servers.append(build_traffic_server(proxy))
                try:
                    await servers[-1].start_on_socket(sock)
                except BaseException:
                    sock.close()
                    raise
        except OSError as exc:
            self.protocol.send(
                json_frame(
                    Kind.ERROR,
                    {
                        "error": f"cannot listen on {config.listen_host}:{config.listen_port}: "
                        f"{exc.strerror or exc}"
                    },
                ),
                now=True,
            )
            for server in servers:
                await server.close()
            await proxy.close()
            await self._drain()
            if self.logs is not None:
                await asyncio.to_thread(self.logs.close)
            return 2
        gcpolicy.settle()  # start-up out of the collector's reach; full collections rarer
        # From here on: the start-up (and its one full collection above) is not traffic's
        # stall, and would otherwise be every worker's largest.
        self.stalls.install()
        self.protocol.send(json_frame(Kind.READY, {"pid": os.getpid()}), now=True)
        reporter = asyncio.create_task(self._report(float(hello["status_interval"]), bound))
        try:
            await self.stop.wait()
        finally:
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter
            # Stop accepting everywhere first; then in-flight requests finish (within the
            # listener's grace, as in one process), each ending in its record, sent before
            # the final status below.
            for server in servers:
                server.stop_accepting()
            for server in servers:
                await server.close()
            await proxy.close()
            self.stalls.uninstall()
        self.protocol.send(json_frame(Kind.STATUS, self.status(final=True)), now=True)
        await self._drain()
        if self.logs is not None:
            await asyncio.to_thread(self.logs.close)  # what is queued is written
        return 0

    async def _drain(self) -> None:
        """Let what the transport holds reach the collector, then close the channel."""
        self.protocol.flush()
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while not self.channel_lost and self.protocol.buffered() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        transport = self.protocol.transport
        if transport is not None:
            transport.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.protocol.closed), 1.0)


async def serve(channel_fd: int) -> int:
    loop = asyncio.get_running_loop()
    worker = Worker()
    sock = socket.socket(fileno=channel_fd)
    sock.setblocking(False)
    try:
        await loop.create_unix_connection(lambda: worker.protocol, sock=sock)
    except BaseException:
        sock.close()
        raise
    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGTERM, worker.stop.set)
    stopped = asyncio.ensure_future(worker.stop.wait())
    await asyncio.wait((worker.hello, stopped), return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not worker.hello.done() or worker.hello.exception() is not None:
        return 1  # stopped (or the collector gone) before it said what to run
    return await worker.run(worker.hello.result())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sidecar.proxy.worker",
        description="a worker of `sidecar proxy` (started by it)",
    )
    parser.add_argument(
        "--channel-fd", type=int, required=True, help="the inherited Unix socket to the collector"
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - Windows, or a stripped install
        return asyncio.run(serve(args.channel_fd))
    return uvloop.run(serve(args.channel_fd))


if __name__ == "__main__":
    sys.exit(main())
