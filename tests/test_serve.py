"""The proxy from a script (serve.py `serve`): what `sidecar proxy` runs, given a `ProxyConfig`
and stopped by the caller's event instead of a signal, over real sockets to the simulator."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import aiohttp
import pytest

from sidecar.config import build_config
from sidecar.serve import RunningProxy, Served, ServeError, serve
from sidecar.sim.server import SimConfig, close_replicas, start_replicas


async def serve_one_request(config_flags: dict[str, object]) -> tuple[Served, list[str]]:
    """Serve until one completion went through the proxy, then stop; what `serve` said."""
    replicas = await start_replicas(SimConfig(model="m"), 1)
    said: list[str] = []
    try:
        config = build_config(
            {"upstreams": [replicas[0].url], "listen": "127.0.0.1:0", **config_flags},
            environ={},
        )
        stop = asyncio.Event()
        ready: asyncio.Future[RunningProxy] = asyncio.get_running_loop().create_future()

        async def one_request() -> None:
            proxy = await ready
            said.append(f"ready {proxy.workers}")
            body = {"model": "m", "prompt": "hi", "max_tokens": 3, "stream": True}
            async with (
                aiohttp.ClientSession() as session,
                session.post(proxy.url + "/v1/completions", json=body) as response,
            ):
                assert response.status == 200
                await response.read()
            async with (
                aiohttp.ClientSession() as session,
                session.get(proxy.admin_url + "/healthz") as response,
            ):
                assert response.status == 200
            stop.set()

        served, _ = await asyncio.gather(
            serve(
                config,
                stop=stop,
                on_ready=ready.set_result,
                on_stopping=lambda: said.append("stopping"),
            ),
            one_request(),
        )
    finally:
        await close_replicas(replicas)
    return served, said


async def test_serve_runs_in_one_process_until_its_stop_and_counts_the_capture(
    tmp_path: Path,
) -> None:
    capture = tmp_path / "capture"
    served, said = await serve_one_request(
        {"metrics_listen": "127.0.0.1:0", "workers": 0, "capture_dir": str(capture)}
    )
    assert said == ["ready 0", "stopping"]
    assert served.started and served.capture is not None
    assert served.capture.directory == str(capture)
    assert served.capture.written == 1 and served.capture.dropped == 0
    assert served.capture.files == 1 and len(list(capture.glob("capture-*"))) == 1


async def test_serve_runs_workers_and_their_collector_alike() -> None:
    served, said = await serve_one_request({"metrics_listen": "127.0.0.1:0", "workers": 1})
    assert said == ["ready 1", "stopping"]
    assert served == Served(started=True, capture=None)


async def test_a_stop_before_it_listens_ends_the_start() -> None:
    config = build_config(
        {"upstreams": ["http://127.0.0.1:9"], "listen": "127.0.0.1:0", "workers": 0},
        environ={},
    )
    stop = asyncio.Event()
    stop.set()
    ready: list[RunningProxy] = []
    assert await serve(config, stop=stop, on_ready=ready.append) == Served(False, None)
    assert ready == []


async def test_a_port_in_use_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = build_config(
            {
                "upstreams": ["http://127.0.0.1:9"],
                "listen": f"127.0.0.1:{port}",
                "metrics_listen": "127.0.0.1:0",
                "workers": 0,
            },
            environ={},
        )
        with pytest.raises(ServeError, match=f"127.0.0.1:{port}"):
            await serve(config, stop=asyncio.Event())
