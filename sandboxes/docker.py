"""The Docker sandbox backend: one container per sandbox, its main process the resident executor.

The container is created from the spec's image with the executor (`sandboxes/agent.py`) as its command,
the host attaches to its stdin and stdout once, and every request goes over that stream: no `docker exec`
per command (which costs tens of milliseconds of runc start-up each). The docker SDK is blocking, so its
calls run on worker threads (at most `MAX_ENGINE_CALLS` at once); the request stream itself is read and
written on the event loop. One slow daemon call never freezes the other rollouts.

Engines: a spec may name several (`docker_engines`, any URL the SDK takes; none means DOCKER_HOST's);
`sandboxes/placement.py` picks one per sandbox by free capacity under per-engine caps. An engine that stops
answering is marked lost there: the sandboxes on it die (their rollouts fail as SandboxDied), new ones go to
the other engines, and its containers are removed once it answers again.

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
  containers whose owner process is gone, never one without our labels, on every engine used.

What it does not protect against:
- kernel exploits: containers share the host kernel (use a VM-based runtime such as gVisor or Kata
  through the engine for that).
- disk: the image's layers are read-only, and writes go to tmpfs, which counts toward memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from datetime import UTC, datetime
from typing import Any

from sandboxes import errors, placement
from sandboxes.base import RUN_ID, Sandbox, SandboxSpec
from sandboxes.channel import AgentChannel
from sandboxes.engine import (
    LABEL_PREFIX,
    LABELS,
    container_state,
    docker_client,
    engine_address,
    engine_call,
    engine_name,
    remove_on,
    unreachable,
)
from sandboxes.owner import this_owner

SANDBOX_UID = SANDBOX_GID = 1000  # the image's `sandbox` user, whom commands run as
EXECUTOR_CAPABILITIES = ["SETUID", "SETGID", "KILL"]
_reaped_engines: set[str] = set()


class DockerSandbox(Sandbox):
    """A container sandbox; see the module docstring for what it isolates."""

    def __init__(self, spec: SandboxSpec, *, name: str | None = None):
        super().__init__(spec, name=name)
        self.container_id: str | None = None
        self.engine_url: str | None = None  # the engine it was placed on ("" for DOCKER_HOST's)
        self._slot: placement.Slot | None = None
        self._stderr_tail: deque[str] = deque(maxlen=20)

    async def _launch(self) -> AgentChannel:
        """Place the sandbox on an engine and start it there; an engine that does not answer is marked lost
        and the next one is tried, so a lost engine costs a start its time, never the start itself."""
        num_engines = len(placement.urls_of(self.spec))
        for attempt in range(num_engines):
            self._slot = await placement.reserve(self.spec)
            url = self.engine_url = self._slot.engine.url
            try:
                client = await engine_call(docker_client, url, engine=url)
                await _reap_once(client, url)
                self.container_id = await engine_call(self._create, client, engine=url)
                reader, writer = await self._attach(client, url)
                try:
                    await engine_call(self._start, client, engine=url)
                except BaseException:
                    writer.close()
                    raise
            except Exception as exc:
                if not unreachable(exc):
                    raise
                placement.mark_lost(url, f"{type(exc).__name__}: {exc}")
                self._forget_placement()
                if attempt == num_engines - 1:
                    raise errors.EngineUnavailable(
                        f"sandbox {self.name}: Docker engine {engine_name(url)} does not answer ({exc}), "
                        "and no other engine of the spec took the sandbox"
                    ) from exc
                continue
            self._slot.started()
            return AgentChannel(
                _Demultiplexer(reader, self._stderr_tail), writer, name=self.name, why_dead=self._why_dead
            )
        raise AssertionError("unreachable: the loop returns or raises")

    def _forget_placement(self) -> None:
        """Give the slot back; a container made on an engine now lost is left for when it answers again."""
        if self.container_id is not None and self.engine_url is not None:
            placement.add_orphan(self.engine_url, self.container_id)
        self.container_id = None
        if self._slot is not None:
            self._slot.release()
            self._slot = None

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

    async def _attach(self, client: Any, url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Attach to the container's stdin, stdout and stderr before it starts, so no answer can be missed.

        The attach is the engine's HTTP upgrade, made here on the event loop over a connection of our own
        (a unix socket, or tcp with the engine's TLS settings), so the stream is asyncio's from the start."""
        address = engine_address(url)
        try:
            if address.unix_path is not None:
                reader, writer = await asyncio.open_unix_connection(address.unix_path)
            else:
                reader, writer = await asyncio.open_connection(address.host, address.port, ssl=address.ssl)
            path = f"/v{client.api.api_version}/containers/{self.container_id}/attach"
            writer.write(
                f"POST {path}?stdin=1&stdout=1&stderr=1&stream=1 HTTP/1.1\r\nHost: docker\r\n"
                "Connection: Upgrade\r\nUpgrade: tcp\r\nContent-Length: 0\r\n\r\n".encode()
            )
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=self.spec.start_timeout_s)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError) as exc:
            raise errors.EngineUnavailable(
                f"sandbox {self.name}: could not attach to its container on {engine_name(url)}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        status = head.split(b"\r\n", 1)[0].split(b" ", 2)
        if len(status) < 2 or status[1] not in (b"101", b"200"):
            writer.close()
            raise errors.SandboxStartError(
                f"sandbox {self.name}: the engine refused to attach to the container: "
                f"{head.decode(errors='replace').strip()[:300]}"
            )
        return reader, writer

    def _start(self, client: Any) -> None:
        import docker

        try:
            client.api.start(self.container_id)
        except docker.errors.APIError as exc:
            raise errors.SandboxStartError(
                f"sandbox {self.name}: the container did not start: {exc.explanation or exc}"
            ) from exc

    async def _why_dead(self) -> str:
        parts = []
        if self.container_id is not None and self.engine_url is not None:
            url = self.engine_url
            try:
                state = await engine_call(_state_on, url, self.container_id, engine=url)
            except Exception as exc:  # the engine itself may be what died
                if unreachable(exc):
                    placement.mark_lost(url, f"{type(exc).__name__}: {exc}")
                    state = (
                        f"its Docker engine {engine_name(url)} does not answer ({type(exc).__name__}: {exc})"
                    )
                else:
                    state = f"its state is unknown ({type(exc).__name__}: {exc})"
            parts.append(state)
        if self._stderr_tail:
            parts.append("stderr: " + " | ".join(self._stderr_tail))
        return "; ".join(parts)

    async def _destroy(self) -> None:
        url, container_id = self.engine_url, self.container_id
        if container_id is not None and url is not None:
            if placement.engine(url).lost:  # no call to an engine known to be away: bounded close
                self._forget_placement()
                return
            try:
                await engine_call(remove_on, url, container_id, engine=url)
            except Exception as exc:
                if not unreachable(exc):
                    raise
                placement.mark_lost(url, f"{type(exc).__name__}: {exc}")
                self._forget_placement()
                return
            self.container_id = None
        self._forget_placement()

    def _destroy_now(self) -> None:
        url, container_id = self.engine_url, self.container_id
        if container_id is not None and url is not None and not placement.engine(url).lost:
            with contextlib.suppress(Exception):
                remove_on(url, container_id)
                self.container_id = None
        self._forget_placement()


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


def _state_on(url: str, container_id: str) -> str:
    return container_state(docker_client(url), container_id)


async def _reap_once(client: Any, url: str) -> None:
    """At start-up, remove containers that dead runs on this host left behind on each engine used."""
    if url in _reaped_engines:
        return
    _reaped_engines.add(url)
    from sandboxes.reaper import reap_containers

    started = time.monotonic()
    removed = await engine_call(reap_containers, client, engine=url)
    if removed:
        logging.getLogger(__name__).warning(
            "removed %d sandbox containers left by dead runs on %s (%.1f s)",
            len(removed),
            engine_name(url),
            time.monotonic() - started,
        )
