"""A real OTLP/HTTP receiver for tests: aiohttp on 127.0.0.1, protobuf bodies decoded with
opentelemetry-proto (no OpenTelemetry collector with an OTLP receiver installs here).

It serves ``POST /v1/metrics`` and ``POST /v1/traces`` the way a collector does (binary protobuf,
optional gzip/deflate ``Content-Encoding``, an empty ``Export*ServiceResponse``), and keeps every
decoded request. The exporter under test runs on its own thread, the receiver on the test's event
loop: a test must never block the loop while it waits for an export (run ``force_flush`` /
``shutdown`` through ``asyncio.to_thread``).
"""

from __future__ import annotations

import asyncio
import gzip
import zlib
from collections.abc import Callable

from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

PROTOBUF = "application/x-protobuf"


class OTLPReceiver:
    def __init__(self) -> None:
        self.metrics: list[ExportMetricsServiceRequest] = []
        self.traces: list[ExportTraceServiceRequest] = []
        self.rejected: list[str] = []  # why a request was refused, if any was
        self._changed = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self.url = ""  # base URL, like OTEL_EXPORTER_OTLP_ENDPOINT

    async def start(self, port: int = 0) -> str:
        app = web.Application()
        app.router.add_post("/v1/metrics", self._metrics)
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _body(self, request: web.Request) -> bytes | None:
        if request.content_type != PROTOBUF:
            self.rejected.append(f"content type {request.content_type!r}")
            return None
        body = await request.read()
        encoding = request.headers.get("Content-Encoding", "").lower()
        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding == "deflate":
            body = zlib.decompress(body)
        elif encoding not in ("", "identity"):
            self.rejected.append(f"content encoding {encoding!r}")
            return None
        return body

    async def _metrics(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if body is None:
            return web.Response(status=415)
        message = ExportMetricsServiceRequest()
        message.ParseFromString(body)
        async with self._changed:
            self.metrics.append(message)
            self._changed.notify_all()
        return web.Response(
            body=ExportMetricsServiceResponse().SerializeToString(), content_type=PROTOBUF
        )

    async def _traces(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if body is None:
            return web.Response(status=415)
        message = ExportTraceServiceRequest()
        message.ParseFromString(body)
        async with self._changed:
            self.traces.append(message)
            self._changed.notify_all()
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(), content_type=PROTOBUF
        )

    async def wait_for(
        self, predicate: Callable[[OTLPReceiver], bool], timeout: float = 10.0
    ) -> None:
        """Wait (without blocking the loop) until ``predicate(self)`` holds."""

        async def wait() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: predicate(self))

        await asyncio.wait_for(wait(), timeout)
