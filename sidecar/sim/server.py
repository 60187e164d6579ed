"""Simulated vLLM replicas: one aiohttp app and one `EngineModel` each.

`start_replicas` serves them all on the caller's event loop; ``sidecar sim --replicas N`` runs
one process per replica (`sidecar.sim.cli`), so that no replica's work can hold up another's.

A replica speaks vLLM 0.33's OpenAI-compatible protocol (spec/vllm-protocol.md) with the timing
of the engine model: headers go out at admission, each engine step's outputs become visible at
the step's end instant, and chunks carry as many tokens as the engine made visible.

Engine driving: one task per replica runs the loop "plan a step at ``start`` -> sleep until
``start + duration`` -> deliver its outputs". Steps are scheduled against absolute deadlines on
``time.perf_counter()``: a step that starts while the previous one just ended begins at the
previous deadline, not at the (slightly later) wake-up, so timer slack does not accumulate into
drift; only a lag above `MAX_SCHEDULE_LAG_S` (an overloaded process) resets the schedule to now.
Outputs are handed to the request's handler through a list and a future (no queue object per
request); a handler that lags gets several outputs merged into one chunk, as vLLM's
``RequestOutputCollector`` merges deltas for a slow consumer.

Ground truth stays exact under large prompts: a request's ``received`` stamp is taken when its
last bytes reach the replica (in the protocol's ``data_received``, before the handler runs, so
it excludes the parse and tokenization of this and of every other request), and prompts of
more than `OFFLOAD_BODY_BYTES` are tokenized on the replica's tokenizer thread (as vLLM
tokenizes off its event loop), in slices that let the loop's thread take the GIL in between,
so that a 370 KB prompt does not stall the replica's other streams for the ~20 ms it takes.
A replica does at start what a first request would otherwise pay for (`SimReplica.warm_up`).

Around that core: request validation and vLLM's error shapes (`sidecar.sim.requests`), the
byte-exact chunk and body shapes (`sidecar.sim.shapes`), the toy tokenizer, per-replica
Prometheus metrics with vLLM's names (`sidecar.sim.metrics`), fault injection per request or
per share of requests (`sidecar.sim.faults`) and the ground-truth file of what each socket was
really sent, and when (`sidecar.sim.groundtruth`).

Programmatic use::

    replicas = await start_replicas(SimConfig(model="m"), n=2, host="127.0.0.1", port=0)
    ...  # replicas[0].url == "http://127.0.0.1:<port>"
    for replica in replicas:
        await replica.close()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import http
import logging
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from sidecar.sim import tokenizer
from sidecar.sim.engine import EngineConfig, EngineModel, EngineRequest, StepResult
from sidecar.sim.faults import FAULT_HEADER, NO_FAULT, FaultPlan, FaultSpec, FaultSpecError
from sidecar.sim.groundtruth import GroundTruthRecord, GroundTruthWriter
from sidecar.sim.metrics import METRICS_CONTENT_TYPE, ReplicaMetrics
from sidecar.sim.requests import (
    BAD_REQUEST_ERROR,
    GREEDY_EPS,
    MAX_LOGPROBS,
    FieldReader,
    GenerateParams,
    RequestError,
    bad_request,
    parse_json_object,
    read_generate_params,
    read_messages,
    read_token_ids,
)
from sidecar.sim.sampling import LogprobSource, Position, StopChecker, sampling_seed
from sidecar.sim.shapes import (
    DONE_EVENT,
    KEEPALIVE_EVENT,
    ChoiceResult,
    Era,
    Profile,
    RequestTimings,
    StreamFormatter,
    chat_completion_body,
    chat_logprobs,
    compact_json,
    completion_body,
    completion_logprobs,
    error_body,
    models_body,
    prompt_logprobs_json,
)
from sidecar.sim.tools import ToolCallOutput, tool_refusal

log = logging.getLogger(__name__)

VLLM_VERSION = "0.33.0"
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
# vLLM's message for a dead engine (500) and for a generation that failed mid-way.
ENGINE_DEAD_MESSAGE = "The server had an error while processing your request."
GENERATION_ERROR_MESSAGE = "Internal server error"
# Beyond this lag behind the step schedule, start the next step "now" instead of at the previous
# deadline (the process was starved; catching up step by step would only burst the outputs).
MAX_SCHEDULE_LAG_S = 0.05
JSON_CONTENT_TYPE = "application/json"
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
# Bodies above this size are tokenized on the replica's tokenizer thread (below it the thread
# hop costs more than the ~1 ms of tokenizing on the loop), in slices of TOKENIZE_SLICE_CHARS
# characters (~0.5 ms each) with the GIL released in between.
OFFLOAD_BODY_BYTES = 16 * 1024
TOKENIZE_SLICE_CHARS = 8192

# Error `type` for an injected error status: vLLM's names where it has one, else the phrase.
_ERROR_TYPES = {
    400: BAD_REQUEST_ERROR,
    404: "NotFoundError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "Service Unavailable",
}


@dataclass(frozen=True)
class SimConfig:
    """Everything one simulated replica needs (the CLI flags of ``sidecar sim``)."""

    model: str = "sim-model"
    served_model_names: tuple[str, ...] = ()  # default: (model,)
    engine: EngineConfig = field(default_factory=EngineConfig)
    profile: Profile = Profile.VLLM
    vllm_version: str = VLLM_VERSION
    api_key: str | None = None
    response_role: str = "assistant"
    sse_keep_alive_interval: float = 0.0
    enable_force_include_usage: bool = False
    enable_prompt_tokens_details: bool = False
    enable_per_request_metrics: bool = False
    enable_request_id_headers: bool = False
    enable_server_load_tracking: bool = False
    max_num_queued_reqs: int | None = None
    legacy_metric_names: bool = False
    # vLLM's --tool-call-parser and --enable-auto-tool-choice: tool calls are served only with
    # both (sidecar.sim.tools); otherwise every tool_choice but "none" is refused, as by vLLM.
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    ground_truth_path: str | None = None
    fault: FaultSpec = NO_FAULT
    fault_rate: float = 0.0
    fault_seed: int = 0
    # How long close() lets in-flight requests finish before cancelling them.
    shutdown_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        # Accept the profile's plain name ("minimal") as well as the enum member.
        object.__setattr__(self, "profile", Profile(self.profile))
        Era.of(self.vllm_version)  # a version the shapes know, or ValueError now
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            # vLLM refuses to start so (vllm/entrypoints/launchers/cli_args.py 523-524).
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")

    @property
    def serves_tools(self) -> bool:
        """vLLM has a tool parser only with both flags (ParserManager.get_tool_parser)."""
        return self.enable_auto_tool_choice and bool(self.tool_call_parser)

    @property
    def model_names(self) -> tuple[str, ...]:
        return self.served_model_names or (self.model,)


def system_fingerprint(config: SimConfig) -> str:
    """``vllm-<version>-<hash8>``: stable for one configuration, like vLLM's."""
    digest = hashlib.sha256(f"{config.model}|{config.engine!r}".encode()).hexdigest()
    return f"vllm-{config.vllm_version}-{digest[:8]}"


