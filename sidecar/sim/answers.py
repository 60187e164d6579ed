"""Writing the answer to an admitted generation request: a stream of SSE chunks as the engine
makes tokens visible, or one whole JSON body once every choice has finished.

Headers go out at admission (a stream) or with the body (a whole answer); each delivery of the
engine driver becomes one chunk carrying as many tokens as the engine made visible. What a
chunk or a choice shows (text, stop reasons, tool calls, logprobs, the echoed prompt) is built
here from the request's `Plan` and the choice's state; the byte-exact shapes are
`sidecar.sim.shapes`'. A request's fault is applied through `sidecar.sim.faults.FaultInjector`,
and every socket write is stamped into the ground truth (`GroundTruthRecord.stamp`).
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from typing import Any

from aiohttp import web

from sidecar.sim import tokenizer
from sidecar.sim.config import SimConfig
from sidecar.sim.driver import Choice, EngineDriver, RequestState, merge
from sidecar.sim.engine import EngineConfig
from sidecar.sim.faults import FaultInjector, FaultSpec, ResetConnection
from sidecar.sim.groundtruth import GroundTruthRecord
from sidecar.sim.metrics import ReplicaMetrics
from sidecar.sim.planning import Plan
from sidecar.sim.requests import (
    BAD_REQUEST_ERROR,
    ENGINE_DEAD_MESSAGE,
    GenerateParams,
    RequestError,
)
from sidecar.sim.sampling import LogprobSource, Position, sampling_seed
from sidecar.sim.shapes import (
    DONE_EVENT,
    KEEPALIVE_EVENT,
    ChoiceResult,
    Era,
    RequestTimings,
    StreamFormatter,
    WholeAnswer,
    chat_completion_body,
    chat_logprobs,
    compact_json,
    completion_body,
    completion_logprobs,
    error_body,
    prompt_logprobs_json,
)

JSON_CONTENT_TYPE = "application/json"
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"


def decode(token_ids: tuple[int, ...]) -> str:
    if len(token_ids) == 1:
        return tokenizer.token_text(token_ids[0])
    return tokenizer.decode(token_ids)


class AnswerWriter:
    """One replica's answers: streamed, whole, refused in stream, or an error body."""

    def __init__(
        self,
        config: SimConfig,
        engine_config: EngineConfig,
        era: Era,
        fingerprint: str,
        driver: EngineDriver,
        metrics: ReplicaMetrics,
    ) -> None:
        self.config = config
        self.era = era
        self.fingerprint = fingerprint
        self.model_name = config.model_names[0]
        self.driver = driver
        self.metrics = metrics
        self.seed = engine_config.seed
        self.vocab_size = engine_config.vocab_size

    # ------------------------------------------------------------------ heads and errors

    def response_headers(self, request_id: str, content_type: str) -> dict[str, str]:
        headers = {"Content-Type": content_type}
        if self.config.enable_request_id_headers:
            headers["X-Request-Id"] = request_id or uuid.uuid4().hex
        return headers

    def error_response(self, err: RequestError, request_id: str) -> web.Response:
        body = compact_json(error_body(err.message, err.err_type, err.status, err.param)).encode()
        return web.Response(
            body=body,
            status=err.status,
            headers=self.response_headers(request_id, JSON_CONTENT_TYPE),
        )

    async def refuse_in_stream(
        self, request: web.Request, params: GenerateParams, request_id: str | None, message: str
    ) -> web.StreamResponse:
        formatter = StreamFormatter(
            chat=params.chat,
            response_id="",
            created=0,
            model=params.model or "",
            profile=self.config.profile,
            fingerprint=self.fingerprint,
            include_usage=False,
            era=self.era,
        )
        rid = request_id or uuid.uuid4().hex
        response = web.StreamResponse(
            status=200, headers=self.response_headers(rid, SSE_CONTENT_TYPE)
        )
        await response.prepare(request)
        await response.write(formatter.error_event(message, BAD_REQUEST_ERROR, 400))
        await response.write(DONE_EVENT)
        await response.write_eof()
        return response

    def warm_up(self, created: int) -> None:
        """Render each kind of chunk and body once (what a first answer would pay for)."""
        formatter = StreamFormatter(
            chat=True,
            response_id="chatcmpl-warm-up",
            created=created,
            model=self.model_name,
            profile=self.config.profile,
            fingerprint=self.fingerprint,
            include_usage=True,
            era=self.era,
        )
        formatter.role_chunk(0, "assistant", (1, 0))
        formatter.token_chunk(0, decode((300,)), None, (1, 1))
        formatter.token_chunk(0, decode((301, tokenizer.EOS_ID)), "stop", (1, 3))
        formatter.usage_chunk(
            1,
            3,
            0,
            RequestTimings.from_instants(
                arrival_s=0.0,
                scheduled_s=0.0,
                first_token_s=0.1,
                last_token_s=0.2,
                num_generation_tokens=3,
            ),
        )
        answer = WholeAnswer(
            created=created,
            model=self.model_name,
            choices=[ChoiceResult(index=0, text="warm", finish_reason="stop")],
            prompt_tokens=1,
            completion_tokens=1,
            cached_tokens=None,
            timings=None,
            fingerprint=self.fingerprint,
            profile=self.config.profile,
            era=self.era,
        )
        chat_completion_body(answer, response_id="chatcmpl-warm-up", role="assistant")
        completion_body(answer, response_id="cmpl-warm-up")
        error_body("warm up", BAD_REQUEST_ERROR, 400)

    # ------------------------------------------------------------------ what an answer reports

    def usage_flags(self, params: GenerateParams) -> tuple[bool, bool]:
        """(a usage chunk at the end, usage on every chunk) for a stream."""
        if self.config.enable_force_include_usage:
            return True, True
        options = params.stream_options
        if options is None or not options.include_usage:
            return False, False
        return True, options.continuous_usage_stats

    def timings(self, state: RequestState) -> RequestTimings | None:
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

    def cached_tokens(self, state: RequestState) -> int | None:
        if not self.config.enable_prompt_tokens_details:
            return None
        # One count per prompt (its first choice), as vLLM reports the prompt's cache hits.
        return sum(choice.num_cached for choice in state.choices if choice.index % state.n == 0)

    def response_role(self, params: GenerateParams) -> str:
        if not params.add_generation_prompt and params.messages:
            return params.messages[-1].role
        return self.config.response_role

    def prompt_positions(self, plan: Plan, prompt_index: int, k: int) -> list[Position | None]:
        """A prompt's logprobs: none for its first token, then each token's position with
        ``k`` alternatives; a function of the prompt (the same for every choice and request)."""
        ids = plan.prompts[prompt_index]
        source = LogprobSource(sampling_seed(self.seed, "prompt", *ids), True, self.vocab_size)
        positions: list[Position | None] = [None]
        positions.extend(source.prompt(token_id, k) for token_id in ids[1:])
        return positions

    def rich_token_chunk(
        self,
        formatter: StreamFormatter,
        plan: Plan,
        choice: Choice,
        token_ids: tuple[int, ...],
        text: str,
        finished: bool,
        usage: tuple[int, int] | None,
        delta: str | None = None,
    ) -> bytes:
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
                positions.extend(self.prompt_positions(plan, choice.prompt_index, params.logprobs))
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
            choice.index,
            text,
            choice.finish_reason if finished else None,
            usage,
            logprobs=logprobs,
            stop_reason=choice.stop_reason,
            prompt_token_ids=prompt_ids,
            delta=delta,
        )

    def whole_choice(self, plan: Plan, choice: Choice) -> ChoiceResult:
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
            prompt_positions = self.prompt_positions(plan, index, params.prompt_logprobs)
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
        return ChoiceResult(
            index=choice.index,
            text=text,
            finish_reason=finish_reason,
            stop_reason=choice.stop_reason,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            tool_calls=tool_calls,
        )

    # ------------------------------------------------------------------ the two answers

    def _injector(
        self,
        request: web.Request,
        state: RequestState,
        fault: FaultSpec,
        record: GroundTruthRecord | None,
    ) -> FaultInjector | None:
        if fault.is_empty:
            return None
        return FaultInjector(fault, request, record, functools.partial(self.driver.abort, state))

    async def answer(
        self,
        request: web.Request,
        plan: Plan,
        state: RequestState,
        fault: FaultSpec,
        record: GroundTruthRecord | None,
    ) -> web.StreamResponse:
        """The answer to an admitted request: streamed, or whole, as it asked (with ``fault``
        injected)."""
        injector = self._injector(request, state, fault, record)
        if plan.params.stream:
            return await _Stream(self, request, plan, state, injector, record).run()
        return await self._whole(request, plan, state, injector, record)

    async def _whole(
        self,
        request: web.Request,
        plan: Plan,
        state: RequestState,
        injector: FaultInjector | None,
        record: GroundTruthRecord | None,
    ) -> web.StreamResponse:
        """A non-streaming answer: wait for every choice, then one JSON body."""
        try:
            await self._collect(state, injector)
        except RequestError as err:
            if record is not None:
                record.status = err.status
                record.outcome = "http_error"
            return await self.send_whole(request, self.error_response(err, plan.request_id), record)
        except ResetConnection:
            raise asyncio.CancelledError() from None
        except (asyncio.CancelledError, ConnectionError):
            if record is not None:
                record.cut_short(self.driver.closing)
            self.driver.abort(state, "abort")
            raise asyncio.CancelledError() from None
        body = self._whole_body(plan, state)
        if injector is not None:
            body = injector.cut(body)
            await injector.delay_headers()
        response = web.Response(
            body=body,
            status=200,
            headers=self.response_headers(plan.request_id, JSON_CONTENT_TYPE),
        )
        return await self.send_whole(request, response, record)

    async def _collect(self, state: RequestState, injector: FaultInjector | None) -> None:
        """Wait for every choice of a whole answer to finish, keeping its tokens."""
        loop = asyncio.get_running_loop()
        remaining = len(state.choices)
        outputs = 0
        while remaining:
            if not state.pending:
                if state.failed:
                    self.driver.abort(state, "error")
                    raise RequestError(500, ENGINE_DEAD_MESSAGE, "InternalServerError")
                waiter: asyncio.Future[None] = loop.create_future()
                state.waiter = waiter
                await waiter
                continue
            if injector is not None:
                await injector.stall(outputs)
            batch = state.pending
            state.pending = []
            for choice, token_ids, finished, _text in batch:
                if injector is not None:
                    injector.before_whole_output(outputs)
                choice.token_ids.extend(token_ids)
                choice.delivered += len(token_ids)
                outputs += 1
                if finished:
                    remaining -= 1

    def _whole_body(self, plan: Plan, state: RequestState) -> bytes:
        params = plan.params
        choices = [self.whole_choice(plan, choice) for choice in state.choices]
        tools = params.tools
        if self.config.serves_tools and tools is not None and tools.choice.kind == "auto":
            # The parser reads each whole choice once (abstract_parser.py 626-652).
            self.metrics.count_tool_parser_invocations(streaming=False, count=len(choices))
        prompt_tokens = sum(len(ids) for ids in plan.prompts)
        completion_tokens = sum(choice.delivered for choice in state.choices)
        answer = WholeAnswer(
            created=int(time.time()),
            model=params.model or self.model_name,
            choices=choices,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=self.cached_tokens(state),
            timings=self.timings(state),
            fingerprint=self.fingerprint,
            profile=self.config.profile,
            era=self.era,
        )
        if not params.chat:
            return completion_body(answer, response_id="cmpl-" + plan.request_id)
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs_json(
                self.prompt_positions(plan, 0, params.prompt_logprobs), plan.prompt_strs[0]
            )
        return chat_completion_body(
            answer,
            response_id="chatcmpl-" + plan.request_id,
            role=self.response_role(params),
            prompt_logprobs=prompt_logprobs,
        )

    async def send_whole(
        self, request: web.Request, response: web.Response, record: GroundTruthRecord | None
    ) -> web.Response:
        """Send a whole response now, so the ground truth can stamp the write."""
        await response.prepare(request)
        await response.write_eof()
        if record is not None:
            record.stamp(0, "body")  # the token count is filled in at request end
            record.headers_ns = record.chunk_ns[-1]
        return response


