"""The exceptions of the sandboxes package.

Every class also subclasses the stdlib error it refines, so `except TimeoutError` catches a sandbox
timeout, and each pickles (errors cross from the rollout worker process to the trainer). A command that
fails or times out inside a sandbox is not an exception: it is an `ExecResult`. These are for the sandbox
itself failing.
"""

from __future__ import annotations


class SandboxError(Exception):
    """Base class of every error raised by the sandboxes package."""


class InvalidSandboxConfig(SandboxError, ValueError):
    """A sandbox spec or its limits cannot be honoured (a negative memory limit, an unknown backend, ...)."""


class SandboxStartError(SandboxError, RuntimeError):
    """A sandbox could not be started."""


class ImageNotFound(SandboxStartError, LookupError):
    """The container image does not exist in the engine."""


class EngineUnavailable(SandboxStartError, ConnectionError):
    """The container engine (or bubblewrap) is not there or does not answer."""


class SandboxDied(SandboxError, ConnectionError):
    """A running sandbox went away: its container was removed, its executor was killed, its engine died."""


class SandboxTimeout(SandboxError, TimeoutError):
    """The sandbox did not answer in time (starting it, or an operation on it)."""


class SandboxClosed(SandboxError, RuntimeError):
    """The sandbox was used after close()."""


class SandboxFileError(SandboxError, OSError):
    """A file operation inside the sandbox failed (permission denied, a directory, too large, ...)."""


class SandboxFileNotFound(SandboxFileError, FileNotFoundError):
    """The path does not exist inside the sandbox."""


# What a tool call raising means the infrastructure failed (the rollout is typed failed, kept out of the
# group's statistics); a `SandboxFileError` is the model's own mistake (a path that does not exist, a file
# it may not write) and is shown to it as the tool's error instead.
INFRASTRUCTURE_ERRORS: tuple[type[SandboxError], ...] = (
    InvalidSandboxConfig,
    SandboxStartError,
    SandboxDied,
    SandboxTimeout,
    SandboxClosed,
)
