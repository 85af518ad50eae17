"""The built-in generation server: vLLM's HTTP protocol over a transformers model on CPU or one GPU.

The embedded default for one machine, tests and first runs; production runs point the trainer at a vLLM
server instead, and the same client (`harness.generation.client.GenerationClient`) drives both.

    cli.py       `harness serve MODEL` flags, and `python -m harness.server`
    launch.py    start it as a subprocess, wait for /health, stop it (what the trainer uses)
    app.py       the HTTP routes (aiohttp), `serve` in the foreground, `EmbeddedServer` on a thread
    protocol.py  vLLM's JSON shapes in and out
    state.py     settings (`ServerConfig`) and the loaded model, engine and adapters
    engine.py    continuous batching on the engine thread
    kv_cache.py  the KV cache and the attention function transformers calls
    sampling.py  per-request sampling, processed log-probs, seeds
    lora.py      LoRA adapters applied per request
    metrics.py   /metrics under vLLM's metric names

Names are imported lazily, so importing this package (as `harness --help` does) loads neither torch nor
aiohttp.
"""

from harness._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "BuiltinServer": "harness.server.launch",
    "EmbeddedServer": "harness.server.app",
    "Engine": "harness.server.engine",
    "SamplingParams": "harness.server.sampling",
    "ServerConfig": "harness.server.state",
    "ServerStartError": "harness.server.launch",
    "ServerState": "harness.server.state",
    "open_generation_server": "harness.server.launch",
    "serve": "harness.server.app",
    "start_builtin_server": "harness.server.launch",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
