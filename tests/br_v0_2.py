"""Our own checker of llm-d's benchmark report schema v0.2, as a JSON Schema (draft 2020-12).

Written from reading llm-d-benchmark's ``benchmark_report/schema_v0_2.py`` (commit 093eecc),
``schema_v0_2_components.py`` and ``base.py`` (the `Units` enum), not generated from them: their
pydantic models are not a dependency. What it holds, model by model:

- ``extra="forbid"`` (every model of theirs but two) -> ``additionalProperties: false``.
  ``Observability`` allows extra fields; ``Statistics`` sets no config, so pydantic *ignores*
  unknown fields there (they would be dropped on load: we must not rely on them, and
  `test_llmd.py` checks that we put nothing there).
- required fields = those without a default; ``X | None = None`` fields accept null.
- ``Field(ge=..)``/``gt`` bounds; the ``check_units`` validators as per-field unit lists.
- components: ``metadata.kind`` selects the standardized model (``generic`` allows extra
  fields, ``inference_engine`` does not); ``standardized.kind`` must not be written (their
  ``inject_kind`` validator raises).
- ``concurrency``: an integer >= 1 (or infinity, which JSON cannot carry).
- datetimes: ISO 8601 (pydantic's parser), checked here with a pattern.
"""

from __future__ import annotations

from typing import Any

import jsonschema

UNITS = [
    "count",
    "percent",
    "fraction",
    "ms",
    "s",
    "MB",
    "GB",
    "TB",
    "MiB",
    "GiB",
    "TiB",
    "Mbit/s",
    "Gbit/s",
    "Tbit/s",
    "GiB/s",
    "MB/s",
    "GB/s",
    "TB/s",
    "ms/token",
    "s/token",
    "tokens/s",
    "queries/s",
    "Watts",
]
QUANTITY, TIME, GEN_LATENCY = ["count"], ["ms", "s"], ["ms/token", "s/token"]
GEN_THROUGHPUT, REQUEST_THROUGHPUT = ["tokens/s"], ["queries/s"]
ISO_DATETIME = r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:?\d{2})?$"

NUMBER = {"type": "number"}
OPT_NUMBER = {"type": ["number", "null"]}
OPT_STRING = {"type": ["string", "null"]}
OPT_DICT = {"type": ["object", "null"]}


def obj(
    properties: dict[str, Any], required: tuple[str, ...] = (), *, extra: bool = False
) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": extra,
    }


