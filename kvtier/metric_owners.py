"""Every metric of kvtier: this module imports each module that declares metrics, so ``declared()`` is complete.

It sits above all the layers (pyproject.toml's import contracts), because the modules that declare metrics
span them all, from the ground (kvtier.base.metrics) to the applications; the ground layer itself only knows the
declarations made so far. Importing this module imports torch, transformers and the web framework: it is for
the generated metrics reference (docs/hooks/reference.py) and the tests, never for a serving path. A module that
starts declaring metrics is added here; a test checks that none is missing.
"""

from __future__ import annotations

import kvtier.apps.route.metrics
import kvtier.apps.serve.metrics
import kvtier.base.metrics
import kvtier.core.metrics
import kvtier.integrations.blend.lm
import kvtier.tiers.disk.tier
import kvtier.tiers.metrics
import kvtier.tiers.mooncake.tier
import kvtier.tiers.mooncake.transfers
import kvtier.tiers.redis.tier
from kvtier.base.metric_decls import MetricDecl, declarations_so_far


def declared() -> list[MetricDecl]:
    """Every declaration of kvtier, sorted by name (the owners were imported with this module; an ImportError
    of an owner's dependency propagated then: a partial list would be a wrong reference)."""
    return declarations_so_far()
