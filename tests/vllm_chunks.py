"""vLLM's streamed chunks, copied from spec/vllm-protocol.md A1 (shared by the protocol
tests)."""

CHAT_ROLE = (
    '{"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1700000000,"model":"M",'
    '"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
    '"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}'
)

CHAT_HELLO = (
    '{"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1700000000,"model":"M",'
    '"choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null,'
    '"token_ids":null}],"kv_transfer_params":null}'
)

CHAT_BANG = (
    '{"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1700000000,"model":"M",'
    '"choices":[{"index":0,"delta":{"content":"!"},"logprobs":null,"finish_reason":"stop",'
    '"stop_reason":null,"token_ids":null,"weight_versions":null}],'
    '"system_fingerprint":"vllm-0.33.0-1a2b3c4d","kv_transfer_params":null}'
)

CHAT_USAGE = (
    '{"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1700000000,"model":"M",'
    '"choices":[],"usage":{"prompt_tokens":12,"total_tokens":15,"completion_tokens":3},'
    '"system_fingerprint":"vllm-0.33.0-1a2b3c4d"}'
)

COMPLETION_HELLO = (
    '{"id":"cmpl-abc123","object":"text_completion","created":1700000000,"model":"M",'
    '"choices":[{"index":0,"text":"Hello","logprobs":null,"finish_reason":null,'
    '"stop_reason":null,"prompt_token_ids":null,"token_ids":null,"weight_versions":null}],'
    '"kv_transfer_params":null}'
)

ERROR_SPACED = (
    '{"error": {"message": "Internal server error", "type": "InternalServerError", '
    '"param": null, "code": 500}}'
)

ERROR_COMPACT = (
    '{"error":{"message":"Internal server error","type":"InternalServerError","param":null,'
    '"code":500}}'
)

# vLLM 0.32.0 itself (`sidecar vllm up`, the tiny model), copied from its streams: no
# kv_transfer_params and no weight_versions on token chunks.
CHAT_TOKEN_032 = (
    '{"id":"chatcmpl-a484a9c1c3c944b4","object":"chat.completion.chunk","created":1796133266,'
    '"model":"tiny","choices":[{"index":0,"delta":{"content":"NNTP"},"logprobs":null,'
    '"finish_reason":null,"token_ids":null}]}'
)

COMPLETION_TOKEN_032 = (
    '{"id":"cmpl-abe47f2c734129c1","object":"text_completion","created":1796133266,'
    '"model":"tiny","choices":[{"index":0,"text":"directory","logprobs":null,'
    '"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}'
)
