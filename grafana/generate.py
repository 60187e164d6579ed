"""Write the sidecar's Grafana dashboards: ``python grafana/generate.py`` (standard library only).

The JSON in grafana/dashboards/ is what Grafana provisions; this file is where it is edited.
tests/test_dashboards.py fails when the two differ, checks the dashboards' structure, and runs
every query below on a real Prometheus scraping a sidecar (in worker mode) and simulated vLLM
replicas, with the rules of deploy/prometheus/sidecar-rules.yml loaded.

Label conventions the queries rely on:
- where a series comes from: ``cluster`` (where Prometheus or a global view adds it),
  ``namespace`` (Kubernetes), ``job`` (the scrape job: ``vllm-sidecar`` for the sidecars).
  Every dashboard has these three as variables; every query on the sidecar's series selects
  all three, every query on vLLM's or the replayer's series (other jobs) cluster and namespace;
- the sidecar's series: ``model``, ``replica`` (its upstream's host:port, rewritten at scrape
  time to the name vLLM's series get, see docs/deploy.md), ``vantage``, ``slo_class``;
- vLLM's series: ``model_name`` and ``engine`` from vLLM, plus ``replica`` added by
  Prometheus's relabeling (deploy/compose/prometheus/*.yml, deploy/kubernetes/base/
  podmonitor-vllm.yaml). Panels that show both join on ``replica``;
- the SLO recording rules (``sidecar:slo_*``) keep cluster, namespace, job and slo_class.

Every panel's description says what it shows and where its quantities are defined: a section
of docs/metrics.md (or docs/workers.md, docs/runbooks.md for the sidecar's own health), cited
as ``docs/metrics.md "Section"``; the tests check that each section exists.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE / "dashboards"

DS = {"type": "prometheus", "uid": "${datasource}"}
# Where a series comes from. vLLM's and the replayer's series have jobs of their own.
PLACE = 'cluster=~"$cluster", namespace=~"$namespace"'
TARGET = f'{PLACE}, job=~"$job"'
SEL = f'{TARGET}, model=~"$model", replica=~"$replica"'
VLLM_SEL = f'{PLACE}, model_name=~"$model", replica=~"$replica"'
CLASS_SEL = f'{TARGET}, slo_class=~"$slo_class"'
RATE = "$__rate_interval"
QUANTILES = (("0.5", "p50"), ("0.9", "p90"), ("0.99", "p99"))
TOKENS_PER_S = "suffix: tok/s"

Panel = dict[str, Any]


def see(*sections: str) -> str:
    """Where the panel's quantities are defined: ``see("metrics.md#Per-request metrics")``."""
    refs = []
    for section in sections:
        page, _, heading = section.partition("#")
        refs.append(f'docs/{page} "{heading}"')
    return " Defined in " + ", ".join(refs) + "."


METRICS_DEFS = "metrics.md#Per-request metrics"
VANTAGES = "metrics.md#Vantages"
OUTCOMES = "metrics.md#Outcomes"
THROUGHPUT = "metrics.md#Throughput"
SLOS = "metrics.md#SLOs and goodput"
PERCENTILES = "metrics.md#Percentiles"
TOKENS = "metrics.md#Token counts and how exact they are"
OTHER_TOOLS = "metrics.md#Other tools' definitions"
DROPS = "workers.md#What is dropped, and where it is counted"
PROCESSES = "workers.md#Processes"
STAMPS = "metrics.md#How late a stamp may be"
STAMPS_LATE = "runbooks.md#SidecarStampsLate"
OWN_DELAY = "metrics.md#The sidecar's own delay"
SCRAPES_SLOW = "runbooks.md#SidecarScrapesSlow"


# --- queries ---------------------------------------------------------------------------------


def quantile(q: str, metric: str, selector: str, by: str = "", window: str = RATE) -> str:
    group = f"le, {by}" if by else "le"
    return (
        f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{selector}}}[{window}])))"
    )


def mean(metric: str, selector: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return (
        f"sum{group} (rate({metric}_sum{{{selector}}}[{RATE}])) / "
        f"sum{group} (rate({metric}_count{{{selector}}}[{RATE}]))"
    )


def attainment(window: str) -> str:
    """Good / counted per SLO class; a class with no good request yet reads 0, not nothing."""
    good = f"sum by (slo_class) (rate(sidecar_slo_good_requests_total{{{CLASS_SEL}}}[{window}]))"
    every = f"sum by (slo_class) (rate(sidecar_slo_requests_total{{{CLASS_SEL}}}[{window}]))"
    return f"({good} or 0 * {every}) / {every}"


def objective() -> str:
    """Each class's objective as the sidecars declare it (the strictest where they differ)."""
    return f"max by (slo_class) (sidecar_slo_objective_ratio{{{CLASS_SEL}}})"


def budget_spent(window: str) -> str:
    """The share of the error budget spent over ``window`` (1 = all of it, 7.5 = 7.5 times
    over), from the recorded 5-minute rates: a few samples a minute, not the raw counters."""
    good = (
        f"sum by (slo_class) (sum_over_time(sidecar:slo_good_requests:rate5m"
        f"{{{CLASS_SEL}}}[{window}]))"
    )
    every = (
        f"sum by (slo_class) (sum_over_time(sidecar:slo_requests:rate5m{{{CLASS_SEL}}}[{window}]))"
    )
    budget = f"max by (slo_class) (sidecar:slo_error_budget:ratio{{{CLASS_SEL}}})"
    return f"(1 - {good} / {every}) / on (slo_class) {budget}"


def target(
    expr: str, legend: str = "", *, instant: bool = False, fmt: str = "time_series", ref: str = "A"
) -> dict[str, Any]:
    return {
        "datasource": DS,
        "refId": ref,
        "expr": expr,
        "legendFormat": legend,
        "range": not instant,
        "instant": instant,
        "format": fmt,
        "editorMode": "code",
    }


def targets(*pairs: tuple[str, str], **kw: Any) -> list[dict[str, Any]]:
    return [
        target(expr, legend, ref=chr(ord("A") + i), **kw) for i, (expr, legend) in enumerate(pairs)
    ]


# --- panels ----------------------------------------------------------------------------------


def timeseries(
    title: str,
    description: str,
    unit: str,
    queries: list[dict[str, Any]],
    *,
    stack: bool = False,
    minimum: float | None = 0,
    maximum: float | None = None,
    thresholds: list[tuple[float, str]] | None = None,
    w: int = 12,
    h: int = 8,
) -> Panel:
    defaults: dict[str, Any] = {
        "unit": unit,
        "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10 if stack else 0,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"mode": "normal" if stack else "none", "group": "A"},
            "thresholdsStyle": {"mode": "line" if thresholds else "off"},
        },
        "thresholds": {
            "mode": "absolute",
            "steps": [{"color": "green", "value": None}]
            + [{"color": color, "value": value} for value, color in thresholds or []],
        },
    }
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": queries,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {
                "displayMode": "table",
                "placement": "bottom",
                "calcs": ["mean", "max", "lastNotNull"],
                "showLegend": True,
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "gridPos": {"w": w, "h": h},
    }


