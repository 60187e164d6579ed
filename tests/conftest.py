"""Shared fixtures: simulated vLLM replicas on ephemeral 127.0.0.1 ports.

``start_sim(config=None, n=1, **overrides)`` starts ``n`` replicas (a fast engine by default:
1 ms steps) and returns them; every replica started through it is closed at teardown.
``sim_url`` is the base URL of one such replica with the defaults.

Every test runs with blocking calls on the event loop forbidden (`no_blocking_calls`, as
aiohttp's own suite does with blockbuster): a call that would block the loop (file I/O,
``time.sleep``, a blocking socket or lock, a subprocess wait), made with the loop running and
the proxy's or the replay sender's code on the stack, fails the test that made it.

At the end of every run, the real parts (programs and packages some tests run as they run in
production) missing on this machine are named, with the command that installs them: without
them those tests skip, which a plain `pytest` shows only as a count.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import blockbuster.blockbuster
import pytest
import uvloop
from blockbuster import BlockBuster
from real_parts import report_missing_parts

from sidecar import _compiled
from sidecar.sim.engine import EngineConfig
from sidecar.sim.server import RunningReplica, SimConfig, start_replicas

# Tiny step time so that tests exercise the real engine loop in milliseconds.
FAST_ENGINE = EngineConfig(step_floor_s=0.001)

StartSim = Callable[..., Awaitable[list[RunningReplica]]]


def pytest_sessionstart(session: pytest.Session) -> None:
    # A compiled module older than its source would be tested instead of the source: stop.
    stale = _compiled.stale_extensions()
    if stale:
        pytest.exit(
            "compiled modules older than their source, or left from an earlier build: "
            f"{', '.join(stale)}; rebuild with `pip install -e . --no-deps` (setup.py)",
            returncode=4,
        )


def pytest_addoption(parser: pytest.Parser) -> None:
    # The conformance suite's option (tests/conformance/conftest.py), registered here because
    # pytest accepts only options of the conftests it reads before collecting: this way
    # `pytest --real-vllm=...` works from the repository root as well as on tests/conformance.
    parser.addoption(
        "--real-vllm",
        metavar="start|URL",
        default=None,
        help="run tests/conformance against a real vLLM: 'start' brings one up with `sidecar "
        "vllm` (cached in $SIDECAR_VLLM_HOME) and stops it at the end; a base URL uses a "
        "server already running (`sidecar vllm up`)",
    )
    parser.addoption(
        "--real-vllm-otlp-port",
        metavar="PORT",
        type=int,
        default=None,
        help="with --real-vllm=URL: the port on 127.0.0.1 that server exports its spans to "
        "(`sidecar vllm up --otlp-traces-endpoint http://127.0.0.1:PORT/v1/traces`); the "
        "tracing test listens there. --real-vllm=start arranges it itself",
    )


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """How many processes `-n auto` (pyproject.toml's addopts) runs the suite in: one per core
    this process may use, at most 4 (a test often runs a simulator, a sidecar and a client
    process of its own), and none besides pytest itself on one core. The conformance suite
    (--real-vllm) runs in one process: its tests share one real vLLM, which busy-spins two
    cores by itself."""
    if config.getoption("real_vllm") is not None:
        return 0
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    return 0 if cores < 2 else min(cores, 4)


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    """Every async test runs on uvloop, the loop `sidecar` itself runs on: the data path's
    Protocols and transports are tested as they serve traffic."""
    return {"uvloop": uvloop.new_event_loop}


class _RecordedBlockingError(blockbuster.blockbuster.BlockingError):
    """blockbuster's error, also kept in `_BLOCKING_CALLS` when raised: the relay runs in
    transport callbacks, whose exceptions go to the loop's handler (logged, not raised in the
    test), and a failing sink is counted and skipped; the fixture fails the test anyway."""

    def __init__(self, func: str) -> None:
        super().__init__(func)
        _BLOCKING_CALLS.append(f"{func}\n{''.join(traceback.format_stack(limit=30)[:-1])}")


_BLOCKING_CALLS: list[str] = []
# blockbuster raises the module's global by name: ours takes its place, for every test.
blockbuster.blockbuster.BlockingError = _RecordedBlockingError  # type: ignore[misc]

# Where a blocking call fails the test: when one of these is on the stack, i.e. the code that
# serves or sends measured traffic, in the loop that also stamps it. Not scanned: the
# simulator (the stand-in for vLLM, not what is measured) and the commands (replay, sweep,
# trace tools, plots, the real-vLLM manager), which read their inputs and write their reports
# before and after the traffic, in a loop that has nothing else to do then.
SCANNED = [
    "sidecar.proxy",
    "sidecar.meter",
    "sidecar.protocol",
    "sidecar.hooks",
    "sidecar.sinks",
    "sidecar.stats",
    "sidecar.record",
    "sidecar.engine_metrics",
    "sidecar.replay.runner",
    "sidecar.replay.live",
]
# The proxy worker is a process of its own: no test loop runs there.
_BLOCKBUSTER = BlockBuster(SCANNED, excluded_modules=["sidecar.proxy.worker"])

# Allowed, each for its reason (a call site added here is one the owners have judged):
# - Start-up: the proxy, its collector and sinks are built (files checked, keys read, the OTel
#   resource detected) before the listener takes its first connection; a replay's live
#   counters (shared memory) before its first request.
# - Logging: records go to stderr by design, a line per event (--log-requests: per request);
#   moving them off the loop (a QueueHandler) is for the logging setup, not for the tests.
# - The worker pool starting a worker process (collector._spawn: fork+exec, at start-up and
#   when a worker died).
# - Finalizers the garbage collector runs wherever it happens to be (an earlier test's
#   multiprocessing semaphore telling the resource tracker it is gone): not the code on the
#   stack, and not the test's doing.
_ALLOWED_IN = [
    ("sidecar/serve.py", {"build_proxy_server", "build_collector"}),
    ("sidecar/sinks/otel.py", {"build_otel_sink"}),
    ("sidecar/replay/live.py", {"__init__"}),
    ("logging/__init__.py", {"emit", "flush", "handleError"}),
    ("sidecar/proxy/collector.py", {"_spawn"}),
    ("multiprocessing/util.py", {"__call__"}),
]
for _function in _BLOCKBUSTER.functions.values():
    for _file, _names in _ALLOWED_IN:
        _function.can_block_in(_file, _names)


def _except(function: str, allowed: Callable[..., bool]) -> None:
    """Allow ``function``'s calls for which ``allowed(*args)`` holds, besides blockbuster's own
    exceptions (a non-blocking file or socket)."""
    wrapped = _BLOCKBUSTER.functions[function]
    theirs = wrapped.can_block_predicate
    wrapped.can_block_predicate = lambda *a, **k: allowed(*a, **k) or theirs(*a, **k)


def _in_procfs(target: Any = None, *_: Any, **__: Any) -> bool:
    # /proc is the kernel's memory, never a disk: prometheus-client's process metrics read it
    # on each scrape of /metrics (in the loop when the proxy has no worker processes).
    name = getattr(target, "name", target)
    return isinstance(name, (str, bytes)) and str(name).startswith("/proc/")


for _function_name in ("io.BufferedReader.read", "io.TextIOWrapper.read", "os.listdir", "os.stat"):
    _except(_function_name, _in_procfs)


FONT_SUFFIXES = (".ttf", ".otf", ".ttc", ".afm", ".pfb")


def _a_font(target: Any = None, *_: Any, **__: Any) -> bool:
    # Matplotlib's text rendering (a sweep's plots, written after its traffic) reads glyphs
    # from the font file through a Python file object: thousands of small reads per figure,
    # each of which would otherwise walk the whole stack. No measured code reads a font, and
    # plots are not scanned anyway (see SCANNED): allowing these reads up front only saves that
    # walk (about 2/3 of a sweep's plotting time in tests).
    name = getattr(target, "name", None)
    return isinstance(name, str) and name.lower().endswith(FONT_SUFFIXES)


_except("io.BufferedReader.read", _a_font)
# time.sleep(0) gives up the GIL to the loop's thread and returns: it never waits.
_except("time.sleep", lambda seconds=None, *_, **__: seconds == 0)


@pytest.fixture(autouse=True)
def no_blocking_calls() -> Iterator[None]:
    """Fail a test during which the measured code blocked the event loop.

    The mechanism is blockbuster, as aiohttp's suite uses it: while the fixture is active,
    time.sleep, reads and writes of files, os.stat and friends, blocking socket and lock
    calls raise when made on a thread whose loop is running with a `SCANNED` module on the
    stack. A test's own file reads and writes (its setup, its assertions) are not the code
    under test and are not scanned; threads (the capture writer, the OTel exporter) and
    subprocesses have no running loop.

    Why this and not ``loop.slow_callback_duration``: it names the call, however short, and
    needs no threshold, so it cannot trip on scheduling noise on 2 shared CI cores (a
    wall-clock threshold cannot tell a descheduled process from a blocked loop); and uvloop
    times callbacks only in debug mode, which takes a stack trace at every handle (slowing the
    data path the timing tests measure) and never times the transport callbacks the relay
    runs in."""
    del _BLOCKING_CALLS[:]
    _BLOCKBUSTER.activate()
    try:
        yield
    finally:
        _BLOCKBUSTER.deactivate()
    if _BLOCKING_CALLS:
        calls = "\n".join(_BLOCKING_CALLS)
        del _BLOCKING_CALLS[:]
        pytest.fail(f"blocking call(s) on the event loop:\n{calls}", pytrace=False)


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


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """The real parts this machine lacks and how to install them (tests/real_parts.py)."""
    report_missing_parts(terminalreporter)
