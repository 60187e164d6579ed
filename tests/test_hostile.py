"""A hostile upstream, end to end (issue 16): each attack is reproduced on a real socket first,
then what the client gets and what the record says are checked. Every test ends with the
accounting invariant (`settle`: requests in == records out, nothing left in flight).

The upstream is `RawUpstream`: it writes whatever bytes a test gives it, as a broken or
malicious server would.
"""

from __future__ import annotations

import asyncio
import gzip
import json
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import aiohttp
import pytest
from reliability_helpers import RawUpstream, proxy_to
from reliability_helpers import settle as settle_records
from vllm_chunks import CHAT_BANG, CHAT_HELLO, CHAT_ROLE, CHAT_USAGE

from sidecar.record import Outcome, RequestRecord, TokenSource
from sidecar.sim.server import SimConfig, close_replicas, start_replicas

# One xdist worker runs the whole module (pyproject.toml: --dist loadgroup): the
# accounting invariant below is checked over the whole module.
pytestmark = pytest.mark.xdist_group("test_hostile")

CHAT = "/v1/chat/completions"

# The accounting invariant across the whole hostile suite: every request sent ends in exactly
# one record. Each test's `settle` adds what it sent and what was recorded, by outcome; the
# module's teardown checks the sums and prints them.
TALLY: Counter[str] = Counter()


async def settle(server: Any, records: Any, expected: int) -> list[RequestRecord]:
    got = await settle_records(server, records, expected)
    TALLY["sent"] += expected
    TALLY.update(f"outcome {r.outcome.value}" for r in got)
    return got


