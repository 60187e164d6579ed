"""The engine's own view, scraped from each replica's /metrics."""

from __future__ import annotations

import aiohttp
import pytest
from proxy_stack import FAST_ENGINE, stack

from sidecar.engine_metrics import EngineView, parse_engine_metrics
from sidecar.sim.server import SimConfig

SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",tp_rank="0"} 3.0
sglang:num_running_reqs{model_name="m",tp_rank="1"} 2.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 7.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.25
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="m"} 0.4
# HELP sglang:num_retracted_requests_total Retractions.
# TYPE sglang:num_retracted_requests_total counter
sglang:num_retracted_requests_total{model_name="m"} 9.0
"""

LEGACY = """\
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5
# TYPE vllm:gpu_prefix_cache_queries counter
vllm:gpu_prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:gpu_prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
# TYPE vllm:gpu_prefix_cache_hits counter
vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m"} 250.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 4.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
"""


def test_sglang_names_are_understood_and_ranks_summed() -> None:
    values, flavour = parse_engine_metrics(SGLANG)
    assert flavour == "sglang"
    assert values["running"] == 5.0 and values["waiting"] == 7.0
    assert values["kv_cache_usage"] == 0.25 and values["preemptions"] == 9.0
    view = EngineView()
    view.update(values, flavour)
    assert view.to_dict()["prefix_cache_hit_rate"] == 0.4


def test_legacy_vllm_names_and_hit_rates() -> None:
    values, flavour = parse_engine_metrics(LEGACY)
    assert flavour == "vllm-legacy"
    assert values["kv_cache_usage"] == 0.5 and values["running"] == 5.0
    assert values["prefix_cache_queries"] == 1000.0  # the _created sample is not summed in
    view = EngineView()
    view.update(values, flavour)
    assert view.to_dict()["prefix_cache_hit_rate"] == 0.25
    view.update({**values, "prefix_cache_queries": 1400.0, "prefix_cache_hits": 550.0}, flavour)
    assert view.prefix_hit_rate_recent == pytest.approx(300 / 400)
    # An engine restart (counters went down) gives no recent rate rather than a wrong one.
    view.update({**values, "prefix_cache_queries": 10.0, "prefix_cache_hits": 600.0}, flavour)
    assert view.prefix_hit_rate_recent is None


@pytest.mark.parametrize("legacy", [False, True])
async def test_the_proxy_scrapes_each_replica(legacy: bool) -> None:
    sim = SimConfig(model="m", engine=FAST_ENGINE, legacy_metric_names=legacy)
    async with (
        stack(n_replicas=2, sim=sim, engine_scrape_interval="0") as s,
        aiohttp.ClientSession() as session,
    ):
        prompt = "the same long shared prefix " * 20
        for _ in range(3):
            body = {"model": "m", "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
            async with session.post(s.url + "/v1/completions", json=body) as response:
                assert response.status == 200
        await s.server.proxy.scrape_engines()
        async with session.get(s.server.admin_url + "/replicas") as response:
            replicas = await response.json()
    engines = [r["engine"] for r in replicas["replicas"]]
    assert all(e["scrapes"] == 1 and e["failures"] == 0 for e in engines)
    assert {e["flavour"] for e in engines} == {"vllm-legacy" if legacy else "vllm"}
    assert sum(e["generation_tokens_total"] for e in engines) == 12
    assert all(e["running"] == 0 and e["kv_cache_usage"] is not None for e in engines)
    # Repeated prompts hit the prefix cache of whichever replica served them again.
    assert replicas["engine_totals"]["prefix_cache_hit_rate"] > 0


def test_histogram_totals_sum_over_label_sets() -> None:
    from sidecar.engine_metrics import histogram_totals

    text = (
        "# TYPE vllm:time_to_first_token_seconds histogram\n"
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf"} 3.0\n'
        'vllm:time_to_first_token_seconds_sum{engine="0"} 0.5\n'
        'vllm:time_to_first_token_seconds_count{engine="0"} 3.0\n'
        'vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf"} 1.0\n'
        'vllm:time_to_first_token_seconds_sum{engine="1"} 0.25\n'
        'vllm:time_to_first_token_seconds_count{engine="1"} 1.0\n'
    )
    totals = histogram_totals(
        text, ["vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"]
    )
    assert totals == {
        "vllm:time_to_first_token_seconds": (0.75, 4.0),
        "vllm:e2e_request_latency_seconds": (0.0, 0.0),
    }
