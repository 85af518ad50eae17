"""API server processes: `harness serve`'s HTTP in processes of their own (vLLM's --api-server-count).

Why: in one process, the event loop that parses requests and writes log-probs as JSON shares the GIL with
the engine thread, whose host work between GPU steps it can hold up; with `api_server_count` >= 1 that
work moves to other processes, as vLLM's API servers do. On one H100 (random Qwen3-0.6B, 4 client
processes, docs/serving-benchmarks.md) one API server changed generated tokens/s by +1% / -4% at 64 /
256 requests in flight, so it is off by default. Loads heavier in HTTP than in tokens (many short
requests, large top-k log-probs) were not measured.

Layout:

    clients ──HTTP──> API server 0..N-1 (this module's `_api_server_main`, spawned processes sharing one
                        │                 listening socket the engine process opened)
                        │  /v1/completions, /inference/v1/generate: parsed and answered here; the
                        │      prompt ids and sampling params go through a pipe to the engine process
                        │  every other route: proxied as is to the engine process's own HTTP server
                        ▼      (127.0.0.1, a free port), so pause, weights, LoRA and metrics stay in one place
                      engine process: an `_EngineBridge` per API server submits to the engine and sends
                        each output back when the engine thread hands it over

Lifetimes: the engine process owns the listening socket and the children. An API server exits when its pipe
closes (the engine process is gone, even after SIGKILL) or when told to stop; the engine process stops the
server if an API server dies. Shutdown (`ApiServers.close`): after the engine has answered every pending
request (finish_reason "abort"), each bridge sends what is left and then "stop", and the children are
joined (killed after a timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import queue
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

from harness.server.engine import EngineClosedError, GenerationOutput
from harness.server.protocol import CompletionRequest, ProtocolError

if TYPE_CHECKING:
    from harness.server.app import ServedModel

logger = logging.getLogger(__name__)

_STOP = ("stop",)
SIGTERM_GRACE_S = 10.0
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade"}


@dataclass(frozen=True)
class ApiServerSpec:
    """What one API server process needs: how to read and answer requests, and where the engine's HTTP is."""

    index: int
    served: ServedModel  # picklable: names, limits and the tokenizer
    backend_url: str
    parent_pid: int


# ---------------------------------------------------------------------------------------------------------
# The engine process's side


class _EngineBridge:
    """Serves one API server's pipe in the engine process: submits its requests, sends their outputs back.

    A reader thread takes ("submit", id, prompt_ids, params, model) and ("abort", id); outputs arrive on the
    engine thread (`on_done`) and go into an outbox a sender thread drains, so the engine thread never
    pickles or writes to a pipe.
    """

    def __init__(self, conn: Connection, state: Any, on_lost: Callable[[str], None], name: str) -> None:
        self._conn = conn
        self._state = state
        self._on_lost = on_lost
        self._outbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._closing = False
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)
        self._sender = threading.Thread(target=self._send, name=f"{name}-sender", daemon=True)

    def start(self) -> None:
        self._reader.start()
        self._sender.start()

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                if not self._closing:
                    self._on_lost("its pipe closed")
                return
            if message[0] == "submit":
                self._submit(*message[1:])
            elif message[0] == "abort":
                self._state.engine.abort(message[1])

    def _submit(self, request_id: str, prompt_ids: list[int], params: Any, model: str | None) -> None:
        def on_done(result: GenerationOutput | BaseException) -> None:
            self._outbox.put(_encode_result(request_id, result))

        try:
            adapter = self._state.adapter_for(model)
            self._state.engine.submit(prompt_ids, params, on_done, adapter=adapter, request_id=request_id)
        except (ProtocolError, EngineClosedError, ValueError) as exc:
            on_done(exc)

    def _send(self) -> None:
        while True:
            batch = [self._outbox.get()]
            while True:  # everything already waiting goes in one write
                try:
                    batch.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            stop = _STOP in batch
            results = [item for item in batch if item != _STOP]
            try:
                if results:
                    self._conn.send(("results", results))
                if stop:
                    self._conn.send(_STOP)
            except (BrokenPipeError, OSError):
                return
            if stop:
                return

    def stop(self, timeout_s: float) -> None:
        """Send what is pending, then "stop"; wait for the sender (the reader ends at the child's EOF)."""
        self._closing = True
        self._outbox.put(_STOP)
        self._sender.join(timeout_s)


