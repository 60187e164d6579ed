"""Frozen settings of the proxy, from CLI flags, environment variables and a config file.

Precedence (highest first): command-line flag, environment variable ``SIDECAR_<NAME>``, config
file (``--config FILE``, JSON, or TOML on Python >= 3.11), built-in default. Every setting has
one name used in all three places: flag ``--connect-timeout``, env ``SIDECAR_CONNECT_TIMEOUT``,
file key ``connect_timeout``. Where a flag is named otherwise than its setting (``--upstream``
fills ``upstreams``), the flag's name works in the environment and the file too (`ALIASES`).
"""

from __future__ import annotations

import enum
import ipaddress
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit


class ConfigError(ValueError):
    """A setting that cannot be used, with a message that says which and why."""


class RoutePolicy(str, enum.Enum):
    LEAST_OUTSTANDING = "least_outstanding"
    ROUND_ROBIN = "round_robin"
    SESSION = "session"  # session affinity: X-Session-ID header (configurable) or the `user` field
    PREFIX = "prefix"  # prefix affinity: hash of the prompt's first block


# The one duration grammar of the package (settings, SLOs, replay, sweep, trace import): a
# number and a unit. "min" is kept beside "m" because `sidecar trace import` took it.
_DURATION_RE = re.compile(
    r"(?P<number>[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(?P<unit>us|µs|ms|s|min|m|h|d)?"
)
_DURATION_UNITS = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0,
                   "h": 3600.0, "d": 86400.0}