class _Choice:
    """One engine request: one choice of one prompt of an HTTP request."""

    __slots__ = (
        "engine_id",
        "index",
        "prompt_index",
        "request",
        "prompt_tokens",
        "max_tokens",
        "arrival_s",
        "scheduled_s",
        "first_token_s",
        "last_token_s",
        "num_tokens",
        "delivered",
        "num_cached",
        "num_preemptions",
        "finished",
        "finish_reason",
        "held",
        "shown_any",
        "token_ids",
        "stop",
        "stop_reason",
        "logprob_source",
        "text_offset",
        "echo_pending",
        "tool",
    )

    def __init__(
        self,
        engine_id: str,
        index: int,
        prompt_index: int,
        request: _RequestState,
        prompt_tokens: int,
        max_tokens: int,
    ) -> None:
        self.engine_id = engine_id
        self.index = index
        self.prompt_index = prompt_index
        self.request = request
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.arrival_s = 0.0
        self.scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.num_tokens = 0  # made visible by the engine
        self.delivered = 0  # written to the client
        self.num_cached = 0
        self.num_preemptions = 0
        self.finished = False
        self.finish_reason: str | None = None
        self.held: tuple[int, ...] = ()  # tokens held back by a per-request stream_interval
        self.shown_any = False
        self.token_ids: list[int] = []  # non-streaming: the whole output
        # Stop strings: the choice's detokenized text, checked as vLLM's output processor does
        # (None: no stop strings, the text is decoded as it is written).
        self.stop: StopChecker | None = None
        self.stop_reason: str | None = None
        self.logprob_source: LogprobSource | None = None
        self.text_offset = 0  # completions logprobs: where the next token's text starts
        self.echo_pending = False  # completions echo: the first chunk still owes the prompt
        # A forced tool call (named or "required" tool_choice): the text the model generates.
        self.tool: ToolCallOutput | None = None


# (choice, new token ids, finished, their text when a stop checker or a tool call made it,
# else None)
_Delivery = tuple[_Choice, tuple[int, ...], bool, str | None]


class _RequestState:
    """The engine loop's mailbox for one HTTP request (all its choices)."""

    __slots__ = ("pending", "waiter", "choices", "n", "stream_interval", "n_observed", "failed")

    def __init__(self, n: int, stream_interval: int) -> None:
        self.pending: list[_Delivery] = []
        self.waiter: asyncio.Future[None] | None = None
        self.choices: list[_Choice] = []
        self.n = n
        self.stream_interval = stream_interval
        self.n_observed = False
        self.failed = False

    def push(self, choice: _Choice, token_ids: tuple[int, ...], finished: bool) -> None:
        if self.stream_interval > 1:
            # A per-request stream_interval above the engine's: hold tokens back like vLLM's
            # output processor (first token at once, then every N, and at finish).
            if choice.held:
                token_ids = choice.held + token_ids
            if not (finished or not choice.shown_any or len(token_ids) >= self.stream_interval):
                choice.held = token_ids
                return
            choice.held = ()
        choice.shown_any = True
        checker = choice.stop
        if choice.tool is not None:
            text: str | None = choice.tool.next_text(token_ids)
        else:
            text = None if checker is None else checker.next_text(finished)
        self.pending.append((choice, token_ids, finished, text))
        self._wake()

    def fail(self) -> None:
        self.failed = True
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)


def _merge(batch: list[_Delivery]) -> list[_Delivery]:
    """Merge consecutive deliveries per choice (a lagging consumer sees one bigger delta)."""
    if len(batch) == 1:
        return batch
    merged: dict[_Choice, tuple[tuple[int, ...], bool, str | None]] = {}
    for choice, token_ids, finished, text in batch:
        previous = merged.get(choice)
        if previous is None:
            merged[choice] = (token_ids, finished, text)
        else:
            joined = None if text is None else (previous[2] or "") + text
            merged[choice] = (previous[0] + token_ids, finished, joined)
    return [(choice, ids, finished, text) for choice, (ids, finished, text) in merged.items()]


def _decode(token_ids: tuple[int, ...]) -> str:
    if len(token_ids) == 1:
        return tokenizer.token_text(token_ids[0])
    return tokenizer.decode(token_ids)


def _token_str(token_id: int) -> str:
    """A token's string as vLLM's logprobs name it: pad/BOS/EOS by their names."""
    if token_id <= tokenizer.EOS_ID:
        return tokenizer.SPECIAL_TOKEN_STRS[token_id]
    return tokenizer.token_text(token_id)