def _encode_result(request_id: str, result: GenerationOutput | BaseException) -> tuple[Any, ...]:
    if isinstance(result, GenerationOutput):
        return ("done", request_id, result)
    if isinstance(result, ProtocolError):
        return ("error", request_id, result.status, result.message, result.param)
    if isinstance(result, EngineClosedError):
        return ("error", request_id, 503, f"the generation engine is not running: {result}", None)
    if isinstance(result, ValueError):
        return ("error", request_id, 400, str(result), None)
    return ("error", request_id, 500, f"{type(result).__name__}: {result}", None)


class ApiServers:
    """The API server processes of one `harness serve`, and the bridges feeding them. Use `start`."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._processes: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._bridges: list[_EngineBridge] = []
        self._closed = False
        self.lost: str | None = None  # why an API server went away unasked, once one did

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    @classmethod
    def start(
        cls,
        state: Any,
        *,
        host: str,
        port: int,
        count: int,
        backend_url: str,
        on_lost: Callable[[], None],
        timeout_s: float = 120.0,
    ) -> ApiServers:
        """Listen on host:port, spawn `count` API servers on that socket, return once all of them serve.

        `on_lost` is called (from a bridge thread) when an API server dies unasked; the caller stops.
        """
        from harness.server.app import ServedModel

        sock = socket.create_server((host, port), backlog=4096)
        servers = cls(sock)
        context = multiprocessing.get_context("spawn")
        served = ServedModel.of(state)
        try:
            for index in range(count):
                parent_conn, child_conn = context.Pipe()
                spec = ApiServerSpec(index, served, backend_url, os.getpid())
                process = context.Process(
                    target=_api_server_main,
                    args=(spec, sock, child_conn),
                    name=f"harness-api-server-{index}",
                    daemon=True,
                )
                process.start()
                child_conn.close()
                servers._processes.append(process)
                servers._conns.append(parent_conn)
            for index, conn in enumerate(servers._conns):
                if not conn.poll(timeout_s):
                    raise RuntimeError(f"API server {index} did not start within {timeout_s:.0f} s")
                try:
                    ready = conn.recv()
                except EOFError:
                    code = servers._processes[index].exitcode
                    raise RuntimeError(
                        f"API server {index} exited while starting (exit code {code})"
                    ) from None
                if ready != ("ready",):
                    raise RuntimeError(f"API server {index} failed to start: {ready[1]}")

            def lost(index: int) -> Callable[[str], None]:
                def report(why: str) -> None:
                    servers.lost = f"API server {index} (pid {servers._processes[index].pid}) exited: {why}"
                    logger.error("%s; stopping the server", servers.lost)
                    on_lost()

                return report

            for index, conn in enumerate(servers._conns):
                bridge = _EngineBridge(conn, state, lost(index), name=f"harness-api-bridge-{index}")
                servers._bridges.append(bridge)
                bridge.start()
        except BaseException:
            servers.close()
            raise
        return servers

    def close(self, timeout_s: float = 10.0) -> None:
        """Send every pending answer, stop the API servers (killed after `timeout_s`), close the socket."""
        if self._closed:
            return
        self._closed = True
        for bridge in self._bridges:
            bridge.stop(timeout_s)
        for index, conn in enumerate(self._conns):
            if index >= len(self._bridges):  # started, never bridged: tell it directly
                with contextlib.suppress(OSError):
                    conn.send(_STOP)
        for process in self._processes:
            process.join(timeout_s)
            if process.is_alive():
                logger.warning("API server %s did not stop in %.0f s; killing it", process.pid, timeout_s)
                process.kill()
                process.join()
        for conn in self._conns:
            conn.close()
        self._sock.close()


# ---------------------------------------------------------------------------------------------------------
# An API server process's side


class _EngineLink:
    """An API server's end of the pipe: `generated` sends a request and awaits its output."""

    def __init__(self, conn: Connection, index: int, on_closed: Callable[[], None]) -> None:
        self._conn = conn
        self._ids = (f"api{index}-{n}" for n in itertools.count())
        self._pending: dict[str, asyncio.Future[tuple[Any, ...]]] = {}
        self._on_closed = on_closed
        self._closed = False

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_reader(self._conn.fileno(), self._receive)

    def _receive(self) -> None:
        try:
            while self._conn.poll():
                message = self._conn.recv()
                if message[0] == "results":
                    for result in message[1]:
                        future = self._pending.pop(result[1], None)
                        if future is not None and not future.done():
                            future.set_result(result)
                elif message == _STOP:
                    self._close("the server is stopping")
                    return
        except (EOFError, OSError):
            self._close("the engine process is gone")

    def _close(self, why: str) -> None:
        if self._closed:
            return
        self._closed = True
        asyncio.get_running_loop().remove_reader(self._conn.fileno())
        for future in self._pending.values():
            if not future.done():
                future.set_result(("error", "", 503, f"the generation engine is not running: {why}", None))
        self._pending.clear()
        self._on_closed()

    async def generated(self, parsed: CompletionRequest) -> GenerationOutput:
        if self._closed:
            raise EngineClosedError("the engine process is gone")
        request_id = next(self._ids)
        future: asyncio.Future[tuple[Any, ...]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        self._conn.send(("submit", request_id, parsed.prompt_ids, parsed.params, parsed.model))
        try:
            result = await future
        except asyncio.CancelledError:
            self._pending.pop(request_id, None)
            if not self._closed:
                self._conn.send(("abort", request_id))  # the client went away: free the row now
            raise
        if result[0] == "done":
            return result[2]
        _, _, status, message, param = result
        raise ProtocolError(status, message, param)


def _proxy_routes(backend_url: str) -> tuple[list[web.RouteDef], Callable[[], Any]]:
    """A catch-all route forwarding a request to the engine process's HTTP server, and a closer."""
    session: ClientSession | None = None

    async def proxy(request: web.Request) -> web.StreamResponse:
        nonlocal session
        if session is None:
            session = ClientSession(connector=TCPConnector(limit=0), timeout=ClientTimeout(total=None))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        body = await request.read()
        async with session.request(
            request.method, backend_url + request.path_qs, headers=headers, data=body
        ) as answer:
            payload = await answer.read()
            out_headers = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP_HEADERS}
            return web.Response(status=answer.status, body=payload, headers=out_headers)

    async def close() -> None:
        if session is not None:
            await session.close()

    return [web.route("*", "/{tail:.*}", proxy)], close


