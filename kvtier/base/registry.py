"""Lazy registries: a name maps to a module path and an attribute, imported the first time the name is used.

The one registry shape behind tier kinds, tier classes, codec families and eviction policies (as vLLM's
``kv_offload/factory.py`` registers offloading specs). Registering a name imports nothing, so a package can
list every implementation it offers while importing none of them: a tier's config never imports its tier,
``import kvtier.tiers`` pulls in no Redis or Mooncake client, a policy is loaded when a tier asks for it.

Contract:

* ``register(name, module, attr, **kwargs)`` records where ``name`` lives; ``add(name, value)`` records an
  object already at hand (a tier config defined in a test). A name is registered once: a second
  registration is a ConfigError.
* ``registry[name]`` imports ``module`` on first use and returns its ``attr`` (with ``kwargs`` bound by
  ``functools.partial`` where given), the same object on every later lookup. An unregistered name is a
  KeyError, as in any mapping; ``lookup(name)`` raises a ConfigError naming the known names instead.
* ``name in registry``, ``len``, iteration and ``names()`` look at names only and import nothing.
  ``values()`` and ``items()`` resolve every entry.
* Lookups are thread-safe; a module that fails to import raises its ImportError at the lookup and is tried
  again at the next one.

``lazy_exports`` gives a package the same laziness for the names it re-exports (PEP 562 ``__getattr__``).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, TypeVar

from kvtier.base.errors import ConfigError

T = TypeVar("T")
_MISSING: Any = object()


@dataclass(frozen=True)
class Entry:
    """Where a registered name lives: ``getattr(import_module(module), attr)``, called with ``kwargs`` bound
    when there are any."""

    module: str
    attr: str
    kwargs: tuple[tuple[str, Any], ...] = ()

    def load(self) -> Any:
        value = getattr(importlib.import_module(self.module), self.attr)
        return partial(value, **dict(self.kwargs)) if self.kwargs else value


class Registry(Mapping[str, T], Generic[T]):
    """Names of one kind of thing (``what``: "tier kind", "codec", ...), each resolved on first use."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._entries: dict[str, Entry | None] = {}  # None: added as an object, never imported
        self._loaded: dict[str, T] = {}
        self._lock = threading.Lock()

    def register(self, name: str, module: str, attr: str, **kwargs: Any) -> None:
        """Make ``name`` resolve to ``module.attr`` (partially applied to ``kwargs``); imports nothing."""
        with self._lock:
            self._claim(name)
            self._entries[name] = Entry(module, attr, tuple(sorted(kwargs.items())))

    def add(self, name: str, value: T) -> None:
        """Make ``name`` resolve to ``value``, an object already loaded."""
        with self._lock:
            self._claim(name)
            self._entries[name] = None
            self._loaded[name] = value

    def lookup(self, name: str) -> T:
        """``self[name]``, or a ConfigError that names the known names."""
        try:
            return self[name]
        except KeyError:
            raise ConfigError(f"unknown {self.what} {name!r}; known: {self.names()}") from None

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def is_loaded(self, name: str) -> bool:
        """Whether ``name`` has been resolved (or was added as an object)."""
        return name in self._loaded

    def entry(self, name: str) -> Entry | None:
        """Where ``name`` lives; None for a name added as an object. KeyError if unregistered."""
        return self._entries[name]

    def __getitem__(self, name: str) -> T:
        value = self._loaded.get(name, _MISSING)
        if value is not _MISSING:
            return value
        entry = self._entries[name]  # KeyError for an unregistered name
        assert entry is not None  # an added object is in _loaded from the start
        value = entry.load()  # outside the lock: a module being imported may register names of its own
        with self._lock:
            return self._loaded.setdefault(name, value)  # a concurrent first lookup may have won: keep its object

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}, {self.names()})"

    def _claim(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"a {self.what} needs a non-empty name, not {name!r}")
        if name in self._entries:
            raise ConfigError(f"{self.what} {name!r} registered twice")


def lazy_exports(module: str, namespace: dict[str, Any], exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``module`` (PEP 562): each name of ``exports`` (name -> the module
    that defines it) is imported on first access and then kept in ``namespace`` (the module's globals), so
    later accesses are plain attribute reads. Any other name is an AttributeError."""

    def __getattr__(name: str) -> Any:
        source = exports.get(name)
        if source is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source), name)
        namespace[name] = value
        return value

    return __getattr__
