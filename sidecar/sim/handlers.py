"""The HTTP layer of a simulated replica: its aiohttp routes and handlers.

A generation request goes: read the body (its arrival stamped by `ArrivalStamp`) -> parse and
validate (`sidecar.sim.requests`) -> its fault, if any (`sidecar.sim.faults`) -> plan it
(`sidecar.sim.planning`) -> admit it to the engine (`sidecar.sim.driver`) -> write the answer
(`sidecar.sim.answers`) -> one ground-truth line (`sidecar.sim.groundtruth`). The other routes
(models, tokenize, detokenize, health, version, load, metrics) answer from the replica's
configuration and state; unknown paths get FastAPI's JSON 404/405, as from vLLM.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from sidecar.sim import tokenizer
from sidecar.sim.answers import JSON_CONTENT_TYPE, AnswerWriter
from sidecar.sim.config import SimConfig
from sidecar.sim.driver import EngineDriver, RequestState
from sidecar.sim.faults import FAULT_HEADER, FaultPlan, FaultSpec, request_fault, status_error
from sidecar.sim.groundtruth import (
    GroundTruthRecord,
    GroundTruthWriter,
    arrival_span_ns,
    request_read,
)
from sidecar.sim.metrics import METRICS_CONTENT_TYPE, ReplicaMetrics
from sidecar.sim.planning import OFFLOAD_BODY_BYTES, Plan, Planner, RefusedInStream
from sidecar.sim.requests import (
    FieldReader,
    GenerateParams,
    RequestError,
    parse_json_object,
    read_generate_params,
    read_messages,
    read_token_ids,
)
from sidecar.sim.shapes import compact_json, models_body

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def vllm_server_headers(_request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = "uvicorn"
    response.headers["Vary"] = "Origin"


def json_response(value: Any, status: int) -> web.Response:
    return web.Response(
        body=compact_json(value).encode(),
        status=status,
        headers={"Content-Type": JSON_CONTENT_TYPE},
    )


def fill_record(record: GroundTruthRecord, plan: Plan, state: RequestState) -> None:
    """A generation's ground-truth totals, once its answer is over."""
    record.n = plan.params.n
    record.prompt_tokens = sum(len(ids) for ids in plan.prompts)
    record.completion_tokens = sum(choice.delivered for choice in state.choices)
    record.cached_tokens = sum(
        choice.num_cached for choice in state.choices if choice.index % state.n == 0
    )
    record.finish_reasons = [choice.finish_reason for choice in state.choices]
    if not plan.params.stream and record.chunk_kinds and record.status == 200:
        record.chunk_tokens[-1] = record.completion_tokens


