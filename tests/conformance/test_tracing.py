"""Traces with vLLM's own spans: `sidecar proxy --otel-traces` in front of a real vLLM started
with ``--otlp-traces-endpoint`` (`sidecar vllm up --otlp-traces-endpoint URL`). The proxy picks
its CLIENT span's id while the request runs and sends it in the upstream's traceparent; vLLM's
span for the request must then be a child of the sidecar's, in the client's trace."""

from __future__ import annotations

import aiohttp
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from otlp_receiver import OTLPReceiver

from .real_server import RealVLLM
from .test_relay import proxy_before

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


def _spans(receiver: OTLPReceiver) -> list[tuple[str, Span]]:
    """(service.name, span) of every span received."""
    out: list[tuple[str, Span]] = []
    for request in receiver.traces:
        for resource in request.resource_spans:
            service = next(
                (
                    kv.value.string_value
                    for kv in resource.resource.attributes
                    if kv.key == "service.name"
                ),
                "",
            )
            for scope in resource.scope_spans:
                out.extend((service, span) for span in scope.spans)
    return out


async def test_vllms_span_is_a_child_of_the_sidecars(real_vllm: RealVLLM) -> None:
    if real_vllm.otlp_port is None:
        pytest.fail(
            "the tracing test needs the port the server exports its spans to: start "
            "it with `sidecar vllm up --otlp-traces-endpoint "
            "http://127.0.0.1:PORT/v1/traces` and pass --real-vllm-otlp-port=PORT "
            "(--real-vllm=start arranges both)",
            pytrace=False,
        )
    vllm_receiver = OTLPReceiver()
    await vllm_receiver.start(real_vllm.otlp_port)
    sidecar_receiver = OTLPReceiver()
    sidecar_url = await sidecar_receiver.start()
    try:
        async with (
            proxy_before(
                real_vllm, otel_endpoint=sidecar_url, otel_traces="true", otel_export_interval="1s"
            ) as (proxy, records),
            aiohttp.ClientSession() as session,
        ):
            body = {
                "model": real_vllm.model,
                "prompt": "Trace me",
                "max_tokens": 4,
                "ignore_eos": True,
                "stream": True,
            }
            headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
            async with session.post(
                proxy.url + "/v1/completions", json=body, headers=headers
            ) as response:
                assert response.status == 200
                await response.read()
            await records.wait_for(1)
        # vLLM's batch span processor exports within ~5 s.
        await vllm_receiver.wait_for(
            lambda r: any(span.trace_id.hex() == CLIENT_TRACE for _, span in _spans(r)), timeout=30
        )
    finally:
        await vllm_receiver.close()
        await sidecar_receiver.close()
    (sidecar_span,) = [span for _, span in _spans(sidecar_receiver)]
    assert sidecar_span.trace_id.hex() == CLIENT_TRACE
    assert sidecar_span.parent_span_id.hex() == CLIENT_SPAN
    ours = [
        (service, span)
        for service, span in _spans(vllm_receiver)
        if span.trace_id.hex() == CLIENT_TRACE
    ]
    assert ours, "vLLM exported no span of the client's trace"
    # vLLM's request span names the sidecar's span as its parent.
    assert any(span.parent_span_id == sidecar_span.span_id for _, span in ours), [
        (service, span.name, span.parent_span_id.hex()) for service, span in ours
    ]
