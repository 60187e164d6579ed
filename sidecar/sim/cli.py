"""``sidecar sim``: serve N simulated vLLM replicas, one process each.

Every `EngineConfig` field is a flag, generated from the dataclass so the two never drift apart
(``--step-floor-s``, ``--max-num-seqs``, ``--enable-prefix-caching/--no-enable-prefix-caching``...).

Processes: with ``--replicas N`` (N > 1) this process binds the N listening sockets (so a port
in use or a bad ``--ground-truth`` path is reported here, as with one replica) and starts one
child process per replica, handing it its socket and its configuration; each child serves
one replica on an event loop of its own, so that a large request on one replica (tens of ms
of parsing and tokenizing) never holds up another replica's streams or its ground-truth
stamps. This process forwards SIGINT/SIGTERM to the children and stops them all when one
exits; a child whose parent is gone (its stdin closes) stops too. ``--one-process`` serves all
replicas on this process's loop instead (less memory; replicas then share one core).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import pickle
import signal
import socket
import struct
import sys
from collections.abc import Awaitable, Coroutine
from pathlib import Path
from typing import Any

# What the parser needs, without aiohttp: the server (sidecar.sim.server, groundtruth) is
# imported by the functions that serve (start-up time of `sidecar --help`).
from sidecar.sim.config import VLLM_VERSION, SimConfig
from sidecar.sim.engine import EngineConfig
from sidecar.sim.faults import FAULT_HEADER, FaultSpecError, parse_fault_spec
from sidecar.sim.shapes import Profile

# The GIL switch interval of a process serving replicas: a thread tokenizing a long prompt
# gives the event loop's thread the GIL back within this (the default is 5 ms).
SWITCH_INTERVAL_S = 0.001
# How long a child may take to stop after SIGTERM before it is killed.
CHILD_STOP_GRACE_S = 10.0

DESCRIPTION = """\
Serve simulated vLLM replicas (no GPU, no model) that speak vLLM 0.33's OpenAI-compatible
protocol byte for byte: /v1/chat/completions and /v1/completions (streaming and not),
/v1/models, /tokenize, /detokenize, /health, /ping, /version, /load and a vLLM-named /metrics.
Token timing comes from a continuous-batching engine model (step time, batch limits, KV cache,
prefix cache, chunked prefill, speculative decoding), all seeded and reproducible.

Replica i listens on PORT+i (PORT 0: ephemeral ports), each in a process of its own (see
--one-process). When all are ready, one line per replica is printed to stdout:
"replica I listening on http://HOST:PORT". SIGINT/SIGTERM stop them.
"""

EPILOG = f"""\
examples:
  sidecar sim --replicas 2 --port 8100 --model demo-model
      two replicas on 127.0.0.1:8100 and :8101

  sidecar sim --port 0 --model m --step-floor-s 0.02 --sse-keep-alive-interval 1
      one slow replica (20 ms steps) on an ephemeral port, sending keep-alive comments

  sidecar sim --model m --ground-truth truth.jsonl --fault-rate 0.1 --fault 'reset_after=3'
      write what every socket really received to truth.jsonl; reset 10% of the streams

faults (per request with the header "{FAULT_HEADER}: SPEC", or for a share of all requests with
--fault SPEC --fault-rate P); SPEC is "name=value" items separated by ';':
  error_status=CODE       answer HTTP CODE with a vLLM error body
  error_event_after=K     mid-stream error event + [DONE] before token chunk K+1
  reset_after=K           abort the TCP connection before token chunk K+1
  close_after=K           end the body without [DONE] before token chunk K+1
  stall_ms=MS[@after=K]   write nothing for MS ms before token chunk K+1 (default K=0)
  malformed_after=K       one event with cut-off JSON before token chunk K+1, then go on
  slow_headers_ms=MS      send the response headers MS ms late
  split_end_ms=MS         write a stream's end (last token, usage, [DONE], body end) MS ms apart
