"""Grafana dashboards: structure, and every query run on a real Prometheus with real data.

The key test starts two simulated vLLM replicas (vLLM-named /metrics), the sidecar in front of
them with the shipped settings (deploy/kubernetes/base/sidecar.toml), and a real Prometheus
configured from deploy/compose/prometheus/prometheus.cpu.yml (its relabeling included, only the
targets swapped) with the shipped rule file. After a short load it evaluates every PromQL
expression in grafana/ (panels and template variables) and in the PrometheusRule, with the
template variables substituted, and asserts that each returns data.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import itertools
import json
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import pytest
import yaml
from otlp_receiver import OTLPReceiver
from prometheus_helpers import Prometheus, free_port, require_module, running_prometheus
from proxy_stack import FAST_ENGINE

from sidecar.config import build_config, load_config_file
from sidecar.replay import replay_cli
from sidecar.serve import build_collector
from sidecar.sim.server import SimConfig, close_replicas, start_replicas
from sidecar.tracefile import TraceHeader, TraceRequest, write_trace

ROOT = Path(__file__).resolve().parents[1]
GRAFANA = ROOT / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
SIDECAR_TOML = ROOT / "deploy/kubernetes/base/sidecar.toml"
PROMETHEUS_CPU = ROOT / "deploy/compose/prometheus/prometheus.cpu.yml"
RULES = ROOT / "deploy/prometheus/sidecar-rules.yml"
PROMETHEUS_RULE = ROOT / "deploy/kubernetes/base/prometheusrule.yaml"
MODEL = "sim-model"
SIDECAR_JOB = "vllm-sidecar"  # the scrape job the alerts watch
WORKERS = 2
# Labels a Prometheus adds only in some places (a global view, Kubernetes): absent here, and a
# variable over them has no values, so Grafana's All (.*) applies.
OPTIONAL_LABELS = {"cluster", "namespace"}

# Grafana's built-in variables, with values that cover this test's whole history (a minute at
# most), so that every rate window holds the load.
BUILTINS = {
    "__rate_interval": "1m",
    "__interval": "15s",
    "__range": "5m",
    "__range_s": "300",
    "__range_ms": "300000",
    "__interval_ms": "15000",
}
NOT_DATA_PANELS = {"row", "text"}
PREFERRED = {"model": MODEL, "slo_class": "default"}


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("grafana_generate", GRAFANA / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dashboards() -> dict[str, dict[str, Any]]:
    return {path.name: json.loads(path.read_text()) for path in DASHBOARDS}


def all_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # panels inside collapsed rows


def variable_query(variable: dict[str, Any]) -> str:
    query = variable.get("query")
    return str(query.get("query", "")) if isinstance(query, dict) else str(query or "")


# --- structure -------------------------------------------------------------------------------


def test_the_json_is_what_generate_py_writes() -> None:
    rendered = load_generator().render()
    assert sorted(rendered) == [path.name for path in DASHBOARDS]
    for name, content in rendered.items():
        assert (GRAFANA / "dashboards" / name).read_text() == content, (
            f"grafana/dashboards/{name} is stale: run python grafana/generate.py"
        )


def test_the_five_dashboards_exist_with_unique_uids() -> None:
    boards = dashboards()
    titles = {d["title"] for d in boards.values()}
    assert len(boards) == 5
    for word in ("SLO compliance", "Latency", "Replicas", "Replay run", "Sidecar health"):
        assert any(word in title for title in titles), (word, titles)
    uids = [d["uid"] for d in boards.values()]
    assert len(set(uids)) == len(uids)


def test_panel_ids_are_unique_and_panels_do_not_overlap() -> None:
    for name, dashboard in dashboards().items():
        ids = [panel["id"] for panel in all_panels(dashboard)]
        assert len(ids) == len(set(ids)), (name, ids)
        cells: dict[tuple[int, int], str] = {}
        for panel in all_panels(dashboard):
            grid = panel["gridPos"]
            assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, (name, panel["title"])
            for x, y in itertools.product(
                range(grid["x"], grid["x"] + grid["w"]), range(grid["y"], grid["y"] + grid["h"])
            ):
                assert (x, y) not in cells, (name, panel["title"], cells[(x, y)])
                cells[(x, y)] = panel["title"]


def test_every_data_panel_has_a_unit_and_uses_the_datasource_variable() -> None:
    for name, dashboard in dashboards().items():
        for panel in all_panels(dashboard):
            if panel["type"] in NOT_DATA_PANELS:
                continue
            where = f"{name}: {panel['title']}"
            unit = panel["fieldConfig"]["defaults"].get("unit")
            assert isinstance(unit, str) and unit, f"{where}: no unit"
            for override in panel["fieldConfig"].get("overrides", []):
                for prop in override["properties"]:
                    if prop["id"] == "unit":
                        assert prop["value"], where
            if panel["type"] == "heatmap":
                assert panel["options"]["yAxis"]["unit"] == unit, where
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
            assert panel["targets"], f"{where}: no query"
            for query in panel["targets"]:
                assert query["datasource"] == panel["datasource"], where
                assert query["expr"].strip(), where
            assert panel.get("description"), f"{where}: say what the panel shows"


# Which variables each dashboard has besides the place (cluster, namespace, job), which every
# one has.
VARIABLES = {
    "sidecar-slo.json": {"model", "replica", "slo_class", "slo_window"},
    "sidecar-latency.json": {"model", "replica", "slo_class"},
    # The SLO counters carry no model or replica label: no per-replica SLO view.
    "sidecar-replicas.json": {"model", "replica"},
    "sidecar-replay.json": {"model", "replica", "slo_class"},
    "sidecar-health.json": set(),
}
PLACE_VARIABLES = ("cluster", "namespace", "job")


def test_template_variables_place_model_replica_slo_class_and_datasource() -> None:
    assert set(VARIABLES) == set(dashboards())
    for name, dashboard in dashboards().items():
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        assert set(variables) == {"datasource", *PLACE_VARIABLES} | VARIABLES[name], name
        datasource = variables["datasource"]
        assert datasource["type"] == "datasource" and datasource["query"] == "prometheus"
        chained: list[str] = []
        for var, variable in variables.items():
            if variable["type"] != "query":
                continue
            assert variable["datasource"]["uid"] == "${datasource}", (name, var)
            match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable_query(variable))
            assert match and match.group(2) == var, (name, var)
            assert variable["multi"] and variable["includeAll"]
            assert variable["allValue"] == ".*"
            assert variable.get("description"), (name, var)
            # Each narrows by the ones before it: cluster, then namespace, then job, ...
            for earlier in chained:
                if earlier in PLACE_VARIABLES or (earlier == "model" and var == "replica"):
                    assert f'{earlier}=~"${earlier}"' in match.group(1), (name, var, earlier)
            chained.append(var)
        assert chained[:3] == list(PLACE_VARIABLES), name
        text = json.dumps(dashboard["panels"]) + json.dumps(
            [variable_query(v) for v in variables.values()]
        )
        for var in variables:
            if var != "datasource":
                assert f"${var}" in text or f"${{{var}" in text, f"{name}: ${var} unused"


SERIES = re.compile(r"(?<![\w:])((?:sidecar|vllm|process)[_:][a-zA-Z0-9_:]*)(\{[^}]*\})?")


def selectors(expr: str) -> list[tuple[str, str]]:
    """(metric, label matchers) of every series selector in a PromQL expression."""
    return [(m.group(1), m.group(2) or "") for m in SERIES.finditer(expr)]


def test_every_query_selects_the_place_and_the_sidecars_job() -> None:
    """Every series selected by cluster and namespace; the sidecar's own series (and the
    recorded ones, which keep the label) by job too. vLLM's and the replayer's series have
    jobs of their own."""
    checked = 0
    for where, expr in dashboard_queries():
        for metric, matchers in selectors(expr):
            checked += 1
            assert 'cluster=~"$cluster"' in matchers, (where, metric)
            assert 'namespace=~"$namespace"' in matchers, (where, metric)
            own = not (metric.startswith("vllm:") or metric.startswith("sidecar_replay_"))
            assert ('job=~"$job"' in matchers) is own, (where, metric)
    assert checked > 150
    assert selectors('sum(rate(sidecar_x_total{a="b"}[5m])) / vllm:y') == [
        ("sidecar_x_total", '{a="b"}'),
        ("vllm:y", ""),
    ]


def test_long_ranges_are_instant_queries_over_recorded_series() -> None:
    """A query over the dashboard's whole range or the SLO window is evaluated once (instant),
    not at every step of a graph; over the SLO window it reads the rules' 5-minute
    recordings, not 30 days of raw counters."""
    for name, dashboard in dashboards().items():
        for panel in all_panels(dashboard):
            for query in panel.get("targets", []):
                expr = query["expr"]
                where = (name, panel["title"], query["refId"])
                if "$__range" in expr or "$slo_window" in expr:
                    assert query["instant"] is True and query["range"] is False, where
                    assert panel["type"] in ("stat", "table"), where
                if "$slo_window" in expr:
                    for metric, _ in selectors(expr):
                        assert metric.startswith("sidecar:"), (where, metric)
                assert not re.search(r"\[\d+d\]", expr), (where, "a literal day range")


def test_the_error_budget_is_clamped_and_its_overspend_stated() -> None:
    slo = dashboards()["sidecar-slo.json"]
    (panel,) = [p for p in all_panels(slo) if p["title"].startswith("Error budget over")]
    left, spent = panel["targets"]
    assert left["expr"] == f"clamp(1 - {spent['expr']}, 0, 1)"
    assert "clamp" not in spent["expr"], "the overspend is not capped"
    units = {o["matcher"]["options"]: o["properties"] for o in panel["fieldConfig"]["overrides"]}
    assert units["B"] == [{"id": "unit", "value": "suffix:x budget"}]
    assert panel["fieldConfig"]["defaults"]["unit"] == "percentunit"
    assert "overspent" in panel["description"]


def test_the_objective_is_the_sidecars_configuration() -> None:
    """No objective written into a dashboard: it comes from sidecar_slo_objective_ratio (or
    the rules' error budget recorded from it), as in the alerts."""
    for name, dashboard in dashboards().items():
        variables = {v["name"] for v in dashboard["templating"]["list"]}
        assert "objective" not in variables, name
    for where, expr in dashboard_queries():
        without_quantiles = re.sub(r"histogram_quantile\(0\.\d+,", "", expr)
        assert not re.search(r"0\.9\d*", without_quantiles), where
    text = json.dumps(dashboards()["sidecar-slo.json"])
    assert "sidecar_slo_objective_ratio" in text and "sidecar:slo_error_budget:ratio" in text


def test_vllms_coarse_histograms_are_compared_by_their_means() -> None:
    """histogram_quantile inside vLLM's coarse buckets would suggest overhead that is not
    there: no percentile of a vLLM histogram anywhere, means beside the sidecar's."""
    compared = set()
    for where, expr in dashboard_queries():
        for match in re.finditer(
            r"histogram_quantile\([^,]+, sum by \([^)]*\) \(rate\("
            r"([\w:]+)_bucket",
            expr,
        ):
            assert not match.group(1).startswith("vllm:"), where
        compared.update(re.findall(r"(vllm:\w+_seconds)_sum", expr))
    assert compared >= {
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:request_time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
    }


def test_the_sidecars_own_health_has_panels() -> None:
    queried = " ".join(expr for _, expr in dashboard_queries())
    for metric in (
        "sidecar_sink_errors_total",
        "sidecar_sink_records_dropped_total",
        "sidecar_capture_records_dropped_total",
        "sidecar_capture_writer_restarts_total",
        "sidecar_channel_dropped_records_total",
        "sidecar_channel_records_total",
        "sidecar_workers_alive",
        "sidecar_engine_queue_time_seconds_bucket",
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "sidecar_slo_excluded_requests_total",
        "sidecar_loop_lag_seconds_bucket",
        "sidecar_gc_pause_seconds_bucket",
        "sidecar_relay_delay_seconds_bucket",
        "sidecar_worker_cpu_seconds_total",
    ):
        assert metric in queried, metric


def test_every_panel_cites_where_its_quantities_are_defined() -> None:
    headings = {}
    for page in ("metrics.md", "workers.md", "runbooks.md"):
        headings[page] = {
            re.sub(r"^\d+\.\s*", "", h).strip()
            for h in re.findall(r"^#+ (.+)$", (ROOT / "docs" / page).read_text(), re.MULTILINE)
        }
    for name, dashboard in dashboards().items():
        for panel in all_panels(dashboard):
            if panel["type"] in NOT_DATA_PANELS:
                continue
            cited = re.findall(r'docs/(\w+\.md) "([^"]+)"', panel["description"])
            assert cited, (name, panel["title"], "cites no definition")
            for page, heading in cited:
                assert heading in headings[page], (name, panel["title"], page, heading)


def test_the_foundation_sdk_keeps_every_key() -> None:
    """grafana-foundation-sdk's models read the JSON leniently; a key they drop is one Grafana
    does not know either (a misspelt fieldConfig, unit, ...)."""
    dashboard_models = require_module(
        "grafana_foundation_sdk.models.dashboard", "grafana-foundation-sdk"
    )

    def plain(value: Any) -> Any:
        if hasattr(value, "to_json"):
            return plain(value.to_json())
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value

    lost: set[str] = set()

    def compare(original: Any, kept: Any, path: str) -> None:
        if isinstance(original, dict):
            for key, value in original.items():
                if not isinstance(kept, dict) or key not in kept:
                    lost.add(f"{path}/{key}")
                else:
                    compare(value, kept[key], f"{path}/{key}")
        elif isinstance(original, list):
            for value, other in zip(original, kept, strict=False):
                compare(value, other, f"{path}[]")

    for name, dashboard in dashboards().items():
        model = dashboard_models.Dashboard.from_json(dashboard)
        compare(dashboard, plain(model), name)
    # `definition` (the variable query as shown in the editor) is not in the SDK's model.
    assert {key for key in lost if not key.endswith("/templating/list[]/definition")} == set()


def test_provisioning_points_where_compose_mounts_the_dashboards() -> None:
    datasources = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yaml").read_text())
    (datasource,) = datasources["datasources"]
    assert datasources["apiVersion"] == 1 and datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((GRAFANA / "provisioning/dashboards/vllm-sidecar.yaml").read_text())
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    for compose_file in ("docker-compose.yml", "docker-compose.cpu.yml"):
        compose = yaml.safe_load((ROOT / "deploy/compose" / compose_file).read_text())
        mounts = dict(
            volume.rsplit(":", 2)[:2] if volume.count(":") == 2 else volume.split(":", 1)
            for volume in compose["services"]["grafana"]["volumes"]
        )
        assert mounts["../../grafana/dashboards"] == provider["options"]["path"]
        assert mounts["../../grafana/provisioning"] == "/etc/grafana/provisioning"
        home = compose["services"]["grafana"]["environment"][
            "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"
        ]
        assert (GRAFANA / "dashboards" / Path(home).name).is_file()


# --- every query on a real Prometheus --------------------------------------------------------


def substitute(expr: str, values: dict[str, str]) -> str:
    """Replace $name, ${name} and ${name:format} as Grafana would for these values."""

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise AssertionError(f"unknown variable ${name} in {expr}")
        return values[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", replace, expr)


COMPARISON = re.compile(r"(==|!=|>=|<=|>|<)")


def with_bool(expr: str) -> str:
    """An alert expression with `bool` after each comparison outside label matchers, so that it
    returns its series (0 or 1) whether or not the alert would fire now."""
    out: list[str] = []
    depth = 0
    quote: str | None = None
    i = 0
    while i < len(expr):
        char = expr[i]
        if quote:
            out.append(char)
            if char == "\\":
                out.append(expr[i + 1])
                i += 1
            elif char == quote:
                quote = None
        elif char in "\"'`":
            quote = char
            out.append(char)
        elif char == "{":
            depth += 1
            out.append(char)
        elif char == "}":
            depth -= 1
            out.append(char)
        elif depth == 0 and (match := COMPARISON.match(expr, i)):
            operator = match.group(1)
            out.append(operator)
            i += len(operator)
            if not re.match(r"\s*bool\b", expr[i:]):
                out.append(" bool")
            continue
        else:
            out.append(char)
        i += 1
    return "".join(out)


def dashboard_queries() -> list[tuple[str, str]]:
    found = []
    for name, dashboard in dashboards().items():
        for panel in all_panels(dashboard):
            for query in panel.get("targets", []):
                found.append((f"{name}: {panel['title']} [{query['refId']}]", query["expr"]))
    return found


def rule_expressions() -> list[tuple[str, str, bool]]:
    """(where, expr, is_alert) for every rule of the PrometheusRule."""
    found = []
    resource = yaml.safe_load(PROMETHEUS_RULE.read_text())
    for group in resource["spec"]["groups"]:
        for rule in group["rules"]:
            name = rule.get("alert") or rule.get("record")
            found.append((f"PrometheusRule {group['name']}: {name}", rule["expr"], "alert" in rule))
    return found


def returns_data(prometheus: Prometheus, expr: str) -> str | None:
    """None when the expression returns at least one finite sample, else why not."""
    try:
        result = prometheus.query(expr)
    except AssertionError as exc:
        return f"error: {exc}"
    if not result:
        return "no data"
    values = [float(sample["value"][1]) for sample in result]
    if not any(math.isfinite(value) for value in values):
        return f"only non-finite values {values}"
    return None


def prometheus_config(sidecar_admin: str, replicas: list[str], replay: str) -> str:
    config = yaml.safe_load(PROMETHEUS_CPU.read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(RULES)]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["vllm"]["relabel_configs"], "the join label comes from this relabeling"
    jobs[SIDECAR_JOB]["static_configs"] = [{"targets": [sidecar_admin]}]
    jobs["vllm"]["static_configs"] = [{"targets": replicas}]
    # The compose file finds the load generator by DNS name; here it is an address.
    del jobs["replay"]["dns_sd_configs"]
    jobs["replay"]["static_configs"] = [{"targets": [replay]}]
    # No OpenTelemetry collector runs here; nothing in grafana/ queries its series.
    config["scrape_configs"] = [jobs[SIDECAR_JOB], jobs["vllm"], jobs["replay"]]
    dumped: str = yaml.safe_dump(config, sort_keys=False)
    return dumped


def start_replay(tmp_path: Path, target: str, metrics: str) -> asyncio.Task[int]:
    """`sidecar replay --metrics-listen` of a 5 s trace, straight to a replica (the sidecar's
    counts stay the test's own load), its /metrics kept up until the task is cancelled. It
    starts 3 s from now (--start-at): scrapes see the counters at 0 first, then growing, as
    rate() and histogram_quantile() need."""
    trace = tmp_path / "replay.jsonl"
    write_trace(
        trace,
        TraceHeader(source="test"),
        [TraceRequest(t=i * 0.1, n_in=8, n_out=4) for i in range(50)],
    )
    parser = argparse.ArgumentParser()
    replay_cli.add_arguments(parser)
    args = parser.parse_args(
        [
            str(trace),
            "--target",
            target,
            "--repeats",
            "1",
            "--no-progress",
            "--model",
            MODEL,
            "--metrics-listen",
            metrics,
            "--metrics-linger",
            "600s",
            "--start-at",
            str(time.time() + 3),
        ]
    )
    return asyncio.create_task(replay_cli.run(args))


async def send_load(url: str, count: int, wave: int = 15, pause_s: float = 0.5) -> None:
    """A fixed mix: chat and completions, streamed and not, every SLO class, some failures."""
    classes = ("default", "interactive", "batch")
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> None:
            headers = {"X-SLO-Class": classes[i % 3]}
            if i % 5 == 2:  # alternate parity: both replicas get some (round robin)
                headers["X-Sim-Fault"] = "error_status=500"
            words = " ".join(f"w{i % 7}" for _ in range(20 + (i * 37) % 400))
            stream = i % 5 != 4
            if i % 4 == 3:
                path = "/v1/completions"
                body: dict[str, Any] = {"prompt": words}
            else:
                path = "/v1/chat/completions"
                body = {"messages": [{"role": "user", "content": words}]}
            body.update(
                {"model": MODEL, "stream": stream, "max_tokens": 4 + i % 21, "ignore_eos": True}
            )
            async with session.post(url + path, json=body, headers=headers) as response:
                await response.read()

        # Waves over a few seconds, so that several 1 s scrapes see the counters grow (the
        # first sample of a new series carries no increase for rate()).
        for start in range(0, count, wave):
            await asyncio.gather(*(one(i) for i in range(start, min(count, start + wave))))
            await asyncio.sleep(pause_s)


def wait_until(prometheus: Prometheus, checks: dict[str, Any], timeout_s: float = 40) -> None:
    deadline = time.monotonic() + timeout_s
    pending = dict(checks)
    while pending:
        for expr, expected in list(pending.items()):
            value = prometheus.scalar(expr)
            if value is not None and (expected is None or value == expected):
                del pending[expr]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"Prometheus never answered as expected: {pending}")
        time.sleep(0.25)


@pytest.mark.slow
@pytest.mark.realparts
async def test_every_query_in_grafana_and_the_rules_returns_data(tmp_path: Path) -> None:
    requests = 120
    sim = SimConfig(model=MODEL, engine=FAST_ENGINE, enable_per_request_metrics=True)
    replicas = await start_replicas(sim, 2)
    # As shipped: worker processes and a collector (the per-worker series), an OpenTelemetry
    # sink exporting to a receiver (the queued sink's series), a capture.
    receiver = OTLPReceiver()
    await receiver.start()
    flags = {
        "upstreams": [r.url for r in replicas],
        "listen": "127.0.0.1:0",
        "metrics_listen": "127.0.0.1:0",
        "health_interval": "1s",
        "route_policy": "round_robin",
        "engine_scrape_interval": "0",
        "capture_dir": str(tmp_path / "captures"),
        "otel_endpoint": receiver.url,
    }
    config = build_config(flags, {}, load_config_file(SIDECAR_TOML))
    server, _window = build_collector(config, WORKERS)
    await server.start()
    try:
        admin = server.admin_url.split("://")[1]
        targets = [r.url.split("://")[1] for r in replicas]
        replay_metrics = f"127.0.0.1:{free_port()}"
        with running_prometheus(
            prometheus_config(admin, targets, replay_metrics), tmp_path / "prometheus"
        ) as prometheus:
            replay = start_replay(tmp_path, replicas[1].url, replay_metrics)
            try:
                await asyncio.to_thread(
                    wait_until,
                    prometheus,
                    {
                        f'sum(up{{job="{SIDECAR_JOB}"}})': 1,
                        'sum(up{job="vllm"})': len(replicas),
                        'sum(up{job="replay"})': 1,
                    },
                )
                await send_load(server.url, requests)
                await asyncio.to_thread(
                    wait_until,
                    prometheus,
                    {
                        "sum(sidecar_slo_requests_total)": requests,
                        "sum(sidecar_capture_records_written_total)": requests,
                        'count(vllm:num_requests_running{replica=~".+"})': len(replicas),
                        "count(sidecar:slo_error_ratio:rate6h)": 3,
                        "sum(sidecar_replay_requests_completed_total)": 50,
                        "sum(sidecar_workers_alive)": WORKERS,
                        "count(sidecar:slo_burn_rate:rate3d)": 3,
                    },
                )
                await asyncio.to_thread(check_settled, prometheus, targets)
            finally:
                replay.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await replay
    finally:
        await server.close()
        await close_replicas(replicas)
        await receiver.close()


def check_settled(prometheus: Prometheus, replica_addresses: list[str], attempts: int = 3) -> None:
    """`check_every_expression`, again after a few seconds when a query found no data: on a
    loaded host (the suite runs in parallel processes) a scrape can time out (1 s here), and
    until the next one the target's series are stale, so every rule and panel reading them at
    that instant finds nothing. A series that is missing for good fails every attempt."""
    for attempt in range(attempts):
        try:
            check_every_expression(prometheus, replica_addresses)
            return
        except AssertionError:
            if attempt == attempts - 1:
                raise
            time.sleep(3.0)  # a few scrapes (1 s) and rule evaluations (1 s) later


def check_every_expression(prometheus: Prometheus, replica_addresses: list[str]) -> None:
    failures: list[str] = []
    evaluated = 0
    # The rules loaded into this Prometheus evaluate without error.
    groups = prometheus.get("/api/v1/rules")["groups"]
    loaded = {rule["name"]: rule for group in groups for rule in group["rules"]}
    for where, _expr, _alert in rule_expressions():
        rule = loaded.get(where.rsplit(": ", 1)[1])
        if rule is None or rule["health"] != "ok":
            failures.append(f"{where}: not loaded or unhealthy: {rule}")

    for where, expr, is_alert in rule_expressions():
        evaluated += 1
        problem = returns_data(prometheus, with_bool(expr) if is_alert else expr)
        if problem:
            failures.append(f"{where}: {problem}\n    {expr}")

    # Template variables: each label_values() query, then every panel query, once with the
    # "All" value (.*) and once with concrete values from those label_values() results.
    for name, dashboard in dashboards().items():
        concrete = dict(BUILTINS)
        every = dict(BUILTINS)
        for variable in dashboard["templating"]["list"]:
            var = variable["name"]
            if variable["type"] == "datasource":
                continue
            if variable["type"] == "custom":
                concrete[var] = every[var] = variable["current"]["value"]
                continue
            match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable_query(variable))
            assert match, variable
            selector, label = match.groups()
            # Over the last minute, as Grafana asks for label values over the dashboard's
            # range (not at one instant): a scrape that failed a moment ago (a loaded host)
            # leaves its series stale at the instant, not gone from the range.
            window = BUILTINS["__rate_interval"]
            expr = (
                f"count by ({label}) (last_over_time({substitute(selector, concrete)}[{window}]))"
            )
            evaluated += 1
            values = sorted(sample["metric"].get(label, "") for sample in prometheus.query(expr))
            if var in OPTIONAL_LABELS and values in ([], [""]):
                concrete[var] = every[var] = variable["allValue"]
                continue
            if not values or "" in values:
                failures.append(f"{name}: variable ${var}: {expr} -> {values}")
                # Bound to "All", so that the variables and queries after it still run and
                # the assertion below names this failure, not a variable left unbound.
                concrete[var] = every[var] = variable["allValue"]
                continue
            # "default" declares every threshold (ttft, tpot, e2e) in the shipped sidecar.toml;
            # "batch" declares only e2e, so its TTFT threshold line is rightly empty.
            preferred = PREFERRED.get(var)
            concrete[var] = preferred if preferred and preferred in values else values[0]
            every[var] = variable["allValue"]
        if "model" in concrete:
            assert concrete["model"] == MODEL
            assert concrete["replica"] in replica_addresses
        for bindings in (every, concrete):
            for where, expr in dashboard_queries():
                if not where.startswith(name):
                    continue
                evaluated += 1
                problem = returns_data(prometheus, substitute(expr, bindings))
                if problem:
                    failures.append(f"{where} with {bindings}: {problem}\n    {expr}")
    assert not failures, f"{len(failures)} of {evaluated} failed:\n" + "\n".join(failures)
    assert evaluated > 200


def test_with_bool_leaves_label_matchers_alone() -> None:
    assert with_bool('a{x!="1"} > 0.5 and b{y=~"z"} <= 2') == (
        'a{x!="1"} > bool 0.5 and b{y=~"z"} <= bool 2'
    )
    assert with_bool("a > bool 1") == "a > bool 1"
    assert substitute(
        'x{m=~"$model"}[$__rate_interval] ${slo_class}',
        {"model": ".*", "__rate_interval": "1m", "slo_class": "a"},
    ) == ('x{m=~".*"}[1m] a')
