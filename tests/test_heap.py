"""The collector's C heap settings (`sidecar.proxy.heap`): what glibc does with them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sidecar.proxy import heap

# In a process of its own (malloc's settings are the process's): allocate, touch and free a
# 24 MiB block twice, and count the page faults of the second time (ru_minflt).
FAULTS = """
import json, resource, sys
import numpy as np
from sidecar.proxy import heap
took = heap.keep_freed_memory() if sys.argv[1] == "keep" else None
def faults() -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = np.ones(3 * 1024 * 1024)  # 24 MiB, every page touched
    del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
first = faults()
print(json.dumps({"took": took, "first": first, "second": faults()}))
"""


def faults(mode: str) -> dict[str, int | bool | None]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run(
        [sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, env=env, check=True
    )
    result: dict[str, int | bool | None] = json.loads(done.stdout)
    return result


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_a_freed_block_is_reused_without_faulting_its_pages_in_again() -> None:
    kept, default = faults("keep"), faults("default")
    assert kept["took"] is True
    pages = 24 * 1024 * 1024 // 4096
    # glibc's defaults: the block is mmapped and unmapped each time, its pages faulted in
    # each time (a huge-page fault stands for 512 pages: at least the 2 MiB pages' count).
    assert default["first"] >= pages // 512 and default["second"] >= pages // 512  # type: ignore[operator]
    # Kept: the second block reuses the heap pages the first one left.
    assert kept["second"] < default["second"] // 4 + 16  # type: ignore[operator]


@pytest.mark.parametrize(
    ("value", "expected"), [("1", True), (" On ", True), ("0", False), ("no", False)]
)
def test_the_environment_switch(value: str, expected: bool) -> None:
    assert heap.wanted({heap.ENV: value}) is expected
    assert heap.wanted({}) is False  # off unless asked for


def test_a_bad_switch_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="SIDECAR_KEEP_FREED_MEMORY must be 1 or 0"):
        heap.wanted({heap.ENV: "maybe"})
