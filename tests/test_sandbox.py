"""Sandbox backends, one property per test, on the real thing: bubblewrap, and a Docker engine (marker
`docker`). Each test runs on every backend it applies to."""

from __future__ import annotations

import os
import pickle
import socket
import time
from pathlib import Path

import anyio
import pytest

from sandboxes import errors
from sandboxes.backends import create_sandbox
from sandboxes.base import Limits, SandboxSpec

pytestmark = pytest.mark.anyio

BACKENDS = ["local", pytest.param("docker", marks=pytest.mark.docker)]


def spec(backend: str, **limits: object) -> SandboxSpec:
    return SandboxSpec(backend=backend, limits=Limits(**limits), exec_timeout_s=30)  # type: ignore[arg-type]


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


COUNT_PROCESSES = "import os; print(sum(name.isdigit() for name in os.listdir('/proc')))"


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_exec_runs_argv_and_shell_with_stdin_env_and_cwd(backend):
    async with create_sandbox(spec(backend)) as sandbox:
        result = await sandbox.exec(
            ["python3", "-c", "import sys; print(sys.stdin.read().upper())"], stdin="hi"
        )
        assert (result.exit_code, result.stdout, result.timed_out) == (0, "HI\n", False)
        result = await sandbox.exec(
            "mkdir -p sub && cd sub && pwd && echo $GREETING >&2; exit 3", env={"GREETING": "hello"}
        )
        assert result.exit_code == 3
        assert result.stdout == "/workspace/sub\n"
        assert result.stderr == "hello\n"
        assert (await sandbox.exec("pwd", cwd="sub")).stdout == "/workspace/sub\n"
        missing = await sandbox.exec(["no-such-program"])
        assert missing.exit_code == 127 and "command not found" in missing.stderr
        assert (await sandbox.exec("id -u")).stdout.strip() == "1000"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_infinite_loop_is_killed_on_time_with_its_process_tree(backend):
    async with create_sandbox(spec(backend)) as sandbox:
        before = int((await sandbox.exec(["python3", "-c", COUNT_PROCESSES])).stdout)
        result = await sandbox.exec(
            "sleep 1000 & (setsid sleep 1000 &) ; while true; do :; done", timeout_s=1.0
        )
        assert result.timed_out
        assert result.exit_code == -9
        assert 1.0 <= result.duration_s < 5.0
        after = int((await sandbox.exec(["python3", "-c", COUNT_PROCESSES])).stdout)
        assert after == before  # the loop, its background sleep and the one that left the group are gone


@pytest.mark.parametrize("backend", BACKENDS)
async def test_fork_bomb_is_contained_by_the_pids_limit(backend):
    async with create_sandbox(spec(backend, pids=64)) as sandbox:
        result = await sandbox.exec("bomb() { bomb | bomb & }; bomb; sleep 3", timeout_s=10)
        assert not result.timed_out
        assert "fork" in result.stderr.lower() or "resource temporarily unavailable" in result.stderr.lower()
        after = await sandbox.exec(["python3", "-c", COUNT_PROCESSES])
        assert after.ok and int(after.stdout) < 10  # the bomb is gone, the sandbox works


