"""Security: nothing secret leaves the sidecar, nobody is let into its admin side by default,
a client cannot blow up its metrics or its memory, and it refuses insecure settings.

The leak test sends traffic carrying a secret prompt, a bearer API key, an ``api-key`` header
and a key in the query string through the proxy with every sink on (Prometheus, live window,
OpenTelemetry metrics and spans in memory, capture, per-request logs), then greps everything
produced: records, capture files, /metrics, /stats, /replicas, spans, metric points and logs
(in-process with caplog, and a real ``sidecar proxy --log-requests`` process's stderr). The
completion the client received is grepped for too (it is text the upstream produced). With
``--capture-text`` the prompt and completion may appear in the capture, and only there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import stat
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from proxy_stack import FAST_ENGINE, stack
from reliability_helpers import assert_json_error, proxy_to, settle, sse_payloads

from sidecar.config import ConfigError, ProxyConfig, build_config, is_loopback_host
from sidecar.record import Outcome
from sidecar.sim.engine import EngineConfig
from sidecar.sim.server import SimConfig, close_replicas, start_replicas
from sidecar.sinks.otel import build_otel_sink

SECRET_PROMPT = "SECRET-PROMPT-c0ffee-the-patient-has-condition-x"
SECRET_KEY = "sk-SECRET-KEY-5d41402abc4b2a76b9719d911017c592"
SECRET_API_KEY = "SECRET-API-KEY-header-7c6a180b36896a0a8c02787eeafb0e4c"
SECRET_QUERY_KEY = "SECRET-QUERY-KEY-e4da3b7fbbce2345d7772b0674a318d5"
ADMIN_TOKEN = "SECRET-ADMIN-TOKEN-1679091c5a880faf6fb5e6087eb1b2dc"
CREDENTIALS = (SECRET_KEY, SECRET_API_KEY, SECRET_QUERY_KEY, ADMIN_TOKEN)


def _completion_text(body: bytes, endpoint: str, streamed: bool) -> str:
    if not streamed:
        choice = json.loads(body)["choices"][0]
        content: str = choice["message"]["content"] if endpoint == "chat" else choice["text"]
        return content
    text = []
    for payload in sse_payloads(body):
        if payload.startswith("{") and '"choices":[{' in payload.replace(" ", ""):
            choice = json.loads(payload)["choices"][0]
            text.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
    return "".join(text)


async def _secret_traffic(url: str, session: aiohttp.ClientSession) -> list[str]:
    """Requests of every kind carrying the secrets; returns the completions received."""
    headers = {
        "Authorization": f"Bearer {SECRET_KEY}",
        "api-key": SECRET_API_KEY,
        "X-Api-Key": SECRET_API_KEY,
    }
    completions = []
    for endpoint, path in (("chat", "/v1/chat/completions"), ("completions", "/v1/completions")):
        for streamed in (True, False):
            body: dict[str, Any] = {
                "model": "m",
                "max_tokens": 30,
                "ignore_eos": True,
                "stream": streamed,
            }
            if endpoint == "chat":
                body["messages"] = [
                    {"role": "system", "content": SECRET_PROMPT},
                    {"role": "user", "content": SECRET_PROMPT},
                ]
            else:
                body["prompt"] = SECRET_PROMPT
            async with session.post(
                f"{url}{path}?api_key={SECRET_QUERY_KEY}", json=body, headers=headers
            ) as response:
                data = await response.read()
                assert response.status == 200, data[:200]
            completions.append(_completion_text(data, endpoint, streamed))
    # Failures carry the secrets too: a wrong key (401), an unknown model (404), a client that
    # leaves mid-stream, and a pass-through path.
    bad = {"model": "m", "messages": [{"role": "user", "content": SECRET_PROMPT}]}
    async with session.post(
        url + "/v1/chat/completions",
        json=bad,
        headers={"Authorization": "Bearer sk-wrong-" + SECRET_API_KEY},
    ) as r:
        assert r.status == 401
    async with session.post(
        url + "/v1/chat/completions", json={**bad, "model": "nope"}, headers=headers
    ) as r:
        assert r.status == 404
    async with session.post(
        url + "/v1/chat/completions",
        json={**bad, "stream": True, "max_tokens": 300},
        headers=headers,
    ) as r:
        await r.content.readline()
    async with session.post(
        url + "/tokenize", json={"model": "m", "prompt": SECRET_PROMPT}, headers=headers
    ) as r:
        assert r.status == 200
    assert all(len(c) > 60 for c in completions)
    return completions


REQUESTS_SENT = 8


def _leaks(text: str, secrets: tuple[str, ...]) -> list[str]:
    return [s for s in secrets if s in text]


@pytest.mark.parametrize("capture_text", [False, True])
async def test_no_secret_in_anything_the_sidecar_produces(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capture_text: bool
) -> None:
    caplog.set_level(logging.DEBUG)
    capture = tmp_path / "capture"
    sims = await start_replicas(SimConfig(model="m", engine=FAST_ENGINE, api_key=SECRET_KEY), 1)
    reader = InMemoryMetricReader()
    spans = InMemorySpanExporter()
    otel = build_otel_sink(readers=[reader], traces=True, span_exporter=spans, slo_policy=None)
    settings: dict[str, Any] = {
        "capture_dir": str(capture),
        "log_requests": "true",
        "admin_token": ADMIN_TOKEN,
        "slo": "ttft=1s,tpot=100ms",
    }
    if capture_text:
        settings["capture_text"] = "true"
    try:
        async with proxy_to([sims[0].url], **settings) as p, aiohttp.ClientSession() as session:
            p.server.proxy.fanout.add(otel)
            completions = await _secret_traffic(p.url, session)
            records = await settle(p.server, p.records, REQUESTS_SENT, sims)
            admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
            exposed = {}
            for path in ("/metrics", "/stats", "/replicas", "/healthz"):
                async with session.get(p.admin + path, headers=admin) as response:
                    assert response.status == 200
                    exposed[path] = await response.text()
    finally:
        otel.shutdown()
        await close_replicas(sims)
    assert {r.outcome for r in records} == {
        Outcome.OK,
        Outcome.HTTP_ERROR,
        Outcome.CLIENT_CANCELLED,
    }
    completion_marks = tuple(completions)
    everything_secret = (SECRET_PROMPT, *CREDENTIALS, *completion_marks)

    # Records: no credential ever; text only inside the capture shape, and only on opt-in.
    for record in records:
        without_shape = json.dumps({**record.to_dict(), "shape": None})
        assert _leaks(without_shape, everything_secret) == []
        shape = json.dumps(record.to_dict()["shape"])
        assert _leaks(shape, CREDENTIALS) == []
        if not capture_text:
            assert _leaks(shape, everything_secret) == []

    # Every admin page, the OpenTelemetry output and the logs: nothing, opted in or not.
    for path, text in exposed.items():
        assert _leaks(text, everything_secret) == [], path
    metric_data = reader.get_metrics_data()
    assert metric_data is not None
    otel_text = metric_data.to_json() + "".join(s.to_json() for s in spans.get_finished_spans())
    assert len(spans.get_finished_spans()) == REQUESTS_SENT - 1  # none for /tokenize
    assert _leaks(otel_text, everything_secret) == []
    log_text = caplog.text + "".join(
        json.dumps([str(a) for a in (r.args or ())]) + r.getMessage() for r in caplog.records
    )
    assert sum("outcome=" in r.getMessage() for r in caplog.records) == REQUESTS_SENT
    assert _leaks(log_text, everything_secret) == []

    # The capture: no credential ever; the prompt and completions only with --capture-text.
    files = sorted(capture.glob("capture-*"))
    assert files
    captured = "".join(f.read_text() for f in files)
    assert _leaks(captured, CREDENTIALS) == []
    if capture_text:
        assert SECRET_PROMPT in captured
        assert all(c in captured for c in completion_marks)
        # Text captures are readable by the sidecar's user only.
        assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    else:
        assert _leaks(captured, everything_secret) == []


def _kill(proc: subprocess.Popen[str]) -> tuple[str, str]:
    if proc.poll() is None:
        proc.terminate()
    try:
        out, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=5)
    return out, err


def _first_url(proc: subprocess.Popen[str], pattern: str) -> str:
    assert proc.stdout is not None
    for _ in range(10):
        match = re.search(pattern, proc.stdout.readline())
        if match:
            return match.group(1)
    raise AssertionError(f"no line matching {pattern!r}")


async def test_a_real_proxy_process_logs_no_secret() -> None:
    """`sidecar proxy --log-requests` as run in production: its whole stderr and stdout,
    after secret traffic and a SIGTERM, hold neither text nor credentials."""
    env = {**os.environ, "SIDECAR_ADMIN_TOKEN": ADMIN_TOKEN}
    sim = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sidecar",
            "sim",
            "--port",
            "0",
            "--model",
            "m",
            "--api-key",
            SECRET_KEY,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proxy = None
    try:
        upstream = _first_url(sim, r"listening on (http://\S+)")
        proxy = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sidecar",
                "proxy",
                "--upstream",
                upstream,
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "127.0.0.1:0",
                "--health-interval",
                "0",
                "--log-requests",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        url = _first_url(proxy, r"proxy listening on (http://\S+)")
        async with aiohttp.ClientSession() as session:
            completions = await _secret_traffic(url, session)
    finally:
        # SIGTERM: the proxy finishes what is in flight (every log line written), then exits.
        out, err = _kill(proxy) if proxy is not None else ("", "")
        _kill(sim)
    assert proxy is not None and proxy.returncode == 0
    assert err.count("outcome=") == REQUESTS_SENT, err
    assert _leaks(out + err, (SECRET_PROMPT, *CREDENTIALS, *completions)) == []


# -- metrics a client cannot blow up ---------------------------------------------------------


def _label_values(exposition: str, label: str) -> set[str]:
    return set(re.findall(rf'{label}="((?:[^"\\]|\\.)*)"', exposition))


@pytest.mark.slow
async def test_label_cardinality_is_capped_against_10k_model_names() -> None:
    """A client sending 10 000 distinct model names (the upstream answers 404 to each) adds at
    most ``label_cap`` model label values (plus `other`/`unknown`) to /metrics and the
    OpenTelemetry attributes, and /metrics stays small."""
    reader = InMemoryMetricReader()
    otel = build_otel_sink(readers=[reader], slo_policy=None, max_models=16)
    try:
        async with (
            stack(label_cap="16") as s,
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=16)) as session,
        ):
            s.server.proxy.fanout.add(otel)

            async def one(i: int) -> int:
                body = {"model": f"model-{i:05d}", "prompt": "hi", "max_tokens": 1}
                async with session.post(s.url + "/v1/completions", json=body) as response:
                    await response.read()
                    return response.status

            statuses: list[int] = []
            for start in range(0, 10_000, 500):
                statuses += await asyncio.gather(*(one(i) for i in range(start, start + 500)))
            assert set(statuses) == {404}
            await settle(s.server, s.records, 10_000, s.replicas, timeout=30)
            async with session.get(s.server.admin_url + "/metrics") as response:
                exposition = await response.text()
    finally:
        otel.shutdown()
    models = _label_values(exposition, "model")
    assert len(models - {"other", "unknown"}) <= 16 and "other" in models
    assert len(exposition) < 400_000
    data = reader.get_metrics_data()
    assert data is not None
    otel_models = set(re.findall(r'"gen_ai\.request\.model": "([^"]*)"', data.to_json()))
    assert len(otel_models - {"other"}) <= 16 and "other" in otel_models


async def test_huge_or_control_character_model_names_never_become_labels(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Within the cap, a label value is still client text: a 100 kB model name must not end up
    in every series of /metrics, and one with a line break must not forge a log line. Such
    names are not kept on the record at all."""
    caplog.set_level(logging.INFO, logger="sidecar.proxy")
    names = [f"{i}" + "m" * 100_000 for i in range(3)] + ["m\nFORGED LOG LINE", "m\x1b[2J"]
    async with stack(log_requests="true") as s, aiohttp.ClientSession() as session:
        for name in names:
            body = {"model": name, "prompt": "hi", "max_tokens": 1}
            async with session.post(s.url + "/v1/completions", json=body) as response:
                assert response.status == 404
        records = await settle(s.server, s.records, len(names), s.replicas)
        async with session.get(s.server.admin_url + "/metrics") as response:
            exposition = await response.text()
    assert all(r.model is None and r.outcome is Outcome.HTTP_ERROR for r in records)
    assert "m" * 300 not in exposition and len(exposition) < 200_000
    assert "FORGED" not in exposition and "FORGED" not in caplog.text
    assert all("\n" not in r.getMessage() and "\x1b" not in r.getMessage() for r in caplog.records)


