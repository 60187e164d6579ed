"""The measuring proxy over real sockets: simulator replicas <- proxy <- real clients."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from proxy_stack import FAST_ENGINE, proxy_to, scripted_upstream, stack
from reliability_helpers import until

from sidecar import stats
from sidecar.record import Outcome, TokenSource, Vantage
from sidecar.sim.engine import EngineConfig
from sidecar.sim.server import SimConfig

CREATED = re.compile(rb'"created": ?\d+')


def normalised(body: bytes) -> bytes:
    return CREATED.sub(b'"created":0', body)


async def post(
    session: aiohttp.ClientSession,
    url: str,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes, Any]:
    async with session.post(url + path, json=body, headers=headers) as response:
        return response.status, await response.read(), response.headers


CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "Tell me a story"}],
    "max_tokens": 6,
    "ignore_eos": True,
}
COMPLETION = {"model": "m", "prompt": "Once upon a time", "max_tokens": 6, "ignore_eos": True}
USAGE_OPTIONS: list[dict[str, Any] | None] = [
    None,
    {"include_usage": True},
    {"include_usage": True, "continuous_usage_stats": True},
    {"continuous_usage_stats": True},
]


@pytest.mark.parametrize(
    "path,base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]
)
@pytest.mark.parametrize("options", USAGE_OPTIONS)
async def test_streams_reach_the_client_byte_for_byte(
    path: str, base: dict[str, Any], options: dict[str, Any] | None
) -> None:
    """Whatever usage options the client chose, it gets the bytes it would get directly,
    while the proxy counts tokens exactly from the usage it added."""
    body = {**base, "stream": True}
    if options is not None:
        body["stream_options"] = options
    async with stack() as s, aiohttp.ClientSession() as session:
        rid = {"X-Request-Id": "same-id-1"}
        status_d, direct, _ = await post(session, s.direct, path, body, rid)
        status_p, proxied, headers = await post(session, s.url, path, body, rid)
        assert status_d == status_p == 200
        assert normalised(proxied) == normalised(direct)
        assert headers["X-Request-Id"] == "same-id-1"
        (record,) = await s.records.wait_for(1)
    assert record.outcome is Outcome.OK
    assert record.n_out == 6 and record.n_in is not None and record.n_in > 0
    assert record.token_source is TokenSource.USAGE
    assert [m.n_tokens for m in record.client.marks] == [1] * 6
    assert record.server is not None and len(record.server.marks) == 6
    assert record.finish_reason == "length"


async def test_a_replica_that_echoes_the_request_id_is_not_echoed_twice() -> None:
    """vLLM run with --enable-request-id-headers answers with the X-Request-Id it was sent
    (the proxy's): the client reads it once, streamed, whole or refused, and it is the id
    the record carries."""
    sim = SimConfig(model="m", engine=FAST_ENGINE, enable_request_id_headers=True)
    async with stack(sim=sim) as s, aiohttp.ClientSession() as session:
        bodies = [{**CHAT, "stream": True}, CHAT, {**CHAT, "max_tokens": -1}]
        for i, body in enumerate(bodies):
            status, _, headers = await post(
                session, s.url, "/v1/chat/completions", body, {"X-Request-Id": f"echo-{i}"}
            )
            assert status == (400 if i == 2 else 200)
            assert headers.getall("X-Request-Id") == [f"echo-{i}"]
        records = await s.records.wait_for(3)
    assert sorted(r.request_id for r in records) == ["echo-0", "echo-1", "echo-2"]


@pytest.mark.parametrize(
    "path,base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]
)
async def test_non_streaming_bodies_are_unchanged(path: str, base: dict[str, Any]) -> None:
    async with stack() as s, aiohttp.ClientSession() as session:
        rid = {"X-Request-Id": "same-id-2"}
        _, direct, _ = await post(session, s.direct, path, base, rid)
        _, proxied, _ = await post(session, s.url, path, base, rid)
        assert normalised(proxied) == normalised(direct)
        (record,) = await s.records.wait_for(1)
    assert record.outcome is Outcome.OK and not record.client_stream
    assert record.n_out == 6 and record.token_source is TokenSource.USAGE_TOTAL
    assert record.client.marks == () and record.client.end_ns is not None


async def test_openai_client_gets_identical_results_through_the_proxy() -> None:
    async with stack() as s:
        results = []
        for base in (s.direct, s.url):
            client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-secret-key")
            try:
                stream = await client.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=5,
                    stream=True,
                    extra_body={"ignore_eos": True},
                    extra_headers={"X-Request-Id": "oa-1"},
                )
                chunks = [c.model_dump(exclude={"created"}) async for c in stream]
                completion = await client.completions.create(
                    model="m",
                    prompt="hello",
                    max_tokens=4,
                    extra_body={"ignore_eos": True},
                    extra_headers={"X-Request-Id": "oa-2"},
                )
                results.append((chunks, completion.model_dump(exclude={"created"})))
            finally:
                await client.close()
        assert results[0] == results[1]
        records = await s.records.wait_for(2)
    # Credentials never reach a record.
    assert "sk-secret-key" not in json.dumps([r.to_dict() for r in records])


async def test_multi_token_chunks_are_counted_exactly() -> None:
    sim = SimConfig(
        model="m", engine=EngineConfig(step_floor_s=0.002, per_token_s=0.0, stream_interval=3)
    )
    async with stack(sim=sim) as s, aiohttp.ClientSession() as session:
        status, body, _ = await post(
            session, s.url, "/v1/chat/completions", {**CHAT, "max_tokens": 8, "stream": True}
        )
        assert status == 200 and b'"usage"' not in body
        (record,) = await s.records.wait_for(1)
    # First token alone, then every 3 tokens, the rest at the end: 1 + 3 + 3 + 1.
    assert [m.n_tokens for m in record.client.marks] == [1, 3, 3, 1]
    assert record.n_out == 8 and record.token_source is TokenSource.USAGE


async def test_without_usage_injection_counts_are_labelled_estimates() -> None:
    sim = SimConfig(
        model="m", engine=EngineConfig(step_floor_s=0.002, per_token_s=0.0, stream_interval=2)
    )
    async with stack(sim=sim, inject_usage=False) as s, aiohttp.ClientSession() as session:
        await post(session, s.url, "/v1/completions", {**COMPLETION, "stream": True})
        (record,) = await s.records.wait_for(1)
    assert record.token_source is TokenSource.CHUNK_COUNT
    assert record.n_out == len(record.client.marks) < 6  # an undercount, and labelled so


async def test_server_side_stamps_match_the_simulators_ground_truth(tmp_path: Path) -> None:
    truth_file = tmp_path / "truth.jsonl"
    sim = SimConfig(
        model="m",
        engine=EngineConfig(step_floor_s=0.05, per_token_s=0.0),
        ground_truth_path=str(truth_file),
    )
    async with stack(sim=sim) as s, aiohttp.ClientSession() as session:
        await post(
            session,
            s.url,
            "/v1/chat/completions",
            {**CHAT, "max_tokens": 10, "stream": True},
            {"X-Request-Id": "gt-1"},
        )
        (record,) = await s.records.wait_for(1)
    truth = [json.loads(line) for line in truth_file.read_text().splitlines()]
    (line,) = [t for t in truth if t["request_id"] == "gt-1"]
    token_stamps = [
        ns
        for ns, kind in zip(line["chunk_ns"], line["chunk_kinds"], strict=True)
        if kind == "token"
    ]
    assert record.server is not None
    marks = record.server.marks
    assert len(marks) == len(token_stamps) == 10
    assert [m.n_tokens for m in marks] == [
        n for n, k in zip(line["chunk_tokens"], line["chunk_kinds"], strict=True) if k == "token"
    ]
    # ITL: every gap the proxy saw against the gap the simulator wrote. The engine steps every
    # 50 ms, so a mark paired with the wrong chunk would be off by >= 50 ms; the tolerance
    # (half that) is far above the proxy's real error (benchmarks/RESULTS.md: tenths of a ms)
    # and holds on a host loaded by other tests (the suite runs in parallel processes: 12 ms
    # of scheduling delay between the proxy's send and the simulator's receipt was seen).
    tolerance_ns = 25_000_000
    proxy_gaps = [b.offset_ns - a.offset_ns for a, b in pairwise(marks)]
    truth_gaps = [b - a for a, b in pairwise(token_stamps)]
    assert max(abs(p - t) for p, t in zip(proxy_gaps, truth_gaps, strict=True)) < tolerance_ns
    proxy_ttft = marks[0].offset_ns - record.server.start_ns
    truth_ttft = token_stamps[0] - line["received_ns"]
    assert truth_ttft > 0 and abs(proxy_ttft - truth_ttft) < tolerance_ns


async def test_assembled_non_streaming_answer_has_the_upstreams_shape() -> None:
    async with stack(assemble_nonstream=True) as s, aiohttp.ClientSession() as session:
        for path, base in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
            rid = {"X-Request-Id": f"asm-{path}"}
            _, direct, _ = await post(session, s.direct, path, base, rid)
            _, assembled, _ = await post(session, s.url, path, base, rid)
            assert normalised(assembled) == normalised(direct)
        records = await s.records.wait_for(2)
    for record in records:
        assert record.attributes["assembled"] == "true" and not record.client_stream
        assert record.server is not None and len(record.server.marks) == 6
        assert record.client.marks == () and record.n_out == 6


FAULTS: list[tuple[str, Outcome, str]] = [
    ("error_status=500", Outcome.HTTP_ERROR, "InternalServerError"),
    ("error_event_after=2", Outcome.HTTP_ERROR, "InternalServerError"),
    ("reset_after=2", Outcome.UPSTREAM_ERROR, "upstream_"),
    ("close_after=2", Outcome.UPSTREAM_ERROR, "stream_cut_without_done"),
    ("malformed_after=1", Outcome.UPSTREAM_ERROR, "malformed_chunk"),
    ("stall_ms=1500@after=2", Outcome.TIMEOUT, "idle_timeout"),
    ("slow_headers_ms=1500", Outcome.TIMEOUT, "ttft_timeout"),
]


@pytest.mark.parametrize("fault,outcome,error_type", FAULTS)
async def test_every_fault_ends_in_one_record_while_other_streams_go_on(
    fault: str, outcome: Outcome, error_type: str
) -> None:
    async with (
        stack(idle_timeout="500ms", ttft_timeout="700ms") as s,
        aiohttp.ClientSession() as session,
    ):
        healthy_body = {**CHAT, "max_tokens": 20, "stream": True}
        healthy = [
            asyncio.create_task(post(session, s.url, "/v1/chat/completions", healthy_body))
            for _ in range(3)
        ]
        status, body, _ = await post(
            session,
            s.url,
            "/v1/chat/completions",
            {**CHAT, "max_tokens": 8, "stream": True},
            {"X-Sim-Fault": fault, "X-Request-Id": "faulty"},
        )
        others = await asyncio.gather(*healthy)
        records = await s.records.wait_for(4)
        proxy = s.server.proxy
        assert proxy.requests_total == proxy.records_total == 4  # requests in == records out
        assert proxy.in_flight == 0
        assert all(r.outstanding == 0 for r in proxy.router.replicas)
    assert all(st == 200 and b"data: [DONE]" in b for st, b, _ in others)
    assert len(records) == 4
    (faulty,) = [r for r in records if r.request_id == "faulty"]
    assert faulty.outcome is outcome
    assert faulty.error_type is not None and faulty.error_type.startswith(error_type)
    assert all(r.outcome is Outcome.OK for r in records if r is not faulty)
    if fault.startswith(("error_status", "slow_headers")):
        assert status in (500, 504)
        assert json.loads(body)["error"]["code"] == status
    elif fault.startswith("malformed"):
        # Passive: the malformed event is relayed as it came, and so is the rest.
        assert status == 200 and body.endswith(b"data: [DONE]\n\n")
        assert len(faulty.client.marks) == 8
    else:
        # Mid-stream: the client gets an error event in vLLM's shape, then [DONE].
        assert status == 200
        assert body.endswith(b"data: [DONE]\n\n")
        assert b'"error":' in body


async def test_client_disconnect_closes_the_upstream_and_the_engine_aborts() -> None:
    sim = SimConfig(model="m", engine=EngineConfig(step_floor_s=0.05, per_token_s=0.0))
    async with stack(sim=sim) as s, aiohttp.ClientSession() as session:
        async with session.post(
            s.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 200, "stream": True}
        ) as response:
            await response.content.readline()  # the stream has started
        (record,) = await s.records.wait_for(1)
        assert record.outcome is Outcome.CLIENT_CANCELLED

        async def aborted() -> float:
            async with session.get(s.replicas[0].url + "/metrics") as metrics:
                text = await metrics.text()
            match = re.search(
                r'vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} '
                r"([0-9.]+)",
                text,
            )
            return float(match.group(1)) if match else 0.0

        for _ in range(100):
            if await aborted() >= 1:
                break
            await asyncio.sleep(0.02)
        assert await aborted() == 1.0


async def test_limits_reject_with_a_record() -> None:
    async with (
        stack(max_body_bytes="1000", max_concurrency="1") as s,
        aiohttp.ClientSession() as session,
    ):
        status, body, _ = await post(
            session, s.url, "/v1/completions", {**COMPLETION, "prompt": "x" * 2000}
        )
        assert status == 413 and json.loads(body)["error"]["code"] == 413
        slow = asyncio.create_task(
            post(
                session, s.url, "/v1/completions", {**COMPLETION, "max_tokens": 50, "stream": True}
            )
        )
        # The next request is sent once the slow one holds the only slot.
        await until(lambda: s.server.proxy.in_flight == 1, what="the slow stream in flight")
        status, body, _ = await post(session, s.url, "/v1/completions", COMPLETION)
        assert status == 429 and "limit of 1 concurrent" in json.loads(body)["error"]["message"]
        await slow
        records = await s.records.wait_for(3)
    outcomes = sorted(r.outcome.value for r in records)
    assert outcomes == ["ok", "rejected", "rejected"]
    assert {r.http_status for r in records if r.outcome is Outcome.REJECTED} == {413, 429}


async def test_upstream_errors_are_relayed_unchanged() -> None:
    async with stack() as s, aiohttp.ClientSession() as session:
        for body in ({**CHAT, "model": "nope"}, {"model": "m", "messages": "not a list"}):
            direct = await post(session, s.direct, "/v1/chat/completions", body)
            proxied = await post(session, s.url, "/v1/chat/completions", body)
            assert proxied[:2] == direct[:2] and direct[0] in (400, 404)
        async with session.post(s.url + "/v1/completions", data=b"{not json") as response:
            assert response.status == 400
        records = await s.records.wait_for(3)
    assert all(r.outcome is Outcome.HTTP_ERROR for r in records)
    assert {r.http_status for r in records} == {400, 404}
    assert "NotFoundError" in {r.error_type for r in records}


async def test_other_paths_pass_through() -> None:
    async with stack() as s, aiohttp.ClientSession() as session:
        for method, path, body in (
            ("GET", "/v1/models", None),
            ("GET", "/health", None),
            ("GET", "/version", None),
            ("POST", "/tokenize", {"model": "m", "prompt": "hi there"}),
        ):
            got = []
            for base in (s.direct, s.url):
                async with session.request(method, base + path, json=body) as response:
                    got.append((response.status, await response.read()))
            # /v1/models carries a creation time and a random permission id per call.
            direct, proxied = (
                (status, re.sub(rb"modelperm-[0-9a-f]+", b"modelperm-x", normalised(body)))
                for status, body in got
            )
            assert direct == proxied, path
        records = await s.records.wait_for(4)
    assert {r.endpoint for r in records} == {"/v1/models", "/health", "/version", "/tokenize"}
    assert all(r.outcome is Outcome.OK for r in records)


async def test_authorization_is_forwarded_and_never_kept() -> None:
    sim = SimConfig(model="m", engine=FAST_ENGINE, api_key="sk-top-secret")
    async with stack(sim=sim) as s, aiohttp.ClientSession() as session:
        denied = await post(session, s.url, "/v1/completions", COMPLETION)
        allowed = await post(
            session, s.url, "/v1/completions", COMPLETION, {"Authorization": "Bearer sk-top-secret"}
        )
        records = await s.records.wait_for(2)
    assert denied[0] == 401 and allowed[0] == 200
    assert "sk-top-secret" not in json.dumps([r.to_dict() for r in records])


async def test_round_robin_spreads_and_connect_failures_retry_elsewhere() -> None:
    async with (
        stack(n_replicas=2, route_policy="round_robin") as s,
        aiohttp.ClientSession() as session,
    ):
        for _ in range(4):
            await post(session, s.url, "/v1/completions", COMPLETION)
        records = await s.records.wait_for(4)
        assert {r.replica for r in records} == {u.url.split("://")[1] for u in s.replicas}
        await s.replicas[0].close()  # one replica dies
        for _ in range(4):
            status, _, _ = await post(session, s.url, "/v1/completions", COMPLETION)
            assert status == 200  # retried on the other before any byte went out
        records = await s.records.wait_for(8)
        dead = s.server.proxy.router.replicas[0]
        assert not dead.healthy and dead.ejections == 1


async def test_health_checks_eject_and_restore() -> None:
    async with stack(n_replicas=2, health_interval="50ms", eject_after="1") as s:
        router = s.server.proxy.router

        async def until(predicate: Callable[[], bool]) -> None:
            for _ in range(200):
                if predicate():
                    return
                await asyncio.sleep(0.02)
            raise AssertionError("condition not reached")

        await until(lambda: all(r.healthy for r in router.replicas))
        await s.replicas[1].close()
        await until(lambda: not router.replicas[1].healthy)
        assert router.replicas[0].healthy


async def test_stats_endpoint_reports_both_vantages_with_definitions() -> None:
    async with stack() as s, aiohttp.ClientSession() as session:
        for _ in range(3):
            await post(session, s.url, "/v1/chat/completions", {**CHAT, "stream": True})
        records = await s.records.wait_for(3)
        async with session.get(s.server.admin_url + "/stats") as response:
            snapshot = await response.json()
        async with session.get(s.server.admin_url + "/replicas") as response:
            replicas = await response.json()
        async with session.get(s.server.admin_url + "/metrics") as response:
            exposition = await response.text()
    assert snapshot["outcomes"]["ok"] == 3
    client, server = snapshot["vantages"]["client"], snapshot["vantages"]["server"]
    assert client["ttft"]["count"] == server["ttft"]["count"] == 3
    assert client["itl"]["count"] == 15  # 5 gaps x 3 requests, sample = event
    assert client["ttft"]["p50"] >= server["ttft"]["p50"] > 0
    assert "sample = event" in snapshot["definitions"]["itl"]
    assert replicas["records_total"] == 3
    # The proxy's own delay: each of the 18 token events relayed, after it reached the
    # upstream socket (a kernel stamp is never later than the read that wrote it on).
    relay = snapshot["relay"]
    assert relay["requests"] == 3 and relay["unpaired"] == 0
    assert relay["delay"]["count"] == 18
    every = [d for r in records for d in stats.relay_delays_ns(r) or ()]
    assert len(every) == 18 and min(every) >= 0
    assert relay["delay"]["max"] == max(every) / 1e9
    assert 'sidecar_relay_delay_seconds_count{model="m",replica=' in exposition
    (count,) = [
        float(line.rsplit(" ", 1)[1])
        for line in exposition.splitlines()
        if line.startswith("sidecar_relay_delay_seconds_count{")
    ]
    assert count == 18


async def test_admin_token_guards_the_admin_listener_but_not_healthz() -> None:
    async with stack(admin_token="s3cret-admin") as s, aiohttp.ClientSession() as session:
        admin = s.server.admin_url
        for path in ("/stats", "/metrics", "/replicas"):
            async with session.get(admin + path) as response:
                assert response.status == 401
            async with session.get(
                admin + path, headers={"Authorization": "Bearer wrong"}
            ) as response:
                assert response.status == 401
            async with session.get(
                admin + path, headers={"Authorization": "Bearer s3cret-admin"}
            ) as response:
                assert response.status == 200
        async with session.get(admin + "/healthz") as response:
            assert response.status == 200
        # The traffic listener is not affected.
        status, _, _ = await post(session, s.url, "/v1/completions", COMPLETION)
        assert status == 200


def chat_chunk(content: str | None, finish: str | None = None, tokens: int = 0) -> bytes:
    delta = {"role": "assistant", "content": ""} if content is None else {"content": content}
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        "usage": {"prompt_tokens": 3, "total_tokens": 3 + tokens, "completion_tokens": tokens},
    }
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


async def test_events_of_one_read_leave_in_one_write_with_one_stamp() -> None:
    """An upstream that writes several events at once (as vLLM does when it falls behind, and
    always at a stream's end): each event keeps its own record entry, but the events of one
    read share the read's instant upstream and the single write's instant downstream."""
    from aiohttp import web

    groups = [
        chat_chunk(None) + chat_chunk("a", tokens=1) + chat_chunk("b", tokens=2),
        chat_chunk("c", tokens=3),
        chat_chunk("d", tokens=4) + chat_chunk("", "stop", tokens=4) + b"data: [DONE]\n\n",
    ]

    async def scripted(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for group in groups:
            await response.write(group)
            await asyncio.sleep(0.2)
        await response.write_eof()
        return response

    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    async with (
        scripted_upstream("/v1/chat/completions", scripted) as upstream,
        proxy_to(upstream) as (server, collected),
        aiohttp.ClientSession() as session,
    ):
        status, got, _headers = await post(session, server.url, "/v1/chat/completions", body)
        records = await collected.wait_for(1)
    assert status == 200 and got == b"".join(groups)  # the client asked for usage: unchanged
    (record,) = records
    assert record.outcome is Outcome.OK and record.n_out == 4
    assert record.server is not None
    for timeline in (record.server, record.client):
        assert timeline.tokens == (1, 1, 1, 1)
        a, b, c, d = timeline.offsets_ns
        assert a == b and b < c < d  # a, b came in one read; c and d 200 ms apart
        assert c - b > 100_000_000


@pytest.mark.parametrize("settings", [{}, {"assemble_nonstream": "true"}])
@pytest.mark.parametrize("stream", [True, False])
async def test_a_refused_request_gets_the_answer_to_its_own_body(
    settings: dict[str, Any], stream: bool
) -> None:
    """The proxy rewrote the body (usage injected, or streaming for an assembled answer) and the
    replica refused it; a refusal can describe the body it got (vLLM counts its members, the
    simulator echoes it), so the client's own body is sent again and that answer relayed."""
    body = {"model": "m", "max_tokens": 4, "stream": stream}  # no messages: refused
    async with stack(**settings) as s, aiohttp.ClientSession() as session:
        status_d, direct, _ = await post(session, s.direct, "/v1/chat/completions", body)
        status_p, proxied, _ = await post(session, s.url, "/v1/chat/completions", body)
        (record,) = await s.records.wait_for(1)
    assert status_d == status_p == 400
    assert proxied == direct
    assert b"stream_options" not in proxied
    assert record.outcome is Outcome.HTTP_ERROR and record.http_status == 400
    assert record.upstream_stream is stream
    assert "assembled" not in record.attributes


async def test_the_client_vantage_starts_at_the_requests_first_byte(tmp_path: Path) -> None:
    """A client that takes 300 ms to upload its request waited those 300 ms too: the client
    vantage starts at the first byte (t_arrive), and t_read (the request read whole) is kept,
    in the record, the capture and /metrics, so that upload and proxy time can be told apart.
    The server vantage is unchanged."""
    async with stack(capture_dir=str(tmp_path / "cap")) as s:
        host, port = s.url.split("://")[1].rsplit(":", 1)
        body = json.dumps(
            {
                "model": "m",
                "stream": True,
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}],
            }
        ).encode()
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                f"Content-Type: application/json\r\nConnection: close\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            + body[:10]
        )
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.write(body[10:])
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        (record,) = await s.records.wait_for(1)
        async with (
            aiohttp.ClientSession() as session,
            session.get(s.server.admin_url + "/metrics") as response,
        ):
            exposition = await response.text()
    assert answer.startswith(b"HTTP/1.1 200") and record.outcome is Outcome.OK
    assert 'sidecar_request_read_seconds_count{model="m"} 1.0' in exposition
    assert 'sidecar_request_read_seconds_bucket{le="0.25",model="m"} 0.0' in exposition
    (line,) = [
        json.loads(x)
        for f in (tmp_path / "cap").glob("capture-*.jsonl")
        for x in f.read_text().splitlines()[1:]
    ]
    # The client paused 300 ms mid-upload; the proxy's stamps are taken where its loop reads
    # the bytes, so allow for a loop that woke a little late or early (no timing claim here).
    assert record.request_read_ns is not None and record.request_read_ns >= 250_000_000
    assert line["request_read_s"] == record.request_read_ns / 1e9 and line["ttft_s"] >= 0.25
    assert record.server is not None and record.server.start_ns >= record.request_read_ns
    # Client TTFT counts from t_arrive: the upload is in it, and not in the server's.
    assert record.client.offsets_ns[0] >= 250_000_000
    assert record.client.offsets_ns[0] - record.server.start_ns < 100_000_000


