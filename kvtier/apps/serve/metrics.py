"""The server's metrics (``kvtier serve``'s ``/metrics``, beside its cache's), declared once."""

from kvtier.base.metrics import declare_counter, declare_gauge, declare_histogram

REQUESTS = declare_counter("kvtier_server_requests_total",
                           "HTTP generation requests answered, by endpoint and status.", ("endpoint", "status"))
REJECTED = declare_counter("kvtier_server_rejected_total",
                           "Requests refused at once, by reason (queue_full: the queue was full; HTTP limits).",
                           ("reason",))
PROMPT_TOKENS = declare_counter("kvtier_server_prompt_tokens_total", "Prompt tokens of completed requests.")
CACHED_PROMPT_TOKENS = declare_counter("kvtier_server_cached_prompt_tokens_total",
                                       "Prompt tokens whose KV came from kvtier instead of prefill.")
BLENDED_PROMPT_TOKENS = declare_counter("kvtier_server_blended_prompt_tokens_total",
                                        "Prompt tokens whose KV came from cached segments (blending).")
GENERATION_TOKENS = declare_counter("kvtier_server_generation_tokens_total", "Completion tokens generated.")
TTFT_SECONDS = declare_histogram("kvtier_server_ttft_seconds",
                                 "Time to first token inside the engine (retrieve + prefill + first token).")
QUEUE_SECONDS = declare_histogram("kvtier_server_queue_seconds", "Time a request waited for the engine.")
REQUESTS_IN_FLIGHT = declare_gauge("kvtier_server_requests_in_flight", "Requests running or waiting.")
QUEUE_LIMIT = declare_gauge("kvtier_server_queue_limit", "Requests that may be running or waiting before 429s.")
