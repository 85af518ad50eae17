"""The local sandbox backend: bubblewrap namespaces on this machine, no container engine needed.

Each sandbox is one `bwrap` process tree running the resident executor in new user, pid, network, ipc
and uts namespaces, with a private working directory under `$TMPDIR/agent-harness-sandboxes/`.

What it protects against:
- reading or writing host files: only the system directories needed to run programs (/usr and its
  links, a few files of /etc) are visible, read-only; the host's /home, /root, /tmp, /work and the
  project are not there at all. The working directory is the only writable place besides a private /tmp.
- the network: a new network namespace has only a loopback interface; no DNS, nothing outside.
- the host's processes: a new pid namespace shows only the sandbox's own; they run as uid 1000 of a new
  user namespace, with no capabilities. When this process runs as root, bwrap itself is started as the
  unprivileged `nobody` user, so nothing in the sandbox maps to root on the host.
- secrets: the host environment is cleared; commands see only PATH, HOME, LANG and what the spec sets.
- runaway commands: a timeout kills the command's whole process tree; RLIMIT_NPROC caps processes
  (a fork bomb), RLIMIT_FSIZE caps file size, RLIMIT_CPU (cpu_time_s) caps CPU seconds per command.
- leaks: closing kills every process in the namespace and deletes the directory; if this process dies
  (even by SIGKILL) the kernel kills the sandbox (--die-with-parent), and the reaper deletes directories
  whose owner is gone.

What it does not protect against:
- memory: without cgroups, `memory_mb` is RLIMIT_AS, an address-space limit per process, so a sandbox
  of many processes can use several times it; CPU share (`cpus`) and disk use (`disk_mb`) are not limited.
- kernel exploits: namespaces share the host kernel (Docker does too; use a VM-based runtime for that).
- a command killing the sandbox's own executor (same user): the host then sees SandboxDied.
Use the Docker backend where those matter.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
from collections import deque
from pathlib import Path
from typing import Any

from sandboxes import errors
from sandboxes.base import Sandbox, SandboxSpec
from sandboxes.channel import AgentChannel
from sandboxes.owner import owner_tag

SANDBOX_UID = 1000
NOBODY = 65534
# System paths the sandbox needs to run programs, bound read-only when present (as links where they are).
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_PATHS = ("/etc/alternatives", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d")


def sandbox_root() -> Path:
    """Where local sandboxes keep their directories (one per sandbox, named after its owner)."""
    return Path(tempfile.gettempdir()) / "agent-harness-sandboxes"


class ProcessSandbox(Sandbox):
    """A sandbox that is one local process tree (bubblewrap, or a plain subprocess) and a directory.

    Subclasses launch their process with `_spawn` from `_launch`; teardown is shared.
    """

    def __init__(self, spec: SandboxSpec, *, name: str | None = None):
        super().__init__(spec, name=name)
        self._process: asyncio.subprocess.Process | None = None
        self._dir: Path | None = None
        self._stderr_tail: deque[str] = deque(maxlen=20)
        self._stderr_task: asyncio.Task[None] | None = None

    def _make_dir(self) -> Path:
        """A fresh directory under the sandbox root, named after the owner so the reaper can find it."""
        root = sandbox_root()
        root.mkdir(mode=0o711, exist_ok=True)
        self._dir = Path(tempfile.mkdtemp(prefix=f"{owner_tag()}-", dir=root))
        return self._dir

    async def _spawn(self, argv: list[str], **kwargs: Any) -> AgentChannel:
        """Start the process running the executor; return the channel to it."""
        try:
            self._process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                **kwargs,
            )
        except OSError as exc:
            raise errors.SandboxStartError(f"sandbox {self.name}: could not start {argv[0]}: {exc}") from exc
        self._stderr_task = asyncio.get_running_loop().create_task(self._keep_stderr_tail())
        assert self._process.stdout is not None and self._process.stdin is not None
        return AgentChannel(
            self._process.stdout, self._process.stdin, name=self.name, why_dead=self._why_dead
        )

    async def _keep_stderr_tail(self) -> None:
        assert self._process is not None and self._process.stderr is not None
        async for line in self._process.stderr:
            self._stderr_tail.append(line.decode("utf-8", errors="replace").rstrip())

    async def _why_dead(self) -> str:
        parts = []
        if self._process is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._process.wait(), timeout=1.0)
        if self._process is not None and self._process.returncode is not None:
            parts.append(f"its process exited with code {self._process.returncode}")
        if self._stderr_tail:
            parts.append("stderr: " + " | ".join(self._stderr_tail))
        return "; ".join(parts)

    async def _destroy(self) -> None:
        process = self._process
        if process is not None:
            if process.stdin is not None:
                process.stdin.close()  # end of input: the executor kills its commands and exits
            try:
                await asyncio.wait_for(process.wait(), timeout=2.0)
            except TimeoutError:
                _kill_group(process.pid)
                await process.wait()
        if self._stderr_task is not None:
            self._stderr_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stderr_task
        if self._dir is not None:
            await asyncio.to_thread(remove_tree, self._dir)

    def _destroy_now(self) -> None:
        if self._process is not None and self._process.returncode is None:
            _kill_group(self._process.pid)
        if self._dir is not None:
            remove_tree(self._dir)


class LocalSandbox(ProcessSandbox):
    """A bubblewrap sandbox; see the module docstring for what it isolates."""

    async def _launch(self) -> AgentChannel:
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise errors.EngineUnavailable(
                "the local sandbox backend needs bubblewrap: apt-get install bubblewrap "
                "(or use backend='docker')"
            )
        directory = self._make_dir()
        workspace = directory / "workspace"
        workspace.mkdir()
        etc = self._write_identity_files(directory)
        run_as_nobody = os.geteuid() == 0
        if run_as_nobody:
            for path in (directory, workspace):
                os.chown(path, NOBODY, NOBODY)
        argv = [bwrap, *self._bwrap_arguments(workspace, etc)]
        argv += self.agent_command(_sandbox_python(), self.spec.workdir, _rlimits(self.spec))
        return await self._spawn(
            argv,
            # bwrap's own processes (pid 1 of the namespace among them) are readable from inside:
            # they must not carry the host's environment either.
            env={"PATH": "/usr/bin:/bin"},
            user=NOBODY if run_as_nobody else None,
            group=NOBODY if run_as_nobody else None,
            extra_groups=[] if run_as_nobody else None,
        )

    def _bwrap_arguments(self, workspace: Path, etc: Path) -> list[str]:
        spec = self.spec
        args = ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
        args += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        if not spec.limits.network:
            args.append("--unshare-net")
        args += ["--hostname", "sandbox", "--die-with-parent", "--new-session", "--clearenv"]
        for path in _SYSTEM_PATHS:
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                args += ["--ro-bind", path, path]
        for path in _ETC_PATHS:
            if os.path.exists(path):
                args += ["--ro-bind", path, path]
        args += [
            "--ro-bind",
            str(etc / "passwd"),
            "/etc/passwd",
            "--ro-bind",
            str(etc / "group"),
            "/etc/group",
        ]
        python_home = _python_home()
        if python_home is not None:
            args += ["--ro-bind", python_home, python_home]
        args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
        args += ["--bind", str(workspace), spec.workdir, "--chdir", spec.workdir]
        args += ["--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "MALLOC_ARENA_MAX", "2"]
        return args

    def _write_identity_files(self, directory: Path) -> Path:
        """passwd and group files naming the sandbox user, instead of exposing the host's."""
        etc = directory / "etc"
        etc.mkdir()
        home = self.spec.workdir
        (etc / "passwd").write_text(
            f"root:x:0:0:root:/root:/bin/sh\nsandbox:x:{SANDBOX_UID}:{SANDBOX_UID}::{home}:/bin/sh\n"
            f"nobody:x:{NOBODY}:{NOBODY}:nobody:/nonexistent:/usr/sbin/nologin\n"
        )
        (etc / "group").write_text(f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\nnogroup:x:{NOBODY}:\n")
        for path in (etc, etc / "passwd", etc / "group"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        return etc


def remove_tree(path: Path) -> None:
    """Delete a sandbox directory, including what sandboxed code made unreadable (chmod 000 and the like)."""

    def make_writable_and_retry(function: Any, failed_path: str, _exc_info: Any) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(failed_path), 0o700)
            os.chmod(failed_path, 0o700)
            function(failed_path)

    shutil.rmtree(path, onerror=make_writable_and_retry)
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _rlimits(spec: SandboxSpec) -> dict[str, int]:
    limits = spec.limits
    return {
        "as": limits.memory_mb << 20,
        "nproc": limits.pids,
        "fsize": limits.file_size_mb << 20,
        "nofile": 1024,
    }


def _sandbox_python() -> str:
    """The interpreter that runs the executor: the system's python3, else this one (bound read-only)."""
    for candidate in ("/usr/bin/python3", "/bin/python3"):
        if os.path.exists(candidate):
            return candidate
    return os.path.realpath(sys.executable)


def _python_home() -> str | None:
    """The install prefix to bind when the executor runs on an interpreter outside the system paths."""
    python = _sandbox_python()
    if python.startswith(("/usr/", "/bin/")):
        return None
    return sys.base_prefix
