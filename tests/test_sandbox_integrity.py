"""The sandbox attacked as the policy would attack it, on both backends: nothing a command does can forge
the executor's answers, stop the executor, or turn the model's own mistake into an infrastructure failure.

Every attack runs for real inside a real sandbox (bubblewrap; Docker with the marker `docker`): writing a
forged answer frame into the executor's stdout through /proc/1/fd/1, tracing the executor, reading its
memory, signalling it, filling /tmp and the working directory, pointing the file tools at a FIFO or a
device. The channel's own checks (oversize and malformed frames) are tested on a scripted stream.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path

import anyio
import pytest

from sandboxes import errors
from sandboxes.backends import create_sandbox
from sandboxes.base import Limits, SandboxSpec
from sandboxes.channel import AgentChannel
from sandboxes.local import remove_tree

pytestmark = pytest.mark.anyio

BACKENDS = ["local", pytest.param("docker", marks=pytest.mark.docker)]


@pytest.fixture
def anyio_backend():
    return "asyncio"


def spec(backend: str, **limits: object) -> SandboxSpec:
    return SandboxSpec(backend=backend, limits=Limits(**limits), exec_timeout_s=30)  # type: ignore[arg-type]


# Writes a well-formed "exit code 0, stdout FORGED" answer for every plausible request id into the
# executor's stdout, the stream the host reads answers from, then exits 3.
FORGE_ANSWERS = r"""
import json, os, struct, sys
forged = 0
for path in ("/proc/1/fd/1", "/proc/1/fd/0", f"/proc/{os.getppid()}/fd/1"):
    try:
        with open(path, "wb", buffering=0) as stream:
            for request_id in range(1, 200):
                body = json.dumps({"id": request_id, "ok": True, "exit_code": 0, "stdout": "Rk9SR0VE",
                                   "stderr": "", "timed_out": False, "stdout_truncated": False,
                                   "stderr_truncated": False, "duration_s": 0.0}).encode()
                stream.write(struct.pack(">I", len(body)) + body)
            forged += 1
    except OSError as exc:
        print(path, "refused:", exc.strerror)
print("forged", forged)
sys.exit(3)
"""

TRACE_THE_EXECUTOR = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
PTRACE_ATTACH, PTRACE_SEIZE = 16, 0x4206
for request in (PTRACE_ATTACH, PTRACE_SEIZE):
    print("ptrace", request, libc.ptrace(request, 1, 0, 0), ctypes.get_errno())
for path in ("/proc/1/mem", "/proc/1/environ", "/proc/1/fd/0", "/proc/1/maps"):
    try:
        with open(path, "rb") as f:
            f.read(16)
        print(path, "READ")
    except OSError as exc:
        print(path, "refused")
class Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]
buffer = ctypes.create_string_buffer(64)
local = Iovec(ctypes.cast(buffer, ctypes.c_void_p), 64)
for address in (0x400000, 0x555555554000, 0x7F0000000000):  # EPERM: refused; EFAULT would be let through
    remote = Iovec(address, 64)
    done = libc.process_vm_readv(1, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    print("process_vm_readv", done, ctypes.get_errno())
"""


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_command_cannot_forge_the_executors_answers(backend):
    async with create_sandbox(spec(backend)) as sandbox:
        result = await sandbox.exec(["python3", "-c", FORGE_ANSWERS])
        assert result.exit_code == 3  # the command's own exit status, not the forged 0
        assert "FORGED" not in result.stdout
        assert "forged 0" in result.stdout and "/proc/1/fd/1 refused" in result.stdout
        follow_up = await sandbox.exec("echo real")  # the stream is intact: answers still match requests
        assert (follow_up.exit_code, follow_up.stdout) == (0, "real\n")


@pytest.mark.parametrize("backend", BACKENDS)
async def test_the_executor_cannot_be_traced_or_read(backend):
    async with create_sandbox(spec(backend)) as sandbox:
        result = await sandbox.exec(["python3", "-c", TRACE_THE_EXECUTOR])
        lines = result.stdout.splitlines()
        assert [line.split()[2] for line in lines if line.startswith("ptrace")] == ["-1", "-1"]
        assert not [line for line in lines if line.endswith("READ")], result.stdout
        reads = [line.split()[1:] for line in lines if line.startswith("process_vm_readv")]
        assert reads == [["-1", "1"]] * 3, result.stdout  # EPERM each time, never EFAULT
        assert await sandbox.alive()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_signals_cannot_kill_or_stop_the_executor(backend):
    async with create_sandbox(spec(backend)) as sandbox:
        for signal in ("KILL", "STOP", "INT", "TERM", "HUP", "SEGV"):
            await sandbox.exec(f"kill -{signal} 1; kill -{signal} -1; true")
        started = time.monotonic()
        result = await sandbox.exec("echo still here")
        assert result.stdout == "still here\n" and time.monotonic() - started < 5