def stat(
    title: str,
    description: str,
    unit: str,
    queries: list[dict[str, Any]],
    *,
    steps: list[tuple[float | None, str]] | None = None,
    w: int = 6,
    h: int = 5,
) -> Panel:
    steps = steps or [(None, "blue")]
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": queries,
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "decimals": 2,
                "thresholds": {
                    "mode": "absolute",
                    "steps": [{"color": color, "value": value} for value, color in steps],
                },
            },
            "overrides": [],
        },
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background",
            "graphMode": "none",
            "textMode": "auto",
            "orientation": "auto",
            "justifyMode": "auto",
        },
        "gridPos": {"w": w, "h": h},
    }


def heatmap(
    title: str, description: str, unit: str, metric: str, selector: str, w: int = 12, h: int = 8
) -> Panel:
    expr = f"sum by (le) (increase({metric}_bucket{{{selector}}}[{RATE}]))"
    return {
        "type": "heatmap",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": [target(expr, "{{le}}", fmt="heatmap")],
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {
            "calculate": False,
            "cellGap": 1,
            "yAxis": {"axisPlacement": "left", "unit": unit},
            "rowsFrame": {"layout": "auto"},
            "color": {
                "mode": "scheme",
                "scheme": "Oranges",
                "fill": "dark-orange",
                "scale": "exponential",
                "exponent": 0.5,
                "steps": 64,
            },
            "cellValues": {"unit": "short"},
            "tooltip": {"mode": "single", "yHistogram": True, "showColorScale": True},
            "legend": {"show": True},
        },
        "gridPos": {"w": w, "h": h},
    }


def table(
    title: str,
    description: str,
    queries: list[dict[str, Any]],
    columns: dict[str, tuple[str, str]],
    w: int = 24,
    h: int = 8,
) -> Panel:
    """Instant queries merged on their labels into one row per label set; ``columns`` maps a
    query's value field ("Value #A") to (header, unit)."""
    overrides = [
        {
            "matcher": {"id": "byName", "options": field},
            "properties": [{"id": "displayName", "value": header}, {"id": "unit", "value": unit}],
        }
        for field, (header, unit) in columns.items()
    ]
    return {
        "type": "table",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": queries,
        "fieldConfig": {"defaults": {"unit": "short", "decimals": 3}, "overrides": overrides},
        "options": {"showHeader": True, "cellHeight": "sm"},
        "transformations": [
            {"id": "merge", "options": {}},
            {"id": "organize", "options": {"excludeByName": {"Time": True}}},
        ],
        "gridPos": {"w": w, "h": h},
    }


def text(title: str, content: str, w: int = 24, h: int = 7) -> Panel:
    return {
        "type": "text",
        "title": title,
        "options": {"mode": "markdown", "content": content.strip()},
        "gridPos": {"w": w, "h": h},
    }


def row(title: str) -> Panel:
    return {
        "type": "row",
        "title": title,
        "collapsed": False,
        "panels": [],
        "gridPos": {"w": 24, "h": 1},
    }


def with_units(panel: Panel, units: dict[str, str]) -> Panel:
    """Give the series of some queries (by refId) a unit of their own."""
    panel["fieldConfig"]["overrides"] = [
        {
            "matcher": {"id": "byFrameRefID", "options": ref},
            "properties": [{"id": "unit", "value": unit}],
        }
        for ref, unit in units.items()
    ]
    return panel


# --- variables -------------------------------------------------------------------------------


def datasource_variable() -> dict[str, Any]:
    return {
        "name": "datasource",
        "label": "Prometheus",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "refresh": 1,
        "regex": "",
        "options": [],
        "includeAll": False,
        "multi": False,
    }


def query_variable(name: str, label: str, query: str, description: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "description": description,
        "query": {"query": query, "refId": f"{name}-variable-query"},
        "definition": query,
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "options": [],
        "sort": 1,
        "hide": 0,
        "regex": "",
    }


def custom_variable(
    name: str, label: str, values: list[str], default: str, description: str
) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "custom",
        "description": description,
        "query": ",".join(values),
        "current": {"selected": True, "text": default, "value": default},
        "options": [{"selected": v == default, "text": v, "value": v} for v in values],
        "includeAll": False,
        "multi": False,
        "hide": 0,
    }


COMMON_VARIABLES = [
    datasource_variable(),
    query_variable(
        "cluster",
        "Cluster",
        "label_values(sidecar_requests_total, cluster)",
        "Where Prometheus (or a global view over several) labels series by cluster; "
        "empty otherwise, and All matches series without the label.",
    ),
    query_variable(
        "namespace",
        "Namespace",
        'label_values(sidecar_requests_total{cluster=~"$cluster"}, namespace)',
        "The Kubernetes namespace of the sidecars (and of vLLM and the replayer).",
    ),
    query_variable(
        "job",
        "Job",
        f"label_values(sidecar_requests_total{{{PLACE}}}, job)",
        "The sidecars' scrape job (vllm-sidecar in the shipped configurations).",
    ),
    query_variable(
        "model",
        "Model",
        f"label_values(sidecar_requests_total{{{TARGET}}}, model)",
        "The model a request named (model_name on vLLM's series).",
    ),
    query_variable(
        "replica",
        "Replica",
        f'label_values(sidecar_requests_total{{{TARGET}, model=~"$model"}}, replica)',
        "The vLLM replica, named alike on the sidecar's and vLLM's series "
        "(docs/deploy.md, the replica label).",
    ),
    query_variable(
        "slo_class",
        "SLO class",
        f"label_values(sidecar_slo_requests_total{{{TARGET}}}, slo_class)",
        "The SLO class a request was judged in.",
    ),
]


def variables_except(*names: str) -> list[dict[str, Any]]:
    return [v for v in COMMON_VARIABLES if v["name"] not in names]


# --- layout ----------------------------------------------------------------------------------


def lay_out(panels: list[Panel]) -> list[Panel]:
    """Left to right, top to bottom, in Grafana's 24-column grid; ids in order from 1."""
    x = y = row_height = 0
    out = []
    for number, panel in enumerate(panels, start=1):
        grid = panel["gridPos"]
        if panel["type"] == "row" or x + grid["w"] > 24:
            x, y, row_height = 0, y + row_height, 0
        panel = {"id": number, **panel, "gridPos": {"h": grid["h"], "w": grid["w"], "x": x, "y": y}}
        x += grid["w"]
        row_height = max(row_height, grid["h"])
        if panel["type"] == "row":
            x, y, row_height = 0, y + 1, 0
        out.append(panel)
    return out


