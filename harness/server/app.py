"""The built-in server's HTTP layer: vLLM's routes on aiohttp, in front of the engine.

Who talks to it: clients (`harness.generation.client.GenerationClient`, or anything that speaks vLLM's
protocol) over HTTP; `harness serve` runs it in the foreground with `serve`; tests and benchmarks run it on a
thread of their own process with `EmbeddedServer`. With `--api-server-count N`, N other processes answer
clients (`api_servers.py`, with this module's `generation_routes`) and this app listens on 127.0.0.1 only
for them. Routes (shapes in `protocol.py`):

    GET  /health /v1/models /metrics /is_paused /server_info /get_world_size /version
    POST /v1/completions /inference/v1/generate
    POST /pause?mode=keep|wait|abort /resume /reset_prefix_cache
    POST /init_weight_transfer_engine /start_weight_update /update_weights /finish_weight_update
    POST /v1/load_lora_adapter /v1/unload_lora_adapter

aiohttp rather than FastAPI + uvicorn: one dependency (no ASGI server, no pydantic models to keep in step
with vLLM's), and it cancels a handler when its client disconnects (`handler_cancellation`), which is how
an abandoned request frees its engine row at once. Handlers never run torch: generation waits on a future
the engine thread resolves, and weight or adapter changes run on the engine thread through `Engine.call`
(between two steps), so the event loop only parses and serialises.

Shutdown order (`serve`, `EmbeddedServer.stop`): close the engine first (every pending request is answered
with finish_reason "abort", so handlers return at once), then the HTTP runner (connections close), then
the rest of the state (adapters, weight-transfer group).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from harness import __version__
from harness.server.api_servers import ApiServers
from harness.server.engine import EngineClosedError, GenerationOutput
from harness.server.histograms import REQUEST_LATENCY_BUCKETS_S, Histogram
from harness.server.lora import LoraError
from harness.server.metrics import render_metrics
from harness.server.protocol import (
    CompletionRequest,
    ProtocolError,
    completion_response,
    error_body,
    generate_response,
    model_card,
    models_response,
    parse_completion_request,
    parse_generate_request,
)
from harness.server.state import ServerConfig, ServerState
from harness.weight_sync.cuda_ipc import visible_device_uuids
from harness.weight_sync.wire import (
    DEFAULT_BUFFER_SIZE_BYTES,
    WeightDeltaError,
    WeightManifest,
    WeightTransferError,
    check_manifest,
    copy_into_model,
    read_weights_file,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_STATE = web.AppKey("state", ServerState)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
GENERATION_ROUTES = ("/v1/completions", "/inference/v1/generate")


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    return web.json_response(error_body(status, message, param), status=status)


@web.middleware
async def errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer typed failures with vLLM's error JSON; anything else is a server bug (500, logged)."""
    try:
        return await handler(request)
    except ProtocolError as exc:
        return _error(exc.status, exc.message, exc.param)
    except WeightDeltaError as exc:  # the trainer sends the weights whole instead
        return _error(409, str(exc))
    except (WeightTransferError, LoraError) as exc:
        return _error(400, str(exc))
    except EngineClosedError as exc:
        return _error(503, f"the generation engine is not running: {exc}")
    except web.HTTPException:
        raise
    except Exception as exc:
        logger.exception("error while serving %s %s", request.method, request.path)
        return _error(500, f"{type(exc).__name__}: {exc}")


