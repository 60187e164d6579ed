"""Replay: trace importers, trace tools (lint, stats), schedules and the open-loop runner; a
whole replay (session.py) and a sweep (sweep_session.py) as library calls, from their options
(options.py), which the commands (`*_cli.py`) only parse, call and print around.

This package may import only ``sidecar.protocol``, ``sidecar.tracefile``, ``sidecar.record``,
``sidecar.stats`` and ``sidecar.clock`` (design.md); never ``sidecar.proxy`` or ``sidecar.sim``.
"""
