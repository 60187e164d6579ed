from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sidecar.config import (
    ConfigError,
    RoutePolicy,
    build_config,
    environment_warnings,
    load_config_file,
    parse_duration,
    parse_hostport,
    parse_slo,
)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("500ms", 0.5),
        ("2s", 2.0),
        ("1m", 60.0),
        ("250us", 0.00025),
        ("1.5s", 1.5),
        ("0", 0.0),
        (0, 0.0),
        ("1h", 3600.0),
        ("2d", 172800.0),
        ("15min", 900.0),
        ("1E3ms", 1.0),
    ],
)
def test_durations(text: str | int, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bare", ["500", "1.5", 3, 0.25])
def test_a_duration_without_a_unit_is_refused_with_the_fix(bare: str | float) -> None:
    """A bare 500 meant 500 ms as often as 500 s: an SLO read as the wrong one passes every
    request (or none) without a word. Only 0 needs no unit."""
    with pytest.raises(ConfigError, match="needs a unit") as caught:
        parse_duration(bare)
    assert f"{bare}ms or {bare}s" in str(caught.value)


@pytest.mark.slow
def test_every_front_door_refuses_a_bare_slo(tmp_path: Path) -> None:
    """As a user types it: the proxy's flag, its environment variable and config file, replay,
    sweep and the demo all stop at once, exit 2, and name the fix (one line, no traceback)."""
    import subprocess
    import sys

    config = tmp_path / "sidecar.toml"
    config.write_text('upstreams = ["http://127.0.0.1:9"]\nslo = "ttft=500"\n')
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"format": "sidecar-trace", "version": 2}\n')
    runs = [
        (["proxy", "--upstream", "http://127.0.0.1:9", "--slo", "ttft=500"], {}),
        (["proxy", "--upstream", "http://127.0.0.1:9"], {"SIDECAR_SLO": "ttft=500"}),
        (["proxy", "--config", str(config)], {}),
        (
            [
                "sweep",
                "--target",
                "http://127.0.0.1:9",
                "--slo",
                "ttft=500",
                "--dataset",
                "random:in=8,out=4",
                "--rates",
                "1",
            ],
            {},
        ),
        (["demo", "--slo", "ttft=500"], {}),
        (["proxy", "--upstream", "http://127.0.0.1:9", "--idle-timeout", "30"], {}),
    ]

    def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "sidecar", *argv],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **env},
        )

    # Independent commands (each stops at its arguments): one process each, side by side.
    with ThreadPoolExecutor(len(runs)) as pool:
        done_all = list(pool.map(lambda run_: run(*run_), runs))
    for (argv, env), done in zip(runs, done_all, strict=True):
        assert done.returncode == 2, (argv, env, done.stderr)
        assert "needs a unit" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_bare_number_is_read_only_where_the_flag_names_its_unit() -> None:
    """`sidecar trace import --duration 3600` (metavar SECONDS) keeps taking a bare number;
    everywhere else it is refused (above)."""
    assert parse_duration("90", bare_unit="s") == 90.0
    assert parse_duration(90, bare_unit="s") == 90.0
    assert parse_duration("90ms", bare_unit="s") == pytest.approx(0.09)
    with pytest.raises(ConfigError):
        parse_duration("-90", bare_unit="s")


@pytest.mark.parametrize("bad", ["abc", "-1s", "1 parsec", "nan", ""])
def test_bad_durations_say_so(bad: str) -> None:
    with pytest.raises(ConfigError):
        parse_duration(bad)


def test_hostport() -> None:
    assert parse_hostport("0.0.0.0:8080") == ("0.0.0.0", 8080)
    assert parse_hostport(":9000") == ("127.0.0.1", 9000)
    assert parse_hostport("[::1]:81") == ("::1", 81)
    with pytest.raises(ConfigError, match="not HOST:PORT"):
        parse_hostport("localhost:http")


def test_precedence_flag_over_env_over_file(tmp_path: Path) -> None:
    file = tmp_path / "sidecar.json"
    file.write_text(
        json.dumps(
            {
                "upstreams": ["http://file:1"],
                "ttft_timeout": "10s",
                "idle_timeout": "7s",
                "route_policy": "round_robin",
            }
        )
    )
    env = {"SIDECAR_TTFT_TIMEOUT": "20s", "SIDECAR_IDLE_TIMEOUT": "8s"}
    config = build_config({"idle_timeout": "9s", "upstreams": None}, env, load_config_file(file))
    assert config.upstreams == ("http://file:1",)
    assert config.ttft_timeout == 20.0  # env beats file
    assert config.idle_timeout == 9.0  # flag beats env
    assert config.route_policy is RoutePolicy.ROUND_ROBIN


