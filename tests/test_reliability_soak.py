"""A scaled-down soak for CI: a few thousand requests of benchmarks/soak.py's mix (mostly
normal, a few percent of every fault, client and upstream side) through the proxy, in one
process, with every record checked and the process's resources sampled at quiet checkpoints.

The long version (benchmarks/soak.py, separate processes, 1M requests) is in
benchmarks/soak.md. Here the simulator and the clients share the process with the proxy, so
only flatness is judged, with these tolerances (after a warm-up of two checkpoints, during
which connection pools, caches and the allocator's arenas fill):

- threads, file descriptors that are not sockets, and the capture queue (0): exact;
- sockets in CLOSE_WAIT (the peer closed, nobody here did: how a descriptor leak looks): at
  most 2 at any checkpoint;
- sockets and asyncio tasks: within a structural bound (keep-alive pools hold idle connections,
  how many depends on timing: see SOCKET_BOUND), and the last checkpoint at most 40 above the
  first after warm-up: a per-request leak among the ~20% faulty requests would add ~80 a batch;
- live Python objects (after gc.collect()): at most 3000 more at the last checkpoint than at
  the first after warm-up (~1 object per request; pools vary by a few hundred);
- RSS: the last checkpoint at most 8 MiB above the first after warm-up (the allocator's
  arenas and the simulator, which shares the process, move it by ~1-2 MiB here; the simulator's
  prefix cache is kept small so that it is full after warm-up);
- the live window (trimmed by the scrapes of /metrics and /stats, as a Prometheus would do)
  never holds more than a batch, and empties within its window_s once traffic stops.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import random
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from reliability_helpers import proxy_to, until

from sidecar.sim.engine import EngineConfig
from sidecar.sim.server import SimConfig, close_replicas, start_replicas

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import soak  # noqa: E402  (benchmarks/soak.py: the mix, shared with the long run)

BATCHES = 8
BATCH = 400
CONCURRENCY = 16
WARM_UP = 2
# Connections in this one process, each counted at both ends: clients <-> proxy (at most the
# client pool, CONCURRENCY), proxy <-> simulators (at most CONCURRENCY in use, and as many idle
# per replica), plus the four listeners and the test's own; and one task per connection.
SOCKET_BOUND = 2 * (CONCURRENCY + 3 * CONCURRENCY) + 16
TASK_BOUND = SOCKET_BOUND + 32
# A client that leaves 0.3 s after sending (while the answer's headers are held back): if the
# event loop was too busy to read its request by then, the proxy never saw it (aiohttp drops a
# connection closed before its handler started): no request, so no record. Tolerated for this
# kind only, at most twice per run; every request the proxy counted has its record.
GONE_EARLY = "client_gone_early-"
SIM = SimConfig(
    model="m", engine=EngineConfig(step_floor_s=0.0005, per_token_s=0.0, num_gpu_blocks=1024)
)


async def _run_batch(
    session: aiohttp.ClientSession, url: str, planned: list[tuple[int, soak.Kind]]
) -> list[str]:
    """Send ``planned`` with CONCURRENCY clients; the requests whose client saw the wrong thing."""
    queue = list(planned)
    unexpected: list[str] = []

    async def client() -> None:
        while queue:
            i, kind = queue.pop()
            if not await soak.send(session, url, kind, i):
                unexpected.append(f"{kind.name}-{i}")

    await asyncio.gather(*(client() for _ in range(CONCURRENCY)))
    return unexpected


@pytest.mark.slow
async def test_soak_is_flat_and_loses_nothing(tmp_path: Path) -> None:
    sims = await start_replicas(SIM, 2)
    settings = {
        **soak.PROXY_SETTINGS,
        "capture_dir": str(tmp_path / "capture"),
        "window_s": "100ms",
        "health_interval": "200ms",
    }
    rng = random.Random(7)
    samples: list[dict[str, Any]] = []
    sent = never_arrived = 0
    kinds_total: dict[str, int] = {}
    try:
        async with proxy_to([s.url for s in sims], **settings) as p:
            proxy = p.server.proxy
            capture: Any = next(s for s in proxy.fanout.sinks if s.name == "capture")

            def quiet(planned_ids: set[str]) -> bool:
                missing = planned_ids - {r.request_id for r in p.records.records}
                return (
                    all(m.startswith(GONE_EARLY) for m in missing)
                    and proxy.in_flight == 0
                    and capture.queued == 0
                    and proxy.records_total == proxy.requests_total
                    and all(s.replica.in_flight == 0 for s in sims)
                )

            for _ in range(BATCHES):
                planned = [(sent + i, soak.pick(rng)) for i in range(BATCH)]
                sent += BATCH
                # A client pool per batch, closed before the checkpoint: only the proxy's own
                # connections (to the replicas, pooled) remain at the quiet point.
                async with aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=CONCURRENCY)
                ) as session:
                    unexpected = await _run_batch(session, p.url, planned)
                    for path in ("/metrics", "/stats"):
                        async with session.get(p.admin + path) as response:
                            assert response.status == 200
                            await response.read()
                planned_ids = {f"{kind.name}-{i}" for i, kind in planned}
                await until(functools.partial(quiet, planned_ids), 20, "quiet")
                # Requests in == records out, each with the outcome its kind implies.
                assert unexpected == []
                outcomes = {r.request_id: r.outcome.value for r in p.records.records}
                assert len(outcomes) == len(p.records.records)  # one record per request
                never_arrived += len(planned_ids - set(outcomes))
                assert proxy.requests_total == proxy.records_total == sent - never_arrived
                for i, kind in planned:
                    request_id = f"{kind.name}-{i}"
                    assert outcomes.get(request_id, kind.outcome) == kind.outcome, (kind, i)
                    kinds_total[kind.name] = kinds_total.get(kind.name, 0) + 1
                p.records.records.clear()  # the collector is the test's, not the proxy's
                # The live window holds what ended in its last 100 ms: empty once traffic stops.
                window_peak = len(p.window._records)
                await until(lambda: not p.window.records(), 5, "an empty live window")
                gc.collect()
                samples.append(
                    {
                        **soak.process_state(),
                        "tasks": len(asyncio.all_tasks()),
                        "objects": len(gc.get_objects()),
                        "capture_queue": capture.queued,
                        "window": window_peak,
                        "outstanding": sum(r.outstanding for r in proxy.router.replicas),
                    }
                )
            written, dropped = (
                capture.written,
                (capture.dropped_queue_full + capture.dropped_write_errors),
            )
    finally:
        await close_replicas(sims)
    # Every kind of the mix happened, and nothing was lost on the way to the capture.
    assert set(kinds_total) == {k.name for k in soak.KINDS}
    assert never_arrived <= 2
    assert dropped == 0 and written == sent - never_arrived - kinds_total["pass_through"]
    after = samples[WARM_UP:]
    first, last = after[0], after[-1]
    assert all(s["capture_queue"] == 0 and s["outstanding"] == 0 for s in samples)
    for key in ("threads", "fds_not_sockets"):
        assert all(s[key] == first[key] for s in after), (key, [s[key] for s in samples])
    assert all(s["close_wait"] <= 2 for s in samples), [s["close_wait"] for s in samples]
    for key, bound in (("sockets", SOCKET_BOUND), ("tasks", TASK_BOUND)):
        values = [s[key] for s in after]
        assert max(values) <= bound and last[key] <= first[key] + 40, (key, values)
    objects = [s["objects"] for s in after]
    assert last["objects"] - first["objects"] <= 3000, objects
    assert last["rss_kb"] - first["rss_kb"] <= 8 * 1024, [s["rss_kb"] for s in samples]
    assert all(s["window"] <= BATCH for s in samples), [s["window"] for s in samples]