def parse_duration(text: str | float | int, *, bare_unit: str | None = None) -> float:
    """'500ms' -> 0.5, '2s' -> 2.0, '1m' -> 60.0, '250us' -> 0.00025, '2d' -> 172800.0
    (seconds); units us (µs), ms, s, m (min), h, d. 0 needs no unit.

    Anything else without a unit is refused: a bare ``500`` meant 500 ms as often as 500 s,
    and an SLO read as the wrong one passes everything (or nothing) without a word. Only where
    the flag itself names the unit (``bare_unit``: `sidecar trace import`'s --start-at and
    --duration, in SECONDS on the source's clock) is a bare number read in that unit."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
        if value != 0 and bare_unit is None:
            raise ConfigError(f"a duration needs a unit: {text!r} (write e.g. {text}ms or "
                              f"{text}s)")
        value *= _DURATION_UNITS[bare_unit or "s"]
    else:
        match = _DURATION_RE.fullmatch(str(text).strip().lower())
        if match is None:
            raise ConfigError(
                f"not a duration: {text!r} (use e.g. 500ms, 2s, 1m, 2h, 1d)"
            )
        value = float(match["number"]) * _DURATION_UNITS[match["unit"] or bare_unit or "s"]
        if match["unit"] is None and value != 0 and bare_unit is None:
            number = match["number"]
            raise ConfigError(f"a duration needs a unit: {str(text).strip()!r} (write e.g. "
                              f"{number}ms or {number}s)")
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"a duration must be a finite, non-negative number: {text!r}")
    return value


def is_loopback_host(host: str) -> bool:
    """True for a loopback address (127.0.0.0/8, ::1, IPv4-mapped loopback) or ``localhost``;
    False for anything else, wildcards (0.0.0.0, ::) and other host names included."""
    name = host.strip().strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return bool(mapped.is_loopback if mapped is not None else address.is_loopback)


def parse_hostport(text: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """'127.0.0.1:8000' / ':8000' / '8000' / '[::1]:8000' -> (host, port)."""
    raw = text.strip()
    host, sep, port_text = raw.rpartition(":")
    if not sep:
        host, port_text = "", raw
    host = host.strip("[]") or default_host
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"not HOST:PORT: {text!r}") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"port out of range in {text!r}")
    return host, port


def normalise_upstream(url: str) -> str:
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"an upstream must be an http(s) URL like http://127.0.0.1:8000: {url!r}")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        # People paste OpenAI base URLs; the proxy relays paths as the client sent them.
        path = path[: -len("/v1")]
    return f"{parts.scheme}://{parts.netloc}{path}"


def normalise_otel_endpoint(url: str) -> str:
    """An OTLP/HTTP base URL, checked at start rather than at every export interval (a bare
    ``localhost:4318`` is read by urllib as scheme "localhost" and fails each time)."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError("--otel-endpoint must be an http(s) URL like http://127.0.0.1:4318 "
                          f"(OTLP over HTTP): {url!r}")
    return url.strip().rstrip("/")


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    upstreams: tuple[str, ...]
    listen_host: str = "127.0.0.1"
    listen_port: int = 8080
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9464
    route_policy: RoutePolicy = RoutePolicy.LEAST_OUTSTANDING
    session_header: str = "X-Session-ID"
    prefix_block_chars: int = 256  # prefix affinity hashes this many leading prompt characters
    prefix_block_tokens: int = 64  # ... or this many leading token ids for token-id prompts
    # Timeouts in seconds; 0 disables one.
    connect_timeout: float = 5.0
    ttft_timeout: float = 300.0  # upstream send -> first token-carrying event
    idle_timeout: float = 60.0  # longest gap between two upstream reads once streaming
    # Whole request. A ceiling no real generation reaches (a 64k-token answer at 5 tokens/s
    # takes 3.6 h) that still ends a stream which trickles or never ends.
    total_timeout: float = 4 * 3600.0
    # A non-streamed generation relayed whole: nothing arrives until the answer is complete,
    # so neither the TTFT nor the idle timeout can tell a silent replica from a long answer.
    # An hour is ~18k tokens at 5 tokens/s on a loaded replica (the total timeout, if shorter,
    # wins).
    nonstream_timeout: float = 3600.0
    # Events in one streamed response; each costs the record ~16 bytes. A million is a
    # million-token answer at one token per event: beyond it the stream is cut with an error.
    max_stream_events: int = 1_000_000
    # Limits.
    max_body_bytes: int = 16 * 1024 * 1024
    max_concurrency: int = 4096  # requests in flight through the proxy; excess gets 429
    max_event_bytes: int = 4 * 1024 * 1024  # one SSE event; larger is a malformed upstream
    # The traffic listener's connection hygiene (proxy/listener.py); 0 disables a timeout.
    header_timeout: float = 10.0  # a request's head must be complete this long after it began
    body_timeout: float = 60.0  # ... and its body this long after the head
    keepalive_timeout: float = 60.0  # an idle keep-alive client connection closes after this
    max_connections: int = 0  # client connections (next: 503); 0 = from the open-files limit
    max_header_count: int = 100  # request headers (more: 431)
    max_header_bytes: int = 60 * 1024  # request line + headers (more: 431); Envoy's default
    # Behaviour.
    inject_usage: bool = True  # ask the upstream for (continuous) usage, strip what we added
    assemble_nonstream: bool = False  # stream from the upstream for non-streaming clients
    retry_connect: int = 1  # other replicas to try when connecting fails (before any byte)
    health_interval: float = 5.0  # active health checks (GET /health); 0 disables
    health_timeout: float = 2.0
    eject_after: int = 2  # consecutive failures (health or connect) that eject a replica
    window_s: float = 60.0  # live statistics window
    window_max_records: int = 100_000  # bound on the live window, whatever the traffic
    # ... and on its memory (records of long streams are large: ~8 KiB at 256 tokens)
    window_max_bytes: int = 256 * 1024 * 1024
    log_requests: bool = False  # one log line per request (no text, no credentials)
    # SLOs: the default class ("ttft=500ms,tpot=50ms"), named classes (name -> spec), and how a
    # request picks its class: a header naming the class, else its model, else "default".
    slo: str | None = None
    slo_classes: Mapping[str, str] = field(default_factory=dict)
    slo_class_header: str | None = None
    slo_model_classes: Mapping[str, str] = field(default_factory=dict)
    # Export.
    otel_endpoint: str | None = None
    otel_exponential_histograms: bool = False
    otel_traces: bool = False
    otel_provider_name: str = "vllm"
    otel_export_interval: float = 10.0
    otel_server_chunks: bool = False  # also export server-side per-chunk gaps (doubles cost)
    label_cap: int = 64  # distinct values per metric label (model, replica) before "other"
    # Latency histogram bounds (sinks/prometheus.py LATENCY_LAYOUTS): schema3 keeps the
    # dashboards' percentiles within 9.2 % of the exact ones (benchmarks/RESULTS.md).
    histogram_buckets: str = "schema3"
    # Bearer token the admin listener requires (except the probes /healthz and /readyz); None =
    # open admin listener.
    admin_token: str | None = field(default=None, repr=False)
    # An admin listener on a non-loopback address without a token is refused unless this is set
    # (the network in front of it, e.g. a NetworkPolicy, is then what keeps strangers out).
    allow_open_admin: bool = False
    # Capture (traces of the traffic). Text (bodies, completions) only with capture_text.
    capture_dir: str | None = None
    capture_text: bool = False
    capture_compress: bool = False
    capture_rotate_bytes: int = 256 * 1024 * 1024
    capture_rotate_s: float = 3600.0
    capture_queue: int = 10_000
    capture_block_chars: int = 256
    capture_block_tokens: int = 64
    # A key shared by every sidecar of a fleet (a mounted Secret): their prefix hashes and
    # session pseudonyms then agree, so their captures can be merged. Default: a random key
    # per process, never written anywhere.
    capture_key_file: str | None = None
    engine_scrape_interval: float = 15.0  # upstream /metrics scrapes for the engine view; 0=off
    # Processes: `sidecar proxy` runs this many worker processes sharing the traffic port
    # (SO_REUSEPORT), each a whole data plane, and one collector process that owns the sinks
    # and the admin listener (docs/workers.md). None: the CPUs this process may use
    # (`default_workers`). 0: everything in one process, as `ProxyServer` always does.
    workers: int | None = None
    # Bytes of finished records a worker lets wait for the collector before it drops (and
    # counts) new ones instead: the channel never blocks traffic.
    channel_buffer_bytes: int = 8 * 1024 * 1024

    def slo_thresholds(self) -> dict[str, dict[str, float]]:
        """SLO class name -> {metric: seconds}; empty when no SLO was declared."""
        return {name: dict(spec.thresholds) for name, spec in self.slo_specs().items()}

    def slo_specs(self) -> dict[str, SLOSpec]:
        """SLO class name -> its declaration; empty when no SLO was declared."""
        return _slo_specs(self)

    def __post_init__(self) -> None:
        if not self.upstreams:
            raise ConfigError("at least one --upstream URL is required")
        positive_ints = ("max_body_bytes", "max_concurrency", "max_event_bytes", "eject_after",
                         "max_stream_events",
                         "window_max_records", "window_max_bytes", "prefix_block_chars",
                         "prefix_block_tokens", "max_header_count", "max_header_bytes")
        for name in positive_ints:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_connections < 0:
            raise ConfigError("max_connections must be >= 0 (0: from the open-files limit)")
        if self.retry_connect < 0:
            raise ConfigError("retry_connect must be >= 0")
        if self.workers is not None and self.workers < 0:
            raise ConfigError(f"workers must be >= 0 (0: one process), got {self.workers}")
        if self.channel_buffer_bytes <= 0:
            raise ConfigError(f"channel_buffer_bytes must be > 0, got {self.channel_buffer_bytes}")
        if self.window_s <= 0:
            raise ConfigError("window_s must be > 0")
        if self.capture_key_file is not None:
            if not self.capture_dir:
                raise ConfigError("capture_key_file keys capture hashes: it needs --capture DIR")
            read_capture_key(self.capture_key_file)  # refuse a bad key now, not at first use
        if self.capture_text and not self.capture_dir:
            raise ConfigError("capture_text stores prompts and completions: it needs --capture DIR")
        if self.admin_token and not self.admin_token.strip():
            # Compared without surrounding whitespace (a Secret file's newline), a blank
            # token would be no token while looking like one.
            raise ConfigError("the admin token is only whitespace: set a real token, or none")
        if not self.admin_token and not self.allow_open_admin and not is_loopback_host(
                self.metrics_host):
            raise ConfigError(
                f"refusing to serve the admin listener on {self.metrics_host}:{self.metrics_port} "
                "without a bearer token: anyone who can reach that address could read /metrics, "
                "/stats and /replicas (upstream addresses, traffic). Set an admin token "
                "(SIDECAR_ADMIN_TOKEN), or listen on a loopback address (--metrics-listen "
                "127.0.0.1:PORT), or pass --allow-open-admin (SIDECAR_ALLOW_OPEN_ADMIN=1) when "
                "the network already restricts who reaches it"
            )
        for name in ("capture_rotate_bytes", "capture_queue", "capture_block_chars",
                     "capture_block_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        thresholds = self.slo_thresholds()
        for model, name in self.slo_model_classes.items():
            if name not in thresholds:
                raise ConfigError(f"model {model!r} maps to undeclared SLO class {name!r}")
        if self.listen_port != 0 and self.listen_port == self.metrics_port and (
            self.listen_host == self.metrics_host
        ):
            raise ConfigError(
                "the metrics port must differ from the traffic port (admin data stays off the "
                "path clients use)"
            )


def default_workers() -> int:
    """The CPUs this process may use: its affinity mask (taskset, cpusets), bounded by a
    cgroup v2 CPU quota (a container's CPU limit, which the mask does not show: a pod limited
    to 2 CPUs on a 64-core node would otherwise start 64 workers). At least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, quota)
    return max(1, cpus)


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """CPUs allowed by this process's cgroup v2 ``cpu.max`` (quota / period, rounded up), or
    None when there is no quota or no cgroup v2 to read."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    own = next((line[3:] for line in lines if line.startswith("0::")), None)
    for directory in ([root / own.lstrip("/")] if own else []) + [root]:
        try:
            quota, period = (directory / "cpu.max").read_text().split()[:2]
        except (OSError, ValueError):
            continue
        if quota == "max":
            return None
        try:
            return max(1, math.ceil(int(quota) / int(period)))
        except (ValueError, ZeroDivisionError):
            return None
    return None


MIN_CAPTURE_KEY_BYTES = 16


def read_capture_key(path: str) -> bytes:
    """The capture key from a file (a Secret's mount): its bytes, surrounding whitespace
    dropped, at least 16 of them. The key itself is never logged."""
    try:
        key = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"capture key file {path}: {exc.strerror or exc}") from None
    if len(key) < MIN_CAPTURE_KEY_BYTES:
        raise ConfigError(f"capture key file {path}: {len(key)} bytes; it needs at least "
                          f"{MIN_CAPTURE_KEY_BYTES} (e.g. `head -c 32 /dev/urandom | base64`)")
    return key