def test_upstreams_from_env_and_v1_suffix_is_dropped() -> None:
    config = build_config({}, {"SIDECAR_UPSTREAMS": "http://a:8000/v1, http://b:8000/"})
    assert config.upstreams == ("http://a:8000", "http://b:8000")


def test_a_flags_name_works_where_its_setting_is_named_otherwise() -> None:
    """--upstream fills `upstreams`, --window `window_s`, --capture `capture_dir`: the flag's
    name is taken in the environment and the file too, and two names set differently are
    refused rather than one chosen in silence."""
    config = build_config({}, {"SIDECAR_UPSTREAM": "http://a:1", "SIDECAR_WINDOW": "30s"})
    assert config.upstreams == ("http://a:1",) and config.window_s == 30.0
    config = build_config({}, {}, {"upstream": ["http://b:1"], "window": "10s"})
    assert config.upstreams == ("http://b:1",) and config.window_s == 10.0
    same = build_config({}, {"SIDECAR_UPSTREAM": "http://a:1", "SIDECAR_UPSTREAMS": "http://a:1"})
    assert same.upstreams == ("http://a:1",)
    with pytest.raises(
        ConfigError,
        match="SIDECAR_UPSTREAMS and SIDECAR_UPSTREAM are the same setting, set differently",
    ):
        build_config({}, {"SIDECAR_UPSTREAM": "http://a:1", "SIDECAR_UPSTREAMS": "http://b:1"})
    with pytest.raises(ConfigError, match="'upstreams' and 'upstream' are the same setting"):
        build_config({}, {}, {"upstreams": ["http://a:1"], "upstream": ["http://b:1"]})
    assert environment_warnings(
        {
            "SIDECAR_UPSTRAEMS": "x",
            "SIDECAR_VLLM_HOME": "x",
            "SIDECAR_UPSTREAM": "x",
            "SIDECAR_DRAIN_S": "5",
        }
    ) == ["SIDECAR_UPSTRAEMS is not a setting (did you mean SIDECAR_UPSTREAMS?): ignored"]


