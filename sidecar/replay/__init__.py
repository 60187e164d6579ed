"""Replay: trace importers, trace tools (lint, stats), schedules and the open-loop runner.

This package may import only ``sidecar.protocol``, ``sidecar.tracefile``, ``sidecar.record``,
``sidecar.stats`` and ``sidecar.clock`` (design.md); never ``sidecar.proxy`` or ``sidecar.sim``.
"""