"""

_ENGINE_HELP: dict[str, str] = {
    "max_num_seqs": "most requests in one batch",
    "max_num_batched_tokens": "token budget of one engine step",
    "max_model_len": "context length (prompt + output tokens)",
    "block_size": "KV cache block size, in tokens",
    "num_gpu_blocks": "KV cache size, in blocks",
    "enable_prefix_caching": "reuse cached KV blocks of identical prompt prefixes",
    "enable_chunked_prefill": "split long prompts over several steps",
    "step_floor_s": "step time of a memory-bound step (seconds)",
    "saturation_tokens": "tokens per step above which steps get slower",
    "per_token_s": "extra step time per token above saturation (seconds)",
    "stream_interval": "tokens per streamed delta (vLLM --stream-interval)",
    "num_speculative_tokens": "speculative draft tokens per decode step",
    "spec_acceptance": "probability that each draft token is accepted",
    "seed": "engine seed (replica i uses seed + i)",
    "natural_length_median": "median of the seeded output length (tokens)",
    "natural_length_sigma": "log-space sigma of the seeded output length",
    "vocab_size": "vocabulary size of the pseudo tokens",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine model")
    for engine_field in dataclasses.fields(EngineConfig):
        default = engine_field.default
        help_text = _ENGINE_HELP.get(engine_field.name, "engine knob")
        if isinstance(default, bool):
            group.add_argument(
                _flag(engine_field.name),
                dest=f"engine_{engine_field.name}",
                action=argparse.BooleanOptionalAction,
                default=default,
                help=f"{help_text} (default: %(default)s)",
            )
        else:
            group.add_argument(
                _flag(engine_field.name),
                dest=f"engine_{engine_field.name}",
                type=type(default),
                default=default,
                metavar=engine_field.name.upper(),
                help=f"{help_text} (default: %(default)s)",
            )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serving = parser.add_argument_group("serving")
    serving.add_argument("--replicas", type=int, default=1, help="replicas to serve (default: 1)")
    serving.add_argument(
        "--one-process",
        action="store_true",
        help="serve all replicas from this process, on one event loop (less memory, but a "
        "large request on one replica then delays the others); default: one process each",
    )
    serving.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s)"
    )
    serving.add_argument(
        "--port", type=int, default=8100, help="port of replica 0; 0 = ephemeral (default: 8100)"
    )
    serving.add_argument("--model", default="sim-model", help="model name (default: %(default)s)")
    serving.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="names the model answers to (default: --model)",
    )
    serving.add_argument(
        "--profile",
        choices=[profile.value for profile in Profile],
        default=Profile.VLLM.value,
        help="response shapes: vllm (0.33, default) or minimal (older vLLM keys)",
    )
    serving.add_argument(
        "--vllm-version", default=VLLM_VERSION, help="version for /version and fingerprints"
    )
    serving.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1"
    )
    serving.add_argument(
        "--response-role", default="assistant", help="role of chat answers (default: %(default)s)"
    )
    serving.add_argument(
        "--sse-keep-alive-interval",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="send ': keep-alive' comments after this much silence; 0 = off (default)",
    )
    serving.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="every stream carries include_usage and continuous_usage_stats",
    )
    serving.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage gains prompt_tokens_details.cached_tokens",
    )
    serving.add_argument(
        "--enable-per-request-metrics",
        action="store_true",
        help="the final usage (n=1) carries vLLM's per-request timing metrics",
    )
    serving.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="answer with an X-Request-Id header",
    )
    serving.add_argument(
        "--enable-server-load-tracking",
        action="store_true",
        help="GET /load reports requests in flight",
    )
    serving.add_argument(
        "--max-num-queued-reqs",
        type=int,
        default=None,
        help="503 new requests while this many are waiting (default: no limit)",
    )
    serving.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help='vLLM\'s tool parser flag; with --enable-auto-tool-choice, named and "required" '
        "tool_choice answer with tool calls in vLLM's shapes (else refused, as by vLLM)",
    )
    serving.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="serve tool calls (needs --tool-call-parser, as vLLM does)",
    )
    serving.add_argument(
        "--legacy-metric-names",
        action="store_true",
        help="use vLLM 0.10's metric names (gpu_cache_usage_perc, time_per_output_token...)",
    )
    serving.add_argument(
        "--ground-truth",
        default=None,
        metavar="FILE",
        help="append one JSON line per finished request: every write's time and tokens",
    )
    serving.add_argument(
        "--fault", default=None, metavar="SPEC", help="fault injected into --fault-rate of requests"
    )
    serving.add_argument(
        "--fault-rate",
        type=float,
        default=None,
        metavar="P",
        help="share of requests (without the header) that get --fault (default: 1 with --fault)",
    )
    serving.add_argument("--fault-seed", type=int, default=0, help="seed of the fault draws")
    serving.add_argument(
        "--log-level", default="WARNING", help="logging level on stderr (default: %(default)s)"
    )
    _add_engine_arguments(parser)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """Build the SimConfig the flags describe (ValueError on an inconsistent combination)."""
    engine_values = {
        engine_field.name: getattr(args, f"engine_{engine_field.name}")
        for engine_field in dataclasses.fields(EngineConfig)
    }
    engine = EngineConfig(**engine_values)
    fault_spec = parse_fault_spec(args.fault) if args.fault else parse_fault_spec("")
    fault_rate = args.fault_rate
    if fault_rate is None:
        fault_rate = 1.0 if args.fault else 0.0
    if args.max_num_queued_reqs is not None and args.max_num_queued_reqs < 0:
        raise ValueError("--max-num-queued-reqs must be >= 0")
    if args.sse_keep_alive_interval < 0:
        raise ValueError("--sse-keep-alive-interval must be >= 0")
    return SimConfig(
        model=args.model,
        served_model_names=tuple(args.served_model_name or ()),
        engine=engine,
        profile=Profile(args.profile),
        vllm_version=args.vllm_version,
        api_key=args.api_key,
        response_role=args.response_role,
        sse_keep_alive_interval=args.sse_keep_alive_interval,
        enable_force_include_usage=args.enable_force_include_usage,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_per_request_metrics=args.enable_per_request_metrics,
        enable_request_id_headers=args.enable_request_id_headers,
        enable_server_load_tracking=args.enable_server_load_tracking,
        max_num_queued_reqs=args.max_num_queued_reqs,
        legacy_metric_names=args.legacy_metric_names,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        ground_truth_path=args.ground_truth,
        fault=fault_spec,
        fault_rate=fault_rate,
        fault_seed=args.fault_seed,
    )


async def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    try:
        config = config_from_args(args)
    except (ValueError, FaultSpecError) as exc:
        print(f"sidecar sim: error: {exc}", file=sys.stderr)
        return 2
    if args.replicas < 1:
        print("sidecar sim: error: --replicas must be >= 1", file=sys.stderr)
        return 2
    if args.replicas > 1 and not args.one_process:
        return await _run_processes(config, args)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    from sidecar.sim.server import close_replicas, start_replicas  # start-up time of the CLI

    try:
        replicas = await start_replicas(config, args.replicas, args.host, args.port)
    except OSError as exc:
        return _start_error(exc, args)
    try:
        for running in replicas:
            print(f"replica {running.index} listening on {running.url}", flush=True)
        await _until_signalled()
    finally:
        await close_replicas(replicas)
    return 0


def _start_error(exc: OSError, args: argparse.Namespace) -> int:
    """One line naming the address(es) or file and the cause; exit 2 like every input error."""
    if exc.filename:  # --ground-truth FILE
        print(f"sidecar sim: error: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    ports = (
        f"{args.port}"
        if args.replicas == 1 or args.port == 0
        else f"{args.port}-{args.port + args.replicas - 1}"
    )
    print(
        f"sidecar sim: error: cannot listen on {args.host}:{ports}: {exc.strerror or exc}",
        file=sys.stderr,
    )
    return 2


async def _until_signalled(*others: Awaitable[Any]) -> bool:
    """Wait for SIGINT/SIGTERM (True), or for the first of ``others`` to finish (False)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for signum in signals:
        loop.add_signal_handler(signum, stop.set)
    signalled = asyncio.ensure_future(stop.wait())
    waits = [signalled, *(asyncio.ensure_future(other) for other in others)]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)
        for wait in waits:
            wait.cancel()
    return stop.is_set()