def _slo_specs(config: ProxyConfig) -> dict[str, SLOSpec]:
    classes = {"default": parse_slo_spec(config.slo)} if config.slo else {}
    for name, spec in config.slo_classes.items():
        if name == "default" and "default" in classes:
            raise ConfigError("SLO class 'default' declared by both --slo and --slo-class")
        classes[name] = parse_slo_spec(spec)
    if classes and "default" not in classes:
        raise ConfigError("named SLO classes need a default class too: add --slo SPEC")
    return classes


_DURATIONS = {"connect_timeout", "ttft_timeout", "idle_timeout", "total_timeout",
              "nonstream_timeout",
              "health_interval", "health_timeout", "window_s", "engine_scrape_interval",
              "capture_rotate_s", "otel_export_interval", "header_timeout", "body_timeout",
              "keepalive_timeout"}
_BOOLS = {"inject_usage", "assemble_nonstream", "log_requests", "otel_exponential_histograms",
          "otel_traces", "capture_text", "capture_compress", "otel_server_chunks",
          "allow_open_admin"}
_INTS = {"max_body_bytes", "max_concurrency", "max_event_bytes", "retry_connect", "eject_after",
         "max_stream_events",
         "window_max_records", "window_max_bytes", "prefix_block_chars", "prefix_block_tokens",
         "label_cap", "workers", "channel_buffer_bytes", "max_connections", "max_header_count",
         "max_header_bytes",
         "capture_rotate_bytes", "capture_queue", "capture_block_chars", "capture_block_tokens"}