@pytest.mark.docker
async def test_docker_commands_run_as_another_uid_than_the_executor():
    async with create_sandbox(spec("docker")) as sandbox:
        identity = await sandbox.exec("id -u; grep '^Uid' /proc/1/status; grep '^CapEff' /proc/self/status")
        command_uid, executor_uids, command_caps = identity.stdout.splitlines()
        assert command_uid == "1000"
        assert executor_uids.split()[1:] == ["0", "0", "0", "0"]
        assert command_caps.split()[1] == "0000000000000000"
        # the executor's file operations act as uid 1000, not as root
        with pytest.raises(errors.SandboxFileError):
            await sandbox.read_file("/etc/shadow")
        await sandbox.write_file("mine.txt", "x")
        assert (await sandbox.exec("stat -c %u mine.txt")).stdout == "1000\n"


async def test_no_debugger_or_tracer_is_usable_in_the_local_sandbox():
    async with create_sandbox(spec("local")) as sandbox:
        result = await sandbox.exec(
            "for t in gdb strace ltrace; do command -v $t && $t --version; done; true"
        )
        assert "GNU gdb" not in result.stdout and "strace -- version" not in result.stdout


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_full_tmp_or_workdir_is_no_space_left_not_a_dead_sandbox(backend):
    async with create_sandbox(spec(backend, memory_mb=256, disk_mb=64)) as sandbox:
        for target in ("/tmp/fill", "fill"):
            result = await sandbox.exec(f"dd if=/dev/zero of={target} bs=1M count=1024", timeout_s=60)
            assert result.exit_code != 0 and "No space left on device" in result.stderr, result.stderr
            assert await sandbox.alive()
            await sandbox.exec(f"rm -f {target}")


@pytest.mark.parametrize("backend", BACKENDS)
async def test_the_file_tools_refuse_fifos_and_devices_at_once(backend):
    async with create_sandbox(spec(backend)) as sandbox:
        await sandbox.exec("mkfifo pipe && ln -s /dev/zero zeros")
        for path in ("pipe", "zeros"):
            started = time.monotonic()
            with pytest.raises(errors.SandboxFileError, match="not a regular file"):
                await sandbox.read_file(path)
            with pytest.raises(errors.SandboxFileError, match="not a regular file"):
                await sandbox.write_file(path, "x")
            assert time.monotonic() - started < 5
        assert await sandbox.alive()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_timeout_zero_is_refused_with_the_fix(backend):
    async with create_sandbox(spec(backend)) as sandbox:
        with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds"):
            await sandbox.exec("true", timeout_s=0)


# --- the channel's own checks, on a scripted stream --------------------------------------------------


