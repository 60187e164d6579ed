"""Plumbing of the conformance suite: tests that meet vLLM's own server, not the simulator.

    pytest tests/conformance --real-vllm=start
        install (once; cached in $SIDECAR_VLLM_HOME) and start a real vLLM on a free port,
        stop it when the session ends
    pytest tests/conformance --real-vllm=http://127.0.0.1:8000
        use a server already running (`sidecar vllm up --tool-calls`: the tool-call cases
        need a tool parser)

Every test in this directory is marked ``realvllm``. Without ``--real-vllm`` they are
deselected (the summary says so and how to run them): the normal suite needs no vLLM. With
it, a server that cannot be installed, started or reached makes every test here ERROR with
the reason; nothing is ever skipped.

Tests take the session fixture ``real_vllm`` (a `real_server.RealVLLM`: base_url, model,
version); real_server.py also has raw-HTTP helpers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.realvllm import Home, RealVLLMError, ServerHandle, start_server
from sidecar.realvllm.server import TOOL_CALL_ARGS, free_port

from .real_server import RealVLLM, describe_server

HERE = Path(__file__).resolve().parent
MARKER = "realvllm"
_DESELECTED = pytest.StashKey[int]()
HOW_TO_RUN = (
    "pytest tests/conformance --real-vllm=start (or --real-vllm=URL of a server "
    "from `sidecar vllm up`); see docs/real-vllm.md"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(MARKER)
    if config.getoption("real_vllm", default=None):
        return
    kept = [item for item in items if item.get_closest_marker(MARKER) is None]
    dropped = [item for item in items if item.get_closest_marker(MARKER) is not None]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    config.stash[_DESELECTED] = len(dropped)


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    count = config.stash.get(_DESELECTED, 0)
    if count:
        terminalreporter.write_line(
            f"{count} conformance test{'s' if count > 1 else ''} against a real vLLM not run: "
            f"{HOW_TO_RUN}"
        )


@pytest.fixture(scope="session")
def real_vllm(request: pytest.FixtureRequest) -> Iterator[RealVLLM]:
    value = request.config.getoption("real_vllm", default=None)
    if not value:
        pytest.fail(f"no real vLLM given: {HOW_TO_RUN}", pytrace=False)
    handle: ServerHandle | None = None
    failure: str | None = None
    otlp_port = request.config.getoption("real_vllm_otlp_port", default=None)
    try:
        if value == "start":
            otlp_port = free_port()
            # With a tool parser, as CI starts it (.ci/run: `sidecar vllm up --tool-calls`).
            handle = start_server(
                free_port(),
                extra_args=TOOL_CALL_ARGS,
                home=Home.resolve(),
                otlp_traces_endpoint=f"http://127.0.0.1:{otlp_port}/v1/traces",
            )
            base_url = handle.url
        elif value.startswith(("http://", "https://")):
            base_url = value.rstrip("/")
        else:
            raise RealVLLMError(
                f"--real-vllm={value}: give 'start' or a base URL (http://HOST:PORT)"
            )
        server = describe_server(base_url)
    except (RealVLLMError, OSError) as exc:
        failure = str(exc)
        if handle is not None:
            handle.stop()
    if failure is not None:  # outside the except: the reason alone, no exception chain
        pytest.fail(f"real vLLM unavailable: {failure}", pytrace=False)
    try:
        yield RealVLLM(server.base_url, server.model, server.version, handle, otlp_port)
    finally:
        if handle is not None:
            handle.stop()
