"""The environment contract: what a class must offer to be an environment, and how the harness uses it.

An environment is a class whose instances hold the state of one episode (the spec's contract):

    class CounterEnv(Environment):
        manifest = Manifest(name="counter", reward_names=("reached_target",))

        def reset(self, target: int = 3, **row) -> str | None:   # required; row = the dataset row
            self.value, self.target = 0, target
            return f"Increment the counter to {target}."          # becomes or extends the user prompt

        def increment(self, step: int) -> int:                    # public methods are the tools
            '''Add to the counter.

            Args:
                step: How much to add.
            '''
            self.value += step
            return self.value

        def get_reward(self) -> float:                            # optional, sync or async
            return float(self.value == self.target)

Inheriting from `Environment` is optional: any class with a `reset` method works, as in the reference.
The base adds the `sandbox` attribute (the rollout's sandbox, attached by the harness before `reset`
when the manifest asks for one) and documents the hooks. Any of reset, get_reward and close may be
`async def`. Instances are reused across episodes (reset between them) and `close()` is called when one
is discarded. Reserved names (reset, get_reward, close, manifest, sandbox, and anything starting with
an underscore) are never tools; nor are class and static methods.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any, ClassVar

from environments.errors import InvalidEnvironment
from environments.manifest import Manifest
from tools import Tool, ToolDefinitionError, Toolset
from tools.sandboxed import SandboxTools

RESERVED_NAMES = frozenset({"reset", "get_reward", "close", "manifest", "sandbox"})
EnvironmentFactory = Callable[[], Any]


class Environment:
    """Optional base class of environments (see the module docstring for the contract)."""

    manifest: ClassVar[Manifest | None] = None
    sandbox: Any = None  # sandboxes.Sandbox, attached by the harness when the manifest asks for one

    def reset(self, **row: Any) -> str | None:
        """Start an episode from a dataset row; return text for the user prompt, or None."""
        raise NotImplementedError(f"{type(self).__name__} must define reset(self, **row)")

    def close(self) -> None:
        """Release what the instance holds; called when the harness discards it."""


def environment_class(factory: EnvironmentFactory) -> type:
    """The class a factory makes: the factory itself when it is a class, else the type of one instance
    (building one is the only way to know what a plain function returns)."""
    if inspect.isclass(factory):
        return factory
    return type(factory())


def manifest_of(cls: type) -> Manifest:
    """The class's manifest, or the default one for a class that declares none."""
    manifest = getattr(cls, "manifest", None)
    if manifest is None:
        return Manifest(name=_slug(cls.__name__))
    if not isinstance(manifest, Manifest):
        raise InvalidEnvironment(
            f"{_where(cls)}.manifest must be an environments.Manifest, got {type(manifest).__name__}"
        )
    return manifest


def tool_method_names(cls: type, manifest: Manifest) -> list[str]:
    """The methods of `cls` exposed as tools: the manifest's list, or every public instance method."""
    public = [
        name
        for name in dir(cls)
        if not name.startswith("_")
        and name not in RESERVED_NAMES
        and not hasattr(Environment, name)
        and inspect.isfunction(inspect.getattr_static(cls, name))
    ]
    if manifest.tools is None:
        return sorted(public, key=lambda name: _definition_order(cls, name))
    return list(manifest.tools)


def validate_environment(cls: type) -> Manifest:
    """Check a class against the contract; return its manifest. Raises InvalidEnvironment naming the fix."""
    where = _where(cls)
    manifest = manifest_of(cls)
    reset = getattr(cls, "reset", None)
    if not callable(reset):
        raise InvalidEnvironment(f"{where} has no reset method; define reset(self, **row) -> str | None")
    get_reward = getattr(cls, "get_reward", None)
    if get_reward is not None:
        required = [
            p.name
            for p in list(inspect.signature(get_reward).parameters.values())[1:]
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        if required:
            raise InvalidEnvironment(f"{where}.get_reward must take no arguments, but requires {required}")
    names = tool_method_names(cls, manifest)
    for name in names:
        if name in RESERVED_NAMES or name.startswith("_"):
            raise InvalidEnvironment(
                f"{where}: manifest tool {name!r} is a reserved name and cannot be a tool"
            )
        attribute = inspect.getattr_static(cls, name, None)
        if not inspect.isfunction(attribute):
            raise InvalidEnvironment(
                f"{where}: manifest tool {name!r} is not an instance method of the class"
            )
        try:
            Tool.from_callable(getattr(cls, name))
        except ToolDefinitionError as exc:
            raise InvalidEnvironment(
                f"{where}: tool {name!r} cannot be described to the model: {exc}"
            ) from exc
    clash = set(names) & set(manifest.sandbox_tools)
    if clash:
        raise InvalidEnvironment(f"{where}: {sorted(clash)} are both methods and sandbox_tools; rename one")
    return manifest


def environment_tools(env: Any, manifest: Manifest) -> Toolset:
    """The tools of one live instance: its methods, then the manifest's sandbox tools bound to its sandbox."""
    methods = [
        Tool.from_callable(getattr(env, name), timeout_s=manifest.tool_timeout_s)
        for name in tool_method_names(type(env), manifest)
    ]
    toolset = Toolset(methods)
    if manifest.sandbox_tools:
        sandbox = getattr(env, "sandbox", None)
        if sandbox is None:
            raise InvalidEnvironment(
                f"{_where(type(env))} needs a sandbox for its sandbox_tools, but none is attached"
            )
        sandboxed = SandboxTools(sandbox, timeout_s=manifest.tool_timeout_s).toolset()
        toolset = toolset | Toolset(sandboxed[name] for name in manifest.sandbox_tools)
    return toolset


def reward_names(cls: type, manifest: Manifest) -> tuple[str, ...]:
    """The names the environment's rewards are logged under (rewards/{name}/...): the manifest's, else
    the class name, as the reference does."""
    if manifest.reward_names:
        return manifest.reward_names
    return (cls.__name__,) if callable(getattr(cls, "get_reward", None)) else ()


def _slug(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "-", name).lower().replace("_", "-")


def _where(cls: type) -> str:
    return f"environment class {cls.__module__}.{cls.__qualname__}"


def _definition_order(cls: type, name: str) -> int:
    """Order tools as the class defines them (the prompt lists them in that order)."""
    for depth, klass in enumerate(reversed(cls.__mro__)):
        if name in vars(klass):
            return depth * 10_000 + list(vars(klass)).index(name)
    return 1 << 30
