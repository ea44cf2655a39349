"""HTTP pieces ``kvtier serve`` and ``kvtier route`` share (FastAPI/Starlette): bodies, limits, start-up; request
errors, tenants and the admin API's shared parts are re-exported from kvtier.api, which the vLLM connector uses
too."""
