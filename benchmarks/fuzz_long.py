"""Random-input fuzzing of what the relay does to every upstream byte: the SSE parser, the chunk
classifier, token counting and the usage rewrite (without_usage / strip_usage_member /
insert_member), composed as sidecar/proxy/relay.py composes them.

    python benchmarks/fuzz_long.py                      # 1M inputs (a few minutes)
    python benchmarks/fuzz_long.py --inputs 20000       # what tests/test_fuzz.py runs in CI
    python benchmarks/fuzz_long.py --smoke              # 2000 inputs: the harness runs

An input is one upstream stream: vLLM-shaped events (chat and completions chunks with random
text full of quotes, braces, backslashes, CRs, non-ASCII and the word "usage"; usage chunks,
error events, keep-alives, [DONE]) put through 0-3 random mutations (bytes flipped, inserted,
deleted, duplicated, the stream cut, a huge line, or pure random bytes), then split at random
points into reads. Seeded: the same seed gives the same inputs.

Checked on every input:
- no exception escapes, except `SSEError` from `feed` when a block exceeds max_event_size, after
  which the parser refuses all input (SSEError again);
- the parser's buffer stays bounded: pending_bytes <= max_event_size after every feed;
- every event's raw bytes plus what is pending are exactly the bytes fed (nothing lost/invented);
- classify_chunk returns a kind for every data field; TokenCounter never goes negative;
- a usage member cut out as text leaves the event byte for byte minus one slice, and when the
  event was a JSON object with a top-level usage, the edited event is that object without it
  (so the text edit never removes the wrong member; objects with a duplicated top-level key
  are not judged); insert_member returns bytes.

Found and fixed in sidecar/protocol/rewrite.py on the way (each now a test in tests/test_fuzz.py):
a "usage" key nested in a later member was cut instead of the top-level one; a brace inside a
string of the usage object was taken for its end (the event was cut into invalid JSON); a lone
escaped surrogate made the re-encoding fallback raise.

Last run (committed result; 2 cores shared with other work, one used):
    fuzz_long: 1000000 inputs, 0 failures, seed 1, 2311594 events, 112.8 s (8863 inputs/s)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass, field

from sidecar.protocol.openai import ChunkKind, TokenCounter, classify_chunk
from sidecar.protocol.rewrite import insert_member, strip_usage_member, without_usage
from sidecar.protocol.sse import BOM, SSEError, SSEParser

_TEXT_ALPHABET = 'abc xyz "\\{}[],:\n\r\t\u00e9\u4e2d\U0001f642' + "usage" * 3 + "data: [DONE]"
_NOISE = [
    b"\n",
    b"\r",
    b"\r\n",
    b"\n\n",
    b":",
    b" ",
    b"data:",
    b"data: ",
    b"id:",
    b"event:",
    b"retry:",
    b"{",
    b"}",
    b'"',
    b"\\",
    b'"usage"',
    b',"usage":',
    b"null",
    b"\xff",
    b"\x00",
    b"\xc3",
    BOM,
    b"[DONE]",
    b"\xf0\x9f\x99",
]
MAX_EVENT_SIZES = (64, 512, 4096)


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(_TEXT_ALPHABET) for _ in range(rng.randrange(0, 12)))


def _usage(rng: random.Random) -> dict[str, object]:
    usage: dict[str, object] = {
        "prompt_tokens": rng.randrange(0, 900),
        "total_tokens": rng.randrange(0, 900),
        "completion_tokens": rng.randrange(0, 300),
    }
    if rng.random() < 0.3:
        usage["prompt_tokens_details"] = {"cached_tokens": rng.randrange(0, 50)}
    if rng.random() < 0.2:
        usage["completion_tokens_details"] = None
    return usage


def _event(rng: random.Random) -> bytes:
    """One vLLM-shaped event (compact chat JSON, spaced completions JSON)."""
    kind = rng.randrange(10)
    chat = rng.random() < 0.5
    if kind == 0:
        return b"data: [DONE]\n\n"
    if kind == 1:
        return b": keep-alive\n\n"
    if kind == 2:
        obj: dict[str, object] = {
            "error": {
                "message": _text(rng),
                "type": "BadRequestError",
                "param": None,
                "code": rng.choice([400, 500]),
            }
        }
    elif kind == 3:
        obj = {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [],
            "usage": _usage(rng),
        }
        if rng.random() < 0.5:
            obj["system_fingerprint"] = "vllm-x"
    else:
        text = _text(rng)
        finish = rng.choice([None, None, "stop", "length"])
        if chat:
            delta: dict[str, object] = rng.choice(
                [
                    {"content": text},
                    {"role": "assistant", "content": ""},
                    {"reasoning": text},
                    {
                        "tool_calls": [
                            {"index": 0, "function": {"arguments": json.dumps({"usage": text})}}
                        ]
                    },
                ]
            )
            choice: dict[str, object] = {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = {
            "id": "x",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 1,
            "model": "m",
            "choices": [choice],
        }
        if rng.random() < 0.6:
            obj["usage"] = _usage(rng)
        if rng.random() < 0.5:
            obj["kv_transfer_params"] = None
        if rng.random() < 0.05:
            # A nested member named usage after the top-level one: the text edit must not
            # take it for the top-level usage.
            obj["kv_transfer_params"] = {"a": 1, "usage": None}
    separators = (",", ":") if chat else (", ", ": ")
    return (
        b"data: "
        + json.dumps(obj, separators=separators, ensure_ascii=rng.random() < 0.5).encode()
        + b"\n\n"
    )


def _mutate(rng: random.Random, data: bytes, max_event: int) -> bytes:
    buf = bytearray(data)
    choice = rng.randrange(8)
    if choice == 0 and buf:  # flip bytes
        for _ in range(rng.randrange(1, 4)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
    elif choice == 1:  # insert interesting bytes
        at = rng.randrange(len(buf) + 1)
        buf[at:at] = b"".join(rng.choice(_NOISE) for _ in range(rng.randrange(1, 5)))
    elif choice == 2 and buf:  # delete a slice
        a = rng.randrange(len(buf))
        del buf[a : a + rng.randrange(1, 40)]
    elif choice == 3 and buf:  # duplicate a slice
        a = rng.randrange(len(buf))
        buf[a:a] = buf[a : a + rng.randrange(1, 60)]
    elif choice == 4 and buf:  # cut the stream
        del buf[rng.randrange(len(buf)) :]
    elif choice == 5:  # a huge line, sometimes a whole huge event
        at = rng.randrange(len(buf) + 1)
        huge = b"data: " + b"x" * rng.randrange(max_event // 2, max_event * 2)
        buf[at:at] = huge + (b"\n\n" if rng.random() < 0.5 else b"")
    elif choice == 6:  # pure random bytes
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 200)))
    else:  # CRLF line endings everywhere
        return bytes(buf).replace(b"\n", b"\r\n")
    return bytes(buf)


def make_input(rng: random.Random) -> tuple[list[bytes], int]:
    """One input: the reads of one stream, and the parser's max_event_size."""
    max_event = rng.choice(MAX_EVENT_SIZES)
    stream = b"".join(_event(rng) for _ in range(rng.randrange(1, 9)))
    if rng.random() < 0.1:
        stream = BOM + stream
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
        stream = _mutate(rng, stream, max_event)
    cuts = sorted(rng.randrange(len(stream) + 1) for _ in range(rng.randrange(0, 8)))
    bounds = [0, *cuts, len(stream)]
    return [stream[a:b] for a, b in zip(bounds, bounds[1:], strict=False)], max_event


