"""The cache core. Importing it declares the core's metrics (kvtier.core.metrics), which its modules record by
name."""

from kvtier.core import metrics as _metrics  # noqa: F401
