"""Write the sidecar's Grafana dashboards: ``python grafana/generate.py`` (standard library only).

The JSON in grafana/dashboards/ is what Grafana provisions; this file is where it is edited.
tests/test_dashboards.py fails when the two differ, checks the dashboards' structure, and runs
every query below on a real Prometheus scraping a sidecar and simulated vLLM replicas.

Label conventions the queries rely on:
- the sidecar's series: ``model``, ``replica`` (its upstream's host:port, rewritten at scrape
  time to the name vLLM's series get, see docs/deploy.md), ``vantage``, ``slo_class``;
- vLLM's series: ``model_name`` and ``engine`` from vLLM, plus ``replica`` added by
  Prometheus's relabeling (deploy/compose/prometheus/*.yml, deploy/kubernetes/base/
  podmonitor-vllm.yaml). Panels that show both join on ``replica``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE / "dashboards"

DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'model=~"$model", replica=~"$replica"'
VLLM_SEL = 'model_name=~"$model", replica=~"$replica"'
CLASS_SEL = 'slo_class=~"$slo_class"'
RATE = "$__rate_interval"
QUANTILES = (("0.5", "p50"), ("0.9", "p90"), ("0.99", "p99"))
TOKENS_PER_S = "suffix: tok/s"

Panel = dict[str, Any]


# --- queries ---------------------------------------------------------------------------------

def quantile(q: str, metric: str, selector: str, by: str = "", window: str = RATE) -> str:
    group = f"le, {by}" if by else "le"
    return (f"histogram_quantile({q}, sum by ({group}) "
            f"(rate({metric}_bucket{{{selector}}}[{window}])))")


def mean(metric: str, selector: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return (f"sum{group} (rate({metric}_sum{{{selector}}}[{RATE}])) / "
            f"sum{group} (rate({metric}_count{{{selector}}}[{RATE}]))")


def attainment(window: str) -> str:
    """Good / all per SLO class; a class with no good request yet reads 0, not nothing."""
    good = f"sum by (slo_class) (rate(sidecar_slo_good_requests_total{{{CLASS_SEL}}}[{window}]))"
    every = f"sum by (slo_class) (rate(sidecar_slo_requests_total{{{CLASS_SEL}}}[{window}]))"
    return f"({good} or 0 * {every}) / {every}"


def burn_rate(window: str) -> str:
    return f"(1 - ({attainment(window)})) / (1 - $objective)"


def target(expr: str, legend: str = "", *, instant: bool = False, fmt: str = "time_series",
           ref: str = "A") -> dict[str, Any]:
    return {"datasource": DS, "refId": ref, "expr": expr, "legendFormat": legend,
            "range": not instant, "instant": instant, "format": fmt, "editorMode": "code"}


def targets(*pairs: tuple[str, str], **kw: Any) -> list[dict[str, Any]]:
    return [target(expr, legend, ref=chr(ord("A") + i), **kw)
            for i, (expr, legend) in enumerate(pairs)]


# --- panels ----------------------------------------------------------------------------------

def timeseries(title: str, description: str, unit: str, queries: list[dict[str, Any]], *,
               stack: bool = False, minimum: float | None = 0, maximum: float | None = None,
               thresholds: list[tuple[float, str]] | None = None, w: int = 12,
               h: int = 8) -> Panel:
    defaults: dict[str, Any] = {
        "unit": unit,
        "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if stack else 0,
                   "showPoints": "never", "spanNulls": False,
                   "stacking": {"mode": "normal" if stack else "none", "group": "A"},
                   "thresholdsStyle": {"mode": "line" if thresholds else "off"}},
        "thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None}] + [
            {"color": color, "value": value} for value, color in thresholds or []]},
    }
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    return {"type": "timeseries", "title": title, "description": description, "datasource": DS,
            "targets": queries, "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "table", "placement": "bottom",
                                   "calcs": ["mean", "max", "lastNotNull"], "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}},
            "gridPos": {"w": w, "h": h}}


def stat(title: str, description: str, unit: str, queries: list[dict[str, Any]], *,
         steps: list[tuple[float | None, str]] | None = None, w: int = 6, h: int = 5) -> Panel:
    steps = steps or [(None, "blue")]
    return {"type": "stat", "title": title, "description": description, "datasource": DS,
            "targets": queries,
            "fieldConfig": {"defaults": {
                "unit": unit, "decimals": 2,
                "thresholds": {"mode": "absolute", "steps": [
                    {"color": color, "value": value} for value, color in steps]}},
                "overrides": []},
            "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "",
                                          "values": False},
                        "colorMode": "background", "graphMode": "none", "textMode": "auto",
                        "orientation": "auto", "justifyMode": "auto"},
            "gridPos": {"w": w, "h": h}}


def heatmap(title: str, description: str, unit: str, metric: str, selector: str,
            w: int = 12, h: int = 8) -> Panel:
    expr = f"sum by (le) (increase({metric}_bucket{{{selector}}}[{RATE}]))"
    return {"type": "heatmap", "title": title, "description": description, "datasource": DS,
            "targets": [target(expr, "{{le}}", fmt="heatmap")],
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"calculate": False, "cellGap": 1,
                        "yAxis": {"axisPlacement": "left", "unit": unit},
                        "rowsFrame": {"layout": "auto"},
                        "color": {"mode": "scheme", "scheme": "Oranges", "fill": "dark-orange",
                                  "scale": "exponential", "exponent": 0.5, "steps": 64},
                        "cellValues": {"unit": "short"},
                        "tooltip": {"mode": "single", "yHistogram": True, "showColorScale": True},
                        "legend": {"show": True}},
            "gridPos": {"w": w, "h": h}}


def table(title: str, description: str, queries: list[dict[str, Any]],
          columns: dict[str, tuple[str, str]], w: int = 24, h: int = 8) -> Panel:
    """Instant queries merged on their labels into one row per label set; ``columns`` maps a
    query's value field ("Value #A") to (header, unit)."""
    overrides = [{"matcher": {"id": "byName", "options": field},
                  "properties": [{"id": "displayName", "value": header},
                                 {"id": "unit", "value": unit}]}
                 for field, (header, unit) in columns.items()]
    return {"type": "table", "title": title, "description": description, "datasource": DS,
            "targets": queries,
            "fieldConfig": {"defaults": {"unit": "short", "decimals": 3}, "overrides": overrides},
            "options": {"showHeader": True, "cellHeight": "sm"},
            "transformations": [
                {"id": "merge", "options": {}},
                {"id": "organize", "options": {"excludeByName": {"Time": True}}}],
            "gridPos": {"w": w, "h": h}}


