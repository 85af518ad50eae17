"""The Docker sandbox backend: one container per sandbox, its main process the resident executor.

The container is created from the spec's image with the executor (`sandboxes/agent.py`) as its command,
the host attaches to its stdin and stdout once, and every request goes over that stream: no `docker exec`
per command (which costs tens of milliseconds of runc start-up each). The docker SDK is blocking, so its
calls run on worker threads (at most `MAX_ENGINE_CALLS` at once); the request stream itself is read and
written on the event loop. One slow daemon call never freezes the other rollouts.

What it protects against:
- the request stream (forged answers): the executor is the container's pid 1 (no docker-init), running as
  root with only the capabilities it needs to start commands as uid 1000 and to kill them (SETUID,
  SETGID, KILL). Commands run as uid 1000 with no capabilities at all: they cannot
  signal the executor, open /proc/1/fd or /proc/1/mem, or trace it (it is also non-dumpable), and the
  executor's file operations act with uid 1000's rights. As pid 1 it reaps orphans.
- the network: `network_mode="none"` by default (loopback only, no DNS).
- the host's files and the engine: no host mounts, no Docker socket inside; the root filesystem is
  read-only, the working directory, /tmp and /dev/shm are size-capped tmpfs mounts whose sizes together
  stay a quarter (at least 64 MB) under `memory_mb`, so filling them is "no space left on device", never
  an out-of-memory kill.
- privilege: no-new-privileges; commands have no capabilities.
- resources: memory (swap included), pids and CPU are cgroup limits on the whole container; file size
  and open files are rlimits. A fork bomb hits the pids limit; a memory hog is OOM-killed inside.
- runaway commands: a timeout kills the command's whole process tree.
- secrets: nothing of the host environment enters the container.
- leaks: every container carries labels naming its run, owner host, owner pid (with the pid's start time)
  and creation time; close() removes it, an exit hook removes what is left open at interpreter exit,
  and the reaper (`harness sandbox reap`, also run when this process starts its first sandbox) removes
  containers whose owner process is gone, never one without our labels.

What it does not protect against:
- kernel exploits: containers share the host kernel (use a VM-based runtime such as gVisor or Kata
  through the engine for that).
- disk: the image's layers are read-only, and writes go to tmpfs, which counts toward memory.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections import deque
from datetime import UTC, datetime
from typing import Any

from sandboxes import errors
from sandboxes.base import RUN_ID, Sandbox, SandboxSpec
from sandboxes.channel import AgentChannel
from sandboxes.engine import (
    LABEL_PREFIX,
    LABELS,
    container_state,
    docker_client,
    engine_call,
    remove_container,
)
from sandboxes.owner import this_owner

SANDBOX_UID = SANDBOX_GID = 1000  # the image's `sandbox` user, whom commands run as
EXECUTOR_CAPABILITIES = ["SETUID", "SETGID", "KILL"]
_reaped_at_start = False


class DockerSandbox(Sandbox):
    """A container sandbox; see the module docstring for what it isolates."""

    def __init__(self, spec: SandboxSpec, *, name: str | None = None):
        super().__init__(spec, name=name)
        self.container_id: str | None = None
        self._stderr_tail: deque[str] = deque(maxlen=20)
        self._socket: socket.socket | None = None

    async def _launch(self) -> AgentChannel:
        client = await engine_call(docker_client)
        await _reap_once(client)
        self.container_id = await engine_call(self._create, client)
        raw = await engine_call(self._attach_and_start, client)
        reader, writer = await asyncio.open_connection(sock=raw)
        return AgentChannel(
            _Demultiplexer(reader, self._stderr_tail), writer, name=self.name, why_dead=self._why_dead
        )

    def _create(self, client: Any) -> str:
        import docker

        spec, limits = self.spec, self.spec.limits
        owner = this_owner()
        labels = {
            LABELS["managed"]: "1",
            LABELS["run_id"]: RUN_ID,
            LABELS["owner_host"]: owner.host,
            LABELS["owner_pid"]: str(owner.pid),
            LABELS["owner_start"]: str(owner.start_ticks),
            LABELS["created_at"]: datetime.now(UTC).isoformat(timespec="seconds"),
            LABELS["sandbox"]: self.name,
        }
        rlimits = {"fsize": limits.file_size_mb << 20, "nofile": 1024}
        tmpfs_options = "rw,exec,nosuid,nodev"
        workdir_mb, tmp_mb, shm_mb = tmpfs_sizes_mb(limits.memory_mb, limits.disk_mb)
        command = self.agent_command(
            "python3", spec.workdir, rlimits, command_user=(SANDBOX_UID, SANDBOX_GID)
        )
        try:
            container = client.containers.create(
                image=spec.image,
                command=command,
                name=f"{LABEL_PREFIX}-{self.name}",
                hostname="sandbox",
                user="0:0",  # the executor; its commands run as SANDBOX_UID (see the module docstring)
                working_dir=spec.workdir,
                environment={"HOME": spec.workdir, "LANG": "C.UTF-8"},
                labels=labels,
                stdin_open=True,
                tty=False,
                init=False,  # the executor is pid 1
                network_mode="bridge" if limits.network else "none",
                read_only=True,
                tmpfs={
                    spec.workdir: f"{tmpfs_options},size={workdir_mb}m,uid={SANDBOX_UID},gid={SANDBOX_GID},"
                    "mode=0755",
                    "/tmp": f"{tmpfs_options},size={tmp_mb}m,mode=1777",
                },
                shm_size=f"{shm_mb}m",
                mem_limit=f"{limits.memory_mb}m",
                memswap_limit=f"{limits.memory_mb}m",
                pids_limit=limits.pids,
                nano_cpus=int(limits.cpus * 1e9),
                cap_drop=["ALL"],
                cap_add=EXECUTOR_CAPABILITIES,
                security_opt=["no-new-privileges"],
                log_config=docker.types.LogConfig(type="none"),  # the request stream is not a log
            )
        except docker.errors.ImageNotFound as exc:
            raise errors.ImageNotFound(
                f"image {spec.image!r} is not in the Docker engine: build it with "
                f"`harness sandbox build-image --tag {spec.image}`, or pull it where a registry is reachable"
            ) from exc
        except docker.errors.APIError as exc:
            raise errors.SandboxStartError(
                f"sandbox {self.name}: the engine refused to create the container: {exc.explanation or exc}"
            ) from exc
        return container.id

    def _attach_and_start(self, client: Any) -> socket.socket:
        """Attach to stdin/stdout before starting, so no answer can be missed; return an owned socket."""
        import docker

        params = {"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
        try:
            attached = client.api.attach_socket(self.container_id, params=params)
            sdk_socket = getattr(attached, "_sock", attached)
            if not isinstance(sdk_socket, socket.socket):
                raise errors.SandboxStartError(
                    f"sandbox {self.name}: the Docker connection ({client.api.base_url}) is not a plain "
                    "socket; TLS and SSH engines are not supported by the sandbox backend yet"
                )
            # A socket of our own: the SDK's response object may close its copy whenever it is collected.
            owned = socket.socket(fileno=os.dup(sdk_socket.fileno()))
            attached.close()
            client.api.start(self.container_id)
        except docker.errors.APIError as exc:
            raise errors.SandboxStartError(
                f"sandbox {self.name}: the container did not start: {exc.explanation or exc}"
            ) from exc
        owned.setblocking(False)
        self._socket = owned
        return owned

    async def _why_dead(self) -> str:
        parts = []
        if self.container_id is not None:
            try:
                state = await engine_call(container_state, docker_client(), self.container_id)
            except Exception as exc:  # the engine itself may be what died
                state = f"its state is unknown ({type(exc).__name__}: {exc})"
            parts.append(state)
        if self._stderr_tail:
            parts.append("stderr: " + " | ".join(self._stderr_tail))
        return "; ".join(parts)

    async def _destroy(self) -> None:
        if self.container_id is not None:
            await engine_call(remove_container, docker_client(), self.container_id)

    def _destroy_now(self) -> None:
        if self.container_id is not None:
            remove_container(docker_client(), self.container_id)


def tmpfs_sizes_mb(memory_mb: int, disk_mb: int) -> tuple[int, int, int]:
    """Sizes of the working directory, /tmp and /dev/shm tmpfs mounts: their pages count in the container's
    memory, so together they stay a quarter of `memory_mb` (at least 64 MB) under it and filling them is
    "no space left on device", not an out-of-memory kill of the executor. The working directory gets up
    to `disk_mb` of that."""
    budget = max(memory_mb - max(64, memory_mb // 4), 48)
    shm = max(min(64, budget // 8), 4)
    workdir = max(min(disk_mb, (budget - shm) * 3 // 4), 16)
    tmp = max(budget - shm - workdir, 16)
    return workdir, tmp, shm


class _Demultiplexer:
    """The container's stdout out of Docker's attach stream, which frames stdout and stderr together.

    Each frame is an 8-byte header (stream: 1 stdout, 2 stderr; 3 padding bytes; a 4-byte big-endian
    length) and its payload. stdout carries the executor's answers; stderr lines are kept for diagnosis.
    """

    def __init__(self, reader: asyncio.StreamReader, stderr_tail: deque[str]):
        self._reader = reader
        self._buffer = bytearray()
        self._stderr_tail = stderr_tail

    async def readexactly(self, n: int) -> bytes:
        while len(self._buffer) < n:
            header = await self._reader.readexactly(8)
            payload = await self._reader.readexactly(int.from_bytes(header[4:8], "big"))
            if header[0] == 2:
                self._stderr_tail.extend(payload.decode("utf-8", errors="replace").splitlines())
            else:
                self._buffer += payload
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data


async def _reap_once(client: Any) -> None:
    """At start-up, remove containers that dead runs on this host left behind."""
    global _reaped_at_start
    if _reaped_at_start:
        return
    _reaped_at_start = True
    from sandboxes.reaper import reap_containers

    started = time.monotonic()
    removed = await engine_call(reap_containers, client)
    if removed:
        import logging

        logging.getLogger(__name__).warning(
            "removed %d sandbox containers left by dead runs (%.1f s)",
            len(removed),
            time.monotonic() - started,
        )