# -- the admin side --------------------------------------------------------------------------


async def test_admin_pages_are_not_on_the_traffic_port_and_the_token_never_shows() -> None:
    """The traffic listener passes /metrics, /stats, /replicas through to the upstream (the
    simulator's own /metrics, 404s): the sidecar's admin data is only on the admin port, behind
    the token; the token appears in no page, log or repr."""
    async with stack(admin_token=ADMIN_TOKEN) as s, aiohttp.ClientSession() as session:
        assert s.server.url != s.server.admin_url
        for path in ("/stats", "/replicas"):
            async with session.get(s.url + path) as response:
                assert response.status == 404  # the simulator has no such page
        async with session.get(s.url + "/metrics") as response:
            text = await response.text()
            assert "vllm:" in text and "sidecar_" not in text
        async with session.get(
            s.server.admin_url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}x"}
        ) as response:
            assert response.status == 401
            assert ADMIN_TOKEN not in await response.text()
        pages = []
        for path in ("/metrics", "/stats", "/replicas", "/healthz"):
            async with session.get(
                s.server.admin_url + path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
            ) as response:
                assert response.status == 200
                pages.append(await response.text())
        await settle(s.server, s.records, 3, s.replicas)
    assert all(ADMIN_TOKEN not in page for page in pages)
    assert ADMIN_TOKEN not in repr(s.server.config)


