"""Building blocks for talking to remote stores, shared by the remote tiers (Redis, and the pooled tiers to come)
and the router: a circuit breaker, reusable transfer buffers and a free-port helper for tests and benchmarks.

They live outside ``kvtier/tiers/`` so that a tier folder never imports from another tier's folder.
"""
