"""Reading a measuring sidecar's admin listener from the load generator (``sidecar sweep
--sidecar-admin``): the proxy's own view of exactly the requests of one run.

The proxy keeps each request's ``X-Request-Id``, and the replayer names every request of a run
``<prefix>-<index>-<random>``; ``GET /stats?request_id_prefix=<prefix>`` then summarises that
run's records only, whatever else shares the sidecar's live window (earlier steps, warm-up
requests, other clients). The window is time-based (60 s by default, and a record cap): a step
that lasts longer than the window loses its first records, which shows as fewer requests seen
than sent (``complete: false``), never as other requests mixed in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from sidecar import clock

VANTAGES = ("client", "server")
METRICS = ("ttft", "tpot", "itl", "e2e")


class AdminError(Exception):
    pass


class SidecarAdmin:
    def __init__(self, url: str, session: aiohttp.ClientSession, token: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.session = session
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    async def _get(self, path: str, params: Mapping[str, str] | None = None) -> dict[str, Any]:
        try:
            async with self.session.get(
                self.url + path, params=params, headers=self.headers
            ) as response:
                if response.status == 401:
                    raise AdminError(
                        f"{self.url}{path}: the sidecar wants its admin token "
                        "(--admin-token or SIDECAR_ADMIN_TOKEN)"
                    )
                if response.status != 200:
                    text = (await response.text())[:200]
                    raise AdminError(f"{self.url}{path}: HTTP {response.status}: {text}")
                body = await response.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            raise AdminError(f"{self.url}{path}: {exc or type(exc).__name__}") from None
        if not isinstance(body, dict):
            raise AdminError(f"{self.url}{path}: not a JSON object")
        return body

    async def replicas(self) -> dict[str, Any]:
        return await self._get("/replicas")

    async def cpu_seconds(self) -> float:
        """The sidecar's CPU so far, every process of it: ``process_cpu_seconds_total`` (the
        process that serves /metrics: the collector, or the whole proxy with ``--workers 0``)
        plus ``sidecar_worker_cpu_seconds_total`` (each worker's own, as of its last status,
        every 0.25 s)."""
        try:
            async with self.session.get(self.url + "/metrics", headers=self.headers) as response:
                if response.status != 200:
                    raise AdminError(f"{self.url}/metrics: HTTP {response.status}")
                exposition = await response.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, UnicodeDecodeError) as exc:
            raise AdminError(f"{self.url}/metrics: {exc or type(exc).__name__}") from None
        return cpu_seconds_of(exposition)

    async def stats(self, request_id_prefix: str) -> dict[str, Any]:
        snapshot = await self._get("/stats", {"request_id_prefix": request_id_prefix})
        selection = snapshot.get("selection")
        if (
            not isinstance(selection, dict)
            or selection.get("request_id_prefix") != request_id_prefix
        ):
            # An older sidecar ignores the query and summarises its whole window: refuse
            # rather than report other requests' latencies as this step's.
            raise AdminError(
                f"{self.url}/stats cannot select requests by id (an older "
                "sidecar?): no per-step server view"
            )
        return snapshot

    async def view_of(
        self, request_id_prefix: str, sent: int, *, settle_s: float = 5.0
    ) -> dict[str, Any]:
        """The sidecar's view of the ``sent`` requests named ``request_id_prefix``.

        The proxy finishes a request's record just after relaying its last byte, so the
        replayer can be done a moment before the sidecar has counted every request: poll until
        all are there, or ``settle_s`` has passed (then the view says it is incomplete).
        """
        deadline = clock.monotonic_ns() + int(settle_s * 1e9)
        while True:
            snapshot = await self.stats(request_id_prefix)
            if snapshot.get("generation_requests", 0) >= sent or clock.monotonic_ns() >= deadline:
                return sidecar_view(snapshot, request_id_prefix, sent)
            await asyncio.sleep(0.05)


_CPU_SAMPLES = ("process_cpu_seconds_total", "sidecar_worker_cpu_seconds_total")


def cpu_seconds_of(exposition: str) -> float:
    """The sum of the CPU samples of a sidecar's /metrics (`SidecarAdmin.cpu_seconds`). An
    exposition without ``process_cpu_seconds_total`` (a process not on Linux, or not a
    sidecar) or one that does not parse raises AdminError."""
    total, found = 0.0, False
    try:
        for family in text_string_to_metric_families(exposition):
            for sample in family.samples:
                if sample.name in _CPU_SAMPLES:
                    total += sample.value
                    found = found or sample.name == _CPU_SAMPLES[0]
    except ValueError as exc:
        raise AdminError(f"/metrics does not parse: {exc}") from None
    if not found:
        raise AdminError("/metrics has no process_cpu_seconds_total: no CPU figure")
    return total


def _in_ms(summary: Mapping[str, Any]) -> dict[str, Any]:
    return {
        k: (v * 1000.0 if k != "count" and isinstance(v, (int, float)) else v)
        for k, v in summary.items()
    }


def sidecar_view(snapshot: Mapping[str, Any], request_id_prefix: str, sent: int) -> dict[str, Any]:
    """A /stats snapshot (seconds) as a sweep step's sidecar view (milliseconds).

    ``client`` here is the sidecar's client vantage (from the request fully received by the
    proxy), ``server`` its upstream vantage (from the request sent to the replica); neither is
    the replayer's own client vantage, which the step's report holds.
    """
    seen = int(snapshot.get("generation_requests", 0))
    vantages: dict[str, Any] = {}
    for name in VANTAGES:
        data = snapshot.get("vantages", {}).get(name, {})
        vantages[name] = {
            "requests": data.get("requests", 0),
            **{f"{m}_ms": _in_ms(data.get(m, {})) for m in METRICS},
        }
    return {
        "request_id_prefix": request_id_prefix,
        "requests_sent": sent,
        "requests_seen": seen,
        "complete": seen == sent,
        "outcomes": dict(snapshot.get("outcomes", {})),
        "evicted_over_cap": snapshot.get("evicted_over_cap", 0),
        "vantages": vantages,
        # The sidecar's own delay per token event of the step's streams (docs/metrics.md).
        "relay": {
            "requests": snapshot.get("relay", {}).get("requests", 0),
            "delay_ms": _in_ms(snapshot.get("relay", {}).get("delay", {})),
        },
    }
