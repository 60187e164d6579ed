"""Frozen settings of the proxy, from CLI flags, environment variables and a config file.

Precedence (highest first): command-line flag, environment variable ``SIDECAR_<NAME>``, config
file (``--config FILE``, JSON, or TOML on Python >= 3.11), built-in default. Every setting has
one name used in all three places: flag ``--connect-timeout``, env ``SIDECAR_CONNECT_TIMEOUT``,
file key ``connect_timeout``. Where a flag is named otherwise than its setting (``--upstream``
fills ``upstreams``), the flag's name works in the environment and the file too (`ALIASES`).
Each setting is declared once, as a ProxyConfig field made with `setting` (default, kind,
help); its flag, variable, key and type conversion are derived from that (`SETTINGS`).
"""

from __future__ import annotations

import argparse
import enum
import ipaddress
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
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
_DURATION_UNITS = {
    "us": 1e-6,
    "µs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "min": 60.0,
    "h": 3600.0,
    "d": 86400.0,
}


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
            raise ConfigError(f"a duration needs a unit: {text!r} (write e.g. {text}ms or {text}s)")
        value *= _DURATION_UNITS[bare_unit or "s"]
    else:
        match = _DURATION_RE.fullmatch(str(text).strip().lower())
        if match is None:
            raise ConfigError(f"not a duration: {text!r} (use e.g. 500ms, 2s, 1m, 2h, 1d)")
        value = float(match["number"]) * _DURATION_UNITS[match["unit"] or bare_unit or "s"]
        if match["unit"] is None and value != 0 and bare_unit is None:
            number = match["number"]
            raise ConfigError(
                f"a duration needs a unit: {str(text).strip()!r} (write e.g. "
                f"{number}ms or {number}s)"
            )
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
        raise ConfigError(
            "--otel-endpoint must be an http(s) URL like http://127.0.0.1:4318 "
            f"(OTLP over HTTP): {url!r}"
        )
    return url.strip().rstrip("/")


# The names of sinks/prometheus.py's LATENCY_LAYOUTS (config imports nothing of the package;
# a test holds the two equal).
HISTOGRAM_LAYOUTS = ("schema3", "schema4", "e6")


# -- the settings: each declared once ---------------------------------------------------------
#
# A setting is one field of ProxyConfig, declared with `setting(...)`: its default, its kind
# (how text from a flag or the environment, or a file's value, becomes its value) and its help.
# Everything else is derived from that declaration (`SETTINGS`): the flag --<name-with-dashes>
# (`add_setting_arguments`), the environment variable SIDECAR_<NAME>, the config-file key
# <name>, the type conversion (`build_config`). Adding a setting is adding a field.


@dataclass(frozen=True)
class Kind:
    """How a setting's value is read: ``convert(name, raw)`` takes a flag's or the
    environment's text, or a config file's value, and returns the value or raises ConfigError.
    The rest shapes its flag."""

    convert: Callable[[str, Any], Any]
    flag_type: Callable[[str], Any] | None = None  # argparse's type=: refused at parse time
    choices: tuple[str, ...] | None = None
    repeated: bool = False  # the flag may be given several times (action="append")
    switch: bool = False  # the flag takes no value: it sets the opposite of the default


def _to_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}: not a boolean: {value!r}")


def _to_int(name: str, value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: not an integer: {value!r}") from None


def _one_of(name: str, value: Any, choices: tuple[str, ...]) -> str:
    text = str(value).strip().lower()
    if text not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}: {value!r}")
    return text


def _to_route_policy(name: str, value: Any) -> RoutePolicy:
    try:
        return RoutePolicy(str(value))
    except ValueError:
        choices = ", ".join(p.value for p in RoutePolicy)
        raise ConfigError(f"{name} must be one of {choices}: {value!r}") from None


def _to_upstreams(name: str, value: Any) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else list(value)
    return tuple(normalise_upstream(str(item)) for item in items if str(item).strip())


