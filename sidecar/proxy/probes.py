"""What the proxy asks of its replicas besides traffic: a health check and an engine-metrics
scrape. One implementation, used by the one-process proxy (relay.py) and by the collector
(collector.py), which runs them once for all its workers."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from sidecar.engine_metrics import parse_engine_metrics
from sidecar.proxy.routing import Replica

log = logging.getLogger("sidecar.proxy")


async def check_health(
    session: aiohttp.ClientSession,
    replica: Replica,
    timeout: aiohttp.ClientTimeout,
    eject_after: int,
) -> bool:
    """``GET /health`` once: a 200 puts the replica (back) in rotation, anything else counts
    towards ejecting it after ``eject_after`` consecutive failures. Returns whether it passed."""
    try:
        async with session.get(replica.url + "/health", timeout=timeout) as resp:
            await resp.read()
            passed = resp.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        passed = False
    if passed:
        if not replica.healthy:
            log.warning("replica %s is healthy again: back in rotation", replica.label)
        replica.record_success()
    elif replica.record_failure(eject_after):
        log.warning(
            "replica %s failed %d health checks: ejected",
            replica.label,
            replica.consecutive_failures,
        )
    return passed


async def scrape_engine(
    session: aiohttp.ClientSession, replica: Replica, timeout: aiohttp.ClientTimeout
) -> None:
    """Read a replica's ``/metrics`` once into its engine view (queue, KV cache, prefix cache),
    or record why it could not be read."""
    try:
        async with session.get(replica.url + "/metrics", timeout=timeout) as resp:
            if resp.status != 200:
                replica.engine.fail(f"http_{resp.status}")
                return
            text = await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        replica.engine.fail(type(exc).__name__)
        return
    try:
        values, flavour = parse_engine_metrics(text)
    except ValueError:
        replica.engine.fail("unparseable_metrics")
        return
    replica.engine.update(values, flavour)