_MAPPINGS = {"slo_classes": ":", "slo_model_classes": "="}
# "listen" and "metrics_listen" are HOST:PORT shorthands for the host/port pairs.
SETTING_NAMES = tuple(f.name for f in fields(ProxyConfig) if f.name != "extra") + (
    "listen",
    "metrics_listen",
)
# Settings whose flag is named otherwise (--upstream fills `upstreams`): the flag's name is
# accepted in the environment (SIDECAR_UPSTREAM) and the config file too, where it used to be
# ignored or refused although the help shows it.
ALIASES = {"upstream": "upstreams", "slo_class": "slo_classes",
           "slo_model_class": "slo_model_classes", "window": "window_s",
           "capture": "capture_dir"}


def _coerce(name: str, value: Any) -> Any:
    if name in _DURATIONS:
        return parse_duration(value)
    if name in _BOOLS:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}: not a boolean: {value!r}")
    if name in _INTS:
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}: not an integer: {value!r}") from None
    if name == "histogram_buckets":
        text = str(value).strip().lower()
        if text not in HISTOGRAM_LAYOUTS:
            raise ConfigError(f"histogram_buckets must be one of {', '.join(HISTOGRAM_LAYOUTS)}"
                              f": {value!r}")
        return text
    if name == "route_policy":
        try:
            return RoutePolicy(str(value))
        except ValueError:
            choices = ", ".join(p.value for p in RoutePolicy)
            raise ConfigError(f"route_policy must be one of {choices}: {value!r}") from None
    if name == "upstreams":
        items = value.split(",") if isinstance(value, str) else list(value)
        return tuple(normalise_upstream(str(item)) for item in items if str(item).strip())
    if name == "otel_endpoint":
        return normalise_otel_endpoint(str(value))
    if name == "listen_port" or name == "metrics_port":
        return int(value)
    if name in _MAPPINGS:
        return _mapping(name, value, _MAPPINGS[name])
    return str(value)


