"""What one simulated replica is configured with: `SimConfig` (the flags of ``sidecar sim``),
its validation, and what the configuration shows of itself (fingerprint, cache config).

Nothing here runs: `sidecar.sim.server` assembles a replica from a `SimConfig`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from sidecar.sim.engine import EngineConfig
from sidecar.sim.faults import NO_FAULT, FaultSpec
from sidecar.sim.shapes import Era, Profile

VLLM_VERSION = "0.33.0"


@dataclass(frozen=True)
class SimConfig:
    """Everything one simulated replica needs (the CLI flags of ``sidecar sim``)."""

    model: str = "sim-model"
    served_model_names: tuple[str, ...] = ()  # default: (model,)
    engine: EngineConfig = field(default_factory=EngineConfig)
    profile: Profile = Profile.VLLM
    vllm_version: str = VLLM_VERSION
    api_key: str | None = None
    response_role: str = "assistant"
    sse_keep_alive_interval: float = 0.0
    enable_force_include_usage: bool = False
    enable_prompt_tokens_details: bool = False
    enable_per_request_metrics: bool = False
    enable_request_id_headers: bool = False
    enable_server_load_tracking: bool = False
    max_num_queued_reqs: int | None = None
    legacy_metric_names: bool = False
    # vLLM's --tool-call-parser and --enable-auto-tool-choice: tool calls are served only with
    # both (sidecar.sim.tools); otherwise every tool_choice but "none" is refused, as by vLLM.
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    ground_truth_path: str | None = None
    fault: FaultSpec = NO_FAULT
    fault_rate: float = 0.0
    fault_seed: int = 0
    # How long close() lets in-flight requests finish before cancelling them.
    shutdown_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        # Accept the profile's plain name ("minimal") as well as the enum member.
        object.__setattr__(self, "profile", Profile(self.profile))
        Era.of(self.vllm_version)  # a version the shapes know, or ValueError now
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            # vLLM refuses to start so (vllm/entrypoints/launchers/cli_args.py 523-524).
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")

    @property
    def serves_tools(self) -> bool:
        """vLLM has a tool parser only with both flags (ParserManager.get_tool_parser)."""
        return self.enable_auto_tool_choice and bool(self.tool_call_parser)

    @property
    def model_names(self) -> tuple[str, ...]:
        return self.served_model_names or (self.model,)


def system_fingerprint(config: SimConfig) -> str:
    """``vllm-<version>-<hash8>``: stable for one configuration, like vLLM's."""
    digest = hashlib.sha256(f"{config.model}|{config.engine!r}".encode()).hexdigest()
    return f"vllm-{config.vllm_version}-{digest[:8]}"


def cache_config_info(engine: EngineConfig) -> dict[str, str]:
    """The labels of vLLM's ``cache_config_info`` gauge for this engine (the rest are vLLM's
    defaults, which the simulator has no flag for)."""
    return {
        "block_size": str(engine.block_size),
        "cache_dtype": "auto",
        "calculate_kv_scales": "False",
        "cpu_offload_gb": "0",
        "enable_prefix_caching": str(engine.enable_prefix_caching),
        "gpu_memory_utilization": "0.9",
        "is_attention_free": "False",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(engine.num_gpu_blocks),
        "num_gpu_blocks_override": "None",
        "prefix_caching_hash_algo": "sha256",
        "sliding_window": "None",
        "swap_space": "4",
    }
