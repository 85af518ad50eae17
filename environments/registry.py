"""The environment registry: names -> environment classes, from the bundled set, plugins and code.

Three sources, one namespace:
- the bundled environments (`BUILTIN` below);
- installed plugins: any distribution declaring, in its pyproject.toml,

      [project.entry-points."harness.environments"]
      my-env = "my_package.envs:MyEnv"

- `register(name, factory)` from code (and tests).

Plugins are imported only when asked for (`load`), so one broken plugin never hides the others: `load`
of a good name works, `load` of the broken one raises `PluginLoadError` with its traceback, and
`entries()` lists every name with, for a broken one, its error. Whatever a plugin raises at import is its
error, SystemExit included, and an import that does not finish within PLUGIN_IMPORT_TIMEOUT_S (the
environment variable HARNESS_PLUGIN_IMPORT_TIMEOUT_S overrides it) is one too: it is left on a daemon
thread, which holds neither the caller nor the process at exit. The same name from two sources is a
`DuplicateEnvironment` naming both, never a silent override. Every class is validated against the
environment contract (`environments.base.validate_environment`) when it is loaded.
"""

from __future__ import annotations

import difflib
import importlib
import os
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType
from typing import Any

from environments.base import validate_environment
from environments.errors import DuplicateEnvironment, PluginLoadError, UnknownEnvironment
from environments.manifest import Manifest

ENTRY_POINT_GROUP = "harness.environments"
BUILTIN: dict[str, str] = {
    "counter": "environments.counter:CounterEnv",
    "arithmetic": "environments.arithmetic:ArithmeticEnv",
    "word-guess": "environments.word_guess:WordGuessEnv",
    "python-coding": "environments.coding:CodingEnv",
}

PLUGIN_IMPORT_TIMEOUT_S = 30.0
_registered: dict[str, Callable[..., Any]] = {}


@dataclass(frozen=True)
class Entry:
    """One registered name and where it comes from (not yet imported)."""

    name: str
    source: str  # "builtin", "code", or "plugin <distribution> <version>"
    target: str  # "module:attr", or the factory's repr for code registrations


def register(name: str, factory: Callable[..., Any], *, replace: bool = False) -> None:
    """Register an environment class (or factory) under `name` from code; validated on `load`."""
    existing = {entry.name: entry for entry in _all_entries()}
    if name in existing and not (replace and existing[name].source == "code"):
        raise DuplicateEnvironment(
            f"environment {name!r} is already registered by {existing[name].source} "
            f"({existing[name].target}); pick another name, or pass replace=True to replace your own"
        )
    _registered[name] = factory


def unregister(name: str) -> None:
    """Forget a name registered from code (tests use it)."""
    _registered.pop(name, None)


def entries() -> list[Entry]:
    """Every registered name, sorted, without importing anything."""
    return sorted(_all_entries(), key=lambda entry: entry.name)


def load(name: str) -> Callable[..., Any]:
    """The environment class (or factory) registered as `name`, imported and validated."""
    matches = [entry for entry in _all_entries() if entry.name == name]
    if not matches:
        known = sorted({entry.name for entry in _all_entries()})
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownEnvironment(
            f"no environment named {name!r}.{hint} Registered: {', '.join(known) or 'none'}. Plugins "
            f"register under the entry-point group {ENTRY_POINT_GROUP!r}; `harness envs list` shows them."
        )
    if len(matches) > 1:
        sources = "; ".join(f"{entry.source} ({entry.target})" for entry in matches)
        raise DuplicateEnvironment(f"environment {name!r} is registered more than once: {sources}")
    (entry,) = matches
    factory = _registered[name] if entry.source == "code" else _import(entry)
    if isinstance(factory, type):
        validate_environment(factory)
    return factory


def load_manifest(name: str) -> Manifest:
    """The validated manifest of a registered environment."""
    from environments.base import environment_class

    return validate_environment(environment_class(load(name)))


def _all_entries() -> list[Entry]:
    found = [Entry(name, "builtin", target) for name, target in BUILTIN.items()]
    for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        distribution = getattr(entry_point, "dist", None)
        source = f"plugin {distribution.name} {distribution.version}" if distribution else "plugin"
        found.append(Entry(entry_point.name, source, entry_point.value))
    found += [Entry(name, "code", repr(factory)) for name, factory in _registered.items()]
    return found


def _import(entry: Entry) -> Callable[..., Any]:
    module_name, _, attr = entry.target.partition(":")
    try:
        target: Any = _import_module_within(module_name, entry)
        for part in attr.split(".") if attr else []:
            target = getattr(target, part)
    except PluginLoadError:
        raise
    except BaseException as exc:  # a plugin's SystemExit or KeyboardInterrupt at import is its failure
        if isinstance(exc, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
            raise  # the user's own Ctrl-C, not the plugin's
        details = "".join(traceback.format_exception(exc))
        raise PluginLoadError(
            f"environment {entry.name!r} ({entry.source}, {entry.target}) failed to import: "
            f"{type(exc).__name__}: {exc}\n{details}"
        ) from exc
    if not callable(target):
        raise PluginLoadError(f"environment {entry.name!r} ({entry.target}) is not a class or factory")
    return target


def _import_module_within(module_name: str, entry: Entry) -> ModuleType:
    """importlib.import_module on a daemon thread, given at most the import timeout; what it raised is
    raised here (anything, SystemExit included)."""
    timeout_s = float(os.environ.get("HARNESS_PLUGIN_IMPORT_TIMEOUT_S") or PLUGIN_IMPORT_TIMEOUT_S)
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["module"] = importlib.import_module(module_name)
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=f"import-{module_name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise PluginLoadError(
            f"environment {entry.name!r} ({entry.source}, {entry.target}) did not finish importing within "
            f"{timeout_s:g} s (it hangs at import); fix the plugin or uninstall it "
            "(HARNESS_PLUGIN_IMPORT_TIMEOUT_S sets the limit)"
        )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["module"]