def text(title: str, content: str, w: int = 24, h: int = 7) -> Panel:
    return {"type": "text", "title": title,
            "options": {"mode": "markdown", "content": content.strip()},
            "gridPos": {"w": w, "h": h}}


def row(title: str) -> Panel:
    return {"type": "row", "title": title, "collapsed": False, "panels": [],
            "gridPos": {"w": 24, "h": 1}}


# --- variables -------------------------------------------------------------------------------

def datasource_variable() -> dict[str, Any]:
    return {"name": "datasource", "label": "Prometheus", "type": "datasource",
            "query": "prometheus", "current": {}, "hide": 0, "refresh": 1, "regex": "",
            "options": [], "includeAll": False, "multi": False}


def query_variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "query", "datasource": DS,
            "query": {"query": query, "refId": f"{name}-variable-query"}, "definition": query,
            "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "options": [], "sort": 1, "hide": 0, "regex": ""}


def custom_variable(name: str, label: str, values: list[str], default: str,
                    description: str) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "custom", "description": description,
            "query": ",".join(values),
            "current": {"selected": True, "text": default, "value": default},
            "options": [{"selected": v == default, "text": v, "value": v} for v in values],
            "includeAll": False, "multi": False, "hide": 0}


COMMON_VARIABLES = [
    datasource_variable(),
    query_variable("model", "Model", "label_values(sidecar_requests_total, model)"),
    query_variable("replica", "Replica",
                   'label_values(sidecar_requests_total{model=~"$model"}, replica)'),
    query_variable("slo_class", "SLO class",
                   "label_values(sidecar_slo_requests_total, slo_class)"),
]


# --- layout ----------------------------------------------------------------------------------

