"""Sans-IO protocol layer: the incremental SSE parser and the OpenAI/vLLM chunk and request shapes.

Standard library only; no I/O, no event loop. See spec/vllm-protocol.md (A1).
"""

from sidecar.protocol.openai import (
    ENDPOINT_CHAT,
    ENDPOINT_COMPLETIONS,
    ChunkInfo,
    ChunkKind,
    ErrorInfo,
    PerRequestMetrics,
    TokenCounter,
    Usage,
    classify_chunk,
    endpoint_for_path,
    error_body,
    stream_usage_options,
)
from sidecar.protocol.sse import (
    BOM,
    DEFAULT_MAX_EVENT_SIZE,
    DONE_EVENT,
    KEEPALIVE_EVENT,
    SSEError,
    SSEEvent,
    SSEParser,
    encode_data_event,
)

__all__ = [
    "BOM",
    "DEFAULT_MAX_EVENT_SIZE",
    "DONE_EVENT",
    "ENDPOINT_CHAT",
    "ENDPOINT_COMPLETIONS",
    "KEEPALIVE_EVENT",
    "ChunkInfo",
    "ChunkKind",
    "ErrorInfo",
    "PerRequestMetrics",
    "SSEError",
    "SSEEvent",
    "SSEParser",
    "TokenCounter",
    "Usage",
    "classify_chunk",
    "encode_data_event",
    "endpoint_for_path",
    "error_body",
    "stream_usage_options",
]
