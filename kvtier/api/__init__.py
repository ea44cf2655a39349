"""The engine-free, framework-free parts of kvtier's HTTP APIs: request errors (OpenAI's envelope), tenants
(the API key and the cache salt it derives) and the admin API (bodies, who may call what, OpenAPI, and the
handling of each call over a cache's ``control``).

A layer below the integrations and above the core, so that every server that answers kvtier's admin API uses
one implementation: ``kvtier serve`` (FastAPI, kvtier.apps.serve.admin), ``kvtier route`` (kvtier.apps.route)
and the vLLM connector's per-rank metrics server (kvtier.integrations.vllm.admin, a stdlib HTTP server). It
imports no web framework and no engine (msgspec and the standard library only); kvtier.web re-exports what the
FastAPI servers import from here.
"""