def lay_out(panels: list[Panel]) -> list[Panel]:
    """Left to right, top to bottom, in Grafana's 24-column grid; ids in order from 1."""
    x = y = row_height = 0
    out = []
    for number, panel in enumerate(panels, start=1):
        grid = panel["gridPos"]
        if panel["type"] == "row" or x + grid["w"] > 24:
            x, y, row_height = 0, y + row_height, 0
        panel = {"id": number, **panel, "gridPos": {"h": grid["h"], "w": grid["w"], "x": x,
                                                   "y": y}}
        x += grid["w"]
        row_height = max(row_height, grid["h"])
        if panel["type"] == "row":
            x, y, row_height = 0, y + 1, 0
        out.append(panel)
    return out


def dashboard(uid: str, title: str, description: str, panels: list[Panel],
              variables: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "uid": uid, "title": title, "description": description,
        "tags": ["vllm", "vllm-sidecar"], "timezone": "browser", "editable": True,
        "graphTooltip": 1, "schemaVersion": 39, "version": 1, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"}, "fiscalYearStartMonth": 0, "liveNow": False,
        "weekStart": "",
        "links": [{"title": "vLLM sidecar", "type": "dashboards", "tags": ["vllm-sidecar"],
                   "asDropdown": True, "includeVars": True, "keepTime": True, "icon":
                   "external link", "targetBlank": False, "tooltip": "", "url": ""}],
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts", "type": "dashboard"}]},
        "templating": {"list": variables},
        "panels": lay_out(panels),
    }


# --- SLO compliance --------------------------------------------------------------------------

def slo_dashboard() -> dict[str, Any]:
    good_rate = f"sum by (slo_class) (rate(sidecar_slo_good_requests_total{{{CLASS_SEL}}}[{RATE}]))"
    all_rate = f"sum by (slo_class) (rate(sidecar_slo_requests_total{{{CLASS_SEL}}}[{RATE}]))"
    panels = [
        row("Attainment and goodput"),
        stat("Attainment over the time range",
             "Good requests / all requests of each SLO class over the dashboard's time range, "
             "all sidecars together. Good = succeeded and met every threshold of its class, "
             "measured at the client side of the sidecar. Failures, timeouts, rejections and "
             "client cancellations count as not good.",
             "percentunit", targets((attainment("$__range"), "{{slo_class}}")),
             steps=[(None, "red"), (0.95, "orange"), (0.99, "green")], w=8),
        timeseries("Attainment per SLO class",
                   "Good / all per SLO class over each point's rate window, with the "
                   "attainment objective ($objective) as a line.",
                   "percentunit",
                   targets((attainment(RATE), "{{slo_class}}"),
                           ("vector($objective)", "objective")),
                   maximum=1, minimum=None, w=16),
        timeseries("Attainment over the live window (exact, per sidecar)",
                   "sidecar_window_slo_attainment: each sidecar's exact attainment over its "
                   "live window (60 s by default), computed from its records at scrape time. "
                   "Per sidecar: do not average these across sidecars; the panel above merges "
                   "the counters correctly.",
                   "percentunit",
                   targets((f"sidecar_window_slo_attainment{{{CLASS_SEL}}}",
                            "{{slo_class}} {{instance}}")),
                   maximum=1, minimum=None),
        timeseries("Goodput: good requests/s, and all requests/s",
                   "Requests per second that met their SLO class (solid) against every "
                   "request of the class (the goodput denominator).",
                   "reqps", targets((good_rate, "{{slo_class}} good"),
                                    (all_rate, "{{slo_class}} all"))),
        timeseries("Goodput in output tokens/s",
                   "Output tokens per second of the good requests, per SLO class, beside the "
                   "output tokens of every successful request of the selected models.",
                   TOKENS_PER_S,
                   targets((f"sum by (slo_class) (rate(sidecar_slo_good_generation_tokens_total"
                            f"{{{CLASS_SEL}}}[{RATE}]))", "{{slo_class}} good"),
                           (f"sum(rate(sidecar_generation_tokens_total{{{SEL}}}[{RATE}]))",
                            "all successful requests")), w=24),
        row("Error budget"),
        stat("Error budget remaining over $slo_window",
             "1 - (1 - attainment over $slo_window) / (1 - $objective): the share of the "
             "window's error budget not yet spent (negative: overspent). Needs $slo_window of "
             "data for the full picture.",
             "percentunit", targets((f"1 - (1 - ({attainment('$slo_window')})) / "
                                     "(1 - $objective)", "{{slo_class}}")),
             steps=[(None, "red"), (0.25, "orange"), (0.5, "green")], w=8),
        timeseries("Burn rate (1 = the budget lasts exactly the SLO window)",
                   "(1 - attainment) / (1 - $objective) over the alerts' windows. The page "
                   "alerts fire when both 1h and 5m exceed 14.4, or both 6h and 30m exceed 6 "
                   "(deploy/prometheus/sidecar-rules.yml, objective 0.99).",
                   "suffix:x",
                   targets((burn_rate("5m"), "{{slo_class}} 5m"),
                           (burn_rate("30m"), "{{slo_class}} 30m"),
                           (burn_rate("1h"), "{{slo_class}} 1h"),
                           (burn_rate("6h"), "{{slo_class}} 6h")),
                   thresholds=[(6, "orange"), (14.4, "red")], w=16),
        row("Outcomes"),
        timeseries("Requests by outcome",
                   "Every request through the sidecars of the selected models and replicas, "
                   "by how it ended: ok, http_error, upstream_error, timeout, client_cancelled, "
                   "rejected.",
                   "reqps",
                   targets((f"sum by (outcome) (rate(sidecar_requests_total{{{SEL}}}[{RATE}]))",
                            "{{outcome}}")), stack=True),
        timeseries("Share of requests that did not end ok",
                   "Per outcome other than ok, as a share of all requests. Empty while every "
                   "request succeeds.",
                   "percentunit",
                   targets((f'sum by (outcome) (rate(sidecar_requests_total{{outcome!="ok", '
                            f"{SEL}}}[{RATE}])) / scalar(sum(rate(sidecar_requests_total"
                            f"{{{SEL}}}[{RATE}])))", "{{outcome}}")), stack=True),
        table("Declared SLO thresholds",
              "sidecar_slo_threshold_seconds: what each SLO class demands, as the sidecars "
              "declare it (--slo, --slo-class, the ConfigMap's sidecar.toml).",
              targets((f"max by (slo_class, metric) (sidecar_slo_threshold_seconds"
                       f"{{{CLASS_SEL}}})", ""), instant=True, fmt="table"),
              {"Value": ("threshold", "s")}, h=7),
    ]
    variables = [*COMMON_VARIABLES,
                 custom_variable("objective", "Attainment objective",
                                 ["0.9", "0.95", "0.99", "0.995", "0.999"], "0.99",
                                 "Share of requests that must be good; the alerts use 0.99."),
                 custom_variable("slo_window", "SLO window", ["7d", "28d", "30d"], "30d",
                                 "Period the error budget is counted over.")]
    return dashboard("vllm-sidecar-slo", "vLLM sidecar / SLO compliance",
                     "Attainment, goodput, error budget and burn rate per SLO class, and "
                     "request outcomes, from the measurement sidecar.", panels, variables)


