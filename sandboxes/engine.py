"""Access to a Docker engine, shared by the Docker backend (docker.py) and the reaper (reaper.py).

    client = docker_client()                      # the process's SDK client; EngineUnavailable if none
    info = await engine_call(client.api.inspect_container, container_id)   # off the event loop, bounded
    remove_container(client, container_id)        # forced, idempotent
    container_state(client, container_id)         # "container status exited, exit code 137, ..." for errors

Every container we make carries the labels in `LABELS` (run, owner host, owner pid and its start time,
creation time, sandbox name): they are what the reaper reads to tell an orphan from a live sandbox, and it
never touches a container without `agent-harness.managed=1`. The docker SDK is imported on first use only.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

from sandboxes import errors

MAX_ENGINE_CALLS = 32
LABEL_PREFIX = "agent-harness"
LABELS = {
    "managed": f"{LABEL_PREFIX}.managed",
    "run_id": f"{LABEL_PREFIX}.run-id",
    "owner_host": f"{LABEL_PREFIX}.owner-host",
    "owner_pid": f"{LABEL_PREFIX}.owner-pid",
    "owner_start": f"{LABEL_PREFIX}.owner-start",
    "created_at": f"{LABEL_PREFIX}.created-at",
    "sandbox": f"{LABEL_PREFIX}.sandbox",
}


T = TypeVar("T")
_client_lock = threading.Lock()
_client: Any = None
_limiters: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, anyio.CapacityLimiter] = (
    weakref.WeakKeyDictionary()
)


def docker_client() -> Any:
    """The process's docker SDK client (created on first use); EngineUnavailable when no engine answers."""
    global _client
    with _client_lock:
        if _client is None:
            import docker

            try:
                client = docker.from_env(timeout=120, max_pool_size=MAX_ENGINE_CALLS)
                client.ping()
            except docker.errors.DockerException as exc:
                host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
                raise errors.EngineUnavailable(
                    f"no Docker engine answers at {host}: start dockerd (or set DOCKER_HOST to a running "
                    f"engine), or use the local backend; the SDK said: {exc}"
                ) from exc
            _client = client
        return _client


async def engine_call(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a blocking docker SDK call on a worker thread, bounded by MAX_ENGINE_CALLS per event loop."""
    loop = asyncio.get_running_loop()
    limiter = _limiters.get(loop)
    if limiter is None:
        limiter = _limiters[loop] = anyio.CapacityLimiter(MAX_ENGINE_CALLS)
    return await anyio.to_thread.run_sync(lambda: function(*args, **kwargs), limiter=limiter)


def container_state(client: Any, container_id: str) -> str:
    """What the engine says of a container, for an error message."""
    import docker

    try:
        attrs = client.api.inspect_container(container_id)
    except docker.errors.NotFound:
        return "its container no longer exists (removed from outside)"
    state = attrs.get("State", {})
    text = f"container status {state.get('Status')}, exit code {state.get('ExitCode')}"
    if state.get("OOMKilled"):
        text += ", killed for running out of memory"
    return text


def remove_container(client: Any, container_id: str) -> None:
    """Remove a container, forced; a container already gone or being removed is not an error."""
    import docker

    with contextlib.suppress(docker.errors.NotFound):
        try:
            client.api.remove_container(container_id, force=True)
        except docker.errors.APIError as exc:
            if exc.status_code != 409:  # 409: removal already in progress
                raise


__all__ = [
    "LABELS",
    "LABEL_PREFIX",
    "MAX_ENGINE_CALLS",
    "container_state",
    "docker_client",
    "engine_call",
    "remove_container",
]
