"""Environments: the episodes an agent is trained in, declared with a manifest, found through a registry.

    from environments import Environment, Manifest, load
    CounterEnv = load("counter")                     # bundled, a plugin, or registered from code

An environment is a class with `reset(**row)`, optional `get_reward()`, and public methods the model
calls as tools (`environments.base` has the contract). Its `Manifest` declares its tools, sandbox,
limits, timeouts and reward names, and is validated when the environment is loaded. Plugins register
under the entry-point group `harness.environments` (`environments.registry`); `environments.routing`
maps dataset rows to environments. Bundled: counter, arithmetic, word-guess, python-coding.
"""

from environments.base import Environment, environment_tools, validate_environment
from environments.errors import (
    DuplicateEnvironment,
    EnvironmentsError,
    InvalidEnvironment,
    PluginLoadError,
    RoutingError,
    UnknownEnvironment,
)
from environments.manifest import Manifest
from environments.registry import entries, load, load_manifest, register, unregister
from environments.routing import RoutedEnvironment, check_routes, reset_arguments, resolve_environments, route

__all__ = [
    "DuplicateEnvironment",
    "Environment",
    "EnvironmentsError",
    "InvalidEnvironment",
    "Manifest",
    "PluginLoadError",
    "RoutedEnvironment",
    "RoutingError",
    "UnknownEnvironment",
    "check_routes",
    "entries",
    "environment_tools",
    "load",
    "load_manifest",
    "register",
    "reset_arguments",
    "resolve_environments",
    "route",
    "unregister",
    "validate_environment",
]
