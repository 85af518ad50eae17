"""Sandboxes: isolated places to run model-written code, with one async interface for every backend.

    async with create_sandbox(SandboxSpec(backend="docker")) as sandbox:
        result = await sandbox.exec("python3 -c 'print(1)'", timeout_s=10)

Backends: "docker" (containers, `sandboxes/docker.py`), "local" (bubblewrap namespaces,
`sandboxes/local.py`), and "unsafe-subprocess" (no isolation, for debugging only). Each backend's module
docstring says what it protects against and what it does not. `SandboxPool` keeps warm sandboxes and
hands out leases; the reaper removes what killed runs left behind. This package knows nothing of the
trainer; it imports docker only when a Docker sandbox is made.
"""

from sandboxes.backends import create_sandbox
from sandboxes.base import RUN_ID, ExecResult, Limits, Sandbox, SandboxSpec
from sandboxes.errors import (
    EngineUnavailable,
    ImageNotFound,
    InvalidSandboxConfig,
    SandboxClosed,
    SandboxDied,
    SandboxError,
    SandboxFileError,
    SandboxFileNotFound,
    SandboxStartError,
    SandboxTimeout,
)
from sandboxes.pool import PoolStats, SandboxPool

__all__ = [
    "RUN_ID",
    "EngineUnavailable",
    "ExecResult",
    "ImageNotFound",
    "InvalidSandboxConfig",
    "Limits",
    "PoolStats",
    "Sandbox",
    "SandboxClosed",
    "SandboxDied",
    "SandboxError",
    "SandboxFileError",
    "SandboxFileNotFound",
    "SandboxPool",
    "SandboxSpec",
    "SandboxStartError",
    "SandboxTimeout",
    "create_sandbox",
]