@pytest.mark.parametrize("backend", BACKENDS)
async def test_memory_limit_holds(backend):
    async with create_sandbox(spec(backend, memory_mb=256)) as sandbox:
        small = await sandbox.exec(["python3", "-c", "x = bytearray(64 << 20); print(len(x))"])
        assert small.ok, small
        big = await sandbox.exec(["python3", "-c", "x = bytearray(1 << 30); x[::4096] = b'x' * (1 << 18)"])
        assert not big.ok
        assert big.exit_code == -9 or "MemoryError" in big.stderr
        assert (await sandbox.exec("echo alive")).stdout == "alive\n"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_huge_output_is_truncated_without_the_host_growing(backend):
    async with create_sandbox(spec(backend)) as sandbox:
        before = rss_mb()
        result = await sandbox.exec("head -c 100000000 /dev/zero | tr '\\0' x; echo done >&2", timeout_s=60)
        grown = rss_mb() - before
        assert result.ok
        assert result.stdout_truncated and not result.stderr_truncated
        assert len(result.stdout) == Limits().output_bytes
        assert result.stderr == "done\n"
        assert grown < 50, f"host RSS grew by {grown:.0f} MB for 100 MB of output"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_binary_and_non_utf8_output_is_kept_decodable(backend):
    async with create_sandbox(spec(backend)) as sandbox:
        result = await sandbox.exec(
            ["python3", "-c", "import sys; sys.stdout.buffer.write(bytes(range(256)))"]
        )
        assert result.ok and "\ufffd" in result.stdout
        await sandbox.write_file("blob.bin", bytes(range(256)))
        assert await sandbox.read_file("blob.bin") == bytes(range(256))


@pytest.mark.parametrize("backend", BACKENDS)
async def test_no_network_neither_loopback_of_the_host_nor_dns(backend):
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    try:
        async with create_sandbox(spec(backend)) as sandbox:
            connect = await sandbox.exec(
                [
                    "python3",
                    "-c",
                    f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3)",
                ]
            )
            resolve = await sandbox.exec(
                ["python3", "-c", "import socket; socket.gethostbyname('deb.debian.org')"]
            )
            interfaces = await sandbox.exec(["python3", "-c", "import socket; print(socket.if_nameindex())"])
    finally:
        listener.close()
    assert connect.exit_code != 0 and "ConnectionRefused" in connect.stderr
    assert resolve.exit_code != 0 and "gaierror" in resolve.stderr
    assert "eth" not in interfaces.stdout


@pytest.mark.parametrize("backend", BACKENDS)
async def test_host_files_outside_the_workdir_can_be_neither_read_nor_written(backend, tmp_path):
    secret = tmp_path / "host-secret.txt"
    secret.write_text("the host's secret")
    async with create_sandbox(spec(backend)) as sandbox:
        read = await sandbox.exec(f"cat {secret}; cat /etc/shadow; ls /root /home")
        write = await sandbox.exec(
            f"echo x > {tmp_path}/planted; echo x > /usr/planted; echo x > /etc/passwd"
        )
    assert "the host's secret" not in read.stdout
    assert read.exit_code != 0
    assert write.exit_code != 0
    assert not (tmp_path / "planted").exists()
    assert not Path("/usr/planted").exists()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_host_secrets_in_the_environment_are_not_visible(backend, monkeypatch):
    monkeypatch.setenv("HARNESS_TEST_API_KEY", "sk-leak")
    monkeypatch.setenv("HARNESS_TEST_TOKEN", "tok-leak")
    monkeypatch.setenv("HARNESS_TEST_SECRET", "sec-leak")
    async with create_sandbox(spec(backend)) as sandbox:
        result = await sandbox.exec("env; cat /proc/1/environ 2>/dev/null | tr '\\0' '\\n'")
    assert "leak" not in result.stdout
    assert not any(word in result.stdout for word in ("KEY=", "TOKEN=", "SECRET="))


@pytest.mark.parametrize("backend", BACKENDS)
async def test_command_that_closes_stdout_and_keeps_running_times_out(backend):
    async with create_sandbox(spec(backend)) as sandbox:
        result = await sandbox.exec("echo started; exec >&- 2>&-; sleep 100", timeout_s=1.0)
    assert result.timed_out and result.stdout == "started\n"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_background_child_holding_the_pipes_does_not_hold_the_answer(backend):
    async with create_sandbox(spec(backend)) as sandbox:
        result = await sandbox.exec("sleep 100 & echo parent done", timeout_s=20)
    assert result.ok and result.stdout == "parent done\n"
    assert result.duration_s < 5