def dashboard(
    uid: str, title: str, description: str, panels: list[Panel], variables: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["vllm", "vllm-sidecar"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "weekStart": "",
        "links": [
            {
                "title": "vLLM sidecar",
                "type": "dashboards",
                "tags": ["vllm-sidecar"],
                "asDropdown": True,
                "includeVars": True,
                "keepTime": True,
                "icon": "external link",
                "targetBlank": False,
                "tooltip": "",
                "url": "",
            }
        ],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "templating": {"list": variables},
        "panels": lay_out(panels),
    }


# --- SLO compliance --------------------------------------------------------------------------

PER_CLASS_ONLY = (
    " Per SLO class: the SLO counters carry no model or replica label, so the "
    "Model and Replica variables do not apply here."
)


def slo_dashboard() -> dict[str, Any]:
    good_rate = f"sum by (slo_class) (rate(sidecar_slo_good_requests_total{{{CLASS_SEL}}}[{RATE}]))"
    counted_rate = f"sum by (slo_class) (rate(sidecar_slo_requests_total{{{CLASS_SEL}}}[{RATE}]))"
    excluded_rate = (
        f"sum by (slo_class, reason) (rate(sidecar_slo_excluded_requests_total"
        f"{{{CLASS_SEL}}}[{RATE}]))"
    )
    spent = budget_spent("$slo_window")
    panels = [
        row("Attainment and goodput"),
        stat(
            "Attainment over the time range, and the objective",
            "Attainment: good requests / counted requests of each SLO class over the "
            "dashboard's time range, all selected sidecars together (one instant query). "
            "Good = outcome ok and every threshold of the class met at the client vantage. "
            "Counted = the class's generation requests except those the client got wrong "
            "(HTTP 4xx but 408 and 429) and those it cancelled before their first token. "
            "Beside it, the class's objective as the sidecars declare it "
            "(sidecar_slo_objective_ratio)." + PER_CLASS_ONLY + see(SLOS, VANTAGES, OUTCOMES),
            "percentunit",
            [
                target(attainment("$__range"), "{{slo_class}}", instant=True),
                target(objective(), "{{slo_class}} objective", instant=True, ref="B"),
            ],
            w=8,
        ),
        timeseries(
            "Attainment per SLO class",
            "Good / counted requests per SLO class over each point's rate window, with "
            "each class's objective as a line." + PER_CLASS_ONLY + see(SLOS),
            "percentunit",
            targets((attainment(RATE), "{{slo_class}}"), (objective(), "{{slo_class}} objective")),
            maximum=1,
            minimum=None,
            w=16,
        ),
        timeseries(
            "Attainment over the live window (exact, per sidecar)",
            "sidecar_window_slo_attainment: each sidecar's exact attainment over its "
            "live window (60 s by default), computed from its records at scrape time. "
            "Per sidecar: do not average these across sidecars; the panel above merges "
            "the counters correctly." + see(SLOS),
            "percentunit",
            targets(
                (f"sidecar_window_slo_attainment{{{CLASS_SEL}}}", "{{slo_class}} {{instance}}")
            ),
            maximum=1,
            minimum=None,
        ),
        timeseries(
            "Goodput: good, counted and excluded requests/s",
            "Requests per second that met their SLO class (good) against the class's "
            "counted requests (the attainment denominator), and those left out of it "
            "by reason: client_error (HTTP 4xx but 408 and 429), client_cancelled "
            "(gone before the first token)." + PER_CLASS_ONLY + see(SLOS, THROUGHPUT),
            "reqps",
            targets(
                (good_rate, "{{slo_class}} good"),
                (counted_rate, "{{slo_class}} counted"),
                (excluded_rate, "{{slo_class}} excluded: {{reason}}"),
            ),
        ),
        timeseries(
            "Goodput in output tokens/s",
            "Output tokens per second of the good requests, per SLO class, beside the "
            "output tokens of every successful request of the selected models and "
            "replicas." + see(SLOS, TOKENS),
            TOKENS_PER_S,
            targets(
                (
                    f"sum by (slo_class) (rate(sidecar_slo_good_generation_tokens_total"
                    f"{{{CLASS_SEL}}}[{RATE}]))",
                    "{{slo_class}} good",
                ),
                (
                    f"sum(rate(sidecar_generation_tokens_total{{{SEL}}}[{RATE}]))",
                    "all successful requests",
                ),
            ),
            w=24,
        ),
        row("Error budget"),
        with_units(
            stat(
                "Error budget over $slo_window: left, and spent",
                "Left: the share of the error budget (1 - objective) not yet spent over "
                "$slo_window, between 0 and 100%. Spent: the errors over $slo_window as a "
                "multiple of the budget, not capped: 1 is all of it, 7.5 means seven and a half "
                "budgets' worth (the budget is overspent 6.5 times over). From the recorded "
                "5-minute rates of the rules (sidecar:slo_requests:rate5m, "
                "sidecar:slo_good_requests:rate5m), one instant query; it needs $slo_window of "
                "them for the full picture." + PER_CLASS_ONLY + see(SLOS),
                "percentunit",
                [
                    target(f"clamp(1 - {spent}, 0, 1)", "{{slo_class}} left", instant=True),
                    target(spent, "{{slo_class}} spent", instant=True, ref="B"),
                ],
                steps=[(None, "red"), (0.25, "orange"), (0.5, "green")],
                w=8,
            ),
            {"B": "suffix:x budget"},
        ),
        timeseries(
            "Burn rate over the alerts' long windows",
            "Error ratio / error budget of each class (1 = the budget lasts exactly 30 "
            "days), from the rules' recordings sidecar:slo_burn_rate:rate1h, 6h, 1d, "
            "3d; the highest of the selected deployments. The alerts page at 14.4 (1h, "
            "with 5m) and 6 (6h, with 30m) and open tickets at 3 (1d, with 2h) and 1 "
            "(3d, with 6h), each only with 10 bad requests in its long window "
            "(docs/runbooks.md)." + PER_CLASS_ONLY + see(SLOS),
            "suffix:x",
            targets(
                *(
                    (
                        f"max by (slo_class) (sidecar:slo_burn_rate:rate{window}{{{CLASS_SEL}}})",
                        f"{{{{slo_class}}}} {window}",
                    )
                    for window in ("1h", "6h", "1d", "3d")
                )
            ),
            thresholds=[(1, "yellow"), (3, "orange"), (6, "red"), (14.4, "dark-red")],
            w=16,
        ),
        row("Outcomes"),
        timeseries(
            "Requests by outcome",
            "Every request through the sidecars of the selected models and replicas, "
            "by how it ended: ok, http_error, upstream_error, timeout, client_cancelled, "
            "rejected." + see(OUTCOMES),
            "reqps",
            targets(
                (f"sum by (outcome) (rate(sidecar_requests_total{{{SEL}}}[{RATE}]))", "{{outcome}}")
            ),
            stack=True,
        ),
        timeseries(
            "Share of requests that did not end ok",
            "Per outcome other than ok, as a share of all requests of the selected "
            "models and replicas. Empty while every request succeeds." + see(OUTCOMES),
            "percentunit",
            targets(
                (
                    f'sum by (outcome) (rate(sidecar_requests_total{{outcome!="ok", '
                    f"{SEL}}}[{RATE}])) / scalar(sum(rate(sidecar_requests_total"
                    f"{{{SEL}}}[{RATE}])))",
                    "{{outcome}}",
                )
            ),
            stack=True,
        ),
        table(
            "Declared SLO thresholds",
            "sidecar_slo_threshold_seconds: what each SLO class demands of TTFT, TPOT and "
            "E2E, as the sidecars declare it (--slo, --slo-class, the ConfigMap's "
            "sidecar.toml)." + see(SLOS, METRICS_DEFS),
            targets(
                (f"max by (slo_class, metric) (sidecar_slo_threshold_seconds{{{CLASS_SEL}}})", ""),
                instant=True,
                fmt="table",
            ),
            {"Value": ("threshold", "s")},
            w=16,
            h=7,
        ),
        table(
            "Declared objectives",
            "sidecar_slo_objective_ratio: the share of each class's counted requests that "
            "must be good (`--slo ...,objective=99.5%`; 99% unless declared). The alerts "
            "take it from here." + see(SLOS),
            targets((objective(), ""), instant=True, fmt="table"),
            {"Value": ("objective", "percentunit")},
            w=8,
            h=7,
        ),
    ]
    variables = [
        *COMMON_VARIABLES,
        custom_variable(
            "slo_window",
            "SLO window",
            ["7d", "28d", "30d"],
            "30d",
            "Period the error budget is counted over.",
        ),
    ]
    return dashboard(
        "vllm-sidecar-slo",
        "vLLM sidecar / SLO compliance",
        "Attainment, goodput, error budget and burn rate per SLO class, and "
        "request outcomes, from the measurement sidecar.",
        panels,
        variables,
    )


# --- Latency ---------------------------------------------------------------------------------

LATENCY_METRICS = (
    # key, title, sidecar histogram, SLO metric, vLLM's histogram, what vLLM's one measures
    (
        "ttft",
        "Time to first token",
        "sidecar_time_to_first_token_seconds",
        "ttft",
        "vllm:time_to_first_token_seconds",
        "vLLM's TTFT runs from the request's arrival in the API server to the engine step that "
        "produced the first token (queue and prefill included).",
    ),
    (
        "itl",
        "Inter-token latency",
        "sidecar_inter_token_latency_seconds",
        None,
        "vllm:inter_token_latency_seconds",
        "vLLM's ITL is one sample per engine step that produced tokens for a request; the "
        "sidecar's is one per streamed event. Equal with --stream-interval 1 and no speculative "
        "decoding.",
    ),
    (
        "tpot",
        "Time per output token",
        "sidecar_time_per_output_token_seconds",
        "tpot",
        "vllm:request_time_per_output_token_seconds",
        "vLLM's TPOT is decode time / (output tokens - 1) per request, from engine timestamps.",
    ),
    (
        "e2e",
        "End-to-end latency",
        "sidecar_e2e_request_latency_seconds",
        "e2e",
        "vllm:e2e_request_latency_seconds",
        "vLLM's E2E runs from arrival to the request's finish in the engine.",
    ),
)

BESIDE_VLLM = (
    "Means, not percentiles: vLLM's buckets are coarse (its TTFT bounds run 1, 5, 10, 20, 40, "
    "60, 80, 100, 250, 500 ms, ...), and histogram_quantile spreads a bucket's samples evenly "
    "across it, so a vLLM percentile can land anywhere in a wide bucket (inside the first, "
    "0 to 1 ms, for fast requests) and its difference to the sidecar's would show overhead "
    "that is not there. A mean is _sum / _count: exact on both sides."
)


def latency_dashboard() -> dict[str, Any]:
    panels: list[Panel] = []
    for key, title, metric, slo_metric, vllm_metric, vllm_note in LATENCY_METRICS:
        name = key.upper()
        panels.append(row(f"{name}: {title.lower()}"))
        for vantage, where in (
            ("client", "client side: what clients see, measured at the sidecar's client socket"),
            (
                "server",
                "server side: from the request sent to the replica, "
                "measured at the sidecar's upstream socket",
            ),
        ):
            queries = [
                (quantile(q, metric, f'vantage="{vantage}", {SEL}'), f"{label}")
                for q, label in QUANTILES
            ]
            if slo_metric is not None:
                queries.append(
                    (
                        f'max by (slo_class) (sidecar_slo_threshold_seconds{{metric="'
                        f'{slo_metric}", {CLASS_SEL}}})',
                        "SLO {{slo_class}}",
                    )
                )
            panels.append(
                timeseries(
                    f"{name} {vantage} side: p50, p90, p99",
                    f"{title} ({name}), {where}, of successful requests. Percentiles from the "
                    "histograms of every selected sidecar merged: with the default buckets "
                    "(--histogram-buckets schema3, bounds 2^(1/8) apart) within 9.2 % of the exact "
                    "percentile"
                    + (
                        ", with the declared SLO thresholds of the selected classes."
                        if slo_metric
                        else "."
                    )
                    + see(METRICS_DEFS, VANTAGES, PERCENTILES),
                    "s",
                    targets(*queries),
                )
            )
        for vantage in ("client", "server"):
            panels.append(
                heatmap(
                    f"{name} distribution, {vantage} side",
                    f"How many {'events' if key == 'itl' else 'requests'} fell in each bucket of "
                    f"the {vantage}-side {title.lower()} ({name}) histogram, per interval."
                    + see(METRICS_DEFS, VANTAGES),
                    "s",
                    metric,
                    f'vantage="{vantage}", {SEL}',
                )
            )
        client_mean = mean(metric, f'vantage="client", {SEL}')
        server_mean = mean(metric, f'vantage="server", {SEL}')
        panels.append(
            timeseries(
                f"{name} mean: client side minus server side",
                f"Mean client-side minus mean server-side {name}: what lies between the client "
                "and the replica (the sidecar's own relay, the network to the replica, the "
                "replica's HTTP layer before the first byte). Means subtract; percentiles do not."
                + see(METRICS_DEFS, VANTAGES),
                "s",
                targets((f"({client_mean}) - ({server_mean})", "client - server")),
                minimum=None,
            )
        )
        engine_queries = [
            (mean(metric, f'vantage="server", {SEL}'), "sidecar server side, mean"),
            (mean(vllm_metric, VLLM_SEL), "vLLM's own, mean"),
        ]
        if key in ("ttft", "tpot", "e2e"):
            engine_queries.append(
                (
                    mean(metric, f'vantage="engine", {SEL}'),
                    "vLLM per-request metrics (vantage=engine), mean",
                )
            )
        panels.append(
            timeseries(
                f"{name}: the sidecar's server side beside vLLM's own (means)",
                f"The mean server-side {name} the sidecar measured beside the mean of vLLM's "
                f"{vllm_metric} for the same models (model_name) and replicas. {vllm_note} "
                + BESIDE_VLLM
                + (
                    " vantage=engine: the timings vLLM returns per request "
                    "(--enable-per-request-metrics), when it does, over the same interval "
                    "(TTFT and "
                    "E2E from queued in the engine)."
                    if key in ("ttft", "tpot", "e2e")
                    else ""
                )
                + see(METRICS_DEFS, VANTAGES, OTHER_TOOLS),
                "s",
                targets(*engine_queries),
            )
        )
        panels.append(
            timeseries(
                f"{name} exact over the live window, per sidecar",
                f'sidecar_window_latency_seconds{{metric="{key}"}}: each sidecar\'s exact p50 and '
                "p99 (numpy) over its live window, both vantages; "
                "sidecar_window_latency_samples says how many samples stand behind them. One "
                "sidecar each: never average these across sidecars." + see(PERCENTILES, VANTAGES),
                "s",
                targets(
                    (
                        f'sidecar_window_latency_seconds{{metric="{key}", percentile="50", '
                        f"{TARGET}}}",
                        "{{vantage}} p50 {{instance}}",
                    ),
                    (
                        f'sidecar_window_latency_seconds{{metric="{key}", percentile="99", '
                        f"{TARGET}}}",
                        "{{vantage}} p99 {{instance}}",
                    ),
                ),
            )
        )
    queue = "sidecar_engine_queue_time_seconds"
    panels += [
        row("Engine queue time"),
        timeseries(
            "Engine queue time: p50 and p99 per replica",
            "Queue time: from the request queued in vLLM's engine to its scheduling, "
            "as vLLM reports it per request (vllm serve --enable-per-request-metrics; "
            "empty without it), per replica. Time a request waits for a place in the "
            "batch: it is part of every vantage's TTFT." + see(METRICS_DEFS, VANTAGES),
            "s",
            targets(
                (quantile("0.5", queue, SEL, "replica"), "{{replica}} p50"),
                (quantile("0.99", queue, SEL, "replica"), "{{replica}} p99"),
            ),
        ),
        timeseries(
            "Engine queue time: the sidecar's beside vLLM's own (means)",
            "Mean queue time per replica from the per-request metrics the sidecar "
            "collects, beside the mean of vLLM's vllm:request_queue_time_seconds "
            "histogram (every request vLLM ran, with or without per-request metrics). "
            + BESIDE_VLLM
            + see(METRICS_DEFS, VANTAGES),
            "s",
            targets(
                (mean(queue, SEL, "replica"), "{{replica}} sidecar"),
                (mean("vllm:request_queue_time_seconds", VLLM_SEL, "replica"), "{{replica}} vLLM"),
            ),
        ),
    ]
    return dashboard(
        "vllm-sidecar-latency",
        "vLLM sidecar / Latency",
        "TTFT, ITL, TPOT and E2E percentiles from the measurement sidecar, client "
        "side beside server side, as heatmaps, beside vLLM's own, and the engine "
        "queue time.",
        panels,
        list(COMMON_VARIABLES),
    )


# --- Replicas --------------------------------------------------------------------------------


def replicas_dashboard() -> dict[str, Any]:
    server = f'vantage="server", {SEL}'
    in_flight = f'sum by (replica) (sidecar_in_flight_requests{{{TARGET}, replica=~"$replica"}})'
    running = f"sum by (replica) (vllm:num_requests_running{{{VLLM_SEL}}})"
    waiting = f"sum by (replica) (vllm:num_requests_waiting{{{VLLM_SEL}}})"
    kv = f"max by (replica) (vllm:kv_cache_usage_perc{{{VLLM_SEL}}})"
    hit_rate = (
        f"sum by (replica) (rate(vllm:prefix_cache_hits_total{{{VLLM_SEL}}}[{RATE}])) / "
        f"sum by (replica) (rate(vllm:prefix_cache_queries_total{{{VLLM_SEL}}}[{RATE}]))"
    )
    vllm_gauges = " vLLM's own series, for the same replicas (replica label added at scrape time)."
    panels = [
        row("The sidecar's view of each replica"),
        timeseries(
            "TTFT per replica, server side: p50 and p99",
            "Time to first token (TTFT) from the request sent to the replica to its "
            "first token-carrying event, per replica." + see(METRICS_DEFS, VANTAGES),
            "s",
            targets(
                (
                    quantile("0.5", "sidecar_time_to_first_token_seconds", server, "replica"),
                    "{{replica}} p50",
                ),
                (
                    quantile("0.99", "sidecar_time_to_first_token_seconds", server, "replica"),
                    "{{replica}} p99",
                ),
            ),
        ),
        timeseries(
            "ITL per replica, server side: p50 and p99",
            "Inter-token latency (ITL): gaps between token-carrying events as they left "
            "the replica (sample = event)." + see(METRICS_DEFS, VANTAGES),
            "s",
            targets(
                (
                    quantile("0.5", "sidecar_inter_token_latency_seconds", server, "replica"),
                    "{{replica}} p50",
                ),
                (
                    quantile("0.99", "sidecar_inter_token_latency_seconds", server, "replica"),
                    "{{replica}} p99",
                ),
            ),
        ),
        timeseries(
            "Requests/s per replica, and those that did not end ok",
            "All requests the sidecars sent to each replica, and per outcome those that "
            "did not end ok." + see(OUTCOMES, THROUGHPUT),
            "reqps",
            targets(
                (
                    f"sum by (replica) (rate(sidecar_requests_total{{{SEL}}}[{RATE}]))",
                    "{{replica}}",
                ),
                (
                    f"sum by (replica, outcome) (rate(sidecar_requests_total{{outcome!="
                    f'"ok", {SEL}}}[{RATE}]))',
                    "{{replica}} {{outcome}}",
                ),
            ),
        ),
        timeseries(
            "In flight per replica (sidecar) and in rotation",
            "sidecar_in_flight_requests: requests each replica has in flight from the "
            "sidecars (concurrency); sidecar_replica_healthy: 1 while the replica is in "
            "rotation, 0 when ejected by health checks or failed connects (the lowest "
            "of the sidecars)." + see(THROUGHPUT),
            "short",
            targets(
                (in_flight, "{{replica}} in flight"),
                (
                    f'min by (replica) (sidecar_replica_healthy{{{TARGET}, replica=~"$replica"}})',
                    "{{replica}} in rotation",
                ),
            ),
        ),
        row("vLLM's own gauges, for the same replicas"),
        timeseries(
            "Requests running and waiting (vLLM)",
            "vllm:num_requests_running (in the batch) and vllm:num_requests_waiting "
            "(queued), summed over the engine (data-parallel rank) label."
            + vllm_gauges
            + see(VANTAGES),
            "short",
            targets((running, "{{replica}} running"), (waiting, "{{replica}} waiting")),
        ),
        timeseries(
            "KV cache usage (vLLM)",
            "vllm:kv_cache_usage_perc, 0 to 1." + vllm_gauges + see(VANTAGES),
            "percentunit",
            targets((kv, "{{replica}}")),
            maximum=1,
        ),
        timeseries(
            "Prefix cache hit rate (vLLM)",
            "vllm:prefix_cache_hits / vllm:prefix_cache_queries (tokens) over each "
            "point's rate window." + vllm_gauges + see(VANTAGES),
            "percentunit",
            targets((hit_rate, "{{replica}}")),
            maximum=1,
        ),
        timeseries(
            "Preemptions/s (vLLM)",
            "vllm:num_preemptions: requests evicted from the batch for lack of KV cache."
            + vllm_gauges
            + see(VANTAGES),
            "short",
            targets(
                (
                    f"sum by (replica) (rate(vllm:num_preemptions_total{{{VLLM_SEL}}}[{RATE}]))",
                    "{{replica}}",
                )
            ),
        ),
        timeseries(
            "Output tokens/s: vLLM's count beside the sidecar's",
            "vllm:generation_tokens (every request the engine ran, aborted ones too) "
            "beside the sidecar's count for its successful requests (usage)."
            + see(TOKENS, THROUGHPUT),
            TOKENS_PER_S,
            targets(
                (
                    f"sum by (replica) (rate(vllm:generation_tokens_total{{{VLLM_SEL}}}[{RATE}]))",
                    "{{replica}} vLLM",
                ),
                (
                    f"sum by (replica) (rate(sidecar_generation_tokens_total{{{SEL}}}[{RATE}]))",
                    "{{replica}} sidecar",
                ),
            ),
            w=24,
        ),
        row("Joined by replica"),
        table(
            "Replicas at a glance",
            "One row per replica: the sidecar's measurements (server-side TTFT p99, "
            "requests/s, in flight) and vLLM's gauges, joined on the replica label (see "
            "docs/deploy.md on how both sides get the same name)."
            + see(METRICS_DEFS, VANTAGES, THROUGHPUT),
            targets(
                (quantile("0.99", "sidecar_time_to_first_token_seconds", server, "replica"), ""),
                (f"sum by (replica) (rate(sidecar_requests_total{{{SEL}}}[{RATE}]))", ""),
                (in_flight, ""),
                (running, ""),
                (waiting, ""),
                (kv, ""),
                (hit_rate, ""),
                instant=True,
                fmt="table",
            ),
            {
                "Value #A": ("TTFT p99 server side", "s"),
                "Value #B": ("requests/s", "reqps"),
                "Value #C": ("in flight (sidecar)", "short"),
                "Value #D": ("running (vLLM)", "short"),
                "Value #E": ("waiting (vLLM)", "short"),
                "Value #F": ("KV cache usage", "percentunit"),
                "Value #G": ("prefix hit rate", "percentunit"),
            },
        ),
        timeseries(
            "In flight at the sidecar minus running and waiting at vLLM",
            "A PromQL join on replica: requests the sidecars count in flight to a "
            "replica minus the requests vLLM has running or waiting. Persistently "
            "positive: requests held between the two (the replica's HTTP layer, "
            "connection setup, streams vLLM finished that are still being relayed). "
            "The two sides are scraped at different instants, so single points are "
            "noisy." + see(VANTAGES, THROUGHPUT),
            "short",
            targets(
                (
                    f"{in_flight} - on (replica) (sum by (replica) "
                    f"(vllm:num_requests_running{{{VLLM_SEL}}} + "
                    f"vllm:num_requests_waiting{{{VLLM_SEL}}}))",
                    "{{replica}}",
                )
            ),
            minimum=None,
        ),
        with_units(
            timeseries(
                "Server-side TTFT p99 beside the vLLM queue",
                "Per replica, the server-side TTFT p99 (left axis, seconds) and vLLM's waiting "
                "requests (right axis): queueing shows up in both." + see(METRICS_DEFS, VANTAGES),
                "s",
                targets(
                    (
                        quantile("0.99", "sidecar_time_to_first_token_seconds", server, "replica"),
                        "{{replica}} TTFT p99",
                    ),
                    (waiting, "{{replica}} waiting"),
                ),
            ),
            {"B": "short"},
        ),
    ]
    # The queue series of the last panel on the right axis.
    panels[-1]["fieldConfig"]["overrides"][0]["properties"].append(
        {"id": "custom.axisPlacement", "value": "right"}
    )
    return dashboard(
        "vllm-sidecar-replicas",
        "vLLM sidecar / Replicas",
        "Per replica: the sidecar's latency and traffic beside vLLM's own queue, "
        "batch, KV cache and prefix cache gauges, joined on the replica label.",
        panels,
        variables_except("slo_class"),
    )


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
    replay = PLACE  # the replayer's series: its own job, shard label
    panels = [
        text("About this view", REPLAY_NOTES, h=6),
        stat(
            "Requests over the time range",
            "Requests through the selected sidecars over the dashboard's time range, one "
            "instant query." + see(OUTCOMES),
            "short",
            [target(total, "requests", instant=True)],
        ),
        stat(
            "Outcome shares over the time range",
            "Share of each outcome among the requests over the time range, one instant query."
            + see(OUTCOMES),
            "percentunit",
            [
                target(
                    f"sum by (outcome) (increase(sidecar_requests_total{{{SEL}}}"
                    f"[$__range])) / scalar({total})",
                    "{{outcome}}",
                    instant=True,
                )
            ],
            w=12,
        ),
        stat(
            "In flight now",
            "Requests in flight from the selected sidecars to every selected replica "
            "(concurrency)." + see(THROUGHPUT),
            "short",
            [
                target(
                    f'sum(sidecar_in_flight_requests{{{TARGET}, replica=~"$replica"}})',
                    "in flight",
                    instant=True,
                )
            ],
        ),
        timeseries(
            "Request rate by outcome",
            "Requests/s through the sidecars, by outcome." + see(OUTCOMES, THROUGHPUT),
            "reqps",
            targets(
                (f"sum by (outcome) (rate(sidecar_requests_total{{{SEL}}}[{RATE}]))", "{{outcome}}")
            ),
            stack=True,
        ),
        timeseries(
            "Token throughput",
            "Prompt and output tokens/s of successful requests (the replica's usage)."
            + see(THROUGHPUT, TOKENS),
            TOKENS_PER_S,
            targets(
                (f"sum(rate(sidecar_prompt_tokens_total{{{SEL}}}[{RATE}]))", "prompt"),
                (f"sum(rate(sidecar_generation_tokens_total{{{SEL}}}[{RATE}]))", "output"),
            ),
        ),
        timeseries(
            "TTFT and E2E, client side: p50 and p99",
            "What the replay's requests experienced at the sidecar's client vantage: "
            "time to first token (TTFT) and end-to-end latency (E2E)."
            + see(METRICS_DEFS, VANTAGES, PERCENTILES),
            "s",
            targets(
                (
                    quantile(
                        "0.5", "sidecar_time_to_first_token_seconds", f'vantage="client", {SEL}'
                    ),
                    "TTFT p50",
                ),
                (
                    quantile(
                        "0.99", "sidecar_time_to_first_token_seconds", f'vantage="client", {SEL}'
                    ),
                    "TTFT p99",
                ),
                (
                    quantile(
                        "0.5", "sidecar_e2e_request_latency_seconds", f'vantage="client", {SEL}'
                    ),
                    "E2E p50",
                ),
                (
                    quantile(
                        "0.99", "sidecar_e2e_request_latency_seconds", f'vantage="client", {SEL}'
                    ),
                    "E2E p99",
                ),
            ),
        ),
        timeseries(
            "Attainment per SLO class",
            "Good / counted requests per SLO class (all models and replicas: the SLO "
            "counters carry neither)." + see(SLOS),
            "percentunit",
            targets((attainment(RATE), "{{slo_class}}")),
            maximum=1,
        ),
        heatmap(
            "Prompt lengths",
            "Prompt tokens (N_in, from usage) per successful request." + see(TOKENS),
            "short",
            "sidecar_request_prompt_tokens",
            f'{TARGET}, model=~"$model"',
        ),
        heatmap(
            "Output lengths",
            "Output tokens (N_out) per successful request." + see(TOKENS),
            "short",
            "sidecar_request_generation_tokens",
            f'{TARGET}, model=~"$model"',
        ),
        row("Sender"),
        stat(
            "Sent / planned",
            "Requests the replay senders have sent, of all they planned "
            "(every run of --repeats counted)." + see(OTHER_TOOLS),
            "percentunit",
            [
                target(
                    f"sum(sidecar_replay_requests_sent_total{{{replay}}}) / "
                    f"sum(sidecar_replay_requests_planned_total{{{replay}}})",
                    "sent",
                    instant=True,
                )
            ],
            w=6,
        ),
        timeseries(
            "Send lateness: p50 and p99",
            "Sender lateness: actual send - scheduled send of open-loop requests, all "
            "shards pooled." + see(OTHER_TOOLS),
            "s",
            targets(
                (quantile("0.5", "sidecar_replay_send_lateness_seconds", replay), "p50"),
                (quantile("0.99", "sidecar_replay_send_lateness_seconds", replay), "p99"),
            ),
            w=6,
        ),
        timeseries(
            "Sender: in flight by shard",
            "Requests sent and not finished, per shard (the replayer's concurrency)."
            + see(THROUGHPUT),
            "short",
            targets(
                (
                    f"sum by (shard) (sidecar_replay_in_flight_requests{{{replay}}})",
                    "shard {{shard}}",
                )
            ),
            w=6,
        ),
        timeseries(
            "Sender: finished/s by outcome",
            "As the replayer saw them (its own client vantage), all shards."
            + see(OUTCOMES, VANTAGES),
            "reqps",
            targets(
                (
                    f"sum by (outcome) (rate(sidecar_replay_requests_completed_total"
                    f"{{{replay}}}[{RATE}]))",
                    "{{outcome}}",
                )
            ),
            stack=True,
            w=6,
        ),
        row("Capture"),
        timeseries(
            "Records captured/s",
            "sidecar_capture_records_written per sidecar: "
            "request records written to trace files." + see(DROPS),
            "suffix: records/s",
            targets(
                (
                    f"sum by (instance) (rate(sidecar_capture_records_written_total"
                    f"{{{TARGET}}}[{RATE}]))",
                    "{{instance}}",
                )
            ),
            w=8,
        ),
        timeseries(
            "Records not captured",
            "sidecar_capture_records_dropped per interval: the writer's queue was full "
            "(queue_full), a write failed (write_error) or no directory was writable "
            "(unwritable). Any is a gap in the trace." + see(DROPS),
            "short",
            targets(
                (
                    f"sum by (instance, reason) (increase("
                    f"sidecar_capture_records_dropped_total{{{TARGET}}}[{RATE}]))",
                    "{{instance}} {{reason}}",
                )
            ),
            w=8,
        ),
        timeseries(
            "Capture writer queue",
            "sidecar_capture_queue_records: records waiting for the capture writer." + see(DROPS),
            "short",
            targets((f"sidecar_capture_queue_records{{{TARGET}}}", "{{instance}}")),
            w=8,
        ),
    ]
    return dashboard(
        "vllm-sidecar-replay",
        "vLLM sidecar / Replay run",
        "A replay or a capture in progress, seen through the sidecar.",
        panels,
        list(COMMON_VARIABLES),
    )


# --- Sidecar health --------------------------------------------------------------------------


def stamps_late_panel() -> Panel:
    """Loop lag and GC pauses of the processes that stamp the chunks, beside the SLO."""
    lag_quantiles = [
        (
            quantile(q, "sidecar_loop_lag_seconds", TARGET, by="instance"),
            f"{{{{instance}}}} loop lag {label}",
        )
        for q, label in (("0.99", "p99"), ("0.5", "p50"))
    ]
    return timeseries(
        "How late the sidecar's stamps may be",
        "Every chunk is stamped on a worker's event loop; while the loop stalls (a garbage "
        "collection, a burst of work, a slow sink or log handler) what arrives is stamped "
        "when the stall ends. Loop lag p99 and p50 per sidecar, over all its workers "
        "(sidecar_loop_lag_seconds: how late a timer due every 0.1 s ran, a sample of how "
        "late a stamp taken at any moment is; below 1 ms it is uvloop's timer granularity, "
        "no stall), the longest garbage-collection pause in each interval "
        "(sidecar_gc_pause_seconds, every generation: the upper bound of the highest bucket "
        "a pause fell in; the _max_seconds gauges are maxima since start, not per interval), "
        "and the strictest TPOT threshold the sidecars declare. The line at 10 ms is "
        "SidecarStampsLate's bound (p99 above it for 10 minutes). Compare with your ITL "
        "SLO: a lag of a few ms beside a 50 ms objective is noise. A lag or pause of the "
        "order of the SLO is in what the sidecar reports: a stall delays the read stamp of "
        "the token after it, so the gap before that token is recorded longer by up to the "
        "stall (ITL tail and maximum pessimistic) and the gap after it shorter (low ITL "
        "percentiles optimistic); TTFT is recorded longer when its first token's read is "
        "late, shorter when the request's arrival stamp is. An ITL spike at the time of a "
        "GC pause is the sidecar's own." + see(STAMPS, STAMPS_LATE),
        "s",
        targets(
            *lag_quantiles,
            (
                "histogram_quantile(1, sum by (le, instance) (rate("
                f"sidecar_gc_pause_seconds_bucket{{{TARGET}}}[{RATE}])))",
                "{{instance}} longest GC pause",
            ),
            (
                f'min(sidecar_slo_threshold_seconds{{metric="tpot", {TARGET}}})',
                "strictest TPOT SLO",
            ),
        ),
        thresholds=[(0.01, "orange")],
        w=24,
    )


def own_delay_panel() -> Panel:
    """What the sidecar itself adds to each token: its own delay per relayed event."""
    return timeseries(
        "The sidecar's own delay per token",
        "sidecar_relay_delay_seconds p50, p99 and p99.9 per sidecar: for each token event "
        "it relayed, from the event's bytes reaching its upstream socket (the kernel's "
        "receive stamp) to their hand-off to the client socket, over streams relayed event "
        "for event. The client vantage's latencies are the server vantage's plus this: "
        "beside a TTFT or ITL objective of tens of milliseconds, tens of microseconds are the "
        "cost of measuring; a tail of the order of the objective is the sidecar's, and its "
        "loop lag and GC pauses (the panel above) say why." + see(OWN_DELAY, STAMPS),
        "s",
        targets(
            *(
                (
                    quantile(q, "sidecar_relay_delay_seconds", TARGET, by="instance"),
                    f"{{{{instance}}}} {label}",
                )
                for q, label in (("0.5", "p50"), ("0.99", "p99"), ("0.999", "p99.9"))
            )
        ),
        w=24,
    )


def health_dashboard() -> dict[str, Any]:
    lost = "docs/runbooks.md (the alert of the same name) says what to do."
    panels = [
        row("Is the sidecar keeping up"),
        timeseries(
            "CPU of the sidecar's main process",
            "process_cpu_seconds_total per sidecar, in cores: the process you start, "
            "which with --workers N is the collector (aggregation, scrapes, sinks, "
            "capture writer); its worker processes are not in it (the panels beside). "
            "One core busy is a saturated event loop: every token it relays waits."
            + see(PROCESSES),
            "short",
            targets((f"rate(process_cpu_seconds_total{{{TARGET}}}[{RATE}])", "{{instance}}")),
            w=6,
        ),
        timeseries(
            "Memory of the sidecar's main process",
            "process_resident_memory_bytes per sidecar (the live window of records "
            "lives here)." + see(PROCESSES),
            "bytes",
            targets((f"process_resident_memory_bytes{{{TARGET}}}", "{{instance}}")),
            w=6,
        ),
        timeseries(
            "Load per worker process",
            "sidecar_channel_records_total: request records each worker process sent "
            "the collector per second, i.e. the requests it served (--workers N; "
            "SO_REUSEPORT spreads connections, not requests, so long-lived connections "
            "can load one worker more). Beside it the workers alive of those "
            "configured, and restarts." + see(PROCESSES, DROPS),
            "reqps",
            targets(
                (
                    f"sum by (instance, worker) (rate(sidecar_channel_records_total"
                    f"{{{TARGET}}}[{RATE}]))",
                    "{{instance}} worker {{worker}}",
                ),
                (f"sidecar_workers_alive{{{TARGET}}}", "{{instance}} alive"),
                (f"sidecar_workers{{{TARGET}}}", "{{instance}} configured"),
                (
                    f"sum by (instance) (increase(sidecar_worker_restarts_total"
                    f"{{{TARGET}}}[{RATE}]))",
                    "{{instance}} restarts",
                ),
            ),
            w=6,
        ),
        timeseries(
            "CPU per worker process",
            "sidecar_worker_cpu_seconds_total per worker process, user and system together, "
            "in cores: what relaying the traffic costs (the collector's own is the first "
            "panel). One core busy is a saturated worker: its reads wait, and every stamp it "
            "takes with them. Divided by the requests per worker beside it, the CPU per "
            "request, to size a deployment by." + see(PROCESSES),
            "short",
            targets(
                (
                    f"sum by (instance, worker) (rate(sidecar_worker_cpu_seconds_total"
                    f"{{{TARGET}}}[{RATE}]))",
                    "{{instance}} worker {{worker}}",
                )
            ),
            w=6,
        ),
        stamps_late_panel(),
        own_delay_panel(),
        timeseries(
            "How long the sidecar's scrapes take",
            "scrape_duration_seconds of the sidecars' scrape job, per sidecar: what Prometheus "
            "waited for each /metrics (a scrape that timed out shows its timeout). A full live "
            "window's scrape takes tens to a few hundred milliseconds; the scrape runs at the "
            "lowest CPU priority, so seconds mean the sidecar has no CPU to spare, its records "
            "wait behind the scrape (dropped past its backlog) and slower scrapes are lost. The "
            "line at 3 s is SidecarScrapesSlow's bound (a 5-minute average above it for 10 "
            "minutes)." + see(SCRAPES_SLOW, PROCESSES),
            "s",
            targets((f"scrape_duration_seconds{{{TARGET}}}", "{{instance}}")),
            thresholds=[(3.0, "orange")],
            w=24,
        ),
        row("Records lost on the way out"),
        timeseries(
            "Sink errors",
            "sidecar_sink_errors_total per interval, by sink: records a sink failed to "
            "take (an exception in it; serving goes on). " + lost + see(DROPS),
            "short",
            targets(
                (
                    f"sum by (instance, sink) (increase(sidecar_sink_errors_total"
                    f"{{{TARGET}}}[{RATE}]))",
                    "{{instance}} {{sink}}",
                )
            ),
            w=12,
        ),
        timeseries(
            "Records dropped by queued sinks",
            "sidecar_sink_records_dropped_total per interval, by sink: records a "
            "queued sink (OpenTelemetry) dropped because its queue was full. " + lost + see(DROPS),
            "short",
            targets(
                (
                    f"sum by (instance, sink) (increase("
                    f"sidecar_sink_records_dropped_total{{{TARGET}}}[{RATE}]))",
                    "{{instance}} {{sink}}",
                )
            ),
            w=12,
        ),
        timeseries(
            "Records lost between workers and the collector",
            "sidecar_channel_dropped_records_total per interval, by reason: "
            "channel_full (the collector fell behind), channel_closed, encode_error, "
            "decode_error, scrape_backlog (a scrape starved of CPU held the sinks), "
            "worker_died. None of the sidecar's metrics count these "
            "requests. " + lost + see(DROPS),
            "short",
            targets(
                (
                    f"sum by (instance, reason) (increase("
                    f"sidecar_channel_dropped_records_total{{{TARGET}}}[{RATE}]))",
                    "{{instance}} {{reason}}",
                )
            ),
            w=12,
        ),
        timeseries(
            "Capture: records not written, writer restarts",
            "sidecar_capture_records_dropped_total per interval by reason (queue_full, "
            "write_error, unwritable), and sidecar_capture_writer_restarts_total (the "
            "writer thread found dead and started again). " + lost + see(DROPS),
            "short",
            targets(
                (
                    f"sum by (instance, reason) (increase("
                    f"sidecar_capture_records_dropped_total{{{TARGET}}}[{RATE}]))",
                    "{{instance}} {{reason}}",
                ),
                (
                    f"sum by (instance) (increase(sidecar_capture_writer_restarts_total"
                    f"{{{TARGET}}}[{RATE}]))",
                    "{{instance}} writer restarts",
                ),
            ),
            w=12,
        ),
    ]
    return dashboard(
        "vllm-sidecar-health",
        "vLLM sidecar / Sidecar health",
        "The sidecar's own health: CPU, memory and worker load, how late its stamps may "
        "be (event-loop lag, GC pauses), and every record lost between the relay and the "
        "sinks.",
        panels,
        variables_except("model", "replica", "slo_class"),
    )


DASHBOARDS = {
    "sidecar-slo.json": slo_dashboard,
    "sidecar-latency.json": latency_dashboard,
    "sidecar-replicas.json": replicas_dashboard,
    "sidecar-replay.json": replay_dashboard,
    "sidecar-health.json": health_dashboard,
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
