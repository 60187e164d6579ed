"""The simulator's ``/metrics`` speaks vLLM's: every family it serves is one the real server
serves, with the same type, label names and histogram buckets; every family the real server
serves is served by the simulator too, or listed in SIM_METRIC_GAPS with the reason it is not.

Both servers get the same single streamed completion before the scrape, so that the families
created on the first request exist on both sides. The simulator is started like the real
server (same model name, version and context length: the token histograms' buckets depend on
max_model_len).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.realvllm.server import http_get

from .real_server import RealVLLM, post_json

_PROCESS = (
    "from prometheus_client's default process and platform collectors: the simulator "
    "shares the sidecar's process (several replicas one process), so these would "
    "describe the sidecar, not a replica"
)
_HTTP = (
    "prometheus-fastapi-instrumentator's per-route HTTP series: the simulator is an "
    "aiohttp app, and the proxy measures the HTTP side itself"
)
_MFU = (
    "MFU estimates from the model's FLOPs and bytes per token: the simulator models step "
    "time, not a model architecture"
)
_CALL_SITE = (
    "needs a per-request value the server's _observe_finished does not hand to "
    "ReplicaMetrics.observe_finished yet"
)
SIM_METRIC_GAPS: dict[str, str] = {
    "process_cpu_seconds": _PROCESS,
    "process_max_fds": _PROCESS,
    "process_open_fds": _PROCESS,
    "process_resident_memory_bytes": _PROCESS,
    "process_start_time_seconds": _PROCESS,
    "process_virtual_memory_bytes": _PROCESS,
    "python_gc_collections": _PROCESS,
    "python_gc_objects_collected": _PROCESS,
    "python_gc_objects_uncollectable": _PROCESS,
    "python_info": _PROCESS,
    "http_requests": _HTTP,
    "http_request_size_bytes": _HTTP,
    "http_response_size_bytes": _HTTP,
    "http_request_duration_seconds": _HTTP,
    "http_request_duration_highr_seconds": _HTTP,
    "vllm:estimated_flops_per_gpu": _MFU,
    "vllm:estimated_read_bytes_per_gpu": _MFU,
    "vllm:estimated_write_bytes_per_gpu": _MFU,
    "vllm:request_max_num_generation_tokens": (
        f"{_CALL_SITE}: the most tokens among a request's n choices, observed when its last "
        "choice finishes"
    ),
    "vllm:request_prefill_kv_computed_tokens": (
        f"{_CALL_SITE}: the prompt tokens not served from the prefix cache (num_cached)"
    ),
}

REQUEST = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "stream": True}


@dataclass(frozen=True)
class Shape:
    type: str
    labels: frozenset[str]
    buckets: tuple[float, ...]


def shapes(text: str) -> dict[str, Shape]:
    """Each family's type, label names (``le`` and ``quantile`` aside) and bucket bounds."""
    out: dict[str, Shape] = {}
    for family in text_string_to_metric_families(text):
        labels: set[str] = set()
        bounds: set[float] = set()
        for sample in family.samples:
            labels.update(k for k in sample.labels if k not in ("le", "quantile"))
            if sample.name.endswith("_bucket"):
                bounds.add(float(sample.labels["le"]))
        out[family.name] = Shape(family.type, frozenset(labels), tuple(sorted(bounds)))
    return out


def gap_of(name: str) -> str | None:
    """The listed gap that covers ``name``: itself, or the family whose ``_created`` it is."""
    for candidate in (name, name.removesuffix("_created")):
        if candidate in SIM_METRIC_GAPS:
            return candidate
    return None


def real_max_model_len(real_vllm: RealVLLM) -> int:
    status, body = http_get(real_vllm.base_url + "/v1/models", timeout=10)
    assert status == 200
    (card,) = [c for c in json.loads(body)["data"] if c["id"] == real_vllm.model]
    return int(card["max_model_len"])


@pytest.fixture
async def sim_url(real_vllm: RealVLLM) -> AsyncIterator[str]:
    from sidecar.sim.engine import EngineConfig
    from sidecar.sim.server import SimConfig, close_replicas, start_replicas

    # With a tool parser, as CI starts the real server (`sidecar vllm up --tool-calls`): vLLM
    # then serves vllm:tool_call_parser_invocations.
    config = SimConfig(
        model=real_vllm.model,
        vllm_version=real_vllm.version,
        engine=EngineConfig(
            step_floor_s=0.002, per_token_s=0.0, max_model_len=real_max_model_len(real_vllm)
        ),
        tool_call_parser="pythonic",
        enable_auto_tool_choice=True,
    )
    (replica,) = await start_replicas(config, 1)
    try:
        yield replica.url
    finally:
        await close_replicas([replica])


async def test_the_simulators_metric_families_are_vllms(real_vllm: RealVLLM, sim_url: str) -> None:
    status, _ = post_json(real_vllm.base_url, "/v1/completions", REQUEST)
    assert status == 200
    status, body = http_get(real_vllm.base_url + "/metrics", timeout=10)
    assert status == 200
    real = shapes(body.decode())
    async with aiohttp.ClientSession() as session:
        async with session.post(sim_url + "/v1/completions", json=REQUEST) as response:
            assert response.status == 200
            await response.read()
        async with session.get(sim_url + "/metrics") as response:
            assert response.status == 200
            sim = shapes(await response.text())

    assert set(SIM_METRIC_GAPS) <= set(real), (
        f"listed gaps vLLM {real_vllm.version} does not serve: "
        f"{sorted(set(SIM_METRIC_GAPS) - set(real))}"
    )
    not_gaps = sorted(name for name in sim if gap_of(name) is not None)
    assert not not_gaps, f"listed in SIM_METRIC_GAPS but served now, remove them: {not_gaps}"
    extra = sorted(set(sim) - set(real))
    assert not extra, f"the simulator serves families vLLM {real_vllm.version} does not: {extra}"
    differ = {name: (sim[name], real[name]) for name in sim if sim[name] != real[name]}
    assert not differ, f"(simulator, vLLM) shapes differ: {differ}"
    missing = sorted(name for name in set(real) - set(sim) if gap_of(name) is None)
    assert not missing, f"vLLM serves families the simulator lacks (serve or list): {missing}"