# ---------------------------------------------------------------- one process per replica

# What a child runs: the directory holding this `sidecar` package first on its path (so the
# child imports the same code as this process, however it was started), then serve_child().
_CHILD_CODE = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from sidecar.sim.cli import serve_child; sys.exit(serve_child())"
)
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
_LENGTH = struct.Struct("!Q")


async def _run_processes(config: SimConfig, args: argparse.Namespace) -> int:
    # Here, not at import: start-up time of the CLI (aiohttp).
    from sidecar.sim.groundtruth import GroundTruthWriter
    from sidecar.sim.server import bind

    sockets: list[socket.socket] = []
    try:
        for index in range(args.replicas):
            sockets.append(bind(args.host, 0 if args.port == 0 else args.port + index))
        if config.ground_truth_path:
            GroundTruthWriter(config.ground_truth_path).close()  # a bad path fails here
    except OSError as exc:
        for sock in sockets:
            sock.close()
        return _start_error(exc, args)
    host = f"[{args.host}]" if ":" in args.host else args.host
    urls = [f"http://{host}:{sock.getsockname()[1]}" for sock in sockets]
    children: list[asyncio.subprocess.Process] = []
    try:
        for index, sock in enumerate(sockets):
            children.append(await _start_child(config, index, args.host, sock, args.log_level))
        for sock in sockets:
            sock.close()  # each child holds its own copy
        for index, child in enumerate(children):
            assert child.stdout is not None
            if (await child.stdout.readline()).strip() != b"ready":
                print(f"sidecar sim: error: replica {index} did not start", file=sys.stderr)
                return 1
        for index, url in enumerate(urls):
            print(f"replica {index} listening on {url}", flush=True)
        if await _until_signalled(*(child.wait() for child in children)):
            return 0
        for index, child in enumerate(children):
            if child.returncode is not None:
                print(
                    f"sidecar sim: error: replica {index} exited with status {child.returncode}",
                    file=sys.stderr,
                )
        return 1
    finally:
        for sock in sockets:
            sock.close()
        await _stop_children(children)