class FuzzFailure(AssertionError):
    pass


def check(reads: list[bytes], max_event: int) -> int:
    """Run one input through the relay's per-event code; raise FuzzFailure on a violation.
    Returns the number of events parsed."""
    parser = SSEParser(max_event_size=max_event)
    counter = TokenCounter()
    fed = bytearray()
    seen = bytearray()
    failed = False
    events_total = 0
    for data in reads:
        if failed:
            try:
                parser.feed(data)
            except SSEError:
                continue
            raise FuzzFailure("a failed parser accepted more input")
        fed += data
        try:
            events = parser.feed(data)
        except SSEError as exc:
            failed = True
            events = exc.events
        if not failed and parser.pending_bytes > max_event:
            raise FuzzFailure(f"pending {parser.pending_bytes} > max_event_size {max_event}")
        for event in events:
            events_total += 1
            seen += event.raw
            if event.data is None:
                continue
            _check_event(event.raw, event.data, counter)
    if not failed:
        if bytes(seen) + parser.pending != bytes(fed):
            raise FuzzFailure("event bytes + pending != bytes fed")
        for event in parser.close():
            events_total += 1
            if event.data is not None:
                _check_event(event.raw, event.data, counter)
    return events_total


def _check_event(raw: bytes, data: str, counter: TokenCounter) -> None:
    info = classify_chunk(data)
    if not isinstance(info.kind, ChunkKind):
        raise FuzzFailure(f"classify_chunk returned {info!r}")
    if counter.observe(info) < 0 or counter.total < 0:
        raise FuzzFailure("negative token count")
    out, cut, reencoded = without_usage(raw, data)
    if not isinstance(out, bytes):
        raise FuzzFailure("without_usage returned no bytes")
    stripped = strip_usage_member(raw)
    if stripped is not None:
        edited, at = stripped
        if not (
            len(edited) < len(raw) and raw.startswith(edited[:at]) and raw.endswith(edited[at:])
        ):
            raise FuzzFailure("strip_usage_member did not cut exactly one slice")
    if cut is not None:
        if not (raw.startswith(out[:cut]) and raw.endswith(out[cut:])):
            raise FuzzFailure("without_usage edited more than one slice")
        _check_semantics(data, out)
    elif reencoded:
        _check_semantics(data, out)
    if not isinstance(insert_member(out, cut, "system_fingerprint", "fp"), bytes):
        raise FuzzFailure("insert_member returned no bytes")