# --- Latency ---------------------------------------------------------------------------------

LATENCY_METRICS = (
    # key, title, sidecar histogram, SLO metric, vLLM's histogram, what vLLM's one measures
    ("ttft", "Time to first token", "sidecar_time_to_first_token_seconds", "ttft",
     "vllm:time_to_first_token_seconds",
     "vLLM's TTFT runs from the request's arrival in the API server to the engine step that "
     "produced the first token (queue and prefill included)."),
    ("itl", "Inter-token latency", "sidecar_inter_token_latency_seconds", None,
     "vllm:inter_token_latency_seconds",
     "vLLM's ITL is one sample per engine step that produced tokens for a request; the "
     "sidecar's is one per streamed event. Equal with --stream-interval 1 and no speculative "
     "decoding."),
    ("tpot", "Time per output token", "sidecar_time_per_output_token_seconds", "tpot",
     "vllm:request_time_per_output_token_seconds",
     "vLLM's TPOT is decode time / (output tokens - 1) per request, from engine timestamps."),
    ("e2e", "End-to-end latency", "sidecar_e2e_request_latency_seconds", "e2e",
     "vllm:e2e_request_latency_seconds",
     "vLLM's E2E runs from arrival to the request's finish in the engine."),
)


def latency_dashboard() -> dict[str, Any]:
    panels: list[Panel] = []
    for key, title, metric, slo_metric, vllm_metric, vllm_note in LATENCY_METRICS:
        name = key.upper()
        panels.append(row(f"{name}: {title.lower()}"))
        for vantage, where in (("client", "client side: what clients see, measured at the "
                                          "sidecar's client socket"),
                               ("server", "server side: from the request sent to the replica, "
                                          "measured at the sidecar's upstream socket")):
            queries = [(quantile(q, metric, f'vantage="{vantage}", {SEL}'), f"{label}")
                       for q, label in QUANTILES]
            if slo_metric is not None:
                queries.append((f'max by (slo_class) (sidecar_slo_threshold_seconds{{metric="'
                                f'{slo_metric}", {CLASS_SEL}}})', "SLO {{slo_class}}"))
            panels.append(timeseries(
                f"{name} {vantage} side: p50, p90, p99",
                f"{title}, {where}. Percentiles from the histograms of every sidecar merged "
                "(bucket resolution: neighbouring bounds at most 1.5x apart)"
                + (", with the declared SLO thresholds of the selected classes."
                   if slo_metric else "."),
                "s", targets(*queries)))
        for vantage in ("client", "server"):
            panels.append(heatmap(
                f"{name} distribution, {vantage} side",
                f"How many {'events' if key == 'itl' else 'requests'} fell in each bucket of "
                f"the {vantage}-side {title.lower()} histogram, per interval.",
                "s", metric, f'vantage="{vantage}", {SEL}'))
        client_mean = mean(metric, f'vantage="client", {SEL}')
        server_mean = mean(metric, f'vantage="server", {SEL}')
        panels.append(timeseries(
            f"{name} mean: client side minus server side",
            "Mean client-side minus mean server-side value: what lies between the client and "
            "the replica (the sidecar's own relay, the network to the replica, the replica's "
            "HTTP layer before the first byte). Means subtract; percentiles do not.",
            "s", targets((f"({client_mean}) - ({server_mean})", "client - server")),
            minimum=None))
        engine_queries = [
            (quantile("0.5", metric, f'vantage="server", {SEL}'), "sidecar server side p50"),
            (quantile("0.99", metric, f'vantage="server", {SEL}'), "sidecar server side p99"),
            (quantile("0.5", vllm_metric, VLLM_SEL), "vLLM p50"),
            (quantile("0.99", vllm_metric, VLLM_SEL), "vLLM p99"),
        ]
        if key in ("ttft", "tpot", "e2e"):
            engine_queries.append((quantile("0.99", metric, f'vantage="engine", {SEL}'),
                                   "per-request metrics p99 (vantage=engine)"))
        panels.append(timeseries(
            f"{name}: the sidecar's server side beside vLLM's own",
            f"The sidecar's server-side percentiles beside vLLM's {vllm_metric} for the same "
            f"models (model_name) and replicas. {vllm_note} vLLM's buckets are coarser than "
            "the sidecar's."
            + (" vantage=engine: the timings vLLM returns per request "
               "(--enable-per-request-metrics), when it does, over the same interval (TTFT and "
               "E2E from queued in the engine)." if key in ("ttft", "tpot", "e2e") else ""),
            "s", targets(*engine_queries)))
        panels.append(timeseries(
            f"{name} exact over the live window, per sidecar",
            "sidecar_window_latency_seconds: each sidecar's exact p50 and p99 (numpy) over its "
            "live window, both vantages. One sidecar each: never average these across "
            "sidecars.",
            "s", targets((f'sidecar_window_latency_seconds{{metric="{key}", quantile="0.5"}}',
                          "{{vantage}} p50 {{instance}}"),
                         (f'sidecar_window_latency_seconds{{metric="{key}", quantile="0.99"}}',
                          "{{vantage}} p99 {{instance}}"))))
    return dashboard("vllm-sidecar-latency", "vLLM sidecar / Latency",
                     "TTFT, ITL, TPOT and E2E percentiles from the measurement sidecar, client "
                     "side beside server side, as heatmaps, and beside vLLM's own.",
                     panels, list(COMMON_VARIABLES))


