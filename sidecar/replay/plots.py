"""Sweep plots (PNG, matplotlib's Agg backend) and a self-contained HTML page.

matplotlib is imported only here, and only when a report is drawn: it is in the `report`
extra, not needed to measure or replay.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sidecar.replay.sweep import Table, capacity_text, knee_text, step_tables

FIGSIZE = (8.0, 4.5)
DPI = 100  # 800 x 450 pixels


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError("plots need matplotlib: pip install 'vllm-sidecar[report]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def capacity_label(capacity: float, lower_bound: bool) -> str:
    return f"capacity >= {capacity:g} (no step failed)" if lower_bound else f"capacity {capacity:g}"


def _figure() -> tuple[Any, Any, Any]:
    """pyplot, and a new figure of the report's size with its axes."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    return plt, fig, ax


def _mark_capacity(ax: Any, capacity: float | None, lower_bound: bool) -> None:
    """The capacity as a vertical line, when there is one."""
    if capacity is not None:
        ax.axvline(
            capacity, color="green", linestyle="-.", label=capacity_label(capacity, lower_bound)
        )


def _mark_knee(ax: Any, knee_load: float, loads: list[Any], goodput: list[Any]) -> None:
    # A marker on the goodput curve, not a second vertical line: at the capacity's load a
    # line would hide behind the capacity's.
    at = next((g for load, g in zip(loads, goodput, strict=True) if load == knee_load), None)
    if at is not None:
        ax.plot(
            [knee_load],
            [at],
            "*",
            color="red",
            markersize=14,
            zorder=5,
            label=f"knee {knee_load:g} (highest goodput)",
        )


def _save(plt: Any, fig: Any, path: Path) -> Path:
    """The figure written to ``path`` (and closed)."""
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_latency(
    steps: Sequence[Mapping[str, Any]],
    unit: str,
    path: Path,
    capacity: float | None,
    lower_bound: bool = False,
) -> Path:
    plt, fig, ax = _figure()
    loads = [s["load"] for s in steps]
    for metric, style in (("ttft", "-"), ("tpot", "--"), ("e2el", ":")):
        for q, marker in (("p50", "o"), ("p90", "s"), ("p99", "^")):
            values = [s["report"].get(f"{q}_{metric}_ms") for s in steps]
            points = [(x, y) for x, y in zip(loads, values, strict=True) if y]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, style, marker=marker, label=f"{metric.upper()} {q}")
    _mark_capacity(ax, capacity, lower_bound)
    ax.set_yscale("log")
    ax.set_xlabel(f"load ({unit}, nominal)")
    ax.set_ylabel("latency (ms, client vantage)")
    ax.set_title("Latency percentiles vs load")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    return _save(plt, fig, path)


def plot_throughput(
    steps: Sequence[Mapping[str, Any]],
    unit: str,
    path: Path,
    capacity: float | None,
    knee_load: float | None,
    lower_bound: bool = False,
) -> Path:
    plt, fig, ax = _figure()
    loads = [s["load"] for s in steps]
    ax.plot(
        loads,
        [s["report"]["request_throughput"] for s in steps],
        "o-",
        label="throughput (completed req/s)",
    )
    ax.plot(
        loads,
        [s.get("achieved_rate") or 0.0 for s in steps],
        "x--",
        label="achieved (completion rate, req/s)",
    )
    goodput = [s["report"].get("request_goodput") or 0.0 for s in steps]
    ax.plot(loads, goodput, "s-", label="goodput (req/s meeting the SLO)")
    if unit == "req/s":
        top = max(loads) if loads else 1.0
        ax.plot([0, top], [0, top], color="grey", alpha=0.4, label="nominal load (y = x)")
        ax.plot(
            loads,
            [s.get("offered") or 0.0 for s in steps],
            "+",
            color="grey",
            markersize=10,
            label="offered (the rate really sent, req/s)",
        )
    _mark_capacity(ax, capacity, lower_bound)
    if knee_load is not None:
        _mark_knee(ax, knee_load, loads, goodput)
    ax.set_xlabel(f"load ({unit}, nominal)")
    ax.set_ylabel("requests / s")
    ax.set_title("Goodput and throughput vs load")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def plot_scatter(points: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """One dot per request: its E2E latency against when it was sent, coloured by load step."""
    plt, fig, ax = _figure()
    loads = sorted({p["load"] for p in points})
    for load in loads:
        mine = [p for p in points if p["load"] == load and p.get("e2e_ms") is not None]
        if mine:
            ax.scatter(
                [p["sent_s"] for p in mine], [p["e2e_ms"] for p in mine], s=4, label=f"{load:g}"
            )
    ax.set_xlabel("send instant (s since the step's start)")
    ax.set_ylabel("E2E latency (ms)")
    ax.set_yscale("log")
    ax.set_title("Per-request latency, by load step")
    ax.grid(True, which="both", alpha=0.3)
    if loads:
        ax.legend(fontsize=6, ncol=4, title="load")
    return _save(plt, fig, path)


def html_table(table: Table) -> str:
    """A step table as HTML: the same rows, names and units as the console's."""
    head = "".join(
        f"<th>{html.escape(c.title)}<br><small>{html.escape(c.unit)}</small></th>"
        for c in table.columns
    )
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>"
        for row in table.rows
    )
    return (
        f"<table><caption>{html.escape(table.title)}</caption><thead><tr>{head}</tr>"
        f"</thead><tbody>{rows}</tbody></table>"
    )


def html_page(result: Mapping[str, Any], images: Sequence[Path], path: Path) -> Path:
    """Everything on one page: images inlined as data URIs, no external resources. The step
    tables are those `sidecar sweep` prints (`sweep.step_tables`)."""
    tables = step_tables(result)
    figures = "".join(
        f'<figure><img alt="{html.escape(p.stem)}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}"></figure>'
        for p in images
    )
    failures = "".join(f"<li>{html.escape(line)}</li>" for line in tables.failures)
    failed = f"<h2>Failed steps</h2><ul>{failures}</ul>" if failures else ""
    legend = "".join(
        f"<dt>{html.escape(names)}</dt><dd>{html.escape(definition)}</dd>"
        for names, definition in tables.legend()
    )
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>sidecar sweep</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:2px 6px;font-size:12px;text-align:right}}
caption{{text-align:left;font-weight:bold}}img{{max-width:100%}}dt{{font-weight:bold}}</style>
</head><body>
<h1>Capacity under SLO</h1>
<p id="capacity"><b>{html.escape(capacity_text(result))}</b></p>
<p id="knee">{html.escape(knee_text(result))}</p>
<p id="criteria">criteria: {html.escape(str(result["criteria"]))}</p>
{"".join(html_table(table) for table in tables.tables)}
{failed}
<h2>Columns</h2><dl>{legend}</dl>
{figures}
<h2>Workload envelope</h2><pre>{
        html.escape(json.dumps(result["envelope"], indent=2, default=str))
    }</pre>
<h2>Definitions</h2><pre>{html.escape(json.dumps(result["definitions"], indent=2))}</pre>
</body></html>
"""
    path.write_text(page)
    return path
