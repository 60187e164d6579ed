"""The one front door: ``sidecar <command> ...``.

Each command lives in its own module, which exposes ``add_arguments(parser)`` and an async
``run(args) -> int``; this file only wires them up and owns the event loop (uvloop when present).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from sidecar import __version__

AsyncCommand = Callable[[argparse.Namespace], Awaitable[int]]

EPILOG = """\
examples:
  sidecar sim --replicas 2 --port 8100 --model demo-model
      serve two simulated vLLM replicas on 127.0.0.1:8100 and :8101

run 'sidecar COMMAND --help' for a command's options and examples.
"""


def run_coroutine(command: AsyncCommand, args: argparse.Namespace) -> int:
    """Run an async command on uvloop when it is installed (it is, except on Windows)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - Windows, or a stripped install
        return asyncio.run(command(args))
    return uvloop.run(command(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sidecar",
        description=(
            "A measurement sidecar for vLLM: it relays OpenAI-compatible traffic and times every "
            "streamed chunk on both sides of itself (client-visible and server-side TTFT, ITL, "
            "TPOT, E2E, goodput under SLOs)."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"sidecar {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    from sidecar.sim import cli as sim_cli

    sim_parser = commands.add_parser(
        "sim",
        help="serve simulated vLLM replicas (no GPU) that speak vLLM's protocol and /metrics",
        description=sim_cli.DESCRIPTION,
        epilog=sim_cli.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sim_cli.add_arguments(sim_parser)
    sim_parser.set_defaults(handler=sim_cli.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Any = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return run_coroutine(handler, args)
    except KeyboardInterrupt:
        return 130