def test_listen_shorthand() -> None:
    config = build_config(
        {"upstreams": ["http://a:1"], "listen": "0.0.0.0:81", "metrics_listen": "127.0.0.1:82"}, {}
    )
    assert (config.listen_host, config.listen_port) == ("0.0.0.0", 81)
    assert (config.metrics_host, config.metrics_port) == ("127.0.0.1", 82)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({}, "at least one upstream"),
        ({"upstreams": ["ftp://x"]}, "http\\(s\\) URL"),
        ({"upstreams": ["http://a:1"], "route_policy": "random"}, "route_policy must be one of"),
        ({"upstreams": ["http://a:1"], "max_concurrency": "0"}, "max_concurrency must be > 0"),
        (
            {
                "upstreams": ["http://a:1"],
                "listen": "127.0.0.1:9000",
                "metrics_listen": "127.0.0.1:9000",
            },
            "metrics port must differ",
        ),
    ],
)
def test_bad_settings_are_refused_with_a_reason(flags: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config(flags, {})


def test_unknown_file_keys_are_errors(tmp_path: Path) -> None:
    file = tmp_path / "c.json"
    file.write_text(json.dumps({"upstreams": ["http://a:1"], "ttft_timout": "1s"}))
    with pytest.raises(ConfigError, match="unknown setting 'ttft_timout'"):
        build_config({}, {}, load_config_file(file))


def test_toml_file(tmp_path: Path) -> None:
    file = tmp_path / "c.toml"
    file.write_text('[proxy]\nupstreams = ["http://a:1"]\nassemble_nonstream = true\n')
    config = build_config({}, {}, load_config_file(file))
    assert config.assemble_nonstream is True


def test_slo_declarations() -> None:
    assert parse_slo("ttft=500ms,tpot=50ms,e2e=20s") == {"ttft": 0.5, "tpot": 0.05, "e2e": 20.0}
    for bad, message in (
        ("ttft=0", "must be > 0"),
        ("itl=5ms", "bad SLO term"),
        ("ttft=1s,ttft=2s", "declared twice"),
        ("", "empty SLO"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_slo(bad)


def test_one_slo_vocabulary_for_requests_and_sweep_steps() -> None:
    """A per-request SLO has no ITL term (a request has many gaps); a sweep's percentile
    criteria take one, with the same grammar, names and units (seconds). vllm bench's "e2el"
    is read as e2e everywhere."""
    from sidecar.config import PERCENTILE_METRICS, SLO_METRICS, parse_slo_spec

    assert set(SLO_METRICS) < set(PERCENTILE_METRICS)
    spec = parse_slo_spec("ttft=500ms,itl=30ms,e2el=2s", PERCENTILE_METRICS)
    assert dict(spec.thresholds) == {"ttft": 0.5, "itl": 0.03, "e2e": 2.0}
    assert spec.slo_arguments()["e2e_s"] == 2.0 and "itl_s" not in spec.slo_arguments()
    assert parse_slo("e2el=2s") == {"e2e": 2.0}


def test_the_otel_endpoint_is_checked_at_start() -> None:
    """`localhost:4318` used to be accepted and then fail at every export interval."""
    for bad in ("localhost:4318", "otel-collector", "grpc://collector:4317"):
        with pytest.raises(ConfigError, match="must be an http"):
            build_config({"upstreams": ["http://127.0.0.1:9"], "otel_endpoint": bad}, {})
    config = build_config(
        {"upstreams": ["http://127.0.0.1:9"], "otel_endpoint": "http://collector:4318/"}, {}
    )
    assert config.otel_endpoint == "http://collector:4318"


def test_an_slo_declares_its_objective_and_what_its_denominator_leaves_out() -> None:
    from sidecar import stats
    from sidecar.config import SLO_EXCLUSION_NAMES, parse_slo_spec

    assert SLO_EXCLUSION_NAMES == stats.SLO_EXCLUSIONS
    spec = parse_slo_spec("ttft=500ms,objective=99.5%,exclude=client_error")
    slo = stats.SLO(**spec.slo_arguments())
    assert (slo.ttft_s, slo.tpot_s, slo.exclude) == (0.5, None, frozenset({"client_error"}))
    assert slo.objective == pytest.approx(0.995)
    default = stats.SLO(**parse_slo_spec("tpot=50ms").slo_arguments())
    assert (default.objective, default.exclude) == (0.99, frozenset(stats.SLO_EXCLUSIONS))
    assert parse_slo_spec("e2e=1s,exclude=none,objective=0.9").exclude == frozenset()
    assert parse_slo_spec("e2e=1s,objective=0.9").objective == pytest.approx(0.9)


@pytest.mark.parametrize(
    "spec,message",
    [
        ("ttft=1s,objective=99", "did you mean objective=99%"),
        ("ttft=1s,objective=100%", "between 0 and 100"),
        ("ttft=1s,objective=high", "a percentage"),
        ("ttft=1s,exclude=timeouts", "bad SLO exclusion"),
        ("objective=99%", "no threshold"),
        ("ttft=1s,objective=99%,objective=98%", "declared twice"),
    ],
)
def test_bad_objective_and_exclusion_terms_say_what_is_wrong(spec: str, message: str) -> None:
    from sidecar.config import parse_slo_spec

    with pytest.raises(ConfigError, match=message):
        parse_slo_spec(spec)


def test_histogram_layouts_are_the_sinks_and_a_bad_name_is_refused() -> None:
    from sidecar.config import HISTOGRAM_LAYOUTS
    from sidecar.sinks.prometheus import DEFAULT_LATENCY_LAYOUT, LATENCY_LAYOUTS

    assert set(HISTOGRAM_LAYOUTS) == set(LATENCY_LAYOUTS)
    assert (
        build_config({"upstreams": ["http://a:1"]}, {}).histogram_buckets == DEFAULT_LATENCY_LAYOUT
    )
    assert (
        build_config({"upstreams": ["http://a:1"], "histogram_buckets": "E6"}, {}).histogram_buckets
        == "e6"
    )
    with pytest.raises(ConfigError, match="histogram_buckets must be one of"):
        build_config({"upstreams": ["http://a:1"], "histogram_buckets": "e12"}, {})