async def test_n2_through_the_proxy_keeps_each_choice_a_sequence() -> None:
    """A streamed n = 2 answer from the simulator: every token event keeps its choice on both
    sides, and TPOT is per choice (the engine's step), not the step halved."""
    async with stack() as s, aiohttp.ClientSession() as session:
        body = {
            "model": "m",
            "prompt": "hi",
            "max_tokens": 8,
            "ignore_eos": True,
            "n": 2,
            "temperature": 0.7,
            "stream": True,
        }
        async with session.post(s.url + "/v1/completions", json=body) as response:
            await response.read()
        (record,) = await s.records.wait_for(1)
    assert record.outcome is Outcome.OK and record.n_out == 16
    assert record.server is not None and record.server.choices is not None
    assert record.client.choices is not None
    assert sorted(set(record.client.choices)) == [0, 1]
    per_choice = [
        sum(
            t
            for t, c in zip(record.client.tokens, record.client.choices, strict=True)
            if c == choice
        )
        for choice in (0, 1)
    ]
    assert per_choice == [8, 8]
    latency = stats.request_latency(record, Vantage.CLIENT)
    assert latency is not None and latency.tpot_s is not None
    # Per sequence: sum(last - first) / sum(N_i - 1) over the two choices...
    sequences = stats.sequences(record.client)
    decode = sum(offsets[-1] - offsets[0] for offsets, _ in sequences)
    steps = sum(sum(tokens) - 1 for _, tokens in sequences)
    assert latency.tpot_s == pytest.approx(decode / steps / 1e9, rel=1e-12)
    # ... about twice what one series of both choices' events gives: both choices advance
    # one token per engine step, so the mixed series saw two tokens per step.
    offsets = record.client.offsets_ns
    mixed = (offsets[-1] - offsets[0]) / (16 - 1) / 1e9
    assert latency.tpot_s > 1.6 * mixed
