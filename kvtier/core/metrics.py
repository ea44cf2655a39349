"""The cache core's metrics (chunks, segments, state snapshots), declared once; KVCache and its stores record
them. Per-tier byte, error and corruption counts are the tiers' (kvtier.tiers.metrics)."""

from kvtier.base.metrics import declare_counter, declare_histogram

LOOKUPS = declare_counter("kvtier_lookups_total", "Lookups served.")
LOOKUP_TOKENS = declare_counter("kvtier_lookup_tokens_total", "Tokens asked about by lookups (full chunks only).")
HIT_TOKENS = declare_counter("kvtier_hit_tokens_total", "Tokens retrieved, by the tier that served them.", ("tier",))
MISS_TOKENS = declare_counter("kvtier_miss_tokens_total", "Tokens asked for by retrieve that no tier could serve.")
STORED_TOKENS = declare_counter("kvtier_stored_tokens_total", "Tokens written, by tier.", ("tier",))
PROMOTIONS = declare_counter("kvtier_promotions_total",
                             "Chunks copied into a faster tier after a hit in a slower one, by the faster tier.",
                             ("tier",))
DEMOTIONS = declare_counter("kvtier_demotions_total",
                            "Chunks written to a slower tier when a faster one evicted them, by the slower tier.",
                            ("tier",))
ADMISSION_REFUSED = declare_counter(
    "kvtier_admission_refused_total",
    "Entries a tier's admission policy kept out, by tier and reason (unseen: second-hit had not sighted them "
    "twice; rate: over the tier's byte-rate cap).", ("reason", "tier"))
ENGINE_DEFERRED_LOADS = declare_counter(
    "kvtier_engine_deferred_loads_total",
    "Times an engine asked for a request's hit and was told to ask again because its cache lacked the room to run "
    "the request once loaded (vLLM: an asynchronous load would have overfilled its blocks).")
ENGINE_IGNORED_PARAMS = declare_counter(
    "kvtier_engine_ignored_params_total",
    "Requests whose kvtier parameters (vLLM: kv_transfer_params' kvtier object) were malformed and ignored.")
ENGINE_UNCACHED_REQUESTS = declare_counter(
    "kvtier_engine_uncached_requests_total",
    "Requests an engine integration neither looked up, loaded nor stored because an input that changes their KV "
    "could not be keyed, by the kind of input (vLLM: the request field, or unreadable).", ("kind",))
LOOKUP_SECONDS = declare_histogram("kvtier_lookup_seconds", "Latency of lookup().")
RETRIEVE_SECONDS = declare_histogram("kvtier_retrieve_seconds", "Latency of retrieve().")
STORE_SECONDS = declare_histogram("kvtier_store_seconds", "Latency of store().")

SEGMENT_HIT_TOKENS = declare_counter("kvtier_segment_hit_tokens_total",
                                     "Tokens of cached segments retrieved for blending, by the tier that served them.",
                                     ("tier",))
SEGMENT_MISS_TOKENS = declare_counter("kvtier_segment_miss_tokens_total",
                                      "Tokens of segments asked for that no tier held (computed, then stored).")
SEGMENT_STORED_TOKENS = declare_counter("kvtier_segment_stored_tokens_total", "Tokens of segments written, by tier.",
                                        ("tier",))
SEGMENT_RETRIEVE_SECONDS = declare_histogram("kvtier_segment_retrieve_seconds",
                                             "Latency of retrieving a prompt's cached segments.")

SNAPSHOTS_STORED = declare_counter("kvtier_state_snapshots_stored_total",
                                   "SSM state snapshots (one per kind and boundary) written, by tier.", ("tier",))
SNAPSHOTS_LOADED = declare_counter("kvtier_state_snapshots_loaded_total",
                                   "SSM state snapshots restored, by tier and kind.", ("kind", "tier"))
