"""`CacheConfig`: everything the cache-aware state (tokenizers, hashes, KV index, events, sessions) is tuned by."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class CacheConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    default_block_size: int = Field(16, gt=0, description="tokens per KV block when a replica does not say")
    tokenizers: dict[str, str] = Field(
        default_factory=dict,
        description='model name -> local HF tokenizer dir, "sim" or "chars"; overrides the replica\'s own',
    )
    char_chunk_size: int = Field(4, gt=0, description='characters per pseudo token for the "chars" tokenizer')
    session_header: str = Field("x-session-id", description="request header carrying the session key")
    agent_session_headers: list[str] = Field(
        default_factory=lambda: ["x-claude-code-session-id", "session-id", "x-session-affinity", "thread-id"],
        description="further request headers carrying a session key, tried in order after `session_header`: what "
        "coding agents send of their own (Claude Code's `x-claude-code-session-id`, the Codex CLI's `session-id` "
        "and `thread-id`, OpenCode's `x-session-affinity`); [] = only `session_header`",
    )
    session_from_user: bool = Field(
        True,
        description="use the body's `user` field (the Messages API's `metadata.user_id`) when no session header is "
        "present",
    )
    session_ttl_s: float = Field(600.0, gt=0, description="a session binding expires this long after last use")
    session_max_entries: int = Field(100_000, gt=0, description="LRU bound of the session table")
    awaited_ttl_s: float = Field(
        30.0,
        ge=0,
        description="a session whose answer ended in a tool call (`finish_reason: tool_calls`, `stop_reason: "
        "tool_use`, a Responses `function_call`) is expected back this long: placement prices evicting its blocks "
        "(`routing.params.awaited_cost`); 0 = off",
    )
    speculative_ttl_s: float = Field(
        2.0, ge=0, description="routed-but-unconfirmed blocks expire after this on replicas with KV events; 0 = never"
    )
    max_blocks_per_replica: int = Field(
        65_536,
        gt=0,
        description="starting index capacity of a replica whose num_gpu_blocks is unknown; lowered online from the "
        "cached tokens it reports (the index's tables grow by doubling with the blocks held, to about 35 bytes of "
        "gateway memory per block of capacity, 61 with KV events; docs/fleet.md)",
    )
    hot_window_s: float = Field(
        60.0,
        gt=0,
        description="a replica's hot footprint counts the distinct blocks routed there within this window; "
        "placement weighs it against the replica's capacity",
    )
    chat_prefix_cache_bytes: int = Field(
        128 * 1024 * 1024,
        ge=0,
        description="bound of the cache of tokenized conversation prefixes (a growing chat tokenizes only its new "
        "messages); 0 = off",
    )
    kv_events: bool = Field(True, description="subscribe to replicas' KV events when they publish them")
    kv_events_topic: str = Field("kv-events", description="ZMQ topic prefix to subscribe to")
    kv_events_replay_timeout_s: float = Field(1.0, gt=0, description="deadline of a replay request after a gap")
    tokenizer_thread_min_chars: int = Field(
        1024, ge=0, description="prompts at least this long (characters) are tokenized in the thread pool"
    )
    python_tokenizer_thread_min_chars: int = Field(
        16384,
        ge=0,
        description="the same threshold for tokenizers that run in Python under the GIL (sim, chars): a thread only "
        "adds hand-off latency for them, so only very long prompts leave the event loop",
    )
    deferred_turn_min_chars: int = Field(
        4096,
        ge=0,
        description="a conversation's new turn (the last assistant message and the messages after it, the rest of "
        "the conversation tokenized before) at least this long (characters) is tokenized beside the request, after "
        "the routing decision: no replica holds its blocks beyond the answer's, so routing on the conversation before "
        "it decides the same, with the prompt's length estimated; set it above the longest prompt to tokenize every "
        "turn before routing",
    )
    tokenizer_threads: int = Field(2, gt=0, description="size of the tokenization thread pool")
    parity_window: int = Field(50, gt=0, description="finished requests per parity check (per model)")
    parity_warn_fraction: float = Field(
        0.2, gt=0, le=1, description="warn when the mean |predicted - reported| cached tokens exceeds this share"
    )
