"""A deterministic toy tokenizer for the simulator: text <-> token ids, no model files.

It only has to be *consistent*, not linguistic: the same text always gives the same ids, on
every host and every run, so that `/tokenize`, `usage.prompt_tokens` and the engine's prefix
cache all agree on one count.

- Text is cut into pieces: optional leading whitespace plus up to 4 non-space characters, or a
  run of whitespace alone. Each piece maps to an id by a stable hash (CRC-32) into a 32000-entry
  vocabulary; ids below `FIRST_REGULAR_ID` are reserved for special tokens.
- A chat prompt is rendered by a fixed template: BOS, then per message
  ``<|im_start|> ROLE \\n <content pieces> <|im_end|> \\n`` (5 tokens of overhead per message),
  then ``<|im_start|> assistant \\n`` (3 tokens) when a generation prompt is added.
- Decoding cannot invert a hash, so an id decodes to a short pseudo-word (" kalo") made of
  syllables picked by the id (``decode(encode(text)) != text``). Every id the engine can emit
  (>= 3) decodes to non-empty text, so every generated token is visible in the stream, except
  EOS (id 2), which ends a request that finishes "stop" and decodes to "" as in vLLM.

Cost: a piece's id is computed once and kept in a bounded dict, so a long prompt costs about
one regex pass plus one dict lookup per piece (~20 ms for 370 KB of text). ``encode`` with
``slice_chars`` cuts the text at piece boundaries and releases the GIL between slices, for a
worker thread that must not hold up the event loop's thread for a whole long prompt.
"""

from __future__ import annotations

import re
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

VOCAB_SIZE = 32000

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
IM_START_ID = 3
IM_END_ID = 4
NEWLINE_ID = 5
ROLE_IDS: dict[str, int] = {
    "system": 6,
    "user": 7,
    "assistant": 8,
    "tool": 9,
    "developer": 10,
}
OTHER_ROLE_ID = 11
FIRST_REGULAR_ID = 256

SPECIAL_TOKEN_STRS: dict[int, str] = {
    PAD_ID: "<pad>",
    BOS_ID: "<s>",
    EOS_ID: "</s>",
    IM_START_ID: "<|im_start|>",
    IM_END_ID: "<|im_end|>",
    NEWLINE_ID: "\n",
    OTHER_ROLE_ID: "<|role|>",
    **{token_id: role for role, token_id in ROLE_IDS.items()},
}

# Tokens added by the chat template around each message, and for the generation prompt.
CHAT_MESSAGE_OVERHEAD = 5
CHAT_GENERATION_PROMPT_TOKENS = 3

