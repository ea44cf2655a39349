"""The small error hierarchy kvtier raises across its boundaries.

Tiers translate their backend's failures (OSError, redis errors, ...) into these at the tier boundary;
KVCache turns every one of them into a miss or a skipped store plus a metric, so none reaches an engine.
"""


class KVTierError(Exception):
    """Base class of every error kvtier raises on purpose."""


class ConfigError(KVTierError, ValueError):
    """A configuration value is missing, malformed or inconsistent."""


class InvalidArgument(ConfigError):
    """A call got an argument it cannot use (a tensor of the wrong shape or dtype, token ids out of range).

    A ConfigError subclass only so that callers written against the earlier contract, which raised
    ConfigError for these, keep catching them; catch InvalidArgument to tell a bad call from a bad config.
    """


class BlobError(KVTierError):
    """Stored bytes do not decode: truncated, corrupt, of another key or tokens, or of an unknown format."""


class CodecError(BlobError):
    """A codec cannot encode or decode the given chunk or payload."""


class TierError(KVTierError):
    """A tier failed (I/O error, store unreachable, timeout). Callers treat it as a miss or a skipped store."""


class PinBudgetExceeded(InvalidArgument):
    """A pin would take a tier's pinned bytes past its pin budget (``pin_budget_bytes``): nothing was pinned."""


class NotSupported(InvalidArgument):
    """A tier cannot do what a cache-control call asks (a shared store without pins, say): nothing changed."""


class MissingDependency(ConfigError):
    """An optional module a feature needs is not installed; the message names the extra that brings it."""