# --- Replicas --------------------------------------------------------------------------------

def replicas_dashboard() -> dict[str, Any]:
    server = f'vantage="server", {SEL}'
    in_flight = 'sum by (replica) (sidecar_in_flight_requests{replica=~"$replica"})'
    running = f"sum by (replica) (vllm:num_requests_running{{{VLLM_SEL}}})"
    waiting = f"sum by (replica) (vllm:num_requests_waiting{{{VLLM_SEL}}})"
    kv = f"max by (replica) (vllm:kv_cache_usage_perc{{{VLLM_SEL}}})"
    hit_rate = (f"sum by (replica) (rate(vllm:prefix_cache_hits_total{{{VLLM_SEL}}}[{RATE}])) / "
                f"sum by (replica) (rate(vllm:prefix_cache_queries_total{{{VLLM_SEL}}}[{RATE}]))")
    panels = [
        row("The sidecar's view of each replica"),
        timeseries("TTFT per replica, server side: p50 and p99",
                   "From the request sent to the replica to its first token, per replica.",
                   "s", targets((quantile("0.5", "sidecar_time_to_first_token_seconds", server,
                                          "replica"), "{{replica}} p50"),
                                (quantile("0.99", "sidecar_time_to_first_token_seconds", server,
                                          "replica"), "{{replica}} p99"))),
        timeseries("ITL per replica, server side: p50 and p99",
                   "Gaps between token-carrying events as they left the replica.",
                   "s", targets((quantile("0.5", "sidecar_inter_token_latency_seconds", server,
                                          "replica"), "{{replica}} p50"),
                                (quantile("0.99", "sidecar_inter_token_latency_seconds", server,
                                          "replica"), "{{replica}} p99"))),
        timeseries("Requests/s per replica, and those that did not end ok",
                   "All requests the sidecars sent to each replica, and per outcome those that "
                   "failed.",
                   "reqps",
                   targets((f"sum by (replica) (rate(sidecar_requests_total{{{SEL}}}[{RATE}]))",
                            "{{replica}}"),
                           (f'sum by (replica, outcome) (rate(sidecar_requests_total{{outcome!='
                            f'"ok", {SEL}}}[{RATE}]))', "{{replica}} {{outcome}}"))),
        timeseries("In flight per replica (sidecar) and in rotation",
                   "Requests each replica has in flight from the sidecars, and 1 while the "
                   "replica is in rotation (0: ejected by health checks or failed connects).",
                   "short",
                   targets((in_flight, "{{replica}} in flight"),
                           ('min by (replica) (sidecar_replica_healthy{replica=~"$replica"})',
                            "{{replica}} in rotation"))),
        row("vLLM's own gauges, for the same replicas"),
        timeseries("Requests running and waiting (vLLM)",
                   "vllm:num_requests_running (in the batch) and vllm:num_requests_waiting "
                   "(queued), summed over the engine (data-parallel rank) label.",
                   "short", targets((running, "{{replica}} running"),
                                    (waiting, "{{replica}} waiting"))),
        timeseries("KV cache usage (vLLM)", "vllm:kv_cache_usage_perc, 0 to 1.", "percentunit",
                   targets((kv, "{{replica}}")), maximum=1),
        timeseries("Prefix cache hit rate (vLLM)",
                   "vllm:prefix_cache_hits / vllm:prefix_cache_queries (tokens) over each "
                   "point's rate window.",
                   "percentunit", targets((hit_rate, "{{replica}}")), maximum=1),
        timeseries("Preemptions/s (vLLM)",
                   "vllm:num_preemptions: requests evicted from the batch for lack of KV cache.",
                   "short",
                   targets((f"sum by (replica) (rate(vllm:num_preemptions_total{{{VLLM_SEL}}}"
                            f"[{RATE}]))", "{{replica}}"))),
        timeseries("Output tokens/s: vLLM's count beside the sidecar's",
                   "vllm:generation_tokens (every request the engine ran, aborted ones too) "
                   "beside the sidecar's count for its successful requests.",
                   TOKENS_PER_S,
                   targets((f"sum by (replica) (rate(vllm:generation_tokens_total{{{VLLM_SEL}}}"
                            f"[{RATE}]))", "{{replica}} vLLM"),
                           (f"sum by (replica) (rate(sidecar_generation_tokens_total{{{SEL}}}"
                            f"[{RATE}]))", "{{replica}} sidecar")), w=24),
        row("Joined by replica"),
        table("Replicas at a glance",
              "One row per replica: the sidecar's measurements and vLLM's gauges, joined on "
              "the replica label (see docs/deploy.md on how both sides get the same name).",
              targets((quantile("0.99", "sidecar_time_to_first_token_seconds", server,
                                "replica"), ""),
                      (f"sum by (replica) (rate(sidecar_requests_total{{{SEL}}}[{RATE}]))", ""),
                      (in_flight, ""), (running, ""), (waiting, ""), (kv, ""), (hit_rate, ""),
                      instant=True, fmt="table"),
              {"Value #A": ("TTFT p99 server side", "s"), "Value #B": ("requests/s", "reqps"),
               "Value #C": ("in flight (sidecar)", "short"),
               "Value #D": ("running (vLLM)", "short"), "Value #E": ("waiting (vLLM)", "short"),
               "Value #F": ("KV cache usage", "percentunit"),
               "Value #G": ("prefix hit rate", "percentunit")}),
        timeseries("In flight at the sidecar minus running and waiting at vLLM",
                   "A PromQL join on replica: requests the sidecars count in flight to a "
                   "replica minus the requests vLLM has running or waiting. Persistently "
                   "positive: requests held between the two (the replica's HTTP layer, "
                   "connection setup, streams vLLM finished that are still being relayed). "
                   "The two sides are scraped at different instants, so single points are "
                   "noisy.",
                   "short",
                   targets((f"{in_flight} - on (replica) (sum by (replica) "
                            f"(vllm:num_requests_running{{{VLLM_SEL}}} + "
                            f"vllm:num_requests_waiting{{{VLLM_SEL}}}))", "{{replica}}")),
                   minimum=None),
        timeseries("Server-side TTFT p99 beside the vLLM queue",
                   "Per replica, the server-side TTFT p99 (left axis, seconds) and vLLM's "
                   "waiting requests (right axis): queueing shows up in both.",
                   "s",
                   targets((quantile("0.99", "sidecar_time_to_first_token_seconds", server,
                                     "replica"), "{{replica}} TTFT p99"),
                           (waiting, "{{replica}} waiting"))),
    ]
    # The queue series of the last panel in its own unit, on the right axis.
    last = panels[-1]
    last["fieldConfig"]["overrides"] = [{
        "matcher": {"id": "byFrameRefID", "options": "B"},
        "properties": [{"id": "unit", "value": "short"},
                       {"id": "custom.axisPlacement", "value": "right"}]}]
    return dashboard("vllm-sidecar-replicas", "vLLM sidecar / Replicas",
                     "Per replica: the sidecar's latency and traffic beside vLLM's own queue, "
                     "batch, KV cache and prefix cache gauges, joined on the replica label.",
                     panels, [v for v in COMMON_VARIABLES if v["name"] != "slo_class"])


