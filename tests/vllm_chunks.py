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

# ... and the other chunks of its streams (2026-12-02): the finish chunk without usage (the
# fingerprint on it), with continuous usage (no fingerprint), the completions one, the role
# chunk with usage, the usage-only chunk.
CHAT_FINISH_032 = (
    '{"id":"chatcmpl-ab12de41e6ea3128","object":"chat.completion.chunk","created":1796248996,'
    '"model":"tiny","choices":[{"index":0,"delta":{"content":"turtle"},"logprobs":null,'
    '"finish_reason":"length","stop_reason":null,"token_ids":null}],'
    '"system_fingerprint":"vllm-0.32.0-0384aa49"}'
)

CHAT_FINISH_USAGE_032 = (
    '{"id":"chatcmpl-8e67c8ed8bc6de79","object":"chat.completion.chunk","created":1796248996,'
    '"model":"tiny","choices":[{"index":0,"delta":{"content":"rch"},"logprobs":null,'
    '"finish_reason":"length","stop_reason":null,"token_ids":null}],"usage":{"prompt_tokens":17,'
    '"total_tokens":20,"completion_tokens":3,"completion_tokens_details":null}}'
)

COMPLETION_FINISH_032 = (
    '{"id":"cmpl-b1826f6feae19d54","object":"text_completion","created":1796248996,'
    '"model":"tiny","choices":[{"index":0,"text":"eature","logprobs":null,'
    '"finish_reason":"length","stop_reason":null,"prompt_token_ids":null,"token_ids":null}],'
    '"system_fingerprint":"vllm-0.32.0-0384aa49"}'
)

CHAT_ROLE_USAGE_032 = (
    '{"id":"chatcmpl-8e67c8ed8bc6de79","object":"chat.completion.chunk","created":1796248996,'
    '"model":"tiny","choices":[{"index":0,"delta":{"role":"assistant","content":""},'
    '"logprobs":null,"finish_reason":null}],"usage":{"prompt_tokens":17,"total_tokens":17,'
    '"completion_tokens":0,"completion_tokens_details":null},"prompt_token_ids":null,'
    '"prompt_text":null}'
)

CHAT_USAGE_032 = (
    '{"id":"chatcmpl-8e67c8ed8bc6de79","object":"chat.completion.chunk","created":1796248996,'
    '"model":"tiny","choices":[],"usage":{"prompt_tokens":17,"total_tokens":20,'
    '"completion_tokens":3},"system_fingerprint":"vllm-0.32.0-0384aa49"}'
)
