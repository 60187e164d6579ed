"""Cost of one step of the simulator's engine model with a full batch (no I/O, one core).

    python benchmarks/engine_step.py
    python benchmarks/engine_step.py --smoke      # CI: 20 steps per configuration

Prints steps/s for 256 running decodes at stream_interval 1 and 8, and with 4 speculative
tokens, then the same as one JSON line. A real engine step at that batch takes >= 8 ms (the
default step floor), so the model must stay far below that to never be what limits a simulated
replica.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

from sidecar.sim.engine import EngineConfig, EngineModel, EngineRequest


def steps_per_second(config: EngineConfig, batch: int = 256, steps: int = 400) -> float:
    model = EngineModel(config)
    for i in range(batch):
        tokens = tuple(range(i * 1000 + 3, i * 1000 + 203))
        model.add_request(EngineRequest(f"r{i}", tokens, max_tokens=100_000, ignore_eos=True), 0.0)
    now = 0.0
    while model.stats().num_waiting or now == 0.0:
        now += model.step(now).duration_s
    start = time.perf_counter()
    for _ in range(steps):
        now += model.step(now).duration_s
    return steps / (time.perf_counter() - start)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="timed steps per configuration")
    parser.add_argument("--smoke", action="store_true", help="CI smoke run: 20 steps")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps = 20
    rates: dict[str, float] = {}
    for label, config in (
        ("stream_interval=1", EngineConfig(seed=1, max_model_len=131072)),
        ("stream_interval=8", EngineConfig(seed=1, max_model_len=131072, stream_interval=8)),
        ("speculative k=4", EngineConfig(seed=1, max_model_len=131072, num_speculative_tokens=4)),
    ):
        rate = steps_per_second(config, steps=args.steps)
        rates[label] = rate
        print(f"{label:20} {rate:8.0f} steps/s  ({1e3 / rate:.2f} ms per step, 256 running)")
    print(json.dumps({label: round(rate, 1) for label, rate in rates.items()}))


if __name__ == "__main__":
    main()
