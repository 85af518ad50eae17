"""Starting the built-in server as a subprocess: what the trainer does when no server URL is configured.

Who talks to it: the trainer calls `open_generation_server(url_or_None, model=...)` around its run; it yields
the base URL to give `GenerationClient`, and logs one line saying which server is in use. With a URL it
only logs; without one it runs `python -m harness.server MODEL --port 0 ...`, learns the port the server
bound (through a port file, so no port is guessed and raced for), waits for /health, and stops the
server on the way out.

No leaked process: the subprocess is stopped by the context manager on every exit path (an error while
waiting for /health included), by an atexit hook if the interpreter exits without leaving the context, and
by the server itself (`--exit-with-parent`) if this process is killed outright. Stopping sends SIGTERM
(the server aborts pending requests and closes its listener), then SIGKILL after `stop_timeout_s`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

logger = logging.getLogger(__name__)


class ServerStartError(RuntimeError):
    """The built-in server exited or did not become healthy in time (the message ends with its log)."""


class BuiltinServer:
    """A running `harness serve` subprocess. Use `start_builtin_server` to make one."""

    def __init__(
        self, process: subprocess.Popen, base_url: str, log_path: Path | None, workdir: Path
    ) -> None:
        self.process = process
        self.base_url = base_url
        self.log_path = log_path
        self._workdir = workdir
        self._stopped = False
        atexit.register(self.stop)

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, stop_timeout_s: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after `stop_timeout_s`; returns the exit code (idempotent)."""
        if self._stopped:
            return self.process.returncode
        self._stopped = True
        atexit.unregister(self.stop)
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=stop_timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("built-in server (pid %d) ignored SIGTERM; killing it", self.process.pid)
                self.process.kill()
                self.process.wait()
        self.remove_workdir()
        return self.process.returncode

    def remove_workdir(self) -> None:
        """Delete the folder the server wrote its port into (idempotent)."""
        shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> BuiltinServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _log_tail(log_path: Path | None, num_chars: int = 3000) -> str:
    if log_path is None or not log_path.is_file():
        return "(its output went to this process's stderr)"
    return log_path.read_text(errors="replace")[-num_chars:]


def start_builtin_server(
    model: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    device: str = "auto",
    dtype: str = "auto",
    max_model_len: int | None = None,
    num_threads: int | None = None,
    extra_args: Sequence[str] = (),
    timeout_s: float = 600.0,
    log_path: str | Path | None = None,
    env: dict[str, str] | None = None,
) -> BuiltinServer:
    """Start `harness serve MODEL` in a subprocess and return once /health answers.

    Args:
        model: Model folder to serve.
        host, port: Where it listens (port 0: a free port, read back from the server).
        device, dtype, max_model_len, num_threads: As `harness serve`'s flags.
        extra_args: More `harness serve` flags (e.g. ["--enable-lora"]).
        timeout_s: How long to wait for /health (loading a model can take a while).
        log_path: File for the server's stdout and stderr; default: inherit this process's.
        env: Environment of the server; default: this process's.
    """
    workdir = Path(tempfile.mkdtemp(prefix="agent-harness-serve-"))
    port_file = workdir / "port"
    command = [
        sys.executable,
        "-m",
        "harness.server",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
        "--port-file",
        str(port_file),
        "--device",
        device,
        "--dtype",
        dtype,
        "--exit-with-parent",
        *(["--max-model-len", str(max_model_len)] if max_model_len else []),
        *(["--num-threads", str(num_threads)] if num_threads else []),
        *extra_args,
    ]
    log_file: IO[bytes] | None = None
    resolved_log = Path(log_path) if log_path is not None else None
    if resolved_log is not None:
        resolved_log.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(resolved_log, "ab")  # noqa: SIM115 -- handed to the child, closed below
    try:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT if log_file else None,
            env=env,
        )
    finally:
        if log_file is not None:
            log_file.close()  # the child holds its own descriptor
    server = BuiltinServer(process, base_url="", log_path=resolved_log, workdir=workdir)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise ServerStartError(
                    f"the built-in server exited with status {process.returncode} while starting; its log:\n"
                    + _log_tail(resolved_log)
                )
            if not server.base_url and port_file.is_file():
                server.base_url = f"http://{host}:{int(port_file.read_text())}"
                server.remove_workdir()  # read: a parent killed from now on leaves no folder behind
            if server.base_url and _healthy(server.base_url):
                return server
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"the built-in server was not healthy after {timeout_s:.0f} s; its log:\n"
                    + _log_tail(resolved_log)
                )
            time.sleep(0.2)
    except BaseException:
        server.stop()
        raise


@contextlib.contextmanager
def open_generation_server(
    base_url: str | None, *, model: str | Path | None, **builtin_kwargs: object
) -> Iterator[str]:
    """The generation server's base URL for a run: `base_url` if given, else a built-in server's (on
    `model`, a local folder).

    Logs one line saying which server is in use; a built-in server is stopped when the block exits.
    """
    if base_url:
        logger.info("generation server: external vLLM-protocol server at %s", base_url)
        yield base_url
        return
    if model is None:
        raise ValueError("a built-in generation server needs a model folder to load")
    with start_builtin_server(model, **builtin_kwargs) as server:  # type: ignore[arg-type]
        logger.info(
            "generation server: built-in (harness serve %s, pid %d) at %s", model, server.pid, server.base_url
        )
        yield server.base_url


__all__ = ["BuiltinServer", "ServerStartError", "open_generation_server", "start_builtin_server"]
