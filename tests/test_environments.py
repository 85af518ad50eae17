"""The environment contract, manifests, the registry (bundled, plugins, code) and routing."""

from __future__ import annotations

import sys
import types
from importlib import metadata

import pytest

import environments
from environments import (
    DuplicateEnvironment,
    Environment,
    InvalidEnvironment,
    Manifest,
    PluginLoadError,
    RoutingError,
    UnknownEnvironment,
    check_routes,
    environment_tools,
    register,
    reset_arguments,
    resolve_environments,
    route,
    unregister,
    validate_environment,
)
from environments.base import tool_method_names
from sandboxes import Limits, SandboxSpec


class Plain:
    """The reference's style: no base class, no manifest."""

    def reset(self, **row):
        self.n = 0

    def bump(self, by: int) -> int:
        """Bump.

        Args:
            by: Amount.
        """
        self.n += by
        return self.n

    def get_reward(self) -> float:
        return float(self.n)

    def _private(self) -> None:
        pass

    @classmethod
    def dataset(cls) -> list:
        return []

    @staticmethod
    def helper() -> None:
        pass


class Declared(Environment):
    manifest = Manifest(
        name="declared", version="2.1.0", tools=("go",), reward_names=("r",), max_concurrent=4
    )

    def reset(self, **row):
        return "go somewhere"

    def go(self, where: str) -> str:
        """Go.

        Args:
            where: Destination.
        """
        return where

    def stay(self, reason: str) -> str:
        """Not listed in the manifest, so not a tool.

        Args:
            reason: Why.
        """
        return reason


def test_plain_class_gets_a_default_manifest_and_public_instance_methods_as_tools():
    manifest = validate_environment(Plain)
    assert manifest.name == "plain"
    assert tool_method_names(Plain, manifest) == ["bump"]  # not reset/get_reward/_private/dataset/helper
    env = Plain()
    env.reset()
    assert environment_tools(env, manifest).names() == ["bump"]


def test_manifest_tools_restrict_what_is_exposed():
    manifest = validate_environment(Declared)
    assert environment_tools(Declared(), manifest).names() == ["go"]
    assert manifest.summary()["max_concurrent"] == 4


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"name": "Bad Name"}, "must be lowercase"),
        ({"name": "x", "version": ""}, "version must not be empty"),
        ({"name": "x", "sandbox_tools": ("bash",)}, "sandbox_tools need a sandbox"),
        ({"name": "x", "sandbox": SandboxSpec(), "sandbox_tools": ("rm",)}, "are not built-in tools"),
        ({"name": "x", "tool_timeout_s": 0}, "tool_timeout_s must be positive"),
        ({"name": "x", "max_concurrent": 0}, "max_concurrent must be at least 1"),
    ],
)
def test_invalid_manifests_are_refused_naming_the_problem(kwargs, needle):
    with pytest.raises(InvalidEnvironment, match=needle):
        Manifest(**kwargs)


def make_class(name: str, body: dict) -> type:
    return type(name, (), body)


def test_contract_violations_are_refused_naming_the_fix():
    with pytest.raises(InvalidEnvironment, match="has no reset method"):
        validate_environment(make_class("NoReset", {}))
    with pytest.raises(InvalidEnvironment, match="get_reward must take no arguments"):
        validate_environment(make_class("R", {"reset": lambda self: None, "get_reward": lambda self, x: 0.0}))

    def undocumented(self, x: int) -> int:
        return x

    with pytest.raises(InvalidEnvironment, match=r"tool 'undocumented' cannot be described.*no docstring"):
        validate_environment(make_class("U", {"reset": lambda self: None, "undocumented": undocumented}))
    listed_reserved = Manifest(name="r", tools=("reset",))
    with pytest.raises(InvalidEnvironment, match="'reset' is a reserved name"):
        validate_environment(make_class("Res", {"reset": lambda self: None, "manifest": listed_reserved}))
    missing = Manifest(name="m", tools=("fly",))
    with pytest.raises(InvalidEnvironment, match="'fly' is not an instance method"):
        validate_environment(make_class("M", {"reset": lambda self: None, "manifest": missing}))


def test_sandbox_tools_need_an_attached_sandbox():
    manifest = Manifest(name="s", sandbox=SandboxSpec(limits=Limits()), sandbox_tools=("bash",))
    env = make_class("S", {"reset": lambda self: None, "manifest": manifest})()
    with pytest.raises(InvalidEnvironment, match="needs a sandbox"):
        environment_tools(env, manifest)


