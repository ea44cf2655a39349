"""``kvtier bench``: workloads against OpenAI-compatible endpoints (``workloads``), sent and timed by
``runner``/``client``, summarised by ``report``; ``launch`` starts kvtier servers to compare."""
