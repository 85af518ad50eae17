"""Lazy package exports (PEP 562): a package names its public objects and the module of each, and a name is
imported on first use. So `import harness`, `harness --help` and the built-in server's start load only what
they touch (torch, transformers and aiohttp stay out until a name needs them).

    _EXPORTS = {"AsyncRolloutLoop": "harness.rollout.loop"}
    __all__ = sorted(_EXPORTS)
    __getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_exports(
    namespace: dict[str, Any], exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level `__getattr__` and `__dir__` of a package whose public names are `exports`."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(module), name)
        namespace[name] = value  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
