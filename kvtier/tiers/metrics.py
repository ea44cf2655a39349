"""The metrics every tier has, labelled by tier name, declared once; tiers and the cache core record them."""

from kvtier.base.metrics import declare_counter, declare_gauge

USED_BYTES = declare_gauge("kvtier_tier_used_bytes", "Bytes held by a tier.", ("tier",))
CAPACITY_BYTES = declare_gauge("kvtier_tier_capacity_bytes", "Configured capacity of a tier.", ("tier",))
ENTRIES = declare_gauge("kvtier_tier_entries", "Chunks held by a tier.", ("tier",))
READ_BYTES = declare_counter("kvtier_read_bytes_total", "Stored bytes read, by tier.", ("tier",))
WRITTEN_BYTES = declare_counter("kvtier_written_bytes_total", "Stored bytes written, by tier.", ("tier",))
EVICTIONS = declare_counter("kvtier_evictions_total", "Entries evicted, by tier.", ("tier",))
SKIPPED_STORES = declare_counter("kvtier_skipped_stores_total", "Chunks not stored, by tier and reason.",
                                 ("reason", "tier"))
CORRUPT_CHUNKS = declare_counter("kvtier_corrupt_chunks_total",
                                 "Stored chunks that failed verification and were treated as misses.", ("tier",))
TIER_ERRORS = declare_counter("kvtier_tier_errors_total",
                              "Tier failures turned into misses or skipped stores, by tier and operation.",
                              ("op", "tier"))
BREAKER_OPENS = declare_counter("kvtier_breaker_opens_total",
                                "Times a tier's circuit breaker opened (a server kept failing).", ("tier",))
BREAKER_REJECTED = declare_counter("kvtier_breaker_rejected_total",
                                   "Tier calls skipped because the server's circuit breaker was open.",
                                   ("op", "tier"))
BREAKER_OPEN = declare_gauge("kvtier_breaker_open", "1 while the circuit breaker of a tier's server is open, else 0.",
                             ("node", "tier"))
PINNED_BYTES = declare_gauge("kvtier_tier_pinned_bytes", "Bytes of entries pinned in a tier (cache control).",
                             ("tier",))
TENANT_BYTES = declare_gauge("kvtier_tenant_bytes",
                             "Bytes a tier holds per tenant: configured tenants by name, default, the rest as other.",
                             ("tenant", "tier"))
EXPIRED = declare_counter("kvtier_expired_total", "Entries reclaimed because their retention time passed, by tier.",
                          ("tier",))
