"""From a generation request's parameters to a `Plan` the engine can take: vLLM's checks
against the served model (model name, lengths, sampling limits), and the prompts tokenized.

Planning is pure, so a large prompt's can run on the replica's tokenizer thread: prompts of
more than `OFFLOAD_BODY_BYTES` are tokenized there (as vLLM tokenizes off its event loop), in
slices that let the loop's thread take the GIL in between, so that a 370 KB prompt does not
stall the replica's other streams for the ~20 ms it takes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
from dataclasses import dataclass, field

from sidecar.sim import tokenizer
from sidecar.sim.config import SimConfig
from sidecar.sim.engine import EngineConfig
from sidecar.sim.requests import (
    GREEDY_EPS,
    MAX_LOGPROBS,
    GenerateParams,
    RequestError,
    bad_request,
    parse_json_object,
    read_generate_params,
)
from sidecar.sim.shapes import Era
from sidecar.sim.tools import tool_refusal

# Bodies above this size are tokenized on the replica's tokenizer thread (below it the thread
# hop costs more than the ~1 ms of tokenizing on the loop), in slices of TOKENIZE_SLICE_CHARS
# characters (~0.5 ms each) with the GIL released in between.
OFFLOAD_BODY_BYTES = 16 * 1024
TOKENIZE_SLICE_CHARS = 8192


class RefusedInStream(Exception):
    """A request vLLM refuses only once its stream has begun: 200, an error event, [DONE]."""


@dataclass
class Plan:
    """A validated generation request, tokenized and resolved, ready for the engine."""

    params: GenerateParams
    request_id: str
    prompts: list[list[int]]
    max_tokens: list[int]
    # Echo and prompt logprobs only: each prompt's text and each of its tokens' strings.
    prompt_texts: list[str] = field(default_factory=list)
    prompt_strs: list[list[str]] = field(default_factory=list)


def token_str(token_id: int) -> str:
    """A token's string as vLLM's logprobs name it: pad/BOS/EOS by their names."""
    if token_id <= tokenizer.EOS_ID:
        return tokenizer.SPECIAL_TOKEN_STRS[token_id]
    return tokenizer.token_text(token_id)


class Planner:
    """One replica's request checks and tokenization, and its tokenizer thread."""

    def __init__(
        self, config: SimConfig, engine_config: EngineConfig, era: Era, index: int
    ) -> None:
        self.model_names = config.model_names
        self.serves_tools = config.serves_tools
        self.max_model_len = engine_config.max_model_len
        self.vocab_size = engine_config.vocab_size
        self.era = era
        self.index = index
        self.tokenizer_thread: concurrent.futures.ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ the tokenizer thread

    def _tokenizer(self) -> concurrent.futures.ThreadPoolExecutor:
        pool = self.tokenizer_thread
        if pool is None:
            # One thread per replica, as vLLM's API server has one tokenizer thread.
            pool = self.tokenizer_thread = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"sim-tokenizer-{self.index}"
            )
        return pool

    def shutdown(self) -> None:
        pool, self.tokenizer_thread = self.tokenizer_thread, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def warm_up(self) -> None:
        """Plan a chat and a completion once (the JSON reading and validation of both)."""
        chat_raw = (
            b'{"model":null,"messages":[{"role":"user","content":"warm up"}],"max_tokens":2,'
            b'"stream":true,"stream_options":{"include_usage":true}}'
        )
        completion_raw = b'{"model":null,"prompt":["warm up",[5,6,7]],"max_tokens":2}'
        for raw, chat in ((chat_raw, True), (completion_raw, False)):
            params = read_generate_params(parse_json_object(raw), chat)
            with contextlib.suppress(RequestError):  # e.g. a context shorter than the prompt
                self.plan(params, "warm-up", slice_chars=TOKENIZE_SLICE_CHARS)

    async def warm_up_thread(self) -> None:
        # Awaited, not waited for: the replica starts on a running loop, which a blocking
        # wait would hold up (tests/conftest.py fails a test whose code blocks the loop).
        await asyncio.wrap_future(self._tokenizer().submit(tokenizer.warm))

    async def plan_off_loop(self, params: GenerateParams, request_id: str) -> Plan:
        """`plan` on the tokenizer thread (a large prompt), its text tokenized in slices."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._tokenizer(),
            functools.partial(self.plan, params, request_id, slice_chars=TOKENIZE_SLICE_CHARS),
        )

    # ------------------------------------------------------------------ checks

    def check_model(self, model: str | None) -> None:
        """404 for a model name this replica does not serve (no name: the default model)."""
        if model is not None and model not in self.model_names:
            raise RequestError(
                404,
                f"The model `{model}` does not exist. "
                f"Valid aliases: {', '.join(self.model_names)}.",
                "NotFoundError",
                "model",
            )

    def resolve_max_tokens(self, prompt_len: int, requested: int | None, param: str) -> int:
        """vLLM's length checks (``TokenizeParams`` then ``SamplingParams``), same messages."""
        max_model_len = self.max_model_len
        if requested is not None and requested > max_model_len:
            raise bad_request(
                f"{param}={requested} cannot be greater than max_model_len={max_model_len}. "
                "Please request fewer output tokens.",
                param,
                requested,
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
                    "input prompt.",
                    "input_tokens",
                    count,
                )
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
                "input_tokens",
                prompt_len,
            )
        max_tokens = max_model_len - prompt_len if requested is None else requested
        if max_tokens < 1:
            raise bad_request(
                f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens
            )
        return max_tokens

    def _check_sampling(self, params: GenerateParams) -> None:
        """The checks that need no tokens, in vLLM's order."""
        self.check_model(params.model)
        refusal = tool_refusal(params.tools, self.serves_tools)
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
                "stream_interval",
                params.stream_interval,
            )
        if params.min_tokens < 0:
            raise bad_request(
                f"min_tokens must be greater than or equal to 0, got {params.min_tokens}.",
                "min_tokens",
                params.min_tokens,
            )

    def _check_logprobs(self, params: GenerateParams) -> None:
        """SamplingParams._validate_logprobs, against vLLM's default --max-logprobs."""
        for count, name, what in (
            (params.logprobs, "logprobs", "sample"),
            (params.prompt_logprobs, "prompt_logprobs", "prompt"),
        ):
            if count:
                count = self.vocab_size if count == -1 else count
                if count > MAX_LOGPROBS:
                    raise bad_request(
                        f"Requested {what} logprobs of {count}, which is greater "
                        f"than max allowed: {MAX_LOGPROBS}",
                        name,
                        count,
                    )

    # ------------------------------------------------------------------ planning

    def plan(self, params: GenerateParams, request_id: str, slice_chars: int = 0) -> Plan:
        """Validate and tokenize (pure: it may run on the tokenizer thread)."""
        self._check_sampling(params)
        prompts = self._tokenize(params, slice_chars)
        max_tokens: list[int] = []
        for ids in prompts:
            resolved = self.resolve_max_tokens(len(ids), params.max_tokens, params.max_tokens_param)
            if params.min_tokens > resolved:
                raise bad_request(
                    f"min_tokens must be less than or equal to max_tokens={resolved}, "
                    f"got {params.min_tokens}.",
                    "min_tokens",
                    params.min_tokens,
                )
            max_tokens.append(resolved)
        self._check_logprobs(params)
        plan = Plan(params=params, request_id=request_id, prompts=prompts, max_tokens=max_tokens)
        if params.echo or params.prompt_logprobs is not None:
            describe_prompts(plan)
        return plan

    def _tokenize(self, params: GenerateParams, slice_chars: int) -> list[list[int]]:
        """The request's prompts as token ids: the chat template's, or each prompt's."""
        if params.chat:
            return [
                tokenizer.apply_chat_template(
                    params.messages, params.add_generation_prompt, slice_chars
                )
            ]
        prompts: list[list[int]] = []
        vocab_size = self.vocab_size
        for prompt in params.prompts:
            if isinstance(prompt, str):
                prompts.append(tokenizer.encode(prompt, params.add_special_tokens, slice_chars))
                continue
            out_of_vocab = [t for t in prompt if not 0 <= t < vocab_size]
            if out_of_vocab:
                # vLLM finds it in the engine's input processing: a 400 (a ValueError, no
                # param) for a whole answer, after the head (an error event) for a stream.
                message = f"Token id {max(out_of_vocab)} is out of vocabulary"
                if params.stream:
                    raise RefusedInStream(message)
                raise bad_request(message)
            prompts.append(list(prompt))
        return prompts


def describe_prompts(plan: Plan) -> None:
    """The prompts' texts (what echo shows) and their tokens' strings (what logprobs of
    prompt tokens name): a text prompt's own pieces; token ids decoded one by one."""
    params = plan.params
    if params.chat:
        ids, strs = tokenizer.apply_chat_template_with_strs(
            params.messages, params.add_generation_prompt
        )
        plan.prompt_texts.append("")
        plan.prompt_strs.append(strs)
        return
    for prompt, ids in zip(params.prompts, plan.prompts, strict=True):
        if isinstance(prompt, str):
            _, strs = tokenizer.encode_with_strs(prompt, params.add_special_tokens)
            plan.prompt_texts.append(prompt)
        else:
            strs = [token_str(t) for t in ids]
            plan.prompt_texts.append(tokenizer.decode(ids))
        plan.prompt_strs.append(strs)
