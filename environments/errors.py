"""The exceptions of the environments package; each also subclasses the stdlib error it refines."""

from __future__ import annotations


class EnvironmentsError(Exception):
    """Base class of every error raised by the environments package."""


class InvalidEnvironment(EnvironmentsError, TypeError):
    """An environment class or its manifest breaks the contract (no reset, a bad tool, bad limits, ...)."""


class UnknownEnvironment(EnvironmentsError, LookupError):
    """No environment is registered under that name."""


class PluginLoadError(EnvironmentsError, ImportError):
    """An environment plugin could not be imported; the message carries its traceback."""


class DuplicateEnvironment(EnvironmentsError, ValueError):
    """Two sources register the same environment name."""


class RoutingError(EnvironmentsError, ValueError):
    """A dataset row names an environment the run does not have, or routing is ambiguous."""
