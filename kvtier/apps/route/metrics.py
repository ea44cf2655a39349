"""The router's metrics (``kvtier route``'s ``/metrics``), declared once; the routing service records them."""

from kvtier.base.metrics import declare_counter, declare_gauge, declare_histogram

REQUESTS = declare_counter("kvtier_router_requests_total",
                           "HTTP generation requests answered by the router, by endpoint and status.",
                           ("endpoint", "status"))
REJECTED = declare_counter("kvtier_router_rejected_total",
                           "Requests refused without forwarding, by reason (malformed, queue_full, no_replica, "
                           "HTTP limits).", ("reason",))
CANCELLED = declare_counter("kvtier_router_cancelled_total", "Requests whose client went away before the answer.")
ROUTED = declare_counter("kvtier_router_routed_total",
                         "Forwarding attempts, by replica and the policy's reason for choosing it.",
                         ("reason", "replica"))
STICKY_BREAKS = declare_counter("kvtier_router_sticky_breaks_total",
                                "Requests of a session sent away from its replica (it was down or overloaded).")
RETRIES = declare_counter("kvtier_router_retries_total",
                          "Attempts that failed before the first byte and were retried elsewhere, by replica and "
                          "cause (busy: a 429; failed).", ("cause", "replica"))
BROKEN_STREAMS = declare_counter("kvtier_router_broken_streams_total",
                                 "Answers that broke off after they had started, by replica.", ("replica",))
EXPECTED_CACHED = declare_counter("kvtier_router_expected_cached_tokens_total",
                                  "Prompt tokens the index expected the chosen replica to have cached, by replica.",
                                  ("replica",))
REPORTED_CACHED = declare_counter("kvtier_router_reported_cached_tokens_total",
                                  "Prompt tokens the replica reported as cached in its answer, by replica.",
                                  ("replica",))
EVENTS = declare_counter("kvtier_router_events_total",
                         "Cache event stream messages from a replica, by what they were (batch, gap, new_epoch, "
                         "snapshot, snapshot_failed, apply_failed, malformed; vLLM replicas: replayed, restart, "
                         "replay_failed, reset, bad_event, and blocks not indexed: orphan, unindexed, malformed, "
                         "unknown, evicted).", ("replica", "what"))
EJECTIONS = declare_counter("kvtier_router_ejections_total",
                            "Replicas taken out of rotation, by cause (active: health checks; passive: failed "
                            "requests).", ("cause", "replica"))
READMISSIONS = declare_counter("kvtier_router_readmissions_total",
                               "Ejected replicas put back in rotation after passing health checks.", ("replica",))
TOKENIZE_SECONDS = declare_histogram("kvtier_router_tokenize_seconds",
                                     "Time to tokenize a request's prompt before choosing its replica.")
REPLICA_UP = declare_gauge("kvtier_router_replica_up", "1 while a replica is in rotation, else 0.", ("replica",))
IN_FLIGHT = declare_gauge("kvtier_router_in_flight", "Requests the router has open at a replica.", ("replica",))
PREFILL_TOKENS = declare_gauge("kvtier_router_prefill_tokens",
                               "Uncached prompt tokens a replica is computing for the router's requests, by the "
                               "router's count.", ("replica",))
DECODE_STREAMS = declare_gauge("kvtier_router_decode_streams",
                               "Router requests a replica is generating text for (past their first token).",
                               ("replica",))
INDEX_CHUNKS = declare_gauge("kvtier_router_index_chunks",
                             "Chunks the router's index believes a replica holds, by tier.", ("replica", "tier"))
INDEX_DROPPED_EVENTS = declare_gauge("kvtier_router_index_dropped_events",
                                     "Events of a replica the index dropped (at its cap, or naming an unknown tier).",
                                     ("replica",))
QUEUE_WAITING = declare_gauge("kvtier_router_queue_waiting", "Requests waiting for an admission slot.")
