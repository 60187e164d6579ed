"""How the proxy's processes run CPython's garbage collector.

A collection stops the whole process: in a worker, every stream's relay, and every stamp due
meanwhile is taken late by what is left of it (`stalls.py` measures each pause). Reference
counting frees almost everything the moment it is no longer used; the cycle collector is only
needed for objects in reference cycles, and a finished request leaves none
(tests/test_gc_cycles.py, `benchmarks/gc_census.py`: 0 objects per request over eleven ways a
request can end). What a collection costs is the scan of what is alive: about 70 tracked
objects per stream in flight, and a full (generation-2) collection with 1,000 streams in flight
takes 27-35 ms here, with 4,000 165-172 ms.

CPython's default thresholds (700, 10, 10) run a full collection after every 10 generation-1
collections once the objects promoted since the last one reach a quarter of those that
survived it: with streams living for seconds, each new stream's objects are promoted, and a
worker holding 2,000 streams made a full collection every ~8 s. `settle` keeps the first two
thresholds and asks for ``FULL_COLLECTION_AFTER`` generation-1 collections between full ones:
at that load (8,000 events/s), none in a 40 s window instead of five (benchmarks/RESULTS.md,
"Garbage-collection pauses"). What a full collection would have freed (cycles left by code
outside the tested paths, or by libraries) waits that much longer: ten times CPython's
default, bounded the same way.
"""

from __future__ import annotations

import gc
from typing import Final

# Generation-1 collections between two full collections (CPython's default: 10).
FULL_COLLECTION_AFTER: Final = 100


def settle() -> None:
    """Once the process is ready to serve: one full collection, everything alive after
    start-up (modules, classes, the app) moved out of the collector's reach (`gc.freeze`: the
    collections that follow scan only what traffic made), and full collections made rarer.
    In the accuracy benchmark (benchmarks/proxy.md) freezing took GC time at 128 streams
    from 166 to 89 ms in 8 s, and a 14.5 ms full collection at one stream went away."""
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTION_AFTER)
