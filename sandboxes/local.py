"""The local sandbox backend: bubblewrap namespaces on this machine, no container engine needed.

Each sandbox is one `bwrap` process tree running the resident executor as pid 1 of new user, pid,
network, ipc and uts namespaces, with a directory of its own under `$TMPDIR/agent-harness-sandboxes/`.

What it protects against:
- reading or writing host files: only the system directories needed to run programs (/usr and its
  links, a few files of /etc) are visible, read-only; the host's /home, /root, /tmp, /work and the
  project are not there at all. The working directory and /tmp are private tmpfs mounts of `disk_mb`
  and a quarter of it, so a full disk is "no space left on device" inside, never the host's disk.
- the request stream (forged answers): the executor is the namespace's init, which commands cannot
  signal; it is non-dumpable, so /proc/1/fd, /proc/1/mem and ptrace are refused; no other process in
  the sandbox holds the stream. Debuggers and tracers of the host (gdb, strace, ...) are masked.
- the network: a new network namespace has only a loopback interface; no DNS, nothing outside.
- the host's processes: a new pid namespace shows only the sandbox's own; they run as uid 1000 of a new
  user namespace, with no capabilities. When this process runs as root, bwrap itself is started as the
  unprivileged `nobody` user, so nothing in the sandbox maps to root on the host.
- resources: where the harness runs as root with cgroups (v2, or v1's memory/pids/cpu hierarchies), each
  sandbox gets its own control group (sandboxes/cgroups.py): memory (tmpfs pages included), pids and CPU
  for the whole sandbox. Always: RLIMIT_AS per process (memory_mb), RLIMIT_NPROC (pids, per user),
  RLIMIT_FSIZE, RLIMIT_CPU (cpu_time_s) per command; a timeout kills a command's whole process tree.
- secrets: the host environment is cleared; commands see only PATH, HOME, LANG and what the spec sets.
- leaks: closing kills every process in the namespace and deletes the directory; if this process dies
  (even by SIGKILL) the executor reads end of input and exits, which ends the namespace, the kernel kills
  the sandbox too (--die-with-parent), and the reaper kills executors and deletes directories and
  groups whose owner is gone.

What it does not protect against:
- without root or cgroups, memory, CPU share and process count are per-process limits only (a sandbox of
  many processes can use several times `memory_mb`; `cpus` is not enforced); the first sandbox of a
  process logs which limits it cannot enforce.
- kernel exploits: namespaces share the host kernel (Docker does too; use a VM-based runtime for that).
- commands share the executor's uid (an unprivileged user namespace maps one uid); the init and
  non-dumpable protections above are what keeps them off its stream (Docker adds a separate uid).
Use the Docker backend where those matter.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections import deque
from pathlib import Path
from typing import Any

from sandboxes import errors, processes
from sandboxes.base import Sandbox, SandboxSpec
from sandboxes.cgroups import SandboxCgroup, cgroup_problem
from sandboxes.channel import AgentChannel
from sandboxes.owner import owner_tag, this_owner

log = logging.getLogger(__name__)

SANDBOX_UID = 1000
NOBODY = 65534
# System paths the sandbox needs to run programs, bound read-only when present (as links where they are).
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_PATHS = ("/etc/alternatives", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d")
# Host tools a sandbox has no use for that would help it attack its own executor; masked by /dev/null.
_MASKED_TOOLS = ("gdb", "gdbserver", "gdb-multiarch", "strace", "ltrace", "perf", "valgrind", "cuda-gdb")


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
        self._cgroup: SandboxCgroup | None = None
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
                _kill_tree(process.pid, self.name)
                await process.wait()
        # What outlived the launcher, or a launcher we never got a handle on: asyncio kills the process it
        # was creating when the start is cancelled then, and --die-with-parent kills it if its thread ends.
        await asyncio.to_thread(_kill_tree, None, self.name)
        if self._stderr_task is not None:
            self._stderr_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stderr_task
        if self._dir is not None:
            await asyncio.to_thread(remove_tree, self._dir)
        if self._cgroup is not None:
            self._cgroup.remove()

    def _destroy_now(self) -> None:
        process = self._process
        _kill_tree(process.pid if process is not None and process.returncode is None else None, self.name)
        if self._dir is not None:
            remove_tree(self._dir)
        if self._cgroup is not None:
            self._cgroup.remove()


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
        etc = self._write_identity_files(directory)
        run_as_nobody = os.geteuid() == 0
        if run_as_nobody:
            os.chown(directory, NOBODY, NOBODY)
        argv = [bwrap, *self._bwrap_arguments(etc)]
        argv += self.agent_command(_sandbox_python(), self.spec.workdir, _rlimits(self.spec))
        _say_what_is_not_enforced()
        _reap_once()
        return await self._spawn(
            argv,
            # bwrap's own processes (pid 1 of the namespace among them) are readable from inside:
            # they must not carry the host's environment either.
            env={"PATH": "/usr/bin:/bin"},
            user=NOBODY if run_as_nobody else None,
            group=NOBODY if run_as_nobody else None,
            extra_groups=[] if run_as_nobody else None,
        )

    async def start(self) -> LocalSandbox:
        await super().start()
        if self._process is not None and self._cgroup is None:
            # once the executor answers: it and bwrap exist, and no command has started yet
            assert self._dir is not None
            self._cgroup = await asyncio.to_thread(SandboxCgroup.create, self._dir.name, self.spec.limits)
            if self._cgroup is not None:
                for pid in [self._process.pid, *processes.descendants(self._process.pid)]:
                    with contextlib.suppress(OSError):
                        self._cgroup.add(pid)
        return self

    def _bwrap_arguments(self, etc: Path) -> list[str]:
        spec = self.spec
        args = ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
        args += ["--unshare-pid", "--as-pid-1", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
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
        for tool in _MASKED_TOOLS:
            for directory in ("/usr/bin", "/usr/local/bin", "/usr/sbin"):
                if os.path.exists(f"{directory}/{tool}"):
                    args += ["--ro-bind", "/dev/null", f"{directory}/{tool}"]
        disk = spec.limits.disk_mb << 20
        args += [
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--size",
            str(max(disk // 4, 16 << 20)),
            "--tmpfs",
            "/tmp",
        ]
        args += ["--size", str(disk), "--tmpfs", spec.workdir, "--chdir", spec.workdir]
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
    """Delete a sandbox directory, including what sandboxed code made unreadable (chmod 000 and the like).

    Never follows a link: only real directories inside the tree are made accessible (opened with
    O_NOFOLLOW), so a symlink the sandbox left cannot point the cleanup at a host file. A pass that meets
    an unreadable directory makes it accessible and the next pass goes into it; nesting deeper than
    _REMOVE_PASSES such directories is left to the reaper.
    """

    def make_accessible(function: Any, failed_path: str, _exc_info: Any) -> None:
        with contextlib.suppress(OSError):
            _chmod_directory(os.path.dirname(failed_path))
            if not os.path.islink(failed_path) and os.path.isdir(failed_path):
                _chmod_directory(failed_path)

    for _ in range(_REMOVE_PASSES):
        shutil.rmtree(path, onerror=make_accessible)
        if not os.path.lexists(path):
            return


_REMOVE_PASSES = 32


def _chmod_directory(path: str) -> None:
    """chmod 0700 on a directory, refusing a symlink (O_NOFOLLOW) and anything that is not a directory.

    The directory is opened as a path only (O_PATH: it may be mode 000, unreadable to its own owner) and
    changed through its /proc/self/fd entry, which names the opened directory itself, never a link."""
    fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.chmod(f"/proc/self/fd/{fd}", 0o700)
    finally:
        os.close(fd)


def _kill_tree(pid: int | None, sandbox: str) -> None:
    """SIGKILL a sandbox's bwrap (`pid`, if any), every descendant (bwrap's namespace init is in a session of
    its own, so its group alone would leave the sandbox running) and any process that runs this sandbox's
    executor. With nothing to kill it costs one look at /proc.

    Each is stopped, and seen stopped, before the next look at /proc, so that none can start a child
    unseen: a bwrap killed after it cloned its namespace child but before it let that child go on leaves
    the child waiting forever on bwrap's setup eventfd, out of the tree (its parent is gone). Its command
    line is bwrap's, so the last look, by this sandbox's name and owner, finds it all the same."""
    owner = this_owner()

    def find() -> set[int]:
        table = processes.parents()
        mine = {
            process.pid
            for process in processes.executor_processes()
            if process.owner == owner and process.sandbox == sandbox
        }
        tree = {pid, *processes.descendants(pid, table)} if pid is not None else set()
        return (tree | mine) & table.keys()

    if pid is None and not find():
        return
    processes.stop_then_kill(find)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


@functools.cache
def _reap_once() -> None:
    """Once per process, before its first local sandbox: what dead owners on this host left behind."""
    from sandboxes.reaper import reap_local_cgroups, reap_local_dirs, reap_local_executors

    killed, dirs, groups = reap_local_executors(), reap_local_dirs(), reap_local_cgroups()
    if killed or dirs or groups:
        log.warning(
            "removed what dead runs left of local sandboxes: %d executors, %d directories, %d control groups",
            len(killed),
            len(dirs),
            len(groups),
        )


@functools.cache
def _say_what_is_not_enforced() -> None:
    """Once per process: which limits the local backend cannot enforce here, and why."""
    problem = cgroup_problem()
    if problem is not None:
        log.warning(
            "local sandboxes get no cgroup here (%s): memory_mb is an address-space limit per process, pids "
            "a per-user process limit, cpus is not enforced; the working directory and /tmp are size-capped "
            "tmpfs mounts. Run as root on a machine with cgroups, or use the Docker backend, for "
            "whole-sandbox limits",
            problem,
        )


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
