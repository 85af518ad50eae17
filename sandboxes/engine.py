"""Access to Docker engines, shared by the Docker backend (docker.py), placement (engines.py) and the
reaper (reaper.py).

    client = docker_client()                      # the engine of DOCKER_HOST; EngineUnavailable if none
    client = docker_client("tcp://10.0.0.7:2376") # another engine, by any URL the docker SDK takes
    info = await engine_call(client.api.inspect_container, container_id, engine=url)  # off the loop
    remove_container(client, container_id)        # forced, idempotent (remove_on(url, id) connects first)
    container_state(client, container_id)         # "container status exited, exit code 137, ..." for errors
    unreachable(exc)                              # whether an SDK error means the engine did not answer

An engine is named by its URL; "" means the engine of DOCKER_HOST (and DOCKER_TLS_VERIFY, DOCKER_CERT_PATH),
or the default socket. TLS for a tcp:// URL comes from those same variables. One client per engine per
process, each with its own bound on concurrent calls (`MAX_ENGINE_CALLS` per event loop), so a slow engine
never starves another.

Every container we make carries the labels in `LABELS` (run, owner host, owner pid and its start time,
creation time, sandbox name): they are what the reaper reads to tell an orphan from a live sandbox, and it
never touches a container without `agent-harness.managed=1`. The docker SDK is imported on first use only.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl as ssl_module
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import anyio

from sandboxes import errors

MAX_ENGINE_CALLS = 32
CALL_TIMEOUT_S = 120  # one SDK call; creating a container under load can take tens of seconds
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
_clients: dict[tuple[str, int], Any] = {}
_limiters: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, anyio.CapacityLimiter]] = (
    weakref.WeakKeyDictionary()
)


def engine_name(url: str) -> str:
    """How messages name an engine: its URL, or DOCKER_HOST's value for the default one."""
    return url or os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")


def docker_client(url: str = "", *, timeout_s: int = CALL_TIMEOUT_S) -> Any:
    """The process's docker SDK client for the engine at `url` ("" for DOCKER_HOST's), created on first use
    and checked to answer then; EngineUnavailable when it does not."""
    with _client_lock:
        client = _clients.get((url, timeout_s))
        if client is None:
            import docker

            try:
                client = _connect(url, timeout_s)
                client.ping()
            except (docker.errors.DockerException, OSError) as exc:
                hint = (
                    "start dockerd there" if url else "start dockerd (or set DOCKER_HOST to a running engine)"
                )
                raise errors.EngineUnavailable(
                    f"no Docker engine answers at {engine_name(url)}: {hint}, or use the local backend; "
                    f"the SDK said: {exc}"
                ) from exc
            _clients[(url, timeout_s)] = client
        return client


@dataclass(frozen=True)
class EngineAddress:
    """Where to open a raw connection to an engine: a unix socket, or a host and port (with TLS or not)."""

    unix_path: str | None = None
    host: str | None = None
    port: int | None = None
    ssl: ssl_module.SSLContext | None = None


def engine_address(url: str) -> EngineAddress:
    """How to reach the engine at `url` ("" for DOCKER_HOST's) over a connection of our own: its socket path,
    or host and port with TLS from DOCKER_TLS_VERIFY / DOCKER_CERT_PATH as the docker SDK reads them.
    SandboxStartError for a scheme that gives no such connection (ssh, npipe)."""
    import docker

    environment = docker.utils.kwargs_from_env()
    url = url or environment.get("base_url") or "unix:///var/run/docker.sock"
    scheme, _, rest = url.partition("://")
    if scheme == "unix":
        return EngineAddress(unix_path="/" + rest.lstrip("/"))
    if scheme in ("tcp", "http", "https"):
        parsed = urlsplit(f"//{rest}")
        tls = environment.get("tls")
        context = None
        if tls is not None or scheme == "https":
            context = ssl_module.create_default_context(cafile=getattr(tls, "ca_cert", None))
            if tls is not None and not tls.verify:
                context.check_hostname = False
                context.verify_mode = ssl_module.CERT_NONE
            if getattr(tls, "cert", None):
                context.load_cert_chain(*tls.cert)
        return EngineAddress(
            host=parsed.hostname, port=parsed.port or (2376 if context else 2375), ssl=context
        )
    raise errors.SandboxStartError(
        f"a sandbox's stream cannot go over a {scheme}:// engine ({url}): use unix:// or tcp:// (with TLS "
        "through DOCKER_TLS_VERIFY and DOCKER_CERT_PATH; for a remote host over SSH, forward its socket: "
        "`ssh -NL /tmp/remote.sock:/var/run/docker.sock host` and use unix:///tmp/remote.sock)"
    )


