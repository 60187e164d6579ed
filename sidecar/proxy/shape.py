"""What a request asks for, reduced to the shape of its work (for capture): no text kept.

Prefix hashes are chained: block i's hash covers blocks 0..i, so two prompts share their first
k hashes exactly when their first k blocks are equal, like a KV prefix cache sees it. They are
keyed with a salt drawn when the proxy starts and never written anywhere, so a hash cannot be
matched against guessed text by someone holding only the trace. Session ids (a header or the
body's ``user``) are pseudonymised with the same key unless the operator opted in to text: the
same id gives the same pseudonym for as long as the proxy runs (enough to replay a session's
turns together), and the id itself is not stored.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
from collections.abc import Mapping
from typing import Any

from sidecar.protocol.openai import MAX_TOKEN_COUNT
from sidecar.record import RequestShape


class PrefixHasher:
    def __init__(self, block_chars: int, block_tokens: int, salt: bytes | None = None) -> None:
        if block_chars <= 0 or block_tokens <= 0:
            raise ValueError("block sizes must be > 0")
        self.block_chars = block_chars
        self.block_tokens = block_tokens
        self._salt = salt if salt is not None else secrets.token_bytes(16)

    def _chain(self, blocks: list[bytes]) -> tuple[int, ...]:
        hashes: list[int] = []
        previous = b""
        for block in blocks:
            digest = hashlib.blake2b(previous + block, digest_size=8, key=self._salt).digest()
            previous = digest
            # 63 bits: a non-negative int that every JSON reader keeps exactly.
            hashes.append(int.from_bytes(digest, "big") >> 1)
        return tuple(hashes)

    def text(self, text: str) -> tuple[int, ...]:
        size = self.block_chars
        data = [
            text[i : i + size].encode("utf-8", "surrogatepass") for i in range(0, len(text), size)
        ]
        return self._chain(data)

    @property
    def key_id(self) -> str:
        """Names the key without revealing it (a keyed hash of a constant): captures whose
        hashes can be compared carry the same id."""
        return hashlib.blake2b(b"sidecar-capture-key-id", digest_size=8, key=self._salt).hexdigest()

    def pseudonym(self, value: str) -> str:
        """A stable stand-in for an identifier: keyed, so it cannot be reversed or matched
        against guessed ids without the key, which is never written."""
        digest = hashlib.blake2b(
            b"id\x00" + value.encode("utf-8", "surrogatepass"), digest_size=8, key=self._salt
        ).hexdigest()
        return f"anon-{digest}"

    def tokens(self, token_ids: list[int]) -> tuple[int, ...]:
        size = self.block_tokens
        blocks = [
            b",".join(str(t).encode() for t in token_ids[i : i + size])
            for i in range(0, len(token_ids), size)
        ]
        return self._chain(blocks)


def chat_text(messages: list[Any], limit: int | None = None) -> str:
    """A canonical text of chat messages, the same for the same conversation: each message as
    ``role \x1f content \x1e``; content parts that are not text kept as sorted JSON. Used for
    the capture's prefix hashes and for prefix-affinity routing, so that both see one prompt
    the same way. With ``limit``, stops once that many characters are there (a routing key
    needs only the first block of a long conversation)."""
    parts: list[str] = []
    size = 0
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(
                p["text"]
                if isinstance(p, dict) and isinstance(p.get("text"), str)
                else json.dumps(p, sort_keys=True, separators=(",", ":"))
                for p in content
            )
        elif not isinstance(content, str):
            content = "" if content is None else json.dumps(content, sort_keys=True)
        part = f"{message.get('role')}\x1f{content}\x1e"
        parts.append(part)
        size += len(part)
        if limit is not None and size >= limit:
            break
    return "".join(parts)


def _int_or_none(value: Any) -> int | None:
    # A trace keeps what a replay can use: a count beyond any real request (a 4,000-digit
    # max_tokens) is read as absent, so that every trace line stays plain, portable JSON.
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_COUNT:
        return value
    return None


def _finite_or_none(value: Any) -> float | None:
    # NaN and infinities are not JSON: a trace line with them is refused by strict readers.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value) if abs(value) < 1e308 else math.inf
        return number if math.isfinite(number) else None
    return None


def request_shape(
    body: Mapping[str, Any], hasher: PrefixHasher, *, session_id: str | None, raw_body: bytes | None
) -> RequestShape:
    """The shape of a chat or completions request body. ``raw_body`` is kept only when given
    (the operator opted in to storing text)."""
    max_tokens = _int_or_none(body.get("max_completion_tokens"))
    if max_tokens is None:
        max_tokens = _int_or_none(body.get("max_tokens"))
    temperature = body.get("temperature")
    ignore_eos = body.get("ignore_eos")
    n = _int_or_none(body.get("n"))
    unit: str | None = None
    size = 0
    hashes: tuple[int, ...] = ()
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: the first prompt represents it
    if isinstance(prompt, str):
        unit, size, hashes = "chars", hasher.block_chars, hasher.text(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        unit, size, hashes = "tokens", hasher.block_tokens, hasher.tokens(prompt)
    elif isinstance(body.get("messages"), list):
        unit, size = "chars", hasher.block_chars
        hashes = hasher.text(chat_text(body["messages"]))
    return RequestShape(
        max_tokens=max_tokens,
        ignore_eos=ignore_eos if isinstance(ignore_eos, bool) else None,
        n=n if n is not None and n > 0 else 1,
        temperature=_finite_or_none(temperature),
        session_id=session_id,
        prefix_unit=unit,
        prefix_size=size,
        prefix_hashes=hashes,
        body=None if raw_body is None else raw_body.decode("utf-8", "replace"),
    )
