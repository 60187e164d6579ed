"""A fast path for vLLM's common chunks: above all the one that makes up almost every event, one
output token (or a merged delta) of one choice, with or without continuous usage; and the few
others every stream has (the finish chunk, chat's role chunk, the usage-only chunk).

`classify_chunk` parses every event with ``json.loads`` (~3 µs), and cutting the usage that the
proxy injected back out takes a regex and a brace check (~2.5 µs). For an event whose bytes are
exactly a common shape, one anchored regex over the raw bytes (~1.3 µs) gives the same answer
and where the usage member is; the same walk written in C (`_tokenscan.c`, built with the package
where a C compiler is at hand) gives it in a tenth of the instructions, and the regexes stay its
specification and its fallback. Anything else (logprobs, tool calls, an escape in a name, a
number longer than 18 digits, vLLM's per-request metrics, cached-token details, a byte out of
place) is not matched, and the caller takes the general path. Whatever this returns equals what
the general path gives for the same event, classification and cut alike: tests/test_fastchunk.py
holds it to that on vLLM's shapes (the real 0.32 server's among them), the simulator's output and
generated variants.

Two scans: `scan_token_chunk` (`_TOKEN_CHUNK`) for the token chunk alone, what the per-read lanes
take (meter.StreamMeter.feed, _tokenscan.Lane); `scan_common_chunk` (`_COMMON_CHUNK`) for all of
them, what `fast_chunk` gives the general path.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Final

from sidecar.protocol.openai import ChunkInfo, ChunkKind, Usage

_new_tuple: Final = tuple.__new__

# A JSON string's content as json.loads accepts it (no raw control characters, only the
# escapes JSON defines), non-empty for a token's text; names (id, model, finish reason,
# fingerprint) without escapes, so that their bytes are their value.
# Written as an "unrolled loop" (runs of plain bytes between escapes, non-empty by the lookahead):
# linear in the text's length and ~20% faster than one alternation per byte.
_TEXT_OR_EMPTY = (
    rb'[^"\\\x00-\x1f]*'
    rb'(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*'
)
_TEXT = rb'(?=[^"])' + _TEXT_OR_EMPTY
_NAME = rb'[^"\\\x00-\x1f]*'
_INT = rb"(?:0|[1-9][0-9]{0,17})"  # fits an int64; longer numbers take the general path
# Token counts of at most 15 digits are below MAX_TOKEN_COUNT (2**53 - 1, 16 digits): longer
# ones take the general path, which judges them.
_COUNT = rb"(?:0|[1-9][0-9]{0,14})"
_USAGE = (
    rb'(?P<usage>,"usage":\{"prompt_tokens":(?P<prompt>'
    + _COUNT
    + rb'),"total_tokens":(?P<total>'
    + _COUNT
    + rb'),"completion_tokens":(?P<completion>'
    + _COUNT
    + rb')(?:,"completion_tokens_details":null)?\})?'
)
_PREFIX = (
    rb'data: \{"id":"(?P<id>' + _NAME + rb')","object":"(?:chat\.completion\.chunk|'
    rb'text_completion)","created":' + _INT + rb',"model":"(?P<model>' + _NAME + rb')","choices":\['
)
_HEAD = _PREFIX + rb'\{"index":(?P<index>' + _INT + rb"),"
# vLLM 0.32 / 0.33 (spec/vllm-protocol.md A1): a chat content delta, and a completions text.
_CHAT_CHOICE = (
    rb'"delta":\{"content":"' + _TEXT + rb'"\},"logprobs":null,"finish_reason":null,'
    rb'"token_ids":null\}\]'
)
_TEXT_CHOICE = (
    rb'"text":"' + _TEXT + rb'","logprobs":null,"finish_reason":null,'
    rb'"stop_reason":null,"prompt_token_ids":null,"token_ids":null'
    rb'(?:,"weight_versions":null)?\}\]'
)
# 0.33 ends a token chunk with kv_transfer_params; 0.32 does not (seen from the real server).
_TAIL = rb'(?:,"kv_transfer_params":null)?\}\n\n'
_TOKEN_CHUNK: Final = re.compile(
    _HEAD + rb"(?:" + _CHAT_CHOICE + rb"|" + _TEXT_CHOICE + rb")" + _USAGE + _TAIL
)

# The other chunks every stream has, for `scan_common_chunk` (the general path's fast path):
# the finish chunk (its text may be empty: an EMPTY event), chat's role chunk and the
# usage-only chunk, in vLLM 0.32 / 0.33's shapes (seen from the real server), with the
# fingerprint vLLM puts on the finish chunk when there is no usage chunk and on the usage chunk.


def _finish(tag: bytes) -> bytes:
    return (
        rb'"finish_reason":"(?P<finish_'
        + tag
        + rb">"
        + _NAME
        + rb')","stop_reason":(?:null|'
        + _INT
        + rb'|"'
        + _NAME
        + rb'")'
    )


_CHAT_FINISH = (
    rb'"delta":\{"content":"(?P<chat_text>'
    + _TEXT_OR_EMPTY
    + rb')"\},"logprobs":null,'
    + _finish(b"chat")
    + rb',"token_ids":null(?:,"weight_versions":null)?\}\]'
)
_TEXT_FINISH = (
    rb'"text":"(?P<text_text>'
    + _TEXT_OR_EMPTY
    + rb')","logprobs":null,'
    + _finish(b"text")
    + rb',"prompt_token_ids":null,"token_ids":null(?:,"weight_versions":null)?\}\]'
)
_ROLE_CHOICE = (
    rb'"delta":\{"role":"(?P<role>' + _NAME + rb')","content":""\},"logprobs":null,'
    rb'"finish_reason":null\}\]'
)
_COMMON_CHUNK: Final = re.compile(
    _PREFIX
    + rb'(?:(?P<no_choice>\])|\{"index":(?P<index>'
    + _INT
    + rb"),(?:"
    + rb"|".join((_CHAT_CHOICE, _TEXT_CHOICE, _CHAT_FINISH, _TEXT_FINISH, _ROLE_CHOICE))
    + rb"))"
    + _USAGE
    + rb'(?:,"system_fingerprint":"(?P<fingerprint>'
    + _NAME
    + rb')")?(?:,"prompt_token_ids":null,"prompt_text":null)?'
    + _TAIL
)


ID_START: Final = len(b'data: {"id":"')

# What a scan answers for the common token chunk: (choice index, prompt, total and completion
# tokens of its usage or three None, start and end of its ``,"usage":{...}`` member or -1, -1,
# end of the id, start and end of the model name); the id starts at ID_START.
TokenScan = tuple[int, "int | None", "int | None", "int | None", int, int, int, int, int]


def scan_with_regex(data: bytes) -> TokenScan | None:
    """The common token chunk by the regex above: the specification, and the scanner wherever
    the C one (`_tokenscan.c`) is not built. ``data``: one whole event, as the SSE parser gives
    it."""
    match = _TOKEN_CHUNK.fullmatch(data)
    if match is None:
        return None
    _id, _model, index, _usage, prompt, total, completion = match.groups()
    usage_start, usage_end = match.span(4)
    return (
        int(index),
        None if prompt is None else int(prompt),
        None if total is None else int(total),
        None if completion is None else int(completion),
        usage_start,
        usage_end,
        match.end(1),
        match.start(2),
        match.end(2),
    )


# The group numbers `scan_with_regex` reads by position.
assert tuple(_TOKEN_CHUNK.groupindex) == (
    "id", "model", "index", "usage", "prompt", "total", "completion"
)  # fmt: skip


# What `scan_common_chunk` answers: (kind, choice index or None for the usage-only chunk,
# prompt, total, completion, usage span, id end, model span, as TokenScan, then the finish
# reason's span and the system fingerprint's, (-1, -1) when absent). kind: 0 token, 1 role,
# 2 empty, 3 usage (_KINDS).
ChunkScan = tuple[
    int, "int | None", "int | None", "int | None", "int | None", int, int, int, int, int,
    int, int, int, int,
]  # fmt: skip
_KINDS: Final = (ChunkKind.TOKEN, ChunkKind.ROLE, ChunkKind.EMPTY, ChunkKind.USAGE)


def _span(match: re.Match[bytes], group: str) -> tuple[int, int]:
    return match.span(group) if match.group(group) is not None else (-1, -1)


def scan_common_with_regex(data: bytes) -> ChunkScan | None:
    """Any chunk `_COMMON_CHUNK` matches (the token chunk among them), by the regex: the
    specification of `_tokenscan.scan_chunk`, and its stand-in where that is not built."""
    match = _COMMON_CHUNK.fullmatch(data)
    if match is None:
        return None
    prompt = match.group("prompt")
    if match.group("no_choice") is not None:
        if prompt is None:
            return None  # no choice and no usage: left to the general path
        kind, index = 3, None
    else:
        index = int(match.group("index"))
        if match.group("role") is not None:
            kind = 1 if match.group("role") else 2
        elif match.group("finish_chat") is not None:
            kind = 0 if match.group("chat_text") else 2
        elif match.group("finish_text") is not None:
            kind = 0 if match.group("text_text") else 2
        else:
            kind = 0
    finish = _span(match, "finish_chat")
    if finish[0] < 0:
        finish = _span(match, "finish_text")
    usage_start, usage_end = _span(match, "usage")
    return (
        kind,
        index,
        None if prompt is None else int(prompt),
        None if prompt is None else int(match.group("total")),
        None if prompt is None else int(match.group("completion")),
        usage_start,
        usage_end,
        match.end("id"),
        match.start("model"),
        match.end("model"),
        *finish,
        *_span(match, "fingerprint"),
    )


def cut_with_slices(data: bytes, start: int, end: int) -> bytes:
    """``data`` without ``data[start:end]`` (what the C `cut` does in one copy)."""
    return data[:start] + data[end:]


def fast_chunk_from_scan(raw: bytes) -> tuple[ChunkInfo, int, int] | None:
    """`fast_chunk` in Python, over `scan_common_chunk`: what the C `fast_chunk` does in one
    call, and the path wherever that is not built."""
    scan = scan_common_chunk(raw)
    if scan is None:
        return None
    (
        kind,
        index,
        prompt,
        total,
        completion,
        start,
        end,
        id_end,
        model_start,
        model_end,
        finish_start,
        finish_end,
        fingerprint_start,
        fingerprint_end,
    ) = scan
    usage = None if prompt is None else _new_tuple(Usage, (prompt, completion, total, None))
    info = _new_tuple(
        ChunkInfo,
        (
            _KINDS[kind],
            usage,
            None if finish_start < 0 else raw[finish_start:finish_end].decode("utf-8", "replace"),
            index,
            None,
            None,
            raw[model_start:model_end].decode("utf-8", "replace"),
            raw[ID_START:id_end].decode("utf-8", "replace"),
            None
            if fingerprint_start < 0
            else raw[fingerprint_start:fingerprint_end].decode("utf-8", "replace"),
            False,
        ),
    )
    return info, start, end


# The scanners the data path uses: the same walks in C where the package was built with them
# (one token event in ~2k instructions instead of ~20k, benchmarks/meter_instructions.py), else
# the regexes; and the cut of the usage member, in one copy instead of two slices and their
# join. SIDECAR_TOKEN_SCAN=regex picks the Python ones anyway (to compare the two, or to rule
# the C ones out).
#
# fast_chunk(raw) -> (ChunkInfo, usage start, usage end) | None: what `classify_chunk` says of
# this event, and where its ``,"usage":{...}`` member is in ``raw`` (-1, -1 without one); None
# when ``raw`` (one whole event, as the SSE parser gives it) is not one of vLLM's common chunks
# (`_COMMON_CHUNK`: a token chunk, a finish chunk, a role chunk, a usage-only chunk).
scan_token_chunk: Callable[[bytes], TokenScan | None]
scan_common_chunk: Callable[[bytes], ChunkScan | None]
fast_chunk: Callable[[bytes], tuple[ChunkInfo, int, int] | None]
cut_span: Callable[[bytes, int, int], bytes]
if os.environ.get("SIDECAR_TOKEN_SCAN", "") == "regex":
    scan_token_chunk, scan_common_chunk = scan_with_regex, scan_common_with_regex
    fast_chunk, cut_span, NATIVE_SCAN = fast_chunk_from_scan, cut_with_slices, False
else:
    try:
        from sidecar.protocol import _tokenscan

        _tokenscan.configure(ChunkInfo, Usage, _KINDS)
        scan_token_chunk, scan_common_chunk = _tokenscan.scan, _tokenscan.scan_chunk
        fast_chunk, cut_span = _tokenscan.fast_chunk, _tokenscan.cut
        NATIVE_SCAN = True
    except ImportError:  # built without a C compiler: correct, slower
        scan_token_chunk, scan_common_chunk = scan_with_regex, scan_common_with_regex
        fast_chunk, cut_span, NATIVE_SCAN = fast_chunk_from_scan, cut_with_slices, False
