"""Server processes for tests and benchmarks: a free port, a real vLLM OpenAI server started and waited for,
and stopped with every process of its group.

    process, url = start_vllm_process([python, "-m", "vllm.entrypoints.openai.api_server", *flags], log_path,
                                      env=env, timeout_s=600)
    ...
    stop_process_group(process)
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (at the time of asking)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_vllm_process(
    argv: Sequence[str],
    log_path: Path,
    *,
    env: Mapping[str, str],
    timeout_s: float,
    poll_s: float = 1.0,
) -> tuple[subprocess.Popen, str]:
    """Start `argv` (a vLLM OpenAI server command, without --host and --port) on a free port of 127.0.0.1,
    its output to `log_path`, in a process group of its own (its engine processes join it); wait until
    /health answers. Returns the process and its URL; raises RuntimeError with the log's tail if it exits
    or does not answer within `timeout_s` (then it is stopped)."""
    port = free_port()
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [*argv, "--host", "127.0.0.1", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(
                f"vLLM exited with code {process.returncode} while starting:\n{tail(log_path)}"
            )
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return process, url
        except OSError as exc:
            if time.monotonic() > deadline:
                stop_process_group(process)
                raise RuntimeError(f"no answer on /health in {timeout_s:.0f} s:\n{tail(log_path)}") from exc
            time.sleep(poll_s)


def stop_process_group(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the process's group, wait up to `grace_s`, then SIGKILL what is left of the group."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # its engine processes, whatever the API server did
    process.wait()


def tail(path: Path, lines: int = 60) -> str:
    """The last `lines` lines of a log file."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
