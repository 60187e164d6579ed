"""The official ``openai`` client against simulated replicas, and the real ``sidecar sim`` CLI.

If the SDK parses every shape the simulator sends (and raises the right exception classes for
its errors), real client code can be pointed at a simulated replica unchanged.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Any

import aiohttp
import openai
import pytest

from sidecar.sim.server import RunningReplica

MESSAGES: list[Any] = [{"role": "user", "content": "Write a haiku about queues."}]
CONTINUOUS_USAGE = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}


def client_for(replica: RunningReplica) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=replica.url + "/v1", api_key="x", max_retries=0)


def words(text: str) -> int:
    """Tokens in a generated text: every simulated token is one space-led pseudo-word (but EOS,
    which has no text: these tests ask for ignore_eos)."""
    return len(text.split())


async def test_chat_stream_with_continuous_usage(start_sim: Any) -> None:
    (replica,) = await start_sim()
    async with client_for(replica) as client:
        stream = await client.chat.completions.create(
            model="M",
            messages=MESSAGES,
            stream=True,
            max_tokens=12,
            extra_body={**CONTINUOUS_USAGE, "ignore_eos": True},
        )
        chunks = [chunk async for chunk in stream]
    role_chunk, *content_chunks, usage_chunk = chunks
    assert role_chunk.choices[0].delta.role == "assistant"
    assert role_chunk.choices[0].delta.content == ""
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.system_fingerprint and usage_chunk.system_fingerprint.startswith(
        "vllm-0.33.0-"
    )
    previous = 0
    deltas = 0
    for chunk in content_chunks:
        assert chunk.object == "chat.completion.chunk" and chunk.id == role_chunk.id
        assert chunk.created == role_chunk.created
        assert chunk.usage is not None
        delta = chunk.usage.completion_tokens - previous
        assert delta == words(chunk.choices[0].delta.content or "") >= 1
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        previous = chunk.usage.completion_tokens
        deltas += delta
    assert content_chunks[-1].choices[0].finish_reason == "length"
    assert usage_chunk.usage.completion_tokens == deltas == 12
    assert usage_chunk.usage.prompt_tokens == content_chunks[0].usage.prompt_tokens  # type: ignore[union-attr]


async def test_completion_stream_with_continuous_usage(start_sim: Any) -> None:
    (replica,) = await start_sim()
    async with client_for(replica) as client:
        stream = await client.completions.create(
            model="M",
            prompt="The queue was long",
            stream=True,
            max_tokens=7,
            extra_body={**CONTINUOUS_USAGE, "ignore_eos": True},
        )
        chunks = [chunk async for chunk in stream]
    *content_chunks, usage_chunk = chunks
    assert all(chunk.object == "text_completion" for chunk in chunks)
    assert usage_chunk.usage is not None and usage_chunk.choices == []
    total = 0
    previous = 0
    for chunk in content_chunks:
        assert chunk.usage is not None
        assert chunk.usage.completion_tokens - previous == words(chunk.choices[0].text)
        total += chunk.usage.completion_tokens - previous
        previous = chunk.usage.completion_tokens
    assert usage_chunk.usage.completion_tokens == total == 7


async def test_stream_options_typed_param_and_n2(start_sim: Any) -> None:
    (replica,) = await start_sim()
    async with client_for(replica) as client:
        stream = await client.chat.completions.create(
            model="M",
            messages=MESSAGES,
            stream=True,
            n=2,
            max_tokens=3,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [chunk async for chunk in stream]
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
    assert [words(texts[0]), words(texts[1])] == [3, 3]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


async def test_non_streaming_chat_and_completion(start_sim: Any) -> None:
    (replica,) = await start_sim(enable_prompt_tokens_details=True)
    async with client_for(replica) as client:
        chat = await client.chat.completions.create(
            model="M", messages=MESSAGES, max_tokens=5, extra_body={"ignore_eos": True}
        )
        completion = await client.completions.create(
            model="M", prompt=["one", "two"], max_tokens=4, extra_body={"ignore_eos": True}
        )
        models = await client.models.list()
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    assert chat.choices[0].message.role == "assistant"
    assert words(chat.choices[0].message.content or "") == 5
    assert chat.usage is not None and chat.usage.completion_tokens == 5
    assert chat.usage.prompt_tokens_details is not None
    assert chat.usage.prompt_tokens_details.cached_tokens == 0
    assert [choice.index for choice in completion.choices] == [0, 1]
    assert completion.usage is not None and completion.usage.completion_tokens == 8
    assert [model.id for model in models.data] == ["M"]


async def test_errors_surface_as_openai_exceptions(start_sim: Any) -> None:
    (replica,) = await start_sim(engine_max_model_len=64)
    async with client_for(replica) as client:
        with pytest.raises(openai.NotFoundError) as not_found:
            await client.chat.completions.create(model="other", messages=MESSAGES)
        assert not_found.value.status_code == 404
        assert isinstance(not_found.value.body, dict) and not_found.value.body["param"] == "model"
        with pytest.raises(openai.BadRequestError) as too_long:
            await client.completions.create(model="M", prompt="word " * 100, max_tokens=5)
        assert "maximum input length" in str(too_long.value)
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="M", messages=MESSAGES, max_tokens=0)
        with pytest.raises(openai.InternalServerError):
            await client.chat.completions.create(
                model="M", messages=MESSAGES, extra_headers={"X-Sim-Fault": "error_status=500"}
            )
        with pytest.raises(openai.APIError, match="Internal server error"):
            stream = await client.chat.completions.create(
                model="M",
                messages=MESSAGES,
                stream=True,
                max_tokens=10,
                extra_headers={"X-Sim-Fault": "error_event_after=2"},
            )
            async for _ in stream:
                pass


async def test_api_key_is_checked(start_sim: Any) -> None:
    (replica,) = await start_sim(api_key="right")
    async with openai.AsyncOpenAI(
        base_url=replica.url + "/v1", api_key="wrong", max_retries=0
    ) as client:
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()
    async with openai.AsyncOpenAI(
        base_url=replica.url + "/v1", api_key="right", max_retries=0
    ) as client:
        assert (await client.models.list()).data[0].id == "M"


async def _read_line(stream: asyncio.StreamReader, timeout: float = 20.0) -> str:
    return (await asyncio.wait_for(stream.readline(), timeout)).decode().strip()


async def test_cli_serves_two_replicas_and_stops_on_sigint() -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sidecar",
        "sim",
        "--replicas",
        "2",
        "--port",
        "0",
        "--model",
        "cli-model",
        "--step-floor-s",
        "0.001",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdout is not None and process.stderr is not None
    try:
        lines = [await _read_line(process.stdout), await _read_line(process.stdout)]
        urls = []
        for index, line in enumerate(lines):
            prefix = f"replica {index} listening on "
            assert line.startswith(prefix), line
            urls.append(line[len(prefix) :])
        assert urls[0] != urls[1]
        for url in urls:
            async with openai.AsyncOpenAI(
                base_url=url + "/v1", api_key="x", max_retries=0
            ) as client:
                stream = await client.chat.completions.create(
                    model="cli-model",
                    messages=MESSAGES,
                    stream=True,
                    max_tokens=4,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                chunks = [chunk async for chunk in stream]
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
        async with (
            aiohttp.ClientSession() as session,
            session.get(urls[1] + "/metrics") as response,
        ):
            assert "vllm:e2e_request_latency_seconds_count" in await response.text()
        process.send_signal(signal.SIGINT)
        returncode = await asyncio.wait_for(process.wait(), 20)
        stderr = await process.stderr.read()
        assert returncode == 0, stderr.decode()
        assert await process.stdout.read() == b""
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_the_sdk_reads_the_empty_final_chunk_of_a_stream_ending_at_eos(
    start_sim: Any,
) -> None:
    (replica,) = await start_sim(engine_natural_length_median=2.0, engine_natural_length_sigma=0.0)
    async with client_for(replica) as client:
        stream = await client.completions.create(
            model="M", prompt="The queue", stream=True, stream_options={"include_usage": True}
        )
        *content, usage = [chunk async for chunk in stream]
    assert [(chunk.choices[0].text != "", chunk.choices[0].finish_reason) for chunk in content] == [
        (True, None),
        (False, "stop"),
    ]
    assert usage.usage is not None and usage.usage.completion_tokens == 2


async def _sim_cli(*args: str) -> tuple[asyncio.subprocess.Process, list[str]]:
    """``sidecar sim --port 0 ARGS`` started; its replica URLs, once it printed them all."""
    replicas = int(args[args.index("--replicas") + 1]) if "--replicas" in args else 1
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sidecar",
        "sim",
        "--port",
        "0",
        "--step-floor-s",
        "0.001",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    lines = [await _read_line(process.stdout) for _ in range(replicas)]
    return process, [line.rsplit(" ", 1)[1] for line in lines]


async def _ended(process: asyncio.subprocess.Process) -> None:
    """Kill it if it still runs, and read its pipes to the end (so they are closed)."""
    if process.returncode is None:
        process.kill()
    await process.communicate()


async def _refused(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        _, writer = await asyncio.open_connection(host, int(port))
    except (ConnectionRefusedError, ConnectionResetError):
        # Refused: nothing listens. Reset: the listening process died with this connection
        # in its accept queue, and the kernel reset it (seen on CI).
        return True
    writer.close()
    return False


async def test_cli_replicas_share_one_ground_truth_file_and_go_with_their_parent(
    tmp_path: Any,
) -> None:
    # One process per replica: all append to one ground-truth file, and none outlives the
    # process that started them (here killed without a chance to stop them).
    truth = tmp_path / "truth.jsonl"
    process, urls = await _sim_cli("--replicas", "3", "--ground-truth", str(truth))
    try:
        async with aiohttp.ClientSession() as session:
            for round_ in range(2):
                for url in urls:
                    async with session.post(
                        url + "/v1/completions",
                        json={"prompt": "x", "max_tokens": 2, "stream": True, "ignore_eos": True},
                        headers={"X-Request-Id": f"{url}-{round_}"},
                    ) as r:
                        assert r.status == 200
                        await r.read()
        process.kill()
        await process.wait()
        for url in urls:
            for _ in range(200):
                if await _refused(url):
                    break
                await asyncio.sleep(0.05)
            assert await _refused(url), f"{url} still serves after its parent died"
        # Read once they are gone: a line is written just after its answer's last byte.
        lines = [json.loads(line) for line in truth.read_text().splitlines()]
        assert sorted((line["replica"], line["request_id"]) for line in lines) == sorted(
            (index, f"{url}-{round_}") for index, url in enumerate(urls) for round_ in range(2)
        )
    finally:
        await _ended(process)


async def test_cli_one_process_serves_all_replicas_too() -> None:
    process, urls = await _sim_cli("--replicas", "2", "--one-process")
    try:
        async with aiohttp.ClientSession() as session:
            for url in urls:
                async with session.get(url + "/health") as response:
                    assert response.status == 200
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 20) == 0
    finally:
        await _ended(process)


async def test_cli_reports_a_port_in_use_among_replicas_in_one_line() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "sidecar",
            "sim",
            "--replicas",
            "2",
            "--port",
            str(port - 1),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await asyncio.wait_for(process.communicate(), 20)
    assert process.returncode == 2 and stdout == b""
    assert stderr.decode().strip() == (
        f"sidecar sim: error: cannot listen on 127.0.0.1:{port - 1}-{port}: Address already in use"
    )


async def test_cli_rejects_a_bad_fault_spec() -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sidecar",
        "sim",
        "--port",
        "0",
        "--fault",
        "explode=1",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 20)
    assert process.returncode == 2
    assert b"unknown fault" in stderr and stdout == b""


def test_cli_flags_cover_every_engine_knob() -> None:
    import argparse
    from dataclasses import fields

    from sidecar.sim import cli as sim_cli
    from sidecar.sim.engine import EngineConfig

    parser = argparse.ArgumentParser()
    sim_cli.add_arguments(parser)
    args = parser.parse_args(
        ["--port", "0", "--step-floor-s", "0.002", "--no-enable-prefix-caching"]
    )
    config = sim_cli.config_from_args(args)
    assert config.engine.step_floor_s == 0.002 and config.engine.enable_prefix_caching is False
    help_text = parser.format_help()
    for engine_field in fields(EngineConfig):
        assert "--" + engine_field.name.replace("_", "-") in help_text