_PIECE_RE = re.compile(r"\s*\S{1,4}|\s+")
_SYLLABLES = (
    "ka", "lo", "mi", "ren", "to", "sa", "vi", "ne",
    "du", "pa", "ri", "go", "le", "ma", "shi", "tu",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


def split_pieces(text: str) -> list[str]:
    """The pieces `encode` maps to ids, in order (their concatenation is `text`)."""
    return _PIECE_RE.findall(text)


def piece_id(piece: str) -> int:
    span = VOCAB_SIZE - FIRST_REGULAR_ID
    return FIRST_REGULAR_ID + zlib.crc32(piece.encode("utf-8")) % span


# Beyond this many distinct pieces the id cache starts over (a piece is at most 4 non-space
# characters after its whitespace, so ordinary text stays far below it).
_ID_CACHE_LIMIT = 1 << 20


class _PieceIds(dict[str, int]):
    """piece -> id, computed on first sight (``ids[piece]`` never raises)."""

    def __missing__(self, piece: str) -> int:
        if len(self) >= _ID_CACHE_LIMIT:
            self.clear()
        token_id = self[piece] = piece_id(piece)
        return token_id


_IDS = _PieceIds()
# A piece boundary: a non-space character followed by whitespace (the piece holding the
# non-space character ends there, whatever came before it).
_BOUNDARY_RE = re.compile(r"\S(?=\s)")


def _piece_ids(text: str, slice_chars: int) -> list[int]:
    lookup = _IDS.__getitem__
    if not slice_chars or len(text) <= slice_chars:
        return list(map(lookup, _PIECE_RE.findall(text)))
    ids: list[int] = []
    findall = _PIECE_RE.findall
    start = 0
    end_of_text = len(text)
    while start < end_of_text:
        boundary = _BOUNDARY_RE.search(text, start + slice_chars)
        end = end_of_text if boundary is None else boundary.end()
        ids.extend(map(lookup, findall(text, start, end)))
        start = end
        if start < end_of_text:
            time.sleep(0)  # let another thread (the event loop's) take the GIL
    return ids


def encode(text: str, add_special_tokens: bool = True, slice_chars: int = 0) -> list[int]:
    """Token ids of ``text``; ``slice_chars`` > 0: in slices of about that many characters,
    releasing the GIL between them (the ids are the same)."""
    ids = _piece_ids(text, slice_chars)
    if add_special_tokens:
        ids.insert(0, BOS_ID)
    return ids


def encode_with_strs(text: str, add_special_tokens: bool = True) -> tuple[list[int], list[str]]:
    pieces = _PIECE_RE.findall(text)
    ids = [piece_id(piece) for piece in pieces]
    if add_special_tokens:
        ids.insert(0, BOS_ID)
        pieces.insert(0, SPECIAL_TOKEN_STRS[BOS_ID])
    return ids, pieces


def role_id(role: str) -> int:
    return ROLE_IDS.get(role, OTHER_ROLE_ID)


def apply_chat_template(
    messages: Sequence[ChatMessage], add_generation_prompt: bool = True, slice_chars: int = 0
) -> list[int]:
    """Render and tokenize a conversation with the fixed toy template (``slice_chars``: as
    for `encode`)."""
    ids = [BOS_ID]
    for message in messages:
        ids.append(IM_START_ID)
        ids.append(role_id(message.role))
        ids.append(NEWLINE_ID)
        ids.extend(_piece_ids(message.content, slice_chars))
        ids.append(IM_END_ID)
        ids.append(NEWLINE_ID)
    if add_generation_prompt:
        ids.extend((IM_START_ID, ROLE_IDS["assistant"], NEWLINE_ID))
    return ids


def apply_chat_template_with_strs(
    messages: Sequence[ChatMessage], add_generation_prompt: bool = True
) -> tuple[list[int], list[str]]:
    """`apply_chat_template` plus each token's string (for ``/tokenize``'s token_strs)."""
    ids = apply_chat_template(messages, add_generation_prompt)
    strs: list[str] = []
    pieces = (piece for message in messages for piece in split_pieces(message.content))
    for token_id in ids:
        special = SPECIAL_TOKEN_STRS.get(token_id)
        strs.append(special if special is not None else next(pieces))
    return ids, strs


def _make_word(token_id: int) -> str:
    first = _SYLLABLES[token_id % 16]
    second = _SYLLABLES[(token_id >> 4) % 16]
    if token_id % 3 == 0:
        return " " + first + second + _SYLLABLES[(token_id >> 8) % 16]
    return " " + first + second


_WORDS: list[str] | None = None


def _words() -> list[str]:
    global _WORDS
    if _WORDS is None:
        _WORDS = [_make_word(token_id) for token_id in range(VOCAB_SIZE)]
    return _WORDS


def token_text(token_id: int) -> str:
    """The text a generated token shows in a stream: a non-empty word for every id >= 3.

    Only pad/BOS/EOS (0..2) decode to nothing; of them the engine emits only EOS, as the last
    token of a request that finishes "stop" (vLLM skips it in the text too). Ids that double as
    chat-template markers (3..11) still decode to words here, so every other generated token is
    visible (only `decode(..., skip_special_tokens=False)` shows the markers).
    """
    if token_id <= EOS_ID:
        return ""
    return _words()[token_id % VOCAB_SIZE]


def decode(token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    words = _words()
    parts: list[str] = []
    for token_id in token_ids:
        if not skip_special_tokens and token_id in SPECIAL_TOKEN_STRS:
            parts.append(SPECIAL_TOKEN_STRS[token_id])
        elif token_id <= EOS_ID:
            continue
        else:
            parts.append(words[token_id % VOCAB_SIZE])
    return "".join(parts)


def warm() -> None:
    """Build the decode table and run each path once, so a first request pays for none of it."""
    _words()
    sample = "Warm up: the quick brown fox\njumps over the lazy dog. " * 4
    encode(sample)
    encode(sample, slice_chars=16)
    encode_with_strs(sample)
    messages = [ChatMessage("user", sample)]
    apply_chat_template_with_strs(messages)
    apply_chat_template(messages, slice_chars=16)
    decode(range(EOS_ID, 64))
    token_text(FIRST_REGULAR_ID)