async def _json_body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json(loads=json.loads)
    except json.JSONDecodeError as exc:
        raise ProtocolError(400, f"the body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ProtocolError(400, "the request body must be a JSON object")
    return body


@dataclass(frozen=True)
class ServedModel:
    """What reading a generation request and writing its answer needs to know of the served model."""

    name: str
    max_model_len: int
    max_logprobs: int
    vocab_size: int
    tokenizer: PreTrainedTokenizerBase | None

    @classmethod
    def of(cls, state: ServerState) -> ServedModel:
        return cls(
            name=state.model_name,
            max_model_len=state.max_model_len,
            max_logprobs=state.config.max_logprobs,
            vocab_size=state.vocab_size,
            tokenizer=state.tokenizer,
        )


Generate = Callable[[CompletionRequest], Awaitable[GenerationOutput]]


def generation_routes(served: ServedModel, generated: Generate) -> list[web.RouteDef]:
    """/v1/completions and /inference/v1/generate: parse, run through `generated`, write the answer.

    The engine's own process passes a `generated` that submits to the engine; an API server process
    (`api_servers.py`) one that forwards to the engine's process.
    """

    limits = {
        "max_model_len": served.max_model_len,
        "max_logprobs": served.max_logprobs,
        "vocab_size": served.vocab_size,
    }

    async def completions(request: web.Request) -> web.Response:
        parsed = parse_completion_request(await _json_body(request), tokenizer=served.tokenizer, **limits)
        result = await generated(parsed)
        body = completion_response(
            parsed, result, model_name=parsed.model or served.name, tokenizer=served.tokenizer
        )
        return web.json_response(body)

    async def generate(request: web.Request) -> web.Response:
        parsed = parse_generate_request(await _json_body(request), **limits)
        result = await generated(parsed)
        return web.json_response(generate_response(parsed, result, model_name=parsed.model or served.name))

    return [web.post(GENERATION_ROUTES[0], completions), web.post(GENERATION_ROUTES[1], generate)]


def timed_routes(durations: dict[str, Histogram]) -> Callable[..., Awaitable[web.StreamResponse]]:
    """A middleware observing how long each POST to a route in `durations` took, answered or failed."""

    @web.middleware
    async def timed(request: web.Request, handler: Handler) -> web.StreamResponse:
        histogram = durations.get(request.path) if request.method == "POST" else None
        if histogram is None:
            return await handler(request)
        started = time.perf_counter()
        try:
            return await handler(request)
        finally:
            histogram.observe(time.perf_counter() - started)

    return timed


def build_app(state: ServerState) -> web.Application:
    """The aiohttp application serving `state`."""
    durations = {route: Histogram(REQUEST_LATENCY_BUCKETS_S) for route in GENERATION_ROUTES}
    app = web.Application(middlewares=[timed_routes(durations), errors_as_json], client_max_size=64 * 2**20)
    app[_STATE] = state
    started_at = int(time.time())

    async def run_on_engine(fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(state.engine.call(fn))

    async def health(request: web.Request) -> web.Response:
        error = state.engine.error
        if error is not None:
            return _error(500, f"the generation engine died: {error!r}")
        return web.Response(status=200)

    async def models(request: web.Request) -> web.Response:
        cards = [
            model_card(
                state.model_name,
                root=state.config.model,
                parent=None,
                max_model_len=state.max_model_len,
                created=started_at,
            )
        ]
        for adapter in list(state.lora.adapters.values()):
            cards.append(
                model_card(
                    adapter.name,
                    root=adapter.path,
                    parent=state.model_name,
                    max_model_len=state.max_model_len,
                    created=started_at,
                )
            )
        return web.json_response(models_response(cards))

    async def generated(parsed: CompletionRequest) -> GenerationOutput:
        """Run one parsed request on the engine (its adapter, when it names one) and wait for it."""
        adapter = state.adapter_for(parsed.model)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[GenerationOutput | BaseException] = loop.create_future()

        def resolve(result: GenerationOutput | BaseException) -> None:
            if not done.done():
                done.set_result(result)

        def on_done(result: GenerationOutput | BaseException) -> None:
            # Called on the engine thread; a loop already closed (server stopping) has no one to tell.
            if not loop.is_closed():
                loop.call_soon_threadsafe(resolve, result)

        request_id = state.engine.submit(parsed.prompt_ids, parsed.params, on_done, adapter=adapter)
        try:
            result = await done
        except asyncio.CancelledError:
            state.engine.abort(request_id)  # the client went away: free the row now
            raise
        if isinstance(result, BaseException):
            raise result
        return result

    async def metrics(request: web.Request) -> web.Response:
        text = render_metrics(
            state.engine.stats(),
            model_name=state.model_name,
            max_model_len=state.max_model_len,
            http_durations={route: histogram.snapshot() for route, histogram in durations.items()},
        )
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def pause(request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in ("keep", "wait", "abort"):
            raise ProtocolError(400, f"mode must be keep, wait or abort, got {mode!r}", "mode")
        await asyncio.wrap_future(state.engine.pause(mode))  # type: ignore[arg-type]
        return web.json_response({"status": "paused"})

    async def resume(request: web.Request) -> web.Response:
        await asyncio.wrap_future(state.engine.resume())
        return web.json_response({"status": "resumed"})

    async def is_paused(request: web.Request) -> web.Response:
        return web.json_response({"is_paused": state.engine.is_paused})

    async def server_info(request: web.Request) -> web.Response:
        lora_config = (
            {"max_lora_rank": state.config.max_lora_rank, "max_loras": state.config.max_loras}
            if state.config.enable_lora
            else None
        )
        return web.json_response(
            {
                "server": "agent-harness built-in",
                "version": __version__,
                "vllm_config": {
                    "model_config": {
                        "model": state.config.model,
                        "served_model_name": state.model_name,
                        "dtype": str(state.model.dtype),
                        "max_model_len": state.max_model_len,
                        "max_logprobs": state.config.max_logprobs,
                        "logprobs_mode": "processed_logprobs",
                        "return_sampling_mask": True,  # on /inference/v1/generate
                    },
                    "lora_config": lora_config,
                    "parallel_config": {
                        "data_parallel_size": 1,
                        "tensor_parallel_size": 1,
                        "pipeline_parallel_size": 1,
                    },
                    "device_config": {"device": str(state.model.device)},
                },
                "cuda_device_uuids": visible_device_uuids(),  # GPUs whose IPC buffers it can open
            }
        )

    async def world_size(request: web.Request) -> web.Response:
        return web.json_response({"world_size": 1})

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": f"agent-harness-{__version__}"})

    async def reset_prefix_cache(request: web.Request) -> web.Response:
        await run_on_engine(state.engine.reset_prefix_cache)
        return web.Response(status=200)

    async def init_weight_transfer_engine(request: web.Request) -> web.Response:
        from harness.weight_sync.wire import BroadcastGroup

        info = (await _json_body(request)).get("init_info")
        if not isinstance(info, dict):
            raise ProtocolError(400, "init_weight_transfer_engine needs an init_info object", "init_info")
        try:
            address, port = str(info["master_address"]), int(info["master_port"])
            rank, size = int(info.get("rank_offset", 1)), int(info["world_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(
                400, f"init_info needs master_address, master_port and world_size: {exc}"
            ) from exc
        backend = info.get("backend") or ("nccl" if state.model.device.type == "cuda" else "gloo")
        if state.transfer_group is not None:
            state.transfer_group.close()
            state.transfer_group = None
        device = state.model.device

        def connect() -> BroadcastGroup:
            return BroadcastGroup.connect(
                master_address=address,
                master_port=port,
                rank=rank,
                world_size=size,
                backend=backend,
                device=device if backend == "nccl" else None,
            )

        # Blocks until the trainer joins (it runs its side concurrently), so not on the engine thread.
        state.transfer_group = await asyncio.to_thread(connect)
        return web.json_response({"status": "ok", "rank": rank, "backend": backend})

    async def start_weight_update(request: web.Request) -> web.Response:
        await _json_body(request)
        state.extra["weight_update_in_progress"] = True
        return web.json_response({"status": "ok"})

    async def update_weights(request: web.Request) -> web.Response:
        info = (await _json_body(request)).get("update_info")
        if not isinstance(info, dict):
            raise ProtocolError(400, "update_weights needs an update_info object", "update_info")
        manifest = WeightManifest.from_update_info(info)
        path = info.get("path")
        ipc = info.get("ipc")
        # Which weights a delta applies to (harness/weight_sync/deltas.py): the token of the last update
        # applied whole, kept only until the next update starts, so a failed one leaves none.
        held_token = state.extra.pop("weights_token", None)
        delta_base = info.get("delta_base")
        if ipc is not None:
            if not isinstance(ipc, dict) or not isinstance(ipc.get("offsets"), list):
                raise ProtocolError(400, "update_info.ipc needs a buffer handle and offsets", "update_info")

            def apply_ipc() -> int:
                import torch

                from harness.weight_sync.cuda_ipc import IpcError, open_buffer, tensors_in

                check_manifest(state.model, manifest)
                try:
                    buffer = open_buffer(ipc.get("buffer"))
                    count = copy_into_model(state.model, tensors_in(buffer, manifest, ipc["offsets"]))
                except (IpcError, RuntimeError) as exc:
                    raise WeightTransferError(f"could not read the trainer's CUDA buffer: {exc}") from exc
                torch.cuda.synchronize(buffer.device)  # copied out before the trainer reuses the buffer
                return count

            count = await run_on_engine(apply_ipc)
        elif path is not None:
            if not Path(path).is_file():
                raise WeightTransferError(f"weights file {path} does not exist (is it on this host?)")

            def apply_file() -> int:
                check_manifest(state.model, manifest)
                return copy_into_model(state.model, read_weights_file(path, manifest))

            count = await run_on_engine(apply_file)
        else:
            group = state.transfer_group
            if group is None:
                raise ProtocolError(
                    400,
                    "no weight-transfer group: call /init_weight_transfer_engine first, or send a file path",
                )
            buffer_size = int(info.get("buffer_size_bytes") or DEFAULT_BUFFER_SIZE_BYTES)

            as_delta = delta_base is not None

            def apply_broadcast() -> int:
                try:
                    check_manifest(state.model, manifest)
                    if as_delta and delta_base != held_token:
                        raise WeightDeltaError(
                            f"a weight delta against weights {delta_base!r}, but this server holds "
                            f"{held_token!r} (restarted, or an update failed since): send the weights whole"
                        )
                except WeightTransferError:
                    for _ in group.receive(manifest, buffer_size, as_delta=as_delta):
                        pass  # drain the trainer's broadcast so the group stays usable, then report
                    raise
                return copy_into_model(state.model, group.receive(manifest, buffer_size, as_delta=as_delta))

            count = await run_on_engine(apply_broadcast)
            if isinstance(info.get("token"), str):
                state.extra["weights_token"] = info["token"]
        return web.json_response({"status": "ok", "num_tensors": count})

    async def finish_weight_update(request: web.Request) -> web.Response:
        def finish() -> None:
            state.engine.invalidate_cache()
            state.engine.bump_weight_version()

        await run_on_engine(finish)
        state.extra["weight_update_in_progress"] = False
        return web.json_response({"status": "ok", "weight_version": state.engine.stats().weight_version})

    async def load_lora_adapter(request: web.Request) -> web.Response:
        if not state.config.enable_lora:
            raise ProtocolError(404, "runtime LoRA loading is off: start the server with --enable-lora")
        body = await _json_body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str):
            raise ProtocolError(400, "load_lora_adapter needs lora_name and lora_path strings")
        if name == state.model_name:
            raise ProtocolError(400, f"{name!r} is the base model's name", "lora_name")

        def load() -> None:
            if body.get("load_inplace") and name in state.lora.adapters:
                state.lora.unload(name)
            state.lora.load(name, path)

        await run_on_engine(load)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(request: web.Request) -> web.Response:
        if not state.config.enable_lora:
            raise ProtocolError(404, "runtime LoRA loading is off: start the server with --enable-lora")
        name = (await _json_body(request)).get("lora_name")
        if name not in state.lora.adapters:
            raise ProtocolError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        await run_on_engine(lambda: state.lora.unload(name))
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    app.add_routes(generation_routes(ServedModel.of(state), generated))
    app.add_routes(
        [
            web.get("/health", health),
            web.get("/v1/models", models),
            web.get("/metrics", metrics),
            web.post("/pause", pause),
            web.post("/resume", resume),
            web.get("/is_paused", is_paused),
            web.get("/server_info", server_info),
            web.get("/get_world_size", world_size),
            web.get("/version", version),
            web.post("/reset_prefix_cache", reset_prefix_cache),
            web.post("/init_weight_transfer_engine", init_weight_transfer_engine),
            web.post("/start_weight_update", start_weight_update),
            web.post("/update_weights", update_weights),
            web.post("/finish_weight_update", finish_weight_update),
            web.post("/v1/load_lora_adapter", load_lora_adapter),
            web.post("/v1/unload_lora_adapter", unload_lora_adapter),
        ]
    )
    return app


async def _start(state: ServerState, host: str, port: int) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(build_app(state), handler_cancellation=True, access_log=None)
    await runner.setup()
    # A deep accept backlog: hundreds of rollouts connect at once when a run starts.
    site = web.TCPSite(runner, host, port, backlog=4096)
    await site.start()
    bound_port = int(runner.addresses[0][1])
    return runner, bound_port


async def _stop(state: ServerState, runner: web.AppRunner, api_servers: ApiServers | None = None) -> None:
    await asyncio.to_thread(state.engine.close)
    if api_servers is not None:
        await asyncio.to_thread(api_servers.close)
    await runner.cleanup()
    state.close()


def serve(config: ServerConfig) -> int:
    """Run a server in the foreground until SIGINT / SIGTERM (or the parent's death with exit_with_parent).

    With API server processes (`api_server_count` >= 1), the engine's own HTTP server listens on a free
    port of 127.0.0.1 and the API servers on config.host:config.port (`api_servers.py`).
    """
    parent_pid = os.getppid()
    if config.switch_interval_ms is not None:
        sys.setswitchinterval(config.switch_interval_ms / 1000)
    state = ServerState.load(config)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        count = config.api_server_count
        api_servers: ApiServers | None = None
        if count:
            runner, backend_port = await _start(state, "127.0.0.1", 0)

            def stop_soon() -> None:  # an API server died: called from its bridge's thread
                loop.call_soon_threadsafe(stop.set)

            def start_api_servers() -> ApiServers:
                return ApiServers.start(
                    state,
                    host=config.host,
                    port=config.port,
                    count=count,
                    backend_url=f"http://127.0.0.1:{backend_port}",
                    on_lost=stop_soon,
                )

            try:
                started = await asyncio.to_thread(start_api_servers)
            except BaseException:
                await _stop(state, runner)
                raise
            api_servers, port = started, started.port
        else:
            runner, port = await _start(state, config.host, config.port)
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        if config.port_file:
            partial = Path(config.port_file + ".partial")
            partial.write_text(str(port))
            partial.replace(config.port_file)  # atomic: a reader never sees a half-written port
        fronts = f" ({count} API server process{'es' if count > 1 else ''})" if count else ""
        print(f"harness serve: {state.model_name} on http://{config.host}:{port}{fronts}", flush=True)

        async def watch_parent() -> None:
            while os.getppid() == parent_pid:
                await asyncio.sleep(1.0)
            logger.warning("the process that started this server is gone; stopping")
            stop.set()

        watcher = asyncio.create_task(watch_parent()) if config.exit_with_parent else None
        try:
            await stop.wait()
        finally:
            if watcher is not None:
                watcher.cancel()
            await _stop(state, runner, api_servers)
        if api_servers is not None and api_servers.lost is not None:
            raise SystemExit(f"harness serve: {api_servers.lost}")

    try:
        asyncio.run(main())
    finally:
        state.close()
    return 0


class EmbeddedServer:
    """A built-in server on a background thread of this process, for tests, benchmarks and notebooks.

    Usage:
        with EmbeddedServer(ServerState.from_model(model, ServerConfig(model="tiny"))) as server:
            client = GenerationClient(server.base_url)
            ...

    Args:
        state: What to serve; closed by `stop()`.
        host, port: Where to listen (port 0: a free one).
    """

    def __init__(self, state: ServerState, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.state = state
        self.host = host
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._stopped = False

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> EmbeddedServer:
        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._runner, self.port = loop.run_until_complete(_start(self.state, self.host, self.port))
            except BaseException as exc:
                self._startup_error = exc
                self._ready.set()
                loop.close()
                return
            self._ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="harness-embedded-server", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            self.state.close()
            raise self._startup_error
        return self

    def stop(self) -> None:
        """Stop serving and close the state (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        loop, runner = self._loop, self._runner
        if loop is not None and runner is not None and self._thread is not None and self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(_stop(self.state, runner), loop).result()
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join()
        self.state.close()

    def __enter__(self) -> EmbeddedServer:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