def _connect(url: str, timeout_s: int) -> Any:
    import docker

    environment = docker.utils.kwargs_from_env()
    base_url = url or environment.get("base_url")
    tls = environment.get("tls") if base_url and base_url.startswith(("tcp://", "https://")) else None
    if tls is None:
        return docker.DockerClient(base_url=base_url, timeout=timeout_s, max_pool_size=MAX_ENGINE_CALLS)

    # With TLS, the CA of DOCKER_CERT_PATH decides, as for the docker CLI: requests would let
    # REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE override it, so the environment is not consulted. The SDK asks the
    # engine for its API version inside the constructor, before trust_env can be set, so that is done first
    # with a client of the oldest version, and the real client is made with the engine's answer.
    def make(version: str) -> Any:
        client = docker.DockerClient(
            base_url=base_url, tls=tls, timeout=timeout_s, max_pool_size=MAX_ENGINE_CALLS, version=version
        )
        client.api.trust_env = False
        return client

    probe = make(docker.constants.MINIMUM_DOCKER_API_VERSION)
    try:
        engine_version = probe.api.version(api_version=False)["ApiVersion"]
    finally:
        probe.close()
    newest = docker.constants.DEFAULT_DOCKER_API_VERSION
    return make(min(engine_version, newest, key=lambda v: tuple(int(part) for part in v.split("."))))


def forget_client(url: str) -> None:
    """Drop the cached clients of an engine that stopped answering, so the next call connects afresh."""
    with _client_lock:
        for key in [key for key in _clients if key[0] == url]:
            with contextlib.suppress(Exception):
                _clients.pop(key).close()


def unreachable(exc: BaseException) -> bool:
    """Whether an error from the SDK means the engine did not answer (refused, reset, timed out), as opposed
    to an answer that says no (an APIError) or a bug."""
    import docker

    if isinstance(exc, errors.EngineUnavailable):
        return True
    if isinstance(exc, docker.errors.APIError):
        return False
    return isinstance(exc, (OSError, docker.errors.DockerException))


async def engine_call(function: Callable[..., T], *args: Any, engine: str = "") -> T:
    """Run a blocking docker SDK call on a worker thread, at most MAX_ENGINE_CALLS at once per engine and
    event loop."""
    loop = asyncio.get_running_loop()
    limiters = _limiters.setdefault(loop, {})
    limiter = limiters.get(engine)
    if limiter is None:
        limiter = limiters[engine] = anyio.CapacityLimiter(MAX_ENGINE_CALLS)
    return await anyio.to_thread.run_sync(lambda: function(*args), limiter=limiter)


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


# dockerd's overlay driver can fail a removal with "unable to remove filesystem ... directory not empty" while
# the container's mounts are still being torn down (seen here removing 500 containers at once over two
# engines); the same removal a moment later succeeds.
REMOVE_RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0)


def remove_container(client: Any, container_id: str) -> None:
    """Remove a container, forced; a container already gone or being removed is not an error, and a removal
    the engine fails while it is still unmounting the container is tried again (REMOVE_RETRY_DELAYS_S)."""
    import docker

    for delay in (*REMOVE_RETRY_DELAYS_S, None):
        try:
            client.api.remove_container(container_id, force=True)
            return
        except docker.errors.NotFound:
            return
        except docker.errors.APIError as exc:
            if exc.status_code == 409:  # removal already in progress
                return
            if delay is None or "unable to remove filesystem" not in str(exc.explanation or exc):
                raise
        time.sleep(delay)


def remove_on(url: str, container_id: str) -> None:
    """Blocking: remove a container from the engine at `url`, connecting first if needed."""
    remove_container(docker_client(url), container_id)


__all__ = [
    "CALL_TIMEOUT_S",
    "LABELS",
    "LABEL_PREFIX",
    "MAX_ENGINE_CALLS",
    "EngineAddress",
    "container_state",
    "docker_client",
    "engine_address",
    "engine_call",
    "engine_name",
    "forget_client",
    "remove_container",
    "remove_on",
    "unreachable",
]
