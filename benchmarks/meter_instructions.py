"""Instructions per event of the measuring core's common read, counted by callgrind.

    python benchmarks/meter_instructions.py                        # this tree (~1 minute)
    python benchmarks/meter_instructions.py --tree /tmp/before     # another tree, for an A/B
    python benchmarks/meter_instructions.py --smoke                # CI: no valgrind, no claim

Timing the measuring core (`hot_paths.py`) on a shared 2-vCPU VM moves by 30-50 % from run to
run; an instruction count does not: ``valgrind --tool=callgrind`` counts the instructions the
process executed, the same for the same code and input whatever else the host is doing. What
runs: `StreamMeter.feed` over N vLLM chat token events with continuous usage, one event per
read, the usage the proxy injected cut back out (the one-event lane, what almost every read of a
stream is). The process is run four times, N and 2N events, each with and without the feeding
(the setup alone: imports, building the events), and the instructions per event are

    ((run(2N) - run(N)) - (setup(2N) - setup(N))) / N

so that neither the interpreter's start nor the events' making counts. Instructions are not
time (a cache miss costs more than an add), but a change that removes instructions from this
loop removes work from every read of every stream.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The child: builds the events, then feeds them unless told "setup".
CHILD = r"""
import json, sys
from sidecar.meter import StreamMeter
from sidecar.protocol.rewrite import UsagePlan

n, mode = int(sys.argv[1]), sys.argv[2]
def event(i):
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": " hi"}, "logprobs": None,
                          "finish_reason": None, "token_ids": None}],
             "usage": {"prompt_tokens": 12, "total_tokens": 12 + i, "completion_tokens": i}}
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
events = [event(i) for i in range(1, n + 1)]
if mode == "feed":
    # The proxy's plan when the client asked for no usage: both injected, both cut back out.
    meter = StreamMeter(0, UsagePlan(False, False, True, True))
    feed = meter.feed
    for at, raw in enumerate(events):
        out = feed(raw, at)
    assert meter.events == n and meter.token_totals[1] == n, "the events were not all counted"
    assert b'"usage"' not in out, "the injected usage was not cut"
"""

_COLLECTED = re.compile(r"Collected : (\d+)")


def count(tree: Path, n: int, mode: str) -> int:
    """Instructions the child executed (callgrind)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"}
    proc = subprocess.run(
        [
            "valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
            sys.executable, "-c", CHILD, str(n), mode,
        ],
        cwd=tree, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    found = _COLLECTED.search(proc.stderr)
    if found is None:
        raise RuntimeError(f"callgrind printed no count:\n{proc.stderr[-2000:]}")
    return int(found.group(1))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, default=REPO, help="the source tree to count [this]")
    parser.add_argument("--events", type=int, default=20_000, help="N [20000]")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--smoke", action="store_true", help="CI: run the child once, no count")
    args = parser.parse_args(argv)
    tree = args.tree.resolve()
    if args.smoke:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        subprocess.run([sys.executable, "-c", CHILD, "200", "feed"], env=env, check=True)
        print("meter_instructions smoke: the child fed 200 events through the lane")
        return
    if shutil.which("valgrind") is None:
        print("SKIPPED: valgrind is not installed (apt-get install valgrind)")
        return
    n = args.events
    counts = {
        (mode, size): count(tree, size, mode) for mode in ("feed", "setup") for size in (n, 2 * n)
    }
    fed = counts[("feed", 2 * n)] - counts[("feed", n)]
    setup = counts[("setup", 2 * n)] - counts[("setup", n)]
    per_event = (fed - setup) / n
    result = {
        "tree": str(tree),
        "events": n,
        "python": sys.version.split()[0],
        "counts": {f"{mode}_{size}": value for (mode, size), value in counts.items()},
        "instructions_per_event": round(per_event),
    }
    print(f"{tree}: {per_event:,.0f} instructions per event (StreamMeter.feed, one-event lane)")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