def optional(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def integer(minimum: int | None = None, *, nullable: bool = True) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": ["integer", "null"] if nullable else "integer"}
    if minimum is not None:
        schema["minimum"] = minimum
    return schema


STAT_KEYS = (
    "min",
    "p0p1",
    "p1",
    "p5",
    "p10",
    "p25",
    "p50",
    "p75",
    "p90",
    "p95",
    "p99",
    "p99p9",
    "max",
)


def statistics(units: list[str]) -> dict[str, Any]:
    # Statistics has no model_config: unknown fields are ignored by pydantic, not refused.
    props: dict[str, Any] = {
        "units": {"enum": units},
        "mean": NUMBER,
        "mode": OPT_NUMBER,
        "stddev": {"type": ["number", "null"], "minimum": 0},
    }
    props.update({key: OPT_NUMBER for key in STAT_KEYS})
    return optional(obj(props, ("units", "mean"), extra=True))


SEQUENCE_LENGTH = obj(
    {
        "distribution": {"enum": ["fixed", "gaussian", "random", "other"]},
        "value": {"type": "number", "minimum": 1},
        "std_dev": {"type": ["number", "null"], "minimum": 0},
        "min": integer(0),
        "max": integer(1),
    },
    ("distribution", "value"),
)

LOAD = obj(
    {
        "metadata": obj(
            {"schema_version": {"type": "string"}, "cfg_id": OPT_STRING, "description": OPT_STRING}
        ),
        "standardized": obj(
            {
                "tool": {"type": "string"},
                "tool_version": {"type": "string"},
                "source": {"enum": ["random", "sampled"]},
                "stage": {"type": "integer", "minimum": 0},
                "input_seq_len": SEQUENCE_LENGTH,
                "output_seq_len": optional(SEQUENCE_LENGTH),
                "prefix": optional(
                    obj(
                        {
                            "prefix_len": SEQUENCE_LENGTH,
                            "num_groups": integer(1, nullable=False),
                            "num_users_per_group": integer(1, nullable=False),
                            "num_prefixes": integer(1, nullable=False),
                        },
                        ("prefix_len", "num_groups", "num_users_per_group", "num_prefixes"),
                    )
                ),
                "multi_turn": optional(
                    obj({"enabled": {"type": "boolean"}, "max_turns": optional(SEQUENCE_LENGTH)})
                ),
                "rate_qps": {"type": ["number", "null"], "exclusiveMinimum": 0},
                "concurrency": integer(1),
            },
            ("tool", "tool_version", "source", "input_seq_len"),
        ),
        "native": obj({"args": OPT_DICT, "envars": OPT_DICT, "config": {}}),
    },
    ("metadata", "standardized", "native"),
)

GENERIC = {
    "type": "object",
    "required": ["tool", "tool_version"],
    "properties": {"tool": {"type": "string"}, "tool_version": {"type": "string"}},
    "not": {"required": ["kind"]},
    "additionalProperties": True,
}
INFERENCE_ENGINE = obj(
    {
        "tool": {"type": "string"},
        "tool_version": {"type": "string"},
        "role": {"enum": ["replica", "prefill", "decode"]},
        "model": obj({"name": {"type": "string"}}, ("name",)),
        "accelerator": obj(
            {
                "model": {"type": "string"},
                "count": integer(1, nullable=False),
                "parallelism": obj(
                    {k: {"type": "integer", "minimum": 1} for k in ("dp", "ep", "pp", "tp")}
                ),
            },
            ("model", "count", "parallelism"),
        ),
    },
    ("tool", "tool_version", "role", "model", "accelerator"),
)


def _when_kind(kind: str, standardized: dict[str, Any]) -> dict[str, Any]:
    return {
        "if": {"properties": {"metadata": {"properties": {"kind": {"const": kind}}}}},
        "then": {"properties": {"standardized": standardized}},
    }


COMPONENT = {
    **obj(
        {
            "metadata": obj(
                {
                    "kind": {"enum": ["generic", "inference_engine"]},
                    "schema_version": {"type": "string"},
                    "label": {"type": "string"},
                    "cfg_id": {"type": "string"},
                    "description": OPT_STRING,
                },
                ("kind", "label", "cfg_id"),
            ),
            "standardized": {"type": "object"},
            "native": obj({"args": OPT_DICT, "envars": OPT_DICT, "config": {}}),
        },
        ("metadata", "standardized", "native"),
    ),
    "allOf": [_when_kind("generic", GENERIC), _when_kind("inference_engine", INFERENCE_ENGINE)],
}


def _series(units: list[str]) -> dict[str, Any]:
    point = obj(
        {
            "ts": {"type": "string", "pattern": ISO_DATETIME},
            "value": {"type": ["string", "number", "boolean", "null"]},
            "mean": OPT_NUMBER,
            "mode": OPT_NUMBER,
            "stddev": {"type": ["number", "null"], "minimum": 0},
            **{key: OPT_NUMBER for key in STAT_KEYS},
        },
        ("ts",),
    )
    return optional(
        obj(
            {"units": {"enum": units}, "series": {"type": "array", "items": point}},
            ("units", "series"),
        )
    )


LATENCY_UNITS = {
    "time_to_first_token": TIME,
    "normalized_time_per_output_token": GEN_LATENCY,
    "time_per_output_token": GEN_LATENCY,
    "inter_token_latency": GEN_LATENCY,
    "request_latency": TIME,
}
THROUGHPUT_UNITS = {
    "input_token_rate": GEN_THROUGHPUT,
    "output_token_rate": GEN_THROUGHPUT,
    "total_token_rate": GEN_THROUGHPUT,
    "request_rate": REQUEST_THROUGHPUT,
}

REQUEST_PERFORMANCE = obj(
    {
        "aggregate": optional(
            obj(
                {
                    "requests": optional(
                        obj(
                            {
                                "total": integer(0, nullable=False),
                                "failures": integer(0),
                                "incomplete": integer(0),
                                "input_length": statistics(QUANTITY),
                                "output_length": statistics(QUANTITY),
                            },
                            ("total",),
                        )
                    ),
                    "latency": optional(obj({k: statistics(u) for k, u in LATENCY_UNITS.items()})),
                    "throughput": optional(
                        obj({k: statistics(u) for k, u in THROUGHPUT_UNITS.items()})
                    ),
                }
            )
        ),
        "time_series": optional(
            obj(
                {
                    "latency": optional(obj({k: _series(u) for k, u in LATENCY_UNITS.items()})),
                    "throughput": optional(
                        obj(
                            {
                                "units": {"enum": UNITS},
                                **{k: _series(u) for k, u in THROUGHPUT_UNITS.items()},
                            }
                        )
                    ),
                }
            )
        ),
    }
)

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "llm-d benchmark report v0.2 (our reading of schema_v0_2.py)",
    **obj(
        {
            "version": {"const": "0.2"},
            "run": obj(
                {
                    "uid": OPT_STRING,
                    "eid": OPT_STRING,
                    "cid": OPT_STRING,
                    "pid": OPT_STRING,
                    "user": OPT_STRING,
                    "time": optional(
                        obj(
                            {
                                "start": {"type": ["string", "null"], "pattern": ISO_DATETIME},
                                "end": {"type": ["string", "null"], "pattern": ISO_DATETIME},
                                "duration": {
                                    "type": ["string", "null"],
                                    "pattern": r"^P(\d+D)?(T(\d+H)?(\d+M)?(\d+(\.\d+)?S)?)?$",
                                },
                            }
                        )
                    ),
                }
            ),
            "scenario": optional(
                obj(
                    {
                        "stack": {"type": ["array", "null"], "items": COMPONENT},
                        "load": optional(LOAD),
                    }
                )
            ),
            "results": obj(
                {
                    "request_performance": optional(REQUEST_PERFORMANCE),
                    "observability": {"type": ["object", "null"]},  # extra="allow"
                    "profiling": {},
                }
            ),
        },
        ("version", "run", "results"),
    ),
}

VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def errors(report: Any) -> list[str]:
    """Why ``report`` would not load as a BR v0.2 (empty when it would)."""
    found = sorted(VALIDATOR.iter_errors(report), key=lambda e: list(e.absolute_path))
    return [f"{'/'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}" for e in found]
