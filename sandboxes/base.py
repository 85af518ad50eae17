"""The sandbox interface every backend implements, its spec and limits, and the exec result.

    spec = SandboxSpec(backend="docker", image="agent-harness/python:bookworm", limits=Limits(memory_mb=512))
    async with create_sandbox(spec) as sandbox:           # started on entry, removed on exit
        result = await sandbox.exec("python3 -c 'print(6 * 7)'", timeout_s=10)
        result.stdout, result.exit_code, result.timed_out  # ("42\\n", 0, False)
        await sandbox.write_file("solution.py", "def f(): return 1\\n")
        data = await sandbox.read_file("solution.py")

Every backend runs the same resident executor (`sandboxes/agent.py`) inside the sandbox and talks to it
through an `AgentChannel`; a backend only says how to launch that executor in isolation and how to tear the
sandbox down (`_launch`, `_destroy`, `_destroy_now`). Everything else lives here, once.

Lifecycle: `start()` once, use, `close()`; close is idempotent, and `async with` does both. As a backstop,
sandboxes still open when the interpreter exits are torn down by an exit hook, and what a killed process
leaves behind is removed by the reaper (`harness sandbox reap`).
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import io
import json
import os
import tarfile
import time
import uuid
import weakref
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import anyio

from sandboxes import errors
from sandboxes.channel import AgentChannel
from sandboxes.image import DEFAULT_IMAGE
from sandboxes.owner import owner_tag

AGENT_SOURCE = (Path(__file__).parent / "agent.py").read_text(encoding="utf-8")
BackendName = Literal["auto", "docker", "local", "unsafe-subprocess"]
MAX_FILE_BYTES = 128 << 20  # the most one read_file or download moves (the executor's own cap)
# Slack on top of a command's own timeout before the host gives up on the executor's answer.
_ANSWER_SLACK_S = 15.0
# A process-wide id for this run: every sandbox it starts carries it (Docker labels, local directories).
RUN_ID = os.environ.get("HARNESS_RUN_ID") or uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandbox. How each backend enforces them is in its module docstring.

    Attributes:
        cpus: CPU cores the sandbox may use at once (Docker: a CFS quota; local: not enforced).
        memory_mb: Memory of the whole sandbox (Docker: cgroup, swap included; local: address space per
            process).
        pids: Processes and threads at once (Docker: pids cgroup; local: RLIMIT_NPROC).
        file_size_mb: Largest file a command may write (RLIMIT_FSIZE).
        disk_mb: Size of the writable working directory (Docker: tmpfs size; local: not enforced).
        cpu_time_s: CPU seconds per command (RLIMIT_CPU), None for no limit beyond the command's timeout.
        network: Whether the sandbox has a network. False: no interface but loopback, no DNS.
        output_bytes: Output kept per stream per command; the rest is discarded and flagged.
    """

    cpus: float = 1.0
    memory_mb: int = 1024
    pids: int = 256
    file_size_mb: int = 1024
    disk_mb: int = 1024
    cpu_time_s: int | None = None
    network: bool = False
    output_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        problems = []
        if not self.cpus > 0:
            problems.append(f"cpus must be positive, got {self.cpus}")
        if self.memory_mb < 32:
            problems.append(
                f"memory_mb must be at least 32 (an interpreter needs that), got {self.memory_mb}"
            )
        if self.pids < 8:
            problems.append(f"pids must be at least 8 (the executor itself needs a few), got {self.pids}")
        if self.file_size_mb < 1 or self.disk_mb < 1:
            problems.append("file_size_mb and disk_mb must be at least 1")
        if self.cpu_time_s is not None and self.cpu_time_s < 1:
            problems.append(f"cpu_time_s must be at least 1 or None, got {self.cpu_time_s}")
        if not 1024 <= self.output_bytes <= 32 << 20:
            problems.append(f"output_bytes must be between 1024 and 32 MiB, got {self.output_bytes}")
        if problems:
            raise errors.InvalidSandboxConfig("impossible sandbox limits: " + "; ".join(problems))


