"""Real processes and fixtures the tests and the benchmarks both start: redis-server/valkey-server, a Mooncake
master and segment host, a vLLM OpenAI server with the kvtier connector, ``kvtier serve`` replicas and a router,
a tiny random-weights model, hostile peers and bodies.

Not part of kvtier and never shipped (the wheel packages ``kvtier*`` only). It lives at the top of the repository,
beside ``tests/`` and ``benchmarks/``, so that a benchmark never imports a test module and a test's helpers are
the very ones a benchmark measures with. Both import it as ``harness``: pytest, run from the repository root, has
the root on ``sys.path`` (``pythonpath`` in pyproject.toml), and each benchmark script inserts the root itself.
Nothing in ``kvtier`` imports it.

| module | what it starts or holds |
|---|---|
| ``process`` | ``ServerProcess`` (stop, freeze, resume, crash a child), ``wait_for``, ``timed`` |
| ``redis_server`` | ``RedisServer``, ``RedisCluster`` on free ports; ``have_redis_server`` |
| ``mooncake_master`` | ``MooncakeMaster``, ``SegmentHost`` (the pool's memory in a process of its own) |
| ``vllm_server`` | ``VllmServer``: ``vllm serve`` on the CPU with the kvtier connector |
| ``fleet`` | ``ReplicaProcess`` (a ``kvtier serve`` process), ``LiveRouter``, ``scrape`` |
| ``serve`` | ``build_tiny_model``, ``LiveServer``/``start_server`` (kvtier serve in this process) |
| ``stub_replica``, ``hostile_events``, ``malformed`` | hostile peers and bodies for the router and the server |
| ``vllm_router``, ``render_replica`` | ``VllmRouter`` (kv_aware); ``RenderReplica`` (a vLLM that only renders) |
| ``blend_models``, ``sglang_pool`` | tiny decoders for blending; SGLang's host pool layout without CUDA |
"""