async def _vllm_server_headers(_request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = "uvicorn"
    response.headers["Vary"] = "Origin"




class _RefusedInStream(Exception):
    """A request vLLM refuses only once its stream has begun: 200, an error event, [DONE]."""


@dataclass
class _Plan:
    """A validated generation request, tokenized and resolved, ready for the engine."""

    params: GenerateParams
    request_id: str
    prompts: list[list[int]]
    max_tokens: list[int]
    # Echo and prompt logprobs only: each prompt's text and each of its tokens' strings.
    prompt_texts: list[str] = field(default_factory=list)
    prompt_strs: list[list[str]] = field(default_factory=list)


class _ResetConnection(Exception):
    """Raised inside a handler after a fault aborted the TCP connection."""


class _ArrivalStamp(asyncio.Protocol):
    """aiohttp's protocol for one connection, plus the instant its latest bytes arrived.

    ``last_data_ns`` is read when the loop hands the bytes over, before aiohttp parses them and
    before any handler runs, so when a request's body is complete it is the arrival instant of
    the body's last bytes, whatever the loop did next (HTTP/1.1 clients do not send the next
    request on a connection before the answer, so no later request's bytes move it).
    """

    __slots__ = ("_inner", "last_data_ns")

    def __init__(self, inner: asyncio.Protocol) -> None:
        self._inner = inner
        self.last_data_ns = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.last_data_ns = time.perf_counter_ns()
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


def _arrival_ns(request: web.Request) -> int:
    """When the request's last bytes reached the replica (now, if that is not known)."""
    transport = request.transport
    protocol = transport.get_protocol() if transport is not None else None
    stamp = protocol.last_data_ns if isinstance(protocol, _ArrivalStamp) else 0
    return stamp or time.perf_counter_ns()


class SimReplica:
    """One simulated vLLM server: the aiohttp app, its engine model and its metrics."""

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
        self.permission_id = f"modelperm-{uuid.uuid4().hex}"
        self.metrics = ReplicaMetrics(
            model_name=self.model_names[0],
            engine_index=0,
            max_model_len=self.engine_config.max_model_len,
            stats_source=self.engine.stats,
            cache_info=self._cache_info(),
            legacy_names=config.legacy_metric_names,
            tool_parser=config.tool_call_parser is not None,
        )
        self.dead = False
        self.in_flight = 0
        self._closing = False
        self._choices: dict[str, _Choice] = {}
        self._live_requests: set[_RequestState] = set()
        self._next_engine_id = 0
        self._latest_arrival_s = 0.0
        self._wake = asyncio.Event()
        self._engine_task: asyncio.Task[None] | None = None
        self._ground_truth = ground_truth
        self._faults = FaultPlan(config.fault, config.fault_rate, config.fault_seed + index)
        self._known_paths: frozenset[str] = frozenset()
        self._tokenizer_thread: concurrent.futures.ThreadPoolExecutor | None = None
        self.app = self._build_app()

    # ------------------------------------------------------------------ app

    def _cache_info(self) -> dict[str, str]:
        engine = self.engine_config
        return {
            "block_size": str(engine.block_size),
            "cache_dtype": "auto",
            "calculate_kv_scales": "False",
            "cpu_offload_gb": "0",
            "enable_prefix_caching": str(engine.enable_prefix_caching),
            "gpu_memory_utilization": "0.9",
            "is_attention_free": "False",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(engine.num_gpu_blocks),
            "num_gpu_blocks_override": "None",
            "prefix_caching_hash_algo": "sha256",
            "sliding_window": "None",
            "swap_space": "4",
        }

    def _build_app(self) -> web.Application:
        # No middleware unless an API key asks for one: every coroutine layer between aiohttp
        # and the handler is resumed once per streamed chunk.
        middlewares: list[Any] = []
        if self.config.api_key:
            middlewares.append(self._auth_middleware)
        app = web.Application(middlewares=middlewares)
        # Once per response, not per chunk: vLLM's uvicorn names itself, and its CORS
        # middleware adds Vary: Origin (checked against vLLM 0.32.0 itself).
        app.on_response_prepare.append(_vllm_server_headers)
        routes: list[tuple[str, str, Callable[[web.Request], Awaitable[web.StreamResponse]]]] = [
            ("POST", CHAT_PATH, functools.partial(self._handle_generate, chat=True)),
            ("POST", COMPLETIONS_PATH, functools.partial(self._handle_generate, chat=False)),
            ("GET", "/v1/models", self._handle_models),
            ("POST", "/tokenize", self._handle_tokenize),
            ("POST", "/detokenize", self._handle_detokenize),
            ("GET", "/health", self._handle_health),
            ("GET", "/ping", self._handle_health),
            ("POST", "/ping", self._handle_health),
            ("GET", "/version", self._handle_version),
            ("GET", "/load", self._handle_load),
            ("GET", "/metrics", self._handle_metrics),
        ]
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        self._known_paths = frozenset(path for _, path, _ in routes)
        # Registered last, so it only sees what no route above took: FastAPI's JSON answers
        # for an unknown path (404) and for a known path with the wrong method (405).
        app.router.add_route("*", "/{tail:.*}", self._handle_unrouted)
        return app

    async def _handle_unrouted(self, request: web.Request) -> web.Response:
        if request.path in self._known_paths:
            return _json_response({"detail": "Method Not Allowed"}, 405)
        return _json_response({"detail": "Not Found"}, 404)

    @web.middleware
    async def _auth_middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.method != "OPTIONS" and request.path.startswith("/v1"):
            expected = f"Bearer {self.config.api_key}"
            if request.headers.get("Authorization") != expected:
                return _json_response({"error": "Unauthorized"}, 401)
        return await handler(request)

    # ------------------------------------------------------------------ lifecycle

    def start_engine(self) -> None:
        if self._engine_task is None:
            self._engine_task = asyncio.get_running_loop().create_task(
                self._run_engine(), name=f"sim-engine-{self.index}"
            )

    def begin_shutdown(self) -> None:
        """From now on, requests cut short are recorded as "shutdown", not client disconnects."""
        self._closing = True

    async def stop_engine(self) -> None:
        self._closing = True
        task, self._engine_task = self._engine_task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        for state in list(self._live_requests):
            state.fail()
        pool, self._tokenizer_thread = self._tokenizer_thread, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    async def warm_up(self) -> None:
        """Run once, with nothing recorded, what a first request would pay for on its own.

        The tokenizer's tables, the JSON reading and validation of both endpoints, the chunk and
        body rendering, the metrics page and the tokenizer thread. No engine request, metric or
        ground-truth line comes of it.
        """
        tokenizer.warm()
        chat_raw = (
            b'{"model":null,"messages":[{"role":"user","content":"warm up"}],"max_tokens":2,'
            b'"stream":true,"stream_options":{"include_usage":true}}'
        )
        completion_raw = b'{"model":null,"prompt":["warm up",[5,6,7]],"max_tokens":2}'
        for raw, chat in ((chat_raw, True), (completion_raw, False)):
            params = read_generate_params(parse_json_object(raw), chat)
            with contextlib.suppress(RequestError):  # e.g. a context shorter than the prompt
                self._plan(params, "warm-up", slice_chars=TOKENIZE_SLICE_CHARS)
        formatter = StreamFormatter(
            chat=True, response_id="chatcmpl-warm-up", created=self.created,
            model=self.model_names[0], profile=self.config.profile,
            fingerprint=self.fingerprint, include_usage=True, era=self.era,
        )
        formatter.role_chunk(0, "assistant", (1, 0))
        formatter.token_chunk(0, _decode((300,)), None, (1, 1))
        formatter.token_chunk(0, _decode((301, tokenizer.EOS_ID)), "stop", (1, 3))
        formatter.usage_chunk(1, 3, 0, RequestTimings.from_instants(
            arrival_s=0.0, scheduled_s=0.0, first_token_s=0.1, last_token_s=0.2,
            num_generation_tokens=3))
        common: dict[str, Any] = {
            "created": self.created, "model": self.model_names[0],
            "choices": [ChoiceResult(index=0, text="warm", finish_reason="stop")],
            "prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": None,
            "timings": None, "fingerprint": self.fingerprint, "profile": self.config.profile,
            "era": self.era,
        }
        chat_completion_body(response_id="chatcmpl-warm-up", role="assistant", **common)
        completion_body(response_id="cmpl-warm-up", **common)
        error_body("warm up", BAD_REQUEST_ERROR, 400)
        self.metrics.render()
        uuid.uuid4()
        # Awaited, not waited for: the replica starts on a running loop, which a blocking
        # wait would hold up (tests/conftest.py fails a test whose code blocks the loop).
        await asyncio.wrap_future(self._tokenizer().submit(tokenizer.warm))

    def _tokenizer(self) -> concurrent.futures.ThreadPoolExecutor:
        pool = self._tokenizer_thread
        if pool is None:
            # One thread per replica, as vLLM's API server has one tokenizer thread.
            pool = self._tokenizer_thread = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"sim-tokenizer-{self.index}"
            )
        return pool

    # ------------------------------------------------------------------ the engine loop

    async def _run_engine(self) -> None:
        engine = self.engine
        wake = self._wake
        perf = time.perf_counter
        sleep = asyncio.sleep
        deadline: float | None = None
        try:
            while True:
                if not engine.has_work():
                    deadline = None
                    wake.clear()
                    await wake.wait()
                    continue
                now = perf()
                start = now if deadline is None or now - deadline > MAX_SCHEDULE_LAG_S else deadline
                if start < self._latest_arrival_s:
                    start = self._latest_arrival_s
                result = engine.step(start)
                deadline = start + result.duration_s
                delay = deadline - perf()
                await sleep(delay if delay > 0 else 0)
                self._deliver(result, deadline)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("simulated engine of replica %d died", self.index)
            self.dead = True
            for state in list(self._live_requests):
                state.fail()

    def _deliver(self, result: StepResult, end_s: float) -> None:
        metrics = self.metrics
        if result.num_batched_tokens:
            metrics.observe_iteration(result.num_batched_tokens)
        choices = self._choices
        for output in result.outputs:
            choice = choices.get(output.request_id)
            if choice is None:
                continue  # aborted meanwhile
            last = choice.last_token_s
            for step_end_s in output.step_times_s or (end_s,):
                if last is None:
                    metrics.observe_time_to_first_token(step_end_s - choice.arrival_s)
                else:
                    metrics.observe_inter_token_latency(step_end_s - last)
                last = step_end_s
            choice.last_token_s = last
            if choice.scheduled_s is None:
                choice.scheduled_s = output.scheduled_s
            if choice.first_token_s is None:
                choice.first_token_s = output.first_token_s
            if output.num_cached_tokens:
                choice.num_cached = output.num_cached_tokens
            choice.num_preemptions = output.num_preemptions
            token_ids = output.new_token_ids
            choice.num_tokens += len(token_ids)
            finished = output.finished
            checker = choice.stop
            if checker is not None and checker.update(token_ids) is not None and not finished:
                # A stop string in the text: vLLM's output processor finishes the request as
                # "stop" with the string as stop_reason and aborts it in the engine core.
                finished = True
                choice.stop_reason = checker.matched
                del choices[output.request_id]
                self.engine.abort_request(output.request_id, "stop")
                choice.finished = True
                choice.finish_reason = "stop"
                self._observe_finished(choice, "stop", end_s)
            elif finished:
                if checker is not None and checker.matched is not None:
                    choice.stop_reason = checker.matched  # the last token held the string
                    choice.finish_reason = "stop"
                else:
                    choice.finish_reason = output.finish_reason or "stop"
                del choices[output.request_id]
                choice.finished = True
                self._observe_finished(choice, choice.finish_reason, end_s)
            choice.request.push(choice, token_ids, finished)

    def _observe_finished(self, choice: _Choice, reason: str, finished_s: float) -> None:
        state = choice.request
        n: int | None = None
        if not state.n_observed:
            state.n_observed = True
            n = state.n
        self.metrics.observe_finished(
            finished_reason=reason,
            prompt_tokens=choice.prompt_tokens,
            generation_tokens=choice.num_tokens,
            max_tokens=choice.max_tokens,
            n=n,
            arrival_s=choice.arrival_s,
            scheduled_s=choice.scheduled_s,
            first_token_s=choice.first_token_s,
            last_token_s=choice.last_token_s,
            finished_s=finished_s,
            num_preemptions=choice.num_preemptions,
        )

    def _abort(self, state: _RequestState, reason: str) -> None:
        """Stop every unfinished choice of a request (client gone, fault, error)."""
        now = time.perf_counter()
        for choice in state.choices:
            if choice.finished:
                continue
            choice.finished = True
            choice.finish_reason = reason
            if self._choices.pop(choice.engine_id, None) is not None:
                self.engine.abort_request(choice.engine_id)
            self._observe_finished(choice, reason, now)

    # ------------------------------------------------------------------ generation endpoints

    async def _handle_generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        raw = await request.read()
        received_ns = _arrival_ns(request)
        record: GroundTruthRecord | None = None
        if self._ground_truth is not None:
            record = GroundTruthRecord(
                replica=self.index,
                endpoint=CHAT_PATH if chat else COMPLETIONS_PATH,
                received_ns=received_ns,
                wall_time_ns=time.time_ns(),
            )
        self.in_flight += 1
        try:
            return await self._generate(request, raw, chat, record)
        finally:
            self.in_flight -= 1
            if record is not None and self._ground_truth is not None:
                if not record.done_ns:
                    record.done_ns = time.perf_counter_ns()
                self._ground_truth.write(record)

    async def _generate(
        self, request: web.Request, raw: bytes, chat: bool, record: GroundTruthRecord | None
    ) -> web.StreamResponse:
        header_request_id = request.headers.get("X-Request-Id")
        request_id = header_request_id or ""
        try:
            body = parse_json_object(raw)
            params = read_generate_params(body, chat)
            request_id = header_request_id or params.request_id or uuid.uuid4().hex
            if record is not None:
                record.request_id = request_id
                record.stream = params.stream
            fault = self._fault_for(request)
            if record is not None and not fault.is_empty:
                record.fault = fault.text
            if fault.error_status is not None:
                code = fault.error_status
                message = ENGINE_DEAD_MESSAGE if code == 500 else f"Simulated HTTP {code} error"
                err_type = _ERROR_TYPES.get(code) or http.HTTPStatus(code).phrase
                raise RequestError(code, message, err_type)
            if len(raw) > OFFLOAD_BODY_BYTES:
                plan = await self._plan_off_loop(params, request_id, record)
            else:
                plan = self._plan(params, request_id)
            state = self._admit(plan)
        except _RefusedInStream as refusal:
            if record is not None:
                record.request_id = record.request_id or request_id or uuid.uuid4().hex
                record.status = 200
                record.outcome = "error_event"
            return await self._refuse_in_stream(request, params, request_id, str(refusal))
        except RequestError as err:
            if record is not None:
                record.request_id = record.request_id or request_id or uuid.uuid4().hex
                record.status = err.status
                record.outcome = "rejected" if err.status == 503 else "http_error"
            return self._error_response(err, request_id)
        try:
            if plan.params.stream:
                return await self._stream(request, plan, state, fault, record)
            return await self._respond_whole(request, plan, state, fault, record)
        finally:
            self._live_requests.discard(state)
            if any(not choice.finished for choice in state.choices):
                self._abort(state, "abort")
            if record is not None:
                self._fill_record(record, plan, state)

    async def _refuse_in_stream(self, request: web.Request, params: GenerateParams,
                                request_id: str | None, message: str) -> web.StreamResponse:
        formatter = StreamFormatter(
            chat=params.chat, response_id="", created=0, model=params.model or "",
            profile=self.config.profile, fingerprint=self.fingerprint, include_usage=False,
            era=self.era)
        rid = request_id or uuid.uuid4().hex
        response = web.StreamResponse(status=200,
                                      headers=self._response_headers(rid, SSE_CONTENT_TYPE))
        await response.prepare(request)
        await response.write(formatter.error_event(message, BAD_REQUEST_ERROR, 400))
        await response.write(DONE_EVENT)
        await response.write_eof()
        return response

    def _fault_for(self, request: web.Request) -> FaultSpec:
        try:
            return self._faults.for_request(request.headers.get(FAULT_HEADER))
        except FaultSpecError as exc:
            raise bad_request(f"Invalid {FAULT_HEADER} header: {exc}") from None

    def _resolve_max_tokens(self, prompt_len: int, requested: int | None, param: str) -> int:
        """vLLM's length checks (``TokenizeParams`` then ``SamplingParams``), same messages."""
        max_model_len = self.engine_config.max_model_len
        if requested is not None and requested > max_model_len:
            raise bad_request(
                f"{param}={requested} cannot be greater than max_model_len={max_model_len}. "
                "Please request fewer output tokens.",
                param, requested,
            )
        if not self.era.weight_versions:  # 0.32 (checked against the real server)
            if prompt_len > max_model_len:
                # Its tokenizer stops at max_model_len + 1 tokens: "at least" that many.
                count = min(prompt_len, max_model_len + 1)
                qualifier = "at least " if count == max_model_len + 1 else ""
                raise bad_request(
                    f"This model's maximum context length is {max_model_len} tokens. However, "
                    f"your prompt contains {qualifier}{count} input tokens, which exceeds this "
                    "limit even without any output tokens. Please reduce the length of the "
                    "input prompt.", "input_tokens", count)
            # A prompt that fits leaves max_tokens clamped to what remains (get_max_tokens).
            remaining = max_model_len - prompt_len
            return remaining if requested is None else max(1, min(requested, remaining))
        requested_output = requested if requested is not None and requested > 0 else 0
        max_input = max_model_len - requested_output
        if prompt_len > max_input:
            raise bad_request(
                f"You passed {prompt_len} input tokens and requested {requested_output} output "
                f"tokens. However, the model's context length is only {max_model_len} tokens, "
                f"resulting in a maximum input length of {max_input} tokens. "
                "Please reduce the length of the input prompt.",
                "input_tokens", prompt_len,
            )
        max_tokens = max_model_len - prompt_len if requested is None else requested
        if max_tokens < 1:
            raise bad_request(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens",
                              max_tokens)
        return max_tokens

    async def _plan_off_loop(
        self, params: GenerateParams, request_id: str, record: GroundTruthRecord | None
    ) -> _Plan:
        """`_plan` on the tokenizer thread (a large prompt), its text tokenized in slices."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(
                self._tokenizer(),
                functools.partial(
                    self._plan, params, request_id, slice_chars=TOKENIZE_SLICE_CHARS
                ),
            )
        except asyncio.CancelledError:
            if record is not None:
                record.outcome = "shutdown" if self._closing else "client_disconnect"
            raise

    def _plan(self, params: GenerateParams, request_id: str, slice_chars: int = 0) -> _Plan:
        """Validate and tokenize (pure: it may run on the tokenizer thread)."""
        self._check_model(params.model)
        refusal = tool_refusal(params.tools, self.config.serves_tools)
        if refusal is not None:
            raise bad_request(refusal)
        if params.use_beam_search and params.stream:
            raise bad_request("Streaming is not currently supported with beam search")
        if params.n < 1:
            raise bad_request(f"n must be at least 1, got {params.n}.", "n", params.n)
        if params.n > 1 and params.temperature is not None and params.temperature < GREEDY_EPS:
            # vLLM's SamplingParams._verify_greedy_sampling: a ValueError, so no param.
            raise bad_request(f"n must be 1 when using greedy sampling, got {params.n}.")
        if params.stream_interval is not None and params.stream_interval < 1:
            raise bad_request(
                f"stream_interval must be at least 1, got {params.stream_interval}.",
                "stream_interval", params.stream_interval,
            )
        if params.min_tokens < 0:
            raise bad_request(
                f"min_tokens must be greater than or equal to 0, got {params.min_tokens}.",
                "min_tokens", params.min_tokens,
            )
        prompts: list[list[int]] = []
        if params.chat:
            prompts.append(
                tokenizer.apply_chat_template(
                    params.messages, params.add_generation_prompt, slice_chars
                )
            )
        else:
            vocab_size = self.engine_config.vocab_size
            for prompt in params.prompts:
                if isinstance(prompt, str):
                    prompts.append(
                        tokenizer.encode(prompt, params.add_special_tokens, slice_chars)
                    )
                    continue
                out_of_vocab = [t for t in prompt if not 0 <= t < vocab_size]
                if out_of_vocab:
                    # vLLM finds it in the engine's input processing: a 400 (a ValueError, no
                    # param) for a whole answer, after the head (an error event) for a stream.
                    message = f"Token id {max(out_of_vocab)} is out of vocabulary"
                    if params.stream:
                        raise _RefusedInStream(message)
                    raise bad_request(message)
                prompts.append(list(prompt))
        max_tokens: list[int] = []
        for ids in prompts:
            resolved = self._resolve_max_tokens(
                len(ids), params.max_tokens, params.max_tokens_param
            )
            if params.min_tokens > resolved:
                raise bad_request(
                    f"min_tokens must be less than or equal to max_tokens={resolved}, "
                    f"got {params.min_tokens}.",
                    "min_tokens", params.min_tokens,
                )
            max_tokens.append(resolved)
        # SamplingParams._validate_logprobs, against vLLM's default --max-logprobs.
        for count, name, what in ((params.logprobs, "logprobs", "sample"),
                                  (params.prompt_logprobs, "prompt_logprobs", "prompt")):
            if count:
                count = self.engine_config.vocab_size if count == -1 else count
                if count > MAX_LOGPROBS:
                    raise bad_request(f"Requested {what} logprobs of {count}, which is greater "
                                      f"than max allowed: {MAX_LOGPROBS}", name, count)
        plan = _Plan(params=params, request_id=request_id, prompts=prompts,
                     max_tokens=max_tokens)
        if params.echo or params.prompt_logprobs is not None:
            self._describe_prompts(plan)
        return plan

    @staticmethod
    def _describe_prompts(plan: _Plan) -> None:
        """The prompts' texts (what echo shows) and their tokens' strings (what logprobs of
        prompt tokens name): a text prompt's own pieces; token ids decoded one by one."""
        params = plan.params
        if params.chat:
            ids, strs = tokenizer.apply_chat_template_with_strs(
                params.messages, params.add_generation_prompt)
            plan.prompt_texts.append("")
            plan.prompt_strs.append(strs)
            return
        for prompt, ids in zip(params.prompts, plan.prompts, strict=True):
            if isinstance(prompt, str):
                _, strs = tokenizer.encode_with_strs(prompt, params.add_special_tokens)
                plan.prompt_texts.append(prompt)
            else:
                strs = [_token_str(t) for t in ids]
                plan.prompt_texts.append(tokenizer.decode(ids))
            plan.prompt_strs.append(strs)

    def _admit(self, plan: _Plan) -> _RequestState:
        """Admission control, then hand the request's choices to the engine."""
        if self.dead:
            raise RequestError(500, ENGINE_DEAD_MESSAGE, "InternalServerError")
        limit = self.config.max_num_queued_reqs
        if limit is not None and self.engine.stats().num_waiting >= limit:
            self.metrics.count_admission_rejection("max_num_queued_reqs")
            raise RequestError(
                503,
                f"The server is overloaded: the request queue is full "
                f"(max_num_queued_reqs={limit}). Please retry later.",
                "Service Unavailable",
            )
        params = plan.params
        engine_interval = self.engine_config.stream_interval
        interval = params.stream_interval or engine_interval
        state = _RequestState(params.n, interval if interval > engine_interval else 1)
        requests: list[tuple[EngineRequest, _Choice]] = []
        tools = params.tools if self.config.serves_tools else None
        forced = tools is not None and tools.forces_call
        for prompt_index, ids in enumerate(plan.prompts):
            prompt_ids = tuple(ids)
            for i in range(params.n):
                engine_id = f"{plan.request_id}#{self._next_engine_id}"
                self._next_engine_id += 1
                key = self._sampling_key(params, prompt_ids, i)
                # A forced call is as long as its JSON, then EOS (structured outputs).
                tool = ToolCallOutput(tools) if forced and tools is not None else None
                engine_request = EngineRequest(
                    request_id=engine_id,
                    prompt_token_ids=prompt_ids,
                    max_tokens=plan.max_tokens[prompt_index],
                    min_tokens=params.min_tokens,
                    ignore_eos=params.ignore_eos,
                    natural_length=None if tool is None else tool.natural_length,
                    sampling_key=key,
                )
                try:
                    self.engine.validate(engine_request)
                except ValueError as exc:
                    raise bad_request(str(exc)) from None
                choice = _Choice(
                    engine_id,
                    i + prompt_index * params.n,
                    prompt_index,
                    state,
                    len(prompt_ids),
                    plan.max_tokens[prompt_index],
                )
                choice.tool = tool
                if params.stop and tool is None:  # a tool call's text is not searched: gap
                    choice.stop = StopChecker(params.stop, params.include_stop_str_in_output,
                                              params.min_tokens)
                if params.logprobs is not None:
                    choice.logprob_source = LogprobSource(
                        sampling_seed(self.engine_config.seed, key or engine_id, "logprobs"),
                        params.greedy, self.engine_config.vocab_size)
                choice.echo_pending = params.echo
                requests.append((engine_request, choice))
        now = time.perf_counter()
        self._latest_arrival_s = now
        for engine_request, choice in requests:
            choice.arrival_s = now
            self.engine.add_request(engine_request, now)
            self._choices[choice.engine_id] = choice
            state.choices.append(choice)
        self._live_requests.add(state)
        self._wake.set()
        return state

    @staticmethod
    def _sampling_key(params: GenerateParams, prompt_ids: tuple[int, ...],
                      index: int) -> str | None:
        """What a choice's tokens are drawn from: a greedy answer is a function of the prompt
        alone, a seeded one of the prompt, the seed and the choice (vLLM's per-request
        generators); anything else is a fresh draw (None: the engine request's id)."""
        if params.greedy:
            return f"greedy:{sampling_seed(*prompt_ids)}"
        if params.seed is not None:
            return f"seed:{params.seed}:{index}:{sampling_seed(*prompt_ids)}"
        return None

    def _usage_flags(self, params: GenerateParams) -> tuple[bool, bool]:
        if self.config.enable_force_include_usage:
            return True, True
        options = params.stream_options
        if options is None or not options.include_usage:
            return False, False
        return True, options.continuous_usage_stats

    def _response_headers(self, request_id: str, content_type: str) -> dict[str, str]:
        headers = {"Content-Type": content_type}
        if self.config.enable_request_id_headers:
            headers["X-Request-Id"] = request_id or uuid.uuid4().hex
        return headers

    def _error_response(self, err: RequestError, request_id: str) -> web.Response:
        body = compact_json(error_body(err.message, err.err_type, err.status, err.param)).encode()
        return web.Response(
            body=body,
            status=err.status,
            headers=self._response_headers(request_id, JSON_CONTENT_TYPE),
        )

    def _timings(self, state: _RequestState) -> RequestTimings | None:
        """vLLM's per-request metrics: only with the flag and a single choice."""
        if not self.config.enable_per_request_metrics or len(state.choices) != 1:
            return None
        choice = state.choices[0]
        return RequestTimings.from_instants(
            arrival_s=choice.arrival_s,
            scheduled_s=choice.scheduled_s,
            first_token_s=choice.first_token_s,
            last_token_s=choice.last_token_s,
            num_generation_tokens=choice.num_tokens,
        )

    def _cached_tokens(self, state: _RequestState) -> int | None:
        if not self.config.enable_prompt_tokens_details:
            return None
        # One count per prompt (its first choice), as vLLM reports the prompt's cache hits.
        return sum(choice.num_cached for choice in state.choices if choice.index % state.n == 0)

    async def _stream(
        self,
        request: web.Request,
        plan: _Plan,
        state: _RequestState,
        fault: FaultSpec,
        record: GroundTruthRecord | None,
    ) -> web.StreamResponse:
        params = plan.params
        chat = params.chat
        include_usage, continuous = self._usage_flags(params)
        formatter = StreamFormatter(
            chat=chat,
            response_id=("chatcmpl-" if chat else "cmpl-") + plan.request_id,
            created=int(time.time()),
            model=params.model or self.model_names[0],
            profile=self.config.profile,
            fingerprint=self.fingerprint,
            include_usage=include_usage,
            era=self.era,
        )
        if fault.slow_headers_ms:
            await asyncio.sleep(fault.slow_headers_ms / 1000)
        response = web.StreamResponse(
            status=200, headers=self._response_headers(plan.request_id, SSE_CONTENT_TYPE)
        )
        await response.prepare(request)
        perf_ns = time.perf_counter_ns
        chunk_ns: list[int] = []
        chunk_tokens: list[int] = []
        chunk_kinds: list[str] = []
        if record is not None:
            record.headers_ns = perf_ns()
            chunk_ns = record.chunk_ns
            chunk_tokens = record.chunk_tokens
            chunk_kinds = record.chunk_kinds
        stamping = record is not None
        write = response.write
        loop = asyncio.get_running_loop()
        keep_alive_s = self.config.sse_keep_alive_interval
        role = self._response_role(params)
        remaining = len(state.choices)
        role_pending = chat
        token_chunks = 0
        # Per choice, tokens of tool-call text vLLM sends no event for: the ground truth counts
        # them with the choice's next event.
        unsent_tokens: dict[int, int] = {}
        # With a tool parser every chat delta goes through it (serving.py 662-676). Under
        # tool_choice "none" (a request without tools too) it gives no delta for empty text
        # (abstract_parser.py 706-727): such an event is dropped, or with a finish or logprobs
        # sent with "delta":{} (serving.py 700-716); checked against the real server. Under
        # "auto" the parser's own streaming reads every delta (counted in its metric).
        tools = params.tools if chat and self.config.serves_tools else None
        drop_empty = chat and self.config.serves_tools and (
            tools is None or tools.choice.kind == "none")
        auto_tools = tools is not None and tools.choice.kind == "auto"
        stalled = fault.stall_ms is None
        malformed_done = fault.malformed_after is None
        faulty = not fault.is_empty
        try:
            while remaining:
                if not state.pending:
                    if state.failed:
                        await write(
                            formatter.error_event(ENGINE_DEAD_MESSAGE, "InternalServerError", 500)
                        )
                        await write(DONE_EVENT)
                        if record is not None:
                            record.outcome = "error_event"
                        self._abort(state, "error")
                        await response.write_eof()
                        return response
                    waiter: asyncio.Future[None] = loop.create_future()
                    state.waiter = waiter
                    if keep_alive_s > 0:
                        try:
                            await asyncio.wait_for(waiter, keep_alive_s)
                        except asyncio.TimeoutError:
                            state.waiter = None
                            await write(KEEPALIVE_EVENT)
                            if stamping:
                                chunk_ns.append(perf_ns())
                                chunk_tokens.append(0)
                                chunk_kinds.append("keepalive")
                    else:
                        await waiter
                    continue
                if not stalled and token_chunks >= fault.stall_after:
                    stalled = True
                    # Silence on the wire while the engine keeps going: what piles up meanwhile
                    # goes out merged in the next chunk.
                    await asyncio.sleep((fault.stall_ms or 0.0) / 1000)
                batch = state.pending
                state.pending = []
                if role_pending:
                    role_pending = False
                    for choice in state.choices:
                        usage = (choice.prompt_tokens, 0) if continuous else None
                        await write(formatter.role_chunk(choice.index, role, usage))
                        if stamping:
                            chunk_ns.append(perf_ns())
                            chunk_tokens.append(0)
                            chunk_kinds.append("role")
                for choice, token_ids, finished, text in (
                        batch if len(batch) == 1 else _merge(batch)):
                    if faulty:
                        ended = await self._stream_fault(
                            request, response, formatter, state, fault, token_chunks, record
                        )
                        if ended:
                            return response
                        if not malformed_done and token_chunks >= (fault.malformed_after or 0):
                            malformed_done = True
                            await write(formatter.malformed_event(choice.index))
                            if stamping:
                                chunk_ns.append(perf_ns())
                                chunk_tokens.append(0)
                                chunk_kinds.append("malformed")
                    count = len(token_ids)
                    choice.delivered += count
                    usage = (choice.prompt_tokens, choice.delivered) if continuous else None
                    if text is None:
                        text = _decode(token_ids)
                    tool = choice.tool
                    if tool is not None:
                        delta = tool.delta(text)
                        if delta is None and not finished:
                            unsent_tokens[choice.index] = unsent_tokens.get(choice.index, 0) + count
                            continue
                        chunk = formatter.token_chunk(
                            choice.index, "",
                            tool.stream_finish_reason(choice.finish_reason or "stop")
                            if finished else None,
                            usage, delta="{}" if delta is None else delta)
                        count += unsent_tokens.pop(choice.index, 0)
                    else:
                        empty_delta: str | None = None
                        if auto_tools:
                            self.metrics.count_tool_parser_invocations(streaming=True)
                        elif drop_empty and not text:
                            if not finished and choice.logprob_source is None:
                                unsent_tokens[choice.index] = (
                                    unsent_tokens.get(choice.index, 0) + count)
                                continue
                            empty_delta = "{}"
                        count += unsent_tokens.pop(choice.index, 0)
                        if choice.logprob_source is None and not choice.echo_pending:
                            chunk = formatter.token_chunk(
                                choice.index, text, choice.finish_reason if finished else None,
                                usage, stop_reason=choice.stop_reason, delta=empty_delta)
                        else:
                            chunk = self._rich_token_chunk(formatter, plan, choice, token_ids,
                                                           text, finished, usage, empty_delta)
                    await write(chunk)
                    if stamping:
                        chunk_ns.append(perf_ns())
                        chunk_tokens.append(count)
                        chunk_kinds.append("token")
                    token_chunks += 1
                    if finished:
                        remaining -= 1
            if include_usage:
                prompt_tokens = sum(len(ids) for ids in plan.prompts)
                completion_tokens = sum(choice.delivered for choice in state.choices)
                await write(
                    formatter.usage_chunk(
                        prompt_tokens,
                        completion_tokens,
                        self._cached_tokens(state),
                        self._timings(state),
                    )
                )
                if stamping:
                    chunk_ns.append(perf_ns())
                    chunk_tokens.append(0)
                    chunk_kinds.append("usage")
            await write(DONE_EVENT)
            if stamping:
                chunk_ns.append(perf_ns())
                chunk_tokens.append(0)
                chunk_kinds.append("done")
            await response.write_eof()
            return response
        except _ResetConnection:
            raise asyncio.CancelledError() from None
        except (asyncio.CancelledError, ConnectionError):
            if record is not None and record.outcome == "ok":
                record.outcome = "shutdown" if self._closing else "client_disconnect"
            self._abort(state, "abort")
            raise asyncio.CancelledError() from None

    def _rich_token_chunk(self, formatter: StreamFormatter, plan: _Plan, choice: _Choice,
                          token_ids: tuple[int, ...], text: str, finished: bool,
                          usage: tuple[int, int] | None, delta: str | None = None) -> bytes:
        """A token chunk with logprobs, or a completion's first chunk with the echoed prompt
        (vLLM's serving code: the prompt's text before the first delta, its token ids, and with
        logprobs the prompt's positions before the new tokens')."""
        params = plan.params
        prompt_ids: list[int] | None = None
        positions: list[Position | None] = []
        tokens: list[str] = []
        if choice.echo_pending:
            choice.echo_pending = False
            prompt_ids = plan.prompts[choice.prompt_index]
            text = plan.prompt_texts[choice.prompt_index] + text
            if params.logprobs is not None:
                positions.extend(self._prompt_positions(plan, choice.prompt_index,
                                                        params.logprobs))
                tokens.extend(plan.prompt_strs[choice.prompt_index])
        logprobs: dict[str, Any] | None = None
        source = choice.logprob_source
        if source is not None and params.logprobs is not None:
            k = params.logprobs
            sampled = [source.sampled(token_id, k) for token_id in token_ids]
            if params.chat:
                logprobs = chat_logprobs(sampled, k)
            else:
                positions.extend(sampled)
                tokens.extend(position[0].token for position in sampled)
                logprobs = completion_logprobs(positions, tokens, k, choice.text_offset)
                if tokens:
                    choice.text_offset = logprobs["text_offset"][-1] + len(tokens[-1])
        return formatter.token_chunk(
            choice.index, text, choice.finish_reason if finished else None, usage,
            logprobs=logprobs, stop_reason=choice.stop_reason, prompt_token_ids=prompt_ids,
            delta=delta)

    def _prompt_positions(self, plan: _Plan, prompt_index: int, k: int) -> list[Position | None]:
        """A prompt's logprobs: none for its first token, then each token's position with
        ``k`` alternatives; a function of the prompt (the same for every choice and request)."""
        ids = plan.prompts[prompt_index]
        source = LogprobSource(sampling_seed(self.engine_config.seed, "prompt", *ids), True,
                               self.engine_config.vocab_size)
        positions: list[Position | None] = [None]
        positions.extend(source.prompt(token_id, k) for token_id in ids[1:])
        return positions

    async def _stream_fault(
        self,
        request: web.Request,
        response: web.StreamResponse,
        formatter: StreamFormatter,
        state: _RequestState,
        fault: FaultSpec,
        token_chunks: int,
        record: GroundTruthRecord | None,
    ) -> bool:
        """Apply a fault due before token chunk ``token_chunks + 1``; True if the response ended."""
        if fault.reset_after is not None and token_chunks >= fault.reset_after:
            if record is not None:
                record.outcome = "reset"
            self._abort(state, "abort")
            transport = request.transport
            if transport is not None:
                transport.abort()
            raise _ResetConnection()
        if fault.error_event_after is not None and token_chunks >= fault.error_event_after:
            self._abort(state, "error")
            await response.write(
                formatter.error_event(GENERATION_ERROR_MESSAGE, "InternalServerError", 500)
            )
            self._stamp(record, 0, "error")
            await response.write(DONE_EVENT)
            self._stamp(record, 0, "done")
            if record is not None:
                record.outcome = "error_event"
            await response.write_eof()
            return True
        if fault.close_after is not None and token_chunks >= fault.close_after:
            self._abort(state, "abort")
            if record is not None:
                record.outcome = "truncated"
            await response.write_eof()
            return True
        return False

    @staticmethod
    def _stamp(record: GroundTruthRecord | None, tokens: int, kind: str) -> None:
        if record is not None:
            record.chunk_ns.append(time.perf_counter_ns())
            record.chunk_tokens.append(tokens)
            record.chunk_kinds.append(kind)

    def _response_role(self, params: GenerateParams) -> str:
        if not params.add_generation_prompt and params.messages:
            return params.messages[-1].role
        return self.config.response_role

    async def _respond_whole(
        self,
        request: web.Request,
        plan: _Plan,
        state: _RequestState,
        fault: FaultSpec,
        record: GroundTruthRecord | None,
    ) -> web.StreamResponse:
        """A non-streaming answer: wait for every choice, then one JSON body."""
        params = plan.params
        loop = asyncio.get_running_loop()
        remaining = len(state.choices)
        outputs = 0
        stalled = fault.stall_ms is None
        cut_body = False
        try:
            while remaining:
                if not state.pending:
                    if state.failed:
                        self._abort(state, "error")
                        raise RequestError(500, ENGINE_DEAD_MESSAGE, "InternalServerError")
                    waiter: asyncio.Future[None] = loop.create_future()
                    state.waiter = waiter
                    await waiter
                    continue
                if not stalled and outputs >= fault.stall_after:
                    stalled = True
                    await asyncio.sleep((fault.stall_ms or 0.0) / 1000)
                batch = state.pending
                state.pending = []
                for choice, token_ids, finished, _text in batch:
                    if fault.reset_after is not None and outputs >= fault.reset_after:
                        if record is not None:
                            record.outcome = "reset"
                        self._abort(state, "abort")
                        if request.transport is not None:
                            request.transport.abort()
                        raise _ResetConnection()
                    if fault.error_event_after is not None and outputs >= fault.error_event_after:
                        self._abort(state, "error")
                        raise RequestError(500, GENERATION_ERROR_MESSAGE, "InternalServerError")
                    for cut_after in (fault.close_after, fault.malformed_after):
                        if cut_after is not None and outputs >= cut_after:
                            cut_body = True
                    choice.token_ids.extend(token_ids)
                    choice.delivered += len(token_ids)
                    outputs += 1
                    if finished:
                        remaining -= 1
        except RequestError as err:
            if record is not None:
                record.status = err.status
                record.outcome = "http_error"
            return await self._send_whole(
                request, self._error_response(err, plan.request_id), record
            )
        except _ResetConnection:
            raise asyncio.CancelledError() from None
        except (asyncio.CancelledError, ConnectionError):
            if record is not None and record.outcome == "ok":
                record.outcome = "shutdown" if self._closing else "client_disconnect"
            self._abort(state, "abort")
            raise asyncio.CancelledError() from None
        choices = [self._whole_choice(plan, choice) for choice in state.choices]
        tools = params.tools
        if self.config.serves_tools and tools is not None and tools.choice.kind == "auto":
            # The parser reads each whole choice once (abstract_parser.py 626-652).
            self.metrics.count_tool_parser_invocations(streaming=False, count=len(choices))
        prompt_tokens = sum(len(ids) for ids in plan.prompts)
        completion_tokens = sum(choice.delivered for choice in state.choices)
        common: dict[str, Any] = {
            "created": int(time.time()),
            "model": params.model or self.model_names[0],
            "choices": choices,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "cached_tokens": self._cached_tokens(state),
            "timings": self._timings(state),
            "fingerprint": self.fingerprint,
            "profile": self.config.profile,
            "era": self.era,
        }
        if params.chat:
            prompt_logprobs = None
            if params.prompt_logprobs is not None:
                prompt_logprobs = prompt_logprobs_json(
                    self._prompt_positions(plan, 0, params.prompt_logprobs),
                    plan.prompt_strs[0])
            body = chat_completion_body(
                response_id="chatcmpl-" + plan.request_id,
                role=self._response_role(params),
                prompt_logprobs=prompt_logprobs,
                **common,
            )
        else:
            body = completion_body(response_id="cmpl-" + plan.request_id, **common)
        if cut_body:
            body = body[: len(body) // 2]
            if record is not None:
                record.outcome = "truncated"
        if fault.slow_headers_ms:
            await asyncio.sleep(fault.slow_headers_ms / 1000)
        response = web.Response(
            body=body,
            status=200,
            headers=self._response_headers(plan.request_id, JSON_CONTENT_TYPE),
        )
        return await self._send_whole(request, response, record)

    def _whole_choice(self, plan: _Plan, choice: _Choice) -> ChoiceResult:
        """One choice of a whole answer (vLLM's request_output_to_*_response): its text (cut
        at a stop string), logprobs, and for a completion the echoed prompt before them and
        the prompt's logprobs."""
        params = plan.params
        checker = choice.stop
        text = tokenizer.decode(choice.token_ids) if checker is None else checker.text
        finish_reason = choice.finish_reason or "stop"
        tool_calls: list[dict[str, Any]] | None = None
        if choice.tool is not None:
            text, tool_calls, finish_reason = choice.tool.whole(finish_reason)
        positions: list[Position | None] = []
        tokens: list[str] = []
        prompt_logprobs: list[Any] | None = None
        index = choice.prompt_index
        if not params.chat and params.prompt_logprobs is not None:
            prompt_positions = self._prompt_positions(plan, index, params.prompt_logprobs)
            prompt_logprobs = prompt_logprobs_json(prompt_positions, plan.prompt_strs[index])
            if params.echo and params.logprobs is not None:
                positions.extend(prompt_positions)
                tokens.extend(plan.prompt_strs[index])
        if params.echo:
            text = plan.prompt_texts[index] + text
        logprobs: dict[str, Any] | None = None
        source = choice.logprob_source
        if source is not None and params.logprobs is not None:
            k = params.logprobs
            sampled = [source.sampled(token_id, k) for token_id in choice.token_ids]
            if params.chat:
                logprobs = chat_logprobs(sampled, k)
            else:
                positions.extend(sampled)
                tokens.extend(position[0].token for position in sampled)
                logprobs = completion_logprobs(positions, tokens, k, 0)
        return ChoiceResult(index=choice.index, text=text, finish_reason=finish_reason,
                            stop_reason=choice.stop_reason, logprobs=logprobs,
                            prompt_logprobs=prompt_logprobs, tool_calls=tool_calls)

    async def _send_whole(
        self, request: web.Request, response: web.Response, record: GroundTruthRecord | None
    ) -> web.Response:
        """Send a whole response now, so the ground truth can stamp the write."""
        await response.prepare(request)
        await response.write_eof()
        if record is not None:
            now = time.perf_counter_ns()
            record.headers_ns = now
            record.chunk_ns.append(now)
            record.chunk_tokens.append(0)  # the token count is filled in at request end
            record.chunk_kinds.append("body")
        return response

    def _fill_record(self, record: GroundTruthRecord, plan: _Plan, state: _RequestState) -> None:
        record.n = plan.params.n
        record.prompt_tokens = sum(len(ids) for ids in plan.prompts)
        record.completion_tokens = sum(choice.delivered for choice in state.choices)
        record.cached_tokens = sum(
            choice.num_cached for choice in state.choices if choice.index % state.n == 0
        )
        record.finish_reasons = [choice.finish_reason for choice in state.choices]
        if not plan.params.stream and record.chunk_kinds and record.status == 200:
            record.chunk_tokens[-1] = record.completion_tokens

    # ------------------------------------------------------------------ other endpoints

    async def _handle_models(self, request: web.Request) -> web.Response:
        body = models_body(
            served_model_names=self.model_names,
            root=self.config.model,
            max_model_len=self.engine_config.max_model_len,
            created=self.created,
            permission_id=self.permission_id,
        )
        return web.Response(body=body, headers={"Content-Type": JSON_CONTENT_TYPE})

    def _check_model(self, model: str | None) -> None:
        """404 for a model name this replica does not serve (no name: the default model)."""
        if model is not None and model not in self.model_names:
            raise RequestError(
                404,
                f"The model `{model}` does not exist. "
                f"Valid aliases: {', '.join(self.model_names)}.",
                "NotFoundError",
                "model",
            )

    async def _handle_tokenize(self, request: web.Request) -> web.Response:
        try:
            body = parse_json_object(await request.read())
            reader = FieldReader(body)
            model = reader.str_("model")
            return_token_strs = reader.bool_("return_token_strs", False)
            if "messages" in body:
                messages = read_messages(reader)
                add_generation_prompt = reader.bool_("add_generation_prompt", True)
                reader.fail_if_any()
                ids, strs = tokenizer.apply_chat_template_with_strs(messages, add_generation_prompt)
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    issue_type = "missing" if prompt is None else "string_type"
                    message = (
                        "Field required" if prompt is None else "Input should be a valid string"
                    )
                    reader.issues.append(
                        {
                            "type": issue_type,
                            "loc": ("body", "prompt"),
                            "msg": message,
                            "input": dict(body) if prompt is None else prompt,
                        }
                    )
                add_special_tokens = reader.bool_("add_special_tokens", True)
                reader.fail_if_any()
                assert isinstance(prompt, str)
                ids, strs = tokenizer.encode_with_strs(prompt, add_special_tokens)
            self._check_model(model)
        except RequestError as err:
            return self._error_response(err, "")
        return _json_response(
            {
                "count": len(ids),
                "max_model_len": self.engine_config.max_model_len,
                "tokens": ids,
                "token_strs": strs if return_token_strs else None,
            },
            200,
        )

    async def _handle_detokenize(self, request: web.Request) -> web.Response:
        try:
            body = parse_json_object(await request.read())
            reader = FieldReader(body)
            model = reader.str_("model")
            reader.fail_if_any()
            token_ids = read_token_ids(body, "tokens")
            self._check_model(model)
        except RequestError as err:
            return self._error_response(err, "")
        return _json_response(
            {"prompt": tokenizer.decode(token_ids, skip_special_tokens=False)}, 200
        )

    async def _handle_health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.dead else 200)

    async def _handle_version(self, request: web.Request) -> web.Response:
        return _json_response({"version": self.config.vllm_version}, 200)

    async def _handle_load(self, request: web.Request) -> web.Response:
        load = self.in_flight if self.config.enable_server_load_tracking else 0
        return _json_response({"server_load": load}, 200)

    async def _handle_metrics(self, request: web.Request) -> web.Response:
        response = web.Response(body=self.metrics.render())
        response.headers["Content-Type"] = METRICS_CONTENT_TYPE
        return response


def _json_response(value: Any, status: int) -> web.Response:
    return web.Response(
        body=compact_json(value).encode(),
        status=status,
        headers={"Content-Type": JSON_CONTENT_TYPE},
    )


__all__ = [
    "RunningReplica",
    "SimConfig",
    "SimReplica",
    "bind",
    "close_replicas",
    "start_replica",
    "start_replicas",
    "system_fingerprint",
]


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
            lambda: _ArrivalStamp(make_protocol()), sock=sock, backlog=1024
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
