"""Shared fixtures: simulated vLLM replicas on ephemeral 127.0.0.1 ports.

``start_sim(config=None, n=1, **overrides)`` starts ``n`` replicas (a fast engine by default:
1 ms steps) and returns them; every replica started through it is closed at teardown.
``sim_url`` is the base URL of one such replica with the defaults.

At the end of every run, the real parts (programs and packages some tests run as they run in
production) missing on this machine are named, with the command that installs them: without
them those tests skip, which a plain `pytest` shows only as a count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import uvloop
from real_parts import report_missing_parts

from sidecar.sim.engine import EngineConfig
from sidecar.sim.server import RunningReplica, SimConfig, start_replicas

# Tiny step time so that tests exercise the real engine loop in milliseconds.
FAST_ENGINE = EngineConfig(step_floor_s=0.001)

StartSim = Callable[..., Awaitable[list[RunningReplica]]]


def pytest_addoption(parser: pytest.Parser) -> None:
    # The conformance suite's option (tests/conformance/conftest.py), registered here because
    # pytest accepts only options of the conftests it reads before collecting: this way
    # `pytest --real-vllm=...` works from the repository root as well as on tests/conformance.
    parser.addoption(
        "--real-vllm", metavar="start|URL", default=None,
        help="run tests/conformance against a real vLLM: 'start' brings one up with `sidecar "
        "vllm` (cached in $SIDECAR_VLLM_HOME) and stops it at the end; a base URL uses a "
        "server already running (`sidecar vllm up`)")
    parser.addoption(
        "--real-vllm-otlp-port", metavar="PORT", type=int, default=None,
        help="with --real-vllm=URL: the port on 127.0.0.1 that server exports its spans to "
        "(`sidecar vllm up --otlp-traces-endpoint http://127.0.0.1:PORT/v1/traces`); the "
        "tracing test listens there. --real-vllm=start arranges it itself")


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    """Every async test runs on uvloop, the loop `sidecar` itself runs on: the data path's
    Protocols and transports are tested as they serve traffic."""
    return {"uvloop": uvloop.new_event_loop}


def fast_sim_config(**overrides: Any) -> SimConfig:
    """A SimConfig with the fast engine; ``engine_<field>=...`` overrides engine fields."""
    engine_overrides = {
        key.removeprefix("engine_"): overrides.pop(key)
        for key in list(overrides)
        if key.startswith("engine_")
    }
    engine = dataclasses.replace(overrides.pop("engine", FAST_ENGINE), **engine_overrides)
    overrides.setdefault("model", "M")
    return SimConfig(engine=engine, **overrides)


@pytest.fixture
async def start_sim() -> AsyncIterator[StartSim]:
    started: list[RunningReplica] = []

    async def start(
        config: SimConfig | None = None, n: int = 1, port: int = 0, **overrides: Any
    ) -> list[RunningReplica]:
        if config is None:
            config = fast_sim_config(**overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        replicas = await start_replicas(config, n, "127.0.0.1", port)
        started.extend(replicas)
        return replicas

    yield start
    for replica in started:
        await replica.close()


@pytest.fixture
async def sim_url(start_sim: StartSim) -> str:
    (replica,) = await start_sim()
    return replica.url


@pytest.fixture
def make_sim_config() -> Callable[..., SimConfig]:
    """`fast_sim_config` as a fixture, for tests that build a config before starting."""
    return fast_sim_config


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int,
                            config: pytest.Config) -> None:
    """The real parts this machine lacks and how to install them (tests/real_parts.py)."""
    report_missing_parts(terminalreporter)
