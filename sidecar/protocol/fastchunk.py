"""A fast path for the streamed chunk that makes up almost every event: one output token (or a
merged delta) of one choice, as vLLM writes it, with or without continuous usage.

`classify_chunk` parses every event with ``json.loads`` (~3 µs), and cutting the usage that the
proxy injected back out takes a regex and a brace check (~2.5 µs). For an event whose bytes are
exactly the common shape, one anchored regex over the raw bytes (~1.3 µs) gives the same answer
and where the usage member is; the same walk written in C (`_tokenscan.c`, built with the package
where a C compiler is at hand) gives it in a tenth of the instructions, and the regex stays its
specification and its fallback. Anything else (a role chunk, a finish chunk, logprobs, tool
calls, an escape in the model name, a number longer than 18 digits, a byte out of place) is not
matched, and the caller takes the general path. Whatever this returns equals what the general
path gives for the same event, classification and cut alike: tests/test_fastchunk.py holds it
to that on vLLM's shapes, the simulator's output and generated variants.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Final

from sidecar.protocol.openai import ChunkInfo, ChunkKind, Usage

_new_tuple: Final = tuple.__new__

# A JSON string's content as json.loads accepts it (no raw control characters, only the
# escapes JSON defines), non-empty for the text; names (id, model) without escapes, so that their
# bytes are their value.
# Written as an "unrolled loop" (runs of plain bytes between escapes, non-empty by the lookahead):
# linear in the text's length and ~20% faster than one alternation per byte.
_TEXT = (
    rb'(?=[^"])[^"\\\x00-\x1f]*'
    rb'(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*'
)
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
_HEAD = (
    rb'data: \{"id":"(?P<id>' + _NAME + rb')","object":"(?:chat\.completion\.chunk|'
    rb'text_completion)","created":'
    + _INT
    + rb',"model":"(?P<model>'
    + _NAME
    + rb')","choices":\[\{"index":(?P<index>'
    + _INT
    + rb"),"
)
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


def cut_with_slices(data: bytes, start: int, end: int) -> bytes:
    """``data`` without ``data[start:end]`` (what the C `cut` does in one copy)."""
    return data[:start] + data[end:]


# The scanner the data path uses: the same walk in C where the package was built with it (one
# token event in ~2k instructions instead of ~20k, benchmarks/meter_instructions.py), else the
# regex; and the cut of the usage member, in one copy instead of two slices and their join.
# SIDECAR_TOKEN_SCAN=regex picks the Python ones anyway (to compare the two, or to rule the C
# one out).
scan_token_chunk: Callable[[bytes], TokenScan | None]
cut_span: Callable[[bytes, int, int], bytes]
if os.environ.get("SIDECAR_TOKEN_SCAN", "") == "regex":
    scan_token_chunk, cut_span, NATIVE_SCAN = scan_with_regex, cut_with_slices, False
else:
    try:
        from sidecar.protocol._tokenscan import cut as cut_span
        from sidecar.protocol._tokenscan import scan as scan_token_chunk

        NATIVE_SCAN = True
    except ImportError:  # built without a C compiler: correct, slower
        scan_token_chunk, cut_span, NATIVE_SCAN = scan_with_regex, cut_with_slices, False


def fast_token_chunk(raw: bytes) -> tuple[ChunkInfo, int, int] | None:
    """(what `classify_chunk` says of this event, start and end of its ``,"usage":{...}``
    member in ``raw``, or -1, -1 without one), or None when ``raw`` (one whole event, as the SSE
    parser gives it) is not the common token chunk."""
    scan = scan_token_chunk(raw)
    if scan is None:
        return None
    index, prompt, total, completion, start, end, id_end, model_start, model_end = scan
    usage = None if prompt is None else _new_tuple(Usage, (prompt, completion, total, None))
    info = _new_tuple(
        ChunkInfo,
        (
            ChunkKind.TOKEN,
            usage,
            None,
            index,
            None,
            None,
            raw[model_start:model_end].decode("utf-8", "replace"),
            raw[ID_START:id_end].decode("utf-8", "replace"),
            None,
            False,
        ),
    )
    return info, start, end