def _mapping_kind(separator: str) -> Kind:
    return Kind(lambda name, value: _mapping(name, value, separator), repeated=True)


DURATION = Kind(lambda name, value: parse_duration(value))
BOOL = Kind(_to_bool, switch=True)
INT = Kind(_to_int, flag_type=int)
STRING = Kind(lambda name, value: str(value))
UPSTREAMS = Kind(_to_upstreams, repeated=True)
ROUTE_POLICY = Kind(_to_route_policy, choices=tuple(p.value for p in RoutePolicy))
HISTOGRAM_LAYOUT = Kind(
    lambda name, value: _one_of(name, value, HISTOGRAM_LAYOUTS), choices=HISTOGRAM_LAYOUTS
)
SERVER_STAMPS = Kind(
    lambda name, value: _one_of(name, value, ("kernel", "read")), choices=("kernel", "read")
)
OTEL_ENDPOINT = Kind(lambda name, value: normalise_otel_endpoint(str(value)))
# The kind of a setting that names none, by its annotation. Every float setting of the proxy is
# a duration (given with a unit, held in seconds): a float that is not one declares its kind.
_KIND_OF_TYPE = {
    "float": DURATION,
    "bool": BOOL,
    "int": INT,
    "int | None": INT,
    "str": STRING,
    "str | None": STRING,
}


@dataclass(frozen=True)
class Setting:
    """A setting's declaration (a ProxyConfig field's metadata; the name is the field's)."""

    kind: Kind | None  # None: from the field's annotation (`_KIND_OF_TYPE`)
    help: str | None  # None: no flag (the environment and the config file only)
    flag: str | None = None  # the flag's name when not the setting's (underscores for dashes)
    metavar: str | None = None
    # A HOST:PORT flag declared on a host setting: it fills this port setting too.
    port: str | None = None