@dataclass(frozen=True)
class SandboxSpec:
    """What sandbox to start: backend, image, limits. Hashable, so pools can key on it.

    Attributes:
        backend: "docker" (containers), "local" (bubblewrap namespaces), "auto" (Docker when an engine
            answers and has the image, else local), or "unsafe-subprocess" (NO isolation at all, for
            debugging a tool on a machine with neither).
        image: Container image (Docker only).
        limits: Resource limits.
        workdir: The writable working directory inside the sandbox; relative paths start there.
        env: Extra environment variables for every command (nothing of the host's environment is passed).
        exec_timeout_s: Timeout of a command that does not give its own.
        start_timeout_s: How long starting may take before it fails.
        docker_engines: Docker engines to spread sandboxes over, by the URLs the docker SDK takes
            (unix:///path, tcp://host:2376 with TLS from DOCKER_TLS_VERIFY and DOCKER_CERT_PATH, ssh://),
            "" for the engine of DOCKER_HOST; empty: that engine alone. `sandboxes/placement.py` places.
        engine_max_sandboxes: Most sandboxes this process keeps on one engine (None: no cap beyond the
            pool's); an engine at its cap gets no new sandbox until one of its own closes.
        engine_max_starting: Most sandboxes starting at once on one engine.
    """

    backend: BackendName = "local"
    image: str = DEFAULT_IMAGE
    limits: Limits = field(default_factory=Limits)
    workdir: str = "/workspace"
    env: tuple[tuple[str, str], ...] = ()
    exec_timeout_s: float = 120.0
    start_timeout_s: float = 60.0
    docker_engines: tuple[str, ...] = ()
    engine_max_sandboxes: int | None = None
    engine_max_starting: int = 16

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "docker", "local", "unsafe-subprocess"):
            raise errors.InvalidSandboxConfig(
                f"unknown sandbox backend {self.backend!r}; choose 'auto', 'docker', 'local' or "
                "'unsafe-subprocess'"
            )
        if not self.exec_timeout_s > 0 or not self.start_timeout_s > 0:
            raise errors.InvalidSandboxConfig(
                f"exec_timeout_s and start_timeout_s must be positive, got {self.exec_timeout_s} and "
                f"{self.start_timeout_s}"
            )
        if not self.workdir.startswith("/"):
            raise errors.InvalidSandboxConfig(f"workdir must be an absolute path, got {self.workdir!r}")
        if isinstance(self.env, Mapping):  # accept a dict, store it hashable
            object.__setattr__(self, "env", tuple(sorted(self.env.items())))
        if isinstance(self.docker_engines, str):  # "unix:///a.sock,tcp://b:2376" from a command line
            object.__setattr__(self, "docker_engines", tuple(filter(None, self.docker_engines.split(","))))
        object.__setattr__(self, "docker_engines", tuple(self.docker_engines))
        _check_engines(self.docker_engines, self.engine_max_sandboxes, self.engine_max_starting)


_ENGINE_SCHEMES = ("unix", "tcp", "ssh", "http", "https", "npipe", "fd")


def _check_engines(urls: tuple[str, ...], max_sandboxes: int | None, max_starting: int) -> None:
    problems = []
    for url in urls:
        if url == "":  # DOCKER_HOST's engine, beside others
            continue
        if not isinstance(url, str) or url.partition("://")[0] not in _ENGINE_SCHEMES or "://" not in url:
            problems.append(
                f"docker_engines entry {url!r} is not an engine URL (unix:///var/run/docker.sock, "
                "tcp://host:2376, ssh://user@host)"
            )
    if len(set(urls)) != len(urls):
        problems.append(f"docker_engines names an engine twice: {list(urls)}")
    if max_sandboxes is not None and max_sandboxes < 1:
        problems.append(f"engine_max_sandboxes must be at least 1 or None, got {max_sandboxes}")
    if max_starting < 1:
        problems.append(f"engine_max_starting must be at least 1, got {max_starting}")
    if problems:
        raise errors.InvalidSandboxConfig("; ".join(problems))


