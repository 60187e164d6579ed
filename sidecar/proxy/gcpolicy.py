"""How the proxy's processes run CPython's garbage collector.

A collection stops the whole process: in a worker, every stream's relay, and every stamp due
meanwhile is taken late by what is left of it (`stalls.py` measures each pause). Reference
counting frees almost everything the moment it is no longer used; the cycle collector is only
needed for objects in reference cycles, and a finished request leaves none
(tests/test_gc_cycles.py, `benchmarks/gc_census.py`: 0 objects per request over eleven ways a
request can end). What a collection costs is the scan of what is alive: about 61 tracked
objects per stream in flight, and a full (generation-2) collection with 1,000 streams in flight
takes 9-35 ms on the reference VMs, with 4,000 115-172 ms.

CPython's default thresholds (700, 10, 10) run a full collection after every 10 generation-1
collections once the objects promoted since the last one reach a quarter of those that
survived it: with streams living for seconds, each new stream's objects are promoted, and a
worker holding 2,000 streams made a full collection every ~8 s. `settle` sets
``DEFAULT_THRESHOLDS`` instead (benchmarks/RESULTS.md, "Garbage-collection pauses"):

- full collections after 1,000 generation-0 collections' worth (500 generation-1 ones of 2),
  not 100: at 8,000 events/s with 256 or 2,000 streams, none in a 40 s window instead of four
  or five. What one would have freed (cycles left by code outside the tested paths, or by
  libraries) waits ten times longer than under CPython's default, bounded the same way;
- a generation-1 collection after 2 generation-0 ones, not 10: it scans the survivors of the
  generation-0 collections since the last one, so it is shorter (at 2,000 streams 1.7-2.1 ms
  instead of 4.6-6.6 on average, the longest 6.4-7.7 ms instead of 9.4-25, three 40 s runs
  each) and five times as frequent, for about the same work: each surviving object is scanned
  once in each young generation either way.

``SIDECAR_GC_THRESHOLDS`` (three positive integers, as `gc.set_threshold` takes them, e.g.
``700,10,10`` for CPython's own) overrides them for every process of the proxy; a value that
is not three positive integers stops the start (`thresholds`).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping
from typing import Final

ENV: Final = "SIDECAR_GC_THRESHOLDS"
# Generation 0 after 700 net new tracked objects (CPython's), generation 1 after 2 of those,
# a full collection after 500 of those.
DEFAULT_THRESHOLDS: Final = (700, 2, 500)


def thresholds(environ: Mapping[str, str] | None = None) -> tuple[int, int, int]:
    """The thresholds `settle` sets: ``SIDECAR_GC_THRESHOLDS`` or ``DEFAULT_THRESHOLDS``.
    Raises ValueError, naming the variable, for a value that is not three positive integers
    (0 would switch the collector off)."""
    text = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not text:
        return DEFAULT_THRESHOLDS
    try:
        young, middle, full = (int(part) for part in text.split(","))
    except ValueError:
        young = middle = full = 0
    if min(young, middle, full) < 1:
        raise ValueError(
            f"{ENV}={text!r}: want three positive integers, gc.set_threshold's generation 0, "
            "1 and 2 thresholds (e.g. 700,2,500, the default; 700,10,10 is CPython's)"
        )
    return young, middle, full


def settle() -> None:
    """Once the process is ready to serve: one full collection, everything alive after
    start-up (modules, classes, the app) moved out of the collector's reach (`gc.freeze`: the
    collections that follow scan only what traffic made), and the thresholds set.
    In the accuracy benchmark (benchmarks/proxy.md) freezing took GC time at 128 streams
    from 166 to 89 ms in 8 s, and a 14.5 ms full collection at one stream went away."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds())
