"""What the simulated model's sampler and detokenizer add to its token ids: logprobs and stop
strings, as vLLM computes and applies them.

Logprobs (`LogprobSource`): the simulator has no distribution, so the numbers are synthetic but
shaped like a real model's: per position, the top-k alternatives with strictly falling
logprobs (the best between about -0.05 and -3, each next one an exponential gap lower), the
sampled token among them at rank 1 when decoding is greedy and usually near the top otherwise,
and vLLM's per-position dict order: the sampled token first, then the top-k by rank (the
sampled one keeps its first place when it is also in the top-k; vllm/v1/engine/logprobs.py).
Every value comes from a generator seeded by the choice's sampling key, so the same request
to the same simulator gives the same numbers.

Stop strings (`StopChecker`): vLLM's ``BaseIncrementalDetokenizer.update`` and
``check_stop_strings`` (vllm/v1/engine/detokenizer.py, 0.32): the text of each new token is
appended, the text from the first new token on is searched for every stop string, the match
that completes earliest wins (ties by list order), the text is cut before it (after it with
``include_stop_str_in_output``), and no check runs before ``min_tokens`` tokens. While the
request runs, a streamed delta holds back the last ``max(len(stop)) - 1`` characters (a stop
string may be under way) unless the stop strings are to be included; the finish releases it.
"""

from __future__ import annotations

import hashlib
import random
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sidecar.sim import tokenizer

__all__ = ["Logprob", "LogprobSource", "StopChecker", "check_stop_strings", "sampling_seed"]

# vLLM clamps -inf to this before JSON (OpenAI's floor).
LOGPROB_FLOOR = -9999.0


def sampling_seed(*parts: object) -> int:
    """A 64-bit seed from ``parts``, stable across runs and processes (``hash`` is salted)."""
    data = "\x00".join(str(part) for part in parts).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


@dataclass(frozen=True, slots=True)
class Logprob:
    """One entry of vLLM's per-position logprobs dict (``vllm.logprobs.Logprob``)."""

    token_id: int
    logprob: float
    rank: int

    @property
    def token(self) -> str:
        """vLLM's ``decoded_token`` of an entry: special tokens by name (EOS too)."""
        special = tokenizer.SPECIAL_TOKEN_STRS.get(self.token_id)
        if special is not None and self.token_id <= tokenizer.EOS_ID:
            return special
        return tokenizer.token_text(self.token_id)


Position = tuple[Logprob, ...]  # the sampled (or prompt) token first, then the top-k by rank


class LogprobSource:
    """Synthetic logprobs for one choice's tokens, in order (module doc)."""

    __slots__ = ("_rng", "_greedy", "_vocab_size")

    def __init__(self, seed: int, greedy: bool, vocab_size: int) -> None:
        self._rng = random.Random(seed)
        self._greedy = greedy
        self._vocab_size = vocab_size

    def _ladder(self, depth: int) -> list[float]:
        """Logprobs of ranks 1..depth, falling."""
        rng = self._rng
        value = -0.05 - rng.expovariate(1.2)
        values = [round(value, 6)]
        for _ in range(depth - 1):
            value -= 0.02 + rng.expovariate(1.5)
            values.append(round(value, 6))
        return values

    def _others(self, avoid: int, count: int) -> list[int]:
        rng = self._rng
        span = self._vocab_size - tokenizer.FIRST_REGULAR_ID
        ids: list[int] = []
        while len(ids) < count:
            token_id = tokenizer.FIRST_REGULAR_ID + int(rng.random() * span)
            if token_id != avoid and token_id not in ids:
                ids.append(token_id)
        return ids

    def sampled(self, token_id: int, k: int) -> Position:
        """The position of a generated token: vLLM's dict with ``k`` alternatives."""
        rank = 1
        if not self._greedy:
            # Sampling at temperature > 0 mostly picks one of the likeliest few tokens.
            while rank < 50 and self._rng.random() < 0.3:
                rank += 1
        return self._position(token_id, rank, k)

    def prompt(self, token_id: int, k: int) -> Position:
        """The position of a prompt token: its rank is whatever the model thought of it."""
        rank = 1 if self._rng.random() < 0.2 else 2 + int(self._rng.random() * 5000)
        return self._position(token_id, rank, k)

    def _position(self, token_id: int, rank: int, k: int) -> Position:
        ladder = self._ladder(max(k, min(rank, 64)))
        own = (
            ladder[rank - 1]
            if rank <= len(ladder)
            else round(ladder[-1] - self._rng.expovariate(0.5), 6)
        )
        others = iter(self._others(token_id, k))
        entries = [Logprob(token_id, max(own, LOGPROB_FLOOR), rank)]
        for i in range(1, k + 1):
            if i == rank:
                continue  # the sampled token is this rank: it keeps its first place
            entries.append(Logprob(next(others), ladder[i - 1], i))
        return tuple(entries)


def check_stop_strings(
    output_text: str, new_char_count: int, stop: Sequence[str], include_in_output: bool
) -> tuple[str, int] | None:
    """vLLM's ``check_stop_strings``: (the stop string, the length to cut the text to, or -1
    for no cut), or None."""
    if not new_char_count or not stop:
        return None
    best: str | None = None
    best_index = 0
    best_end = sys.maxsize
    for stop_str in stop:
        index = output_text.find(stop_str, 1 - new_char_count - len(stop_str))
        if index == -1:
            continue
        end = index + len(stop_str)
        if end < best_end:
            best, best_index, best_end = stop_str, index, end
    if best is None:
        return None
    if include_in_output:
        return (best, -1) if best_end >= len(output_text) else (best, best_end)
    return best, best_index


class StopChecker:
    """One choice's detokenized text and stop-string state (module doc)."""

    __slots__ = (
        "stop",
        "include",
        "min_tokens",
        "buffer_length",
        "text",
        "num_tokens",
        "matched",
        "_sent",
    )

    def __init__(self, stop: Sequence[str], include: bool, min_tokens: int) -> None:
        self.stop = tuple(stop)
        self.include = include
        self.min_tokens = min_tokens
        self.buffer_length = max(len(s) for s in stop) - 1 if stop and not include else 0
        self.text = ""
        self.num_tokens = 0
        self.matched: str | None = None  # the stop string that ended the text
        self._sent = 0

    def update(self, token_ids: Iterable[int]) -> str | None:
        """Append new tokens' text; the stop string that ended the output, if one did."""
        previous = self.num_tokens
        offsets = [len(self.text)]
        for token_id in token_ids:
            # EOS (and pad/BOS) decode to nothing: the text of an EOS-ended request stops
            # before it, as vLLM's skipped stop token does.
            self.text += tokenizer.token_text(token_id)
            self.num_tokens += 1
            offsets.append(len(self.text))
        if not self.stop or self.matched is not None or self.num_tokens <= self.min_tokens:
            return None
        check_from = offsets[min(max(self.min_tokens - previous, 0), len(offsets) - 1)]
        found = check_stop_strings(self.text, len(self.text) - check_from, self.stop, self.include)
        if found is None:
            return None
        stop_string, cut = found
        if cut != -1:
            self.text = self.text[:cut]
        self.matched = stop_string
        return stop_string

    def next_text(self, finished: bool) -> str:
        """vLLM's ``get_next_output_text(finished, delta=True)``."""
        end = len(self.text) - (0 if finished else self.buffer_length)
        if self._sent < end:
            start, self._sent = self._sent, end
            return self.text[start:end]
        return ""
