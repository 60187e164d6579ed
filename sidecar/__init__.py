"""vllm-sidecar: a measurement sidecar for vLLM (per-chunk, two-vantage latency and goodput)."""

from sidecar import _compiled

__version__ = "0.1.0"

if _compiled.interpreted_requested():
    # Before any of the compiled modules is imported (sidecar/_compiled.py says why).
    _compiled.install_source_first()
