"""How the collector's C heap keeps the memory its summaries use from one scrape to the next.

A summary of a full live window works on numpy arrays of one value per token event: a window of
100,000 32-token streams makes several arrays of ~25 MB per `/stats` (3.2M gaps per vantage).
By default glibc's malloc gives memory of that size back to the kernel when it is freed (an
``munmap``, or a trim of its heap's top; both thresholds adapt to the blocks it has seen, not to
a working set that changes from scrape to scrape), and the next scrape faults its arrays in
again page by page. On the reference VM that was about a fifth of a `/stats` of that window
(119-129 ms against 96-102 with the settings below: in-process timings of
`WindowSink.snapshot` + JSON, best of five, three to four runs each; `hot_paths.py`'s row
109.7 against 96.7), spent in the kernel, where a worker sharing the core may wait for it (the
reference VM's kernel is built without kernel preemption, PREEMPT_NONE).

`keep_freed_memory` asks glibc to serve blocks up to 32 MiB from its heap (``M_MMAP_THRESHOLD``,
which also stops the threshold from moving) and to give back its top only beyond 256 MiB free
(``M_TRIM_THRESHOLD``): the arrays of one scrape reuse the pages of the last. The cost is
resident memory, paid whether scrapes come every second or every minute: what a scrape freed
stays mapped, and the live window's growing columns, reallocated on the heap instead of
remapped, leave holes behind (a 100,000 x 32-event window built and summarised in one process:
672 MB against 578 MB, flat over 60 summaries of windows of three sizes; ad hoc). So it is
off by default: ``SIDECAR_KEEP_FREED_MEMORY=1`` turns it on for the collector (`serve.serve`,
with ``--workers`` >= 1), where scrapes are frequent and heavy and memory is not short; the
workers, whose allocations are small, keep glibc's defaults always. Elsewhere than glibc (musl,
macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from typing import Final

ENV: Final = "SIDECAR_KEEP_FREED_MEMORY"
# glibc's <malloc.h>.
M_TRIM_THRESHOLD: Final = -1
M_MMAP_THRESHOLD: Final = -3
# The largest value glibc takes for M_MMAP_THRESHOLD on 64-bit (HEAP_MAX_SIZE / 2).
MMAP_THRESHOLD_BYTES: Final = 32 * 1024 * 1024
TRIM_THRESHOLD_BYTES: Final = 256 * 1024 * 1024


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the settings apply: when ``SIDECAR_KEEP_FREED_MEMORY`` is 1 (or true, yes, on);
    unset, 0, false, no or off leave glibc's defaults; any other value stops the start."""
    value = environ.get(ENV, "0").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{ENV} must be 1 or 0 (true/false, yes/no, on/off): {value!r}")


def keep_freed_memory() -> bool:
    """Set glibc's thresholds as the module says; True if glibc took both, False where this
    is not glibc (nothing changed)."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc's own symbol: musl has mallopt too
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success, 0 on a value it refuses.
    return bool(
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
        and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    )