# --- Replay run ------------------------------------------------------------------------------

REPLAY_NOTES = """
A replay (`sidecar replay`, or the sharded Job in deploy/kubernetes/replay) sends its load
through the sidecar, so this view is the sidecar's: request rate and outcomes, tokens, the
latency clients get, goodput, and the shape of the replayed workload (prompt and output
lengths). The capture panels show a sidecar writing traces (`--capture`).

The **Sender** row is the replayer's own view (`sidecar replay --metrics-listen`, scraped by
podmonitor-replay.yaml or the compose `replay` job): how far the run has got, how late requests
leave against their schedule (an open loop that falls behind no longer offers the load its
report will name), what the sender saw finish, per shard. The run's own report is report.json
under --output-dir (`sidecar merge` for all shards).
"""


def replay_dashboard() -> dict[str, Any]:
    total = f"sum(increase(sidecar_requests_total{{{SEL}}}[$__range]))"
    panels = [
        text("About this view", REPLAY_NOTES, h=6),
        stat("Requests over the time range", "Requests through the sidecars.", "short",
             targets((total, "requests"))),
        stat("Outcome shares over the time range", "Share of each outcome.", "percentunit",
             targets((f"sum by (outcome) (increase(sidecar_requests_total{{{SEL}}}"
                      f"[$__range])) / scalar({total})", "{{outcome}}")), w=12),
        stat("In flight now", "Requests in flight from the sidecars to every replica.",
             "short", targets(('sum(sidecar_in_flight_requests{replica=~"$replica"})',
                               "in flight"))),
        timeseries("Request rate by outcome", "Requests/s through the sidecars.", "reqps",
                   targets((f"sum by (outcome) (rate(sidecar_requests_total{{{SEL}}}[{RATE}]))",
                            "{{outcome}}")), stack=True),
        timeseries("Token throughput", "Prompt and output tokens/s of successful requests.",
                   TOKENS_PER_S,
                   targets((f"sum(rate(sidecar_prompt_tokens_total{{{SEL}}}[{RATE}]))",
                            "prompt"),
                           (f"sum(rate(sidecar_generation_tokens_total{{{SEL}}}[{RATE}]))",
                            "output"))),
        timeseries("TTFT and E2E, client side: p50 and p99",
                   "What the replay's requests experienced, measured by the sidecar.", "s",
                   targets((quantile("0.5", "sidecar_time_to_first_token_seconds",
                                     f'vantage="client", {SEL}'), "TTFT p50"),
                           (quantile("0.99", "sidecar_time_to_first_token_seconds",
                                     f'vantage="client", {SEL}'), "TTFT p99"),
                           (quantile("0.5", "sidecar_e2e_request_latency_seconds",
                                     f'vantage="client", {SEL}'), "E2E p50"),
                           (quantile("0.99", "sidecar_e2e_request_latency_seconds",
                                     f'vantage="client", {SEL}'), "E2E p99"))),
        timeseries("Attainment per SLO class", "Good / all per SLO class.", "percentunit",
                   targets((attainment(RATE), "{{slo_class}}")), maximum=1),
        heatmap("Prompt lengths", "Prompt tokens per successful request (usage).", "short",
                "sidecar_request_prompt_tokens", 'model=~"$model"'),
        heatmap("Output lengths", "Output tokens per successful request.", "short",
                "sidecar_request_generation_tokens", 'model=~"$model"'),
        row("Sender"),
        stat("Sent / planned", "Requests the replay senders have sent, of all they planned "
             "(every run of --repeats counted).", "percentunit",
             targets(("sum(sidecar_replay_requests_sent_total) / "
                      "sum(sidecar_replay_requests_planned_total)", "sent")), w=6),
        timeseries("Send lateness: p50 and p99",
                   "Actual send - scheduled send of open-loop requests, all shards pooled.",
                   "s",
                   targets((quantile("0.5", "sidecar_replay_send_lateness_seconds", ""), "p50"),
                           (quantile("0.99", "sidecar_replay_send_lateness_seconds", ""),
                            "p99")), w=6),
        timeseries("Sender: in flight by shard", "Requests sent and not finished, per shard.",
                   "short", targets(("sum by (shard) (sidecar_replay_in_flight_requests)",
                                     "shard {{shard}}")), w=6),
        timeseries("Sender: finished/s by outcome", "As the replayer saw them (client "
                   "vantage), all shards.", "reqps",
                   targets((f"sum by (outcome) (rate(sidecar_replay_requests_completed_total"
                            f"[{RATE}]))", "{{outcome}}")), stack=True, w=6),
        row("Capture"),
        timeseries("Records captured/s", "sidecar_capture_records_written per sidecar.",
                   "suffix: records/s",
                   targets((f"sum by (instance) (rate(sidecar_capture_records_written_total"
                            f"[{RATE}]))", "{{instance}}")), w=8),
        timeseries("Records not captured", "Dropped per interval: the writer's queue was full "
                   "(queue_full) or a write failed (write_error). Any is a gap in the trace.",
                   "short",
                   targets((f"sum by (instance, reason) (increase("
                            f"sidecar_capture_records_dropped_total[{RATE}]))",
                            "{{instance}} {{reason}}")), w=8),
        timeseries("Capture writer queue", "Records waiting for the capture writer.", "short",
                   targets(("sidecar_capture_queue_records", "{{instance}}")), w=8),
    ]
    return dashboard("vllm-sidecar-replay", "vLLM sidecar / Replay run",
                     "A replay or a capture in progress, seen through the sidecar.",
                     panels, list(COMMON_VARIABLES))


DASHBOARDS = {
    "sidecar-slo.json": slo_dashboard,
    "sidecar-latency.json": latency_dashboard,
    "sidecar-replicas.json": replicas_dashboard,
    "sidecar-replay.json": replay_dashboard,
}


def render() -> dict[str, str]:
    return {name: json.dumps(build(), indent=2) + "\n" for name, build in DASHBOARDS.items()}


def main() -> None:
    OUT.mkdir(exist_ok=True)
    for name, content in render().items():
        (OUT / name).write_text(content)
        print(f"wrote {OUT / name}")


if __name__ == "__main__":
    main()