@dataclass(frozen=True)
class ExecResult:
    """What a command did.

    Attributes:
        exit_code: The command's exit status; negative when a signal ended it (-9 after a timeout kill);
            127 when the program does not exist.
        stdout: Its standard output (decoded as UTF-8, undecodable bytes replaced), cut to the output cap.
        stderr: Its standard error, likewise.
        timed_out: Whether it ran past its timeout and was killed with its whole process tree.
        stdout_truncated: Whether stdout went past the cap (the excess was read and discarded).
        stderr_truncated: Likewise for stderr.
        duration_s: Wall time inside the sandbox, from start to exit (or kill).
    """

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    stdout_truncated: bool
    stderr_truncated: bool
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class Sandbox(ABC):
    """An isolated place to run model-written commands. Use `create_sandbox(spec)` to get one."""

    def __init__(self, spec: SandboxSpec, *, name: str | None = None):
        self.spec = spec
        self.name = name or f"{RUN_ID}-{uuid.uuid4().hex[:8]}"
        self._channel: AgentChannel | None = None
        self._closed = False
        self._started_at: float | None = None

    # --- lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> Sandbox:
        """Launch the sandbox and wait until its executor answers. Idempotent."""
        if self._closed:
            raise errors.SandboxClosed(f"sandbox {self.name} was closed; create a new one")
        if self._channel is not None:
            return self
        _LIVE.add(self)
        try:
            self._channel = await self._launch()
            await self._channel.request("ping", wait_s=self.spec.start_timeout_s)
        except BaseException:
            await self.close()
            raise
        self._started_at = time.monotonic()
        return self

    async def close(self) -> None:
        """Tear the sandbox down: every process in it ends, its files are deleted. Idempotent.

        Shielded from cancellation (the teardown is bounded), so a rollout cancelled at shutdown still
        removes its sandbox; one interrupted otherwise (a signal's SystemExit) finishes synchronously."""
        if self._closed:
            return
        self._closed = True
        try:
            with anyio.CancelScope(shield=True):
                if self._channel is not None:
                    await self._channel.close()
                await self._destroy()
        except BaseException:
            with contextlib.suppress(Exception):
                self._destroy_now()
            raise
        finally:
            _LIVE.discard(self)

    @property
    def closed(self) -> bool:
        return self._closed

    async def __aenter__(self) -> Sandbox:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def alive(self, timeout_s: float = 5.0) -> bool:
        """Whether the executor answers a ping within `timeout_s`."""
        if self._closed or self._channel is None or not self._channel.alive:
            return False
        try:
            await self._channel.request("ping", wait_s=timeout_s)
        except errors.SandboxError:
            return False
        return True

    # --- commands and files --------------------------------------------------------------------------

    async def exec(
        self,
        command: str | Sequence[str],
        *,
        timeout_s: float | None = None,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        max_output_bytes: int | None = None,
    ) -> ExecResult:
        """Run a command: a shell string (run by /bin/sh -c) or an argv list.

        Returns its result even when it fails or times out; raises only when the sandbox itself fails
        (SandboxDied, SandboxTimeout, SandboxClosed).
        """
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else [str(arg) for arg in command]
        if not argv:
            raise ValueError("exec needs a command")
        timeout_s = self.spec.exec_timeout_s if timeout_s is None else timeout_s
        if not timeout_s > 0:  # 0 would mean no limit inside the sandbox but a 15 s wait out here
            raise ValueError(
                f"timeout_s must be a positive number of seconds, got {timeout_s!r}; leave it None for the "
                "spec's exec_timeout_s"
            )
        answer = await self._request(
            "exec",
            wait_s=timeout_s + _ANSWER_SLACK_S,
            argv=argv,
            stdin=_b64(stdin),
            env=dict(env or {}),
            cwd=cwd,
            timeout_s=timeout_s,
            max_output_bytes=max_output_bytes or self.spec.limits.output_bytes,
            cpu_s=self.spec.limits.cpu_time_s,
        )
        return ExecResult(
            exit_code=answer["exit_code"],
            stdout=base64.b64decode(answer["stdout"]).decode("utf-8", errors="replace"),
            stderr=base64.b64decode(answer["stderr"]).decode("utf-8", errors="replace"),
            timed_out=answer["timed_out"],
            stdout_truncated=answer["stdout_truncated"],
            stderr_truncated=answer["stderr_truncated"],
            duration_s=answer["duration_s"],
        )

    async def read_file(self, path: str, *, max_bytes: int = 64 << 20) -> bytes:
        """The bytes of a regular file (relative paths start at the working directory); a FIFO, device or
        socket is refused (SandboxFileError), as is a file over `max_bytes` (at most 128 MiB)."""
        _check_max_bytes(max_bytes)
        answer = await self._request("read_file", wait_s=60.0, path=path, max_bytes=max_bytes)
        return base64.b64decode(answer["data"])

    async def read_text(self, path: str, *, max_bytes: int = 64 << 20) -> str:
        return (await self.read_file(path, max_bytes=max_bytes)).decode("utf-8", errors="replace")

    async def write_file(self, path: str, data: bytes | str, *, mode: int | None = None) -> None:
        """Write a file, creating its parent directories."""
        await self._request("write_file", wait_s=60.0, path=path, data=_b64(data), mode=mode)

    async def upload(self, local_dir: str | os.PathLike[str], remote_dir: str = ".") -> None:
        """Copy a local directory's files into the sandbox (regular files and directories only)."""
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
            archive.add(os.fspath(local_dir), arcname=".")
        await self._request("put_archive", wait_s=300.0, path=remote_dir, data=_b64(buffer.getvalue()))

    async def download(
        self, remote_dir: str, local_dir: str | os.PathLike[str], *, max_bytes: int = 64 << 20
    ) -> None:
        """Copy a directory out of the sandbox (its archive at most `max_bytes`, 128 MiB at most). Its
        contents are untrusted: links, devices and paths that would land outside `local_dir` are skipped."""
        _check_max_bytes(max_bytes)
        answer = await self._request("get_archive", wait_s=300.0, path=remote_dir, max_bytes=max_bytes)
        target = Path(local_dir)
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(base64.b64decode(answer["data"])), mode="r:*") as archive:
            members = _safe_members(archive, target)
            if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4: also drops setuid bits and odd modes
                archive.extractall(target, members=members, filter="data")
            else:
                archive.extractall(target, members=members)

    async def kill_all(self) -> int:
        """Kill every process in the sandbox but its executor (to recycle it); returns how many."""
        return (await self._request("kill_all", wait_s=30.0))["killed"]

    # --- backends implement ---------------------------------------------------------------------------

    @abstractmethod
    async def _launch(self) -> AgentChannel:
        """Start the isolated environment with the executor running in it; return a channel to it."""

    @abstractmethod
    async def _destroy(self) -> None:
        """Remove everything the sandbox holds (processes, container, files). Must tolerate partial starts."""

    @abstractmethod
    def _destroy_now(self) -> None:
        """Like _destroy, synchronously and best effort: called from the exit hook, with no event loop."""

    # --- helpers for backends -------------------------------------------------------------------------

    def agent_command(
        self,
        python: str,
        workdir: str,
        rlimits: Mapping[str, int] | None = None,
        *,
        command_user: tuple[int, int] | None = None,
    ) -> list[str]:
        """The argv that starts the executor with this sandbox's settings. `command_user`: the (uid, gid)
        commands run as, when the executor may switch to it (it then runs as root with a few capabilities).
        The owner tag in the config is how the reaper recognises an executor whose owner died."""
        config = {
            "workdir": workdir,
            "env": dict(self.spec.env),
            "rlimits": dict(rlimits or {}),
            "command_user": list(command_user) if command_user else None,
            "owner": owner_tag(),
            "sandbox": self.name,
        }
        return [python, "-I", "-S", "-u", "-c", AGENT_SOURCE, _json(config)]

    async def _request(self, op: str, *, wait_s: float, **fields: Any) -> dict[str, Any]:
        if self._closed:
            raise errors.SandboxClosed(f"sandbox {self.name} was closed")
        if self._channel is None:
            raise errors.SandboxError(f"sandbox {self.name} is not started; call start() or use `async with`")
        return await self._channel.request(op, wait_s=wait_s, **fields)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self._channel else "new"
        return f"<{type(self).__name__} {self.name} {state}>"


# --- exit hook ----------------------------------------------------------------------------------------

_LIVE: weakref.WeakSet[Sandbox] = weakref.WeakSet()


def _close_all_now() -> None:
    """Exit hook: tear down every sandbox still open in this process, without an event loop."""
    for sandbox in list(_LIVE):
        with contextlib.suppress(Exception):
            sandbox._closed = True
            sandbox._destroy_now()
    _LIVE.clear()


atexit.register(_close_all_now)


def _check_max_bytes(max_bytes: int) -> None:
    if not 0 < max_bytes <= MAX_FILE_BYTES:
        raise ValueError(f"max_bytes must be between 1 and {MAX_FILE_BYTES} (128 MiB), got {max_bytes}")


def _b64(data: bytes | str | None) -> str | None:
    if data is None:
        return None
    if isinstance(data, str):
        data = data.encode("utf-8")
    return base64.b64encode(data).decode()


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _safe_members(archive: tarfile.TarFile, target: Path) -> list[tarfile.TarInfo]:
    """Regular files and directories whose paths stay inside `target`: the archive came from a sandbox."""
    root = target.resolve()
    return [
        member
        for member in archive.getmembers()
        if (member.isfile() or member.isdir()) and (root / member.name).resolve().is_relative_to(root)
    ]
