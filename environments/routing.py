"""Routing dataset rows to environments, and checking every route before training starts.

`environment_factory` (the trainer argument) is one of:
- a class or factory: every row uses it;
- a registry name ("counter", or a plugin's name): the same, loaded from the registry;
- a dict name -> class, factory or registry name: each row's `environment` column picks one, and only
  that environment's tools are rendered in the row's prompt.

`resolve_environments` turns it into `RoutedEnvironment`s, validating each (contract and manifest);
`check_routes` runs before training and raises one `RoutingError` listing every environment name the
dataset uses but the run does not have. `reset_arguments` is what a row passes to `reset`: every column
but `environment`, which the router consumes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from environments import registry
from environments.base import environment_class, reward_names, validate_environment
from environments.errors import RoutingError
from environments.manifest import Manifest

ROUTE_COLUMN = "environment"


@dataclass(frozen=True)
class RoutedEnvironment:
    """An environment the run uses: its route name, how to build it, and what it declares."""

    name: str
    factory: Callable[[], Any]
    cls: type
    manifest: Manifest

    @property
    def reward_names(self) -> tuple[str, ...]:
        return reward_names(self.cls, self.manifest)


def resolve_environments(environment_factory: Any) -> dict[str, RoutedEnvironment]:
    """Validate the trainer's `environment_factory` and name each environment (see the module docstring)."""
    if environment_factory is None:
        return {}
    if isinstance(environment_factory, Mapping):
        if not environment_factory:
            raise RoutingError("environment_factory is an empty dict; give at least one name -> factory")
        return {str(name): _routed(str(name), value) for name, value in environment_factory.items()}
    routed = _routed(None, environment_factory)
    return {routed.name: routed}


def route(row: Mapping[str, Any], environments: Mapping[str, RoutedEnvironment]) -> RoutedEnvironment:
    """The environment of one dataset row."""
    if len(environments) == 1:
        return next(iter(environments.values()))
    if ROUTE_COLUMN not in row:
        raise RoutingError(
            f"the run has several environments ({', '.join(environments)}) but a row has no "
            f"{ROUTE_COLUMN!r} column to pick one"
        )
    name = row[ROUTE_COLUMN]
    if name not in environments:
        raise RoutingError(_unknown_message({name: 1}, environments))
    return environments[name]


def check_routes(
    column_names: Iterable[str],
    route_values: Iterable[Any] | None,
    environments: Mapping[str, RoutedEnvironment],
) -> None:
    """Before training: every row can be routed. `route_values` is the dataset's environment column."""
    if len(environments) <= 1:
        return
    if ROUTE_COLUMN not in set(column_names) or route_values is None:
        raise RoutingError(
            f"environment_factory maps {len(environments)} environments ({', '.join(environments)}), so each "
            f"dataset row needs an {ROUTE_COLUMN!r} column naming one; the dataset has none"
        )
    counts = Counter(route_values)
    unknown = {name: count for name, count in counts.items() if name not in environments}
    if unknown:
        raise RoutingError(_unknown_message(unknown, environments))


def reset_arguments(row: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments `reset` gets for a row: its columns, without the routing column."""
    return {key: value for key, value in row.items() if key != ROUTE_COLUMN}


def _routed(name: str | None, value: Any) -> RoutedEnvironment:
    factory = registry.load(value) if isinstance(value, str) else value
    if not callable(factory):
        raise RoutingError(
            f"environment {name or value!r}: expected a class, a factory or a registry name, got "
            f"{type(value).__name__}"
        )
    cls = environment_class(factory)
    manifest = validate_environment(cls)
    return RoutedEnvironment(name=name or manifest.name, factory=factory, cls=cls, manifest=manifest)


def _unknown_message(unknown: Mapping[Any, int], environments: Mapping[str, RoutedEnvironment]) -> str:
    listed = ", ".join(f"{name!r} ({count} rows)" for name, count in sorted(unknown.items(), key=str))
    return (
        f"the dataset routes rows to environments the run does not have: {listed}; the run has "
        f"{', '.join(repr(name) for name in environments)}. Add them to environment_factory or fix the "
        f"{ROUTE_COLUMN!r} column."
    )