@pytest.mark.parametrize("backend", BACKENDS)
async def test_files_upload_and_download(backend, tmp_path):
    source = tmp_path / "source"
    (source / "pkg").mkdir(parents=True)
    (source / "pkg" / "mod.py").write_text("VALUE = 42\n")
    async with create_sandbox(spec(backend)) as sandbox:
        await sandbox.upload(source, "project")
        result = await sandbox.exec(
            ["python3", "-c", "from pkg.mod import VALUE; print(VALUE)"], cwd="project"
        )
        assert result.stdout == "42\n"
        await sandbox.exec(
            "cd project && echo out > made.txt && ln -s /etc/hostname link && ln -s ../../.. up"
        )
        await sandbox.download("project", tmp_path / "back")
        with pytest.raises(errors.SandboxFileNotFound) as info:
            await sandbox.read_file("missing.txt")
        assert isinstance(info.value, FileNotFoundError)
    assert (tmp_path / "back" / "made.txt").read_text() == "out\n"
    assert (tmp_path / "back" / "pkg" / "mod.py").read_text() == "VALUE = 42\n"
    assert not (tmp_path / "back" / "link").exists() and not (tmp_path / "back" / "up").exists()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_sandbox_killed_from_outside_mid_exec_is_a_typed_error_fast(backend):
    sandbox = await create_sandbox(spec(backend)).start()
    try:
        async with anyio.create_task_group() as group:
            outcome: dict[str, BaseException] = {}

            async def run() -> None:
                try:
                    await sandbox.exec("sleep 100", timeout_s=60)
                except errors.SandboxDied as exc:
                    outcome["error"] = exc

            group.start_soon(run)
            await anyio.sleep(0.5)
            started = time.monotonic()
            await kill_from_outside(sandbox)
        assert time.monotonic() - started < 10
        assert "died" in str(outcome["error"])
        with pytest.raises(errors.SandboxDied):
            await sandbox.exec("true")
        assert not await sandbox.alive()
    finally:
        await sandbox.close()


async def kill_from_outside(sandbox) -> None:
    if sandbox.spec.backend == "docker":
        from sandboxes.engine import docker_client

        await anyio.to_thread.run_sync(lambda: docker_client().api.kill(sandbox.container_id))
    else:
        os.killpg(sandbox._process.pid, 9)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_close_is_idempotent_and_use_after_close_is_typed(backend):
    sandbox = create_sandbox(spec(backend))
    async with sandbox:
        pass
    await sandbox.close()
    with pytest.raises(errors.SandboxClosed):
        await sandbox.exec("true")
    with pytest.raises(errors.SandboxClosed):
        await sandbox.start()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_start_or_close_cancelled_half_way_leaves_nothing(backend):
    """What a run's shutdown does to rollouts in flight: cancel their sandboxes mid-start and mid-close."""
    started_late = [create_sandbox(spec(backend)) for _ in range(6)]
    cancelled = 0
    for index, sandbox in enumerate(started_late):  # cancelled at different points of the start
        with anyio.move_on_after(0.005 * (index + 1)) as scope:
            await sandbox.start()
        cancelled += scope.cancelled_caught
        if not scope.cancelled_caught:
            await sandbox.close()
    assert cancelled >= 2, "the starts were meant to be cancelled part-way"
    closed_cancelled = [await create_sandbox(spec(backend)).start() for _ in range(2)]
    for sandbox in closed_cancelled:
        with anyio.CancelScope() as scope:
            scope.cancel()  # every await of close() is cancelled
            await sandbox.close()
    everything = started_late + closed_cancelled
    assert all(sandbox.closed for sandbox in everything)
    assert leftovers(backend, everything) == []


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
async def test_64_concurrent_sandboxes_are_all_removed_after(backend):
    sandboxes = [create_sandbox(spec(backend)) for _ in range(64)]

    async def use(sandbox, index: int) -> None:
        async with sandbox:
            result = await sandbox.exec(f"echo {index}")
            assert result.stdout == f"{index}\n"

    async with anyio.create_task_group() as group:
        for index, sandbox in enumerate(sandboxes):
            group.start_soon(use, sandbox, index)
    assert all(sandbox.closed for sandbox in sandboxes)
    assert leftovers(backend, sandboxes) == []


