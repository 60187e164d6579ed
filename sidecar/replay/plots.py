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


def plot_latency(steps: Sequence[Mapping[str, Any]], unit: str, path: Path,
                 capacity: float | None) -> Path:
    plt = _pyplot()
    loads = [s["load"] for s in steps]
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    for metric, style in (("ttft", "-"), ("tpot", "--"), ("e2el", ":")):
        for q, marker in (("p50", "o"), ("p90", "s"), ("p99", "^")):
            values = [s["report"].get(f"{q}_{metric}_ms") for s in steps]
            points = [(x, y) for x, y in zip(loads, values, strict=True) if y]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, style, marker=marker, label=f"{metric.upper()} {q}")
    if capacity is not None:
        ax.axvline(capacity, color="green", linestyle="-.", label=f"capacity {capacity:g}")
    ax.set_yscale("log")
    ax.set_xlabel(f"offered load ({unit})")
    ax.set_ylabel("latency (ms, client vantage)")
    ax.set_title("Latency percentiles vs offered load")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_throughput(steps: Sequence[Mapping[str, Any]], unit: str, path: Path,
                    capacity: float | None, knee_load: float | None) -> Path:
    plt = _pyplot()
    loads = [s["load"] for s in steps]
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    ax.plot(loads, [s["report"]["request_throughput"] for s in steps], "o-",
            label="throughput (completed req/s)")
    ax.plot(loads, [s.get("achieved_rate") or 0.0 for s in steps], "x--",
            label="completion rate (req/s)")
    goodput = [s["report"].get("request_goodput") or 0.0 for s in steps]
    ax.plot(loads, goodput, "s-", label="goodput (req/s meeting the SLO)")
    if unit == "req/s":
        top = max(loads) if loads else 1.0
        ax.plot([0, top], [0, top], color="grey", alpha=0.4, label="offered")
    if knee_load is not None:
        ax.axvline(knee_load, color="red", linestyle=":", label=f"knee {knee_load:g}")
    if capacity is not None:
        ax.axvline(capacity, color="green", linestyle="-.", label=f"capacity {capacity:g}")
    ax.set_xlabel(f"offered load ({unit})")
    ax.set_ylabel("requests / s")
    ax.set_title("Goodput and throughput vs offered load")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_scatter(points: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """One dot per request: its E2E latency against when it was sent, coloured by load step."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    loads = sorted({p["load"] for p in points})
    for load in loads:
        mine = [p for p in points if p["load"] == load and p.get("e2e_ms") is not None]
        if mine:
            ax.scatter([p["sent_s"] for p in mine], [p["e2e_ms"] for p in mine], s=4,
                       label=f"{load:g}")
    ax.set_xlabel("send instant (s since the step's start)")
    ax.set_ylabel("E2E latency (ms)")
    ax.set_yscale("log")
    ax.set_title("Per-request latency, by load step")
    ax.grid(True, which="both", alpha=0.3)
    if loads:
        ax.legend(fontsize=6, ncol=4, title="load")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def html_page(result: Mapping[str, Any], images: Sequence[Path], path: Path) -> Path:
    """Everything on one page: images inlined as data URIs, no external resources."""
    # The sidecar's server vantage (sweep --sidecar-admin) and the engines' prefix-cache hit
    # ratio get columns only when some step has them.
    with_sidecar = any(step.get("sidecar") for step in result["steps"])
    with_cache = any((step.get("engine_delta") or {}).get("prefix_cache_hit_rate") is not None
                     for step in result["steps"])
    rows = []
    for step in result["steps"]:
        r = step["report"]
        cells: list[Any] = [
            step["load"], f"{step.get('achieved_rate') or 0:.2f}",
            r.get("max_concurrent_requests"), _fmt(r.get("p50_ttft_ms")),
            _fmt(r.get("p99_ttft_ms")), _fmt(r.get("p50_tpot_ms")),
            _fmt(r.get("p99_tpot_ms")), _fmt(r.get("p99_itl_ms")),
            _fmt(r.get("p99_e2el_ms"))]
        if with_sidecar:
            cells += _sidecar_cells(step.get("sidecar"))
        cells += [r["completed"], r["failed"],
                  _fmt(r.get("request_goodput")), _fmt(r.get("slo_attainment")),
                  _fmt((r.get("lateness_ms") or {}).get("p99"))]
        if with_cache:
            cells.append(_fmt((step.get("engine_delta") or {}).get("prefix_cache_hit_rate")))
        cells.append("pass" if step["passed"] else "fail: " + "; ".join(step["reasons"]))
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(cell))}</td>" for cell in cells)
                    + "</tr>")
    sidecar_heads = ("<th>server TTFT p50</th><th>server TTFT p99</th><th>server TPOT p50</th>"
                     "<th>server E2E p99</th><th>sidecar seen/sent</th>"
                     if with_sidecar else "")
    cache_head = "<th>engine cache hit</th>" if with_cache else ""
    figures = "".join(
        f'<figure><img alt="{html.escape(p.stem)}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}"></figure>' for p in images)
    capacity = result.get("capacity")
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>sidecar sweep</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 6px;font-size:12px}}img{{max-width:100%}}</style>
</head><body>
<h1>Capacity under SLO</h1>
<p id="capacity"><b>capacity: {html.escape(str(capacity))} {html.escape(result['unit'])}</b>
 &mdash; {html.escape(result['criteria'])}; knee at {html.escape(str(result.get('knee')))}</p>
<table><thead><tr><th>load</th><th>achieved/s</th><th>max conc.</th><th>TTFT p50</th>
<th>TTFT p99</th><th>TPOT p50</th><th>TPOT p99</th><th>ITL p99</th><th>E2E p99</th>
{sidecar_heads}<th>ok</th><th>failed</th><th>goodput/s</th><th>attainment</th>
<th>lateness p99</th>{cache_head}<th>verdict</th></tr></thead><tbody>{''.join(rows)}</tbody>
</table>
<p>Latencies in ms; the first ones are the replayer's (client vantage), the server ones the
sidecar's (from the request sent upstream), for the same requests.</p>
{figures}
<h2>Workload envelope</h2><pre>{html.escape(json.dumps(result['envelope'], indent=2,
                                                         default=str))}</pre>
<h2>Definitions</h2><pre>{html.escape(json.dumps(result['definitions'], indent=2))}</pre>
</body></html>
"""
    path.write_text(page)
    return path


def _sidecar_cells(view: Mapping[str, Any] | None) -> list[str]:
    if not view:
        return ["-"] * 5
    server = view["vantages"]["server"]
    return [_fmt(server["ttft_ms"].get("p50")), _fmt(server["ttft_ms"].get("p99")),
            _fmt(server["tpot_ms"].get("p50")), _fmt(server["e2e_ms"].get("p99")),
            f"{view['requests_seen']}/{view['requests_sent']}"]


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)