async def _start_child(
    config: SimConfig, index: int, host: str, sock: socket.socket, log_level: str
) -> asyncio.subprocess.Process:
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _CHILD_CODE,
        _PACKAGE_ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        pass_fds=(sock.fileno(),),
    )
    payload = pickle.dumps(
        {
            "config": config,
            "index": index,
            "host": host,
            "fd": sock.fileno(),
            "log_level": log_level,
        }
    )
    assert child.stdin is not None
    # The stdin pipe stays open: the child stops when it closes (this process is gone).
    child.stdin.write(_LENGTH.pack(len(payload)) + payload)
    await child.stdin.drain()
    return child


async def _stop_children(children: list[asyncio.subprocess.Process]) -> None:
    for child in children:
        if child.returncode is None:
            child.send_signal(signal.SIGTERM)
    for child in children:
        try:
            await asyncio.wait_for(child.wait(), CHILD_STOP_GRACE_S)
        except asyncio.TimeoutError:
            child.kill()
            await child.wait()


def _read_exactly(fd: int, size: int) -> bytes:
    data = b""
    while len(data) < size:
        piece = os.read(fd, size - len(data))
        if not piece:
            raise EOFError("the parent closed the pipe before the configuration was read")
        data += piece
    return data


def serve_child() -> int:
    """A child's entry point: read its configuration from stdin, serve its replica."""
    size = _LENGTH.unpack(_read_exactly(0, _LENGTH.size))[0]
    payload = pickle.loads(_read_exactly(0, size))  # from our own parent only
    logging.basicConfig(level=payload["log_level"].upper(), stream=sys.stderr)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # Ctrl-C reaches the whole process group: the parent alone decides, and sends SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return _run_loop(_serve_child(payload))


def _run_loop(main: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - Windows, or a stripped install
        return asyncio.run(main)
    return uvloop.run(main)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _StdinClosed(asyncio.Protocol):
    def __init__(self, closed: asyncio.Future[None]) -> None:
        self._closed = closed

    def connection_lost(self, exc: Exception | None) -> None:
        _settle(self._closed)


async def _serve_child(payload: dict[str, Any]) -> int:
    # Here, not at import: start-up time of the CLI (aiohttp).
    from sidecar.sim.groundtruth import GroundTruthWriter
    from sidecar.sim.server import start_replica

    config: SimConfig = payload["config"]
    sock = socket.socket(fileno=payload["fd"])
    ground_truth = GroundTruthWriter(config.ground_truth_path) if config.ground_truth_path else None
    running = await start_replica(
        config, payload["index"], payload["host"], 0, ground_truth, sock=sock
    )
    loop = asyncio.get_running_loop()
    stop: asyncio.Future[None] = loop.create_future()
    # SIGTERM (from the parent) or the parent gone: close, still answering SIGTERM meanwhile
    # (a handler stays installed, so a second one cannot cut the shutdown short).
    loop.add_signal_handler(signal.SIGTERM, _settle, stop)
    await loop.connect_read_pipe(lambda: _StdinClosed(stop), sys.stdin)
    try:
        print("ready", flush=True)
        await stop
    finally:
        await running.close()
    return 0