def _mapping(name: str, value: Any, separator: str) -> dict[str, str]:
    """A mapping from a file table, or from 'k<sep>v' items (flags, env: ';'-separated)."""
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    items = value.split(";") if isinstance(value, str) else list(value)
    out: dict[str, str] = {}
    for item in items:
        key, sep, rest = str(item).partition(separator)
        if not sep or not key.strip() or not rest.strip():
            raise ConfigError(f"{name}: expected KEY{separator}VALUE, got {item!r}")
        out[key.strip()] = rest.strip()
    return out


def load_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {file}: {exc.strerror}") from None
    if file.suffix == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            raise ConfigError("TOML config files need Python >= 3.11; use JSON") from None
        try:
            data: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{file}: invalid TOML: {exc}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{file}: invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: the top level must be a table/object of settings")
    proxy_section = data.get("proxy", data)
    if not isinstance(proxy_section, dict):
        raise ConfigError(f"{file}: [proxy] must be a table of settings")
    return dict(proxy_section)


def build_config(
    flags: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
    file_settings: Mapping[str, Any] | None = None,
) -> ProxyConfig:
    """Merge settings (flag > env > file > default) into a validated ProxyConfig.

    ``flags`` holds only the flags the user gave (None means not given). Unknown keys in the
    file are an error: a misspelt setting silently ignored is a measurement configured wrong.
    """
    environ = os.environ if environ is None else environ
    merged: dict[str, Any] = {}
    file_keys: dict[str, str] = {}  # setting -> the key that set it
    for key, value in (file_settings or {}).items():
        name = ALIASES.get(key, key)
        if name not in SETTING_NAMES:
            raise ConfigError(f"unknown setting {key!r} in config file{_suggestion(key)}")
        if name in file_keys:
            raise ConfigError(f"config file: {file_keys[name]!r} and {key!r} are the same "
                              "setting: keep one")
        file_keys[name] = key
        merged[name] = value
    for name in SETTING_NAMES:
        env_value = _env_setting(environ, name)
        if env_value is not None:
            merged[name] = env_value
    for name, value in flags.items():
        if value is None:
            continue
        if name not in SETTING_NAMES:
            raise ConfigError(f"unknown setting {name!r}")
        if isinstance(value, (list, tuple)) and not value:
            continue
        merged[name] = value
    for hostport, host_key, port_key in (("listen", "listen_host", "listen_port"),
                                         ("metrics_listen", "metrics_host", "metrics_port")):
        raw = merged.pop(hostport, None)
        if raw is not None:
            merged[host_key], merged[port_key] = parse_hostport(str(raw))
    coerced = {name: _coerce(name, value) for name, value in merged.items()}
    if "upstreams" not in coerced:
        raise ConfigError(
            "at least one upstream is required: --upstream URL (or SIDECAR_UPSTREAMS, "
            "or `upstreams` in the config file)"
        )
    return ProxyConfig(**coerced)


