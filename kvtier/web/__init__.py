"""HTTP pieces ``kvtier serve`` and ``kvtier route`` share: request errors, bodies, limits, tenants."""
