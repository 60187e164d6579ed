"""The engine driver: one task per replica steps its `EngineModel` in time and delivers each
step's outputs to the requests that wait for them.

The loop is "plan a step at ``start`` -> sleep until ``start + duration`` -> deliver its
outputs". Steps are scheduled against absolute deadlines on ``time.perf_counter()``: a step
that starts while the previous one just ended begins at the previous deadline, not at the
(slightly later) wake-up, so timer slack does not accumulate into drift; only a lag above
`MAX_SCHEDULE_LAG_S` (an overloaded process) resets the schedule to now.

Outputs are handed to the request's handler through a list and a future (`RequestState`, no
queue object per request); a handler that lags gets several outputs merged into one chunk
(`merge`), as vLLM's ``RequestOutputCollector`` merges deltas for a slow consumer. The
driver also observes what vLLM's engine core observes per request (first token, inter-token
latencies, the finished request) into the replica's metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time

from sidecar.sim.engine import EngineConfig, EngineModel, EngineRequest, StepResult
from sidecar.sim.metrics import ReplicaMetrics
from sidecar.sim.planning import Plan
from sidecar.sim.requests import ENGINE_DEAD_MESSAGE, GenerateParams, RequestError, bad_request
from sidecar.sim.sampling import LogprobSource, StopChecker, sampling_seed
from sidecar.sim.tools import ToolCallOutput

log = logging.getLogger(__name__)

# Beyond this lag behind the step schedule, start the next step "now" instead of at the previous
# deadline (the process was starved; catching up step by step would only burst the outputs).
MAX_SCHEDULE_LAG_S = 0.05


class Choice:
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
        request: RequestState,
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
Delivery = tuple[Choice, tuple[int, ...], bool, str | None]


class RequestState:
    """The engine loop's mailbox for one HTTP request (all its choices)."""

    __slots__ = ("pending", "waiter", "choices", "n", "stream_interval", "n_observed", "failed")

    def __init__(self, n: int, stream_interval: int) -> None:
        self.pending: list[Delivery] = []
        self.waiter: asyncio.Future[None] | None = None
        self.choices: list[Choice] = []
        self.n = n
        self.stream_interval = stream_interval
        self.n_observed = False
        self.failed = False

    def push(self, choice: Choice, token_ids: tuple[int, ...], finished: bool) -> None:
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


def merge(batch: list[Delivery]) -> list[Delivery]:
    """Merge consecutive deliveries per choice (a lagging consumer sees one bigger delta)."""
    if len(batch) == 1:
        return batch
    merged: dict[Choice, tuple[tuple[int, ...], bool, str | None]] = {}
    for choice, token_ids, finished, text in batch:
        previous = merged.get(choice)
        if previous is None:
            merged[choice] = (token_ids, finished, text)
        else:
            joined = None if text is None else (previous[2] or "") + text
            merged[choice] = (previous[0] + token_ids, finished, joined)
    return [(choice, ids, finished, text) for choice, (ids, finished, text) in merged.items()]


def sampling_key(params: GenerateParams, prompt_ids: tuple[int, ...], index: int) -> str | None:
    """What a choice's tokens are drawn from: a greedy answer is a function of the prompt
    alone, a seeded one of the prompt, the seed and the choice (vLLM's per-request
    generators); anything else is a fresh draw (None: the engine request's id)."""
    if params.greedy:
        return f"greedy:{sampling_seed(*prompt_ids)}"
    if params.seed is not None:
        return f"seed:{params.seed}:{index}:{sampling_seed(*prompt_ids)}"
    return None


class EngineDriver:
    """Runs one replica's engine model on its event loop and routes its outputs."""

    def __init__(
        self,
        engine: EngineModel,
        engine_config: EngineConfig,
        metrics: ReplicaMetrics,
        index: int,
        *,
        max_num_queued_reqs: int | None,
        serves_tools: bool,
    ) -> None:
        self.engine = engine
        self.engine_config = engine_config
        self.metrics = metrics
        self.index = index
        self.max_num_queued_reqs = max_num_queued_reqs
        self.serves_tools = serves_tools
        self.dead = False
        # Set once the replica shuts down: requests cut short from then on are recorded as
        # "shutdown", not as client disconnects.
        self.closing = False
        self._choices: dict[str, Choice] = {}
        self._live_requests: set[RequestState] = set()
        self._next_engine_id = 0
        self._latest_arrival_s = 0.0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"sim-engine-{self.index}"
            )

    async def stop(self) -> None:
        self.closing = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        for state in list(self._live_requests):
            state.fail()

    # ------------------------------------------------------------------ the engine loop

    async def _run(self) -> None:
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

    def _observe_finished(self, choice: Choice, reason: str, finished_s: float) -> None:
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

    # ------------------------------------------------------------------ requests in and out

    def admit(self, plan: Plan) -> RequestState:
        """Admission control, then hand the request's choices to the engine."""
        if self.dead:
            raise RequestError(500, ENGINE_DEAD_MESSAGE, "InternalServerError")
        limit = self.max_num_queued_reqs
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
        state = RequestState(params.n, interval if interval > engine_interval else 1)
        # Every choice is validated before any reaches the engine: a refused request leaves
        # nothing behind.
        requests = [
            self._engine_request(plan, state, prompt_index, i)
            for prompt_index in range(len(plan.prompts))
            for i in range(params.n)
        ]
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

    def _engine_request(
        self, plan: Plan, state: RequestState, prompt_index: int, i: int
    ) -> tuple[EngineRequest, Choice]:
        """Choice ``i`` of prompt ``prompt_index``: its engine request, checked, and its state."""
        params = plan.params
        tools = params.tools if self.serves_tools else None
        forced = tools is not None and tools.forces_call
        prompt_ids = tuple(plan.prompts[prompt_index])
        engine_id = f"{plan.request_id}#{self._next_engine_id}"
        self._next_engine_id += 1
        key = sampling_key(params, prompt_ids, i)
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
        choice = Choice(
            engine_id,
            i + prompt_index * params.n,
            prompt_index,
            state,
            len(prompt_ids),
            plan.max_tokens[prompt_index],
        )
        choice.tool = tool
        if params.stop and tool is None:  # a tool call's text is not searched: gap
            choice.stop = StopChecker(
                params.stop, params.include_stop_str_in_output, params.min_tokens
            )
        if params.logprobs is not None:
            choice.logprob_source = LogprobSource(
                sampling_seed(self.engine_config.seed, key or engine_id, "logprobs"),
                params.greedy,
                self.engine_config.vocab_size,
            )
        choice.echo_pending = params.echo
        return engine_request, choice

    def abort(self, state: RequestState, reason: str) -> None:
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

    def release(self, state: RequestState) -> None:
        """The request's answer is over: abort what the engine still works on for it."""
        self._live_requests.discard(state)
        if any(not choice.finished for choice in state.choices):
            self.abort(state, "abort")
