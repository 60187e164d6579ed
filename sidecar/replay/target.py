"""What a replay or a sweep asks of its target before and around its load: the model it
serves, its tokenizer (prompt calibration, token ids), its version and its engine counters.
Every function here is best effort except `first_model`, whose failure means there is no
target at all (`TargetUnreachable`)."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from sidecar.engine_metrics import parse_engine_metrics
from sidecar.replay.options import UsageError
from sidecar.replay.payload import (
    DEFAULT_TOKEN_IDS,
    WORDS,
    TokenCalibration,
    TokenIds,
    text_prompt,
)
from sidecar.replay.peers import vllm_bench_counters


class TargetUnreachable(UsageError, ValueError):
    """Nothing answers at the target (refused, timed out, not resolvable)."""


def checked_target(target: str) -> str:
    """The target's base URL, refused at once when it is not an http(s) URL (a bare host:port
    used to reach the first request and come back as "no model")."""
    parts = urlsplit(target.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UsageError(f"--target must be an http(s) URL like http://127.0.0.1:8000: {target!r}")
    return target.strip().rstrip("/")


async def first_model(session: aiohttp.ClientSession, target: str) -> str | None:
    """The first model the target's /v1/models lists; None when it lists none or answers
    something else. Raises TargetUnreachable when nothing answers there."""
    try:
        async with session.get(target + "/v1/models") as response:
            body = await response.json(content_type=None)
    except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
        cause = str(exc) or type(exc).__name__
        raise TargetUnreachable(f"{target} is unreachable: {cause}") from None
    except (aiohttp.ClientError, ValueError):
        return None
    data = body.get("data") if isinstance(body, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict):
        model = data[0].get("id")
        return model if isinstance(model, str) else None
    return None


async def _tokenize(session: aiohttp.ClientSession, target: str, body: dict[str, Any]) -> Any:
    """The target's ``/tokenize`` answer to ``body``, as JSON whatever its content type."""
    async with session.post(target + "/tokenize", json=body) as response:
        return await response.json(content_type=None)


async def calibrate(session: aiohttp.ClientSession, target: str, model: str) -> TokenCalibration:
    """Tokens per generated word and the chat template's overhead, from the target's
    /tokenize; without it, one token per word (input lengths then approximate)."""
    words = 500
    sample = text_prompt(words, 12345, TokenCalibration())
    try:
        plain = await _tokenize(
            session, target, {"model": model, "prompt": sample, "add_special_tokens": False}
        )
        chat = await _tokenize(
            session, target, {"model": model, "messages": [{"role": "user", "content": sample}]}
        )
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return TokenCalibration()
    if not (
        isinstance(plain, dict)
        and isinstance(plain.get("count"), int)
        and isinstance(chat, dict)
        and isinstance(chat.get("count"), int)
    ):
        return TokenCalibration()
    per_word = plain["count"] / words
    return TokenCalibration(
        tokens_per_word=per_word, chat_overhead=max(0, chat["count"] - plain["count"])
    )


# Text for the target's tokenizer to turn into ids a rebuilt prompt may use: words, numbers,
# letters and punctuation, so that the ids are many and spread over the vocabulary.
_TOKEN_SAMPLE = " ".join(
    [
        *WORDS,
        *(f"{w.capitalize()}{i}" for i, w in enumerate(WORDS)),
        *(str(n) for n in range(0, 1000, 7)),
        *("".join(chr(c) for c in range(start, start + 8)) for start in range(33, 127, 8)),
        "the quick brown fox jumps over the lazy dog; THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG",
    ]
)


async def probe_token_ids(session: aiohttp.ClientSession, target: str, model: str) -> TokenIds:
    """Token ids the target's tokenizer produced for varied text (vLLM's ``/tokenize``): every
    one is in its vocabulary, whatever its size. Without the endpoint, the default range (which
    fits vocabularies of 30k ids and more)."""
    try:
        answer = await _tokenize(
            session, target, {"model": model, "prompt": _TOKEN_SAMPLE, "add_special_tokens": False}
        )
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return DEFAULT_TOKEN_IDS
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, list):
        return DEFAULT_TOKEN_IDS
    ids = sorted({t for t in tokens if type(t) is int and t >= 0})
    if len(ids) < 32:
        return DEFAULT_TOKEN_IDS  # too few to make prompts that differ
    return TokenIds(ids=tuple(ids), source="the target's /tokenize")


async def engine_version(session: aiohttp.ClientSession, target: str) -> str | None:
    """The target's /version (vLLM and the simulator serve it), best effort."""
    try:
        async with session.get(target + "/version") as response:
            body = await response.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None
    version = body.get("version") if isinstance(body, dict) else None
    return version if isinstance(version, str) else None


async def server_counters(target: str) -> dict[str, Any] | None:
    """The target's /metrics counters that vllm bench reads (`vllm_bench_counters`); None
    when it serves no /metrics."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
            session.get(target + "/metrics") as response,
        ):
            if response.status != 200:
                return None
            return vllm_bench_counters(await response.text())
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


async def scrape_engine(session: aiohttp.ClientSession, target: str) -> dict[str, Any] | None:
    """The engine's counters from the target's /metrics, with its flavour ("vllm",
    "sglang"); None when it serves none the sidecar reads."""
    try:
        async with session.get(target + "/metrics") as response:
            if response.status != 200:
                return None
            text = await response.text()
        values, flavour = parse_engine_metrics(text)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None
    return {"flavour": flavour, "values": values} if flavour else None


def engine_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, float]:
    """The engine's counters over a run (two `scrape_engine` views), with the prefix-cache
    hit rate they give."""
    if not before or not after:
        return {}
    b, a = before.get("values", {}), after.get("values", {})
    out = {
        k: a[k] - b[k]
        for k in (
            "prefix_cache_queries",
            "prefix_cache_hits",
            "preemptions",
            "prompt_tokens",
            "generation_tokens",
            "cached_tokens",
        )
        if k in a and k in b
    }
    if out.get("prefix_cache_queries"):
        out["prefix_cache_hit_rate"] = out.get("prefix_cache_hits", 0) / out["prefix_cache_queries"]
    elif out.get("cached_tokens") is not None and out.get("prompt_tokens"):
        # SGLang counts cached prompt tokens instead of vLLM's queries and hits (tokens too).
        out["prefix_cache_hit_rate"] = out["cached_tokens"] / out["prompt_tokens"]
    return out
