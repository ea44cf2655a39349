"""kvtier.base.registry: names resolve to module attributes on first use, never before."""

import importlib
import sys
import textwrap
import threading

import pytest

from kvtier.base.errors import ConfigError
from kvtier.base.registry import Registry


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A module on sys.path that no test has imported yet; counts how often it was imported."""
    name = f"kvtier_registry_plugin_{abs(hash(tmp_path)) % 10**9}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        import builtins
        builtins.kvtier_plugin_imports = getattr(builtins, "kvtier_plugin_imports", 0) + 1

        class Thing:
            def __init__(self, size=1, colour="red"):
                self.size, self.colour = size, colour
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    import builtins

    builtins.kvtier_plugin_imports = 0
    yield name
    sys.modules.pop(name, None)
    del builtins.kvtier_plugin_imports


def test_registering_and_asking_about_names_imports_nothing(plugin):
    things = Registry("thing")
    things.register("thing", plugin, "Thing")
    assert "thing" in things and "other" not in things
    assert list(things) == ["thing"] and len(things) == 1 and things.names() == ["thing"]
    assert not things.is_loaded("thing")
    assert plugin not in sys.modules


def test_first_lookup_imports_once_and_returns_the_attribute(plugin):
    import builtins

    things = Registry("thing")
    things.register("thing", plugin, "Thing")
    cls = things["thing"]
    assert plugin in sys.modules and things.is_loaded("thing")
    assert cls is sys.modules[plugin].Thing
    assert things["thing"] is cls and things.lookup("thing") is cls
    assert builtins.kvtier_plugin_imports == 1


def test_keyword_arguments_are_bound(plugin):
    things = Registry("thing")
    things.register("big", plugin, "Thing", size=9)
    thing = things["big"]()
    assert (thing.size, thing.colour) == (9, "red")
    assert things["big"](colour="blue").colour == "blue"


def test_unknown_names_and_second_registrations_are_refused():
    things = Registry("thing")
    things.register("a", "json", "dumps")
    with pytest.raises(KeyError):
        things["b"]
    with pytest.raises(ConfigError, match=r"unknown thing 'b'; known: \['a'\]"):
        things.lookup("b")
    with pytest.raises(ConfigError, match="registered twice"):
        things.register("a", "json", "loads")
    with pytest.raises(ConfigError, match="registered twice"):
        things.add("a", object())
    with pytest.raises(ConfigError, match="non-empty name"):
        things.register("", "json", "loads")
    assert things.get("b") is None  # the Mapping protocol holds


def test_added_objects_resolve_to_themselves():
    things = Registry("thing")
    value = object()
    things.add("x", value)
    assert things.is_loaded("x") and things["x"] is value and things.entry("x") is None


def test_a_failed_import_is_raised_at_lookup_and_tried_again(plugin, tmp_path):
    things = Registry("thing")
    things.register("late", "kvtier_registry_module_made_later", "VALUE")
    with pytest.raises(ImportError):
        things["late"]
    (tmp_path / "kvtier_registry_module_made_later.py").write_text("VALUE = 42\n")
    importlib.invalidate_caches()  # the path finder caches directory listings
    try:
        assert things["late"] == 42
    finally:
        sys.modules.pop("kvtier_registry_module_made_later", None)


def test_concurrent_first_lookups_see_one_object(plugin):
    things = Registry("thing")
    things.register("made", plugin, "Thing", size=3)
    seen, barrier = [], threading.Barrier(8)

    def look():
        barrier.wait()
        seen.append(things["made"])

    threads = [threading.Thread(target=look) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(v) for v in seen}) == 1