@pytest.fixture(scope="module", autouse=True)
def accounting(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    recorded = sum(v for k, v in TALLY.items() if k.startswith("outcome "))
    line = ", ".join(
        f"{k.removeprefix('outcome ')} {v}"
        for k, v in sorted(TALLY.items())
        if k.startswith("outcome ")
    )
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and TALLY["sent"]:
        reporter.write_line(
            f"\nhostile suite: {TALLY['sent']} requests sent, {recorded} records ({line})"
        )
    assert recorded == TALLY["sent"], TALLY


def chat_body(stream: bool = True, **extra: object) -> bytes:
    return json.dumps(
        {
            "model": "M",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": stream,
            "max_tokens": 3,
            **extra,
        }
    ).encode()


def event(payload: str) -> bytes:
    return b"data: " + payload.encode() + b"\n\n"


def with_usage(payload: str, completion: int | str, prompt: int | str = 12) -> str:
    """The chunk as vLLM writes it with continuous usage (the member after `choices`); the
    counts are spliced in as raw JSON text, so that a test can write any number."""
    obj = json.loads(payload)
    obj.pop("system_fingerprint", None)
    text = json.dumps(obj, separators=(",", ":"))
    at = text.index(',"kv_transfer_params"') if "kv_transfer_params" in text else len(text) - 1
    usage = (
        f',"usage":{{"prompt_tokens":{prompt},"total_tokens":{prompt},'
        f'"completion_tokens":{completion}}}'
    )
    return text[:at] + usage + text[at:]


def chunked_sse(events: Sequence[bytes]) -> bytes:
    """An HTTP/1.1 streamed answer, one chunk per event, as uvicorn writes it."""
    out = [
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    ]
    for data in events:
        out.append(b"%x\r\n%s\r\n" % (len(data), data))
    out.append(b"0\r\n\r\n")
    return b"".join(out)


async def exchange(
    url: str, body: bytes, request_id: str, path: str = CHAT
) -> tuple[int, dict[str, str], bytes]:
    """One request on a raw connection; the answer's status, headers and de-chunked body."""
    host, port = url.split("://")[1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"X-Request-Id: {request_id}\r\nConnection: close\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        + body
    )
    raw = await asyncio.wait_for(reader.read(), 20)
    writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        body_out = b""
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            body_out += rest[:size]
            rest = rest[size + 2 :]
        rest = body_out
    return int(lines[0].split(" ", 2)[1]), headers, rest


def answering(data: bytes) -> RawUpstream:
    async def answer(_c: int, _n: int, _head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(data)
        return False

    return RawUpstream(answer)


# -- 1. usage numbers that cannot be believed ------------------------------------------------

PLAIN = event(CHAT_ROLE) + event(CHAT_HELLO) + event(CHAT_BANG) + b"data: [DONE]\n\n"


async def test_usage_beyond_int64_loses_nothing() -> None:
    """Usage of 2**63 once raised OverflowError in the record builder: no record, and the
    client got 200 headers and an empty body. Now the client gets the stream it would have got
    (injected usage cut out) and the record says malformed usage, with estimated counts."""
    huge = str(2**63)
    events = [
        event(with_usage(CHAT_ROLE, 0)),
        event(with_usage(CHAT_HELLO, huge, huge)),
        event(with_usage(CHAT_BANG, 2)),
        event(CHAT_USAGE),
        b"data: [DONE]\n\n",
    ]
    async with (
        answering(chunked_sse(events)) as url,
        proxy_to([url], engine_scrape_interval="0") as p,
    ):
        status, _, body = await exchange(p.url, chat_body(), "huge-usage")
        (record,) = await settle(p.server, p.records, 1)
    assert status == 200
    assert body == PLAIN  # byte for byte what vLLM would have sent
    assert record.outcome is Outcome.UPSTREAM_ERROR and record.error_type == "malformed_usage"
    assert (record.n_in, record.n_out, record.token_source) == (None, 2, TokenSource.CHUNK_COUNT)
    # What OpenTelemetry's gen_ai.response.* and gen_ai.request.max_tokens come from.
    assert {
        k: record.attributes.get(k) for k in ("response_model", "response_id", "request_max_tokens")
    } == {"response_model": "M", "response_id": "chatcmpl-abc123", "request_max_tokens": "3"}


# -- 3 and 8. answers that never come, streams that never end -------------------------------


def silent() -> RawUpstream:
    """Takes the request and never answers (until the test ends)."""

    async def answer(_c: int, _n: int, _head: bytes, _writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(30)
        return False

    return RawUpstream(answer)


async def test_a_silent_replica_ends_a_non_streamed_request_in_504() -> None:
    """A non-streamed answer arrives whole, so neither the TTFT nor the idle timeout applies:
    once only the total timeout (off) bounded it, and a silent replica held it for ever.
    `--nonstream-timeout` (1 h by default) ends it in 504."""
    async with (
        silent() as url,
        proxy_to([url], engine_scrape_interval="0", nonstream_timeout="300ms") as p,
    ):
        status, _, body = await exchange(p.url, chat_body(stream=False), "silent")
        (record,) = await settle(p.server, p.records, 1)
    assert status == 504
    assert "nonstream timeout" in json.loads(body)["error"]["message"]
    assert record.outcome is Outcome.TIMEOUT and record.error_type == "nonstream_timeout"


def test_the_default_limits_bound_every_request() -> None:
    from sidecar.config import build_config

    config = build_config({"upstreams": ["http://127.0.0.1:1"]}, {})
    assert config.nonstream_timeout == 3600.0
    assert config.total_timeout == 4 * 3600.0
    assert config.max_stream_events == 1_000_000


def trickling(events: Sequence[bytes], gap_s: float) -> RawUpstream:
    """Streams ``events`` one at a time, ``gap_s`` apart, then hangs without [DONE]."""

    async def answer(_c: int, _n: int, _head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        for data in events:
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()
            await asyncio.sleep(gap_s)
        await asyncio.sleep(30)
        return False

    return RawUpstream(answer)


async def test_a_stream_that_trickles_ends_at_the_total_timeout_with_an_error_event() -> None:
    """An event every 50 ms never trips the idle timeout; the total timeout ends the stream
    with vLLM's error event and [DONE], after whole events only."""
    events = [event(CHAT_ROLE)] + [event(CHAT_HELLO)] * 200
    async with (
        trickling(events, 0.05) as url,
        proxy_to([url], engine_scrape_interval="0", total_timeout="400ms", idle_timeout="10s") as p,
    ):
        status, _, body = await exchange(p.url, chat_body(), "trickle")
        (record,) = await settle(p.server, p.records, 1)
    assert status == 200, body
    parts = body.split(b"\n\n")
    assert parts[-1] == b"" and parts[-2] == b"data: [DONE]", (record.error_type, body[-300:])
    error = json.loads(parts[-3].removeprefix(b"data: "))["error"]
    assert error["code"] == 504 and "total timeout" in error["message"]
    assert all(part.startswith(b"data: {") for part in parts[:-3])  # whole events, none cut
    assert record.outcome is Outcome.TIMEOUT and record.error_type == "total_timeout"
    assert record.n_out is not None and 2 <= record.n_out <= 10


async def test_a_stream_of_too_many_events_is_cut_with_an_error_event() -> None:
    """Each event costs the record ~16 bytes: a stream of endless events is cut at
    --max-stream-events with an error event, the events before it relayed and counted."""
    events = [event(CHAT_ROLE) + event(CHAT_HELLO) * 40]
    async with (
        trickling(events, 0) as url,
        proxy_to([url], engine_scrape_interval="0", max_stream_events="25") as p,
    ):
        status, _, body = await exchange(p.url, chat_body(), "endless")
        (record,) = await settle(p.server, p.records, 1)
    assert status == 200
    parts = body.split(b"\n\n")
    assert parts[-2] == b"data: [DONE]"
    error = json.loads(parts[-3].removeprefix(b"data: "))["error"]
    assert error["code"] == 502 and "limit of 25 events" in error["message"]
    assert len(parts) - 3 == 25  # the 25 events before the limit, relayed
    assert record.outcome is Outcome.UPSTREAM_ERROR and record.error_type == "too_many_events"
    assert record.n_out == 24 and record.token_source is TokenSource.CHUNK_COUNT


# -- 7. SSE and HTTP edges ---------------------------------------------------------------------


async def test_a_stream_ending_with_a_lone_cr_is_complete() -> None:
    events = [event(CHAT_ROLE), event(CHAT_HELLO), b"data: [DONE]\r\r"]
    async with (
        answering(chunked_sse(events)) as url,
        proxy_to([url], engine_scrape_interval="0", inject_usage="0") as p,
    ):
        status, _, body = await exchange(p.url, chat_body(), "cr")
        (record,) = await settle(p.server, p.records, 1)
    assert status == 200 and body == b"".join(events)  # no error event after [DONE]
    assert record.outcome is Outcome.OK, record.error_type


async def test_events_after_done_are_not_relayed_or_counted() -> None:
    events = [event(CHAT_ROLE), event(CHAT_HELLO), b"data: [DONE]\n\n", event(CHAT_HELLO) * 3]
    async with (
        answering(chunked_sse(events)) as url,
        proxy_to([url], engine_scrape_interval="0", inject_usage="0") as p,
    ):
        status, _, body = await exchange(p.url, chat_body(), "after")
        (record,) = await settle(p.server, p.records, 1)
    assert status == 200 and body == b"".join(events[:3])
    assert record.outcome is Outcome.OK and record.n_out == 1


async def test_an_invalid_chunk_size_fails_at_once_not_at_the_idle_timeout() -> None:
    async def answer(_c: int, _n: int, _head: bytes, writer: asyncio.StreamWriter) -> bool:
        head = (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        data = event(CHAT_HELLO)
        writer.write(head + b"%x\r\n%s\r\n" % (len(data), data) + b"zz\r\nnot a chunk\r\n")
        await asyncio.sleep(30)  # and then nothing: only the parser can tell
        return False

    async with (
        RawUpstream(answer) as url,
        proxy_to([url], engine_scrape_interval="0", idle_timeout="20s") as p,
    ):
        started = asyncio.get_running_loop().time()
        status, _, body = await exchange(p.url, chat_body(), "badchunk")
        elapsed = asyncio.get_running_loop().time() - started
        (record,) = await settle(p.server, p.records, 1)
    assert elapsed < 10  # not the 20 s idle timeout
    assert status == 200 and body.endswith(b"data: [DONE]\n\n") and b'"code":502' in body
    assert record.outcome is Outcome.UPSTREAM_ERROR


async def test_a_compressed_answer_is_refused_not_garbled() -> None:
    """The proxy asks for identity; a gzip answer once got a plaintext error event under
    Content-Encoding: gzip. It is refused whole, in vLLM's error shape."""
    gz = gzip.compress(b"".join([event(CHAT_HELLO), b"data: [DONE]\n\n"]))
    answer = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-encoding: gzip\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(gz), gz)
    )
    async with answering(answer) as url, proxy_to([url], engine_scrape_interval="0") as p:
        status, headers, body = await exchange(p.url, chat_body(), "gzip")
        (record,) = await settle(p.server, p.records, 1)
    assert status == 502 and "content-encoding" not in headers
    assert "Content-Encoding: 'gzip'" in json.loads(body)["error"]["message"]
    assert record.outcome is Outcome.UPSTREAM_ERROR and record.error_type == "content_encoding"


# -- 9. what a client or an operator meets ----------------------------------------------------


def recording() -> tuple[RawUpstream, list[bytes]]:
    """An upstream that answers 200 {} to anything and keeps each request head."""
    heads: list[bytes] = []

    async def answer(_c: int, _n: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        heads.append(head)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
        )
        return False

    return RawUpstream(answer), heads


async def raw_get(url: str, target: str, headers: str = "") -> tuple[int, bytes]:
    host, port = url.split("://")[1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"GET {target} HTTP/1.1\r\nHost: x\r\n{headers}Connection: close\r\n\r\n".encode())
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return int(raw.split(b" ", 2)[1]), raw


@pytest.mark.parametrize(
    "target",
    [
        "/v1/../../etc/passwd",
        "/v1/%2e%2e/%2E%2E/etc/passwd",
        "/v1/models/./x",
        "/v1/..%2f..%2fetc",
        "/v1\\..\\x",
    ],
)
async def test_paths_that_normalise_elsewhere_are_refused(target: str) -> None:
    upstream, heads = recording()
    async with upstream as url, proxy_to([url], engine_scrape_interval="0") as p:
        status, raw = await raw_get(p.url, target)
        assert (await raw_get(p.url, "/v1/models?x=a/../b"))[0] == 200  # a query is not a path
        records = await settle(p.server, p.records, 2)
    assert status == 400 and b"'..' segments" in raw
    refused = [r for r in records if r.outcome is Outcome.REJECTED]
    assert len(refused) == 1 and refused[0].error_type == "dot_segment_path"
    assert [h.split(b" ")[1] for h in heads] == [b"/v1/models?x=a/../b"]  # sent as written


async def test_the_client_address_is_appended_to_x_forwarded_for() -> None:
    upstream, heads = recording()
    async with upstream as url, proxy_to([url], engine_scrape_interval="0") as p:
        await raw_get(p.url, "/v1/models", "X-Forwarded-For: 6.6.6.6\r\n")
        await raw_get(p.url, "/v1/models")
        await settle(p.server, p.records, 2)
    forwarded = [
        [line for line in h.split(b"\r\n") if line.lower().startswith(b"x-forwarded-for:")]
        for h in heads
    ]
    assert forwarded == [[b"X-Forwarded-For: 6.6.6.6, 127.0.0.1"], [b"X-Forwarded-For: 127.0.0.1"]]


async def test_admin_token_scheme_is_case_insensitive_and_probes_stay_open() -> None:
    upstream, _ = recording()
    async with (
        upstream as url,
        proxy_to([url], engine_scrape_interval="0", admin_token=" s3cret\n") as p,
    ):
        async with aiohttp.ClientSession() as session:
            results = {}
            for name, auth in (
                ("none", None),
                ("Bearer", "Bearer s3cret"),
                ("bearer", "bearer s3cret"),
                ("BEARER", "BEARER  s3cret"),
                ("wrong", "Bearer s3cre"),
                ("basic", "Basic s3cret"),
            ):
                headers = {"Authorization": auth} if auth else {}
                async with session.get(p.admin + "/replicas", headers=headers) as response:
                    results[name] = response.status
                    assert response.headers["Server"] == "vllm-sidecar"
            for probe in ("/healthz", "/readyz"):
                async with session.get(p.admin + probe) as response:
                    results[probe] = response.status
    assert results == {
        "none": 401,
        "Bearer": 200,
        "bearer": 200,
        "BEARER": 200,
        "wrong": 401,
        "basic": 401,
        "/healthz": 200,
        "/readyz": 200,
    }


async def test_readyz_follows_upstream_health() -> None:
    """/healthz says the process serves; /readyz says whether it can relay: 503 once every
    replica is ejected, 200 again when one answers its health check (worker mode:
    tests/test_proxy_workers.py)."""
    sims = await start_replicas(SimConfig(), 1)
    port = sims[0].port
    try:
        flags = {"health_interval": "50ms", "eject_after": "1"}
        async with proxy_to([sims[0].url], **flags) as p, aiohttp.ClientSession() as session:

            async def ready() -> int:
                async with session.get(p.admin + "/readyz") as response:
                    return response.status

            assert await ready() == 200
            await close_replicas(sims)
            await until_status(ready, 503)
            async with session.get(p.admin + "/healthz") as response:
                assert response.status == 200
            sims = await start_replicas(SimConfig(), 1, port=port)
            await until_status(ready, 200)
    finally:
        await close_replicas(sims)


async def until_status(probe: Any, status: int) -> None:
    for _ in range(500):
        if await probe() == status:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"/readyz never answered {status}")