class _Stream:
    """One streamed answer: role chunks, token chunks as the engine delivers, usage, [DONE]."""

    def __init__(
        self,
        writer: AnswerWriter,
        request: web.Request,
        plan: Plan,
        state: RequestState,
        injector: FaultInjector | None,
        record: GroundTruthRecord | None,
    ) -> None:
        self.writer = writer
        self.request = request
        self.plan = plan
        self.state = state
        self.injector = injector
        self.record = record
        params = plan.params
        chat = params.chat
        self.include_usage, self.continuous = writer.usage_flags(params)
        self.formatter = StreamFormatter(
            chat=chat,
            response_id=("chatcmpl-" if chat else "cmpl-") + plan.request_id,
            created=int(time.time()),
            model=params.model or writer.model_name,
            profile=writer.config.profile,
            fingerprint=writer.fingerprint,
            include_usage=self.include_usage,
            era=writer.era,
        )
        # Per choice, tokens of tool-call text vLLM sends no event for: the ground truth counts
        # them with the choice's next event.
        self.unsent_tokens: dict[int, int] = {}
        # With a tool parser every chat delta goes through it (serving.py 662-676). Under
        # tool_choice "none" (a request without tools too) it gives no delta for empty text
        # (abstract_parser.py 706-727): such an event is dropped, or with a finish or logprobs
        # sent with "delta":{} (serving.py 700-716); checked against the real server. Under
        # "auto" the parser's own streaming reads every delta (counted in its metric).
        serves_tools = writer.config.serves_tools
        tools = params.tools if chat and serves_tools else None
        self.drop_empty = chat and serves_tools and (tools is None or tools.choice.kind == "none")
        self.auto_tools = tools is not None and tools.choice.kind == "auto"

    async def run(self) -> web.StreamResponse:
        state = self.state
        record = self.record
        injector = self.injector
        if injector is not None:
            await injector.delay_headers()
        response = web.StreamResponse(
            status=200,
            headers=self.writer.response_headers(self.plan.request_id, SSE_CONTENT_TYPE),
        )
        await response.prepare(self.request)
        if record is not None:
            record.headers_ns = time.perf_counter_ns()
        write = response.write
        remaining = len(state.choices)
        role_pending = self.plan.params.chat
        token_chunks = 0
        try:
            while remaining:
                if not state.pending:
                    if state.failed:
                        await self._fail(response)
                        return response
                    await self._wait(response)
                    continue
                if injector is not None:
                    await injector.stall(token_chunks)
                batch = state.pending
                state.pending = []
                if role_pending:
                    role_pending = False
                    await self._write_roles(response)
                for choice, token_ids, finished, text in batch if len(batch) == 1 else merge(batch):
                    if injector is not None and await injector.before_stream_chunk(
                        response, self.formatter, token_chunks, choice.index
                    ):
                        return response
                    chunk = self._token_chunk(choice, token_ids, finished, text)
                    if chunk is None:
                        continue
                    await write(chunk[0])
                    if record is not None:
                        record.stamp(chunk[1], "token")
                    token_chunks += 1
                    if finished:
                        remaining -= 1
            if injector is not None:
                await injector.end_gap()
            await self._write_tail(response)
            if injector is not None:
                await injector.end_gap()
            await response.write_eof()
            return response
        except ResetConnection:
            raise asyncio.CancelledError() from None
        except (asyncio.CancelledError, ConnectionError):
            if record is not None:
                record.cut_short(self.writer.driver.closing)
            self.writer.driver.abort(state, "abort")
            raise asyncio.CancelledError() from None

    async def _wait(self, response: web.StreamResponse) -> None:
        """Wait for the engine's next delivery, sending keep-alives while there is none."""
        state = self.state
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        state.waiter = waiter
        keep_alive_s = self.writer.config.sse_keep_alive_interval
        if keep_alive_s > 0:
            try:
                await asyncio.wait_for(waiter, keep_alive_s)
            except asyncio.TimeoutError:
                state.waiter = None
                await response.write(KEEPALIVE_EVENT)
                if self.record is not None:
                    self.record.stamp(0, "keepalive")
        else:
            await waiter

    async def _fail(self, response: web.StreamResponse) -> None:
        """The engine died under the stream: an error event and [DONE] (no ground-truth stamps
        for these two writes)."""
        await response.write(
            self.formatter.error_event(ENGINE_DEAD_MESSAGE, "InternalServerError", 500)
        )
        await response.write(DONE_EVENT)
        if self.record is not None:
            self.record.outcome = "error_event"
        self.writer.driver.abort(self.state, "error")
        await response.write_eof()

    async def _write_roles(self, response: web.StreamResponse) -> None:
        """A chat stream's first chunk per choice: the role, no content."""
        role = self.writer.response_role(self.plan.params)
        for choice in self.state.choices:
            usage = (choice.prompt_tokens, 0) if self.continuous else None
            await response.write(self.formatter.role_chunk(choice.index, role, usage))
            if self.record is not None:
                self.record.stamp(0, "role")

    def _token_chunk(
        self, choice: Choice, token_ids: tuple[int, ...], finished: bool, text: str | None
    ) -> tuple[bytes, int] | None:
        """One delivery's chunk and the output tokens it accounts for, or None when vLLM
        sends no event for it (its tokens then go with the choice's next event)."""
        count = len(token_ids)
        choice.delivered += count
        usage = (choice.prompt_tokens, choice.delivered) if self.continuous else None
        if text is None:
            text = decode(token_ids)
        unsent = self.unsent_tokens
        formatter = self.formatter
        tool = choice.tool
        if tool is not None:
            delta = tool.delta(text)
            if delta is None and not finished:
                unsent[choice.index] = unsent.get(choice.index, 0) + count
                return None
            chunk = formatter.token_chunk(
                choice.index,
                "",
                tool.stream_finish_reason(choice.finish_reason or "stop") if finished else None,
                usage,
                delta="{}" if delta is None else delta,
            )
            return chunk, count + unsent.pop(choice.index, 0)
        empty_delta: str | None = None
        if self.auto_tools:
            self.writer.metrics.count_tool_parser_invocations(streaming=True)
        elif self.drop_empty and not text:
            if not finished and choice.logprob_source is None:
                unsent[choice.index] = unsent.get(choice.index, 0) + count
                return None
            empty_delta = "{}"
        count += unsent.pop(choice.index, 0)
        if choice.logprob_source is None and not choice.echo_pending:
            chunk = formatter.token_chunk(
                choice.index,
                text,
                choice.finish_reason if finished else None,
                usage,
                stop_reason=choice.stop_reason,
                delta=empty_delta,
            )
        else:
            chunk = self.writer.rich_token_chunk(
                formatter, self.plan, choice, token_ids, text, finished, usage, empty_delta
            )
        return chunk, count

    async def _write_tail(self, response: web.StreamResponse) -> None:
        """Every choice finished: the usage chunk (if asked for), then [DONE]."""
        state = self.state
        record = self.record
        if self.include_usage:
            prompt_tokens = sum(len(ids) for ids in self.plan.prompts)
            completion_tokens = sum(choice.delivered for choice in state.choices)
            await response.write(
                self.formatter.usage_chunk(
                    prompt_tokens,
                    completion_tokens,
                    self.writer.cached_tokens(state),
                    self.writer.timings(state),
                )
            )
            if record is not None:
                record.stamp(0, "usage")
            if self.injector is not None:
                await self.injector.end_gap()
        await response.write(DONE_EVENT)
        if record is not None:
            record.stamp(0, "done")
