"""vllm-sidecar: a measurement sidecar for vLLM (per-chunk, two-vantage latency and goodput)."""

__version__ = "0.1.0"