async def test_the_concurrency_limit_rejects_exactly_the_excess() -> None:
    """12 streams at once against a limit of 4: 4 are served, 8 get a 429 in vLLM's shape with
    a rejected record, the proxy never holds more than 4, and the served ones are complete."""
    slow = SimConfig(model="m", engine=EngineConfig(step_floor_s=0.02, per_token_s=0.0))
    async with stack(sim=slow, max_concurrency="4") as s, aiohttp.ClientSession() as session:
        peak = 0
        held = asyncio.Event()

        async def watch() -> None:
            nonlocal peak
            while not held.is_set():
                peak = max(peak, s.server.proxy.in_flight)
                await asyncio.sleep(0.001)

        watcher = asyncio.create_task(watch())

        async def one(i: int) -> tuple[int, bytes]:
            body = {
                "model": "m",
                "prompt": "hi",
                "max_tokens": 20,
                "ignore_eos": True,
                "stream": True,
            }
            async with session.post(
                s.url + "/v1/completions", json=body, headers={"X-Request-Id": f"r{i}"}
            ) as response:
                return response.status, await response.read()

        results = await asyncio.gather(*(one(i) for i in range(12)))
        held.set()
        await watcher
        records = await settle(s.server, s.records, 12, s.replicas)
    served = [body for status, body in results if status == 200]
    rejected = [body for status, body in results if status == 429]
    assert len(served) == 4 and len(rejected) == 8
    assert all(body.endswith(b"data: [DONE]\n\n") for body in served)
    for body in rejected:
        assert_json_error(429, body, 429)
    assert peak <= 4
    assert sorted(r.outcome.value for r in records) == ["ok"] * 4 + ["rejected"] * 8
    assert all(r.replica is None for r in records if r.outcome is Outcome.REJECTED)