class Handlers:
    """One replica's routes; `build_app` makes its aiohttp application."""

    def __init__(
        self,
        config: SimConfig,
        index: int,
        *,
        max_model_len: int,
        created: int,
        permission_id: str,
        metrics: ReplicaMetrics,
        driver: EngineDriver,
        planner: Planner,
        answers: AnswerWriter,
        ground_truth: GroundTruthWriter | None,
    ) -> None:
        self.config = config
        self.index = index
        self.model_names = config.model_names
        self.max_model_len = max_model_len
        self.created = created
        self.permission_id = permission_id
        self.metrics = metrics
        self.driver = driver
        self.planner = planner
        self.answers = answers
        self.in_flight = 0
        self._ground_truth = ground_truth
        self._faults = FaultPlan(config.fault, config.fault_rate, config.fault_seed + index)
        self._known_paths: frozenset[str] = frozenset()

    # ------------------------------------------------------------------ the app

    def build_app(self) -> web.Application:
        # No middleware unless an API key asks for one: every coroutine layer between aiohttp
        # and the handler is resumed once per streamed chunk.
        middlewares: list[Any] = []
        if self.config.api_key:
            middlewares.append(self._auth_middleware)
        app = web.Application(middlewares=middlewares)
        # Once per response, not per chunk: vLLM's uvicorn names itself, and its CORS
        # middleware adds Vary: Origin (checked against vLLM 0.32.0 itself).
        app.on_response_prepare.append(vllm_server_headers)
        # Every answer starts after its request was read: the connection's next bytes are the
        # next request's first (`arrival_span_ns` takes a generation request's own earlier).
        app.on_response_prepare.append(request_read)
        routes: list[tuple[str, str, Handler]] = [
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
            return json_response({"detail": "Method Not Allowed"}, 405)
        return json_response({"detail": "Not Found"}, 404)

    @web.middleware
    async def _auth_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method != "OPTIONS" and request.path.startswith("/v1"):
            expected = f"Bearer {self.config.api_key}"
            if request.headers.get("Authorization") != expected:
                return json_response({"error": "Unauthorized"}, 401)
        return await handler(request)

    # ------------------------------------------------------------------ generation endpoints

    async def _handle_generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        raw = await request.read()
        first_byte_ns, received_ns = arrival_span_ns(request)
        record: GroundTruthRecord | None = None
        if self._ground_truth is not None:
            record = GroundTruthRecord(
                replica=self.index,
                endpoint=CHAT_PATH if chat else COMPLETIONS_PATH,
                received_ns=received_ns,
                first_byte_ns=first_byte_ns,
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
            params = read_generate_params(parse_json_object(raw), chat)
            request_id = header_request_id or params.request_id or uuid.uuid4().hex
            if record is not None:
                record.request_id = request_id
                record.stream = params.stream
            fault = self._fault(request, record)
            plan = await self._plan(params, request_id, len(raw), record)
            state = self.driver.admit(plan)
        except RefusedInStream as refusal:
            _record_refusal(record, request_id, 200, "error_event")
            return await self.answers.refuse_in_stream(request, params, request_id, str(refusal))
        except RequestError as err:
            outcome = "rejected" if err.status == 503 else "http_error"
            _record_refusal(record, request_id, err.status, outcome)
            return self.answers.error_response(err, request_id)
        try:
            return await self.answers.answer(request, plan, state, fault, record)
        finally:
            self.driver.release(state)
            if record is not None:
                fill_record(record, plan, state)

    def _fault(self, request: web.Request, record: GroundTruthRecord | None) -> FaultSpec:
        """The request's fault; an injected error status is raised here, before any work."""
        fault = request_fault(self._faults, request.headers.get(FAULT_HEADER))
        if record is not None and not fault.is_empty:
            record.fault = fault.text
        error = status_error(fault)
        if error is not None:
            raise error
        return fault

    async def _plan(
        self,
        params: GenerateParams,
        request_id: str,
        body_bytes: int,
        record: GroundTruthRecord | None,
    ) -> Plan:
        if body_bytes <= OFFLOAD_BODY_BYTES:
            return self.planner.plan(params, request_id)
        try:
            return await self.planner.plan_off_loop(params, request_id)
        except asyncio.CancelledError:
            if record is not None:
                record.cut_short(self.driver.closing)
            raise

    # ------------------------------------------------------------------ other endpoints

    async def _handle_models(self, request: web.Request) -> web.Response:
        body = models_body(
            served_model_names=self.model_names,
            root=self.config.model,
            max_model_len=self.max_model_len,
            created=self.created,
            permission_id=self.permission_id,
        )
        return web.Response(body=body, headers={"Content-Type": JSON_CONTENT_TYPE})

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
                    _prompt_issue(reader, body, prompt)
                add_special_tokens = reader.bool_("add_special_tokens", True)
                reader.fail_if_any()
                assert isinstance(prompt, str)
                ids, strs = tokenizer.encode_with_strs(prompt, add_special_tokens)
            self.planner.check_model(model)
        except RequestError as err:
            return self.answers.error_response(err, "")
        return json_response(
            {
                "count": len(ids),
                "max_model_len": self.max_model_len,
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
            self.planner.check_model(model)
        except RequestError as err:
            return self.answers.error_response(err, "")
        return json_response(
            {"prompt": tokenizer.decode(token_ids, skip_special_tokens=False)}, 200
        )

    async def _handle_health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.driver.dead else 200)

    async def _handle_version(self, request: web.Request) -> web.Response:
        return json_response({"version": self.config.vllm_version}, 200)

    async def _handle_load(self, request: web.Request) -> web.Response:
        load = self.in_flight if self.config.enable_server_load_tracking else 0
        return json_response({"server_load": load}, 200)

    async def _handle_metrics(self, request: web.Request) -> web.Response:
        response = web.Response(body=self.metrics.render())
        response.headers["Content-Type"] = METRICS_CONTENT_TYPE
        return response


def _record_refusal(
    record: GroundTruthRecord | None, request_id: str, status: int, outcome: str
) -> None:
    """A generation refused before the engine saw it, in the ground truth."""
    if record is not None:
        record.request_id = record.request_id or request_id or uuid.uuid4().hex
        record.status = status
        record.outcome = outcome


def _prompt_issue(reader: FieldReader, body: dict[str, Any], prompt: object) -> None:
    """/tokenize's ``prompt`` missing or not a string: pydantic's issue for it."""
    reader.issues.append(
        {
            "type": "missing" if prompt is None else "string_type",
            "loc": ("body", "prompt"),
            "msg": "Field required" if prompt is None else "Input should be a valid string",
            "input": dict(body) if prompt is None else prompt,
        }
    )
