"""The client side of generation: how the rollout worker and the trainer talk to generation servers.

    client.py         GenerationClient: vLLM's HTTP protocol (token-id completions with log-probs, control
                      routes, LoRA adapters), retries on transient errors, typed errors
    client_thread.py  ClientThread: a GenerationClient on a thread of its own, for the trainer's sync code
    server_load.py    a server's load from its Prometheus /metrics (what the concurrency cap reads)

Who talks to it: harness/rollout/ samples through GenerationClient; harness/training/ and harness/weight_sync/
drive pause, resume and weight updates through ClientThread. The servers are vLLM or harness/server/.
"""

from harness._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "ClientThread": "harness.generation.client_thread",
    "Completion": "harness.generation.client",
    "GenerationClient": "harness.generation.client",
    "GenerationError": "harness.generation.client",
    "ModelInfo": "harness.generation.client",
    "SamplingConfig": "harness.generation.client",
    "ServerLoad": "harness.generation.server_load",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