# -- insecure combinations: refused, with the reason -----------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "::1", "localhost", "::ffff:127.0.0.1"])
def test_loopback_admin_needs_no_token(host: str) -> None:
    assert is_loopback_host(host)
    config = ProxyConfig(upstreams=("http://u:1",), metrics_host=host)
    assert config.admin_token is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "sidecar.example"])
def test_an_open_admin_listener_is_refused_unless_allowed(host: str) -> None:
    assert not is_loopback_host(host)
    listen = f"[{host}]:9464" if ":" in host else f"{host}:9464"
    flags = {"upstreams": ["http://u:1"], "metrics_listen": listen}
    with pytest.raises(ConfigError, match="without a bearer token") as refused:
        build_config(flags, {})
    assert "--allow-open-admin" in str(refused.value)
    assert "SIDECAR_ADMIN_TOKEN" in str(refused.value)
    # A token, or the explicit flag (or its environment variable), makes it acceptable.
    assert build_config(flags, {"SIDECAR_ADMIN_TOKEN": "t"}).admin_token == "t"
    assert build_config(flags, {"SIDECAR_ALLOW_OPEN_ADMIN": "1"}).allow_open_admin
    assert build_config({**flags, "allow_open_admin": True}, {}).metrics_host == host


def test_capture_text_without_capture_is_refused() -> None:
    with pytest.raises(ConfigError, match="capture_text stores prompts"):
        build_config({"upstreams": ["http://u:1"], "capture_text": True}, {})


@pytest.fixture
def clean_env() -> Iterator[dict[str, str]]:
    yield {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (("--metrics-listen", "0.0.0.0:0"), "without a bearer token"),
        (("--capture-text",), "capture_text stores prompts and completions: it needs --capture"),
    ],
)
def test_the_proxy_refuses_to_start_insecure_and_says_why(
    args: tuple[str, ...], reason: str, clean_env: dict[str, str]
) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar",
            "proxy",
            "--upstream",
            "http://127.0.0.1:1",
            "--listen",
            "127.0.0.1:0",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env,
    )
    assert done.returncode == 2, done.stderr
    assert reason in done.stderr


def test_the_open_admin_flag_lets_it_start(clean_env: dict[str, str]) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sidecar",
            "proxy",
            "--upstream",
            "http://127.0.0.1:1",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "0.0.0.0:0",
            "--allow-open-admin",
            "--health-interval",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env,
    )
    try:
        admin = _first_url(proc, r"admin on (http://\S+)")
        # Answered once the loop runs, i.e. once SIGTERM is handled (a SIGTERM between the
        # "admin on" line and that point would kill the process outright).
        port = admin.rsplit(":", 1)[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as answer:
            assert answer.status == 200
    finally:
        _kill(proc)
    assert proc.returncode == 0
