"""Request bodies that reproduce a trace line's work: input length, output length, prefixes.

- Captured bodies are sent verbatim when the trace has them (the operator opted in to text).
- Otherwise ``/v1/completions`` gets a token-id prompt of exactly ``n_in`` tokens, built from
  the line's prefix hashes: each hash maps to a fixed pseudo-random block of token ids, so two
  lines that share their first k hashes share their first k blocks of tokens, exactly the prefix
  a KV cache can reuse. Blocks are ``prefix.size`` tokens when the unit is tokens, and
  ``ceil(n_in / len(hashes))`` when hashes were taken over characters. Tokens past the hashed
  blocks are unique to the request. The ids are drawn from `TokenIds`: ids the target's own
  tokenizer produced (`target.probe_token_ids`, never one outside its vocabulary), or a
  range the operator gave, or by default 1000-29999.
- Chat (``endpoint == "chat"``) gets a text prompt of words; with a `TokenCalibration` (from the
  upstream's /tokenize) the word count is chosen to hit ``n_in`` tokens.
- Output length: ``max_tokens = n_out`` and ``ignore_eos`` so the server generates exactly that;
  a request of ``n`` choices is sent with its ``n`` and ``max_tokens = n_out // n`` (``n_out``
  counts the tokens of every choice, ``max_tokens`` bounds each one).
- Streaming with ``include_usage`` and ``continuous_usage_stats``: the replayer is a client and
  counts tokens exactly from usage.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from typing import Any

from sidecar.tracefile import TraceRequest

VOCAB_LOW = 1000  # away from the special tokens of common vocabularies
VOCAB_HIGH = 30000  # inside every vocabulary of interest (>= 32k entries)
WORDS = (
    "time",
    "people",
    "way",
    "water",
    "word",
    "number",
    "part",
    "place",
    "world",
    "work",
    "sound",
    "line",
    "story",
    "answer",
    "system",
    "question",
    "model",
    "token",
    "river",
    "music",
    "garden",
    "window",
    "signal",
    "engine",
    "market",
    "letter",
    "bridge",
)


class PayloadError(ValueError):
    """A trace line that does not say enough to build a request."""


@dataclass(frozen=True, slots=True)
class TokenIds:
    """Where a rebuilt prompt's token ids come from: ``ids`` (each one valid on the target: its
    tokenizer produced it) when given, else the range [``low``, ``high``). ``source`` says
    which, for the report's envelope."""

    ids: tuple[int, ...] = ()
    low: int = VOCAB_LOW
    high: int = VOCAB_HIGH
    source: str = f"default range {VOCAB_LOW}-{VOCAB_HIGH - 1}"

    def __post_init__(self) -> None:
        if not self.ids and not 0 <= self.low < self.high:
            raise ValueError(f"an empty token id range: {self.low}-{self.high - 1}")

    def draw(self, rng: random.Random, count: int) -> list[int]:
        if self.ids:
            ids = self.ids
            return [ids[rng.randrange(len(ids))] for _ in range(count)]
        low, high = self.low, self.high
        return [rng.randrange(low, high) for _ in range(count)]

    def describe(self) -> dict[str, Any]:
        if self.ids:
            return {
                "source": self.source,
                "distinct_ids": len(self.ids),
                "min": min(self.ids),
                "max": max(self.ids),
            }
        return {"source": self.source, "min": self.low, "max": self.high - 1}


DEFAULT_TOKEN_IDS = TokenIds()


def parse_token_id_range(text: str) -> TokenIds:
    """``LOW:HIGH`` (both included), as ``--token-id-range`` takes it."""
    low_text, sep, high_text = text.partition(":")
    try:
        low, high = int(low_text), int(high_text)
    except ValueError:
        raise ValueError(f"--token-id-range {text!r}: give LOW:HIGH, e.g. 100:8000") from None
    if not sep or low < 0 or high < low:
        raise ValueError(f"--token-id-range {text!r}: give LOW:HIGH with 0 <= LOW <= HIGH")
    return TokenIds(low=low, high=high + 1, source=f"--token-id-range {low}:{high}")


def _block_tokens(key: int, size: int, token_ids: TokenIds) -> list[int]:
    return token_ids.draw(random.Random(key), size)


def token_prompt(
    request: TraceRequest, unique_key: int, token_ids: TokenIds = DEFAULT_TOKEN_IDS
) -> list[int]:
    """Exactly ``n_in`` token ids; shared prefix blocks where the hashes are shared."""
    n_in = request.n_in
    if n_in is None or n_in <= 0:
        raise PayloadError("a trace line needs n_in > 0 to rebuild its prompt")
    tokens: list[int] = []
    prefix = request.prefix
    if prefix is not None and prefix.hashes:
        size = prefix.size if prefix.unit == "tokens" else math.ceil(n_in / len(prefix.hashes))
        for block_hash in prefix.hashes:
            if len(tokens) >= n_in:
                break
            tokens.extend(_block_tokens(block_hash, size, token_ids))
    if len(tokens) < n_in:
        tokens.extend(token_ids.draw(random.Random(unique_key), n_in - len(tokens)))
    return tokens[:n_in]


@dataclass(frozen=True, slots=True)
class TokenCalibration:
    """Tokens per word of the generated text, measured with the upstream's /tokenize, and the
    fixed token overhead of a one-message chat (template)."""

    tokens_per_word: float = 1.0
    chat_overhead: int = 0


def text_prompt(n_tokens: int, key: int, calibration: TokenCalibration) -> str:
    words = max(1, round((n_tokens - calibration.chat_overhead) / calibration.tokens_per_word))
    rng = random.Random(key)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _stable_key(index: int, run_seed: int) -> int:
    digest = hashlib.blake2b(f"{run_seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def build_body(
    request: TraceRequest,
    *,
    index: int,
    model: str,
    run_seed: int = 0,
    calibration: TokenCalibration | None = None,
    use_captured_body: bool = True,
    endpoint: str | None = None,
    token_ids: TokenIds = DEFAULT_TOKEN_IDS,
) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) for one trace line."""
    target = endpoint or request.endpoint
    if use_captured_body and request.body is not None:
        body = dict(request.body)
        body["model"] = model
        path = "/v1/chat/completions" if target == "chat" else "/v1/completions"
        return path, body
    if request.n_out is None and request.max_tokens is None:
        raise PayloadError("a trace line needs n_out (or max_tokens) to bound its output")
    # n_out counts the output of every choice (usage's completion_tokens), max_tokens bounds
    # each one: n choices of n_out // n tokens each are the recorded work.
    n = max(1, request.n)
    max_tokens = request.n_out // n if request.n_out is not None else request.max_tokens
    body = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_tokens": max(1, int(max_tokens or 1)),
        "ignore_eos": True,
    }
    if n > 1:
        body["n"] = n
    if request.temperature is not None:
        body["temperature"] = request.temperature
    unique = _stable_key(index, run_seed)
    if target == "chat":
        if request.n_in is None or request.n_in <= 0:
            raise PayloadError("a trace line needs n_in > 0 to rebuild its prompt")
        body["messages"] = [
            {
                "role": "user",
                "content": text_prompt(request.n_in, unique, calibration or TokenCalibration()),
            }
        ]
        return "/v1/chat/completions", body
    body["prompt"] = token_prompt(request, unique, token_ids)
    return "/v1/completions", body