def test_registry_finds_bundled_and_code_registered_and_refuses_duplicates():
    names = {entry.name for entry in environments.entries()}
    assert {"counter", "arithmetic", "word-guess", "python-coding"} <= names
    register("plain-test", Plain)
    try:
        assert environments.load("plain-test") is Plain
        with pytest.raises(DuplicateEnvironment, match="already registered by code"):
            register("plain-test", Declared)
        with pytest.raises(DuplicateEnvironment, match="already registered by builtin"):
            register("counter", Declared)
        register("plain-test", Declared, replace=True)
        assert environments.load("plain-test") is Declared
    finally:
        unregister("plain-test")


def test_unknown_name_lists_what_exists_and_the_closest_matches():
    with pytest.raises(UnknownEnvironment) as info:
        environments.load("countr")
    message = str(info.value)
    assert "Did you mean 'counter'?" in message
    assert "arithmetic" in message and "harness.environments" in message


class FakeEntryPoint:
    def __init__(self, name: str, value: str):
        self.name, self.value, self.dist = (
            name,
            value,
            types.SimpleNamespace(name="fake-plugins", version="9.9"),
        )


@pytest.fixture
def plugins(monkeypatch):
    """Two plugins: one good, one whose module raises on import."""
    good = types.ModuleType("fake_good_plugin")
    good.Plain = Plain
    broken = types.ModuleType("fake_broken_plugin")
    monkeypatch.setitem(sys.modules, "fake_good_plugin", good)
    monkeypatch.setattr(sys, "meta_path", [_Exploding("fake_broken_plugin"), *sys.meta_path], raising=True)
    del broken
    found = [
        FakeEntryPoint("good-plugin", "fake_good_plugin:Plain"),
        FakeEntryPoint("bad-plugin", "fake_broken_plugin:X"),
    ]
    real = metadata.entry_points

    def entry_points(**kwargs):
        return found if kwargs.get("group") == "harness.environments" else real(**kwargs)

    monkeypatch.setattr(metadata, "entry_points", entry_points)


class _Exploding:
    """An import hook that makes one module fail to import, as a broken plugin would."""

    def __init__(self, name: str):
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name:
            raise RuntimeError("plugin bug: cannot import this")
        return None


def test_a_broken_plugin_is_reported_with_its_traceback_and_hides_nothing(plugins):
    names = {entry.name: entry.source for entry in environments.entries()}
    assert names["good-plugin"] == "plugin fake-plugins 9.9"
    assert "bad-plugin" in names and "counter" in names
    assert environments.load("good-plugin") is Plain
    with pytest.raises(PluginLoadError) as info:
        environments.load("bad-plugin")
    assert "plugin bug: cannot import this" in str(info.value)
    assert "Traceback" in str(info.value)
    assert isinstance(info.value, ImportError)


def test_envs_list_shows_all_and_marks_the_broken_one(plugins, capsys):
    from harness.cli import main

    assert main(["envs", "list"]) == 1  # a plugin failed
    out = capsys.readouterr().out
    assert "good-plugin" in out and "counter" in out
    assert "bad-plugin           ERROR" in out


def test_envs_show_prints_manifest_and_tool_schemas(capsys):
    import json

    from harness.cli import main

    assert main(["envs", "show", "arithmetic"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["manifest"]["name"] == "arithmetic"
    assert [tool["function"]["name"] for tool in shown["tools"]] == ["calculator", "submit"]
    assert main(["envs", "show", "nope"]) == 1


def test_routing_single_dict_and_registry_names():
    single = resolve_environments(Plain)
    assert list(single) == ["plain"]
    assert route({"prompt": "x"}, single).cls is Plain
    mixed = resolve_environments({"coding": Declared, "count": "counter"})
    assert list(mixed) == ["coding", "count"]
    assert route({"environment": "count"}, mixed).manifest.name == "counter"
    assert route({"environment": "coding"}, mixed).cls is Declared
    assert resolve_environments("counter")["counter"].reward_names == ("reached_target",)
    assert reset_arguments({"environment": "count", "target": 3}) == {"target": 3}


def test_every_name_the_dataset_uses_is_checked_before_training():
    mixed = resolve_environments({"coding": Declared, "count": "counter"})
    check_routes(["environment"], ["coding", "count", "coding"], mixed)
    with pytest.raises(RoutingError) as info:
        check_routes(["environment", "prompt"], ["coding", "game", "game", "chess"], mixed)
    message = str(info.value)
    assert "'chess' (1 rows)" in message and "'game' (2 rows)" in message and "'coding'" in message
    with pytest.raises(RoutingError, match="needs an 'environment' column"):
        check_routes(["prompt"], None, mixed)
    with pytest.raises(RoutingError, match="no 'environment' column"):
        route({"prompt": "x"}, mixed)
    with pytest.raises(UnknownEnvironment):
        resolve_environments({"a": "no-such-env"})