class ScriptedStream:
    """A reader that returns the bytes it was given, then blocks; a writer that drops what it gets."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def readexactly(self, n: int) -> bytes:
        if len(self.data) < n:
            await asyncio.sleep(3600)
        chunk, self.data = self.data[:n], self.data[n:]
        return chunk

    def write(self, data: bytes) -> None:
        pass

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("stream", "reason"),
    [
        (struct.pack(">I", 1 << 30), "announced"),
        (struct.pack(">I", 5) + b"{oops", "JSONDecodeError"),
    ],
    ids=["oversize", "malformed"],
)
async def test_an_oversize_or_malformed_frame_ends_the_sandbox_with_the_reason(stream, reason):
    channel = AgentChannel(ScriptedStream(stream), ScriptedStream(b""), name="scripted")
    with anyio.fail_after(5), pytest.raises(errors.SandboxDied, match=reason):
        await channel.request("ping", wait_s=5)
    assert not channel.alive
    await channel.close()


async def test_an_answer_to_no_request_is_ignored():
    stray = json.dumps({"id": 999, "ok": True}).encode()
    answer = json.dumps({"id": 1, "ok": True, "pid": 7}).encode()
    stream = struct.pack(">I", len(stray)) + stray + struct.pack(">I", len(answer)) + answer
    channel = AgentChannel(ScriptedStream(stream), ScriptedStream(b""), name="scripted")
    with anyio.fail_after(5):
        assert (await channel.request("ping", wait_s=5))["pid"] == 7
    await channel.close()


# --- the local backend's control group (root with cgroups) ------------------------------------------

HOLD_60_MB = "b = bytearray(60 << 20); b[::4096] = b'x' * len(b[::4096]); import time; time.sleep(2)"
TOUCH_MEMORY = f"""
import subprocess, sys
children = [subprocess.Popen([sys.executable, "-c", {HOLD_60_MB!r}]) for _ in range(4)]
print([child.wait() for child in children])
"""


def _cgroup_problem() -> str | None:
    from sandboxes.cgroups import cgroup_problem

    return cgroup_problem()


@pytest.mark.skipif(
    _cgroup_problem() is not None, reason=f"no cgroups for sandboxes here: {_cgroup_problem()}"
)
async def test_a_local_sandbox_gets_a_control_group_with_its_limits():
    async with create_sandbox(spec("local", memory_mb=160, pids=48, cpus=0.5)) as sandbox:
        group = sandbox._cgroup
        assert group is not None
        procs = {
            int(pid)
            for directory in group.directories
            for pid in (directory / "cgroup.procs").read_text().split()
        }
        assert sandbox._process.pid in procs
        # four processes of 60 MB each fit RLIMIT_AS one by one, not the sandbox's 160 MB together
        result = await sandbox.exec(["python3", "-c", TOUCH_MEMORY], timeout_s=60)
        codes = json.loads(result.stdout)
        assert -9 in codes, (result.stdout, result.stderr)
        assert await sandbox.alive()
        directories = group.directories
    assert not any(directory.exists() for directory in directories)  # removed with the sandbox


async def test_the_first_local_sandbox_says_which_limits_it_cannot_enforce(monkeypatch, caplog):
    import logging

    import sandboxes.local as local

    local._say_what_is_not_enforced.cache_clear()
    monkeypatch.setattr(local, "cgroup_problem", lambda: "the harness does not run as root")
    with caplog.at_level(logging.WARNING, logger="sandboxes.local"):
        async with create_sandbox(spec("local")):
            pass
    local._say_what_is_not_enforced.cache_clear()
    (record,) = [r for r in caplog.records if "cannot" in r.getMessage() or "no cgroup" in r.getMessage()]
    assert "does not run as root" in record.getMessage() and "cpus is not enforced" in record.getMessage()


@pytest.fixture
def world_readable_tmp():
    """A temporary folder under /tmp that another user can reach (pytest's own is root-only)."""
    path = Path(tempfile.mkdtemp(prefix="link-cleanup-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_cleanup_never_follows_a_link_out_of_the_sandbox_directory(world_readable_tmp):
    """A tree a sandbox could leave: a directory it made unreadable, holding symlinks to a host file and
    to a host directory, and a read-only one holding a symlink to the host file. Removed by a user who
    needs chmod to get through it (nobody, when the tests run as root): the tree is gone, the host file
    and directory keep their modes and contents."""
    base = world_readable_tmp
    host, tree = base / "host", base / "sandbox-dir"
    secret, host_dir = host / "secret.txt", host / "dir"
    locked = tree / "work" / "locked"
    host_dir.mkdir(parents=True)
    secret.write_text("host data")
    (host_dir / "keep.txt").write_text("keep")
    locked.mkdir(parents=True)
    (locked / "to-file").symlink_to(secret)
    (locked / "to-dir").symlink_to(host_dir)
    (locked / "plain.txt").write_text("x")
    read_only = tree / "work" / "read-only"  # listable, but its entries cannot be unlinked without chmod
    read_only.mkdir()
    (read_only / "to-file").symlink_to(secret)
    as_root = os.geteuid() == 0
    owner = 65534 if as_root else os.geteuid()
    if as_root:  # everything belongs to nobody, who then removes the tree
        for path in (
            base,
            host,
            secret,
            host_dir,
            host_dir / "keep.txt",
            tree,
            tree / "work",
            locked,
            read_only,
        ):
            os.chown(path, owner, owner)
        for path in (*locked.iterdir(), *read_only.iterdir()):
            os.lchown(path, owner, owner)
    secret.chmod(0o600)
    host_dir.chmod(0o500)  # read-only for its owner: the cleanup must not make it writable
    locked.chmod(0o000)
    read_only.chmod(0o500)
    pid = os.fork()
    if pid == 0:  # the child drops to that user and removes the tree
        code = 1
        try:
            if as_root:
                os.setgid(owner)
                os.setuid(owner)
            remove_tree(tree)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not tree.exists()
    assert secret.stat().st_mode & 0o777 == 0o600 and secret.read_text() == "host data"
    assert host_dir.stat().st_mode & 0o777 == 0o500 and (host_dir / "keep.txt").read_text() == "keep"