def leftovers(backend: str, sandboxes) -> list[str]:
    """What of these sandboxes still exists on the host: containers, directories, processes."""
    if backend == "docker":
        from sandboxes.engine import docker_client

        ids = {sandbox.container_id for sandbox in sandboxes}
        return [c["Id"] for c in docker_client().api.containers(all=True) if c["Id"] in ids]
    found = [str(sandbox._dir) for sandbox in sandboxes if sandbox._dir is not None and sandbox._dir.exists()]
    found += [str(s._process.pid) for s in sandboxes if s._process and s._process.returncode is None]
    return found


def test_impossible_limits_and_unknown_backends_are_refused_clearly():
    with pytest.raises(errors.InvalidSandboxConfig, match="memory_mb must be at least 32"):
        Limits(memory_mb=1)
    with pytest.raises(errors.InvalidSandboxConfig, match="pids must be at least 8"):
        Limits(pids=0)
    with pytest.raises(errors.InvalidSandboxConfig, match="unknown sandbox backend 'vm'"):
        SandboxSpec(backend="vm")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        SandboxSpec(workdir="relative")


@pytest.mark.parametrize(
    "error",
    [
        errors.SandboxDied("gone"),
        errors.SandboxTimeout("slow"),
        errors.ImageNotFound("no image"),
        errors.EngineUnavailable("no engine"),
        errors.SandboxFileNotFound("no file"),
        errors.InvalidSandboxConfig("bad"),
    ],
)
def test_errors_pickle_and_refine_the_stdlib(error):
    restored = pickle.loads(pickle.dumps(error))
    assert type(restored) is type(error) and str(restored) == str(error)
    stdlib = {
        errors.SandboxDied: ConnectionError,
        errors.SandboxTimeout: TimeoutError,
        errors.ImageNotFound: LookupError,
        errors.EngineUnavailable: ConnectionError,
        errors.SandboxFileNotFound: FileNotFoundError,
        errors.InvalidSandboxConfig: ValueError,
    }[type(error)]
    assert isinstance(restored, stdlib) and isinstance(restored, errors.SandboxError)


EXIT_WITHOUT_CLOSING = """
import json, sys, anyio
from sandboxes.backends import create_sandbox
from sandboxes.base import SandboxSpec

async def main():
    sandboxes = [await create_sandbox(SandboxSpec(backend=sys.argv[1])).start() for _ in range(3)]
    print(json.dumps([getattr(s, "container_id", None) or str(s._dir) for s in sandboxes]), flush=True)

anyio.run(main)  # returns without closing them: the exit hook must
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_exit_hook_removes_sandboxes_left_open_at_interpreter_exit(backend):
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", EXIT_WITHOUT_CLOSING, backend], capture_output=True, text=True, check=True
    ).stdout
    left = json.loads(out)
    if backend == "docker":
        from sandboxes.engine import docker_client

        existing = {c["Id"] for c in docker_client().api.containers(all=True)}
        assert not existing & set(left)
    else:
        assert not any(Path(path).exists() for path in left)


@pytest.mark.docker
async def test_missing_image_is_a_typed_error_naming_the_fix():
    sandbox = create_sandbox(SandboxSpec(backend="docker", image="agent-harness/missing:never"))
    with pytest.raises(errors.ImageNotFound, match="harness sandbox build-image"):
        await sandbox.start()
    assert sandbox.closed


async def test_engine_not_running_is_a_typed_error(monkeypatch, tmp_path):
    import sandboxes.engine as docker_backend

    monkeypatch.setattr(docker_backend, "_clients", {})
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    with pytest.raises(errors.EngineUnavailable, match="no Docker engine answers at unix://"):
        await create_sandbox(SandboxSpec(backend="docker")).start()
    monkeypatch.setattr(docker_backend, "_clients", {})  # the next test gets a client of its own
