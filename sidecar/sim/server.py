"""Simulated vLLM replicas: `SimReplica` assembles one, `start_replicas` serves them.

`start_replicas` serves them all on the caller's event loop; ``sidecar sim --replicas N`` runs
one process per replica (`sidecar.sim.cli`), so that no replica's work can hold up another's.

A replica speaks vLLM 0.33's OpenAI-compatible protocol (spec/vllm-protocol.md) with the timing
of the engine model: headers go out at admission, each engine step's outputs become visible at
the step's end instant, and chunks carry as many tokens as the engine made visible. Its parts,
each in its own module:

- `sidecar.sim.config`: `SimConfig`, the flags of ``sidecar sim``, and their validation;
- `sidecar.sim.handlers`: the aiohttp routes, from a request's bytes to its answer;
- `sidecar.sim.planning`: vLLM's checks of a generation request, and its tokenization (a large
  prompt's on the replica's tokenizer thread);
- `sidecar.sim.driver`: the task that steps the engine model (`sidecar.sim.engine`) in time
  and delivers its outputs to the waiting requests;
- `sidecar.sim.answers`: the streamed and whole answers, over the byte-exact shapes of
  `sidecar.sim.shapes` and the tool calls of `sidecar.sim.tools`;
- `sidecar.sim.faults`: fault injection per request or per share of requests;
- `sidecar.sim.groundtruth`: what each socket was really sent, and when; a request's
  ``received`` stamp is taken when its last bytes reach the replica (`ArrivalStamp`), before
  the handler runs, so it excludes the parse and tokenization of this and of every other
  request;
- `sidecar.sim.metrics`: per-replica Prometheus metrics with vLLM's names.

A replica does at start what a first request would otherwise pay for (`SimReplica.warm_up`).

Programmatic use::

    replicas = await start_replicas(SimConfig(model="m"), n=2, host="127.0.0.1", port=0)
    ...  # replicas[0].url == "http://127.0.0.1:<port>"
    for replica in replicas:
        await replica.close()
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
import uuid
from collections.abc import Sequence

from aiohttp import web

from sidecar.sim import tokenizer
from sidecar.sim.answers import AnswerWriter
from sidecar.sim.config import VLLM_VERSION, SimConfig, cache_config_info, system_fingerprint
from sidecar.sim.driver import EngineDriver
from sidecar.sim.engine import EngineModel
from sidecar.sim.groundtruth import ArrivalStamp, GroundTruthWriter
from sidecar.sim.handlers import Handlers
from sidecar.sim.metrics import ReplicaMetrics
from sidecar.sim.planning import Planner
from sidecar.sim.shapes import Era

__all__ = [
    "VLLM_VERSION",
    "RunningReplica",
    "SimConfig",
    "SimReplica",
    "bind",
    "close_replicas",
    "start_replica",
    "start_replicas",
    "system_fingerprint",
]


class SimReplica:
    """One simulated vLLM server: its engine model and driver, metrics, and aiohttp app."""

    def __init__(
        self,
        config: SimConfig,
        index: int = 0,
        *,
        ground_truth: GroundTruthWriter | None = None,
    ) -> None:
        self.config = config
        self.index = index
        self.engine_config = dataclasses.replace(config.engine, seed=config.engine.seed + index)
        self.engine = EngineModel(self.engine_config)
        self.model_names = config.model_names
        self.fingerprint = system_fingerprint(config)
        # Which vLLM's shapes to speak (0.32 or 0.33: shapes.Era); a bad --vllm-version fails here.
        self.era = Era.of(config.vllm_version)
        self.created = int(time.time())
        self.metrics = ReplicaMetrics(
            model_name=self.model_names[0],
            engine_index=0,
            max_model_len=self.engine_config.max_model_len,
            stats_source=self.engine.stats,
            cache_info=cache_config_info(self.engine_config),
            legacy_names=config.legacy_metric_names,
            tool_parser=config.tool_call_parser is not None,
        )
        self.driver = EngineDriver(
            self.engine,
            self.engine_config,
            self.metrics,
            index,
            max_num_queued_reqs=config.max_num_queued_reqs,
            serves_tools=config.serves_tools,
        )
        self.planner = Planner(config, self.engine_config, self.era, index)
        self.answers = AnswerWriter(
            config, self.engine_config, self.era, self.fingerprint, self.driver, self.metrics
        )
        self.handlers = Handlers(
            config,
            index,
            max_model_len=self.engine_config.max_model_len,
            created=self.created,
            permission_id=f"modelperm-{uuid.uuid4().hex}",
            metrics=self.metrics,
            driver=self.driver,
            planner=self.planner,
            answers=self.answers,
            ground_truth=ground_truth,
        )
        self.app = self.handlers.build_app()

    @property
    def dead(self) -> bool:
        """The engine loop died: /health answers 503, new requests 500."""
        return self.driver.dead

    @property
    def in_flight(self) -> int:
        """Generation requests being answered now (what /load reports, with the flag)."""
        return self.handlers.in_flight

    def start_engine(self) -> None:
        self.driver.start()

    def begin_shutdown(self) -> None:
        """From now on, requests cut short are recorded as "shutdown", not client disconnects."""
        self.driver.closing = True

    async def stop_engine(self) -> None:
        await self.driver.stop()
        self.planner.shutdown()

    async def warm_up(self) -> None:
        """Run once, with nothing recorded, what a first request would pay for on its own.

        The tokenizer's tables, the JSON reading and validation of both endpoints, the chunk and
        body rendering, the metrics page and the tokenizer thread. No engine request, metric or
        ground-truth line comes of it.
        """
        tokenizer.warm()
        self.planner.warm_up()
        self.answers.warm_up(self.created)
        self.metrics.render()
        uuid.uuid4()
        await self.planner.warm_up_thread()


class RunningReplica:
    """A replica serving on a socket: ``url``, ``port``, and ``close()``."""

    def __init__(
        self,
        replica: SimReplica,
        runner: web.AppRunner,
        server: asyncio.AbstractServer,
        host: str,
        port: int,
        ground_truth: GroundTruthWriter | None,
    ) -> None:
        self.replica = replica
        self.runner = runner
        self.server = server
        self.host = host
        self.port = port
        self._ground_truth = ground_truth
        self._closed = False

    @property
    def index(self) -> int:
        return self.replica.index

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.replica.begin_shutdown()
        self.server.close()  # no new connections
        # In-flight requests get shutdown_timeout_s to finish while the engine still runs.
        await self.runner.cleanup()
        await self.replica.stop_engine()
        if self._ground_truth is not None:
            self._ground_truth.release()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def bind(host: str, port: int) -> socket.socket:
    """A listening, non-blocking socket on ``host:port`` (0: an ephemeral port)."""
    return _bind(host, port)


async def start_replica(
    config: SimConfig,
    index: int,
    host: str,
    port: int,
    ground_truth: GroundTruthWriter | None = None,
    sock: socket.socket | None = None,
) -> RunningReplica:
    """Serve one replica on ``host:port`` (0: an ephemeral port), or on ``sock`` (a listening
    socket, e.g. bound by a parent process), and start its engine loop."""
    if sock is None:
        sock = _bind(host, port)
    else:
        sock.setblocking(False)
    replica = SimReplica(config, index, ground_truth=ground_truth)
    runner = web.AppRunner(
        replica.app,
        handle_signals=False,
        access_log=None,
        handler_cancellation=True,
        shutdown_timeout=config.shutdown_timeout_s,
    )
    try:
        await replica.warm_up()
        await runner.setup()
        make_protocol = runner.server
        assert make_protocol is not None
        # Not a web.SockSite: each connection's protocol is wrapped to stamp arrivals.
        server = await asyncio.get_running_loop().create_server(
            lambda: ArrivalStamp(make_protocol()), sock=sock, backlog=1024
        )
    except BaseException:
        await runner.cleanup()
        await replica.stop_engine()
        sock.close()
        raise
    replica.start_engine()
    if ground_truth is not None:
        ground_truth.acquire()
    return RunningReplica(replica, runner, server, host, sock.getsockname()[1], ground_truth)


async def start_replicas(
    config: SimConfig, n: int, host: str = "127.0.0.1", port: int = 0
) -> list[RunningReplica]:
    """Serve ``n`` replicas on ports ``port .. port+n-1`` (all ephemeral when ``port`` is 0).

    All replicas share the process's event loop and, if configured, one ground-truth file.
    """
    if n < 1:
        raise ValueError(f"need at least one replica, got {n}")
    ground_truth = GroundTruthWriter(config.ground_truth_path) if config.ground_truth_path else None
    started: list[RunningReplica] = []
    try:
        for index in range(n):
            replica_port = 0 if port == 0 else port + index
            started.append(await start_replica(config, index, host, replica_port, ground_truth))
    except BaseException:
        for running in started:
            await running.close()
        if ground_truth is not None:
            ground_truth.close()
        raise
    return started


async def close_replicas(replicas: Sequence[RunningReplica]) -> None:
    for running in replicas:
        await running.close()
