"""`/metrics` on the traffic port (sidecar/proxy/basemetrics.py): in front of several replicas
every replica's exposition with a replica label, in front of one its own; HEAD answered."""

from __future__ import annotations

import aiohttp
import pytest
from proxy_stack import stack

from sidecar.proxy.basemetrics import merge_expositions
from sidecar.record import Outcome
from sidecar.sim.server import close_replicas

EXPOSITION = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="0.3",model_name="m",replica="r"} 1.0
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m",replica="r"} 2.0
vllm:e2e_request_latency_seconds_count{model_name="m",replica="r"} 2.0
vllm:e2e_request_latency_seconds_sum{model_name="m",replica="r"} 0.9
"""


def test_merge_labels_every_sample_and_keeps_one_family_head() -> None:
    merged = merge_expositions(
        [("a:1", EXPOSITION), ("b:2", EXPOSITION.replace(" 2.0", " 7.0"))], [("c:3", "HTTP 500")]
    ).decode()
    lines = merged.splitlines()
    assert lines[0] == "# replica c:3 not included: HTTP 500"
    assert merged.count("# TYPE vllm:num_requests_running gauge") == 1
    assert 'vllm:num_requests_running{engine="0",model_name="m",replica="a:1"} 2.0' in lines
    assert 'vllm:num_requests_running{engine="0",model_name="m",replica="b:2"} 7.0' in lines
    # An upstream's own `replica` label is kept, renamed as Prometheus renames target labels.
    assert (
        'vllm:e2e_request_latency_seconds_count{exported_replica="r",model_name="m",'
        'replica="b:2"} 7.0'
    ) in lines


def test_merge_refuses_one_name_of_two_types() -> None:
    with pytest.raises(ValueError, match="gauge on one replica"):
        merge_expositions(
            [
                ("a:1", EXPOSITION),
                ("b:2", EXPOSITION.replace("requests_running gauge", "requests_running counter")),
            ]
        )


async def test_base_url_metrics_in_front_of_several_replicas_label_each_replica() -> None:
    """Tools scrape ``<base_url>/metrics`` for the server's own metrics; through a gateway the
    answer once came from a random replica each time. It is every replica's, each sample
    labelled with its replica; HEAD gets the head only; neither is a failed request."""
    async with stack(n_replicas=2) as s, aiohttp.ClientSession() as session:
        labels = [r.url.split("://")[1] for r in s.replicas]
        async with session.get(s.url + "/metrics") as response:
            assert response.status == 200
            text = await response.text()
        async with session.head(s.url + "/metrics") as response:
            assert response.status == 200 and await response.read() == b""
            assert int(response.headers["Content-Length"]) > 0
        records = await s.records.wait_for(2)
    for label in labels:
        assert f'replica="{label}"' in text
    running = [line for line in text.splitlines() if line.startswith("vllm:num_requests_running{")]
    assert len(running) == 2  # one per replica, never one replica's alone
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1
    assert all(r.outcome is Outcome.OK and r.endpoint == "/metrics" for r in records)


async def test_base_url_metrics_of_one_replica_are_its_own_and_head_is_answered() -> None:
    async with stack() as s, aiohttp.ClientSession() as session:
        async with session.get(s.url + "/metrics") as response:
            through = await response.text()
        async with session.head(s.url + "/metrics") as response:
            assert response.status == 200 and await response.read() == b""
        records = await s.records.wait_for(2)
    assert "vllm:num_requests_running" in through and 'replica="' not in through
    assert all(r.outcome is Outcome.OK for r in records)


async def test_base_url_metrics_name_a_replica_that_did_not_answer() -> None:
    async with stack(n_replicas=2) as s, aiohttp.ClientSession() as session:
        await close_replicas(s.replicas[1:])
        async with session.get(s.url + "/metrics") as response:
            assert response.status == 200
            text = await response.text()
    gone = s.replicas[1].url.split("://")[1]
    assert f"# replica {gone} not included: ClientConnectorError" in text
    assert f'replica="{s.replicas[0].url.split("://")[1]}"' in text
