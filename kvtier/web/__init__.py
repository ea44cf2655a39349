"""HTTP pieces ``kvtier serve`` and ``kvtier route`` share (FastAPI/Starlette): bodies, limits, start-up. Request
errors, tenants and the admin API's shared parts live in kvtier.api, below the integrations, because the vLLM
connector answers them too."""