def _check_semantics(data: str, out: bytes) -> None:
    """The edited event is the original object minus its top-level usage. (An object with a
    key given twice at its top level has no one meaning, so is not judged: JSON parsers keep the
    last, which is the one the edit removes.)"""
    try:
        pairs = json.loads(data, object_pairs_hook=lambda items: items)
        original = json.loads(data)
    except (ValueError, RecursionError):
        return
    if not isinstance(original, dict) or "usage" not in original:
        return
    if len({key for key, _ in pairs}) != len(pairs):
        return
    expected = {k: v for k, v in original.items() if k != "usage"}
    body = out[len(b"data: ") : -2] if out.startswith(b"data: ") and out.endswith(b"\n\n") else b""
    try:
        edited = json.loads(body.decode("utf-8", "replace"))
    except ValueError:
        raise FuzzFailure(f"the edited event is not JSON: {out[:200]!r}") from None
    if edited != expected:
        raise FuzzFailure(f"the edit removed the wrong member: {data[:300]!r} -> {out[:300]!r}")


@dataclass
class Result:
    inputs: int = 0
    events: int = 0
    failures: list[str] = field(default_factory=list)


def run(inputs: int, seed: int, stop_after_failures: int = 10) -> Result:
    rng = random.Random(seed)
    result = Result()
    for i in range(inputs):
        reads, max_event = make_input(rng)
        try:
            result.events += check(reads, max_event)
        except Exception as exc:  # noqa: BLE001 - every escape is a finding
            result.failures.append(
                f"input {i}: {type(exc).__name__}: {exc} "
                f"(reads={reads!r:.300}, max_event={max_event})"
            )
            if len(result.failures) >= stop_after_failures:
                result.inputs = i + 1
                return result
        result.inputs = i + 1
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="CI smoke run: 2000 inputs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.inputs = 2000
    started = time.perf_counter()
    result = run(args.inputs, args.seed)
    elapsed = time.perf_counter() - started
    for failure in result.failures:
        print(failure)
    print(
        f"fuzz_long: {result.inputs} inputs, {len(result.failures)} failures, seed "
        f"{args.seed}, {result.events} events, {elapsed:.1f} s "
        f"({result.inputs / elapsed:.0f} inputs/s)"
    )
    return 1 if result.failures else 0


if __name__ == "__main__":
    sys.exit(main())