def _api_server_main(spec: ApiServerSpec, sock: socket.socket, conn: Connection) -> None:
    """Entry point of an API server process (spawned by `ApiServers.start`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the engine process, which stops us in order
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(_serve_api(spec, sock, conn))
    except Exception as exc:
        logger.exception("API server %d failed", spec.index)
        with contextlib.suppress(OSError):
            conn.send(("failed", repr(exc)))


async def _serve_api(spec: ApiServerSpec, sock: socket.socket, conn: Connection) -> None:
    from harness.server.app import errors_as_json, generation_routes

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_sigterm() -> None:
        # Sent to the whole process group (a terminal, a supervisor) it reaches the engine process too,
        # which stops us in order; alone, we stop after a grace period.
        loop.call_later(SIGTERM_GRACE_S, stop.set)

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    link = _EngineLink(conn, spec.index, stop.set)
    routes, close_proxy = _proxy_routes(spec.backend_url)
    app = web.Application(middlewares=[errors_as_json], client_max_size=64 * 2**20)
    app.add_routes(generation_routes(spec.served, link.generated))
    app.add_routes(routes)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    link.attach(loop)
    await web.SockSite(runner, sock).start()
    conn.send(("ready",))

    async def watch_parent() -> None:  # belt and braces: the pipe's EOF normally tells us first
        while os.getppid() == spec.parent_pid:
            await asyncio.sleep(1.0)
        stop.set()

    watcher = asyncio.create_task(watch_parent())
    try:
        await stop.wait()
    finally:
        watcher.cancel()
        await runner.cleanup()
        await close_proxy()
        conn.close()


__all__ = ["ApiServerSpec", "ApiServers"]
