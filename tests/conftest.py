"""Suite-wide settings: metrics are strict, so an undeclared metric name fails the test that uses it."""

import os

os.environ["KVTIER_METRICS_STRICT"] = "1"  # read by kvtier.base.metrics; inherited by the servers tests start
