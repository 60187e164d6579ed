"""The collector: the parent process of ``sidecar proxy --workers N`` (docs/workers.md).

It relays nothing. It reserves the traffic port, starts N worker processes (worker.py) that
share it through SO_REUSEPORT, and receives every finished record from them over one channel
per worker (channel.py, records in recordwire.py's binary form). Its fan-out holds the sinks
`sidecar proxy` wires (live window, Prometheus, OpenTelemetry, capture), so `/metrics` and
`/stats` are one view of all workers: counts are sums, percentiles are over every record. It
serves the admin listener, so whatever a scrape costs is spent here, never on a loop that
relays. Health checks and engine scrapes run here once, not once per worker; health is pushed
to the workers after each round, and an ejection a worker decides on its own (connect
failures) comes back in its status and is pushed to the others.

A worker that dies is logged, counted and started again (backoff 0.5 s doubling to 10 s, back
to 0.5 s after a worker lived 30 s). On `close`: STOP to every worker (they stop accepting,
finish in-flight requests, send their last records and status, exit), then the channels are
drained, then the close hooks run, then the sinks close through their fan-out (the capture's
last lines, the last OTLP export), so every record a worker sent is in the sinks before they
close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from sidecar.config import ProxyConfig, read_capture_key
from sidecar.engine_metrics import merge_views
from sidecar.hooks import LogThrottle, SinkFanout
from sidecar.proxy import stalls
from sidecar.proxy.app import ListenError, admin_auth, plain_server_header, readiness
from sidecar.proxy.channel import FrameProtocol, Kind, json_frame, parse_json
from sidecar.proxy.probes import check_health, scrape_engine
from sidecar.proxy.recordwire import WireError, decode_record
from sidecar.proxy.routing import Replica
from sidecar.proxy.shape import PrefixHasher
from sidecar.proxy.worker import Address, config_to_wire, reserve_traffic_port, worker_config

log = logging.getLogger("sidecar.collector")

STATUS_INTERVAL_S = 0.25
START_TIMEOUT_S = 60.0  # a worker that is not listening by then did not start
# A stopping worker gets aiohttp's shutdown timeout (60 s) for its in-flight requests; past
# this it is killed.
STOP_TIMEOUT_S = 75.0
REAP_TIMEOUT_S = 10.0  # channel closed -> process gone; past this it is killed
RESTART_BACKOFF_MIN_S = 0.5
RESTART_BACKOFF_MAX_S = 10.0
STABLE_AFTER_S = 30.0  # a worker that lived this long resets the restart backoff

# Counters a worker's status carries, summed over its incarnations (and its stall figures,
# stalls.counters: the maxima among them are merged by max, see `_merge`).
_STATUS_COUNTERS = (
    "requests_total",
    "records_total",
    "sent",
    "dropped_full",
    "dropped_closed",
    "encode_errors",
    "rewritten_events",
    "upstream_reads_unstamped",
    # The process's own CPU and context switches (worker.own_cpu), as of its last status.
    "cpu_user_us",
    "cpu_system_us",
    "context_switches_voluntary",
    "context_switches_involuntary",
)


class StartError(RuntimeError):
    """The proxy could not start: one line that says why."""


class WorkerProcess:
    """One incarnation of a worker: its process, its channel and what it last reported."""

    def __init__(
        self,
        index: int,
        proc: subprocess.Popen[bytes],
        on_frame: Callable[[WorkerProcess, int, bytes], None],
        n_replicas: int,
    ) -> None:
        loop = asyncio.get_running_loop()
        self.index = index
        self.proc = proc
        self.pid = proc.pid
        self.started = time.monotonic()
        self.ready: asyncio.Future[dict[str, Any]] = loop.create_future()
        self.status: dict[str, Any] = {}
        self.received = 0  # records decoded and given to the sinks
        self.decode_errors = 0
        self.dropped_scrape_backlog = 0  # decoded, then dropped: a scrape held the sinks too long
        self.ejections_seen = [0] * n_replicas
        self.protocol = FrameProtocol(
            lambda kind, payload: on_frame(self, kind, payload), self._lost
        )

    def _lost(self) -> None:
        if not self.ready.done():
            self.ready.set_exception(
                StartError(f"worker {self.index} (pid {self.pid}) exited before it was listening")
            )
        # Nobody may be waiting on `ready` (a worker that dies later): mark it retrieved.
        if self.ready.done() and not self.ready.cancelled():
            self.ready.exception()

    @property
    def alive(self) -> bool:
        return (
            self.ready.done()
            and not self.ready.cancelled()
            and self.ready.exception() is None
            and not self.protocol.closed.done()
        )

    @property
    def final(self) -> bool:
        return bool(self.status.get("final"))

    def counters(self) -> Counter[str]:
        status = self.status
        counts: Counter[str] = Counter(
            {name: int(status.get(name, 0)) for name in _STATUS_COUNTERS}
        )
        counts["received"] = self.received
        counts["decode_errors"] = self.decode_errors
        counts["dropped_scrape_backlog"] = self.dropped_scrape_backlog
        for i, row in enumerate(status.get("replicas", [])):
            counts[f"replica_requests_total:{i}"] = int(row[1])
            counts[f"replica_ejections:{i}"] = int(row[2])
        for name, errors in status.get("sink_errors", {}).items():
            counts[f"sink_errors:{name}"] = int(errors)
        counts.update(stalls.counters(status.get("stalls")))
        # A status is up to one interval old, and records arrive as they are made: every
        # record received stands for a request, whatever the last status said.
        accounted = _accounted(counts)
        for name in ("requests_total", "records_total"):
            counts[name] = max(counts[name], accounted)
        return counts


@dataclass(eq=False)
class WorkerSlot:
    """Worker ``index`` across its incarnations (restarts)."""

    index: int
    current: WorkerProcess | None = None
    restarts: int = 0
    retired: Counter[str] = field(default_factory=Counter)  # counters of past incarnations
    last_exit: str | None = None

    def totals(self) -> Counter[str]:
        totals: Counter[str] = Counter()
        _merge(totals, self.retired)
        if self.current is not None:
            _merge(totals, self.current.counters())
        return totals


def _merge(totals: Counter[str], counts: Mapping[str, int]) -> None:
    """Add ``counts`` to ``totals``: counters add up (over incarnations, over workers), a
    maximum (the largest stall seen) is the larger of the two."""
    for key, value in counts.items():
        if stalls.is_maximum(key):
            totals[key] = max(totals[key], value)
        else:
            totals[key] += value


def _accounted(counts: Counter[str]) -> int:
    """Records that reached the collector or were counted dropped on the way."""
    return (
        counts["received"]
        + counts["dropped_full"]
        + counts["dropped_closed"]
        + counts["encode_errors"]
        + counts["decode_errors"]
        + counts["dropped_scrape_backlog"]
    )


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


def _url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


class Collector:
    """`sidecar proxy` in worker mode; the same surface as `ProxyServer` for its wiring
    (``url``, ``admin_url``, ``add_admin_routes``, ``on_close``, ``start``, ``close``)."""

    def __init__(
        self,
        config: ProxyConfig,
        fanout: SinkFanout,
        workers: int,
        admin_routes: Sequence[web.RouteDef] = (),
        status_interval_s: float = STATUS_INTERVAL_S,
    ) -> None:
        if workers < 1:
            raise ValueError("a collector needs at least one worker (0 workers: ProxyServer)")
        self.config = config
        self.fanout = fanout
        self.status_interval_s = status_interval_s
        # The collector's view of the replicas: health (its checks, and ejections the
        # workers report) and the engine's own metrics (its scrapes). It routes nothing.
        self.replicas = [Replica(url, i) for i, url in enumerate(config.upstreams)]
        self._session: aiohttp.ClientSession | None = None
        # One capture key for all workers, so that their prefix hashes and pseudonyms agree:
        # the shared key file's, or one drawn here, sent to workers over their channels only.
        self._capture_salt: bytes | None = None
        self.capture_key_id: str | None = None
        if config.capture_dir:
            self._capture_salt = (
                read_capture_key(config.capture_key_file)
                if config.capture_key_file
                else secrets.token_bytes(16)
            )
            self.capture_key_id = PrefixHasher(
                config.capture_block_chars, config.capture_block_tokens, salt=self._capture_salt
            ).key_id
        self.slots = [WorkerSlot(i) for i in range(workers)]
        self._admin_routes: list[web.RouteDef] = list(admin_routes)
        self._close_hooks: list[Callable[[], Awaitable[None]]] = []
        self._admin_runner: web.AppRunner | None = None
        self._reserved: list[socket.socket] = []
        self._addresses: list[Address] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._supervisors: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        self.health_checks = [0] * len(self.replicas)  # GET /health sent, per replica
        self._decode_log = LogThrottle()
        self.url = ""
        self.admin_url = ""

    # -- wiring (as ProxyServer) --------------------------------------------------------------

    def on_close(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Run ``hook`` once every worker exited and every record it sent is in the sinks,
        before the sinks close."""
        self._close_hooks.append(hook)

    def add_admin_routes(self, routes: Sequence[web.RouteDef]) -> None:
        self._admin_routes.extend(routes)

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Reserve the traffic port, serve the admin listener, start the workers and return
        once every one of them listens. Raises StartError (one line) when it cannot."""
        config = self.config
        try:
            self._reserved, self._addresses = reserve_traffic_port(
                config.listen_host, config.listen_port
            )
        except OSError as exc:
            raise ListenError(
                "traffic, --listen", config.listen_host, config.listen_port, exc
            ) from None
        _family, host, port = self._addresses[0]
        self.url = _url(host, port)
        try:
            await self._serve_admin()
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
            started = await asyncio.gather(
                *(self._spawn(slot) for slot in self.slots), return_exceptions=True
            )
            failures = [r for r in started if isinstance(r, BaseException)]
            if failures:
                raise failures[0]
        except BaseException:
            await self.close()
            raise
        self._supervisors = [
            asyncio.create_task(self._supervise(slot), name=f"worker-{slot.index}")
            for slot in self.slots
        ]
        if config.health_interval > 0:
            self._tasks.append(asyncio.create_task(self._health_loop(), name="health-checks"))
        if config.engine_scrape_interval > 0:
            self._tasks.append(asyncio.create_task(self._engine_loop(), name="engine-scrapes"))

    async def _serve_admin(self) -> None:
        runner = web.AppRunner(build_collector_admin_app(self, self._admin_routes), access_log=None)
        await runner.setup()
        self._admin_runner = runner
        host, port = self.config.metrics_host, self.config.metrics_port
        site = web.TCPSite(runner, host, port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            raise ListenError("admin, --metrics-listen", host, port, exc) from None
        server: Any = site._server  # aiohttp keeps the bound socket here; needed for port 0
        bound = server.sockets[0].getsockname()
        self.admin_url = _url(bound[0], bound[1])

    async def close(self) -> None:
        """Stop the workers gracefully, drain their channels, then close everything else."""
        self._stopping.set()
        for slot in self.slots:
            if slot.current is not None:
                slot.current.protocol.send(json_frame(Kind.STOP, {}), now=True)
        if self._supervisors:
            _done, pending = await asyncio.wait(self._supervisors, timeout=STOP_TIMEOUT_S)
            for slot in self.slots:
                worker = slot.current
                if pending and worker is not None and worker.proc.poll() is None:
                    log.warning(
                        "worker %d (pid %d) did not stop in %.0f s: killed",
                        slot.index,
                        worker.pid,
                        STOP_TIMEOUT_S,
                    )
                    worker.proc.kill()
            await asyncio.gather(*self._supervisors, return_exceptions=True)
            self._supervisors = []
        for slot in self.slots:  # workers that never got a supervisor (a failed start)
            if slot.current is not None:
                await self._reap(slot.current, STOP_TIMEOUT_S)
                self._retire(slot, slot.current)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._admin_runner is not None:
            await self._admin_runner.cleanup()
            self._admin_runner = None
        for sock in self._reserved:
            sock.close()
        self._reserved = []
        hooks, self._close_hooks = self._close_hooks, []
        for hook in hooks:
            await hook()
        # The collector holds the sinks (its fan-out): it closes them, once, when nothing can
        # reach them any more. In a thread: closing joins sink threads and exports.
        await asyncio.to_thread(self.fanout.close)
        self._check_accounts()

    def _check_accounts(self) -> None:
        """At exit, say so when a worker's requests and records do not add up."""
        for slot in self.slots:
            t = slot.totals()
            accounted = _accounted(t)
            if t["requests_total"] != accounted + t["lost"]:
                log.warning(
                    "worker %d: %d requests, %d records received, %d counted dropped, "
                    "%d lost with a worker that died",
                    slot.index,
                    t["requests_total"],
                    t["received"],
                    accounted - t["received"],
                    t["lost"],
                )

    # -- workers -------------------------------------------------------------------------------

    async def _spawn(self, slot: WorkerSlot) -> WorkerProcess:
        """Start worker ``slot.index`` and wait until it listens (StartError otherwise)."""
        loop = asyncio.get_running_loop()
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with contextlib.suppress(OSError):
                # The kernel's share of the channel follows the bound too (capped at
                # net.core.wmem_max): what waits for the collector stays near 2 x bound.
                child.setsockopt(
                    socket.SOL_SOCKET, socket.SO_SNDBUF, self.config.channel_buffer_bytes
                )
            # A fresh interpreter (fork+exec in C): never a fork of this running loop.
            proc = subprocess.Popen(
                [sys.executable, "-m", "sidecar.proxy.worker", "--channel-fd", str(child.fileno())],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        worker = WorkerProcess(slot.index, proc, self._on_frame, len(self.replicas))
        try:
            parent.setblocking(False)
            await loop.create_unix_connection(lambda: worker.protocol, sock=parent)
        except BaseException:
            parent.close()
            proc.kill()
            proc.wait()
            raise
        slot.current = worker
        hello = {
            "worker": slot.index,
            "config": config_to_wire(worker_config(self.config, self._addresses[0][2])),
            "addresses": [list(address) for address in self._addresses],
            "status_interval": self.status_interval_s,
            "capture_salt": None if self._capture_salt is None else self._capture_salt.hex(),
            "health": self._health_message([False] * len(self.replicas)),
        }
        worker.protocol.send(json_frame(Kind.CONFIG, hello), now=True)
        try:
            await asyncio.wait_for(asyncio.shield(worker.ready), START_TIMEOUT_S)
        except asyncio.TimeoutError:
            worker.proc.kill()  # its channel closes with it: whoever reaps it does not hang
            raise StartError(
                f"worker {slot.index} (pid {worker.pid}) was not listening after "
                f"{START_TIMEOUT_S:.0f} s"
            ) from None
        return worker

    async def _supervise(self, slot: WorkerSlot) -> None:
        """Wait for the worker to end; unless stopping, start it again, with a backoff."""
        backoff = RESTART_BACKOFF_MIN_S
        while True:
            worker = slot.current
            if worker is not None:
                await self._reap(worker)
                self._retire(slot, worker)
                if self._stopping.is_set():
                    return
                if time.monotonic() - worker.started >= STABLE_AFTER_S:
                    backoff = RESTART_BACKOFF_MIN_S
                log.warning(
                    "worker %d (pid %d) %s; starting it again in %.1f s",
                    slot.index,
                    worker.pid,
                    slot.last_exit,
                    backoff,
                )
            if self._stopping.is_set():
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), backoff)
            if self._stopping.is_set():
                return
            backoff = min(backoff * 2, RESTART_BACKOFF_MAX_S)
            slot.restarts += 1
            try:
                await self._spawn(slot)
            except (StartError, OSError) as exc:  # OSError: no process (fds, memory)
                log.error("worker %d: %s", slot.index, exc)
            else:
                log.info(
                    "worker %d started again (pid %d)",
                    slot.index,
                    slot.current.pid if slot.current else -1,
                )

    async def _reap(self, worker: WorkerProcess, timeout_s: float | None = None) -> None:
        """Until the worker's process is gone: its channel closes first (a process that exits
        closes it), then the process is waited for, so none is left a zombie. With
        ``timeout_s``, a worker whose channel is still open by then is killed."""
        try:
            await asyncio.wait_for(asyncio.shield(worker.protocol.closed), timeout_s)
        except asyncio.TimeoutError:
            log.warning(
                "worker %d (pid %d) did not stop in %.0f s: killed",
                worker.index,
                worker.pid,
                timeout_s,
            )
            worker.proc.kill()
            await asyncio.shield(worker.protocol.closed)
        deadline = time.monotonic() + REAP_TIMEOUT_S
        while worker.proc.poll() is None:
            if time.monotonic() > deadline:
                worker.proc.kill()
                await asyncio.to_thread(worker.proc.wait)
                break
            await asyncio.sleep(0.02)

    def _retire(self, slot: WorkerSlot, worker: WorkerProcess) -> None:
        counts = worker.counters()
        # What its last status counted and never reached us nor was counted dropped: requests
        # in flight when it died (a worker that stopped cleanly sent its final status after
        # its last record, so this is 0 for it). Requests after its last status are unknown.
        counts["lost"] = max(0, int(worker.status.get("requests_total", 0)) - _accounted(counts))
        _merge(slot.retired, counts)
        slot.last_exit = describe_exit(worker.proc.returncode)
        slot.current = None

    # -- the channel ---------------------------------------------------------------------------

    def _on_frame(self, worker: WorkerProcess, kind: int, payload: bytes) -> None:
        if kind == Kind.RECORD:
            try:
                record = decode_record(payload)
            except WireError:
                worker.decode_errors += 1
                if self._decode_log.ready():
                    log.exception(
                        "worker %d sent a record this build cannot read (%d so far)",
                        worker.index,
                        worker.decode_errors,
                    )
                return
            if self.fanout.on_record(record):
                worker.received += 1
            else:
                worker.dropped_scrape_backlog += 1
        elif kind == Kind.STATUS:
            worker.status = parse_json(payload)
            self._note_ejections(worker)
        elif kind == Kind.READY:
            if not worker.ready.done():
                worker.ready.set_result(parse_json(payload))
        elif kind == Kind.ERROR:
            if not worker.ready.done():
                worker.ready.set_exception(StartError(str(parse_json(payload).get("error"))))

    def _note_ejections(self, worker: WorkerProcess) -> None:
        """A replica a worker ejected (connect failures) leaves every worker's rotation, until
        it passes a health check here: as one process shares one view of its replicas."""
        ejected = False
        for i, row in enumerate(worker.status.get("replicas", [])[: len(self.replicas)]):
            count = int(row[2])
            if count > worker.ejections_seen[i]:
                worker.ejections_seen[i] = count
                replica = self.replicas[i]
                if replica.healthy:
                    log.warning(
                        "replica %s ejected by worker %d after connect failures: out "
                        "of rotation until it passes a health check",
                        replica.label,
                        worker.index,
                    )
                replica.healthy = False
                ejected = True
        if ejected:
            self._push_health([False] * len(self.replicas))

    def _health_message(self, passed: Sequence[bool]) -> dict[str, Any]:
        return {"passed": list(passed), "healthy": [r.healthy for r in self.replicas]}

    def _push_health(self, passed: Sequence[bool]) -> None:
        message = json_frame(Kind.HEALTH, self._health_message(passed))
        for slot in self.slots:
            if slot.current is not None:
                slot.current.protocol.send(message, now=True)

    # -- health checks and engine scrapes: once, here ------------------------------------------

    async def _health_loop(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout)
        while True:
            passed = await asyncio.gather(*(self._check(r, timeout) for r in self.replicas))
            self._push_health(passed)
            await asyncio.sleep(self.config.health_interval)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Collector.start() was not awaited")
        return self._session

    async def _check(self, replica: Replica, timeout: aiohttp.ClientTimeout) -> bool:
        """One health check, with the same rules as in one process (probes.py)."""
        self.health_checks[replica.index] += 1
        return await check_health(self.session, replica, timeout, self.config.eject_after)

    async def _engine_loop(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout)
        while True:
            await asyncio.gather(*(self._scrape(r, timeout) for r in self.replicas))
            await asyncio.sleep(self.config.engine_scrape_interval)

    async def _scrape(self, replica: Replica, timeout: aiohttp.ClientTimeout) -> None:
        await scrape_engine(self.session, replica, timeout)

    # -- the one view --------------------------------------------------------------------------

    @property
    def workers_alive(self) -> int:
        return sum(1 for slot in self.slots if slot.current is not None and slot.current.alive)

    @property
    def in_flight(self) -> int:
        return sum(
            int(slot.current.status.get("in_flight", 0))
            for slot in self.slots
            if slot.current is not None
        )

    def _replica_rows(self) -> list[list[Any]]:
        """Per replica: outstanding (alive workers now) and requests / ejections (all time)."""
        rows = [[0, 0, 0] for _ in self.replicas]
        for slot in self.slots:
            totals = slot.totals()
            current = slot.current
            status_rows = current.status.get("replicas", []) if current is not None else []
            for i, row in enumerate(rows):
                row[1] += totals[f"replica_requests_total:{i}"]
                row[2] += totals[f"replica_ejections:{i}"]
                if i < len(status_rows):
                    row[0] += int(status_rows[i][0])
        return rows

    def replica_states(self) -> list[tuple[str, int, bool]]:
        """(label, requests in flight over all workers, healthy) per replica."""
        return [
            (r.label, row[0], r.healthy)
            for r, row in zip(self.replicas, self._replica_rows(), strict=True)
        ]

    def totals(self) -> Counter[str]:
        totals: Counter[str] = Counter()
        for slot in self.slots:
            _merge(totals, slot.totals())
        return totals

    def replicas_view(self) -> dict[str, Any]:
        totals = self.totals()
        sink_errors = dict(self.fanout.errors)
        for key, count in totals.items():
            if key.startswith("sink_errors:"):
                name = key.split(":", 1)[1]
                sink_errors[name] = sink_errors.get(name, 0) + count
        return {
            "route_policy": self.config.route_policy.value,
            "replicas": [
                {
                    "url": r.url,
                    "healthy": r.healthy,
                    "outstanding": row[0],
                    "requests_total": row[1],
                    "ejections": r.ejections + row[2],
                    "consecutive_failures": r.consecutive_failures,
                    "health_checks": self.health_checks[r.index],
                    "engine": r.engine.to_dict(),
                }
                for r, row in zip(self.replicas, self._replica_rows(), strict=True)
            ],
            "engine_totals": merge_views(r.engine for r in self.replicas),
            "requests_total": totals["requests_total"],
            "records_total": totals["records_total"],
            "records_received": totals["received"],
            "sink_errors": sink_errors,
            "rewritten_events": totals["rewritten_events"],
            "upstream_reads_unstamped": totals["upstream_reads_unstamped"],
            "workers": len(self.slots),
            "workers_alive": self.workers_alive,
        }

    def worker_view(self, slot: WorkerSlot) -> dict[str, Any]:
        t = slot.totals()
        current = slot.current
        status = current.status if current is not None else {}
        return {
            "worker": slot.index,
            "pid": current.pid if current is not None else None,
            "alive": current is not None and current.alive,
            "restarts": slot.restarts,
            "last_exit": slot.last_exit,
            "in_flight": int(status.get("in_flight", 0)),
            "requests_total": t["requests_total"],
            "records_total": t["records_total"],
            "records_received": t["received"],
            "dropped": {
                "channel_full": t["dropped_full"],
                "channel_closed": t["dropped_closed"],
                "encode_error": t["encode_errors"],
                "decode_error": t["decode_errors"],
                "scrape_backlog": t["dropped_scrape_backlog"],
            },
            # Requests an incarnation of this worker counted that ended in no record and no
            # counted drop: in flight when it died.
            "lost": t["lost"],
            "buffered_bytes": int(status.get("buffered_bytes", 0)),
            "rewritten_events": t["rewritten_events"],
            "upstream_reads_unstamped": t["upstream_reads_unstamped"],
            # All incarnations, each as of its last status (every status interval).
            "cpu_seconds": {
                "user": t["cpu_user_us"] / 1e6,
                "system": t["cpu_system_us"] / 1e6,
            },
            "context_switches": {
                "voluntary": t["context_switches_voluntary"],
                "involuntary": t["context_switches_involuntary"],
            },
            "replicas": [
                {
                    "url": r.url,
                    "outstanding": int(row[0]),
                    "requests_total": int(row[1]),
                    "ejections": int(row[2]),
                    "consecutive_failures": int(row[3]),
                    "healthy": bool(row[4]),
                }
                for r, row in zip(self.replicas, status.get("replicas", []), strict=False)
            ],
            # Loop lag and GC pauses, all incarnations: how late this worker's stamps may be.
            "stalls": stalls.summary(stalls.from_counters(t)),
        }

    def worker_states(self) -> list[dict[str, Any]]:
        """Per worker, the figures of its Prometheus metrics (sinks.prometheus.WorkerState)."""
        states = []
        for slot in self.slots:
            t = slot.totals()
            states.append(
                {
                    "worker": str(slot.index),
                    "alive": slot.current is not None and slot.current.alive,
                    "restarts": slot.restarts,
                    "records_received": t["received"],
                    "dropped_channel_full": t["dropped_full"],
                    "dropped_channel_closed": t["dropped_closed"],
                    "encode_errors": t["encode_errors"],
                    "decode_errors": t["decode_errors"],
                    "dropped_scrape_backlog": t["dropped_scrape_backlog"],
                    "lost": t["lost"],
                    "cpu_user_seconds": t["cpu_user_us"] / 1e6,
                    "cpu_system_seconds": t["cpu_system_us"] / 1e6,
                    "context_switches_voluntary": t["context_switches_voluntary"],
                    "context_switches_involuntary": t["context_switches_involuntary"],
                    "stalls": stalls.from_counters(t),
                }
            )
        return states

    def workers_view(self) -> dict[str, Any]:
        workers = [self.worker_view(slot) for slot in self.slots]
        return {
            "workers": workers,
            "configured": len(self.slots),
            "alive": self.workers_alive,
            "restarts": sum(slot.restarts for slot in self.slots),
            "channel_buffer_bytes": self.config.channel_buffer_bytes,
            "status_interval_s": self.status_interval_s,
            # Over all workers: sums, and the largest stall any of them saw.
            "stalls": stalls.summary(stalls.from_counters(self.totals())),
        }


def build_collector_admin_app(
    collector: Collector, extra_routes: Sequence[web.RouteDef] = ()
) -> web.Application:
    """The admin listener of worker mode: /healthz, /replicas, /workers, plus what the wiring
    adds (/stats, /metrics), behind the same bearer-token check as in one process."""

    async def healthz(_request: web.Request) -> web.Response:
        alive = collector.workers_alive
        return web.json_response(
            {
                "status": "ok" if alive else "no_workers",
                "in_flight": collector.in_flight,
                "workers_alive": alive,
                "workers": len(collector.slots),
            },
            status=200 if alive else 503,
        )

    async def readyz(_request: web.Request) -> web.Response:
        return readiness(
            [r.healthy for r in collector.replicas], workers_alive=bool(collector.workers_alive)
        )

    async def replicas(_request: web.Request) -> web.Response:
        return web.json_response(collector.replicas_view())

    async def workers(_request: web.Request) -> web.Response:
        return web.json_response(collector.workers_view())

    app = web.Application(middlewares=[admin_auth(collector.config.admin_token)])
    app.on_response_prepare.append(plain_server_header)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/replicas", replicas)
    app.router.add_get("/workers", workers)
    app.add_routes(list(extra_routes))
    return app