def _env_setting(environ: Mapping[str, str], name: str) -> str | None:
    """SIDECAR_<NAME>, or SIDECAR_<FLAG NAME> where the flag is named otherwise; both set to
    different values is an error rather than a silent choice."""
    given = {f"SIDECAR_{key.upper()}": environ.get(f"SIDECAR_{key.upper()}")
             for key in (name, *(alias for alias, of in ALIASES.items() if of == name))}
    values = {variable: value for variable, value in given.items() if value}
    if len(set(values.values())) > 1:
        raise ConfigError(f"{' and '.join(values)} are the same setting, set differently: "
                          "keep one")
    return next(iter(values.values()), None)


def _suggestion(name: str) -> str:
    import difflib

    close = difflib.get_close_matches(name, (*SETTING_NAMES, *ALIASES), n=1, cutoff=0.8)
    return f" (did you mean {close[0]!r}?)" if close else ""


def environment_warnings(environ: Mapping[str, str] | None = None) -> list[str]:
    """SIDECAR_* variables that are no setting but look like a misspelt one: each is ignored,
    and says so (other SIDECAR_* variables belong to other tools and pass in silence)."""
    import difflib

    environ = os.environ if environ is None else environ
    known = {f"SIDECAR_{name.upper()}" for name in (*SETTING_NAMES, *ALIASES)}
    warnings = []
    for variable in sorted(environ):
        if not variable.startswith("SIDECAR_") or variable in known:
            continue
        close = difflib.get_close_matches(variable, known, n=1, cutoff=0.85)
        if close:
            warnings.append(f"{variable} is not a setting (did you mean {close[0]}?): ignored")
    return warnings




# The metrics a latency threshold names, in one vocabulary (the names of docs/metrics.md):
# a per-request SLO (stats.SLO) judges the first three; a sweep step's percentile criteria
# (replay/sweep.py) also ITL, which is a sample per gap, not one value per request.
SLO_METRICS = ("ttft", "tpot", "e2e")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2e")
# Other spellings taken for compatibility: vllm bench names E2E "e2el" (and so did `sidecar
# sweep --slo`).
SLO_METRIC_ALIASES = {"e2el": "e2e"}
# The names of sinks/prometheus.py's LATENCY_LAYOUTS (config imports nothing of the package;
# a test holds the two equal).
HISTOGRAM_LAYOUTS = ("schema3", "schema4", "e6")
# What a class may leave out of its denominator: stats.SLO_EXCLUSIONS (config imports nothing
# of the package; a test holds the two equal).
SLO_EXCLUSION_NAMES = ("client_error", "client_cancelled")


