"""The host's end of the conversation with a sandbox's resident executor (`sandboxes/agent.py`).

A channel sends length-prefixed JSON requests down a byte stream and matches the answers, which may come
back in any order, to their requests by id. One reader task per channel reads answers; when the stream
ends or breaks, every waiting request and every later one raises `SandboxDied`, with whatever the backend
can say about why (the container's state, the executor's stderr).

Backends give the channel an `asyncio.StreamReader`-like object (anything with `readexactly`) and an
`asyncio.StreamWriter`-like object (`write`, `drain`, `close`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import struct
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import anyio

from sandboxes import errors

HEADER = struct.Struct(">I")
# The largest answer the executor may send (base64 of a 128 MiB file, or of two 32 MiB output streams);
# a frame announcing more means a corrupt or hostile stream, and ends the sandbox.
MAX_MESSAGE_BYTES = 192 << 20

# The executor reports failures by exception class name; these become typed errors on the host.
_FILE_ERRORS = {
    "FileNotFoundError": errors.SandboxFileNotFound,
    "NotADirectoryError": errors.SandboxFileError,
    "IsADirectoryError": errors.SandboxFileError,
    "PermissionError": errors.SandboxFileError,
    "OverflowError": errors.SandboxFileError,
    "OSError": errors.SandboxFileError,
}


class ByteReader(Protocol):
    async def readexactly(self, n: int) -> bytes: ...


class ByteWriter(Protocol):
    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    def close(self) -> None: ...


class AgentChannel:
    """Requests to one sandbox executor over a byte stream.

    Args:
        reader: Where the executor's answers arrive.
        writer: Where requests go.
        name: The sandbox's name, for error messages.
        why_dead: Awaited when the stream ends, to explain why (e.g. "container exited with code 137").
    """

    def __init__(
        self,
        reader: ByteReader,
        writer: ByteWriter,
        *,
        name: str,
        why_dead: Callable[[], Awaitable[str]] | None = None,
    ):
        self.name = name
        self._reader = reader
        self._writer = writer
        self._why_dead = why_dead
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._dead: errors.SandboxDied | None = None
        self._closing = False
        self._reader_task = asyncio.get_running_loop().create_task(
            self._read_answers(), name=f"{name}-answers"
        )

    @property
    def alive(self) -> bool:
        return self._dead is None and not self._closing

    async def request(self, op: str, *, wait_s: float | None, **fields: Any) -> dict[str, Any]:
        """Send one request and wait for its answer; raise the typed error the executor reported."""
        if self._dead is not None:
            raise self._dead
        request_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        data = json.dumps({"id": request_id, "op": op, **fields}, separators=(",", ":")).encode()
        try:
            try:
                self._writer.write(HEADER.pack(len(data)) + data)
                await self._writer.drain()
            except (ConnectionError, OSError, RuntimeError) as exc:
                raise await self._die(f"writing to it failed: {exc}") from exc
            with anyio.move_on_after(wait_s) as scope:
                answer = await future
            if scope.cancelled_caught:
                raise errors.SandboxTimeout(
                    f"sandbox {self.name}: no answer to '{op}' within {wait_s:g} s; its executor is stuck "
                    "or the machine is overloaded"
                )
        finally:
            self._pending.pop(request_id, None)
        if not answer.get("ok"):
            raise _typed_error(self.name, op, answer)
        return answer

    async def close(self) -> None:
        """Stop reading and close the stream (the executor sees end of input and exits)."""
        self._closing = True
        with contextlib.suppress(Exception):
            self._writer.close()
        self._reader_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader_task
        self._fail_pending(errors.SandboxClosed(f"sandbox {self.name} was closed"))

    # --- internals -----------------------------------------------------------------------------------

    async def _read_answers(self) -> None:
        try:
            while True:
                (length,) = HEADER.unpack(await self._reader.readexactly(HEADER.size))
                if length > MAX_MESSAGE_BYTES:
                    raise ValueError(f"answer of {length} bytes announced; the stream is corrupt")
                answer = json.loads(await self._reader.readexactly(length))
                future = self._pending.get(answer.get("id"))
                if future is not None and not future.done():
                    future.set_result(answer)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # end of stream, a broken pipe, garbage on the stream: the sandbox is gone
            if not self._closing:
                await self._die(_describe_end(exc))

    async def _die(self, reason: str) -> errors.SandboxDied:
        if self._dead is None:
            detail = ""
            if self._why_dead is not None:
                with contextlib.suppress(Exception), anyio.move_on_after(10):
                    detail = await self._why_dead()
            if self._dead is not None:  # another task declared it dead while we asked why
                return self._dead
            self._dead = errors.SandboxDied(
                f"sandbox {self.name} died: {reason}" + (f"; {detail}" if detail else "")
            )
            self._fail_pending(self._dead)
        return self._dead

    def _fail_pending(self, error: Exception) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)


def _describe_end(exc: Exception) -> str:
    if isinstance(exc, asyncio.IncompleteReadError):
        return "its executor's output ended (the process exited or was killed)"
    return f"reading from it failed: {type(exc).__name__}: {exc}"


def _typed_error(name: str, op: str, answer: dict[str, Any]) -> Exception:
    kind, message = answer.get("error", "Error"), answer.get("message", "")
    error_class = _FILE_ERRORS.get(kind)
    if error_class is not None:
        return error_class(f"sandbox {name}: {op}: {message}")
    return errors.SandboxError(f"sandbox {name}: {op} failed: {kind}: {message}")
