"""A proxy setting is declared once (a ProxyConfig field made with `config.setting`): its flag,
its environment variable and its config-file key all work from that declaration alone."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

import pytest

from sidecar.cli import add_proxy_arguments
from sidecar.config import (
    ALIASES,
    BOOL,
    DURATION,
    HOSTPORTS,
    INT,
    SETTING_NAMES,
    SETTINGS,
    STRING,
    ConfigError,
    Kind,
    ProxyConfig,
    _declared_settings,
    build_config,
    flag_settings,
    setting,
)

UPSTREAM = "http://127.0.0.1:8000"

# A value each setting can take as text (a flag, the environment), and what it becomes.
_BY_KIND: dict[int, tuple[str, Any]] = {
    id(DURATION): ("7s", 7.0),
    id(INT): ("7", 7),
    id(STRING): ("X-Other", "X-Other"),
}
_BY_NAME: dict[str, tuple[str, Any]] = {
    "upstreams": ("http://10.0.0.9:8000/v1", ("http://10.0.0.9:8000",)),
    "route_policy": ("prefix", "prefix"),
    "histogram_buckets": ("e6", "e6"),
    "server_stamps": ("read", "read"),
    "otel_endpoint": ("http://127.0.0.1:4318/", "http://127.0.0.1:4318"),
    "slo_classes": ("fast:ttft=100ms", {"fast": "ttft=100ms"}),
    "slo_model_classes": ("m=default", {"m": "default"}),
    "listen_port": ("8081", 8081),
    "metrics_host": ("127.0.0.2", "127.0.0.2"),
    "listen_host": ("127.0.0.2", "127.0.0.2"),
    "capture_key_file": ("KEYFILE", "KEYFILE"),
    "slo": ("ttft=1s", "ttft=1s"),
    "capture_dir": ("CAPTURE", "CAPTURE"),
}
# Settings that only stand with others (ProxyConfig.__post_init__'s rules).
_NEEDS: dict[str, dict[str, str]] = {
    "capture_text": {"capture_dir": "CAPTURE"},
    "capture_key_file": {"capture_dir": "CAPTURE"},
    "slo_model_classes": {"slo": "ttft=1s"},
    "slo_classes": {"slo": "ttft=1s"},
}


def _sample(name: str, tmp: Any) -> tuple[str, Any, dict[str, str]]:
    """(text to give, the value it becomes, other settings it needs) for one setting."""
    defaults = {f.name: f.default for f in fields(ProxyConfig)}
    kind = SETTINGS[name].kind
    value: Any
    if kind is BOOL:
        flipped = not defaults[name]
        text, value = ("1" if flipped else "0"), flipped
    elif name in _BY_NAME:
        text, value = _BY_NAME[name]
    else:
        text, value = _BY_KIND[id(kind)]
    needs = dict(_NEEDS.get(name, {}))
    key = tmp / "key"
    key.write_bytes(b"k" * 32)
    text = text.replace("KEYFILE", str(key))
    value = str(key) if value == "KEYFILE" else value
    text = text.replace("CAPTURE", str(tmp / "capture"))
    value = str(tmp / "capture") if value == "CAPTURE" else value
    needs = {k: v.replace("CAPTURE", str(tmp / "capture")) for k, v in needs.items()}
    return text, value, needs


def _value(config: ProxyConfig, name: str) -> Any:
    value = getattr(config, name)
    return value.value if hasattr(value, "value") and not isinstance(value, str) else value


@pytest.mark.parametrize("name", list(SETTINGS))
def test_every_setting_works_from_the_environment_and_the_config_file(
    name: str, tmp_path: Any
) -> None:
    text, value, needs = _sample(name, tmp_path)
    base = {} if name == "upstreams" else {"upstreams": UPSTREAM}
    environ = {f"SIDECAR_{key.upper()}": raw for key, raw in {**base, **needs, name: text}.items()}
    assert _value(build_config({}, environ=environ), name) == value
    from_file = build_config({}, environ={}, file_settings={**base, **needs, name: text})
    assert _value(from_file, name) == value


@pytest.mark.parametrize("name", [n for n, s in SETTINGS.items() if s.help is not None])
def test_every_setting_with_help_has_its_flag(name: str, tmp_path: Any) -> None:
    text, value, needs = _sample(name, tmp_path)
    declared = SETTINGS[name]
    parser = argparse.ArgumentParser()
    add_proxy_arguments(parser)
    flag = "--" + (declared.flag or name).replace("_", "-")
    argv = [] if name == "upstreams" else ["--upstream", UPSTREAM]
    for other, raw in needs.items():
        argv += [
            "--" + next((a for a, n in ALIASES.items() if n == other), other).replace("_", "-"),
            raw,
        ]
    if declared.port is not None:
        argv += [flag, f"{text}:9999"]
    elif declared.kind is BOOL:
        argv.append(flag)
    else:
        argv += [flag, text]
    config = build_config(flag_settings(parser.parse_args(argv)), environ={})
    assert _value(config, name) == value
    if declared.port is not None:
        assert getattr(config, declared.port) == 9999


def test_the_names_users_know_are_derived_unchanged() -> None:
    assert ALIASES == {
        "upstream": "upstreams",
        "slo_class": "slo_classes",
        "slo_model_class": "slo_model_classes",
        "window": "window_s",
        "capture": "capture_dir",
    }
    assert HOSTPORTS == {
        "listen": ("listen_host", "listen_port"),
        "metrics_listen": ("metrics_host", "metrics_port"),
    }
    assert set(SETTING_NAMES) == {f.name for f in fields(ProxyConfig)} | set(HOSTPORTS)


def test_a_new_setting_is_one_declaration() -> None:
    # The derivation works on any dataclass of settings: a throwaway one shows what a new
    # field gets from its declaration alone.
    @dataclass(frozen=True)
    class Throwaway:
        drain_timeout: float = setting(30.0, metavar="DURATION", help="drain [30s]")
        max_things: int | None = setting(None)
        fast: bool = setting(False, help="go fast")
        odd: str = setting("a", kind=Kind(lambda name, value: str(value).upper()))

    declared = _declared_settings(Throwaway)
    assert declared["drain_timeout"].kind is DURATION
    assert declared["max_things"].kind is INT
    assert declared["fast"].kind is BOOL
    assert declared["odd"].kind is not None
    assert declared["odd"].kind.convert("odd", "x") == "X"
    assert DURATION.convert("drain_timeout", "2m") == 120.0


def test_a_field_not_declared_as_a_setting_is_refused() -> None:
    @dataclass(frozen=True)
    class Undeclared:
        plain: int = 3

    with pytest.raises(TypeError, match="not declared with setting"):
        _declared_settings(Undeclared)

    @dataclass(frozen=True)
    class NoKind:
        ratio: complex = setting(1j)

    with pytest.raises(TypeError, match="declare kind="):
        _declared_settings(NoKind)


def test_conversion_errors_name_the_setting() -> None:
    with pytest.raises(ConfigError, match="max_concurrency: not an integer: 'many'"):
        build_config({}, environ={"SIDECAR_UPSTREAMS": UPSTREAM, "SIDECAR_MAX_CONCURRENCY": "many"})


# -- replay: the command line and scripts build the same options --------------------------


def test_replay_options_have_the_flags_defaults() -> None:
    from sidecar.replay import replay_cli
    from sidecar.replay.options import ReplayOptions

    parser = argparse.ArgumentParser()
    replay_cli.add_arguments(parser)
    args = parser.parse_args(["t.jsonl", "--target", "http://127.0.0.1:8000"])
    # Every flag is an option, and a script's options are the command line's defaults.
    assert set(vars(args)) == {f.name for f in fields(ReplayOptions)}
    assert ReplayOptions.from_namespace(args) == ReplayOptions("t.jsonl", "http://127.0.0.1:8000")


def test_a_script_plans_as_the_command_does() -> None:
    from sidecar.replay import load
    from sidecar.replay.options import ReplayOptions, UsageError
    from sidecar.tracefile import TraceRequest

    requests = [TraceRequest(t=t, n_in=8, n_out=2) for t in (0.0, 1.0, 3.0)]
    options = ReplayOptions("t.jsonl", "http://127.0.0.1:8000", time_scale=2.0)
    plan = load.plan(requests, options, "m")
    assert plan.mode == "open"
    assert [p.at_s for p in plan.requests] == [0.0, 0.5, 1.5]
    closed = load.plan(requests, ReplayOptions("t", "http://x", max_concurrency=2), "m")
    assert closed.mode == "closed"
    with pytest.raises(UsageError, match="--max-concurrency must be >= 1"):
        load.plan(requests, ReplayOptions("t", "http://x", max_concurrency=0), "m")


# -- sweep: the command line and scripts build the same options ---------------------------


def test_sweep_options_have_the_flags_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar.replay import sweep_cli
    from sidecar.replay.options import SweepOptions

    monkeypatch.delenv("SIDECAR_ADMIN_TOKEN", raising=False)
    parser = argparse.ArgumentParser()
    sweep_cli.add_arguments(parser)
    target = "http://127.0.0.1:8000"
    argv = ["--target", target, "--slo", "ttft=1s", "--dataset", "synthetic:in=8,out=2"]
    args = parser.parse_args([*argv, "--auto"])
    # Every flag is an option, and a script's options are the command line's defaults.
    assert set(vars(args)) == {f.name for f in fields(SweepOptions)}
    assert SweepOptions.from_args(args) == SweepOptions(
        target, "ttft=1s", dataset="synthetic:in=8,out=2", auto=True
    )
    rates = SweepOptions.from_args(parser.parse_args([*argv, "--rates", "4,1,2"]))
    assert rates.rates == (1.0, 2.0, 4.0) and not rates.auto