def setting(
    default: Any = MISSING,
    *,
    help: str | None = None,
    kind: Kind | None = None,
    flag: str | None = None,
    metavar: str | None = None,
    port: str | None = None,
    factory: Callable[[], Any] | None = None,
    repr: bool = True,
) -> Any:
    """A ProxyConfig field declared as a setting (`Setting`); ``factory`` for a mutable
    default."""
    metadata = {"setting": Setting(kind, help, flag, metavar, port)}
    if factory is not None:
        return field(default_factory=factory, repr=repr, metadata=metadata)
    return field(default=default, repr=repr, metadata=metadata)


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    # The order of the fields is the order of the flags in `sidecar proxy --help`.
    upstreams: tuple[str, ...] = setting(
        kind=UPSTREAMS,
        flag="upstream",
        metavar="URL",
        help="a replica's base URL (repeat for several)",
    )
    listen_host: str = setting(
        "127.0.0.1",
        flag="listen",
        port="listen_port",
        metavar="HOST:PORT",
        help="traffic listener [127.0.0.1:8080]",
    )
    listen_port: int = setting(8080)
    metrics_host: str = setting(
        "127.0.0.1",
        flag="metrics_listen",
        port="metrics_port",
        metavar="HOST:PORT",
        help="admin/metrics listener, never the traffic port [127.0.0.1:9464]",
    )
    metrics_port: int = setting(9464)
    route_policy: RoutePolicy = setting(
        RoutePolicy.LEAST_OUTSTANDING,
        kind=ROUTE_POLICY,
        help="how requests are spread over replicas [least_outstanding]",
    )
    session_header: str = setting(
        "X-Session-ID",
        metavar="NAME",
        help="header naming the session for --route-policy session [X-Session-ID; falls back "
        "to the body's `user`]",
    )
    # Prefix affinity hashes this many leading prompt characters, or this many leading token
    # ids for token-id prompts.
    prefix_block_chars: int = setting(256)
    prefix_block_tokens: int = setting(64)
    # Timeouts in seconds; 0 disables one.
    connect_timeout: float = setting(
        5.0, metavar="DURATION", help="e.g. 500ms, 30s, 2m; 0 disables [5s]"
    )
    # Upstream send -> first token-carrying event.
    ttft_timeout: float = setting(
        300.0, metavar="DURATION", help="e.g. 500ms, 30s, 2m; 0 disables [300s]"
    )
    # The longest gap between two upstream reads once streaming.
    idle_timeout: float = setting(
        60.0, metavar="DURATION", help="e.g. 500ms, 30s, 2m; 0 disables [60s]"
    )
    # Whole request. A ceiling no real generation reaches (a 64k-token answer at 5 tokens/s
    # takes 3.6 h) that still ends a stream which trickles or never ends.
    total_timeout: float = setting(
        4 * 3600.0, metavar="DURATION", help="e.g. 500ms, 30s, 2m; 0 disables [4h]"
    )
    # A non-streamed generation relayed whole: nothing arrives until the answer is complete,
    # so neither the TTFT nor the idle timeout can tell a silent replica from a long answer.
    # An hour is ~18k tokens at 5 tokens/s on a loaded replica (the total timeout, if shorter,
    # wins).
    nonstream_timeout: float = setting(
        3600.0,
        metavar="DURATION",
        help="a non-streamed generation relayed whole must be answered within this (504 after "
        "it); 0 disables [1h]",
    )
    # Events in one streamed response; each costs the record ~16 bytes. A million is a
    # million-token answer at one token per event: beyond it the stream is cut with an error.
    max_stream_events: int = setting(
        1_000_000,
        metavar="N",
        help="events in one streamed response; beyond it the stream ends with an error event "
        "[1000000]",
    )
    # Limits.
    max_body_bytes: int = setting(
        16 * 1024 * 1024, metavar="N", help="larger request bodies get 413 [16 MiB]"
    )
    max_concurrency: int = setting(
        4096, metavar="N", help="requests in flight beyond this get 429 [4096]"
    )
    max_event_bytes: int = setting(4 * 1024 * 1024)  # one SSE event; larger: a bad upstream
    # The traffic listener's connection hygiene (proxy/listener.py); 0 disables a timeout.
    header_timeout: float = setting(
        10.0,
        metavar="DURATION",
        help="a request's head must be complete this long after it began (else 408); "
        "0 disables [10s]",
    )
    body_timeout: float = setting(
        60.0,
        metavar="DURATION",
        help="a request's body must be complete this long after its head (else 408); "
        "0 disables [60s]",
    )
    keepalive_timeout: float = setting(
        60.0,
        metavar="DURATION",
        help="an idle keep-alive client connection closes after this; 0 disables [60s]",
    )
    max_connections: int = setting(
        0,
        metavar="N",
        help="client connections on the traffic port; the next gets 503 [0: half the "
        "open-files limit, raised to its hard limit at start]",
    )
    max_header_count: int = setting(
        100, metavar="N", help="request headers beyond this get 431 [100]"
    )
    # Request line + headers; Envoy's default.
    max_header_bytes: int = setting(
        60 * 1024, metavar="N", help="request line + headers beyond this get 431 [60 KiB]"
    )
    # Behaviour.
    # Ask the upstream for (continuous) usage, strip what we added.
    inject_usage: bool = setting(
        True,
        flag="no_inject_usage",
        help="do not ask the upstream for per-chunk usage (token counts per event become "
        "estimates)",
    )
    assemble_nonstream: bool = setting(
        False,
        help="stream from the upstream for non-streaming clients, so the server side gets "
        "TTFT/ITL; the client still gets one JSON body",
    )
    # Where the server vantage's instants come from (proxy/rxstamp.py).
    server_stamps: str = setting(
        "kernel",
        kind=SERVER_STAMPS,
        help="server-side instants from the kernel's receive timestamps on the upstream socket "
        "(kernel: independent of the proxy's load; plain-TCP upstreams on Linux) or from when "
        "the proxy read them (read) [kernel]",
    )
    # Other replicas to try when connecting fails (before any byte).
    retry_connect: int = setting(
        1, metavar="N", help="other replicas to try when connecting fails [1]"
    )
    health_interval: float = setting(
        5.0, metavar="DURATION", help="active health checks (GET /health); 0 disables [5s]"
    )
    health_timeout: float = setting(2.0)
    # Consecutive failures (health or connect) that eject a replica.
    eject_after: int = setting(2, metavar="N", help="consecutive failures that eject a replica [2]")
    window_s: float = setting(
        60.0, flag="window", metavar="DURATION", help="live statistics window [60s]"
    )
    window_max_records: int = setting(100_000)  # bound on the live window, whatever the traffic
    # ... and on its memory (records of long streams are large: ~8 KiB at 256 tokens)
    window_max_bytes: int = setting(
        256 * 1024 * 1024,
        metavar="N",
        help="memory bound of the live window: the oldest records go first, counted in /stats "
        "as evicted_over_cap [268435456, 256 MiB]",
    )
    # SLOs: the default class ("ttft=500ms,tpot=50ms"), named classes (name -> spec), and how a
    # request picks its class: a header naming the class, else its model, else "default".
    slo: str | None = setting(
        None, metavar="SPEC", help="the default SLO class, e.g. ttft=500ms,tpot=50ms,e2e=20s"
    )
    slo_classes: Mapping[str, str] = setting(
        factory=dict,
        kind=_mapping_kind(":"),
        flag="slo_class",
        metavar="NAME:SPEC",
        help="a named SLO class, e.g. interactive:ttft=200ms,tpot=30ms (repeat)",
    )
    slo_class_header: str | None = setting(
        None,
        metavar="NAME",
        help="request header whose value names the SLO class (e.g. X-Priority)",
    )
    slo_model_classes: Mapping[str, str] = setting(
        factory=dict,
        kind=_mapping_kind("="),
        flag="slo_model_class",
        metavar="MODEL=CLASS",
        help="SLO class of a model's requests (repeat)",
    )
    # Export.
    otel_endpoint: str | None = setting(
        None,
        kind=OTEL_ENDPOINT,
        metavar="URL",
        help="OTLP/HTTP endpoint for metrics (default: OTEL_EXPORTER_OTLP_ENDPOINT when set; no "
        "OpenTelemetry export otherwise)",
    )
    otel_exponential_histograms: bool = setting(
        False,
        help="export base-2 exponential histograms instead of the conventions' explicit buckets",
    )
    otel_traces: bool = setting(False, help="also export one span per request (OTLP/HTTP)")
    otel_provider_name: str = setting(
        "vllm", metavar="NAME", help="gen_ai.provider.name attribute [vllm]"
    )
    otel_export_interval: float = setting(
        10.0, metavar="DURATION", help="OpenTelemetry metric export interval [10s]"
    )
    # Also export server-side per-chunk gaps (doubles the cost).
    otel_server_chunks: bool = setting(
        False,
        help="also export server-side per-chunk gaps (sidecar.server.time_per_output_chunk; "
        "doubles the per-chunk cost)",
    )
    # Distinct values per metric label (model, replica) before "other".
    label_cap: int = setting(
        64, metavar="N", help="distinct model/replica label values before 'other' [64]"
    )
    # Latency histogram bounds (sinks/prometheus.py LATENCY_LAYOUTS): schema3 keeps the
    # dashboards' percentiles within 9.2 % of the exact ones (benchmarks/RESULTS.md).
    histogram_buckets: str = setting(
        "schema3",
        kind=HISTOGRAM_LAYOUT,
        help="latency histogram bounds: schema3 = 2^(1/8) apart, 191 series per histogram, "
        "dashboard percentiles within 9.2 %% [default]; schema4 = 2^(1/16), 377 series, "
        "4.5 %%; e6 = 1, 1.5, 2.2, 3.3, 4.7, 6.8 per decade, 46 series, up to 50 %% "
        "(docs/metrics.md)",
    )
    # Upstream /metrics scrapes for the engine view; 0 = off.
    engine_scrape_interval: float = setting(
        15.0,
        metavar="DURATION",
        help="scrape each upstream's /metrics for the engine view; 0 disables [15s]",
    )
    # Capture (traces of the traffic). Text (bodies, completions) only with capture_text.
    capture_dir: str | None = setting(
        None,
        flag="capture",
        metavar="DIR",
        help="write every chat/completions request to trace files in DIR (shapes, lengths, "
        "prefix hashes, timings; no text)",
    )
    # A key shared by every sidecar of a fleet (a mounted Secret): their prefix hashes and
    # session pseudonyms then agree, so their captures can be merged. Default: a random key
    # per process, never written anywhere.
    capture_key_file: str | None = setting(
        None,
        metavar="FILE",
        help="key for the capture's prefix hashes and session pseudonyms, shared by a fleet "
        "(a mounted Secret, >= 16 bytes) so that its pods' captures can be merged [a random "
        "key per process]",
    )
    capture_text: bool = setting(
        False,
        help="OPT-IN: also store request bodies, completion text and session ids as sent in "
        "the capture (without it ids are keyed pseudonyms; prompts are user data: mind where "
        "the files go)",
    )
    capture_compress: bool = setting(False, help="gzip the capture files")
    capture_rotate_bytes: int = setting(
        256 * 1024 * 1024, metavar="N", help="start a new capture file after N bytes [256 MiB]"
    )
    capture_rotate_s: float = setting(
        3600.0, metavar="DURATION", help="start a new capture file after this long [1h]"
    )
    capture_queue: int = setting(
        10_000,
        metavar="N",
        help="records waiting for the writer before new ones are dropped (and counted) [10000]",
    )
    capture_block_chars: int = setting(256)
    capture_block_tokens: int = setting(64)
    # Bearer token the admin listener requires (except the probes /healthz and /readyz); None =
    # open admin listener.
    admin_token: str | None = setting(
        None,
        repr=False,
        metavar="TOKEN",
        help="require 'Authorization: Bearer TOKEN' on the admin listener (the probes /healthz "
        "and /readyz excepted); prefer SIDECAR_ADMIN_TOKEN over the flag, which other local "
        "users can see in the process list",
    )
    # An admin listener on a non-loopback address without a token is refused unless this is set
    # (the network in front of it, e.g. a NetworkPolicy, is then what keeps strangers out).
    allow_open_admin: bool = setting(
        False,
        help="serve the admin listener on a non-loopback address without --admin-token "
        "(refused otherwise: /metrics, /stats and /replicas would be open to whoever reaches "
        "it); for networks that already restrict it",
    )
    # One log line per request (no text, no credentials).
    log_requests: bool = setting(
        False, help="log one line per request (ids, outcome, counts; never text)"
    )
    # Processes: `sidecar proxy` runs this many worker processes sharing the traffic port
    # (SO_REUSEPORT), each a whole data plane, and one collector process that owns the sinks
    # and the admin listener (docs/workers.md). None: the CPUs this process may use
    # (`default_workers`). 0: everything in one process, as `ProxyServer` always does.
    workers: int | None = setting(
        None,
        metavar="N",
        help="worker processes sharing the traffic port, each relaying on its own core, beside "
        "one collector process that serves the admin listener and the sinks; 0 runs "
        "everything in one process [the CPUs this process may use]",
    )
    # Bytes of finished records a worker lets wait for the collector before it drops (and
    # counts) new ones instead: the channel never blocks traffic.
    channel_buffer_bytes: int = setting(
        8 * 1024 * 1024,
        metavar="N",
        help="records a worker lets wait for the collector before it drops (and counts) new "
        "ones rather than wait [8388608, 8 MiB]",
    )

    def slo_thresholds(self) -> dict[str, dict[str, float]]:
        """SLO class name -> {metric: seconds}; empty when no SLO was declared."""
        return {name: dict(spec.thresholds) for name, spec in self.slo_specs().items()}

    def slo_specs(self) -> dict[str, SLOSpec]:
        """SLO class name -> its declaration; empty when no SLO was declared."""
        return _slo_specs(self)

    def __post_init__(self) -> None:
        """Refuse a configuration that cannot run (`ConfigError`), checks in a fixed order."""
        if not self.upstreams:
            raise ConfigError("at least one --upstream URL is required")
        self._check_limits()
        self._check_capture_needs()
        self._check_admin()
        for name in (
            "capture_rotate_bytes",
            "capture_queue",
            "capture_block_chars",
            "capture_block_tokens",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        thresholds = self.slo_thresholds()
        for model, name in self.slo_model_classes.items():
            if name not in thresholds:
                raise ConfigError(f"model {model!r} maps to undeclared SLO class {name!r}")
        if (
            self.listen_port != 0
            and self.listen_port == self.metrics_port
            and (self.listen_host == self.metrics_host)
        ):
            raise ConfigError(
                "the metrics port must differ from the traffic port (admin data stays off the "
                "path clients use)"
            )

    def _check_limits(self) -> None:
        """The sizes, counts and durations that bound the proxy."""
        positive_ints = (
            "max_body_bytes",
            "max_concurrency",
            "max_event_bytes",
            "eject_after",
            "max_stream_events",
            "window_max_records",
            "window_max_bytes",
            "prefix_block_chars",
            "prefix_block_tokens",
            "max_header_count",
            "max_header_bytes",
        )
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

    def _check_capture_needs(self) -> None:
        """The capture options that only mean something with a capture directory."""
        if self.capture_key_file is not None:
            if not self.capture_dir:
                raise ConfigError("capture_key_file keys capture hashes: it needs --capture DIR")
            read_capture_key(self.capture_key_file)  # refuse a bad key now, not at first use
        if self.capture_text and not self.capture_dir:
            raise ConfigError("capture_text stores prompts and completions: it needs --capture DIR")

    def _check_admin(self) -> None:
        """The admin listener is guarded by a real token, on loopback, or opened on purpose."""
        if self.admin_token and not self.admin_token.strip():
            # Compared without surrounding whitespace (a Secret file's newline), a blank
            # token would be no token while looking like one.
            raise ConfigError("the admin token is only whitespace: set a real token, or none")
        if (
            not self.admin_token
            and not self.allow_open_admin
            and not is_loopback_host(self.metrics_host)
        ):
            raise ConfigError(
                f"refusing to serve the admin listener on {self.metrics_host}:{self.metrics_port} "
                "without a bearer token: anyone who can reach that address could read /metrics, "
                "/stats and /replicas (upstream addresses, traffic). Set an admin token "
                "(SIDECAR_ADMIN_TOKEN), or listen on a loopback address (--metrics-listen "
                "127.0.0.1:PORT), or pass --allow-open-admin (SIDECAR_ALLOW_OPEN_ADMIN=1) when "
                "the network already restricts who reaches it"
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
        raise ConfigError(
            f"capture key file {path}: {len(key)} bytes; it needs at least "
            f"{MIN_CAPTURE_KEY_BYTES} (e.g. `head -c 32 /dev/urandom | base64`)"
        )
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


def _declared_settings(settings_class: Any = ProxyConfig) -> dict[str, Setting]:
    """Each field's declaration (`setting`), its kind resolved; a field declared otherwise is
    refused rather than left without its flag, variable and key."""
    out: dict[str, Setting] = {}
    for item in fields(settings_class):
        where = f"{settings_class.__name__}.{item.name}"
        declared = item.metadata.get("setting")
        if declared is None:
            raise TypeError(f"{where} is not declared with setting()")
        kind = declared.kind or _KIND_OF_TYPE.get(str(item.type))
        if kind is None:
            raise TypeError(f"{where}: no kind for {item.type}: declare kind=")
        out[item.name] = replace(declared, kind=kind)
    return out


SETTINGS = _declared_settings()


def _kind(name: str) -> Kind:
    kind = SETTINGS[name].kind
    assert kind is not None  # resolved by _declared_settings
    return kind


# HOST:PORT flags ("listen", "metrics_listen") -> the host and port settings they fill.
HOSTPORTS = {
    declared.flag or name: (name, declared.port)
    for name, declared in SETTINGS.items()
    if declared.port is not None
}
SETTING_NAMES = (*SETTINGS, *HOSTPORTS)
# Settings whose flag is named otherwise (--upstream fills `upstreams`): the flag's name is
# accepted in the environment (SIDECAR_UPSTREAM) and the config file too, where it used to be
# ignored or refused although the help shows it. Not a switch's name: --no-inject-usage says
# the opposite of its setting.
ALIASES = {
    declared.flag: name
    for name, declared in SETTINGS.items()
    if declared.flag and declared.port is None and not _kind(name).switch
}


def _flag_dest(name: str) -> str:
    return SETTINGS[name].flag or name if SETTINGS[name].port else name


def add_setting_arguments(parser: argparse.ArgumentParser) -> None:
    """A flag for every setting declared with help, in ProxyConfig's order. Every default is
    None: an absent flag lets the environment or the config file decide (`build_config`)."""
    for name, declared in SETTINGS.items():
        if declared.help is None:
            continue
        kind = _kind(name)
        options: dict[str, Any] = {"dest": _flag_dest(name), "help": declared.help}
        if kind.switch:
            default = next(f.default for f in fields(ProxyConfig) if f.name == name)
            options.update(action="store_const", const=not default)
        else:
            if kind.repeated:
                options["action"] = "append"
            if kind.flag_type is not None:
                options["type"] = kind.flag_type
            if kind.choices is not None:
                options["choices"] = kind.choices
            if declared.metavar is not None:
                options["metavar"] = declared.metavar
        parser.add_argument("--" + (declared.flag or name).replace("_", "-"), **options)


def flag_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The flags of `add_setting_arguments` as `build_config`'s ``flags`` (None: not given)."""
    return {
        _flag_dest(name): getattr(args, _flag_dest(name), None)
        for name, declared in SETTINGS.items()
        if declared.help is not None
    }


def _coerce(name: str, value: Any) -> Any:
    return _kind(name).convert(name, value)


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
            raise ConfigError(
                f"config file: {file_keys[name]!r} and {key!r} are the same setting: keep one"
            )
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
    for hostport, (host_key, port_key) in HOSTPORTS.items():
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
    given = {
        f"SIDECAR_{key.upper()}": environ.get(f"SIDECAR_{key.upper()}")
        for key in (name, *(alias for alias, of in ALIASES.items() if of == name))
    }
    values = {variable: value for variable, value in given.items() if value}
    if len(set(values.values())) > 1:
        raise ConfigError(f"{' and '.join(values)} are the same setting, set differently: keep one")
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
        if (
            name in thresholds
            or (name == "objective" and objective is not None)
            or (name == "exclude" and exclude is not None)
        ):
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
        raise ConfigError(
            f"bad SLO objective {part!r}: a percentage, e.g. objective=99.5%"
        ) from None
    share = number / 100 if percent else number
    if not percent and number >= 1:
        raise ConfigError(
            f"bad SLO objective {part!r}: a bare number is a fraction below 1; "
            f"did you mean objective={value}%?"
        )
    if not (0 < share < 1):
        raise ConfigError(f"bad SLO objective {part!r}: between 0 and 100 % (exclusive)")
    return share


def _parse_exclusions(value: str, part: str) -> frozenset[str]:
    if value.lower() == "none":
        return frozenset()
    names = frozenset(name.strip().lower() for name in value.split("+") if name.strip())
    unknown = names - set(SLO_EXCLUSION_NAMES)
    if not names or unknown:
        raise ConfigError(
            f"bad SLO exclusion {part!r}: '+'-separated names of "
            f"{', '.join(SLO_EXCLUSION_NAMES)}, or none"
        )
    return names