@dataclass(frozen=True)
class SLOSpec:
    """One SLO declaration: thresholds in seconds, and the objective and exclusions when it
    states them (None: stats.SLO's defaults, 99 % and both exclusions)."""

    thresholds: Mapping[str, float]
    objective: float | None = None
    exclude: frozenset[str] | None = None

    def slo_arguments(self) -> dict[str, Any]:
        """Keyword arguments of stats.SLO. An ITL threshold (a sweep's percentile criterion,
        `PERCENTILE_METRICS`) has no per-request value to judge and is not among them."""
        out: dict[str, Any] = {f"{name}_s": self.thresholds.get(name) for name in SLO_METRICS}
        if self.objective is not None:
            out["objective"] = self.objective
        if self.exclude is not None:
            out["exclude"] = self.exclude
        return out


def parse_slo(text: str) -> dict[str, float]:
    """'ttft=500ms,tpot=50ms,e2e=20s' -> {'ttft': 0.5, 'tpot': 0.05, 'e2e': 20.0} (seconds).
    Objective and exclusion terms are accepted and left out: `parse_slo_spec` has them."""
    return dict(parse_slo_spec(text).thresholds)


def parse_slo_spec(text: str, metrics: tuple[str, ...] = SLO_METRICS) -> SLOSpec:
    """'ttft=500ms,tpot=50ms,objective=99.5%,exclude=client_error': thresholds (each with a
    unit, `parse_duration`; held in seconds), the objective (a percentage, or a fraction below
    1) and what the denominator leaves out (``+``-separated names of SLO_EXCLUSION_NAMES, or
    ``none``). ``metrics``: the threshold names taken (`PERCENTILE_METRICS` for a sweep's
    criteria, which also judge ITL)."""
    thresholds: dict[str, float] = {}
    objective: float | None = None
    exclude: frozenset[str] | None = None
    terms = (*metrics, "objective", "exclude")
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip().lower()
        name = SLO_METRIC_ALIASES.get(name, name)
        value = value.strip()
        if not sep or name not in terms:
            raise ConfigError(
                f"bad SLO term {part!r}: use NAME=DURATION with NAME in {', '.join(metrics)}"
                ", objective=99.5% or exclude=client_error+client_cancelled|none"
            )
        if name in thresholds or (name == "objective" and objective is not None) or (
                name == "exclude" and exclude is not None):
            raise ConfigError(f"SLO {name} declared twice in {text!r}")
        if name == "objective":
            objective = _parse_objective(value, part)
        elif name == "exclude":
            exclude = _parse_exclusions(value, part)
        else:
            seconds = parse_duration(value)
            if seconds <= 0:
                raise ConfigError(f"SLO {name} must be > 0: {part!r}")
            thresholds[name] = seconds
    if not thresholds:
        raise ConfigError(f"empty SLO declaration (no threshold): {text!r}")
    return SLOSpec(thresholds, objective, exclude)


def _parse_objective(value: str, part: str) -> float:
    percent = value.endswith("%")
    try:
        number = float(value[:-1] if percent else value)
    except ValueError:
        raise ConfigError(f"bad SLO objective {part!r}: a percentage, e.g. objective=99.5%"
                          ) from None
    share = number / 100 if percent else number
    if not percent and number >= 1:
        raise ConfigError(f"bad SLO objective {part!r}: a bare number is a fraction below 1; "
                          f"did you mean objective={value}%?")
    if not (0 < share < 1):
        raise ConfigError(f"bad SLO objective {part!r}: between 0 and 100 % (exclusive)")
    return share


def _parse_exclusions(value: str, part: str) -> frozenset[str]:
    if value.lower() == "none":
        return frozenset()
    names = frozenset(name.strip().lower() for name in value.split("+") if name.strip())
    unknown = names - set(SLO_EXCLUSION_NAMES)
    if not names or unknown:
        raise ConfigError(f"bad SLO exclusion {part!r}: '+'-separated names of "
                          f"{', '.join(SLO_EXCLUSION_NAMES)}, or none")
    return names
